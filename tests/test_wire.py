"""The wires: the compact wire's ops (wire_encode, wire_decode) against gtopk_ext/reference.py on every backend,
their contract (bad arguments, opcheck), corrupted payloads; the 2- and 4-bit wires against loops; and every sparse
collective on the lossy wires on real Gloo groups of 2, 3, 4, 5 and 8 ranks, the hierarchical one on 4 and 3 nodes
of 2 (one spawn): conservation through the hook, identical results on every rank, corruption and bad arguments
failing alike on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gtopk_ext as gx
from gtopk_ext import backends, collectives, ops, reference, wire
from gtopk_ext._contract import wire_num_pages
from tests.distributed import run_distributed
from tests.test_collectives import Members, bucket_input, equal_on_every_rank, reduce_and_check_bucket
from tests.test_ops import BACKENDS, DTYPES, backend_device


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


# ----- the ops -----


def sorted_message(numel: int, k: int, dtype: torch.dtype, generator: torch.Generator, scale: float = 1e-3,
                   duplicates: bool = False):
    pool = torch.randint(0, numel, (k,), generator=generator) if duplicates else \
        torch.randperm(numel, generator=generator)[:k]
    indices = pool.sort().values.int()
    values = (torch.randn(k, generator=generator) * scale).to(dtype)
    return indices, values


def encode_cases(device: torch.device):
    """(indices, values, count, numel): page edges, every count regime, the values' edge cases."""
    generator = torch.Generator().manual_seed(7)
    cases = []
    for dtype in DTYPES:
        for numel, k, scale in ((1, 1, 1.0), (1000, 37, 1e-3), (65536, 300, 1e-6), (65537, 5, 30.0),
                                (200_003, 700, 1e-2), (300_000, 4, 1e3)):
            indices, values = sorted_message(numel, k, dtype, generator, scale, duplicates=numel > 65536)
            for count in (k, max(k - 3, 0), k + 10, -1):
                cases.append((indices, values, torch.tensor([count], dtype=torch.int32), numel))
        indices, values = sorted_message(140_000, 8, dtype, generator)
        special = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-30, 2.0, -3.0]
        cases.append((indices, torch.tensor(special).to(dtype), torch.tensor([8], dtype=torch.int32), 140_000))
        cases.append((indices, torch.zeros(8, dtype=dtype), torch.tensor([8], dtype=torch.int32), 140_000))
    indices = torch.tensor([0, 5, 65535, 65536, 131072, 131073, 200_000], dtype=torch.int32)
    # float32's extremes: the largest finite values (their nearest float16 pattern would decode to infinity),
    # subnormals, and a spread wider than float16's.
    extreme = torch.tensor([3.4028235e38, -3.4e38, 1e-45, -1e-40, 1e30, 1e-30, 1.0])
    cases.append((indices, extreme, torch.tensor([7], dtype=torch.int32), 200_001))
    cases.append((indices, extreme[[2, 3, 5, 6, 1, 4, 0]] * 1e-8, torch.tensor([7], dtype=torch.int32), 200_001))
    return [(i.to(device), v.to(device), c.to(device), n) for i, v, c, n in cases]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype == torch.float16:
        actual, expected = actual.view(torch.int16), expected.view(torch.int16)
    if actual.dtype == torch.float32:
        actual, expected = actual.view(torch.int32), expected.view(torch.int32)
    assert torch.equal(actual.cpu(), expected.cpu()), what


def test_wire_ops_match_reference(backend):
    for case, (indices, values, count, numel) in enumerate(encode_cases(backend_device(backend))):
        what = f"case {case}: numel {numel}, k {values.numel()}, {values.dtype}, count {int(count)}"
        encoded = ops.wire_encode(indices, values, count, numel, backend=backend)
        expected = reference.wire_encode(indices.cpu(), values.cpu(), count.cpu(), numel)
        for name, actual, wanted in zip(("halves", "low", "pages", "shift"), encoded, expected):
            assert_same_bits(actual, wanted, f"{what}: {name}")
        decoded = ops.wire_decode(*encoded, count, numel, backend=backend)
        expected_decoded = reference.wire_decode(*expected, count.cpu(), numel)
        for name, actual, wanted in zip(("indices", "values", "invalid"), decoded, expected_decoded):
            assert_same_bits(actual, wanted, f"{what}: decoded {name}")
        # What an encoding means: the used slots come back with their indices, values rounded to 11 bits of
        # the largest finite |value| (or exactly, for float16 and bfloat16 values of an ordinary spread).
        used = min(max(int(count), 0), values.numel())
        out_indices, out_values, invalid = decoded
        assert int(invalid) == 0, what
        assert torch.equal(out_indices[:used].cpu(), indices[:used].cpu()), what
        assert not out_indices[used:].any() and not out_values[used:].any(), what
        sent = values[:used].float().cpu()
        finite = sent.isfinite()
        largest = float(sent[finite].abs().max()) if finite.any() else 0.0
        error = (out_values[:used].cpu()[finite] - sent[finite]).abs()
        assert error.numel() == 0 or float(error.max()) <= largest * 2.0**-11, what
        assert torch.equal(out_values[:used].cpu()[~finite].nan_to_num(), sent[~finite].nan_to_num()), what


def corrupted(encoded, count, numel, generator):
    """The encoding with random bytes of one part overwritten."""
    parts = [p.clone() for p in encoded]
    part = parts[int(torch.randint(0, 4, (1,), generator=generator))]
    raw = part.view(-1).view(torch.uint8)
    where = torch.randint(0, raw.numel(), (min(3, raw.numel()),), generator=generator)
    raw[where] = torch.randint(0, 256, (where.numel(),), generator=generator, dtype=torch.uint8)
    return parts


def test_decoding_a_corrupted_message_stays_in_bounds(backend):
    device = backend_device(backend)
    generator = torch.Generator().manual_seed(11)
    numel = 140_000
    indices, values = sorted_message(numel, 600, torch.float32, generator)
    count = torch.tensor([600], dtype=torch.int32)
    encoded = reference.wire_encode(indices, values, count, numel)
    for trial in range(20):
        parts = [p.to(device) for p in corrupted(encoded, count, numel, generator)]
        out_indices, out_values, invalid = ops.wire_decode(*parts, count.to(device), numel, backend=backend)
        expected = reference.wire_decode(*[p.cpu() for p in parts], count, numel)
        for name, actual, wanted in zip(("indices", "values", "invalid"), (out_indices, out_values, invalid),
                                        expected):
            assert_same_bits(actual, wanted, f"trial {trial}: {name}")
        assert bool(((out_indices >= 0) & (out_indices < numel)).all()), f"trial {trial}"
    # Each kind of damage is seen.
    halves, low, pages, shift = encoded
    damages = {
        "shift out of range": (halves, low, pages, torch.tensor([127], dtype=torch.int32)),
        "pages descend": (halves, low, pages.flip(0), shift),
        "page table does not end at the count": (halves, low, torch.cat([pages[:-1], pages[-1:] + 1]), shift),
        "lows descend": (halves, low.flip(0), pages, shift),
        "index past numel": (halves, torch.full_like(low, -1), pages, shift),
    }
    for name, parts in damages.items():
        _, _, invalid = ops.wire_decode(*[p.to(device) for p in parts], count.to(device), numel, backend=backend)
        assert int(invalid) > 0, name


def test_every_nan_half_decodes_to_one_pattern(backend):
    """A NaN half of any sign and payload (a corrupted message holds any) decodes to the float32 pattern
    0x7FC00000 on every backend: a CPU's product keeps a NaN's payload, a GPU's gives its own."""
    device = backend_device(backend)
    patterns = [0x7E00, 0xFE00, 0x7C01, 0xFD23, 0x7FFF, 0x3C00]  # five NaNs, then 1.0
    halves = torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(torch.float16)
    low = torch.arange(len(patterns), dtype=torch.int16)
    pages, shift = torch.tensor([0, len(patterns)], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    count = torch.tensor([len(patterns)], dtype=torch.int32)
    _, values, invalid = ops.wire_decode(*[p.to(device) for p in (halves, low, pages, shift, count)], 100,
                                         backend=backend)
    assert int(invalid) == 0
    assert values.cpu().view(torch.int32).tolist() == [0x7FC00000] * 5 + [0x3E000000]  # 1.0 * 2^-3


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 300_000), data=st.data(), dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([1e-8, 1e-3, 1.0, 1e4]))
def test_property_round_trip(numel, data, dtype, scale):
    k = data.draw(st.integers(1, min(numel, 500)))
    count = data.draw(st.integers(-2, k + 2))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    indices, values = sorted_message(numel, k, dtype, generator, scale, duplicates=data.draw(st.booleans()))
    count = torch.tensor([count], dtype=torch.int32)
    encoded = ops.wire_encode(indices, values, count, numel)
    for actual, wanted in zip(encoded, reference.wire_encode(indices, values, count, numel)):
        assert_same_bits(actual, wanted, "encode")
    out_indices, _, invalid = ops.wire_decode(*encoded, count, numel)
    used = min(max(int(count), 0), k)
    assert int(invalid) == 0 and torch.equal(out_indices[:used], indices[:used])


def bad_wire_calls():
    i32 = torch.zeros(4, dtype=torch.int32)
    f32 = torch.zeros(4)
    one = torch.ones(1, dtype=torch.int32)
    halves, low, pages, shift = torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.int16), \
        torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return [
        ("wire_encode", (i32.long(), f32, one, 10), "indices must be a 1-D int32 tensor"),
        ("wire_encode", (i32, f32.int(), one, 10), "values must be float32, float16 or bfloat16"),
        ("wire_encode", (i32, f32[:3], one, 10), "values must have indices' shape"),
        ("wire_encode", (i32, f32, one.long(), 10), "count must be an int32 tensor of one element"),
        ("wire_encode", (i32, f32, one, 0), "numel must be in [1, 2^31 - 1]"),
        ("wire_decode", (halves.float(), low, pages, shift, one, 10), "halves must be a 1-D float16 tensor"),
        ("wire_decode", (halves, low[:3], pages, shift, one, 10), "low must be an int16 tensor of halves' shape"),
        ("wire_decode", (halves, low, pages[:1], shift, one, 10), "pages must be a 1-D int32 tensor of 2 elements"),
        ("wire_decode", (halves, low, pages, shift.repeat(2), one, 10), "shift must be an int32 tensor of one"),
        ("wire_decode", (halves, low, pages, shift, one, 2**31), "numel must be in [1, 2^31 - 1]"),
    ]


def test_bad_wire_arguments_are_rejected_clearly(backend):
    kernels = backends.choose(backend_device(backend), backend).kernels
    for op_name, args, message in bad_wire_calls():
        args = tuple(a.to(backend_device(backend)) if isinstance(a, torch.Tensor) else a for a in args)
        with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace("^", r"\^").replace("[", r"\[")):
            getattr(kernels, op_name)(*args)


def test_wire_opcheck():
    generator = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        indices, values = sorted_message(70_000, 64, dtype, generator)
        count = torch.tensor([60], dtype=torch.int32)
        torch.library.opcheck(torch.ops.gtopk_ext.wire_encode, (indices, values, count, 70_000))
        encoded = ops.wire_encode(indices, values, count, 70_000)
        torch.library.opcheck(torch.ops.gtopk_ext.wire_decode, (*encoded, count, 70_000))


def test_compact_payload_is_four_bytes_a_pair():
    """At density 0.01 on a 3M-element bucket: 4 bytes a pair and the page table (plain float32: 8)."""
    numel, k = 3_000_000, 30_000
    compact = wire.payload_size("compact", k, numel, torch.float32, 1)
    assert compact / k <= 4.01 and compact / wire.payload_size("plain", k, numel, torch.float32, 1) <= 0.501


def test_two_bit_wire_sends_signs_and_two_magnitudes():
    """Each used slot arrives as its sign times one of two levels: the mean |value| of the slots at or below the
    used slots' mean |value|, and of those above (found here by a loop); indices exact, padding (0, 0); 2 bytes of
    index and a quarter byte of value a pair, plus the page table and the two levels."""
    generator = torch.Generator().manual_seed(3)
    two_bit = wire.WIRES["2bit"]
    for numel, k, count in ((70_000, 37, 37), (200_003, 300, 290), (1000, 5, 0), (10, 1, 1)):
        for dtype in DTYPES:
            indices, values = sorted_message(numel, k, dtype, generator, duplicates=False)
            head = torch.tensor([count, 6], dtype=torch.int32)
            payload, sent_indices, sent_values = two_bit.pack(indices, values, head, numel)
            assert payload.numel() == two_bit.payload_size(k, numel, dtype, 2)
            got_indices, got_values, got_head, invalid = two_bit.unpack(payload, k, numel, dtype, 2)
            assert int(invalid) == 0 and got_head.tolist() == [count, 6]
            assert torch.equal(got_indices, sent_indices) and torch.equal(got_values, sent_values)
            assert got_indices[:count].tolist() == indices[:count].tolist() and not got_indices[count:].any()
            used = [abs(float(v)) for v in values[:count].float()]
            mean = sum(used) / max(count, 1)
            lower = [m for m in used if m <= mean] or [0.0]
            upper = [m for m in used if m > mean] or [0.0]
            levels = (sum(lower) / len(lower), sum(upper) / len(upper))
            for value, got in zip(values[:count].float().tolist(), got_values[:count].float().tolist()):
                level = levels[abs(value) > mean]
                expected = torch.tensor(math.copysign(level, value)).to(dtype).float()
                assert got == pytest.approx(float(expected), rel=1e-5, abs=1e-12), (numel, k, dtype, value, got)
            assert not got_values[count:].float().any()
    k, numel = 30_000, 3_000_000
    assert (two_bit.payload_size(k, numel, torch.float32, 1) - two_bit.payload_size(0, numel, torch.float32, 1)
            == 2 * k + k // 4)
    # A corrupted index is caught as on the compact wire.
    indices, values = sorted_message(140_000, 600, torch.float32, generator)
    payload, _, _ = two_bit.pack(indices, values, torch.tensor([600], dtype=torch.int32), 140_000)
    low_start = 4 * (1 + wire_num_pages(140_000) + 1 + 2)
    payload[low_start:low_start + 2 * 600] = payload[low_start:low_start + 2 * 600].flip(0)
    assert int(two_bit.unpack(payload, 600, 140_000, torch.float32, 1)[3]) > 0


def four_bit_expected(values: torch.Tensor, indices: torch.Tensor, count: int) -> list[float]:
    """The 4-bit wire's values, found by a loop: per page of 4,096 elements, 7 levels spaced geometrically from
    the bfloat16 of the page's smallest nonzero |value| to that of its largest; each value the sign times the level
    nearest its |value|, 0 for 0."""
    magnitudes = [abs(float(v)) for v in values[:count].float()]
    pages = [int(i) >> 12 for i in indices[:count]]
    bounds = {}
    for page, magnitude in zip(pages, magnitudes):
        if magnitude > 0:
            low, high = bounds.get(page, (magnitude, magnitude))
            bounds[page] = (min(low, magnitude), max(high, magnitude))
    out = []
    for page, magnitude, value in zip(pages, magnitudes, values[:count].float().tolist()):
        if magnitude == 0:
            out.append(0.0)
            continue
        low, high = (float(torch.tensor(b).to(torch.bfloat16)) for b in bounds[page])
        levels = [low * (high / low) ** (j / 6) for j in range(7)]
        out.append(math.copysign(min(levels, key=lambda level: abs(level - magnitude)), value))
    return out


def test_four_bit_wire_sends_twelve_bit_indices_and_a_level_of_its_page():
    """Indices exact, padding (0, 0), each used value the sign times the nearest of its page's 7 geometric levels
    (found by a loop); 2 bytes a pair and 6 a page; corrupted tables and slots are counted, never decoded out of
    bounds."""
    generator = torch.Generator().manual_seed(5)
    four_bit = wire.WIRES["4bit"]
    for numel, k, count in ((70_000, 300, 300), (12_289, 40, 37), (4096, 5, 0), (10, 2, 2)):
        for dtype in DTYPES:
            indices, values = sorted_message(numel, k, dtype, generator, duplicates=False)
            values[::7] = 0  # code 0
            values[1::5] *= 1e3  # pages whose spread is wide
            head = torch.tensor([count, 6], dtype=torch.int32)
            payload, sent_indices, sent_values = four_bit.pack(indices, values, head, numel)
            assert payload.numel() == four_bit.payload_size(k, numel, dtype, 2) == 8 + 6 * -(-numel // 4096) + 2 * k
            got_indices, got_values, got_head, invalid = four_bit.unpack(payload, k, numel, dtype, 2)
            assert int(invalid) == 0 and got_head.tolist() == [count, 6]
            assert torch.equal(got_indices, sent_indices) and torch.equal(got_values, sent_values)
            assert got_indices[:count].tolist() == indices[:count].tolist() and not got_indices[count:].any()
            for value, got, want in zip(values[:count].float().tolist(), got_values[:count].float().tolist(),
                                        four_bit_expected(values, indices, count)):
                expected = float(torch.tensor(want).to(dtype).float())
                assert got == pytest.approx(expected, rel=1e-4, abs=1e-30), (numel, k, dtype, value, got, want)
            assert not got_values[count:].float().any()
    # Corruption: descending slots, a count that no page table sums to, a slot past the tensor's end.
    indices, values = sorted_message(140_000, 600, torch.float32, generator)
    pack = lambda n=140_000: four_bit.pack(indices, values, torch.tensor([600], dtype=torch.int32), n)[0]  # noqa: E731
    pairs_start = 4 + 6 * -(-140_000 // 4096)
    payload = pack()
    assert int(indices[1]) < 4096  # the first two slots share page 0: swapped, they descend
    first_two = slice(pairs_start, pairs_start + 4)
    payload[first_two] = payload[first_two].view(torch.int16).flip(0).view(torch.uint8)
    assert int(four_bit.unpack(payload, 600, 140_000, torch.float32, 1)[3]) == 1
    payload = pack()
    payload[:4] = torch.tensor([599], dtype=torch.int32).view(torch.uint8)
    got_indices, _, _, invalid = four_bit.unpack(payload, 600, 140_000, torch.float32, 1)
    assert int(invalid) > 0 and not got_indices.any()
    # Duplicate indices, more than a page's 4,096 elements: each slot arrives as it was sent.
    same = torch.full((5000,), 4097, dtype=torch.int32)
    payload, _, sent_values = four_bit.pack(same, torch.ones(5000), torch.tensor([5000], dtype=torch.int32), 9000)
    got_indices, got_values, _, invalid = four_bit.unpack(payload, 5000, 9000, torch.float32, 1)
    assert int(invalid) == 0 and torch.equal(got_indices, same) and torch.equal(got_values, torch.ones(5000))
    # Packed for 143,360 elements (the same 35 pages), decoded as 140,000: index 140,500 lies past the last page's
    # 736 elements.
    past = torch.tensor([5, 139_300, 140_500], dtype=torch.int32)
    payload = four_bit.pack(past, torch.ones(3), torch.tensor([3], dtype=torch.int32), 143_360)[0]
    got_indices, _, _, invalid = four_bit.unpack(payload, 3, 140_000, torch.float32, 1)
    assert int(invalid) == 1 and got_indices.tolist() == [5, 139_300, 0]


# ----- the collectives on real groups -----

WIRE_COLLECTIVES = ("gtopk", "allgather", "oktopk")
WIRE_WORLD_SIZES = (2, 3, 4, 5, 8)  # groups of the first ranks; non-powers of two fold into gTop-k's butterfly
BUCKET_NUMELS = (3000, 70_000)  # the second spans two pages
STEPS = 4  # two dense warm-up steps, then two compressed


def check_hook_conservation(members: Members, checked: tuple[str, ...] | None = None) -> list[str]:
    """Through SparseGradState.reduce with wire="compact": per bucket and step, sum_r new_residual_r + P * output
    == sum_r (input_r + old_residual_r) up to the float rounding of the sums (the wire's rounding is kept in
    the residuals), and the output bitwise the same on every rank. ``checked``: the collectives (default: every
    sparse one, and the hierarchical one with nodes of 2 ranks on the whole world)."""
    failures = []
    # The hierarchical collective on the whole world only by default: its node groups are created by their members
    # alone, which would leave the ranks' counts of created groups apart for later subgroups.
    if checked is None:
        checked = WIRE_COLLECTIVES + (("hierarchical",) if members.size == dist.get_world_size() else ())
    for collective in checked:
        for dtype, lossy in [*((dtype, "compact") for dtype in DTYPES), (torch.float32, "2bit")]:
            options = ({"collective": "gtopk", "hierarchical": gx.Hierarchical(2)} if collective == "hierarchical"
                       else {"collective": collective})
            state = gx.SparseGradState(members.group, density=0.02, start_iter=2,
                                       path=gx.PathPolicy("sparse", min_compress_numel=1000),
                                       stats_logging_frequency=0, wire=lossy, **options)
            state.synchronous = True
            for step in range(STEPS):
                for index, numel in enumerate(BUCKET_NUMELS):
                    where = f"{members.name}, {collective}/{dtype}/{lossy}, step {step}, bucket {index}"
                    failures += reduce_and_check_bucket(members, state, step, index, numel, dtype,
                                                        index == len(BUCKET_NUMELS) - 1, where)
    return failures


def run_collective(name: str, msg: gx.SparseMessage, group, **kwargs):
    if name == "allgather":
        return collectives.sparse_allgather(msg, group, **kwargs)
    if name == "gtopk":
        return collectives.gtopk_allreduce(msg, group, **kwargs)
    return collectives.oktopk_allreduce(msg, group, **kwargs)


def message(members: Members, numel: int = 70_000, density: float = 0.02) -> gx.SparseMessage:
    grad = bucket_input(members.me, 0, 0, numel, torch.float32)
    return gx.make_compressor("topk", density).compress(grad, None)


def errors_on_every_rank(members: Members, fn) -> list[str]:
    """Every rank's error message from fn() ('' when it returned)."""
    try:
        fn()
        mine = ""
    except (ValueError, TypeError) as error:
        mine = str(error)
    gathered = [None] * members.size
    dist.all_gather_object(gathered, mine, group=members.group)
    return gathered


def check_collectives(members: Members) -> list[str]:
    failures = []
    msg = message(members)
    for name in WIRE_COLLECTIVES:
        where = f"{members.name}, {name}"
        # Unsorted slots, with a count above k: the same result as sorted ones, glob the same on every rank.
        shuffled = torch.randperm(msg.k, generator=torch.Generator().manual_seed(members.me))
        hostile = gx.SparseMessage(msg.values[shuffled], msg.indices[shuffled], msg.count + 5, msg.numel)
        for variant, m, lossy in (("sorted", msg, "compact"), ("unsorted", hostile, "compact"),
                                  ("sorted", msg, "2bit"), ("unsorted", hostile, "2bit"),
                                  ("sorted", msg, "4bit"), ("unsorted", hostile, "4bit")):
            variant = f"{variant}, {lossy}"
            rounding = wire.Rounding()
            result = run_collective(name, m, members.group, wire=lossy, rounding=rounding)
            total = result if name == "allgather" else result[0].to_dense(torch.float32)
            if not equal_on_every_rank(members, total):
                failures.append(f"{where} ({variant}): the result differs across ranks")
            # Conservation inside the collective: what entered = what was applied + what went back.
            back = torch.zeros(msg.numel, dtype=torch.float64)
            if name != "allgather":
                back.index_add_(0, m.indices.long(), m.values.double() * ~result[1])
            error_indices, errors = rounding.pairs(torch.float64, torch.device("cpu"))
            back.index_add_(0, error_indices.long(), errors)
            entered = torch.zeros(msg.numel, dtype=torch.float64).index_add_(0, m.indices.long(), m.values.double())
            local = torch.cat([entered - back, m.values.double().abs()])
            dist.all_reduce(local, group=members.group)
            imbalance = float((local[:msg.numel] - total.double()).abs().max())
            if not imbalance <= 1e-6 * float(local[msg.numel:].max()):  # a NaN fails too
                failures.append(f"{where} ({variant}): conservation broken by {imbalance:.3g}")

        # A corrupted payload from the last rank: the same error on every rank.
        original_pack = wire.CompactWire.pack

        def corrupting_pack(self, *args, **kwargs):
            payload, sent_indices, sent_values = original_pack(self, *args, **kwargs)
            if members.me == members.size - 1:
                payload = payload.clone()
                payload[-2:] = 255  # the last slot's low bits: its index descends or passes numel
            return payload, sent_indices, sent_values

        wire.CompactWire.pack = corrupting_pack
        try:
            seen = errors_on_every_rank(members, lambda: run_collective(name, msg, members.group, wire="compact"))
        finally:
            wire.CompactWire.pack = original_pack
        if len(set(seen)) != 1 or "arrived corrupted" not in seen[0]:
            failures.append(f"{where}: a corrupted payload raised {seen}")

        # Bad arguments: the same clear error everywhere.
        seen = errors_on_every_rank(members, lambda: run_collective(name, msg, members.group, wire="tiny"))
        if not seen[0].startswith("wire must be one of"):
            failures.append(f"{where}: wire='tiny' raised {seen}")
        if members.size > 1:
            mixed = "compact" if members.me == 0 else "plain"
            seen = errors_on_every_rank(members, lambda: run_collective(name, msg, members.group, wire=mixed))
            if len(set(seen)) != 1 or "wire differs across ranks" not in seen[0]:
                failures.append(f"{where}: mixed wires raised {seen}")
    return failures


def check_traffic(members: Members) -> list[str]:
    """The compact wire sends at most 0.51x the plain bytes of float32 messages (payloads only)."""
    failures, msg = [], message(members)
    for name in ("allgather", "gtopk"):
        sent = {}
        for wire_name in wire.WIRES:
            traffic = collectives.Traffic()
            run_collective(name, msg, members.group, wire=wire_name, check=False, traffic=traffic)
            sent[wire_name] = traffic.sent
        if members.size > 1 and not sent["compact"] <= 0.51 * sent["plain"]:
            failures.append(f"{members.name}, {name}: compact sent {sent['compact']} bytes, plain {sent['plain']}")
    return failures


def wire_worker(rank: int, world_size: int) -> list[str]:
    failures = []
    for size in WIRE_WORLD_SIZES:
        group = dist.new_group(list(range(size)))
        if rank < size:
            members = Members(group, list(range(size)), rank, f"{size} ranks")
            failures += check_collectives(members) + check_traffic(members) + check_hook_conservation(members)
    # Last, as its node groups are its members' alone: 3 nodes of 2 (gTop-k between them folds the third in).
    group = dist.new_group(list(range(6)))
    if rank < 6:
        failures += check_hook_conservation(Members(group, list(range(6)), rank, "6 ranks as 3 nodes of 2"),
                                            ("hierarchical",))
    return failures


def test_compact_wire_on_real_groups():
    results = run_distributed(wire_worker, max(WIRE_WORLD_SIZES), timeout=900)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_bad_wire_in_the_state_is_rejected():
    with pytest.raises(ValueError, match="wire must be one of"):
        gx.SparseGradState(wire="zip", path="sparse")
