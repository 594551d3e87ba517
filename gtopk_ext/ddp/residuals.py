"""Per-bucket residuals of the DDP hook that follow the parameters when DDP changes its buckets."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

# (parameter ordinal, numel) of each parameter of a bucket, in the bucket's order; None for a bare tensor.
Layout = Union[tuple[tuple[int, int], ...], None]


class ResidualStore:
    """Per-bucket error-feedback residuals that follow the parameters when DDP changes its buckets.

    Fields: ``residuals`` (per bucket index, the flat residual in that bucket's layout), ``layouts`` (the latest
    layout of every bucket seen), ``unclaimed`` (residual parts per parameter ordinal, left by a bucket whose
    layout changed, until a bucket that holds the parameter takes them), ``restored`` (loaded from a state_dict
    and no iteration ended since), and the parameters' ordinals (in the order this process first saw them: the
    same on every rank and in a resumed process).
    """

    def __init__(self):
        self.residuals: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, Layout] = {}
        self.unclaimed: dict[int, torch.Tensor] = {}
        self.restored = False
        self._ordinals = WeakIdKeyDictionary()
        self._next_ordinal = 0

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

    def knows(self, parameter: torch.Tensor) -> bool:
        """Whether a bucket of this store held ``parameter``."""
        return parameter in self._ordinals

    def knows_parameters(self) -> bool:
        """Whether a bucket with parameters has been seen (in this process)."""
        return self._next_ordinal > 0

    def checkpoint_parts(self, index: int, layout: Layout) -> Optional[list[tuple[int, Layout]]]:
        """The known buckets that this new bucket is exactly made of.

        A fresh DDP model reduces its first iteration in one bucket; after a resume, reducing it in the
        checkpoint's buckets instead keeps the run bitwise identical to one that never stopped (also when no
        residual exists yet: the selection per bucket differs from the selection over their union). Only in the
        first iteration after a restore: a run's own new layout (DDP's rebuilt buckets) is recorded instead, so
        that no later step pays for reducing in parts."""
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
        """A bucket changed: its residual and every one that shares a parameter with it go to per-parameter parts,
        from which each bucket assembles its residual again on its next compressed step."""
        previous = self.layouts.get(index)
        if index in self.layouts and previous == layout:
            return
        self.layouts[index] = layout
        if layout is None:
            return
        changed = {o for o, _ in layout}
        for i in list(self.residuals):
            old_layout = previous if i == index else self.layouts.get(i)
            if old_layout is not None and (i == index or changed & {o for o, _ in old_layout}):
                residual, offset = self.residuals.pop(i), 0
                for ordinal, numel in old_layout:
                    self.unclaimed[ordinal] = residual[offset:offset + numel]
                    offset += numel

    def holds_any(self, index: int, layout: Layout) -> bool:
        return index in self.residuals or any(o in self.unclaimed for o, _ in layout or ())

    def residual(self, index: int, tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The bucket's residual (assembled from unclaimed parts, or zeros, when it has none in its layout)."""
        residual = self.residuals.get(index)
        if residual is not None and residual.numel() == tensor.numel() and residual.dtype == tensor.dtype:
            if residual.device != tensor.device:
                residual = self.residuals[index] = residual.to(tensor.device)
            return residual
        if residual is not None and bool(residual.any()):
            logger.warning("sparse_grad_hook: bucket %d changed from %d to %d elements without parameters to follow; "
                           "its residual is dropped", index, residual.numel(), tensor.numel())
        residual = torch.zeros_like(tensor)
        offset = 0
        for ordinal, numel in layout or ():
            part = self.unclaimed.pop(ordinal, None)
            if part is not None:
                residual[offset:offset + numel] = part.to(residual.device)
            offset += numel
        self.residuals[index] = residual
        return residual

    def __getstate__(self):
        """Without the parameter identities of this process."""
        return {"residuals": self.residuals, "layouts": self.layouts, "unclaimed": self.unclaimed}

    def __setstate__(self, state):
        self.__init__()
        self.__dict__.update(state)
        self.restored = True

    def all_tensors(self) -> list[torch.Tensor]:
        return [*self.residuals.values(), *self.unclaimed.values()]

    def state_dict(self) -> dict:
        return {"residuals": {index: r.detach().clone() for index, r in self.residuals.items()},
                "layouts": {index: None if layout is None else [list(p) for p in layout]
                            for index, layout in self.layouts.items()},
                "unclaimed": {ordinal: r.detach().clone() for ordinal, r in self.unclaimed.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.residuals = {int(i): r.detach().clone() for i, r in state_dict["residuals"].items()}
        self.layouts = {int(i): None if layout is None else tuple((int(o), int(n)) for o, n in layout)
                        for i, layout in state_dict.get("layouts", {}).items()}
        self.unclaimed = {int(o): r.detach().clone() for o, r in state_dict.get("unclaimed", {}).items()}
        self.restored = True

    def add_state_dict(self, state_dict: dict) -> None:
        """Adds another store's saved residuals to these (another rank's, folded in at another world size): DDP
        gives every rank the same buckets, so their layouts must agree."""
        other = ResidualStore()
        other.load_state_dict(state_dict)
        self.restored = True
        for index, layout in other.layouts.items():
            if self.layouts.setdefault(index, layout) != layout:
                raise ValueError(f"the state_dicts hold bucket {index} in different layouts: they were saved by "
                                 f"different models")
        for mine, theirs in ((self.residuals, other.residuals), (self.unclaimed, other.unclaimed)):
            for key, residual in theirs.items():
                if key in mine and mine[key].shape != residual.shape:
                    raise ValueError(f"the state_dicts hold residuals of {mine[key].numel()} and "
                                     f"{residual.numel()} elements for the same bucket or parameter ({key})")
                mine[key] = mine[key] + residual if key in mine else residual


def hold_unused(residual: torch.Tensor, maxima: list[float], layout: Layout,
                 zero: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Save (and ``zero``, for the selection) the part of each parameter whose gradient is all zero (unused by
    this rank); returns (part, saved copy) pairs to restore afterwards."""
    if layout is None:
        return []
    held, offset = [], 0
    for (_, numel), largest in zip(layout, maxima):
        if largest == 0 and numel:
            part = residual[offset:offset + numel]
            held.append((part, part.clone()))
            if zero:
                part.zero_()
        offset += numel
    return held
