"""The DDP hook's checkpoints: :meth:`SparseGradState.state_dict` and :meth:`SparseGradState.load_state_dict`
(documented there), at the saved world size or at another by the user's policy (:mod:`gtopk_ext.resume`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gtopk_ext.collectives import OkTopkState
from gtopk_ext.ddp.residuals import ResidualStore
from gtopk_ext.ddp.stats import RunTotals
from gtopk_ext.resume import StateDicts, plan_resume, world_fields

if TYPE_CHECKING:
    from gtopk_ext.ddp.state import SparseGradState


def saved_state(state: SparseGradState) -> dict:
    state.wait()
    scaling = state.loss_scaling
    return {"iter": state.iter, **world_fields(state.process_group), "totals": state.run_totals.as_dict(),
            "residual_scale": scaling.scale, **state.residual_store.state_dict(),
            "velocities": state.velocity_store.state_dict(),
            "velocities_before": {index: v.clone() for index, v in scaling.velocities_before.items()},
            "oktopk": {index: s.state_dict() for index, s in state.oktopk_states.items()},
            "taken": {index: (None if indices is None else indices.clone(), values.detach().clone())
                      for index, (indices, values) in scaling.taken.items()}}


def restore(state: SparseGradState, state_dict: StateDicts, on_world_size_change: str) -> None:
    plan = plan_resume(state_dict, on_world_size_change, state.process_group, "SparseGradState.load_state_dict")
    state_dict = plan.replicated
    missing = {"iter", "residuals"} - set(state_dict)
    if missing:
        raise KeyError(f"state_dict is missing {sorted(missing)} (expected SparseGradState.state_dict()'s keys)")
    iteration = state_dict["iter"]
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"state_dict['iter'] must be an int >= 0, got {iteration!r}")
    state.wait()
    state.iter = iteration
    state.run_totals = RunTotals(state_dict.get("totals"))
    scaling = state.loss_scaling
    scaling.scale = float(state_dict.get("residual_scale", 1.0))
    state.bucket_stats, state.residual_bounds, state.agreed_plans = {}, {}, {}
    if plan.policy is not None:
        state.residual_store, state.velocity_store, state.oktopk_states = ResidualStore(), ResidualStore(), {}
        # The buckets' layouts are the same on every rank; each needs them to reduce its first iteration as the
        # others do (in the saved buckets), also a rank that takes no saved rank's residuals.
        state.residual_store.add_state_dict({"residuals": {}, "layouts": state_dict.get("layouts", {})})
        for saved in plan.own:
            state.residual_store.add_state_dict(saved)
        scaling.taken, scaling.velocities_before = {}, {}
        if plan.policy == "fold":
            state.start_iter = max(state.start_iter, iteration + 1)
        return
    state.residual_store.load_state_dict(state_dict)
    state.velocity_store.load_state_dict(state_dict.get("velocities", {"residuals": {}}))
    scaling.taken = {int(i): (indices, values.detach().clone())
                     for i, (indices, values) in state_dict.get("taken", {}).items()}
    scaling.velocities_before = {int(i): v.clone() for i, v in state_dict.get("velocities_before", {}).items()}
    state.oktopk_states = {}
    for i, saved in state_dict.get("oktopk", {}).items():
        state.oktopk_states[int(i)] = OkTopkState()
        state.oktopk_states[int(i)].load_state_dict(saved)
