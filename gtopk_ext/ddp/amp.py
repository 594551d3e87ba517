"""Loss scaling (``torch.amp.GradScaler``) in the DDP hook: the residuals are kept at the scale of the latest step,
and what a step the scaler skips took out of them goes back."""

from __future__ import annotations

from typing import Optional

import torch

from gtopk_ext.backends import BackendChoice
from gtopk_ext.ddp.residuals import ResidualStore
from gtopk_ext.reduction import put_back


class LossScaling:
    """What the hook keeps to follow a loss scaler.

    ``scale``: the residuals hold the gradient times this factor (the latest step's loss scale). ``taken``: per
    bucket, what this iteration took out of the residual, (indices or None for all, values), put back if the
    scaler skips it. ``velocities_before``: with momentum correction, what each velocity goes back to if the
    scaler skips this iteration (a dense bucket's from before the update, a compressed bucket's from before the
    masking)."""

    __slots__ = ("scaler", "scale", "taken", "velocities_before")

    def __init__(self):
        self.scaler = None
        self.scale = 1.0
        self.taken: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.velocities_before: dict[int, torch.Tensor] = {}

    def record_taken(self, index: int, indices: Optional[torch.Tensor], values: torch.Tensor) -> None:
        if self.scaler is not None:
            self.taken[index] = (indices, values)

    def start_iteration(self, residuals: ResidualStore, velocities: ResidualStore, backend: BackendChoice) -> bool:
        """Put back what a skipped step took, and bring the residuals to this step's scale. Returns whether they
        were rescaled."""
        if self.scaler is None:
            return False
        scale = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
        if scale < self.scale:  # the scaler backed off: it skipped the previous step
            for index, (indices, values) in self.taken.items():
                residual = residuals.residuals.get(index)
                if indices is None:
                    residuals.residuals[index] = values if residual is None else residual.add_(values)
                else:
                    put_back(residual, indices, values, backend.for_device(residual.device))
            for index, velocity in self.velocities_before.items():
                velocities.residuals[index] = velocity
        self.taken, self.velocities_before = {}, {}
        if scale == self.scale:
            return False
        factor = scale / self.scale
        for residual in [*residuals.all_tensors(), *velocities.all_tensors()]:
            residual.mul_(factor)
        self.scale = scale
        return True
