"""Loss scaling (``torch.amp.GradScaler``) in a hook: the residuals are kept at the scale of the latest step, and
what a step the scaler skips took out of them goes back (error feedback's completion for a skipped step)."""

from __future__ import annotations

from typing import Optional

import torch

from gtopk_ext import ops


class LossScaling:
    """What a hook keeps to follow a loss scaler (``scaler``; None: none attached): ``scale``, the factor the
    residuals hold the gradient times (the latest step's loss scale); ``taken``, per tensor, what this iteration
    took out of the residual, (indices or None for all, values), put back if the scaler skips it;
    ``velocities_before``, what each velocity then goes back to (momentum correction); ``open``: an iteration has
    begun (:meth:`start_iteration` ran)."""

    __slots__ = ("scaler", "scale", "taken", "velocities_before", "open")

    def __init__(self, scaler=None):
        if scaler is not None and (not callable(getattr(scaler, "get_scale", None))
                                   or not callable(getattr(scaler, "is_enabled", None))):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self.scale = 1.0
        self.taken: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.velocities_before: dict[int, torch.Tensor] = {}
        self.open = False

    def start_iteration(self, residuals: dict[int, torch.Tensor], velocities: dict[int, torch.Tensor],
                        others: list[torch.Tensor], backend) -> bool:
        """Put back what a skipped step took, and bring ``residuals`` and ``velocities`` (per tensor index) and
        ``others`` to this step's scale. Returns whether they were rescaled."""
        self.open = True
        scale = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
        if scale < self.scale:  # the scaler backed off: it skipped the previous step
            for index, (indices, values) in self.taken.items():
                residual = residuals.get(index)
                if indices is None:
                    residuals[index] = values if residual is None else residual.add_(values)
                else:
                    ops.scatter_add_(residual, indices, values, backend=backend[residual.device])
            velocities.update(self.velocities_before)
        self.taken, self.velocities_before = {}, {}
        if scale == self.scale:
            return False
        factor = scale / self.scale
        for tensor in [*residuals.values(), *velocities.values(), *others]:
            tensor.mul_(factor)
        self.scale = scale
        return True
