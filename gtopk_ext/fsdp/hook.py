"""The FSDP2 front end's algorithm (docs/fsdp.md): this rank's shard of its node's average gradient, averaged over
the nodes by :func:`gtopk_ext.reduction.reduce_step`; the state is data (:mod:`gtopk_ext.fsdp.state`)."""

from __future__ import annotations

import functools
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

from gtopk_ext.collectives import DTYPE_CODES, Disagreement, agree
from gtopk_ext.fsdp.layout import fsdp_modules, parameter_group, shard_layout
from gtopk_ext.fsdp.state import GroupState, SparseFSDPState
from gtopk_ext.momentum import DecoupledMomentum, clip_together, increment
from gtopk_ext.ops import is_finite
from gtopk_ext.reduction import Memory, Slot, StepStats, reduce_step


def sparse_all_reduce_hook(state: SparseFSDPState, group: GroupState, shard: torch.Tensor) -> None:
    """FSDP2 all-reduce hook of one parameter group: ``shard`` (this rank's reduce-scattered gradient shard, the
    node's average) becomes, in place, the average over the nodes of what was applied. Registered by
    :func:`register_sparse_all_reduce`; FSDP calls it once per reduce-scatter, synchronously.

    1. Gather: the shard's real elements, without FSDP's padding (never selected, never in a residual), in
       float32 (the residual's dtype, whatever FSDP's ``reduce_dtype``).
    2. One node: nothing to exchange, but momentum correction, which the optimizer no longer applies, is applied.
    3. Reduce over the nodes: :func:`gtopk_ext.reduction.reduce_step`, the group's count of calls its iteration.
    4. Write back: the real elements of ``shard`` take the average, in its dtype (FSDP's post-division follows).
    """
    layout = group.layout
    if shard.dim() != 1 or shard.numel() != layout.padded_numel or shard.dtype not in DTYPE_CODES:
        raise ValueError(f"sparse_all_reduce_hook: group {group.index} ({group.name!r}) expected a flat float32, "
                         f"float16 or bfloat16 shard of {layout.padded_numel} elements, got {shard.dtype} of shape "
                         f"{tuple(shard.shape)} (did the module's parameters change since registration?)")
    _check_divide_factor(group.fsdp_group, group.name)
    iteration = group.calls
    group.calls += 1
    config = state.config
    correction = config.momentum
    decoupled = isinstance(correction, DecoupledMomentum)
    if layout.numel == 0 or (state.mesh.size(0) == 1 and correction is None):  # one node: FSDP's average is the answer
        group.slot.stats = StepStats("none", layout.numel, 0)
        if decoupled and correction.clip_norm is not None:  # the other ranks' clipping counts on this one
            clip_together(shard.new_zeros(0, dtype=torch.float32), correction.clip_norm, dist.group.WORLD,
                          state.mesh.size(0))
        return
    # 1. Gather.
    in_place = layout.numel == layout.padded_numel and shard.dtype == torch.float32
    index = None if in_place else layout.real_index(shard.device)
    work = shard if in_place else shard.index_select(0, index).float()
    tensors = group.memory.tensors
    if tensors["residual"].device != work.device:  # CPU offload: parameters (where it was made) live on the host
        group.memory.tensors = {kind: tensor.to(work.device) for kind, tensor in tensors.items()}
    weights = group.parameters() if correction is not None and correction.weight_decay else None
    clip_over = (dist.group.WORLD, state.mesh.size(0))  # a module's gradient: its shards on a node's ranks
    if state.mesh.size(0) == 1:  # 2. One node.
        group.slot.stats = StepStats("none", layout.numel, 0)
        if decoupled:  # nothing to select: all of m goes, m = the clipped gradient
            if correction.clip_norm is not None:
                clip_together(work, correction.clip_norm, *clip_over)
        elif is_finite(work):
            increment(correction, group.memory.get("velocity"), work, weights, None, [1.0], sent_whole=True)
    else:  # 3. Reduce over the nodes.
        reduce_step(work, group.slot, group.memory, config, index=group.index, iteration=iteration,
                    group=state.mesh.get_group(0), what="sparse_all_reduce_hook", weights=weights,
                    clip_over=clip_over).wait()
        group.run_traffic.add(group.slot.stats.traffic.sent, group.slot.stats.traffic.received)
    if decoupled:  # for SparseAdamW to tell a later rescaling of the gradients
        state.adam.norms[group.index] = (iteration, torch.linalg.vector_norm(work),
                                         frozenset(id(p) for p in group.trained()))
    # 4. Write back.
    if not in_place:
        shard.index_copy_(0, index, work.to(shard.dtype))


def register_sparse_all_reduce(model: nn.Module, state: SparseFSDPState) -> None:
    """Set :func:`sparse_all_reduce_hook` as the all-reduce hook of every FSDP2 module of ``model``, after
    ``fully_shard``, on every rank. Each module must have one parameter group, sharded over ``state.shard_mesh``;
    modules without parameters are skipped; sets ``set_reduce_scatter_unused_params(True)``. The ranks check each
    other's configuration and parameter groups first: a mismatch, or an error on any rank, raises on every rank."""
    if not isinstance(state, SparseFSDPState):
        raise TypeError(f"state must be a gtopk_ext.fsdp.SparseFSDPState, got {type(state).__name__}")
    if state.groups:
        raise ValueError("state is registered on a model already: make one SparseFSDPState per model")
    found, error = [], None
    try:
        shard_ranks = dist.get_process_group_ranks(state.mesh.get_group(1))
        for name, module in fsdp_modules(model):
            param_group = parameter_group(module, name)
            if param_group is None:
                continue
            _check_mesh(param_group, name, shard_ranks)
            _check_divide_factor(param_group, name)
            if isinstance(state.config.momentum, DecoupledMomentum):
                _check_float32(param_group, name)
            found.append((name, module, param_group, shard_layout(param_group)))
        if not found:
            raise ValueError(f"model ({type(model).__name__}) has no FSDP2 module with trainable parameters")
    except (TypeError, ValueError) as local:
        found, error = [], local
    code = 0 if error is None else 1 + isinstance(error, ValueError)
    layouts = [layout.parts for *_, layout in found]
    device = torch.device(state.mesh.device_type)
    # The world compares the configuration and the shards' padded sizes (the same on every rank of a node), each
    # replicate group its shards' real sizes (which differ between local ranks).
    checks = ((dist.group.WORLD, {"error": code, "groups": len(found),
                                  "padded": sum(layout.padded_numel for *_, layout in found),
                                  **state.config.fields(), "nodes": state.mesh.size(0)}),
              (state.mesh.get_group(0), {"error": code, "layouts": zlib.crc32(repr(layouts).encode())}))
    for process_group, fields in checks:
        try:
            agree(fields, process_group, device, "register_sparse_all_reduce")
        except Disagreement as disagreement:
            if error is not None:
                raise error from disagreement
            raise
    if error is not None:
        raise error
    for index, (name, module, param_group, layout) in enumerate(found):
        device = param_group.fsdp_params[0].sharded_param.device
        residual = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        velocity = state.config.momentum is not None and not isinstance(state.config.momentum, DecoupledMomentum)
        memory = Memory(residual=residual, **({"velocity": torch.zeros_like(residual)} if velocity else {}))
        group = GroupState(index, name, layout, memory, Slot(state.config.reducer), fsdp_group=param_group)
        state.groups.append(group)
        module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_all_reduce_hook(functools.partial(sparse_all_reduce_hook, state, group))


def _check_mesh(param_group, name: str, shard_ranks: list[int]) -> None:
    info = param_group.mesh_info
    if isinstance(info, DDPMeshInfo) or not isinstance(info, FSDPMeshInfo):
        what = "sharded over a 2-D (HSDP) mesh" if isinstance(info, FSDPMeshInfo) else "a replicate() module"
        raise ValueError(f"FSDP module {name!r} is {what}: FSDP then all-reduces its gradient densely across the "
                         f"replicas before any hook runs; shard it with fully_shard(module, mesh=state.shard_mesh)")
    ranks = dist.get_process_group_ranks(info.shard_process_group)
    if ranks != shard_ranks:
        raise ValueError(f"FSDP module {name!r} is sharded over ranks {ranks}, not over this node's ranks "
                         f"{shard_ranks}: shard it with fully_shard(module, mesh=state.shard_mesh)")


def _check_divide_factor(param_group, name: str) -> None:
    """A custom divide factor is refused: averaging over the nodes would not turn it into what it asks for."""
    if param_group is not None and param_group.gradient_divide_factor is not None:
        raise ValueError(f"FSDP module {name!r} has a gradient divide factor "
                         f"({param_group.gradient_divide_factor}): the sparse hook averages over the nodes, which "
                         f"supports only FSDP's own average; remove set_gradient_divide_factor")


def _check_float32(param_group, name: str) -> None:
    """The AdamW recipe's hook is not linear (clipping, the selection): FSDP's pre- and post-division of a
    16-bit reduction would not pass through it."""
    policy = param_group.mp_policy
    dtypes = {policy.reduce_dtype or policy.param_dtype or p.sharded_param.dtype for p in param_group.fsdp_params}
    if dtypes != {torch.float32}:
        raise ValueError(f"FSDP module {name!r} reduces its gradients in {sorted(map(str, dtypes))}: "
                         f"the AdamW recipe (momentum=DecoupledMomentum) needs float32 parameters and reduction "
                         f"(MixedPrecisionPolicy(reduce_dtype=torch.float32))")
