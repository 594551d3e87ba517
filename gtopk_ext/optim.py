"""SparseAdamW: the optimizer of the hooks' AdamW recipe (:class:`gtopk_ext.AdamCorrection`). AdamW until the
recipe's freeze step; then it publishes the frozen variance to the hook, which from then on sends Adam's update
itself, and applies the hook's average with AdamW's decoupled weight decay."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from gtopk_ext.momentum import ADAMW_CORRECTIONS, AdamCorrection, DecoupledMomentum

RESCALED_TOLERANCE = 1e-3  # relative: a norm that differs more was rescaled after the hook


class SparseAdamW(torch.optim.AdamW):
    """AdamW whose momentum and variance move into the hook of ``state`` (a hook state made with
    ``optimizer="adamw"``, e.g. ``gx.SparseGradState.recipe(density=0.01, optimizer="adamw")``) at the recipe's
    freeze step. ``lr``, ``betas``, ``eps``, ``weight_decay``, parameter groups and learning-rate schedulers are
    AdamW's; the betas and eps are the hook's too (given to ``state`` before its first step).

    1. Steps 1 to ``freeze_step``: ``torch.optim.AdamW``'s own step, on the hook's dense average.
    2. At the end of step ``freeze_step``: each parameter's bias-corrected variance v^ becomes its scale
       ``s = sqrt(max(v^, variance_floor x mean(v^))) + eps`` (a parameter that never had a gradient: the mean of
       all), handed to the hook; AdamW's m and v are dropped (m goes on in the hook, per rank).
    3. Later steps: ``w = w * (1 - lr * weight_decay) - lr * grad``, the grad being the average over the ranks of
       Adam's update (m^ / s) that the hook applied.

    Clipping is the hook's (the recipe's ``clip_norm``): after the freeze a gradient's norm is an update's. When
    the gradients were rescaled after the hook (``clip_grad_norm_``), the step undoes it and warns once."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state):
        correction = getattr(getattr(state, "config", None), "momentum", None)
        if not isinstance(correction, ADAMW_CORRECTIONS):
            raise ValueError(f"state must be a hook state made for AdamW (gx.SparseGradState.recipe(..., "
                             f"optimizer='adamw'), momentum=gx.AdamCorrection() or gx.DecoupledMomentum()), got "
                             f"{type(state).__name__} with momentum={correction!r}")
        decoupled = isinstance(correction, DecoupledMomentum)
        try:  # decoupled: the hook's momentum replaces AdamW's first moment; Adam with beta1 = 0 normalises its output
            inner = (0.0, betas[1]) if decoupled else betas
        except (TypeError, IndexError):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}") from None
        super().__init__(params, lr=lr, betas=inner, eps=eps, weight_decay=weight_decay)
        shared = {(tuple(group["betas"]), group["eps"]) for group in self.param_groups}
        if not decoupled:
            if len(shared) != 1:
                raise ValueError(f"betas and eps must be the same in every parameter group (the hook keeps one Adam "
                                 f"momentum), got {sorted(shared)}")
            (betas, eps), = shared
            if (tuple(float(b) for b in betas), float(eps)) != (correction.betas, correction.eps):
                if state.iter:
                    raise ValueError(f"betas={betas}, eps={eps}: the hook's state has run {state.iter} iterations "
                                     f"with betas={correction.betas}, eps={correction.eps}; give the optimizer those")
                state.config = state.config.replace(momentum=dataclasses.replace(correction, betas=betas, eps=eps))
        self.hook_state = state  # the momentum-twice check pairs the two by it
        self._warned = False
        self.publish()

    @property
    def correction(self) -> "AdamCorrection | DecoupledMomentum":
        return self.hook_state.config.momentum

    @torch.no_grad()
    def step(self, closure=None):
        """One step: AdamW's before the freeze (then, at the freeze step, the scales), the hook's update after."""
        iteration = self.hook_state.iter  # this step applies the hook's iteration - 1
        self._undo_rescaling(iteration - 1)
        if isinstance(self.correction, DecoupledMomentum):
            return super().step(closure)
        if not self.correction.frozen(iteration - 1):
            loss = super().step(closure)
            if iteration == self.correction.freeze_step:
                self._freeze()
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, decay = float(group["lr"]), float(group["weight_decay"])
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)
        return loss

    def _freeze(self) -> None:
        """Step 2: AdamW's variance becomes each parameter's scale (its m and v are dropped)."""
        floor, eps = self.correction.variance_floor, self.correction.eps
        variances = {}
        for group in self.param_groups:
            for p in group["params"]:
                held = self.state.get(p, {})
                if "exp_avg_sq" in held:
                    variances[p] = held["exp_avg_sq"] / (1 - group["betas"][1] ** float(held["step"]))
        means = {p: float(v.mean()) for p, v in variances.items()}
        overall = sum(means.values()) / max(len(means), 1)
        for group in self.param_groups:
            for p in group["params"]:
                v = variances.get(p)
                if v is None or means[p] == 0:
                    v = torch.full_like(p, overall) if v is None else v.clamp(min=overall)
                    mean = overall
                else:
                    mean = means[p]
                step = self.state.get(p, {}).get("step", torch.tensor(0.0))
                self.state[p] = {"step": step, "scale": v.clamp(min=floor * mean).sqrt_().add_(eps)}
        self.publish()

    def publish(self) -> None:
        """Hand the scales (after the freeze, or a restore) to the hook: this rank's pieces of them."""
        scales = {id(p): _local(held["scale"]) for p, held in self.state.items() if "scale" in held}
        if scales:
            self.hook_state.adam.publish(scales)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.publish()

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
                          f"recipe's clip_norm={self.correction.clip_norm}); drop clip_grad_norm_", UserWarning,
                          stacklevel=3)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (an FSDP2 parameter's, gradient's or state's DTensor), or ``tensor``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
