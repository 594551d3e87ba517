"""The FSDP2 front end (gtopk_ext.fsdp) on real FSDP2 over Gloo groups: 2 nodes x 2 ranks, 3 nodes x 2 and 1 node
x 4 (the no-op). Per hook call, the nodes conserve what went in (sum over nodes of shard + old residual == nodes x
average + sum of new residuals) for every sparse collective, both wires, float32 and a bfloat16 reduce_dtype;
every rank's full parameters are bitwise equal after every step; the padding is never read nor holds residual
(its layout is pinned against the shard FSDP builds); momentum correction conserves the increments and masks
the velocity where a slot was applied; a resume from a checkpoint continues bitwise; bad input raises on every
rank; training converges like FSDP2's own HSDP. Each test runs its cases inside one group."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import gtopk_ext as gx
from gtopk_ext.costs import format_bytes
from tests.distributed import run_distributed

STEPS = 3
# Every call compresses (after the warm-up), however small the shard: what these tests check is the sparse path.
SPARSE = gx.PathPolicy("sparse", min_compress_numel=0)


def make_model(seed: int = 0) -> nn.Module:
    """Odd sizes, so that FSDP pads most parameters' shards (dim 0 not a multiple of the node size)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 5), nn.ReLU(), nn.Linear(5, 3))


def shard(model: nn.Module, mesh, **options) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 33, generator=torch.Generator().manual_seed(1000 * step + rank))


def full_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter, gathered over its node (a collective: every rank calls it)."""
    with torch.no_grad():
        return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def record(state, poison: bool = True) -> list:
    """Wraps each group's hook: records (group, call, shard in, old residual, shard out, new residual, path) of
    the real elements, in float32; ``poison`` fills the padding with NaN first (read, it would spoil the output)."""
    calls = []
    for group in state.groups:
        fsdp_group, hook = group.fsdp_group, group.fsdp_group._all_reduce_hook

        def recorded(tensor, group=group, hook=hook):
            index = group.layout.real_index(tensor.device)
            padding = torch.ones(tensor.numel(), dtype=torch.bool)
            padding[index] = False
            if poison:
                tensor[padding] = float("nan")
            residual = group.memory.tensors["residual"]
            before, old = tensor[index].float(), residual.clone()
            hook(tensor)
            untouched = bool(tensor[padding].isnan().all()) if poison else True
            calls.append((group.index, group.calls - 1, before, old, tensor[index].float(),
                          group.memory.tensors["residual"].clone(), group.slot.stats.path, untouched))

        fsdp_group._all_reduce_hook = recorded
    return calls


def train(model: nn.Module, rank: int, steps: range, after=None, **sgd) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **sgd)
    for step in steps:
        model(batch(step, rank)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if after is not None:
            after(step)


def configs() -> list[tuple[str, str, str, int, str]]:
    """(collective, wire, reduce dtype, start_iter, path)."""
    # float16: FSDP divides before the reduce-scatter and after the hook (to avoid overflow), both linear.
    return [(collective, wire, dtype, start_iter, "sparse") for collective in gx.collectives.SPARSE_COLLECTIVES
            for wire in ("plain", "compact") for dtype, start_iter in (("float32", 1), ("bfloat16", 0))
            ] + [("gtopk", "compact", "float16", 0, "sparse"), ("gtopk", "plain", "float32", 1, "dense16"),
                 ("allgather", "plain", "float32", 1, "dense8"), ("gtopk", "plain", "bfloat16", 0, "dense")]


def conservation_case(rank: int, node_size: int, config) -> dict:
    """One configuration: every call's record and every step's full parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    collective, wire, dtype, start_iter, path = config
    state = gx.SparseFSDPState(gx.fsdp.node_mesh(node_size), density=0.1, collective=collective, wire=wire,
                               path=gx.PathPolicy(path, min_compress_numel=0), start_iter=start_iter)
    policy = MixedPrecisionPolicy(reduce_dtype=getattr(torch, dtype))
    model = shard(make_model(), state.shard_mesh, mp_policy=policy)
    gx.register_sparse_all_reduce(model, state)
    calls, parameters = record(state), []
    train(model, rank, range(STEPS), after=lambda step: parameters.append(full_parameters(model)))
    return {"calls": calls, "parameters": parameters, "stats": state.stats()["total"]}


def layout_case(rank: int, node_size: int) -> list:
    """The shard FSDP hands the hook, against the layout read from its parameters: every rank feeds the same
    batch, so the node's average is the plain model's gradient, chunked along dim 0 as FSDP does."""
    mesh = gx.fsdp.node_mesh(node_size)
    reference, model = make_model(), shard(make_model(), mesh["shard"])
    reference(batch(0, 0)).square().mean().backward()
    local = rank % node_size
    expected = []  # (the shard, its real elements) of each module, built with torch.chunk as FSDP shards
    for module in (m for m in reference if isinstance(m, nn.Linear)):
        padded_parts, real_parts = [], []
        for p in (module.weight, module.bias):
            rows = math.ceil(p.shape[0] / node_size)
            chunks = list(torch.chunk(p.grad, node_size))
            mine = chunks[local].reshape(-1) if local < len(chunks) else torch.zeros(0)
            padded = torch.zeros(rows * p[0].numel())
            padded[:mine.numel()] = mine
            padded_parts.append(padded)
            real_parts.append(mine)
        expected.append((torch.cat(padded_parts), torch.cat(real_parts)))
    seen, failures = [], []
    layouts = [gx.fsdp.shard_layout(m._get_fsdp_state()._fsdp_param_groups[0]) for m in model
               if isinstance(m, nn.Linear)]
    for m in (m for m in model if isinstance(m, nn.Linear)):
        m.set_all_reduce_hook(lambda tensor: seen.append(tensor.clone()))
    model(batch(0, 0)).square().mean().backward()
    for shard_seen, (want, real), layout in zip(reversed(seen), expected, layouts):  # backward: last layer first
        index = layout.real_index(shard_seen.device)
        if shard_seen.numel() != want.numel() or not torch.allclose(shard_seen, want, atol=1e-6):
            failures.append(f"rank {rank}: FSDP's shard {shard_seen.tolist()} != expected {want.tolist()}")
        elif (layout.padded_numel != want.numel() or index.numel() != real.numel()
              or not torch.allclose(shard_seen[index], real, atol=1e-6)):
            failures.append(f"rank {rank}: the layout {layout.parts} does not find the real elements")
    return failures


def resume_case(rank: int, node_size: int, directory: str, momentum=None) -> list:
    """Six steps straight, against three steps, a torch.distributed.checkpoint of the hook's state (and the
    parameters), a new model and state loading it, and three more steps: bitwise the same parameters."""
    import torch.distributed.checkpoint as dcp

    def build():
        state = gx.SparseFSDPState(gx.fsdp.node_mesh(node_size), density=0.1, collective="oktopk", wire="compact",
                                   path=SPARSE, momentum=momentum)
        model = shard(make_model(), state.shard_mesh)
        gx.register_sparse_all_reduce(model, state)
        return state, model

    state, straight = build()
    train(straight, rank, range(6))
    state, first = build()
    train(first, rank, range(3))
    dcp.save({"hook": state, "model": first.state_dict()}, checkpoint_id=directory)
    state, resumed = build()
    model_state = resumed.state_dict()
    dcp.load({"hook": state, "model": model_state}, checkpoint_id=directory)
    resumed.load_state_dict(model_state)
    failures = [] if all(g.calls == 3 for g in state.groups) else [f"rank {rank}: calls not restored"]
    train(resumed, rank, range(3, 6))
    if not torch.equal(full_parameters(straight), full_parameters(resumed)):
        failures.append(f"rank {rank}: the resumed run ended elsewhere (momentum {momentum})")
    return failures


MOMENTA = (gx.MomentumCorrection(0.9, masking_start_iter=2),
           gx.MomentumCorrection(0.8, nesterov=True, weight_decay=0.05))


def momentum_case(rank: int, node_size: int, correction) -> list:
    """Momentum correction on gtopk (whose merges drop slots: not every sent slot is applied), the first call
    dense: per call (group, call, gradient, old residual, old velocity, weights, output, new residual, new
    velocity, path) of the real elements, and every step's full parameters."""
    state = gx.SparseFSDPState(gx.fsdp.node_mesh(node_size), density=0.1, path=SPARSE, start_iter=1,
                               momentum=correction)
    model = shard(make_model(), state.shard_mesh)
    gx.register_sparse_all_reduce(model, state)
    calls, parameters = [], []
    for group in state.groups:
        hook = group.fsdp_group._all_reduce_hook

        def recorded(tensor, group=group, hook=hook):
            index = group.layout.real_index(tensor.device)
            tensors = group.memory.tensors
            before = (tensor[index].clone(), tensors["residual"].clone(), tensors["velocity"].clone(),
                      torch.cat(group.parameters()).clone())
            hook(tensor)
            tensors = group.memory.tensors  # CPU offload may have moved them
            calls.append((group.index, group.calls - 1, *before, tensor[index].clone(), tensors["residual"].clone(),
                          tensors["velocity"].clone(), group.slot.stats.path))

        group.fsdp_group._all_reduce_hook = recorded
    train(model, rank, range(4), after=lambda step: parameters.append(full_parameters(model)))
    return [calls, parameters]


def check_momentum(results: list[dict], node_size: int, which: int) -> list[str]:
    """Per call, over each replicate group: the increments conserve (sum over nodes of increment + old residual
    == nodes x average + sum of new residuals); the velocity is u' = momentum x u + g + weight_decay x w where no
    slot was applied and zero where one was, and only there (the sparse calls from masking_start_iter, which
    clear some); an applied slot left nothing in the residual (plain wire)."""
    correction = MOMENTA[which]
    m, failures, world = correction.momentum, [], len(results)
    nodes = world // node_size
    masked_calls = 0
    for local in range(node_size):
        replicas = [results[r]["momentum"][which][0] for r in range(local, world, node_size)]
        for calls in zip(*replicas):
            group, call = calls[0][:2]
            where = f"momentum {correction} local rank {local} group {group} call {call}"
            went_in = came_out = 0
            for _, _, g, r, u, w, out, new_r, new_u, path in calls:
                g = g + correction.weight_decay * w
                u_next = m * u + g
                increment = g + m * u_next if correction.nesterov else u_next
                went_in, came_out = went_in + increment + r, came_out + new_r
                cleared = (new_u == 0) & (u_next != 0)
                if not torch.allclose(new_u[~cleared], u_next[~cleared], rtol=1e-6, atol=1e-7):
                    failures.append(f"{where}: the velocity is not momentum x u + g")
                masking = path == "sparse" and call >= correction.masking_start_iter
                if bool(cleared.any()) != masking or bool(new_r[cleared].any()):
                    failures.append(f"{where} ({path}): {int(cleared.sum())} cleared, residual there "
                                    f"{new_r[cleared].abs().max() if cleared.any() else 0}")
                masked_calls += masking
            came_out = came_out + nodes * calls[0][6]
            if not bool(((went_in - came_out).abs() <= 1e-6 + 1e-5 * went_in.abs()).all()):
                failures.append(f"{where}: not conserved, worst {float((went_in - came_out).abs().max())}")
    for step, per_rank in enumerate(zip(*[r["momentum"][which][1] for r in results])):
        if not all(torch.equal(per_rank[0], p) for p in per_rank):
            failures.append(f"momentum {correction} step {step}: the full parameters differ between ranks")
    return failures + ([] if masked_calls else [f"momentum {correction}: no call masked"])


def accumulation_case(rank: int, node_size: int) -> list:
    """Microbatches under set_requires_gradient_sync(False): FSDP reduces (and calls the hook) once per step, so
    a group's iteration is its optimizer steps."""
    state = gx.SparseFSDPState(gx.fsdp.node_mesh(node_size), density=0.1, path=SPARSE)
    model = shard(make_model(), state.shard_mesh)
    gx.register_sparse_all_reduce(model, state)
    for micro in range(4):
        model.set_requires_gradient_sync(micro == 3)
        model(batch(micro, rank)).square().mean().backward()
    calls = [g.calls for g in state.groups]
    return [] if calls == [1] * len(state.groups) else [f"rank {rank}: calls {calls} after one accumulated step"]


def nonfinite_case(rank: int, node_size: int) -> list:
    """An inf in node 0's gradient at the second call of a group: every replica goes dense; a finite rank sends
    its whole residual with it, the non-finite one keeps its residual."""
    state = gx.SparseFSDPState(gx.fsdp.node_mesh(node_size), density=0.1, path=SPARSE)
    model = shard(make_model(), state.shard_mesh)
    gx.register_sparse_all_reduce(model, state)
    calls = record(state, poison=False)
    group = state.groups[0]
    recorded = group.fsdp_group._all_reduce_hook

    def poisoned(tensor):
        if group.calls == 1 and rank < node_size and group.layout.numel:
            tensor[int(group.layout.real_index(tensor.device)[0])] = float("inf")
        recorded(tensor)

    group.fsdp_group._all_reduce_hook = poisoned
    train(model, rank, range(2))
    failures = [] if any(c[:2] == (0, 1) for c in calls) else [f"rank {rank}: group 0 was not called twice"]
    for index, call, _, old, out, new, path, _ in calls:
        if index == 0 and call == 1:
            kept = torch.equal(new, old) if rank < node_size else not bool(new.any())
            if path != "nonfinite" or not kept or bool(out.isfinite().all()):
                failures.append(f"rank {rank}: a non-finite call took path {path}, residual kept right: {kept}")
    return failures


def error_cases(rank: int, node_size: int) -> dict:
    """Each bad input, and the error type and message every rank raised (the others must not hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    world = torch.distributed.get_world_size()
    mesh = gx.fsdp.node_mesh(node_size)
    world_mesh = init_device_mesh("cpu", (world,))

    def several_groups():
        other = FSDPMeshInfo(world_mesh, shard_mesh_dim=0)
        model = make_model()
        fully_shard(model, mesh=mesh["shard"],
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p.dim() == 1 else None)
        return model

    def divided():
        model = shard(make_model(), mesh["shard"])
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(3.0)
        return model

    def momentum_twice():
        state = gx.SparseFSDPState(mesh, density=0.1, momentum=0.9)
        model = shard(make_model(), mesh["shard"])
        gx.register_sparse_all_reduce(model, state)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(batch(0, rank)).square().mean().backward()
        optimizer.step()

    cases = {
        "not fsdp": lambda: gx.register_sparse_all_reduce(make_model(), gx.SparseFSDPState(mesh)),
        "one rank not fsdp": lambda: gx.register_sparse_all_reduce(
            make_model() if rank == 0 else shard(make_model(), mesh["shard"]), gx.SparseFSDPState(mesh)),
        "world mesh": lambda: gx.register_sparse_all_reduce(shard(make_model(), world_mesh),
                                                            gx.SparseFSDPState(mesh)),
        "hsdp mesh": lambda: gx.register_sparse_all_reduce(shard(make_model(), mesh), gx.SparseFSDPState(mesh)),
        "several groups": lambda: gx.register_sparse_all_reduce(several_groups(), gx.SparseFSDPState(mesh)),
        "divide factor": lambda: gx.register_sparse_all_reduce(divided(), gx.SparseFSDPState(mesh)),
        "density": lambda: gx.SparseFSDPState(mesh, density=1.5),
        "densities differ": lambda: gx.register_sparse_all_reduce(
            shard(make_model(), mesh["shard"]), gx.SparseFSDPState(mesh, density=0.2 if rank == 1 else 0.1)),
        "node sizes differ": lambda: gx.fsdp.node_mesh(node_size if rank else 1),
        "momenta differ": lambda: gx.register_sparse_all_reduce(
            shard(make_model(), mesh["shard"]), gx.SparseFSDPState(mesh, momentum=0.9 if rank == 1 else 0.8)),
        "momentum twice": momentum_twice,
        "clip_norm": lambda: gx.SparseFSDPState(mesh, momentum=gx.MomentumCorrection(0.9, clip_norm=1.0)),
        "layouts differ": lambda: gx.register_sparse_all_reduce(
            shard(make_model(seed=0) if rank < node_size else nn.Sequential(nn.Linear(33, 18)), mesh["shard"]),
            gx.SparseFSDPState(mesh)),
    }
    raised = {}
    for name, case in cases.items():
        try:
            case()
            raised[name] = None
        except Exception as error:  # noqa: BLE001 - the test compares them
            raised[name] = f"{type(error).__name__}: {error}"
    return raised


def as_bytes(result) -> bytes:
    """Tensors cross the result queue as bytes: torch's queue shares their memory with the receiver, which a
    worker that has exited can no longer serve."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data))


def group_checks(rank: int, world: int, node_size: int, directory: str) -> bytes:
    return as_bytes({"layout": layout_case(rank, node_size),
                     "conservation": {config: conservation_case(rank, node_size, config) for config in configs()},
                     "momentum": [momentum_case(rank, node_size, correction) for correction in MOMENTA],
                     "resume": (resume_case(rank, node_size, directory + "/plain")
                                + resume_case(rank, node_size, directory + "/momentum", MOMENTA[1])
                                + accumulation_case(rank, node_size) + nonfinite_case(rank, node_size)),
                     "errors": error_cases(rank, node_size)})


def check_conservation(results: list[dict], node_size: int, config) -> list[str]:
    """Per call, over each replicate group (ranks of the same local rank)."""
    _, _, dtype, start_iter, path = config
    failures, world = [], len(results)
    nodes = world // node_size
    for local in range(node_size):
        replicas = [results[r]["conservation"][config]["calls"] for r in range(local, world, node_size)]
        for calls in zip(*replicas):
            group, call, *_ = calls[0]
            where = f"{config} local rank {local} group {group} call {call}"
            if len({(c[0], c[1]) for c in calls}) != 1:
                failures.append(f"{where}: replicas recorded different calls")
                continue
            outputs = [c[4] for c in calls]
            if not all(torch.equal(outputs[0], o) for o in outputs):
                failures.append(f"{where}: the average differs between replicas")
            if not all(c[7] for c in calls) or not all(bool(o.isfinite().all()) for o in outputs):
                failures.append(f"{where}: the padding was read or written")
            if any(c[6] != ("dense" if call < start_iter else path) for c in calls):
                failures.append(f"{where}: path {[c[6] for c in calls]}")
            went_in = sum(c[2] + c[3] for c in calls)
            came_out = nodes * outputs[0] + sum(c[5] for c in calls)
            # bfloat16, float16: the average is written back in the reduce dtype (rounded as FSDP's all-reduce is).
            rounding = torch.finfo(getattr(torch, dtype)).eps * nodes * outputs[0].abs()
            if not bool(((went_in - came_out).abs() <= rounding + 1e-6 + 1e-5 * went_in.abs()).all()):
                failures.append(f"{where}: not conserved, worst {float((went_in - came_out).abs().max())}")
    parameters = [r["conservation"][config]["parameters"] for r in results]
    for step, per_rank in enumerate(zip(*parameters)):
        if not all(torch.equal(per_rank[0], p) for p in per_rank):
            failures.append(f"{config} step {step}: the full parameters differ between ranks")
    return failures


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (3, 2)])
def test_fsdp2_nodes_conserve_agree_resume_and_refuse_bad_input(tmp_path, nodes, node_size):
    results = [from_bytes(r) for r in run_distributed(group_checks, nodes * node_size, node_size, str(tmp_path),
                                                      timeout=300)]
    failures = [f for r in results for f in r["layout"] + r["resume"]]
    failures += [f for which in range(len(MOMENTA)) for f in check_momentum(results, node_size, which)]
    for config in configs():
        failures += check_conservation(results, node_size, config)
        stats = results[node_size - 1]["conservation"][config]["stats"]  # the last local rank holds padding
        k_sent = stats["k"] < stats["numel"] if config[4] == "sparse" else stats["k"] == stats["numel"]
        if not (0 < stats["k"] and k_sent and stats["numel"] < stats["padded_numel"]) or not stats["bytes_sent"]:
            failures.append(f"{config}: stats {stats}")
    assert not failures, "\n".join(failures[:20])
    expected = {"not fsdp": "TypeError: model (Sequential) has no FSDP2 module",
                "one rank not fsdp": "", "world mesh": "ValueError: FSDP module", "hsdp mesh": "2-D (HSDP)",
                "several groups": "parameter groups", "divide factor": "gradient divide factor",
                "density": "ValueError: density must be a number in (0, 1]", "densities differ": "density_ppb differs",
                "node sizes differ": "node_size differs", "layouts differ": "differs across ranks",
                "momenta differ": "momentum differs",
                "momentum twice": "SGD has momentum=0.9 on 6 parameter(s) whose gradients the hook already gives "
                                  "momentum to (SparseFSDPState(momentum=",
                "clip_norm": "ValueError: momentum: clip_norm is not supported by the FSDP hook"}
    for name, part in expected.items():
        for rank, result in enumerate(results):
            error = result["errors"][name]
            assert error is not None and part in error, (name, rank, error)


def one_node_case(rank: int, world: int) -> bytes:
    """One node of all ranks: the hook leaves FSDP's average as it is (bitwise the plain FSDP2 run), or, with the
    recipe, applies its Nesterov momentum as torch's SGD would. Nodes of one
    rank (a (world, 1) mesh, FSDP2 as a DDP): the hook exchanges whole gradients sparsely between all ranks."""
    state = gx.SparseFSDPState(gx.fsdp.node_mesh(world), density=0.01, path=SPARSE)
    hooked, plain = shard(make_model(), state.shard_mesh), shard(make_model(), state.shard_mesh)
    gx.register_sparse_all_reduce(hooked, state)
    train(hooked, rank, range(STEPS))
    train(plain, rank, range(STEPS))
    no_op = torch.equal(full_parameters(hooked), full_parameters(plain)) and state.stats()["total"]["bytes_sent"] == 0
    # With momentum correction the hook still applies the momentum the optimizer no longer has: torch's SGD with
    # Nesterov momentum on plain FSDP2.
    state = gx.SparseFSDPState.recipe(gx.fsdp.node_mesh(world), density=0.01, path=SPARSE)
    hooked, plain = shard(make_model(), state.shard_mesh), shard(make_model(), state.shard_mesh)
    gx.register_sparse_all_reduce(hooked, state)
    train(hooked, rank, range(STEPS))
    train(plain, rank, range(STEPS), momentum=0.9, nesterov=True)
    no_op = no_op and torch.allclose(full_parameters(hooked), full_parameters(plain), rtol=1e-6, atol=1e-7)
    no_op = no_op and not torch.equal(full_parameters(hooked), full_parameters(shard(make_model(), state.shard_mesh)))
    state = gx.SparseFSDPState(gx.fsdp.node_mesh(1), density=0.1, path=SPARSE)
    replicated = shard(make_model(), state.shard_mesh)
    gx.register_sparse_all_reduce(replicated, state)
    train(replicated, rank, range(STEPS))
    return as_bytes((no_op, full_parameters(replicated), state.stats(), state.summary()))


def test_one_node_is_a_no_op_and_one_rank_nodes_exchange_everything():
    results = [from_bytes(r) for r in run_distributed(one_node_case, 4)]
    assert all(no_op for no_op, *_ in results)
    assert all(torch.equal(results[0][1], parameters) for _, parameters, *_ in results)
    stats, summary = results[0][2], results[0][3].splitlines()
    total = stats["total"]
    assert total["numel"] == total["padded_numel"] and 0 < total["k"] < total["numel"] and total["bytes_sent"], total
    # The summary, as the DDP state's: the configuration, the run beside HSDP's bytes, a row per group.
    assert summary[0] == ("SparseFSDPState: gaussiank + gtopk, density 0.1, plain wire, error feedback on; 4 node(s) "
                          "of 1 ranks"), summary
    assert summary[1].startswith(f"run: {STEPS} calls a group; between nodes this rank sent "), summary
    hsdp = 2 * 3 * total["padded_numel"] * 4 // 4
    assert summary[2] == f"  (HSDP's float32 all-reduce of these shards between nodes: {format_bytes(hsdp)} a call)"
    rows = [line.split() for line in summary[4:]]
    assert [(int(row[0]), row[1], row[-1]) for row in rows] == [
        (index, group["path"], group["name"]) for index, group in stats["groups"].items()], summary


def convergence_case(rank: int, world: int) -> list[dict]:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from examples.train_fsdp2 import parse_args, train as train_example

    common = ["--steps", "200", "--width", "128", "--node-size", "2", "--log-every", "0", "--path", "sparse",
              "--min-compress-numel", "0"]  # every group on the sparse path: what the bytes below measure
    return [train_example(parse_args(common + variant)) for variant in (
        ["--mode", "hsdp"], ["--mode", "sparse", "--density", "1.0"],
        ["--mode", "sparse", "--density", "0.05", "--wire", "compact"], ["--mode", "recipe", "--density", "0.001"])]


def test_training_converges_like_fsdp2_hsdp():
    """examples/train_fsdp2.py on the digits, 2 nodes x 2, 200 steps, against FSDP2's own HSDP (a 2-D mesh):
    at density 1 the hook is HSDP (the same loss: the averaging is right, divide factors included); at density
    0.05 (compact wire, after 10 dense steps) the test accuracy is within 4 points at under 1/15 of HSDP's
    cross-node bytes per step; the recipe (momentum correction) at 0.001 within 4 points at under 1/300 (the
    sparse hook with the optimizer's momentum reached 0.63 there, HSDP 0.98)."""
    hsdp, whole, sparse, recipe = run_distributed(convergence_case, 4, timeout=600)[0]
    assert hsdp["test_accuracy"] > 0.9, hsdp
    assert whole["loss"] == pytest.approx(hsdp["loss"], rel=1e-4), (whole, hsdp)
    # 0.947 against 0.981 with scikit-learn 1.9.1's digits, at dcee162 as now (bitwise the same run)
    assert sparse["test_accuracy"] > hsdp["test_accuracy"] - 0.04, (sparse, hsdp)
    assert 0 < 15 * sparse["cross_node_bytes_last_step"] < hsdp["cross_node_bytes_last_step"], (sparse, hsdp)
    assert recipe["test_accuracy"] > hsdp["test_accuracy"] - 0.04, (recipe, hsdp)
    assert 0 < 300 * recipe["cross_node_bytes_last_step"] < hsdp["cross_node_bytes_last_step"], (recipe, hsdp)
    json.dumps([hsdp, sparse])  # plain data


def test_two_torchrun_agents_as_nodes(tmp_path):
    """Two torchrun agents (c10d rendezvous on loopback) as two nodes of two ranks: tests/torchrun_fsdp_worker.py
    checks conservation and equal parameters; then examples/train_fsdp2.py as its docstring launches it, whose
    rank 0 reports bytes sent to the other node."""
    from bench.harness.launch import run_torchrun

    out = tmp_path / "checks.json"
    run_torchrun(["tests/torchrun_fsdp_worker.py", "--out", str(out)], 2, 2, None, tmp_path, "fsdp2-checks",
                 timeout=240)
    checks = json.loads(out.read_text())
    assert checks["world"] == 4 and checks["calls"] > 0 and not checks["failures"], checks
    logs = run_torchrun(["examples/train_fsdp2.py", "--steps", "30", "--start-iter", "5", "--log-every", "10"],
                        2, 2, None, tmp_path, "fsdp2", timeout=240)
    summary = json.loads([line for line in logs[0].splitlines() if line.startswith("{")][-1])
    assert summary["mode"] == "sparse" and (summary["nodes"], summary["node_size"]) == (2, 2), summary
    assert 0 < summary["cross_node_bytes_last_step"] < summary["cross_node_bytes_run"], summary


def test_the_fsdp2_front_end_is_imported_at_its_first_use():
    """`import gtopk_ext` leaves torch.distributed.fsdp unimported (about a second a process, which a DDP program's
    every rank would pay); gx.fsdp, gx.SparseFSDPState and gx.register_sparse_all_reduce import it when asked."""
    script = ("import sys, gtopk_ext as gx\n"
              "print('torch.distributed.fsdp' in sys.modules)\n"
              "gx.SparseFSDPState, gx.fsdp  # the lazy path first, before anything binds the subpackage\n"
              "from gtopk_ext.fsdp import SparseFSDPState, register_sparse_all_reduce\n"
              "print(gx.SparseFSDPState is SparseFSDPState, gx.register_sparse_all_reduce is "
              "register_sparse_all_reduce, gx.fsdp.SparseFSDPState is SparseFSDPState, 'SparseFSDPState' in dir(gx))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "True", "True", "True", "True"]
    with pytest.raises(AttributeError, match="no attribute 'SparseFSDPStat'"):
        gx.SparseFSDPStat  # noqa: B018 - a misspelt name still raises
