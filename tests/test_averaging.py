"""WAGMA group model averaging: the butterfly schedule as a pure function, and GroupModelAverager on real Gloo
process groups (P = 4 and 8, group sizes 2 and 4; every distributed check runs inside one spawn per P)."""

from __future__ import annotations

import math

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


def _check_wait_avoiding_steps(rank: int, world_size: int, group_size: int) -> None:
    """The group mean of step t's snapshot is applied at step t+1 as x + (mean(s_t) - s_t): no rank's progress is
    lost (the sum over ranks only changes by the local updates) and a global step makes all ranks bitwise equal."""
    global_period = 2 * group_schedule_length(world_size, group_size) + 1
    averager = GroupModelAverager(group_size, global_period=global_period)
    params = _make_params(rank)
    snapshot_rows = None  # every rank's weights right after the previous call: the snapshot sent then
    previous_groups = None
    for step in range(2 * global_period + 1):
        _local_progress(params, seed=1000 * step + rank)
        before = _gather_rows(params)
        averager.average_parameters(params)
        after = _gather_rows(params)
        torch.testing.assert_close(after.sum(0), before.sum(0), rtol=1e-12, atol=1e-12)
        expected = before.clone()
        if previous_groups is not None:  # apply the previous group round's average, one step late
            for group in previous_groups:
                expected[group] += snapshot_rows[group].mean(0) - snapshot_rows[group]
        if averager.is_global_step(step):
            _assert_all_equal(after)
            expected[:] = expected.mean(0)
            previous_groups = None
        else:
            previous_groups = butterfly_groups(world_size, group_size, averager.group_round(step))
        torch.testing.assert_close(after, expected, rtol=1e-12, atol=1e-12)
        snapshot_rows = after
    # finish() applies the last in-flight average at once, and a second finish() does nothing.
    averager.average_parameters(params)
    in_flight = _gather_rows(params)
    averager.finish(params)
    finished = _gather_rows(params)
    averager.finish(params)
    assert torch.equal(_gather_rows(params), finished)
    expected = in_flight.clone()
    for group in butterfly_groups(world_size, group_size, averager.group_round(averager.step - 1)):
        expected[group] = in_flight[group].mean(0)
    torch.testing.assert_close(finished, expected, rtol=1e-12, atol=1e-12)


def _check_wait_avoiding_consensus(rank: int, world_size: int, group_size: int) -> None:
    """With no local progress (zero learning rate) and no global step, wait-avoiding group averaging drives the
    ranks to the global mean, each step one step behind the synchronous averager; 60 steps never deadlock."""
    stale = GroupModelAverager(group_size, global_period=10**6, wait_avoiding=True)
    synchronous = GroupModelAverager(group_size, global_period=10**6, wait_avoiding=False)
    stale_params, sync_params = _make_params(rank), _make_params(rank)
    initial = _gather_rows(stale_params)
    sync_history = [initial]
    for _ in range(60):
        stale.average_parameters(stale_params)
        synchronous.average_parameters(sync_params)
        sync_history.append(_gather_rows(sync_params))
        torch.testing.assert_close(_gather_rows(stale_params), sync_history[-2], rtol=1e-12, atol=1e-12)
    stale.finish(stale_params)
    final = _gather_rows(stale_params)
    torch.testing.assert_close(final.mean(0), initial.mean(0), rtol=1e-12, atol=1e-12)
    spread = (final - final.mean(0)).abs().max() / (initial - initial.mean(0)).abs().max()
    assert spread < 1e-9, f"ranks did not reach consensus: relative spread {float(spread)}"


def _check_resume(rank: int, world_size: int, group_size: int) -> None:
    """Checkpointing the averager's step (after finish) and resuming in a new averager reproduces the
    uninterrupted run bitwise; a state of another group size is refused."""
    def run(params, averager, steps):
        for step in steps:
            _local_progress(params, seed=1000 * step + rank)
            averager.average_parameters(params)

    uninterrupted = _make_params(rank)
    averager = GroupModelAverager(group_size, global_period=4)
    run(uninterrupted, averager, range(5))
    averager.finish(uninterrupted)
    run(uninterrupted, averager, range(5, 11))

    first_half = _make_params(rank)
    averager = GroupModelAverager(group_size, global_period=4)
    run(first_half, averager, range(5))
    averager.finish(first_half)
    saved_weights, saved_state = [p.detach().clone() for p in first_half], averager.state_dict()
    assert saved_state["step"] == 5
    resumed = [torch.nn.Parameter(w) for w in saved_weights]
    averager = GroupModelAverager(group_size, global_period=4)
    averager.load_state_dict(saved_state)
    run(resumed, averager, range(5, 11))
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b), "resumed run differs from the uninterrupted one"
    with pytest.raises(ValueError, match="group_size"):
        averager.load_state_dict({**saved_state, "group_size": group_size * 2})


def _check_bad_input(rank: int, world_size: int) -> None:
    """Bad group sizes and parameters fail clearly on every rank (no hang)."""
    for bad in (3, 0, 2 * world_size):
        with pytest.raises(ValueError, match=rf"group_size must divide the process group's size {world_size}"):
            GroupModelAverager(bad, global_period=4)
    with pytest.raises(ValueError, match="global_period"):
        GroupModelAverager(2, global_period=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        GroupModelAverager(2, global_period=4, warmup_steps=-1)
    averager = GroupModelAverager(2, global_period=4)
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.int64"):
        averager.average_parameters([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="params is empty"):
        averager.average_parameters([])
    # Different shapes on one rank are found by the first call's layout check, on every rank.
    shapes = [(4,), (3,)] if rank == 0 else [(4,), (2,)]
    with pytest.raises(ValueError, match="same parameters .* on every rank"):
        averager.average_parameters([torch.zeros(s) for s in shapes])
    averager = GroupModelAverager(2, global_period=4)
    averager.average_parameters([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="different parameters .* than on its first call"):
        averager.average_parameters([torch.zeros(4), torch.zeros(2)])


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


def _all_checks(rank: int, world_size: int, group_sizes: tuple[int, ...]) -> bool:
    for group_size in group_sizes:
        _check_synchronous_steps(rank, world_size, group_size)
        _check_wait_avoiding_steps(rank, world_size, group_size)
        _check_wait_avoiding_consensus(rank, world_size, group_size)
        _check_resume(rank, world_size, group_size)
        _check_training(rank, world_size, group_size)
    _check_bad_input(rank, world_size)
    if world_size >= 4:
        _check_subgroup(rank, world_size)
    return True


@pytest.mark.parametrize("world_size", [4, 8])
def test_group_model_averager(world_size: int) -> None:
    assert all(run_distributed(_all_checks, world_size, (2, 4), timeout=150))
