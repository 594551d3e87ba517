"""Momentum in the hook, for every front end: Deep Gradient Compression's momentum correction (Lin et al. 2018) for
SGD, the velocity in the hook per tensor and rank; AdamW's momentum decoupled as DeMo does, the residual being the
momentum. And the check that no optimizer applies momentum a second time."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gtopk_ext._validate import check_int, check_number
from gtopk_ext.compressors import hold_unused

OPTIMIZER_CHECKS = ("raise", "warn", "off")


@dataclass(frozen=True)
class MomentumCorrection:
    """DGC's momentum correction, the optimizer then run WITHOUT momentum and weight decay (``torch.optim.SGD(params,
    lr)``): per tensor and rank, a velocity u and the residual v: ``g += weight_decay * w``, ``u = momentum * u + g``,
    ``v += u`` (Nesterov: ``v += g + momentum * u``); the compressor selects from v, and where a slot is applied both
    v and u are cleared (momentum factor masking). Dense paths send u (Nesterov: g + momentum * u).

    ``masking_start_iter``: the iteration from which applied slots clear u. ``clip_norm``: DGC's local clipping of
    each tensor's gradient to an L2 norm of at most ``clip_norm / sqrt(P)``, before weight decay and momentum, on
    every path. ``momentum=0`` with a ``clip_norm`` clips only."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    masking_start_iter: int = 0
    clip_norm: Optional[float] = None

    def __post_init__(self):
        momentum = check_number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        if self.nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        weight_decay = check_number("weight_decay", self.weight_decay, 0.0, float("inf"), high_open=True)
        check_int("masking_start_iter", self.masking_start_iter)
        clip_norm = None if self.clip_norm is None else check_number("clip_norm", self.clip_norm, 0.0, float("inf"),
                                                                     low_open=True, high_open=True)
        for name, value in (("momentum", momentum), ("nesterov", bool(self.nesterov)),
                            ("weight_decay", weight_decay), ("clip_norm", clip_norm)):
            object.__setattr__(self, name, value)

    @property
    def accumulates(self) -> bool:
        """Whether a step changes the gradient (momentum or weight decay), not only clips it."""
        return bool(self.momentum or self.weight_decay)


@dataclass(frozen=True)
class DecoupledMomentum:
    """AdamW's momentum decoupled as DeMo does (Peng, Quesnelle & Kingma 2024), with :class:`gtopk_ext.SparseAdamW`
    as the optimizer: per tensor and rank the residual IS Adam's first moment, kept in the DCT domain of each
    ``chunk`` consecutive elements of each parameter (:mod:`gtopk_ext.dct`). Every step:

    1. The gradient g is clipped: scaled on every rank by one factor, ``min(1, clip_norm / sqrt(mean over ranks of
       |g_r|^2))`` (one scalar allreduce), so that their average is at most ``clip_norm`` long (None: no clipping).
       The hook clips: the optimizer never sees a gradient.
    2. ``m = beta * m + DCT(g)``.
    3. The compressor selects from m and what is applied leaves m: the fast components go out as they appear, the
       rest goes on accumulating (and decaying).
    4. The ranks' selections are averaged, and the hook returns Q, the inverse DCT of the average: a top-k of a
       chunk's coefficients moves every element of the chunk.
    5. The optimizer normalises Q as Adam does (AdamW with a first beta of 0): ``v = beta2 v + (1 - beta2) Q^2``,
       ``w = w (1 - lr wd) - lr Q / (sqrt(v^) + eps)``.

    ``beta`` is the momentum's own decay, DeMo's 0.999, not AdamW's first beta: what leaves m is what was sent, so m
    holds mostly what is still owed (in a simulation of docs/language_model.md's run, 0.9 was 0.12 nats behind 0.999
    at step 160). A dense step (the DDP hook's first two, a tensor below the path policy's ``min_compress_numel``, a
    rank's non-finite sum) sends all of m, as density 1 would: none stays."""

    beta: float = 0.999
    chunk: int = 64
    clip_norm: Optional[float] = 1.0

    def __post_init__(self):
        check_number("beta", self.beta, 0.0, 1.0, high_open=True)
        check_int("chunk", self.chunk, 1)
        clip_norm = None if self.clip_norm is None else check_number("clip_norm", self.clip_norm, 0.0, float("inf"),
                                                                     low_open=True, high_open=True)
        object.__setattr__(self, "beta", float(self.beta))
        object.__setattr__(self, "clip_norm", clip_norm)

    # What the shared code asks of a momentum correction: the velocity is the residual, no weight decay in the hook.
    accumulates = True
    weight_decay = 0.0

    @property
    def momentum(self) -> float:
        return self.beta


class AdamLink:
    """What the hook and :class:`gtopk_ext.SparseAdamW` share under :class:`gtopk_ext.DecoupledMomentum`: ``norms``,
    per tensor index (iteration, the L2 norm of the hook's output, the ids of its parameters), from which the
    optimizer tells whether the gradients were rescaled after the hook (``clip_grad_norm_``). Not pickled."""

    __slots__ = ("norms",)

    def __init__(self):
        self.norms: dict[int, tuple[int, torch.Tensor, frozenset[int]]] = {}


def clip_together(tensor: torch.Tensor, max_norm: float, group: dist.ProcessGroup, count: Optional[int] = None) -> None:
    """Scale ``tensor`` on every rank of ``group`` by one factor, ``min(1, max_norm / sqrt(sum over the ranks of
    |tensor|^2 / count))`` (``count``: the gradients whose pieces the ranks hold, default one per rank), so that
    their average is at most ``max_norm`` long (one scalar allreduce)."""
    square = torch.linalg.vector_norm(tensor, dtype=torch.float32).square().reshape(1)
    dist.all_reduce(square, group=group)
    mean = square / (count or dist.get_world_size(group))
    tensor.mul_(torch.clamp(max_norm / (mean.sqrt() + 1e-6), max=1.0).to(tensor.dtype))


def clip(tensor: torch.Tensor, max_norm: float) -> None:
    """Scale ``tensor`` so that its L2 norm is at most ``max_norm`` (on the device: no host sync)."""
    norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
    tensor.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(tensor.dtype))


def increment(correction: MomentumCorrection, velocity: torch.Tensor, tensor: torch.Tensor,
              weights: Optional[list[torch.Tensor]], parts: Optional[list[int]], maxima: list[float], *,
              record: Optional[Callable[[torch.Tensor], None]] = None, sent_whole: bool) -> None:
    """``tensor`` (the gradient) becomes what enters the residual this step: u after ``u = momentum * u + g +
    weight_decay * w`` (Nesterov: ``g + weight_decay * w + momentum * u``); ``weights``: the flat parameters laid end
    to end as in ``tensor`` (for weight decay). A part of ``parts`` unused by this rank (``maxima`` 0) keeps its
    velocity and adds nothing.

    ``record`` (with a loss scaler) gets what the velocity goes back to if the scaler skips the step: before its
    update when ``sent_whole`` (a dense path), else before the masking only (the increment stays in the residual)."""
    if correction.weight_decay:
        if weights is None:
            raise ValueError("weight_decay needs the tensor's parameters (a DDP model, or reduce_buffer(parameters=))")
        for part, weight in zip(tensor.split([w.numel() for w in weights]), weights):
            part.add_(weight.to(part.device), alpha=correction.weight_decay)
    if record is not None and sent_whole:
        record(velocity.clone())
    held = hold_unused(velocity, maxima, parts, zero=False)
    velocity.mul_(correction.momentum).add_(tensor)
    if correction.nesterov:
        tensor.add_(velocity, alpha=correction.momentum)
    else:
        tensor.copy_(velocity)
    for part, saved in held:
        part.copy_(saved)
    if record is not None and not sent_whole:
        record(velocity.clone())
    for part, largest in zip(tensor.split(parts) if parts else [tensor], maxima):
        if largest == 0:
            part.zero_()


def mask(velocity: torch.Tensor, indices: torch.Tensor, count: torch.Tensor, applied: Optional[torch.Tensor]) -> None:
    """Momentum factor masking: the velocity is cleared where a slot was sent and applied."""
    sent = torch.arange(indices.numel(), device=indices.device) < count
    velocity.index_fill_(0, indices[sent if applied is None else sent & applied].long(), 0)


# Every optimizer is checked before its first step after the hook has seen its parameters, through torch's step
# pre-hook common to all optimizers: there is no call the user could forget.
_watched: "weakref.WeakKeyDictionary[object, Callable]" = weakref.WeakKeyDictionary()
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_handle = None


def watch(owner, reduced: Callable[[object], Optional[set[int]]]) -> None:
    """Check every optimizer, before its next step, against ``owner`` (a front end's state whose ``config`` has
    momentum correction); ``reduced(owner)``: the ids of the parameters its hook reduces, None until known."""
    global _handle
    _watched[owner] = reduced
    _checked.clear()  # a new state: every optimizer again
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Raises (or warns, or nothing: ``config.optimizer_check``) when ``optimizer`` has momentum or weight decay on
    parameters whose gradients a watched state's hook gives momentum to."""
    if optimizer in _checked:
        return
    known = [(owner, reduced(owner)) for owner, reduced in list(_watched.items())]
    for owner, ids in known:
        config = owner.config
        if ids is None or config.optimizer_check == "off" or not (config.momentum and config.momentum.accumulates):
            continue
        adam = isinstance(config.momentum, DecoupledMomentum)
        if adam and getattr(optimizer, "hook_state", None) is owner:
            continue
        for group in optimizer.param_groups:
            shared = sum(1 for p in group["params"] if id(p) in ids)
            if not shared:
                continue
            if adam:  # any other optimizer would take the hook's Adam steps for gradients
                message = (f"{type(optimizer).__name__} updates {shared} parameter(s) whose hook "
                           f"({type(owner).__name__}, optimizer='adamw') applies Adam's momentum itself (its output "
                           f"is not the gradient): use gx.SparseAdamW(params, lr, betas, eps, weight_decay, "
                           f"state=<that state>) in place of {type(optimizer).__name__}")
            else:
                doubled = [f"{name}={group[name]}" for name in ("momentum", "weight_decay") if group.get(name)]
                if group.get("betas") and group["betas"][0]:  # Adam's first moment is a momentum
                    doubled.append(f"betas={tuple(group['betas'])}")
                if not doubled:
                    continue
                adamw = (" For AdamW, the recipe's optimizer='adamw' with gx.SparseAdamW corrects Adam's momentum."
                         if group.get("betas") else "")
                message = (f"{type(optimizer).__name__} has {', '.join(doubled)} on {shared} parameter(s) whose "
                           f"gradients the hook already gives momentum to ({type(owner).__name__}(momentum="
                           f"{config.momentum})): momentum would be applied twice. Make the optimizer plain "
                           f"(torch.optim.SGD(params, lr): no momentum, no weight decay) and give weight decay to the "
                           f"hook (gx.MomentumCorrection(..., weight_decay=...)); or, to keep both on purpose, pass "
                           f"optimizer_check='warn' or 'off'.{adamw}")
            if config.optimizer_check == "raise":
                raise ValueError(message)
            warnings.warn(message, UserWarning, stacklevel=2)
    if all(ids is not None for _, ids in known):  # else again at the next step
        _checked.add(optimizer)
