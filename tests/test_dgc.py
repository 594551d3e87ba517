"""Deep Gradient Compression's techniques in the hook, on real Gloo groups of 2 and 3 ranks.

Momentum correction and momentum factor masking against a plain-Python replay of the algorithm: per rank, a
velocity u and an accumulator v, ``g += wd * w``, ``u = m * u + g``, ``v += u`` (Nesterov: ``v += g + m * u``),
the top-k of v sent, the slots applied cleared in v and u (in u from ``masking_start_iter`` on), the dropped ones
back in v; dense warm-up steps send u and keep it. Local clipping, per-tensor selection and the exponential warm-up.
"""

import pytest
import torch
import torch.distributed as dist

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from hypothesis import given, settings
from hypothesis import strategies as st

from gtopk_ext.compressors import tensor_shares
from tests.distributed import run_distributed
from tests.replay import differs, exchange_topk, imbalance

NUMEL, DENSITY, START_ITER, STEPS = 300, 0.05, 2, 7
SHAPES = [(200,), (100,)]  # two parameters in one bucket


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))


def parameters() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def replay(group, rank: int, size: int, collective: str, momentum: float, nesterov: bool, decay: float,
           masking_start: int):
    """The algorithm in plain PyTorch, one rank's view: per step (output, u, v), and what entered v in total."""
    weights = torch.cat([p.reshape(-1) for p in parameters()])
    u, v, entered, k = torch.zeros(NUMEL), torch.zeros(NUMEL), torch.zeros(NUMEL, dtype=torch.float64), 15
    steps = []
    for step in range(STEPS):
        g = gradient(step, rank) + decay * weights
        u = momentum * u + g
        increment = g + momentum * u if nesterov else u.clone()
        if step < START_ITER:
            output = increment / size
            dist.all_reduce(output, group=group)
        else:
            entered += increment.double()
            v = v + increment
            output, indices, applied = exchange_topk(v, k, group, size, collective)
            if step >= masking_start:
                u[indices[applied]] = 0
        steps.append((output, u.clone(), v.clone()))
    return steps, entered


def check(group, rank: int, size: int) -> list[str]:
    failures = []
    for collective in ("gtopk", "allgather"):
        for momentum, nesterov, decay, masking_start in ((0.9, False, 0.0, 0), (0.9, True, 1e-2, 0),
                                                         (0.5, False, 1e-3, 0), (0.9, False, 0.0, 5)):
            where = f"P={size} {collective} m={momentum} nesterov={nesterov} wd={decay} masking from {masking_start}"
            state = gx.SparseGradState(group, density=DENSITY, compressor="topk", collective=collective,
                                       start_iter=START_ITER,
                                       path=gx.PathPolicy("sparse", min_compress_numel=1), stats_logging_frequency=0,
                                       momentum=gx.MomentumCorrection(momentum, nesterov=nesterov, weight_decay=decay,
                                                                      masking_start_iter=masking_start))
            params = parameters()
            expected, entered = replay(group, rank, size, collective, momentum, nesterov, decay, masking_start)
            applied = torch.zeros(NUMEL, dtype=torch.float64)
            for step, (output, u, v) in enumerate(expected):
                got = reduce_buffer(state, gradient(step, rank), 0, parameters=params).wait()
                off = differs(state, got, output, u, v, "u", 1e-5)
                if off:
                    failures.append(f"{where}, step {step}: {off}")
                    break
                if step >= START_ITER:
                    applied += size * got.double()
            # Conserved: what entered every rank's v = what was applied + what the v keep.
            lost = imbalance(entered, applied, state, group)
            if not lost <= 1e-4:  # a NaN fails too
                failures.append(f"{where}: entered != applied + kept by {lost:.3g}")
    # Local clipping: each rank's bucket scaled to an L2 norm of at most clip_norm / sqrt(P), on every path.
    clip_norm = 5.0
    for collective, extra in (("dense", {}), ("gtopk", {"density": 1.0, "start_iter": 0, "error_feedback": False})):
        state = gx.SparseGradState(group, collective=collective, stats_logging_frequency=0, **extra, path="sparse",
                                   momentum=gx.MomentumCorrection(0.0, clip_norm=clip_norm))
        grad = gradient(0, rank) * (rank + 1)  # norms about 17, 35, 52: all above the limit
        limit = clip_norm / size ** 0.5
        expected = grad * min(1.0, limit / (float(grad.norm()) + 1e-6)) / size
        dist.all_reduce(expected, group=group)
        got = reduce_buffer(state, grad.clone(), 0).wait()
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            failures.append(f"P={size} {collective} clip_norm: off by {float((got - expected).abs().max()):.3g}")
    # Per-tensor selection: a parameter of gradients 1000x smaller still sends its share of k (allgather applies
    # it; gTop-k's merges rank the whole bucket, so they send it back to the residual), nothing is lost.
    for collective in ("gtopk", "allgather"):
        # start_iter=0 with error feedback: bare buckets that never change, so compressing from the first step is
        # safe (SparseGradState refuses it for DDP's buckets).
        state = gx.SparseGradState(group, density=0.1, collective=collective,
                                   path=gx.PathPolicy("sparse", min_compress_numel=1),
                                   compressor=gx.make_compressor("gaussiank", 0.1, per_tensor=True),
                                   stats_logging_frequency=0)
        state.config = state.config.replace(start_iter=0)
        params, sent, entered = parameters(), torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(NUMEL)
        for step in range(3):
            grad = gradient(step, rank)
            grad[200:] *= 1e-3
            entered += grad
            output = reduce_buffer(state, grad, 0, parameters=params).wait()
            sent += size * output.double()
            small = int((output[200:] != 0).sum())
            if collective == "allgather" and small < tensor_shares(30, [200, 100])[1]:
                failures.append(f"P={size} {collective} per_tensor: only {small} of the small parameter's "
                                f"elements applied at step {step}")
        total = torch.stack([entered.double(), state.store.residuals[0].double()])
        dist.all_reduce(total, group=group)
        if float((total[0] - sent - total[1]).abs().max()) > 1e-4:
            failures.append(f"P={size} {collective} per_tensor: gradient lost")
    # Momentum 0 is today's hook, bit for bit.
    plain = gx.SparseGradState(group, density=DENSITY, start_iter=START_ITER, stats_logging_frequency=0, path="sparse")
    zero = gx.SparseGradState(group, density=DENSITY, start_iter=START_ITER, stats_logging_frequency=0, momentum=0.0,
                              path="sparse")
    for step in range(4):
        a = reduce_buffer(plain, gradient(step, rank), 0).wait()
        b = reduce_buffer(zero, gradient(step, rank), 0).wait()
        if not torch.equal(a, b) or zero.store.tensors["velocity"]:
            failures.append(f"P={size}: momentum=0 differs from the default at step {step}")
            break
    return failures


def momentum_worker(rank: int, world_size: int) -> list[str]:
    failures = []
    for size in (2, 3):
        group = dist.new_group(list(range(size)))
        if rank < size:
            failures += check(group, rank, size)
    return failures


def test_momentum_correction_matches_the_algorithm_and_conserves():
    results = run_distributed(momentum_worker, 3, timeout=300)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("kwargs, pattern", [
    ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\)"),
    ({"momentum": -0.1}, r"momentum must be a number in \[0, 1\)"),
    ({"momentum": 0.0, "nesterov": True}, "nesterov=True needs momentum > 0"),
    ({"momentum": 0.9, "weight_decay": -1e-4}, r"weight_decay must be a number in \[0, inf\)"),
    ({"momentum": 0.0, "clip_norm": 0.0}, r"clip_norm must be a number in \(0, inf\)"),
    ({"momentum": 0.9, "masking_start_iter": -1}, "masking_start_iter must be an int >= 0"),
])
def test_bad_momentum_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        gx.MomentumCorrection(**kwargs)
    if "momentum" in kwargs and len(kwargs) == 1:  # a number as the state's momentum is MomentumCorrection(number)
        with pytest.raises(ValueError, match=pattern):
            gx.SparseGradState(momentum=kwargs["momentum"], path="sparse")


def test_exponential_warmup_is_dgcs_schedule():
    schedule = gx.exponential_warmup(0.001, 400)
    assert [start for start, _ in schedule] == [0, 100, 200, 300, 400]
    for (_, density), dgc in zip(schedule, (0.25, 0.0625, 0.015625, 0.00390625, 0.001)):
        assert density == pytest.approx(dgc, rel=0.02)  # geometric: within 2% of the paper's rounded values
    state = gx.SparseGradState(density=schedule, path="sparse")
    assert state.config.density_at(99) == pytest.approx(0.25) and state.config.density_at(10**6) == pytest.approx(0.001)
    assert gx.exponential_warmup(0.01, 40, start_iter=2)[1] == (12, pytest.approx(0.25 * 0.04 ** 0.25))
    assert gx.exponential_warmup(0.01, 0) == [(0, 0.01)] and gx.exponential_warmup(0.5, 10) == [(0, 0.5)]
    # fewer iterations than stages: stages share a start, and the later one holds, so the target is reached
    short = gx.SparseGradState(density=gx.exponential_warmup(0.01, 2), path="sparse")
    assert [short.config.density_at(i) for i in (0, 1, 2, 3)] == [pytest.approx(0.25 * 0.04 ** 0.25), 0.05, 0.01, 0.01]
    given = gx.SparseGradState(density=[(5, 0.1), (0, 0.5), (5, 0.2)], path="sparse")
    assert [given.config.density_at(i) for i in (0, 4, 5)] == [0.5, 0.5, 0.2]
    with pytest.raises(ValueError, match="warmup_iters must be an int >= 0"):
        gx.exponential_warmup(0.001, -1)
    with pytest.raises(ValueError, match="final_density must be a number in"):
        gx.exponential_warmup(0.0, 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.data())
def test_tensor_shares_split_k_exactly(numels, data):
    k = data.draw(st.integers(1, sum(numels)))
    shares = tensor_shares(k, numels)
    assert sum(shares) == k
    assert all(0 <= s <= n for s, n in zip(shares, numels))
    if k >= len(numels):
        assert min(shares) >= 1
    exact = [k * n / sum(numels) for n in numels]
    assert all(abs(s - e) < len(numels) + 1 for s, e in zip(shares, exact))
