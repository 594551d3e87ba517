"""SparseAdamW: the optimizer of the hooks' AdamW recipe (:class:`gtopk_ext.DecoupledMomentum`): Adam's first moment
lives in the hook, which sends it sparsely; the optimizer normalises the hook's average as Adam does and applies it
with AdamW's decoupled weight decay."""

from __future__ import annotations

import warnings

import torch

from gtopk_ext.momentum import DecoupledMomentum

RESCALED_TOLERANCE = 1e-3  # relative: a norm that differs more was rescaled after the hook


class SparseAdamW(torch.optim.AdamW):
    """AdamW whose first moment is the hook's (``state``: a hook state made with ``optimizer="adamw"``, e.g.
    ``gx.SparseGradState.recipe(density=0.01, optimizer="adamw")``). ``lr``, ``betas``, ``eps``, ``weight_decay``,
    parameter groups, learning-rate schedulers and ``state_dict`` are AdamW's. Each step is
    ``torch.optim.AdamW``'s with a first beta of 0 on the hook's output Q (the average of what the ranks sent of
    their momentum, :class:`gtopk_ext.DecoupledMomentum`): ``v = beta2 v + (1 - beta2) Q^2``, ``w = w (1 - lr wd)
    - lr Q / (sqrt(v^) + eps)``. ``betas[0]`` is AdamW's decay of its first moment, which the hook's momentum
    replaces with its own (``DecoupledMomentum.beta``): it is accepted, as AdamW's arguments are, and unused.

    Clipping is the hook's (the recipe's ``clip_norm``). When the gradients were rescaled after the hook
    (``clip_grad_norm_``), the step undoes it and warns once."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state):
        correction = getattr(getattr(state, "config", None), "momentum", None)
        if not isinstance(correction, DecoupledMomentum):
            raise ValueError(f"state must be a hook state made for AdamW (gx.SparseGradState.recipe(..., "
                             f"optimizer='adamw') or momentum=gx.DecoupledMomentum()), got {type(state).__name__} "
                             f"with momentum={correction!r}")
        try:
            second = betas[1]
        except (TypeError, IndexError):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}") from None
        super().__init__(params, lr=lr, betas=(0.0, second), eps=eps, weight_decay=weight_decay)
        self.hook_state = state  # the momentum-twice check pairs the two by it
        self._warned = False

    def add_param_group(self, param_group: dict) -> None:
        """AdamW's, with the first beta 0 in every group, its own betas too: the first moment is the hook's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = (0.0, group["betas"][1])

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW's step (first beta 0) on the hook's output, after undoing a rescaling of it."""
        self._undo_rescaling(self.hook_state.iter - 1)  # this step applies the hook's iteration - 1
        return super().step(closure)

    def _undo_rescaling(self, iteration: int) -> None:
        """Put back the hook's output where the gradients were scaled after it (``clip_grad_norm_``)."""
        latest = [(norm, ids) for done, norm, ids in self.hook_state.adam.norms.values() if done == iteration]
        norms = [norm for norm, _ in latest]
        ids = frozenset().union(*(ids for _, ids in latest))
        grads = [_local(p.grad) for group in self.param_groups for p in group["params"]
                 if p.grad is not None and id(p) in ids]
        if not grads:
            return
        pair = torch.stack([torch.linalg.vector_norm(torch.stack(norms)),  # one host sync for both
                            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))])
        sent, found = pair.tolist()
        if found == 0 or abs(found - sent) <= RESCALED_TOLERANCE * sent:
            return
        torch._foreach_mul_(grads, sent / found)
        if not self._warned:
            self._warned = True
            warnings.warn(f"SparseAdamW: the gradients were rescaled after the hook (norm {found:.4g}, the hook's "
                          f"{sent:.4g}; clip_grad_norm_?): undone. With the AdamW recipe the hook clips (the "
                          f"recipe's clip_norm={self.hook_state.config.momentum.clip_norm}); drop clip_grad_norm_",
                          UserWarning, stacklevel=3)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (an FSDP2 parameter's, gradient's or state's DTensor), or ``tensor``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
