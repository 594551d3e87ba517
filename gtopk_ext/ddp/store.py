"""The DDP hook's per-bucket tensors (the residual; with momentum correction the velocity), which follow the
parameters when DDP changes its buckets."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gtopk_ext.reduction import Memory

logger = logging.getLogger(__name__)

# (parameter ordinal, numel) of each parameter of a bucket, in the bucket's order; None for a bare tensor.
Layout = Union[tuple[tuple[int, int], ...], None]
KINDS = ("residual", "velocity")


class BucketStore:
    """Per-bucket tensors by kind that follow the parameters when DDP changes its buckets: ``tensors`` (per kind,
    per bucket index, the flat tensor in that bucket's layout; ``residuals`` is ``tensors["residual"]``),
    ``unclaimed`` (per kind and parameter ordinal, the parts a bucket whose layout changed left, until a bucket that
    holds the parameter takes them), ``layouts`` (every bucket's latest), ``restored`` (loaded, and no iteration
    ended since), and the parameters' ordinals (in the order this process first saw them: the same on every rank
    and in a resumed process)."""

    def __init__(self):
        self.tensors: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in KINDS}
        self.unclaimed: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in KINDS}
        self.layouts: dict[int, Layout] = {}
        self.restored = False
        self._ordinals = WeakIdKeyDictionary()
        self._next_ordinal = 0

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        return self.tensors["residual"]

    def layout_of(self, parameters: Optional[Sequence[torch.Tensor]], numel: int) -> Layout:
        if parameters is None:
            return None
        layout = []
        for p in parameters:
            ordinal = self._ordinals.get(p)
            if ordinal is None:
                ordinal = self._ordinals[p] = self._next_ordinal
                self._next_ordinal += 1
            layout.append((ordinal, p.numel()))
        if sum(n for _, n in layout) != numel:
            raise ValueError(f"parameters hold {sum(n for _, n in layout)} elements, the bucket {numel}")
        return tuple(layout)

    def parameter_ids(self) -> Optional[set[int]]:
        """The ids of the parameters a bucket of this store held; None before any (the optimizer check waits)."""
        return {id(p) for p in self._ordinals.keys()} if self._next_ordinal else None

    def checkpoint_parts(self, index: int, layout: Layout) -> Optional[list[tuple[int, Layout]]]:
        """The known buckets that this new bucket is exactly made of, in the first iteration after a restore: a
        fresh DDP model's first iteration in one bucket, reduced in the checkpoint's buckets instead, keeps the
        run bitwise identical to one that never stopped (the selection per bucket differs from that over their
        union). A run's own new layout (DDP's rebuilt buckets) is recorded instead: no later step pays for parts."""
        if not self.restored or layout is None or self.layouts.get(index) == layout:
            return None
        numels = dict(layout)
        parts = [(i, known) for i, known in sorted(self.layouts.items())
                 if known and all(numels.get(o) == n for o, n in known)]
        covered = [o for _, known in parts for o, _ in known]
        if sorted(covered) != sorted(numels):
            return None
        return parts

    def record(self, index: int, layout: Layout) -> None:
        """A bucket changed: its tensors and every one that shares a parameter with it go to per-parameter parts,
        from which each bucket assembles its tensors again when it next needs them."""
        previous = self.layouts.get(index)
        if index in self.layouts and previous == layout:
            return
        self.layouts[index] = layout
        if layout is None:
            return
        changed = {o for o, _ in layout}
        for kind, tensors in self.tensors.items():
            for i in list(tensors):
                old_layout = previous if i == index else self.layouts.get(i)
                if old_layout is not None and (i == index or changed & {o for o, _ in old_layout}):
                    tensor, offset = tensors.pop(i), 0
                    for ordinal, numel in old_layout:
                        self.unclaimed[kind][ordinal] = tensor[offset:offset + numel]
                        offset += numel

    def get(self, kind: str, index: int, like: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The bucket's tensor of ``kind``; assembled from unclaimed parts, or zeros, when none is in its layout."""
        tensors = self.tensors[kind]
        tensor = tensors.get(index)
        if tensor is not None and tensor.numel() == like.numel() and tensor.dtype == like.dtype:
            if tensor.device != like.device:
                tensor = tensors[index] = tensor.to(like.device)
            return tensor
        if tensor is not None and bool(tensor.any()):
            logger.warning("sparse_grad_hook: bucket %d changed from %d to %d elements without parameters to follow; "
                           "its %s is dropped", index, tensor.numel(), like.numel(), kind)
        tensor = torch.zeros_like(like)
        offset = 0
        for ordinal, numel in layout or ():
            part = self.unclaimed[kind].pop(ordinal, None)
            if part is not None:
                tensor[offset:offset + numel] = part.to(tensor.device)
            offset += numel
        tensors[index] = tensor
        return tensor

    def __getstate__(self):
        """Without the parameter identities of this process."""
        return {"tensors": self.tensors, "layouts": self.layouts, "unclaimed": self.unclaimed}

    def __setstate__(self, state):
        self.__init__()
        self.__dict__.update(state)
        self.restored = True

    def state_dict(self) -> dict:
        """``{"residuals", "layouts", "unclaimed", "velocities": {"residuals", "unclaimed"}}`` (copies)."""
        def copies(tensors: dict) -> dict:
            return {key: t.detach().clone() for key, t in tensors.items()}

        return {"residuals": copies(self.tensors["residual"]), "unclaimed": copies(self.unclaimed["residual"]),
                "layouts": {index: None if layout is None else [list(p) for p in layout]
                            for index, layout in self.layouts.items()},
                "velocities": {"residuals": copies(self.tensors["velocity"]),
                               "unclaimed": copies(self.unclaimed["velocity"])}}

    def load_state_dict(self, state_dict: dict) -> None:
        velocities = state_dict.get("velocities", {})
        for kind, saved in (("residual", state_dict), ("velocity", velocities)):
            self.tensors[kind] = {int(i): t.detach().clone() for i, t in saved.get("residuals", {}).items()}
            self.unclaimed[kind] = {int(o): t.detach().clone() for o, t in saved.get("unclaimed", {}).items()}
        self.layouts = {int(i): None if layout is None else tuple((int(o), int(n)) for o, n in layout)
                        for i, layout in state_dict.get("layouts", {}).items()}
        self.restored = True

    def add_residuals(self, state_dict: dict) -> None:
        """Adds another store's saved residuals to these (another rank's, folded in at another world size): DDP
        gives every rank the same buckets, so their layouts must agree."""
        other = BucketStore()
        other.load_state_dict({key: state_dict.get(key, {}) for key in ("residuals", "layouts", "unclaimed")})
        self.restored = True
        for index, layout in other.layouts.items():
            if self.layouts.setdefault(index, layout) != layout:
                raise ValueError(f"the state_dicts hold bucket {index} in different layouts: they were saved by "
                                 f"different models")
        for mine, theirs in ((self.tensors["residual"], other.tensors["residual"]),
                             (self.unclaimed["residual"], other.unclaimed["residual"])):
            for key, residual in theirs.items():
                if key in mine and mine[key].shape != residual.shape:
                    raise ValueError(f"the state_dicts hold residuals of {mine[key].numel()} and "
                                     f"{residual.numel()} elements for the same bucket or parameter ({key})")
                mine[key] = mine[key] + residual if key in mine else residual


class BucketMemory(Memory):
    """One bucket's tensors in a :class:`BucketStore`, for the reduction (:class:`gtopk_ext.reduction.Memory`)."""

    def __init__(self, store: BucketStore, index: int, like: torch.Tensor, layout: Layout):
        self.store, self.index, self.like, self.layout = store, index, like, layout

    def get(self, kind: str) -> torch.Tensor:
        return self.store.get(kind, self.index, self.like, self.layout)

    def held(self, kind: str) -> Optional[torch.Tensor]:
        unclaimed = self.store.unclaimed[kind]
        holds = self.index in self.store.tensors[kind] or any(o in unclaimed for o, _ in self.layout or ())
        return self.get(kind) if holds else None

    def forget(self, kind: str) -> None:
        del self.store.tensors[kind][self.index]
