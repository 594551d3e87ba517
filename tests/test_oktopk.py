"""Ok-Topk (collectives.oktopk_allreduce) on real Gloo process groups of 1, 2, 3, 4, 5 and 8 ranks, against a plain
Python oracle: per index the float32 sum of every rank's sent slots (in rank order), the global threshold as
the lowest point of the grid 2^e * (1 + i/256) that the k-th largest |sum| reaches, the cut to k by |sum| (ties to
the lower index). The oracle never splits the index space: the result must not depend on the regions.

Every rank builds every rank's message, so each rank replays the whole reduction and compares its own result
bit for bit. One spawn of 8 processes runs every world size, as groups of the first P ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import gtopk_ext as gx
from gtopk_ext.collectives import OKTOPK_REUSE_BOUNDS, OkTopkState, Traffic, carried_dtype
from tests.distributed import run_distributed
from tests.test_collectives import Members, case_data, equal_on_every_rank, expect_error, tolerance

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
CASES = [  # (compressor, density, numel, dtype, shape)
    ("gaussiank", 0.01, 3001, torch.float32, "overlap"),
    ("topk", 0.05, 1000, torch.float32, "ties"),
    ("topk", 0.05, 1000, torch.bfloat16, "overlap"),
    ("gaussiank", 0.05, 1000, torch.float16, "overlap"),
    ("randomk", 0.02, 2000, torch.float32, "overlap"),
    ("topk", 0.5, 5, torch.float32, "overlap"),
    ("gaussiank", 1.0, 300, torch.float32, "overlap"),
]


# ----- the oracle -----


def sent_slots(msg: gx.SparseMessage) -> list[tuple[int, float]]:
    """The slots a rank sends: the first min(count, k), by ascending index (stable)."""
    used = min(max(int(msg.count), 0), msg.k)
    pairs = list(zip(msg.indices[:used].tolist(), msg.values[:used].float().tolist()))
    return sorted(pairs, key=lambda pair: pair[0])


def grid_floor(magnitude: float) -> float:
    """The largest 2^e * (1 + i/256) (float32) at or below ``magnitude``."""
    if magnitude == math.inf:
        return math.inf
    mantissa, exponent = math.frexp(magnitude)  # magnitude = mantissa * 2^exponent, mantissa in [0.5, 1)
    low = math.ldexp(1.0, exponent - 1)
    step = math.floor((magnitude / low - 1) * 256)
    return float(torch.tensor(low * (1 + step / 256), dtype=torch.float32))


def oracle(messages: list[gx.SparseMessage], threshold: float | None = None):
    """(glob slots, the indices kept before the cut, applied per rank, threshold used) of Ok-Topk on these messages;
    ``threshold``: the one a state reuses (re-estimated when the count it keeps leaves the bounds)."""
    k, dtype = messages[0].k, carried_dtype(messages[0].values.dtype)
    sums: dict[int, torch.Tensor] = {}
    for msg in messages:  # float32, in rank order, ascending slots within a rank
        for index, value in sent_slots(msg):
            sums[index] = sums.get(index, torch.zeros((), dtype=torch.float32)) + torch.tensor(value)
    magnitude = {i: (math.inf if math.isnan(float(s)) else abs(float(s))) for i, s in sums.items()}

    def kept_at(t: float) -> list[int]:
        return sorted(i for i, m in magnitude.items() if m >= t)

    low, high = OKTOPK_REUSE_BOUNDS
    ordered = sorted((m for m in magnitude.values() if m > 0), reverse=True)
    if threshold is not None:  # reused while it keeps low..high times k, or all nonzero sums when <= k exist
        kept = len(kept_at(threshold))
        if (kept != len(ordered)) if len(ordered) <= k else not low * k <= kept <= high * k:
            threshold = None
    if threshold is None:
        threshold = grid_floor(ordered[k - 1]) if len(ordered) >= k else 2.0 ** -149
    kept = kept_at(threshold)
    values = {i: float(sums[i].to(dtype)) for i in kept}
    glob = [(i, values[i]) for i in kept]
    if len(glob) > k:
        rank_of = sorted(glob, key=lambda pair: (-(math.inf if math.isnan(pair[1]) else abs(pair[1])), pair[0]))
        glob = sorted(rank_of[:k])
    glob_indices = {i for i, _ in glob}
    applied = []
    for msg in messages:
        used = min(max(int(msg.count), 0), msg.k)
        applied.append([j < used and index in glob_indices for j, index in enumerate(msg.indices.tolist())])
    return glob, kept, applied, threshold


def glob_slots(glob: gx.SparseMessage) -> list[tuple[int, float]]:
    pairs = list(zip(glob.indices.tolist(), glob.values.float().tolist()))
    return [(i, v) for i, v in pairs[:min(int(glob.count), glob.k)]]


def every_rank_applied(members: Members, applied: torch.Tensor) -> list[list[bool]]:
    """The applied masks of every rank of the group, in group-rank order."""
    gathered = [torch.empty_like(applied, dtype=torch.uint8) for _ in range(members.size)]
    dist.all_gather(gathered, applied.to(torch.uint8), group=members.group)
    return [g.bool().tolist() for g in gathered]


def same_slots(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(i == j and (v == w or (math.isnan(v) and math.isnan(w)))
                                    for (i, v), (j, w) in zip(a, b))


def conserved(glob: gx.SparseMessage, messages: list[gx.SparseMessage], applied: list[list[bool]],
              dtype: torch.dtype) -> bool:
    """glob + what every rank keeps (its slots not applied) == everything every rank sent, in float64."""
    everything = torch.zeros(glob.numel, dtype=torch.float64)
    kept = torch.zeros(glob.numel, dtype=torch.float64)
    for msg, mask in zip(messages, applied):
        everything.index_add_(0, msg.indices.long(), msg.values.double())
        kept.index_add_(0, msg.indices.long(), msg.values.double() * ~torch.tensor(mask))
    total = kept.index_add_(0, glob.indices.long(), glob.values.double())
    scale = float(everything.abs().max()) or 1.0
    return bool(torch.allclose(total, everything, rtol=0, atol=4 * tolerance(dtype) * scale * len(messages)))


# ----- on real process groups -----


def check_cases(members: Members) -> list[str]:
    """Fresh estimates (state=None) and a state reused over steps, every dtype: glob, count and applied equal
    the oracle's, glob is bitwise the same on every rank, nothing is lost."""
    failures = []
    for case, (kind, density, numel, dtype, shape) in enumerate(CASES):
        state = OkTopkState()
        threshold = None
        for step in range(3):
            where = f"{members.name}, case {case} ({kind}, {density}, {numel}, {dtype}), step {step}"
            messages = [gx.make_compressor(kind, density).compress(
                case_data(10 * case + step, r, numel, dtype, shape), None, step=step) for r in members.ranks]
            mine = messages[members.me]
            for name, given, reused in (("fresh", None, None), ("state", state, threshold)):
                glob, applied = gx.collectives.oktopk_allreduce(mine, members.group, state=given)
                expected, kept, expected_applied, used_threshold = oracle(messages, reused)
                count = len(kept)
                if given is not None:
                    threshold = used_threshold
                    if state.threshold != used_threshold:
                        failures.append(f"{where}: state threshold {state.threshold}, oracle {used_threshold}")
                if glob.values.dtype != carried_dtype(dtype) or glob.k != mine.k:
                    failures.append(f"{where} ({name}): glob has dtype {glob.values.dtype} and {glob.k} slots")
                if not same_slots(glob_slots(glob), expected) or int(glob.count) != count:
                    failures.append(f"{where} ({name}): glob differs from the oracle's "
                                    f"({len(glob_slots(glob))} vs {len(expected)} slots, count {int(glob.count)} "
                                    f"vs {count})")
                if not bool((glob.values[len(expected):] == 0).all() and (glob.indices[len(expected):] == 0).all()):
                    failures.append(f"{where} ({name}): padding is not (0, 0)")
                if applied.tolist() != expected_applied[members.me]:
                    failures.append(f"{where} ({name}): applied differs from the oracle's")
                if not conserved(glob, messages, every_rank_applied(members, applied), dtype):
                    failures.append(f"{where} ({name}): glob + what stays != what was sent")
                if not equal_on_every_rank(members, glob.indices, glob.values, glob.count):
                    failures.append(f"{where} ({name}): glob differs across ranks")
                if density == 1.0 and not bool(applied.all()):
                    failures.append(f"{where} ({name}): density 1 did not apply every slot")
    return failures


def check_boundaries_and_traffic(members: Members) -> list[str]:
    """The regions are the paper's averaged split points, and the bytes are the counts, the pairs outside the
    own region, P - 1 copies of the own kept sums and the small agreements; below 0.7x gTop-k's at P = 8."""
    failures, size, me = [], members.size, members.me
    numel, k = 20000, 200
    messages = [gx.make_compressor("topk", k / numel).compress(case_data(7, r, numel, torch.float32, "overlap"))
                for r in members.ranks]
    mine = messages[me]
    state, traffic = OkTopkState(), Traffic()
    glob, _ = gx.collectives.oktopk_allreduce(mine, members.group, state=state, check=False, traffic=traffic)
    splits = [sum(sorted(m.indices.tolist())[k * i // size] for m in messages) // size for i in range(1, size)]
    if state.boundaries != splits:
        failures.append(f"{members.name}: boundaries {state.boundaries}, expected the averaged splits {splits}")
    starts = [0, *splits, numel]
    _, kept, _, _ = oracle(messages)
    kept_own = sum(1 for i in kept if starts[me] <= i < starts[me + 1])
    outside = sum(1 for i in mine.indices.tolist() if not starts[me] <= i < starts[me + 1])

    def ring_allreduce(nbytes: int) -> int:
        return 2 * (size - 1) * nbytes // size

    # split points (P - 1 int64), the two histograms (278 and 256 int32), the all-to-all of counts, the
    # allgather of kept and nonzero counts (int64 each), then the pairs (int32 index, float32 value)
    small = ring_allreduce(8 * (size - 1)) + ring_allreduce(4 * 278) + ring_allreduce(4 * 256) + 24 * (size - 1)
    expected = small + 8 * outside + 8 * kept_own * (size - 1)
    if traffic.sent != expected:
        failures.append(f"{members.name}: oktopk sent {traffic.sent} bytes, expected {expected}")
    # A step that reuses the state's regions and threshold sends the counts and the pairs only.
    steady = Traffic()
    gx.collectives.oktopk_allreduce(mine, members.group, state=state, check=False, traffic=steady)
    expected = 24 * (size - 1) + 8 * outside + 8 * kept_own * (size - 1)
    if steady.sent != expected:
        failures.append(f"{members.name}: a steady oktopk step sent {steady.sent} bytes, expected {expected}")
    gtopk = Traffic()
    gx.collectives.gtopk_allreduce(mine, members.group, check=False, traffic=gtopk)
    totals = torch.tensor([steady.sent, gtopk.sent], dtype=torch.float64)
    dist.all_reduce(totals, group=members.group)
    if size == 8 and not float(totals[0]) <= 0.7 * float(totals[1]):
        failures.append(f"{members.name}: a steady oktopk step sent {float(totals[0]):.0f} bytes in all, gtopk "
                        f"{float(totals[1]):.0f}")
    return failures


def check_hostile(members: Members) -> list[str]:
    """Unsorted and duplicate indices, count > k, count < k with leftovers past it, NaN: the oracle's result,
    the same bits on every rank. An invalid message or a state with another plan on one rank raises on all."""
    failures, me, last, group = [], members.me, members.size - 1, members.group
    numel, k = 500, 20

    def message(rank: int, variant: str) -> gx.SparseMessage:
        generator = torch.Generator().manual_seed(500 + rank)
        indices = torch.randint(0, numel, (k,), generator=generator, dtype=torch.int32)  # unsorted, duplicates
        indices[:3] = 7  # every rank sends index 7, three times
        values = torch.randn(k, generator=generator)
        count = {"over": 3 * k, "under": k // 2, "negative": -5}.get(variant, k)
        if variant == "nan" and rank == 0:
            values[1] = math.nan
        return gx.SparseMessage(values, indices, torch.tensor([count], dtype=torch.int32), numel)

    for variant in ("plain", "over", "under", "negative", "nan"):
        messages = [message(r, variant) for r in members.ranks]
        glob, applied = gx.collectives.oktopk_allreduce(messages[me], group)
        expected, kept, expected_applied, _ = oracle(messages)
        count, where = len(kept), f"{members.name}, {variant}"
        if not same_slots(glob_slots(glob), expected) or int(glob.count) != count:
            failures.append(f"{where}: glob differs from the oracle's")
        if applied.tolist() != expected_applied[me]:
            failures.append(f"{where}: applied differs from the oracle's")
        if not equal_on_every_rank(members, glob.indices, glob.values, glob.count):
            failures.append(f"{where}: glob differs across ranks")
        if variant != "nan" and not conserved(glob, messages, every_rank_applied(members, applied), torch.float32):
            failures.append(f"{where}: glob + what stays != what was sent")

    base = message(me, "plain")
    outside = gx.SparseMessage(base.values, base.indices + numel, base.count, numel)
    negative = gx.SparseMessage(base.values, base.indices - numel, base.count, numel)
    for name, bad, pattern in (("out of range", outside, r"msg.indices must lie in \[0, msg.numel = 500\)"),
                               ("negative", negative, r"msg.indices must lie in \[0, msg.numel = 500\)")):
        if me == last:
            failure = expect_error(lambda: gx.collectives.oktopk_allreduce(bad, group), ValueError, pattern)
        else:
            failure = expect_error(lambda: gx.collectives.oktopk_allreduce(base, group), ValueError,
                                   rf"input of rank\(s\) \[{last}\] was invalid")
        if failure:
            failures.append(f"{members.name}: {name} index on the last rank: {failure}")
    ahead = OkTopkState(step=1 if me == last else 0)
    failure = expect_error(lambda: gx.collectives.oktopk_allreduce(base, group, state=ahead), ValueError,
                           "oktopk_allreduce: state_step differs across ranks")
    if failure:
        failures.append(f"{members.name}: states at different steps: {failure}")
    not_a_state = "state" if me == last else None
    if me == last:
        failure = expect_error(lambda: gx.collectives.oktopk_allreduce(base, group, state=not_a_state), TypeError,
                               "state must be an OkTopkState or None")
    else:
        failure = expect_error(lambda: gx.collectives.oktopk_allreduce(base, group, state=not_a_state), ValueError,
                               rf"input of rank\(s\) \[{last}\] was invalid")
    if failure:
        failures.append(f"{members.name}: a wrong state on the last rank: {failure}")
    flags = torch.tensor([1 << me], dtype=torch.int32)  # every rank raises its own bit: all of them come back
    flagged, _ = gx.collectives.oktopk_allreduce(base, group, flags=flags)
    plain, _ = gx.collectives.oktopk_allreduce(base, group)
    if int(flags) != (1 << members.size) - 1 or not torch.equal(flagged.values, plain.values):
        failures.append(f"{members.name}: flags came back as {int(flags)}, expected {(1 << members.size) - 1}, "
                        f"or they changed glob")
    odd_flags = torch.zeros(1, dtype=torch.int64) if me == last else torch.zeros(1, dtype=torch.int32)
    pattern = r"flags must be an int32 tensor" if me == last else rf"input of rank\(s\) \[{last}\] was invalid"
    failure = expect_error(lambda: gx.collectives.oktopk_allreduce(base, group, flags=odd_flags), ValueError, pattern)
    if failure:
        failures.append(f"{members.name}: int64 flags on the last rank: {failure}")
    glob, _ = gx.collectives.oktopk_allreduce(base, group)
    if not equal_on_every_rank(members, glob.values):
        failures.append(f"{members.name}: the group is out of step after the errors")
    return failures


def check_one_rank(members: Members) -> list[str]:
    """On one rank glob is the message (values in the carried dtype) and every slot is applied, as in gTop-k."""
    msg = gx.make_compressor("topk", 0.1).compress((torch.arange(50.0) - 20).half())
    glob, applied = gx.collectives.oktopk_allreduce(msg, members.group, state=OkTopkState())
    if not (torch.equal(glob.indices, msg.indices) and torch.equal(glob.values, msg.values.float())
            and bool(applied.all())):
        return [f"{members.name}: glob is not the message or a slot is not applied"]
    return []


def groups_worker(rank: int, world_size: int, sizes: list[int]) -> list[str]:
    failures = []
    for size in sizes:
        ranks = list(range(size))
        group = dist.new_group(ranks)  # a collective of the whole world: every process calls it
        if rank in ranks:
            members = Members(group, ranks, dist.get_rank(group), f"{size} ranks")
            if size == 1:
                failures += check_one_rank(members)
            else:
                failures += check_cases(members) + check_boundaries_and_traffic(members) + check_hostile(members)
    return failures


def test_oktopk_on_real_groups():
    results = run_distributed(groups_worker, max(WORLD_SIZES), WORLD_SIZES, timeout=600)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_oktopk_state_checks_its_periods_and_round_trips():
    state = OkTopkState(boundary_period=4, threshold_period=2, step=3, boundaries=[5, 9], threshold=0.5,
                        shape=(12, 3))
    restored = OkTopkState()
    restored.load_state_dict(state.state_dict())
    assert restored == state
    assert restored.plan(12, 3) == (False, False) and restored.plan(13, 3) == (True, True)
    for name in ("boundary_period", "threshold_period"):
        try:
            OkTopkState(**{name: 0})
        except ValueError as error:
            assert name in str(error)
        else:
            raise AssertionError(f"{name}=0 was accepted")
