"""Compressors: a dense gradient (+ error-feedback residual) -> a fixed-size sparse message.

Every compressor keeps exactly ``k = ceil(density * numel)`` slots. With a residual, ``compress`` leaves
``residual == grad + old_residual - msg.to_dense()`` (error feedback); ``residual=None`` compresses ``grad`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gtopk_ext import ops
from gtopk_ext._contract import FLOAT_DTYPES
from gtopk_ext._validate import check_number
from gtopk_ext.backends import Backend, BackendChoice, BackendLike
from gtopk_ext.message import SparseMessage

COMPRESSOR_KINDS = ("gaussiank", "topk", "randomk", "chunktopk")
GAUSSIANK_MODES = ("accurate", "paper")


def k_for_density(density: float, numel: int) -> int:
    """``ceil(density * numel)`` clamped to [1, numel]; float noise below 1e-6 (0.07 * 100) is not rounded up."""
    if not (isinstance(density, float) and 0.0 < density <= 1.0):  # the full check only then: this runs per step
        check_density(density)
    return max(1, min(numel, math.ceil(round(density * numel, 6))))


def tensor_shares(k: int, numels: Sequence[int]) -> list[int]:
    """``k`` slots split over tensors of ``numels`` elements (``k <= sum(numels)``): in proportion to their sizes
    (largest remainders first), at least one each while k allows, never more than a tensor holds; they sum to k."""
    exact = [k * n / sum(numels) for n in numels]
    least = 1 if k >= len(numels) else 0
    shares = [min(n, max(least, int(e))) for n, e in zip(numels, exact)]
    while sum(shares) < k:
        grow = max((i for i, n in enumerate(numels) if shares[i] < n), key=lambda i: exact[i] - shares[i])
        shares[grow] += 1
    while sum(shares) > k:
        shrink = min((i for i in range(len(numels)) if shares[i] > least), key=lambda i: exact[i] - shares[i])
        shares[shrink] -= 1
    return shares


def check_density(density: float, name: str = "density") -> None:
    check_number(name, density, 0.0, 1.0, low_open=True)


class Compressor:
    """Base class: ``compress(grad, residual=None, *, step=None) -> SparseMessage``.

    ``step`` makes randomized kinds draw the same indices on every rank. ``backend`` (a name, a
    :class:`gtopk_ext.backends.Backend` or None for ``$GTOPK_EXT_BACKEND``) runs every op of the compressor and of
    the collectives that reduce its messages. ``per_tensor``: select within each parameter of a bucket, each with
    its share of k (:func:`tensor_shares`). ``options``: the keyword arguments it was made with.
    """

    kind = ""

    def __init__(self, density: float, *, backend: BackendLike = None, per_tensor: bool = False):
        check_density(density)
        if not isinstance(per_tensor, bool):
            raise TypeError(f"per_tensor must be a bool, got {per_tensor!r}")
        self.density = float(density)
        self.backend = BackendChoice(backend)
        self.per_tensor = per_tensor
        self.options: dict = {"backend": backend, "per_tensor": per_tensor}

    def with_density(self, density: float) -> "Compressor":
        """A compressor of the same kind and options at ``density`` (this one when it is at it already)."""
        return self if density == self.density else type(self)(density, **self.options)

    def k_for(self, numel: int) -> int:
        return k_for_density(self.density, numel)

    def compress(self, grad: torch.Tensor, residual: torch.Tensor | None = None, *,
                 step: int | None = None, k: int | None = None) -> SparseMessage:
        """``k``: the message's slots (default ``ceil(density * numel)``; the hook's per-tensor shares set it)."""
        if not isinstance(grad, torch.Tensor) or grad.dtype not in FLOAT_DTYPES:
            raise TypeError(f"grad must be a float32, float16 or bfloat16 tensor, got "
                            f"{grad.dtype if isinstance(grad, torch.Tensor) else type(grad).__name__}")
        if grad.numel() == 0:
            raise ValueError("grad must have at least one element")
        if residual is not None and (residual.shape != grad.shape or residual.dtype != grad.dtype
                                     or residual.device != grad.device or not residual.is_contiguous()):
            raise ValueError(f"residual must be a contiguous tensor of grad's shape {tuple(grad.shape)}, dtype "
                             f"{grad.dtype} and device {grad.device}, got shape {tuple(residual.shape)}, dtype "
                             f"{residual.dtype}, device {residual.device}, contiguous={residual.is_contiguous()}")
        flat_grad = grad.detach().reshape(-1)
        backend = self.backend[flat_grad.device]
        if k is None:
            k = self.k_for(flat_grad.numel())
        elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= flat_grad.numel():
            raise ValueError(f"k must be an int in [1, numel = {flat_grad.numel()}], got {k!r}")
        return self._compress(flat_grad, residual.view(-1) if residual is not None else None, k, step, backend)

    def _compress(self, grad: torch.Tensor, residual: torch.Tensor | None, k: int, step: int | None,
                  backend: Backend) -> SparseMessage:
        """The k slots of :meth:`_indices` of acc = grad + residual (kept in the residual, less what is sent)."""
        acc = residual.add_(grad) if residual is not None else grad
        indices = self._indices(acc, k, step)
        count = torch.full((1,), k, dtype=torch.int32, device=acc.device)
        return self._message(acc, residual, acc[indices.long()], indices, count, backend)

    def _indices(self, acc: torch.Tensor, k: int, step: int | None) -> torch.Tensor:
        """k distinct int32 indices of acc, ascending."""
        raise NotImplementedError

    def _message(self, acc: torch.Tensor, residual: torch.Tensor | None, values: torch.Tensor,
                 indices: torch.Tensor, count: torch.Tensor, backend: Backend,
                 stats: torch.Tensor | None = None) -> SparseMessage:
        if residual is not None:
            ops.residual_update_(residual, indices, values, backend=backend, check=False)
        return SparseMessage(values, indices, count, acc.numel(), stats)

    def __repr__(self) -> str:
        extra = "".join(f", {name}={value!r}" for name, value in self.options.items()
                        if name not in ("backend", "per_tensor"))
        return f"{type(self).__name__}(density={self.density}{extra})"


class GaussianK(Compressor):
    """Gaussian-k (Shi et al. 2019): a threshold from one statistics pass instead of a sort.

    ``mode="accurate"`` (default) selects with ``ops.gaussian_select`` (about k elements on any distribution);
    ``mode="paper"`` with ``|mean| + z * std`` and the paper's correction loop. Elements past k stay in the residual.
    """

    kind = "gaussiank"

    def __init__(self, density: float, *, mode: str = "accurate", backend: BackendLike = None,
                 per_tensor: bool = False):
        super().__init__(density, backend=backend, per_tensor=per_tensor)
        if mode not in GAUSSIANK_MODES:
            raise ValueError(f"mode must be one of {GAUSSIANK_MODES}, got {mode!r}")
        self.mode = mode
        self.options["mode"] = mode
        self.z = ops.z_for_density(self.density)

    def _compress(self, grad, residual, k, step, backend):
        acc = residual if residual is not None else grad
        if self.mode == "accurate":  # the selection and the residual's update in one op: no host sync, no sort
            values, indices, count, stats = ops.gaussian_select(grad, residual, z=self.z, k=k, capacity=k,
                                                                update_residual=True, backend=backend)
            return SparseMessage(values, indices, count, acc.numel(), stats)
        stats = ops.gaussian_threshold(grad, residual, z=self.z, k=0, backend=backend)
        threshold = stats[ops.STAT_GAUSSIAN_THRESHOLD:ops.STAT_GAUSSIAN_THRESHOLD + 1]
        # The paper's 3 correction steps: halve below 2k/3, x1.5 above 4k/3. Once the count is inside, the factor
        # is 1 and stays 1: that is the paper's early stop, without a host sync.
        magnitude = acc.float().abs()
        for _ in range(3):
            count = (magnitude >= threshold).sum()
            factor = torch.where(count < 2 * k / 3, 0.5, torch.where(count > 4 * k / 3, 1.5, 1.0))
            threshold = threshold * factor
        # The loop can end above every element (equal values: the deviation is 0 and the count jumps between
        # all and none): then the largest |acc| is sent rather than nothing, step after step.
        threshold = torch.minimum(threshold.float(), stats[ops.STAT_MAX_ABS:ops.STAT_MAX_ABS + 1])
        values, indices, count = ops.compact(acc, threshold, k, backend=backend)
        return self._message(acc, residual, values, indices, count, backend, stats)


class TopK(Compressor):
    """Exact top-k of |acc| (``torch.topk``): the baseline; indices re-sorted ascending."""

    kind = "topk"

    def _indices(self, acc, k, step):
        return torch.topk(acc.abs(), k, sorted=False).indices.sort().values.int()


class RandomK(Compressor):
    """k distinct random indices, drawn from a CPU generator seeded with ``seed + step``: the same on every rank
    that passes the same ``step`` (default: the number of earlier calls of this compressor)."""

    kind = "randomk"

    def __init__(self, density: float, *, seed: int = 0, backend: BackendLike = None, per_tensor: bool = False):
        super().__init__(density, backend=backend, per_tensor=per_tensor)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self.options["seed"] = seed
        self.calls = 0

    def _indices(self, acc, k, step):
        generator = torch.Generator().manual_seed(self.seed + (self.calls if step is None else step))
        self.calls += 1
        return torch.randperm(acc.numel(), generator=generator)[:k].sort().values.int().to(acc.device)


class ChunkTopK(Compressor):
    """Top-k within each ``chunk`` consecutive elements (SparseLoCo: 128 of every 4,096): every chunk gets
    ``k // chunks`` slots (the last, shorter chunk as many as it holds), so the message covers the whole tensor
    evenly; slots left over are padding. ``k = ceil(density * numel)`` must give each chunk at least one."""

    kind = "chunktopk"

    def __init__(self, density: float, *, chunk: int = 4096, backend: BackendLike = None, per_tensor: bool = False):
        super().__init__(density, backend=backend, per_tensor=per_tensor)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        if density * chunk < 1:
            raise ValueError(f"chunktopk sends k // chunks slots of each chunk: density x chunk must be >= 1, got "
                             f"{density!r} x {chunk} (raise the density or the chunk)")
        self.chunk = chunk
        self.options["chunk"] = chunk

    def _compress(self, grad, residual, k, step, backend):
        acc = residual.add_(grad) if residual is not None else grad
        numel = acc.numel()
        chunks = -(-numel // self.chunk)
        per_chunk = k // chunks
        if per_chunk < 1:
            raise ValueError(f"chunktopk: k = {k} slots cannot cover {chunks} chunks of {self.chunk} elements "
                             f"(numel {numel}): raise the density")
        magnitude = acc.detach().abs().float()
        padded = magnitude.new_full((chunks * self.chunk,), -1.0)  # never above a real element
        padded[:numel] = magnitude
        columns = torch.topk(padded.view(chunks, self.chunk), min(per_chunk, self.chunk), dim=1, sorted=False).indices
        starts = torch.arange(chunks, device=acc.device).mul_(self.chunk).unsqueeze(1)
        indices = (columns + starts).reshape(-1).sort().values
        indices = indices[indices < numel].int()  # the last chunk's padding
        used = indices.numel()
        values = acc[indices.long()]
        if used < k:
            indices = torch.cat([indices, indices.new_zeros(k - used)])
            values = torch.cat([values, values.new_zeros(k - used)])
        count = torch.full((1,), used, dtype=torch.int32, device=acc.device)
        return self._message(acc, residual, values, indices, count, backend)


def make_compressor(kind: str = "gaussiank", density: float = 0.01, **kwargs) -> Compressor:
    """A compressor by name: ``"gaussiank"`` (``mode=``), ``"topk"``, ``"randomk"`` (``seed=``) or
    ``"chunktopk"`` (``chunk=``); every kind takes ``backend=`` and ``per_tensor=``."""
    if kind not in COMPRESSOR_KINDS:
        raise ValueError(f"compressor must be one of {COMPRESSOR_KINDS}, got {kind!r}")
    try:
        return (GaussianK, TopK, RandomK, ChunkTopK)[COMPRESSOR_KINDS.index(kind)](density, **kwargs)
    except TypeError as error:
        if "unexpected keyword" not in str(error):
            raise
        raise TypeError(f"make_compressor({kind!r}): {error}") from None


def part_maxima(tensor: torch.Tensor, parts: list[int] | None) -> torch.Tensor:
    """max |tensor| over each part (the whole tensor without ``parts``); NaN where one is NaN."""
    slices = tensor.split(parts) if parts is not None else [tensor]
    extremes = [torch.stack(torch.aminmax(s)) if s.numel() else tensor.new_zeros(2) for s in slices]
    return torch.stack(extremes).abs().amax(dim=1)


def hold_unused(residual: torch.Tensor, maxima: list[float], parts: list[int] | None,
                zero: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Save (and ``zero``, for the selection) each part whose gradient is all zero (``maxima`` 0: unused by this
    rank); returns (part, saved copy) pairs to restore afterwards."""
    if parts is None:
        return []
    held, offset = [], 0
    for numel, largest in zip(parts, maxima):
        if largest == 0 and numel:
            part = residual[offset:offset + numel]
            held.append((part, part.clone()))
            if zero:
                part.zero_()
        offset += numel
    return held


def select(compressor: Compressor, tensor: torch.Tensor, residual: torch.Tensor | None, maxima: list[float],
           parts: list[int] | None, k: int, step: int) -> tuple[SparseMessage, torch.Tensor | None]:
    """``tensor + residual`` compressed to k slots (per-tensor: each part its share); a part unused here (an all-zero
    gradient) keeps its residual out. Returns the message and a bound on the residual's max |value| (or None)."""
    if compressor.per_tensor and parts is not None and len(parts) > 1:
        return _select_per_part(compressor, tensor, residual, maxima, parts, k, step)
    held = hold_unused(residual, maxima, parts) if residual is not None else []
    msg = compressor.compress(tensor, residual, step=step)
    for part, saved in held:  # compressed as zeros: nothing of them was taken
        part.copy_(saved)
    bound = msg.stats[ops.STAT_MAX_ABS] if msg.stats is not None and not held else None
    return msg, bound


def _select_per_part(compressor: Compressor, tensor: torch.Tensor, residual: torch.Tensor | None,
                     maxima: list[float], parts: list[int], k: int, step: int
                     ) -> tuple[SparseMessage, torch.Tensor | None]:
    """Used slots first, in ascending index order, then the padding."""
    grads = tensor.split(parts)
    residuals = residual.split(parts) if residual is not None else [None] * len(parts)
    values, indices, used, bounds, offset = [], [], [], [], 0
    for grad, part_residual, share, largest, numel in zip(grads, residuals, tensor_shares(k, parts), maxima, parts):
        if share and largest != 0:
            part = compressor.compress(grad, part_residual, step=step, k=share)
            values.append(part.values)
            indices.append(part.indices + offset)
            used.append(torch.arange(share, device=tensor.device) < part.count)
            bounds.append(part.stats[ops.STAT_MAX_ABS] if part.stats is not None else None)
        elif share:
            values.append(torch.zeros(share, dtype=tensor.dtype, device=tensor.device))
            indices.append(torch.zeros(share, dtype=torch.int32, device=tensor.device))
            used.append(torch.zeros(share, dtype=torch.bool, device=tensor.device))
            bounds.append(None)
        elif part_residual is not None:  # no slot this step: the gradient waits in the residual
            part_residual.add_(grad)
            bounds.append(None)
        offset += numel
    used = torch.cat(used)
    order = torch.argsort((~used).to(torch.int32), stable=True)
    in_use = used[order]
    msg = SparseMessage(torch.cat(values)[order], torch.where(in_use, torch.cat(indices)[order], 0),
                        in_use.sum(dtype=torch.int32).reshape(1), tensor.numel())
    bound = None if any(b is None for b in bounds) else torch.stack(bounds).max()
    return msg, bound
