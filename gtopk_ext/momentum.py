"""Deep Gradient Compression's momentum correction (Lin et al. 2018), for every front end: the velocity lives in the
hook, per tensor and rank, and the optimizer runs without momentum and weight decay; and the check that no optimizer
applies momentum a second time."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
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
        for group in optimizer.param_groups:
            doubled = [f"{name}={group[name]}" for name in ("momentum", "weight_decay") if group.get(name)]
            if group.get("betas") and group["betas"][0]:  # Adam's first moment is a momentum
                doubled.append(f"betas={tuple(group['betas'])}")
            shared = sum(1 for p in group["params"] if id(p) in ids)
            if not doubled or not shared:
                continue
            message = (f"{type(optimizer).__name__} has {', '.join(doubled)} on {shared} parameter(s) whose gradients "
                       f"the hook already gives momentum to ({type(owner).__name__}(momentum={config.momentum})): "
                       f"momentum would be applied twice. Make the optimizer plain (torch.optim.SGD(params, lr): no "
                       f"momentum, no weight decay) and give weight decay to the hook (gx.MomentumCorrection(..., "
                       f"weight_decay=...)); or, to keep both on purpose, pass optimizer_check='warn' or 'off'")
            if config.optimizer_check == "raise":
                raise ValueError(message)
            warnings.warn(message, UserWarning, stacklevel=2)
    if all(ids is not None for _, ids in known):  # else again at the next step
        _checked.add(optimizer)
