"""Deep Gradient Compression's momentum correction (Lin et al. 2018) in the DDP hook: the velocity lives in the
hook, per bucket and rank, and the optimizer runs without momentum and weight decay."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from gtopk_ext._validate import check_number
from gtopk_ext.ddp.residuals import Layout, ResidualStore, hold_unused
from gtopk_ext.ddp.schedule import DensitySchedule, exponential_warmup


@dataclass(frozen=True)
class MomentumCorrection:
    """DGC's momentum correction, with the optimizer then run WITHOUT momentum and weight decay
    (``torch.optim.SGD(params, lr)``): per bucket and rank, a velocity u and the residual v:
    ``g += weight_decay * w``, ``u = momentum * u + g``, ``v += u`` (Nesterov: ``v += g + momentum * u``), the
    compressor selects from v, and where a slot is applied both v and u are cleared (momentum factor masking).
    Dense paths (warm-up, small buckets, the dense collective) send u (Nesterov: g + momentum * u) and keep it.
    Conserved: what entered v (the increments) = what was applied + what v keeps.

    ``masking_start_iter``: the iteration from which applied slots clear u; before it only v is cleared there.
    Masking during a dense-ish warm-up (a density warm-up from 0.25) clears the velocity of the elements sent at
    almost every step, which then train without momentum; starting it where the warm-up ends keeps their momentum.
    ``clip_norm``: DGC's local gradient clipping: each rank scales each bucket's gradient so that its L2 norm is
    at most ``clip_norm / sqrt(P)`` (before weight decay and momentum), on every path; per bucket, not over the
    model (a norm over the model would wait for the last bucket and undo the overlap). ``momentum=0`` with a
    ``clip_norm`` clips only."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    masking_start_iter: int = 0
    clip_norm: Optional[float] = None

    def __post_init__(self):
        momentum, clip_norm = self.momentum, self.clip_norm
        check_number("momentum", momentum, 0.0, 1.0, high_open=True)
        if self.nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        weight_decay = self.weight_decay
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        start = self.masking_start_iter
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"masking_start_iter must be an int >= 0, got {start!r}")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0):
            raise ValueError(f"clip_norm must be None or a number > 0, got {clip_norm!r}")
        object.__setattr__(self, "momentum", float(momentum))
        object.__setattr__(self, "nesterov", bool(self.nesterov))
        object.__setattr__(self, "weight_decay", float(weight_decay))
        object.__setattr__(self, "clip_norm", None if clip_norm is None else float(clip_norm))


def recipe(density: float, warmup_steps: int, momentum: float) -> tuple[DensitySchedule, MomentumCorrection]:
    """The recipe's density schedule and momentum correction, for every front end: DGC's exponential warm-up from
    0.25 to ``density`` over ``warmup_steps`` steps, and Nesterov momentum correction with its masking from the
    warm-up's end."""
    schedule = exponential_warmup(density, warmup_steps, start_density=max(density, 0.25))
    return schedule, MomentumCorrection(momentum, nesterov=momentum > 0, masking_start_iter=warmup_steps)


def clip(tensor: torch.Tensor, max_norm: float) -> None:
    """Scale ``tensor`` so that its L2 norm is at most ``max_norm`` (on the device: no host sync)."""
    norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
    tensor.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(tensor.dtype))


def clip_bucket(options: Optional[MomentumCorrection], tensor: torch.Tensor, size: int) -> None:
    if options is not None and options.clip_norm is not None:
        clip(tensor, options.clip_norm / math.sqrt(size))


def increment(options: MomentumCorrection, velocities: ResidualStore, before: Optional[dict[int, torch.Tensor]],
              tensor: torch.Tensor, index: int, layout: Layout, parameters: Optional[list[torch.Tensor]],
              maxima: list[float], *, sent_whole: bool) -> torch.Tensor:
    """``tensor`` (the gradient) becomes what enters the residual v this step: u after
    ``u = momentum * u + g + weight_decay * w`` (Nesterov: ``g + weight_decay * w + momentum * u``). A parameter
    whose gradient is all zero here (``maxima`` 0: unused by this rank) keeps its velocity and adds nothing, as
    if the step had not happened for it. Returns the bucket's velocity.

    With a loss scaler, ``before`` gets what the velocity goes back to if the scaler skips the step.
    ``sent_whole`` (a dense path): the increment is sent, not kept, so the skipped step drops it and the velocity
    goes back to before its update. On the sparse path the increment stays in v (nothing lost), so the velocity
    keeps its update and loses only the step's masking: going back to before the update would count
    momentum * u twice.
    """
    if options.weight_decay:
        if parameters is None:
            raise ValueError("weight_decay needs the bucket's parameters (a DDP model, or reduce(parameters=...))")
        for part, p in zip(tensor.split([n for _, n in layout]), parameters):
            part.add_(p.detach().reshape(-1), alpha=options.weight_decay)
    velocity = velocities.residual(index, tensor, layout)
    if before is not None and sent_whole:
        before[index] = velocity.clone()
    held = hold_unused(velocity, maxima, layout, zero=False)
    accumulate(options, velocity, tensor)
    for part, saved in held:
        part.copy_(saved)
    if before is not None and not sent_whole:
        before[index] = velocity.clone()
    for part, largest in zip(tensor.split([n for _, n in layout]) if layout else [tensor], maxima):
        if largest == 0:
            part.zero_()
    return velocity


def accumulate(options: MomentumCorrection, velocity: torch.Tensor, tensor: torch.Tensor) -> None:
    """The velocity's update, ``u = momentum * u + g`` (``g``: ``tensor``), and ``tensor`` becomes what enters the
    residual: u (Nesterov: ``g + momentum * u``)."""
    velocity.mul_(options.momentum).add_(tensor)
    if options.nesterov:
        tensor.add_(velocity, alpha=options.momentum)
    else:
        tensor.copy_(velocity)


def mask(velocity: torch.Tensor, indices: torch.Tensor, count: torch.Tensor, applied: Optional[torch.Tensor]) -> None:
    """Momentum factor masking: the velocity is cleared where a slot was sent and applied."""
    sent = torch.arange(indices.numel(), device=indices.device) < count
    velocity.index_fill_(0, indices[sent if applied is None else sent & applied].long(), 0)
