"""Resuming a front end's per-rank state (residuals, accumulators) at the world size it was saved at, or at another
one by a policy the user names: what ``SparseGradState`` and ``SparseLocalSGD`` share in ``load_state_dict``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.distributed as dist

# What load_state_dict does when the state_dict was saved at another world size (see Resume).
WORLD_SIZE_POLICIES = ("error", "fold", "zero")

StateDicts = Union[dict, list, tuple]


def world_fields(process_group: Optional[dist.ProcessGroup]) -> dict[str, int]:
    """``{"world_size", "rank"}`` of this process in ``process_group`` (None: the default group); empty when
    torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    group = process_group if process_group is not None else dist.group.WORLD
    return {"world_size": dist.get_world_size(group), "rank": dist.get_rank(group)}


@dataclass
class Resume:
    """What a rank loads. ``replicated``: the state_dict to take the fields that every rank has alike from (the
    iteration, global weights); ``own``: the state_dicts whose per-rank fields (residuals) this rank takes;
    ``policy``: None when the world size is the saved one (``own`` is this rank's state_dict alone), else
    ``"fold"`` or ``"zero"``."""

    replicated: dict
    own: list[dict]
    policy: Optional[str]


def plan_resume(state_dict: StateDicts, on_world_size_change: str, process_group: Optional[dist.ProcessGroup],
                what: str) -> Resume:
    """What this rank loads from ``state_dict`` (this rank's, or the list of every saved rank's in rank order),
    checked against this process's world size and rank. A state_dict without ``world_size`` loads as this rank's.
    At another world size, ``"error"`` raises on every rank; ``"fold"`` gives this rank the saved ranks ``q`` with
    ``q % world_size == rank`` (of a list; else the one state_dict given); ``"zero"`` gives it none."""
    if on_world_size_change not in WORLD_SIZE_POLICIES:
        raise ValueError(f"on_world_size_change must be one of {WORLD_SIZE_POLICIES}, got {on_world_size_change!r}")
    saved_list = isinstance(state_dict, (list, tuple))
    dicts = list(state_dict) if saved_list else [state_dict]
    if not dicts or not all(isinstance(d, dict) for d in dicts):
        raise TypeError(f"{what}: state_dict must be a dict (this rank's state_dict()) or a non-empty list of them "
                        f"(every saved rank's, in rank order), got {_kinds(state_dict)}")
    if saved_list:
        for q, saved in enumerate(dicts):
            recorded = (saved.get("world_size"), saved.get("rank"))
            if recorded != (None, None) and recorded != (len(dicts), q):
                raise ValueError(f"{what}: state_dict[{q}] was saved by rank {recorded[1]} of {recorded[0]}; a list "
                                 f"must hold every saved rank's state_dict in rank order ({len(dicts)} given)")
    now = world_fields(process_group)
    saved_size = len(dicts) if saved_list else dicts[0].get("world_size")
    if not now or saved_size is None or saved_size == now["world_size"]:
        mine = dicts[now["rank"]] if saved_list and now else dicts[0]
        saved_rank = mine.get("rank")
        if now and saved_rank is not None and saved_rank != now["rank"] and on_world_size_change == "error":
            raise ValueError(f"{what}: the state_dict was saved by rank {saved_rank}, this is rank {now['rank']} "
                             f"(of {now['world_size']}): load each rank's own state_dict")
        return Resume(mine, [mine], None)
    size, rank = now["world_size"], now["rank"]
    if on_world_size_change == "error":
        raise ValueError(f"{what}: the state_dict was saved at world size {saved_size}, this group has world size "
                         f"{size}, and the residuals it holds are per rank. Resume at world size {saved_size}, or "
                         f"pass on_world_size_change='fold' (the saved residuals are sent whole in the first step: "
                         f"nothing is lost; give every saved rank's state_dict as a list) or 'zero' (they start at "
                         f"zero: what they held is dropped)")
    iterations = {d.get("iter", d.get("local_step")) for d in dicts}  # the hook's step, local SGD's
    if len(iterations) > 1:
        raise ValueError(f"{what}: the saved ranks' state_dicts are of different steps {sorted(iterations)}: they "
                         f"must come from one checkpoint")
    own = [dicts[q] for q in range(len(dicts)) if q % size == rank] if saved_list else dicts
    return Resume(dicts[0], own if on_world_size_change == "fold" else [], on_world_size_change)


def _kinds(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {sorted({type(v).__name__ for v in value})}"
    return type(value).__name__
