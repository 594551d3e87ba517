"""The FSDP2 front end: sparse gradient exchange with error feedback between nodes, FSDP2 inside each node.

    state = gx.fsdp.SparseFSDPState(density=0.01)       # nodes of $LOCAL_WORLD_SIZE ranks; gtopk, Gaussian-k
    for block in model.blocks:
        fully_shard(block, mesh=state.shard_mesh)      # shard inside the node only
    fully_shard(model, mesh=state.shard_mesh)
    gx.fsdp.register_sparse_all_reduce(model, state)   # the hook of every FSDP module

FSDP reduce-scatters each parameter group's gradient inside the node and hands this rank's shard (the node's
average) to the hook; the hook averages it over the nodes through :func:`gtopk_ext.reduction.reduce`, as the DDP
hook does with a bucket. The state is data (:mod:`gtopk_ext.fsdp.state`); this module is the algorithm.
"""

from __future__ import annotations

import functools
import zlib
from time import perf_counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

from gtopk_ext.collectives import DTYPE_CODES, Disagreement, agree, collective_named
from gtopk_ext.compressors import k_for_density
from gtopk_ext.ddp import dgc
from gtopk_ext.fsdp.layout import fsdp_modules, parameter_group, shard_layout
from gtopk_ext.fsdp.state import GroupState, GroupStats, SparseFSDPState
from gtopk_ext.ops import is_finite
from gtopk_ext.paths import ROUNDED
from gtopk_ext.reduction import plan_path, reduce, reduce_rounded
from gtopk_ext.wire import wire_named

# Seeds of randomk's draws: step = call * STEPS_PER_CALL + group index, the same on every replica.
STEPS_PER_CALL = 1 << 20


def sparse_all_reduce_hook(state: SparseFSDPState, group: GroupState, shard: torch.Tensor) -> None:
    """FSDP2 all-reduce hook of one parameter group: ``shard`` (this rank's reduce-scattered gradient shard, the
    node's average) becomes, in place, the average over the nodes of what was applied. Registered by
    :func:`register_sparse_all_reduce`; FSDP calls it once per reduce-scatter, synchronously (it uses the shard
    right after), so every buffer lives until its exchange is done.

    1. Gather: the shard's real elements, without FSDP's per-parameter padding (which is thus never selected and
       never holds residual), in float32 (the residual is float32 whatever FSDP's ``reduce_dtype``).
    2. Plan: dense during the warm-up (``start_iter``), else k = ceil(density x real elements), the density of
       this call (the group's iteration: its count of calls), and the path of the state's policy
       (:func:`gtopk_ext.reduction.plan_path`; ``auto``: the cheapest of sparse, dense16, dense8 and dense as
       measured).
       The replicas exchange a header only when the plan changes, and all raise the same error if they differ.
       With momentum correction (``state.momentum_correction``) the gradient (plus weight decay) then updates the
       group's velocity u, and what enters the residual is u (Nesterov: gradient + momentum x u), on every path
       (a gradient that is not finite leaves u as it is).
    3. Reduce (:func:`gtopk_ext.reduction.reduce`): acc = gradient + residual is compressed to k slots, reduced
       over the replicate group by the collective and divided by the number of nodes; what was not applied (not
       selected, dropped by a merge, lost to the wire's rounding) stays in the residual. Momentum factor masking:
       the velocity is cleared where a slot was applied (from ``masking_start_iter``).
    4. Dense paths (the warm-up, the dense path, or a rank whose acc is not finite: then every rank sends its
       whole acc): the gradient (plus the residual) is averaged over the nodes by the dense collective; on the
       dense16 and dense8 paths in bfloat16 or scaled 8-bit floats, their rounding kept in the residual.
    5. Write back: the real elements of ``shard`` take the average (in its dtype); FSDP then applies any
       post-division of its own (float16 reduce-scatters divide in two parts: both are linear, so averaging the
       pre-divided shards over nodes gives FSDP's node average, averaged over nodes).
    """
    layout, nodes = group.layout, state.nodes
    if shard.dim() != 1 or shard.numel() != layout.padded_numel or shard.dtype not in DTYPE_CODES:
        raise ValueError(f"sparse_all_reduce_hook: group {group.index} ({group.name!r}) expected a flat float32, "
                         f"float16 or bfloat16 shard of {layout.padded_numel} elements, got {shard.dtype} of shape "
                         f"{tuple(shard.shape)} (did the module's parameters change since registration?)")
    _check_divide_factor(group.fsdp_group, group.name)
    iteration = group.calls
    group.calls += 1
    correction = state.momentum_correction
    if layout.numel == 0 or (nodes == 1 and correction is None):  # one node: FSDP's average is the answer
        group.stats = GroupStats("none", layout.numel, layout.padded_numel)
        return
    replicas = state.replicate_group
    # 1. Gather.
    in_place = not layout.padded and shard.dtype == torch.float32
    index = None if in_place else layout.real_index(shard.device)
    work = shard if in_place else shard.index_select(0, index).float()
    if group.residual.device != work.device:  # CPU offload: parameters (where it was made) live on the host
        group.residual = group.residual.to(work.device)
        group.velocity = None if group.velocity is None else group.velocity.to(work.device)
    if nodes == 1:  # nothing to exchange, but the momentum that the optimizer no longer has is applied here
        group.stats = GroupStats("none", layout.numel, layout.padded_numel)
        if is_finite(work):
            _add_momentum(correction, group, work)
        if not in_place:
            shard.index_copy_(0, index, work.to(shard.dtype))
        return
    # 2. Plan.
    may_compress = iteration >= state.start_iter
    density = state.density_at(iteration) if may_compress else 1.0
    k = k_for_density(density, layout.numel) if may_compress else None
    if may_compress:
        state.use_density(density)
    stats = group.stats = GroupStats("dense", layout.numel, layout.padded_numel, layout.numel, selected=layout.numel)
    stats.path = plan_path(work, replicas, group.plan, state.path_policy, iteration=iteration, k=k,
                           collective=state.collective_now, wire=wire_named(state.wire), what="sparse_all_reduce_hook",
                           volatile={"iter": iteration, "group": group.index}, traffic=stats.traffic)
    start = perf_counter()
    # The gradient alone is checked: the residual and the velocity only ever hold what finite gradients left.
    finite = is_finite(work) if correction is not None or stats.path == "sparse" else True
    if correction is not None and finite:
        _add_momentum(correction, group, work)
    if stats.path == "sparse":
        stats.k, stats.selected = k, 0
        compressor = state.compressor_now
        # 3. Reduce: select, exchange, keep what was not applied.
        msg = None
        if finite:
            begin = perf_counter()
            msg = compressor.compress(work, group.residual, step=iteration * STEPS_PER_CALL + group.index)
            stats.select_seconds = perf_counter() - begin
        outcome = reduce(work, group.residual, msg, state.collective_now, replicas, k=k,
                         wire=wire_named(state.wire), backend=compressor.backend.for_device(work.device),
                         traffic=stats.traffic, state=group.oktopk)
        stats.selected = int(outcome.msg.count)
        if outcome.nonfinite:  # 4. a finite rank's work holds its whole acc; a non-finite one's its gradient
            stats.path, stats.k, stats.selected = "nonfinite", layout.numel, layout.numel
            if finite:  # all of the residual is in work now
                group.residual.zero_()
        else:
            group.plan.costs.observe_sparse(layout.numel, k, stats.select_seconds,
                                            perf_counter() - start - stats.select_seconds)
            if correction is not None and iteration >= correction.masking_start_iter:
                dgc.mask(group.velocity, outcome.msg.indices, outcome.msg.count, outcome.applied)
    elif stats.path in ROUNDED:  # 4. Dense, in bfloat16 or 8 bits: all of the residual goes, the rounding stays
        reduce_rounded(stats.path, work, group.residual, replicas, stats.traffic)
        group.plan.costs.observe_dense(layout.numel, perf_counter() - start, stats.path)
    if stats.path in ("dense", "nonfinite"):  # 4. Dense: a residual left by earlier sparse calls goes too
        if stats.path == "dense":
            work.add_(group.residual)
            group.residual.zero_()
        collective_named("dense").reduce_dense(work, replicas, nodes, stats.traffic).wait()
        group.plan.costs.observe_dense(layout.numel, perf_counter() - start)
    stats.exchange_seconds = perf_counter() - start - stats.select_seconds
    # 5. Write back.
    if not in_place:
        shard.index_copy_(0, index, work.to(shard.dtype))
    group.run_traffic.add(stats.traffic.sent, stats.traffic.received)


def _add_momentum(correction: dgc.MomentumCorrection, group: GroupState, work: torch.Tensor) -> None:
    """Momentum correction's step 2: ``work`` (the gradient, plus weight decay) updates the group's velocity and
    becomes what enters the residual (:func:`gtopk_ext.ddp.dgc.accumulate`)."""
    if correction.weight_decay:
        for part, weight in zip(work.split([real for real, _ in group.layout.parts]), group.parameters()):
            part.add_(weight.to(part.device, torch.float32), alpha=correction.weight_decay)
    dgc.accumulate(correction, group.velocity, work)


def register_sparse_all_reduce(model: nn.Module, state: SparseFSDPState) -> None:
    """Set :func:`sparse_all_reduce_hook` as the all-reduce hook of every FSDP2 module of ``model`` (call it
    after ``fully_shard``, on every rank). Each module must have one parameter group, sharded over
    ``state.shard_mesh``; modules without parameters are skipped. Also sets
    ``set_reduce_scatter_unused_params(True)`` on them, so that a parameter unused in a step (zeros) keeps its
    place in the shard. Every rank checks the others' configuration and parameter groups first: a mismatch, or
    an error on any rank, raises on every rank (no hang)."""
    if not isinstance(state, SparseFSDPState):
        raise TypeError(f"state must be a gtopk_ext.fsdp.SparseFSDPState, got {type(state).__name__}")
    if state.groups:
        raise ValueError("state is registered on a model already: make one SparseFSDPState per model")
    found, error = [], None
    try:
        shard_ranks = dist.get_process_group_ranks(state.shard_group)
        for name, module in fsdp_modules(model):
            param_group = parameter_group(module, name)
            if param_group is None:
                continue
            _check_mesh(param_group, name, shard_ranks)
            _check_divide_factor(param_group, name)
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
                                  **state.config_fields()}),
              (state.replicate_group, {"error": code, "layouts": zlib.crc32(repr(layouts).encode())}))
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
        collective = state.collective_now
        group = GroupState(index, name, layout, torch.zeros(layout.numel, dtype=torch.float32, device=device),
                           oktopk=collective.new_state() if collective.stateful else None, fsdp_group=param_group)
        if state.momentum_correction is not None:
            group.velocity = torch.zeros_like(group.residual)
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
    """A custom divide factor would make FSDP's shard a sum over the node scaled by the user's factor, which
    averaging over the nodes would not turn into what the factor asks for; refused rather than guessed."""
    if param_group is not None and param_group.gradient_divide_factor is not None:
        raise ValueError(f"FSDP module {name!r} has a gradient divide factor "
                         f"({param_group.gradient_divide_factor}): the sparse hook averages over the nodes, which "
                         f"supports only FSDP's own average; remove set_gradient_divide_factor")
