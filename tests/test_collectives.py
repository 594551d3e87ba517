"""Sparse collectives, and the hook's reduction of a bucket (SparseGradState.reduce, what sparse_grad_hook
calls), on real Gloo process groups of 1 to 8 ranks, against plain-Python oracles.

Every rank builds every rank's message (deterministic data and compressors), so each rank can replay the whole
collective in plain Python and compare its own result bit for bit. Starting processes is the expensive part, so
one spawn of 8 processes runs every world size, each as a process group of its first P ranks (plus a strided
group whose group ranks differ from the global ones). tests/test_hook.py has the DDP-level tests.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from gtopk_ext import ops, reference, torch_kernels
from gtopk_ext.collectives import Traffic, _transport
from tests.distributed import run_distributed

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# ----- plain-Python oracles -----


def slots(indices: torch.Tensor, values: torch.Tensor) -> list[tuple[int, float]]:
    return list(zip(indices.tolist(), values.float().tolist()))


def oracle_merge(a: list[tuple[int, float]], b: list[tuple[int, float]], k: int,
                 dtype: torch.dtype) -> tuple[list[tuple[int, float]], int]:
    """reference.merge_topk on slot lists: (slots, union size)."""
    def tensors(slot_list):
        return (torch.tensor([i for i, _ in slot_list], dtype=torch.int32),
                torch.tensor([v for _, v in slot_list], dtype=torch.float32).to(dtype))

    indices, values, union = reference.merge_topk(*tensors(a), *tensors(b), k)
    return slots(indices, values), int(union)


def oracle_gtopk(messages: list[gx.SparseMessage]) -> tuple[list[tuple[int, float]], int, list[list[bool]]]:
    """Replays the butterfly (fold the ranks past the largest power of two, then XOR rounds), tracking which
    ranks' contributions each set holds. Returns (glob slots, union size of the last merge, applied per rank)."""
    size, k, dtype = len(messages), messages[0].k, messages[0].values.dtype
    if dtype == torch.float16:  # float16 sums travel in float32: they may leave float16's range
        dtype = torch.float32
    sets = [slots(m.indices, m.values) for m in messages]
    applied = [[True] * k for _ in range(size)]
    holders = [{r} for r in range(size)]  # the ranks whose contributions set r holds
    union = int(messages[0].count)

    def survive(contributors, kept):
        kept_indices = {i for i, _ in kept}
        for c in contributors:
            own_slots = slots(messages[c].indices, messages[c].values)
            applied[c] = [a and i in kept_indices for a, (i, _) in zip(applied[c], own_slots)]

    butterfly = 1 << (size.bit_length() - 1)
    for extra in range(butterfly, size):
        partner = extra - butterfly
        sets[partner], union = oracle_merge(sets[partner], sets[extra], k, dtype)
        holders[partner] |= holders[extra]
        survive(holders[partner], sets[partner])
    bit = 1
    while bit < butterfly:
        merged = {}
        for r in range(butterfly):
            low, high = min(r, r ^ bit), max(r, r ^ bit)
            merged[r] = oracle_merge(sets[low], sets[high], k, dtype)
        new_holders = {r: holders[r] | holders[r ^ bit] for r in range(butterfly)}
        for r in range(butterfly):
            sets[r], union = merged[r]
            if r < r ^ bit:
                survive(new_holders[r], sets[r])
        for r in range(butterfly):
            holders[r] = new_holders[r]
        bit <<= 1
    assert all(sets[r] == sets[0] for r in range(butterfly))
    return sets[0], union, applied


# ----- the merge on its own -----

index_lists = st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True).map(sorted)
value_choices = st.sampled_from([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 0.0, 3.25])


MERGES = {"cpp": ops.merge_topk, "torch": torch_kernels.merge_topk}  # the CPU kernel, and what GPUs run


def assert_merge_matches_reference(ia, va, ib, vb, k):
    expected = reference.merge_topk(ia, va, ib, vb, k)
    for name, merge in MERGES.items():
        got = merge(ia, va, ib, vb, k)
        assert got[0].dtype == torch.int32 and got[1].dtype == va.dtype and got[2].dtype == torch.int32, name
        for actual, want in zip(got, expected):
            torch.testing.assert_close(actual, want, rtol=0, atol=0, equal_nan=True, msg=name)


@settings(max_examples=200, deadline=None)
@given(a=index_lists, b=index_lists, k=st.integers(1, 16), data=st.data(),
       dtype=st.sampled_from(DTYPES), pad_a=st.integers(0, 3))
def test_merge_topk_matches_oracle(a, b, k, data, dtype, pad_a):
    """Messages as collectives see them (ascending, then padding): few distinct magnitudes, so many ties,
    which must go to the lower index; padding joins index 0."""
    values_a = data.draw(st.lists(value_choices, min_size=len(a), max_size=len(a)))
    values_b = data.draw(st.lists(value_choices, min_size=len(b), max_size=len(b)))
    ia = torch.tensor(a + [0] * pad_a, dtype=torch.int32)
    va = torch.tensor(values_a + [0.0] * pad_a).to(dtype)
    ib, vb = torch.tensor(b, dtype=torch.int32), torch.tensor(values_b).to(dtype)
    assert_merge_matches_reference(ia, va, ib, vb, k)
    indices, values, _ = ops.merge_topk(ia, va, ib, vb, k)
    swapped = ops.merge_topk(ib, vb, ia, va, k)  # the sum of two is symmetric: same set either way
    assert torch.equal(swapped[0], indices) and torch.equal(swapped[1], values)


any_values = st.one_of(st.floats(-4, 4, width=32), st.sampled_from([0.0, -0.0, float("nan"), float("inf")]))


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(-5, 40), max_size=14), b=st.lists(st.integers(-5, 40), max_size=14),
       k=st.integers(1, 16), data=st.data(), dtype=st.sampled_from(DTYPES))
def test_merge_topk_any_slots(a, b, k, data, dtype):
    """Any slots: unsorted, repeated or negative indices, empty sets, NaN, inf and signed zeros."""
    ia, ib = torch.tensor(a, dtype=torch.int32), torch.tensor(b, dtype=torch.int32)
    va = torch.tensor(data.draw(st.lists(any_values, min_size=len(a), max_size=len(a))), dtype=torch.float32)
    vb = torch.tensor(data.draw(st.lists(any_values, min_size=len(b), max_size=len(b))), dtype=torch.float32)
    assert_merge_matches_reference(ia, va.to(dtype), ib, vb.to(dtype), k)


def test_merge_topk_large_sets_and_bad_arguments():
    generator = torch.Generator().manual_seed(21)
    for k in (1, 1000, 50_000):
        ia = torch.randperm(20 * k, generator=generator)[:k].sort().values.int()
        ib = torch.randperm(20 * k, generator=generator)[: k // 2].sort().values.int()
        ib = torch.cat([ib, torch.zeros(k - ib.numel(), dtype=torch.int32)])  # padded, as after a small union
        va, vb = torch.randn(k, generator=generator), torch.randn(k, generator=generator)
        vb[k // 2:] = 0.0
        for actual, want in zip(ops.merge_topk(ia, va, ib, vb, k), torch_kernels.merge_topk(ia, va, ib, vb, k)):
            assert torch.equal(actual, want), k
    idx, val = torch.zeros(4, dtype=torch.int32), torch.zeros(4)
    for args, message in (((idx.long(), val, idx, val, 4), "indices_a must be a 1-D int32 tensor"),
                          ((idx, val, idx, val.half(), 4), "values_b must have values_a's dtype"),
                          ((idx, val[:3], idx, val, 4), "values_a must have indices_a's shape"),
                          ((idx, val.int(), idx, val, 4), "values_a must be float32, float16 or bfloat16"),
                          ((idx, val, idx, val, 0), "k must be >= 1")):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.gtopk_ext.merge_topk(*args)


# ----- on real process groups -----


@dataclass
class Members:
    """A process group and where this process sits in it."""

    group: dist.ProcessGroup
    ranks: list[int]  # global ranks, in group-rank order (new_group sorts them)
    me: int  # this process's group rank
    name: str

    @property
    def size(self) -> int:
        return len(self.ranks)


def case_data(case: int, rank: int, numel: int, dtype: torch.dtype, shape: str) -> torch.Tensor:
    """A rank's gradient: a shared component plus noise (top-k sets overlap), or few values (ties)."""
    if shape == "ties":
        generator = torch.Generator().manual_seed(3000 + 100 * case + rank)
        return torch.randint(-2, 3, (numel,), generator=generator).to(dtype)
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + case))
    own = torch.randn(numel, generator=torch.Generator().manual_seed(2000 + 100 * case + rank))
    return (shared + 0.5 * own).to(dtype)


CASES = [  # (kind, density, numel, dtype, shape)
    ("gaussiank", 0.01, 3001, torch.float32, "overlap"),
    ("topk", 0.05, 1000, torch.float32, "ties"),
    ("randomk", 0.02, 2000, torch.float32, "overlap"),
    ("gaussiank", 0.05, 1000, torch.float16, "overlap"),
    ("topk", 0.05, 1000, torch.bfloat16, "overlap"),
    ("topk", 0.5, 5, torch.float32, "overlap"),
    ("gaussiank", 1.0, 1, torch.float32, "overlap"),
    ("gaussiank", 1.0, 300, torch.float32, "overlap"),
]


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


def dense_sum(messages: list[gx.SparseMessage], applied: list[list[bool]] | None = None) -> torch.Tensor:
    total = torch.zeros(messages[0].numel, dtype=torch.float64)
    for r, m in enumerate(messages):
        keep = torch.tensor(applied[r]) if applied is not None else torch.ones(m.k, dtype=torch.bool)
        total.index_add_(0, m.indices.long(), (m.values.double() * keep))
    return total


def equal_on_every_rank(members: Members, *tensors: torch.Tensor) -> bool:
    """Whether every rank of the group holds bitwise the same tensors."""
    mine = torch.cat([t.contiguous().view(-1).view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
                      for t in tensors])
    gathered = [torch.empty_like(mine) for _ in range(members.size)]
    dist.all_gather(gathered, mine, group=members.group)
    return all(torch.equal(g, mine) for g in gathered)


def check_cases(members: Members) -> list[str]:
    failures = []
    for case, (kind, density, numel, dtype, shape) in enumerate(CASES):
        where = f"{members.name}, case {case} ({kind}, {density}, {numel}, {dtype}, {shape})"
        messages = [gx.make_compressor(kind, density).compress(case_data(case, r, numel, dtype, shape), None, step=case)
                    for r in members.ranks]
        mine = messages[members.me]
        total = gx.collectives.sparse_allgather(mine, members.group)
        expected = dense_sum(messages)
        if total.dtype != dtype or not torch.allclose(total.double(), expected, rtol=tolerance(dtype),
                                                      atol=tolerance(dtype) * members.size):
            failures.append(f"{where}: sparse_allgather differs from the dense sum of all messages")

        glob, applied = gx.collectives.gtopk_allreduce(mine, members.group)
        expected_slots, expected_union, expected_applied = oracle_gtopk(messages)
        if slots(glob.indices, glob.values) != expected_slots or int(glob.count) != expected_union:
            failures.append(f"{where}: gtopk glob differs from the replayed butterfly")
        if applied.tolist() != expected_applied[members.me]:
            failures.append(f"{where}: gtopk applied mask differs from the replayed butterfly")
        # Conservation inside the collective: glob is exactly the applied contributions, summed.
        if not torch.allclose(glob.to_dense().double(), dense_sum(messages, expected_applied),
                              rtol=4 * tolerance(dtype), atol=4 * tolerance(dtype) * members.size):
            failures.append(f"{where}: glob is not the sum of the applied contributions")
        if density == 1.0 and not (applied.all() and torch.allclose(glob.to_dense().double(), expected,
                                                                    rtol=tolerance(dtype), atol=tolerance(dtype))):
            failures.append(f"{where}: gtopk at density 1 is not the dense sum")
        if not equal_on_every_rank(members, total, glob.indices, glob.values):
            failures.append(f"{where}: a result differs across ranks")
    return failures


def check_traffic(members: Members) -> list[str]:
    """gTop-k moves O(k log P) bytes per rank (payload: count, k indices, k values), allgather O(kP)."""
    k, numel, size, me = 100, 10000, members.size, members.me
    msg = gx.make_compressor("topk", k / numel).compress(case_data(0, me, numel, torch.float32, "overlap"))
    payload = 4 + 8 * k
    gtopk, allgather = Traffic(), Traffic()
    gx.collectives.gtopk_allreduce(msg, members.group, check=False, traffic=gtopk)
    gx.collectives.sparse_allgather(msg, members.group, check=False, traffic=allgather)
    butterfly = 1 << (size.bit_length() - 1)
    rounds = butterfly.bit_length() - 1
    mask = (k + 7) // 8  # the applied mask of a folded rank, a bit per slot
    if me >= butterfly:  # folded: sends its set, receives the result and its applied mask
        expected = (payload, payload + mask)
    else:
        folds = me + butterfly < size
        expected = (rounds * payload + folds * (payload + mask), (rounds + folds) * payload)
    failures = []
    if (gtopk.sent, gtopk.received) != expected:
        failures.append(f"{members.name}: gtopk moved {(gtopk.sent, gtopk.received)} bytes, expected {expected}")
    if allgather.sent != (size - 1) * payload:
        failures.append(f"{members.name}: allgather sent {allgather.sent} bytes, expected {(size - 1) * payload}")
    for name, traffic in (("gtopk", gtopk), ("allgather", allgather)):  # the cost model's mean over the ranks
        total = torch.tensor([float(traffic.sent)], dtype=torch.float64)
        dist.all_reduce(total, group=members.group)
        modelled = gx.collectives.collective_named(name).mean_bytes(numel, k, size, gx.wire.wire_named("plain"))
        if not math.isclose(total.item() / size, modelled):
            failures.append(f"{members.name}: {name} sent {total.item() / size} bytes a rank, its mean_bytes "
                            f"{modelled}")
    return failures


def check_pieces(members: Members) -> list[str]:
    """gTop-k's exchanges of a payload larger than a piece (40,000 pairs: 320 kB, 3 pieces of
    _transport.EXCHANGE_PIECE_BYTES) give bitwise what one message a round gives, plain and compact."""
    numel, k = 100_000, 40_000
    msg = gx.make_compressor("topk", k / numel).compress(case_data(1, members.me, numel, torch.float32, "overlap"))
    failures = []
    for wire in ("plain", "compact"):
        results = []
        for piece_bytes in (_transport.EXCHANGE_PIECE_BYTES, 1 << 40):
            saved, _transport.EXCHANGE_PIECE_BYTES = _transport.EXCHANGE_PIECE_BYTES, piece_bytes
            try:
                results.append(gx.collectives.gtopk_allreduce(msg, members.group, check=False, wire=wire))
            finally:
                _transport.EXCHANGE_PIECE_BYTES = saved
        (glob, applied), (whole_glob, whole_applied) = results
        if not (torch.equal(glob.indices, whole_glob.indices) and torch.equal(glob.values, whole_glob.values)
                and torch.equal(applied, whole_applied)):
            failures.append(f"{members.name}: gtopk on the {wire} wire differs when its messages go in pieces")
    return failures


def expect_error(fn, exception, pattern: str) -> str | None:
    try:
        fn()
    except exception as error:
        return None if re.search(pattern, str(error)) else f"raised {error!r}, not matching {pattern!r}"
    except Exception as error:  # noqa: BLE001 - reported as a failure
        return f"raised {type(error).__name__}: {error}, expected {exception.__name__}"
    return f"did not raise {exception.__name__} matching {pattern!r}"


def check_mismatches(members: Members) -> list[str]:
    """Mismatched or invalid messages fail on every rank with a clear error, and the group stays usable."""
    failures, me, last, group = [], members.me, members.size - 1, members.group
    base = gx.make_compressor("topk", 0.1).compress(case_data(0, me, 100, torch.float32, "overlap"))
    wrong_k = gx.make_compressor("topk", 0.2).compress(case_data(0, me, 100, torch.float32, "overlap"))
    wrong_numel = gx.make_compressor("topk", 0.1).compress(case_data(0, me, 95, torch.float32, "overlap"))  # k 10
    wrong_dtype = gx.make_compressor("topk", 0.1).compress(case_data(0, me, 100, torch.float16, "overlap"))
    broken = gx.SparseMessage(base.values, base.indices.long(), base.count, base.numel)
    outside = gx.SparseMessage(base.values, base.indices + 100, base.count, base.numel)
    for collective in (gx.collectives.sparse_allgather, gx.collectives.gtopk_allreduce):
        for name, odd in (("k", wrong_k), ("numel", wrong_numel), ("dtype", wrong_dtype)):
            msg = odd if me == last else base
            failure = expect_error(lambda: collective(msg, group), ValueError, f"{name} differs across ranks")
            if failure:
                failures.append(f"{members.name}: {collective.__name__} with another {name} on the last rank: "
                                f"{failure}")
        for bad, error, pattern in ((broken, TypeError, r"msg.indices must be int32"),
                                    (outside, ValueError, r"msg.indices must lie in \[0, msg.numel = 100\)")):
            if me == last:
                failure = expect_error(lambda: collective(bad, group), error, pattern)
            else:
                failure = expect_error(lambda: collective(base, group), ValueError,
                                       rf"input of rank\(s\) \[{last}\] was invalid")
            if failure:
                failures.append(f"{members.name}: {collective.__name__} with an invalid message on the last rank: "
                                f"{failure}")
    glob, _ = gx.collectives.gtopk_allreduce(base, group)
    if not equal_on_every_rank(members, glob.values):
        failures.append(f"{members.name}: the group is out of step after the errors")
    return failures


# ----- the hook's reduction of a bucket -----

HOOK_CONFIGS = [  # (compressor, collective, dtype)
    ("gaussiank", "gtopk", torch.float32),
    ("topk", "gtopk", torch.float32),
    ("randomk", "gtopk", torch.float32),
    ("gaussiank", "allgather", torch.float32),
    ("randomk", "allgather", torch.float32),
    ("gaussiank", "gtopk", torch.float16),
    ("topk", "allgather", torch.bfloat16),
]
BUCKET_NUMELS = (3000, 700)  # the second is below min_compress_numel: dense
HOOK_STEPS = 4  # two dense warm-up steps, then two compressed ones (error feedback carried between them)


def bucket_input(rank: int, step: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(10_000 * step + 100 * index + 99))
    own = torch.randn(numel, generator=torch.Generator().manual_seed(10_000 * step + 100 * index + rank))
    return ((shared + own) * 1e-2).to(dtype)


def reduce_and_check_bucket(members: Members, state: gx.SparseGradState, step: int, index: int, numel: int,
                            dtype: torch.dtype, is_last: bool, where: str) -> list[str]:
    """One bucket through SparseGradState.reduce: the output bitwise the same on every rank, and
    sum_r new_residual_r + P * output == sum_r (input_r + old_residual_r) up to rounding."""
    failures = []
    grad = bucket_input(members.me, step, index, numel, dtype)
    old_residual = state.store.residuals.get(index, torch.zeros(numel, dtype=dtype)).clone()
    output = reduce_buffer(state, grad.clone(), index, is_last=is_last).wait()
    new_residual = state.store.residuals.get(index, torch.zeros(numel, dtype=dtype))
    if not equal_on_every_rank(members, output):
        failures.append(f"{where}: the averaged gradient differs across ranks")
    # One allreduce: the imbalance of every element, and the scale it is measured against.
    local = torch.cat([new_residual.double() - grad.double() - old_residual.double(),
                       grad.double().abs() + old_residual.double().abs()])
    dist.all_reduce(local, group=members.group)
    imbalance = float((local[:numel] + members.size * output.double()).abs().max())
    scale = float(local[numel:].max())
    if not imbalance <= 4 * tolerance(dtype) * scale:  # a NaN fails too
        failures.append(f"{where}: conservation broken by {imbalance:.3g} (scale {scale:.3g})")
    return failures


def check_hook_reduce(members: Members) -> list[str]:
    """Through SparseGradState.reduce: bitwise the same output on every rank, and per bucket and step
    sum_r new_residual_r + P * output == sum_r (input_r + old_residual_r) up to rounding."""
    failures, size = [], members.size
    for compressor, collective, dtype in HOOK_CONFIGS:
        state = gx.SparseGradState(members.group, density=0.02, compressor=compressor, collective=collective,
                                   start_iter=2,
                                   path=gx.PathPolicy("sparse", min_compress_numel=1000), stats_logging_frequency=0)
        for step in range(HOOK_STEPS):
            for index, numel in enumerate(BUCKET_NUMELS):
                where = f"{members.name}, {compressor}/{collective}/{dtype}, step {step}, bucket {index}"
                failures += reduce_and_check_bucket(members, state, step, index, numel, dtype,
                                                    index == len(BUCKET_NUMELS) - 1, where)
                expected_path = "sparse" if step >= 2 and numel >= 1000 else "dense"
                stats = state.stats()["buckets"][index]
                expected_k = math.ceil(0.02 * numel) if expected_path == "sparse" else numel
                sent = stats["bytes_sent"] > 0
                if stats["path"] != expected_path or stats["k"] != expected_k or (size > 1) != sent:
                    failures.append(f"{where}: stats {stats} (expected path {expected_path}, k {expected_k})")
    return failures


def check_hook_edge_cases(members: Members) -> list[str]:
    failures, me, last, size, group = [], members.me, members.size - 1, members.size, members.group
    numel = 2000
    # Density 1.0 reproduces the dense average.
    for collective in ("gtopk", "allgather"):
        state = gx.SparseGradState(group, density=1.0, collective=collective, start_iter=0, error_feedback=False,
                                   stats_logging_frequency=0, path="sparse")
        grad = bucket_input(me, 0, 0, numel, torch.float32)
        output = reduce_buffer(state, grad.clone(), 0).wait()
        dense = grad / size
        dist.all_reduce(dense, group=group)
        if not torch.allclose(output, dense, rtol=1e-5, atol=1e-8):
            failures.append(f"{members.name}: {collective} at density 1.0 differs from the dense average")

    # A non-finite bucket on one rank: every rank goes dense, that rank's residual untouched, the others' applied
    # with their gradient (nothing left behind), the inf reaches every rank.
    for collective in ("gtopk", "allgather"):
        state = gx.SparseGradState(group, density=0.05, collective=collective, start_iter=2,
                                   stats_logging_frequency=0, path="sparse")
        for step in range(3):  # two dense steps, one sparse step: a residual to keep
            reduce_buffer(state, bucket_input(me, step, 0, numel, torch.float32), 0).wait()
        residual_before = state.store.residuals[0].clone()
        grad = bucket_input(me, 3, 0, numel, torch.float32)
        if me == last:
            grad[7] = float("inf")
        output = reduce_buffer(state, grad.clone(), 0).wait()
        path = state.stats()["buckets"][0]["path"]
        kept = state.store.residuals[0] if me == last else state.store.residuals.get(0, torch.zeros(numel))
        applied = grad / size + (0 if me == last else residual_before / size)
        dist.all_reduce(applied, group=group)
        expected_kept = residual_before if me == last else torch.zeros(numel)
        finite = torch.isfinite(applied)
        if (path != "nonfinite" or not torch.equal(kept, expected_kept) or not bool(torch.isinf(output[7]))
                or not torch.allclose(output[finite], applied[finite], rtol=1e-5, atol=1e-7)):
            failures.append(f"{members.name} {collective}: non-finite bucket on the last rank: path {path}, residual "
                            f"as expected {torch.equal(kept, expected_kept)}, inf arrived "
                            f"{bool(torch.isinf(output[7]))}")

    # A density schedule picks k per iteration.
    state = gx.SparseGradState(group, density=[(0, 0.01), (3, 0.05)], start_iter=2,
                               stats_logging_frequency=0, path="sparse")
    ks = []
    for step in range(4):
        reduce_buffer(state, bucket_input(me, step, 0, numel, torch.float32), 0).wait()
        ks.append(state.stats()["buckets"][0]["k"])
    if ks != [numel, numel, 20, 100]:
        failures.append(f"{members.name}: density schedule gave k {ks}, expected {[numel, numel, 20, 100]}")

    if size >= 2:  # mismatches fail on every rank, with a clear message, and leave the group usable
        state = gx.SparseGradState(group, density=0.05, start_iter=2, stats_logging_frequency=0, path="sparse")
        odd = numel + 1 if me == last else numel
        failure = expect_error(lambda: reduce_buffer(state, torch.ones(odd), 0).wait(), ValueError,
                               "sparse_grad_hook: numel differs across ranks")
        if failure:
            failures.append(f"{members.name}: buckets of different sizes: {failure}")
        state.iter = 1 if me == last else 0
        failure = expect_error(lambda: reduce_buffer(state, torch.ones(numel), 0).wait(), ValueError,
                               "sparse_grad_hook: iter differs across ranks")
        if failure:
            failures.append(f"{members.name}: states at different iterations: {failure}")
        state.iter = 0
        reduce_buffer(state, torch.ones(numel), 0).wait()
        # Another collective is another protocol: the ranks would wait in different collectives, not raise.
        other = gx.SparseGradState(group, density=0.05, collective="allgather" if me == last else "gtopk",
                                   start_iter=0, stats_logging_frequency=0, path="sparse")
        listing = ", ".join(f"rank {r}: '{'allgather' if r == last else 'gtopk'}'" for r in range(size))
        failure = expect_error(lambda: reduce_buffer(other, torch.ones(numel), 0).wait(), ValueError,
                               re.escape(f"sparse_grad_hook: collective differs across ranks ({listing})"))
        if failure:
            failures.append(f"{members.name}: states with different collectives: {failure}")
    return failures


def check_everything(members: Members) -> list[str]:
    failures = check_cases(members) + check_traffic(members) + check_pieces(members) + check_hook_reduce(members)
    failures += check_hook_edge_cases(members)
    if members.size >= 2:
        failures += check_mismatches(members)
    return failures


def groups_worker(rank: int, world_size: int, sizes: list[int]) -> list[str]:
    """Every size as the group of the first P ranks, then a strided group (group rank != global rank)."""
    layouts = [(list(range(size)), f"{size} ranks") for size in sizes]
    strided = list(range(1, world_size, 2)) + [0]
    layouts.append((strided, f"strided group {strided}"))
    failures = []
    for ranks, name in layouts:
        group = dist.new_group(ranks)  # a collective of the whole world: every process calls it
        if rank in ranks:
            in_group_order = [dist.get_global_rank(group, r) for r in range(len(ranks))]
            failures += check_everything(Members(group, in_group_order, dist.get_rank(group), name))
    return failures


def test_collectives_and_hook_on_real_groups():
    results = run_distributed(groups_worker, max(WORLD_SIZES), WORLD_SIZES, timeout=420)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_collectives_need_an_initialized_group():
    msg = gx.make_compressor("topk", 0.5).compress(torch.ones(4))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        gx.collectives.gtopk_allreduce(msg)
