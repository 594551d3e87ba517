"""WAGMA group model averaging: the butterfly schedule as a pure function, and GroupModelAverager on real Gloo
process groups (P = 4 and 8, group sizes 2 and 4; every distributed check runs inside one spawn per P)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from gtopk_ext.averaging import GroupModelAverager, butterfly_groups, group_schedule_length
from tests.distributed import run_distributed

# --------------------------------------------------------------------------------------------- the schedule


def _averaging_matrix(groups: list[list[int]], world_size: int) -> torch.Tensor:
    """W with (W @ x)[i] = mean of x over the group of i."""
    matrix = torch.zeros(world_size, world_size, dtype=torch.float64)
    for group in groups:
        for i in group:
            matrix[i, group] = 1.0 / len(group)
    return matrix


def _is_connected(world_size: int, rounds: list[list[list[int]]]) -> bool:
    parent = list(range(world_size))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for groups in rounds:
        for group in groups:
            for member in group[1:]:
                parent[root(member)] = root(group[0])
    return len({root(i) for i in range(world_size)}) == 1


SCHEDULE_CASES = [(p, s) for p in range(1, 49) for s in range(1, p + 1) if p % s == 0]


@pytest.mark.parametrize("world_size,group_size", SCHEDULE_CASES)
def test_schedule_partitions_rotate_and_spread(world_size: int, group_size: int) -> None:
    length = group_schedule_length(world_size, group_size)
    rounds = [butterfly_groups(world_size, group_size, r) for r in range(2 * length + 1)]
    for groups in rounds:
        assert all(len(g) == group_size for g in groups)
        assert sorted(i for g in groups for i in g) == list(range(world_size))
    assert rounds[length] == rounds[0]  # the schedule cycles
    partitions = [{frozenset(g) for g in groups} for groups in rounds]
    if group_size not in (1, world_size):
        assert all(partitions[r] != partitions[r + 1] for r in range(2 * length)), "consecutive rounds repeat"
        assert _is_connected(world_size, rounds[:length])
        # An update reaches every rank within ceil(log_S P) + 1 rounds, whatever round it starts in.
        bound = math.ceil(math.log(world_size) / math.log(group_size) - 1e-9)
        exact_power = group_size**bound == world_size
        for start in range(length):
            mixing = torch.eye(world_size, dtype=torch.float64)
            needed = None
            for r in range(bound + 1):
                mixing = _averaging_matrix(butterfly_groups(world_size, group_size, start + r), world_size) @ mixing
                if needed is None and bool((mixing > 0).all()):
                    needed = r + 1
            assert needed is not None and needed <= (bound if exact_power else bound + 1), (start, needed)
            if exact_power and start == 0:  # the paper's butterfly: log_S(P) rounds give the exact global mean
                after = torch.eye(world_size, dtype=torch.float64)
                for r in range(bound):
                    after = _averaging_matrix(butterfly_groups(world_size, group_size, r), world_size) @ after
                torch.testing.assert_close(after, torch.full_like(after, 1.0 / world_size))


def test_schedule_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"group_size must divide the process group's size 6 .*got 4"):
        butterfly_groups(6, 4, 0)
    with pytest.raises(ValueError, match="group_size must divide"):
        group_schedule_length(8, 0)
    with pytest.raises(ValueError, match="group_size must divide"):
        group_schedule_length(4, 8)
    with pytest.raises(TypeError, match="group_size must be an int"):
        group_schedule_length(8, 2.0)
    with pytest.raises(ValueError, match="round_index"):
        butterfly_groups(8, 2, -1)
    with pytest.raises(ValueError, match="world_size"):
        butterfly_groups(0, 1, 0)


# ------------------------------------------------------------------------------------ distributed helpers


def _make_params(seed: int) -> list[torch.nn.Parameter]:
    """Parameters of a few shapes, different on every seed (float64 so that means compare tightly)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64))
            for shape in ((3, 4), (5,), (2, 1, 3))]


def _local_progress(params: list[torch.Tensor], seed: int) -> None:
    """Stands in for an optimizer step: a different update on every rank and step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype), alpha=0.1)


def _gather_rows(params: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """[ranks of group, all parameter elements]: every rank's parameters, flattened."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    rows = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, flat, group=group)
    return torch.stack(rows)


def _assert_group_step(before: torch.Tensor, after: torch.Tensor, groups: list[list[int]]) -> None:
    """A synchronous group step: the mean over all ranks is unchanged, group members hold exactly the same
    values, namely their group's mean, and members of different groups differ."""
    torch.testing.assert_close(after.mean(0), before.mean(0), rtol=1e-13, atol=1e-13)
    for group in groups:
        for member in group[1:]:
            assert torch.equal(after[member], after[group[0]]), f"group {group} members differ"
        torch.testing.assert_close(after[group[0]], before[group].mean(0), rtol=1e-13, atol=1e-13)
    if len(groups) > 1:
        assert not torch.equal(after[groups[0][0]], after[groups[1][0]])


def _assert_all_equal(rows: torch.Tensor) -> None:
    for rank in range(1, rows.shape[0]):
        assert torch.equal(rows[rank], rows[0]), f"rank {rank} differs from rank 0 after a global average"


# ------------------------------------------------------------------------------------ distributed checks


def _check_synchronous_steps(rank: int, world_size: int, group_size: int) -> None:
    """Group steps follow butterfly_groups; warm-up and every global_period-th step are global and bitwise."""
    averager = GroupModelAverager(group_size, global_period=3, warmup_steps=2, wait_avoiding=False)
    params = _make_params(rank)
    for step in range(2 + 3 * group_schedule_length(world_size, group_size)):
        _local_progress(params, seed=1000 * step + rank)
        before = _gather_rows(params)
        averager.average_parameters(params)
        after = _gather_rows(params)
        if step < 2 or (step - 2 + 1) % 3 == 0:
            assert averager.is_global_step(step)
            _assert_all_equal(after)
            torch.testing.assert_close(after[0], before.mean(0), rtol=1e-13, atol=1e-13)
        else:
            _assert_group_step(before, after, butterfly_groups(world_size, group_size, averager.group_round(step)))
    assert averager.step == 2 + 3 * group_schedule_length(world_size, group_size)


def _delay(rank: int, step: int, seed: int, probability: float = 0.3, most: float = 0.02) -> None:
    """An irregular step time: a random sleep on some steps, different on every rank, seed and step."""
    generator = torch.Generator().manual_seed(100_003 * seed + 1009 * rank + step)
    if float(torch.rand((), generator=generator)) < probability:
        time.sleep(most * float(torch.rand((), generator=generator)))


def _updates(rank: int, seed: int, steps: int, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per step, the update this rank's "optimizer" adds: different on every rank and step."""
    generator = torch.Generator().manual_seed(7919 * seed + rank)
    return [[0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params] for _ in range(steps)]


def _summed_updates(updates: list[list[torch.Tensor]]) -> torch.Tensor:
    """[step, elements]: every step's update summed over the ranks."""
    mine = torch.stack([torch.cat([u.reshape(-1) for u in step]) for step in updates])
    return _gather_rows([mine]).reshape(dist.get_world_size(), *mine.shape).sum(0)


def _train_with_delays(averager: GroupModelAverager, params: list[torch.Tensor], updates, rank: int, seed: int,
                       on_global=None) -> None:
    with torch.no_grad():
        for step, update in enumerate(updates):
            _delay(rank, step, seed)
            torch._foreach_add_(params, update)
            averager.average_parameters(params)
            if on_global is not None and averager.is_global_step(step):
                on_global(step)


def _check_wait_avoiding_conservation(rank: int, world_size: int, group_size: int, seed: int) -> None:
    """Random step times: every global step leaves all ranks bitwise equal, holding the mean of everything put in;
    after finish() the sum over ranks is exactly the initial sum plus every update (no rank's progress lost or
    counted twice), and a second finish() changes nothing."""
    global_period = 2 * group_schedule_length(world_size, group_size) + 1
    averager = GroupModelAverager(group_size, global_period=global_period, warmup_steps=seed % 2)
    params = _make_params(rank)
    steps = 3 * global_period + 2
    updates = _updates(rank, seed, steps, params)
    initial = _gather_rows(params).sum(0)
    per_step = _summed_updates(updates)

    def check_global(step: int) -> None:
        rows = _gather_rows(params)
        _assert_all_equal(rows)
        torch.testing.assert_close(rows[0] * world_size, initial + per_step[:step + 1].sum(0), rtol=1e-12,
                                   atol=1e-12)

    _train_with_delays(averager, params, updates, rank, seed, check_global)
    averager.finish(params)
    finished = _gather_rows(params)
    torch.testing.assert_close(finished.sum(0), initial + per_step.sum(0), rtol=1e-12, atol=1e-12)
    averager.finish(params)
    assert torch.equal(_gather_rows(params), finished)
    assert averager.step == steps


def _check_wait_avoiding_mixing(rank: int, world_size: int, group_size: int, seed: int) -> None:
    """The same updates and step times with and without group averaging (group size 1, no global step): the group
    averages mix the replicas, so they end much closer together. With no updates, whatever the interleaving, the
    wait-avoiding rounds compute exactly the synchronous group averages (every rank's published weights are
    current)."""
    replicas = {size: _make_params(rank) for size in (1, group_size)}
    updates = _updates(rank, seed, 4 * group_schedule_length(world_size, group_size) + 2, replicas[1])
    spreads = {}
    for size, params in replicas.items():
        averager = GroupModelAverager(size, global_period=10**6)
        _train_with_delays(averager, params, updates, rank, seed)
        averager.finish(params)
        rows = _gather_rows(params)
        spreads[size] = float((rows - rows.mean(0)).square().mean().sqrt())
    assert spreads[group_size] < 0.5 * spreads[1], spreads

    stale = GroupModelAverager(group_size, global_period=10**6)
    synchronous = GroupModelAverager(group_size, global_period=10**6, wait_avoiding=False)
    stale_params, sync_params = _make_params(rank), _make_params(rank)
    for step in range(3 * group_schedule_length(world_size, group_size)):
        _delay(rank, step, seed, probability=0.5)
        stale.average_parameters(stale_params)
        synchronous.average_parameters(sync_params)
    stale.finish(stale_params)
    torch.testing.assert_close(_gather_rows(stale_params), _gather_rows(sync_params), rtol=1e-12, atol=1e-12)


def _check_straggler_delays_nobody(rank: int, world_size: int, group_size: int) -> None:
    """Rank 0 stalls for 1.5 s in step 1; the other ranks' group steps do not wait for it (with synchronous group
    averages its partners would, and through the rotating groups everyone), the global step waits for everyone,
    and the sum over ranks is kept."""
    steps = 6
    averager = GroupModelAverager(group_size, global_period=steps)
    params = _make_params(rank)
    updates = _updates(rank, 0, steps, params)
    expected = _gather_rows(params).sum(0) + _summed_updates(updates).sum(0)
    dist.barrier()
    started = time.monotonic()
    with torch.no_grad():
        for step, update in enumerate(updates):
            if rank == 0 and step == 1:
                time.sleep(1.5)
            torch._foreach_add_(params, update)
            averager.average_parameters(params)
            if step == steps - 2:
                group_steps_took = time.monotonic() - started
    if rank != 0:
        assert group_steps_took < 1.0, f"rank {rank} waited {group_steps_took:.2f} s for the straggler"
    assert time.monotonic() - started >= 1.5  # the global step waits for it
    averager.finish(params)
    torch.testing.assert_close(_gather_rows(params).sum(0), expected, rtol=1e-12, atol=1e-12)


def _check_errors_reach_every_rank(rank: int, world_size: int, group_size: int) -> None:
    """Bad parameters on one rank in the middle of a run, finish() at different steps, and a rank that does not
    reach a global step within the timeout: every rank raises (none hangs), and the averager stays stopped."""
    params = _make_params(rank)
    averager = GroupModelAverager(group_size, global_period=5)
    raised, last = None, world_size - 1
    for step in range(8):
        try:
            averager.average_parameters(params if (rank, step) != (last, 2) else params[:2])
        except (ValueError, RuntimeError) as exc:
            raised = exc
            break
    if rank == last:
        assert isinstance(raised, ValueError) and "different parameters" in str(raised), raised
    else:
        assert isinstance(raised, RuntimeError) and f"rank {last} stopped" in str(raised), raised
        assert step <= 4  # at the latest at the global step
    with pytest.raises(RuntimeError, match="stopped"):
        averager.finish(params)

    averager = GroupModelAverager(group_size, global_period=100)
    for _ in range(3 + (rank == 0)):
        averager.average_parameters(params)
    with pytest.raises(RuntimeError, match=r"different steps|rank \d stopped") as raised:
        averager.finish(params)
    found = [None] * world_size
    dist.all_gather_object(found, "different steps" in str(raised.value))
    assert any(found)  # where the ranks found it; the others learn that those stopped

    averager = GroupModelAverager(group_size, global_period=2, timeout=0.5)
    averager.average_parameters(params)
    if rank == 0:
        time.sleep(2.0)
        with pytest.raises(RuntimeError, match=r"rank \d stopped"):  # its global round may still complete
            averager.average_parameters(params)
            averager.finish(params)
    else:
        with pytest.raises((TimeoutError, RuntimeError), match=r"timeout=0.5|rank \d stopped"):
            averager.average_parameters(params)
    dist.barrier()


def _check_resume(rank: int, world_size: int, group_size: int, seed: int) -> None:
    """Synchronous mode: checkpointing the averager's step and resuming in a new averager reproduces the
    uninterrupted run bitwise. Wait-avoiding mode: state_dict() in the middle of a run (rounds in flight, random
    step times) saves the averages the weights do not hold yet, so weights + state resume with nothing lost: the
    sum over ranks after the resumed run's finish() is the saved sum plus every later update. A state of another
    group size, or a correction that does not fit the parameters, is refused."""
    def run(params, averager, steps):
        for step in steps:
            _local_progress(params, seed=1000 * step + rank)
            averager.average_parameters(params)

    uninterrupted = _make_params(rank)
    averager = GroupModelAverager(group_size, global_period=4, wait_avoiding=False)
    run(uninterrupted, averager, range(11))
    first_half = _make_params(rank)
    averager = GroupModelAverager(group_size, global_period=4, wait_avoiding=False)
    run(first_half, averager, range(5))
    saved_weights, saved_state = [p.detach().clone() for p in first_half], averager.state_dict()
    assert saved_state["step"] == 5
    resumed = [torch.nn.Parameter(w) for w in saved_weights]
    averager = GroupModelAverager(group_size, global_period=4, wait_avoiding=False)
    averager.load_state_dict(saved_state)
    run(resumed, averager, range(5, 11))
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b), "resumed run differs from the uninterrupted one"
    with pytest.raises(ValueError, match="group_size"):
        averager.load_state_dict({**saved_state, "group_size": group_size * 2})

    params = _make_params(rank)
    updates = _updates(rank, seed, 12, params)
    averager = GroupModelAverager(group_size, global_period=5)
    _train_with_delays(averager, params, updates[:7], rank, seed)
    state = averager.state_dict()
    assert state["step"] == 7 and len(state["correction"]) == 1
    saved = _gather_rows(params).sum(0) + _gather_rows(state["correction"]).sum(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    averager = GroupModelAverager(group_size, global_period=5)
    with pytest.raises(ValueError, match="correction"):
        averager.load_state_dict({**state, "correction": [torch.zeros(3, dtype=torch.float64)]})
        averager.average_parameters(resumed)
    averager = GroupModelAverager(group_size, global_period=5)
    averager.load_state_dict(state)
    _train_with_delays(averager, resumed, updates[7:], rank, seed + 1)
    averager.finish(resumed)
    torch.testing.assert_close(_gather_rows(resumed).sum(0), saved + _summed_updates(updates[7:]).sum(0),
                               rtol=1e-12, atol=1e-12)


def _check_bad_input(rank: int, world_size: int) -> None:
    """Bad arguments and parameters fail clearly on every rank (no hang), in both modes; in wait-avoiding mode the
    error also stops the averager (on every rank: the others would wait for this one)."""
    for bad in (3, 0, 2 * world_size):
        with pytest.raises(ValueError, match=rf"group_size must divide the process group's size {world_size}"):
            GroupModelAverager(bad, global_period=4)
    with pytest.raises(ValueError, match="global_period"):
        GroupModelAverager(2, global_period=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        GroupModelAverager(2, global_period=4, warmup_steps=-1)
    with pytest.raises(ValueError, match="timeout"):
        GroupModelAverager(2, global_period=4, timeout=0)
    shapes = [(4,), (3,)] if rank == 0 else [(4,), (2,)]
    for wait_avoiding in (False, True):
        cases = [
            (TypeError, r"params\[0\] has dtype torch.int64", [[torch.zeros(3, dtype=torch.int64)]]),
            (ValueError, "params is empty", [[]]),
            # different shapes on one rank are found by the first call's layout check, on every rank
            (ValueError, "same parameters .* on every rank", [[torch.zeros(s) for s in shapes]]),
            (ValueError, "different parameters .* than on its first call",
             [[torch.zeros(4), torch.zeros(3)], [torch.zeros(4), torch.zeros(2)]]),
        ]
        for error, message, calls in cases:
            averager = GroupModelAverager(2, global_period=4, wait_avoiding=wait_avoiding)
            for params in calls[:-1]:
                averager.average_parameters(params)
            with pytest.raises(error, match=message):
                averager.average_parameters(calls[-1])
            if wait_avoiding:
                with pytest.raises(RuntimeError, match="stopped"):
                    averager.finish(calls[0])


def _check_training(rank: int, world_size: int, group_size: int) -> None:
    """A real model with Adam and its param_groups: global steps leave every rank's model bitwise equal."""
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    averager = GroupModelAverager(group_size, global_period=3, warmup_steps=1)
    data = torch.randn(16, 6, generator=torch.Generator().manual_seed(rank))
    for step in range(7):
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()
        averager.average_parameters(optimizer.param_groups)
        if averager.is_global_step(step):
            _assert_all_equal(_gather_rows(list(model.parameters())))


def _check_subgroup(rank: int, world_size: int) -> None:
    """A process_group of the odd ranks: its members average among themselves, the others are untouched."""
    members = [r for r in range(world_size) if r % 2 == 1]
    process_group = dist.new_group(members)
    averager = GroupModelAverager(2, global_period=3, process_group=process_group, wait_avoiding=False)
    params = _make_params(rank)
    untouched = [p.detach().clone() for p in params]
    for step in range(3):
        if rank in members:
            before = _gather_rows(params, process_group)
        averager.average_parameters(params)
        if rank not in members:
            assert all(torch.equal(p, q) for p, q in zip(params, untouched))
            continue
        after = _gather_rows(params, process_group)
        if averager.is_global_step(step):
            _assert_all_equal(after)
        else:
            _assert_group_step(before, after, butterfly_groups(len(members), 2, averager.group_round(step)))
        _local_progress(params, seed=1000 * step + rank)


def _all_checks(rank: int, world_size: int, group_sizes: tuple[int, ...], seeds: int) -> bool:
    for group_size in group_sizes:
        _check_synchronous_steps(rank, world_size, group_size)
        for seed in range(seeds):
            _check_wait_avoiding_conservation(rank, world_size, group_size, seed)
        if group_size > 1:
            _check_wait_avoiding_mixing(rank, world_size, group_size, seeds)
        _check_straggler_delays_nobody(rank, world_size, group_size)
        _check_errors_reach_every_rank(rank, world_size, group_size)
        _check_resume(rank, world_size, group_size, seeds)
        _check_training(rank, world_size, group_size)
    _check_bad_input(rank, world_size)
    if world_size >= 4:
        _check_subgroup(rank, world_size)
    return True


@pytest.mark.parametrize("world_size,group_sizes,seeds", [(2, (1, 2), 3), (4, (2, 4), 3), (8, (2, 4), 1)])
def test_group_model_averager(world_size: int, group_sizes: tuple[int, ...], seeds: int) -> None:
    """Every check in one spawn per world size; random step times with ``seeds`` seeds per group size (one at 8
    ranks, where 8 processes share the machine's cores: the seeds' variety is the smaller worlds')."""
    assert all(run_distributed(_all_checks, world_size, group_sizes, seeds, timeout=240))
