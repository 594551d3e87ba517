"""Momentum applied twice: the hook's momentum correction and an optimizer's own momentum or weight decay on the
same parameters. Every optimizer is checked before its first step after the hook has seen its parameters,
through torch's step pre-hook common to all optimizers: there is no call the user could forget."""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from gtopk_ext.ddp.state import SparseGradState
    from gtopk_ext.fsdp.state import SparseFSDPState

    MomentumState = Union[SparseGradState, SparseFSDPState]

OPTIMIZER_CHECKS = ("raise", "warn", "off")

# The states whose hook applies momentum, and the optimizers already checked against all of them.
_watched: "weakref.WeakSet[MomentumState]" = weakref.WeakSet()
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_handle: Optional[RemovableHandle] = None


def watch(state: MomentumState) -> None:
    """Check every optimizer against ``state`` (whose hook applies momentum) before the optimizer's next step."""
    global _handle
    _watched.add(state)
    _checked.clear()  # a new state: every optimizer again
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _checked:
        return
    states = list(_watched)
    started = [s for s in states if s.knows_parameters()]
    for state in started:
        check_optimizer(state, optimizer)
    if len(started) == len(states):  # else again at the next step: a state has not seen its parameters yet
        _checked.add(optimizer)


def check_optimizer(state: MomentumState, optimizer: torch.optim.Optimizer) -> None:
    """Raises (or warns, or nothing: ``state.optimizer_check``) when ``optimizer`` has momentum or weight decay on
    parameters whose gradients ``state``'s hook applies momentum to (parameters it has reduced)."""
    mode = state.optimizer_check
    if mode not in OPTIMIZER_CHECKS:
        raise ValueError(f"state.optimizer_check must be one of {OPTIMIZER_CHECKS}, got {mode!r}")
    if mode == "off" or state.momentum_correction is None:
        return
    for group in optimizer.param_groups:
        doubled = [f"{name}={group[name]}" for name in ("momentum", "weight_decay") if group.get(name)]
        if group.get("betas") and group["betas"][0]:  # Adam's first moment is a momentum
            doubled.append(f"betas={tuple(group['betas'])}")
        shared = sum(1 for p in group["params"] if state.knows(p))
        if not doubled or not shared:
            continue
        message = (f"{type(optimizer).__name__} has {', '.join(doubled)} on {shared} parameter(s) whose gradients "
                   f"the hook already gives momentum to ({type(state).__name__}(momentum="
                   f"{state.momentum_correction})): momentum would be applied twice. Make the optimizer plain "
                   f"(torch.optim.SGD(params, lr): no momentum, no weight decay) and give weight decay to the hook "
                   f"(gx.MomentumCorrection(..., weight_decay=...)); or, to keep both on purpose, set "
                   f"state.optimizer_check = 'warn' or 'off'")
        if mode == "raise":
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=3)
