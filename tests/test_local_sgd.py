"""SparseLocalSGD on real Gloo process groups (P = 2, 3, 4; every check of one P runs inside one spawn): replicas
bitwise equal after every sync, conservation of the pseudo-gradient through compression and reduction (with a
decayed accumulator: what it keeps, and the decayed mass counted), DiLoCo
(density 1, dense) against a plain-PyTorch DiLoCo, plain local SGD against the mean of the replicas, bitwise
resume, and clear errors on every rank."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gtopk_ext as gx
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
H = 3  # inner steps between syncs


def _model(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    # No bias before BatchNorm: its gradient is zero up to rounding, which AdamW would turn into full-size steps,
    # so runs that differ only in the order of a sum (reference comparisons) would drift apart.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=generator).to(dtype), torch.randint(0, 4, (16,), generator=generator)


def _inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    dtype = next(model.parameters()).dtype
    x, y = _batch(rank, step, dtype)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x).float(), y).backward()
    optimizer.step()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


def _assert_replicas_equal(model: nn.Module, what: str) -> None:
    """Parameters and buffers bitwise equal on every rank (compared as raw bytes)."""
    raw = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8)
                     for t in [*model.parameters(), *model.buffers()]])
    for rank, other in enumerate(_gather(raw)):
        assert torch.equal(other, raw), f"{what}: rank {rank}'s replica differs from rank {dist.get_rank()}'s"


def _synced_and_conserved(outer: gx.SparseLocalSGD, model: torch.nn.Module, world_size: int, decay: float,
                          what: str) -> tuple[torch.Tensor, dict]:
    """``outer.step()``, which must sync, and sum over ranks (pseudo-gradient + decay x old accumulator) = P x the
    averaged pseudo-gradient + sum over ranks (new accumulator), the average read from the global weights (outer
    lr 1, no momentum). Returns this rank's old accumulator and the state after."""
    before = outer.state_dict()
    old = before["accumulator"][0].double()
    dtype = next(model.parameters()).dtype
    adopted = _flat(p.to(dtype) for p in before["global"])  # what the replicas adopted at the last sync
    went_in = adopted - _flat(model.parameters()) + decay * old
    assert outer.step()
    after = outer.state_dict()
    averaged = before["global"][0].double() - after["global"][0].double()
    left = went_in - after["accumulator"][0].double()
    dist.all_reduce(left)
    torch.testing.assert_close(left, world_size * averaged, rtol=0, atol=1e-6,
                               msg=lambda m: f"{what}, sync {outer.syncs}: not conserved: {m}")
    return old, after


# ------------------------------------------------------------------------------------------------------ cases


def _case_replicas_and_conservation(rank: int, world_size: int) -> None:
    """Sparse collectives: bitwise replicas after each sync, and sum over ranks of (pseudo-gradient + old
    accumulator) = P x the averaged pseudo-gradient + sum over ranks of new accumulators. With outer_lr 1 and no
    momentum the global weights move by exactly the averaged pseudo-gradient, so the test reads it from them."""
    settings = [("gtopk", "gaussiank", 0.05, torch.float32, "plain"),
                ("gtopk", "topk", 0.2, torch.float32, "plain"),
                ("allgather", "gaussiank", 0.05, torch.float32, "plain"),
                ("gtopk", "gaussiank", 0.1, torch.bfloat16, "plain"),
                ("allgather", "randomk", 0.1, torch.float16, "plain"),
                ("oktopk", "gaussiank", 0.05, torch.float32, "plain"),
                # The compact wire: the float16 rounding of every value applied (about 1e-5 of these pseudo-
                # gradients, above the tolerance) must be in the new accumulators.
                ("gtopk", "gaussiank", 0.05, torch.float32, "compact"),
                ("gtopk", "topk", 0.2, torch.bfloat16, "compact"),
                ("allgather", "gaussiank", 0.1, torch.float32, "compact"),
                ("oktopk", "gaussiank", 0.05, torch.float16, "compact")]
    sent = {}  # (collective, compressor, density, dtype, wire) -> bytes of the first sync
    for collective, compressor, density, dtype, wire in settings:
        what = f"{collective}/{compressor}/d={density}/{dtype}/{wire}"
        model = _model(seed=rank, dtype=dtype)  # different on every rank: construction adopts rank 0's
        outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=density, collective=collective,
                                  outer_lr=1.0, outer_momentum=0.0, nesterov=False, compressor=compressor,
                                  buffers=model.buffers(), wire=wire, error_decay=1.0, average="ranks")
        _assert_replicas_equal(model, f"{what}, after construction")
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        dropped_somewhere = False
        for step in range(4 * H):
            _inner_step(model, inner, rank, step)
            if (step + 1) % H:
                assert not outer.step()
                continue
            _, after = _synced_and_conserved(outer, model, world_size, 1.0, what)
            # What this rank sent but a merge dropped (or what was not selected) is in its accumulator.
            dropped_somewhere |= bool(after["accumulator"][0].abs().sum() > 0)
            _assert_replicas_equal(model, f"{what}, sync {outer.syncs}")
            last = outer.stats()["last_sync"]
            assert last["decayed"] == 0.0 == outer.stats()["decayed"]  # error_decay=1.0: exact error feedback
            assert last["k"] == math.ceil(density * sum(p.numel() for p in model.parameters()))
            assert 0 < last["bytes_sent"] and last["numel"] == sum(p.numel() for p in model.parameters())
            sent.setdefault((collective, compressor, density, wire), (last["bytes_sent"], last["k"]))
        assert dropped_somewhere, f"{what}: the accumulator never held anything; the conservation check is empty"
    # gtopk sends k pairs in each of its rounds (at least one), in 4 bytes a pair instead of 8: the compact wire
    # saves 4 bytes a pair less its few words of page table and scale.
    (plain, k), (compact, _) = sent[("gtopk", "topk", 0.2, "plain")], sent[("gtopk", "topk", 0.2, "compact")]
    assert plain - compact >= 3 * k, (plain, compact, k)


def _case_error_decay(rank: int, world_size: int) -> None:
    """SparseLoCo's decayed accumulator: each sync scales the old accumulator by error_decay before the
    pseudo-gradient joins it, so sum over ranks (pseudo-gradient + error_decay x old accumulator) = P x averaged
    + sum over ranks (new accumulator), and stats() counts the L1 norm of (1 - error_decay) x old accumulator.
    A decay after the selection (of delta + old - sent), or a mass not counted, fails these checks."""
    for collective, wire, decay in [("gtopk", "plain", 0.5), ("allgather", "compact", 0.5), ("gtopk", "plain", 0.0)]:
        what = f"{collective}/{wire}/error_decay={decay}"
        model = _model(seed=0)
        outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=0.05, collective=collective, wire=wire,
                                  buffers=model.buffers(), error_decay=decay, average="ranks", compressor="gaussiank")
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        per_sync = []
        for step in range(4 * H):
            _inner_step(model, inner, rank, step)
            if (step + 1) % H:
                outer.step()
                continue
            old, _ = _synced_and_conserved(outer, model, world_size, decay, what)
            decayed = outer.stats()["last_sync"]["decayed"]
            assert decayed == pytest.approx((1 - decay) * float(old.abs().sum()), rel=1e-6), what
            assert (decayed > 0) == (outer.syncs > 1), f"{what}: the first sync has no accumulator to decay"
            per_sync.append(decayed)
        assert outer.stats()["decayed"] == sum(per_sync) == outer.state_dict()["decayed"], what
        assert outer.summary().splitlines()[-1] == (f"error decay {decay:g}: dropped {sum(per_sync):.4g} (L1 norm, "
                                                    f"this rank) in all, {per_sync[-1]:.4g} in the latest sync")
    # A sparse collective's default error_decay is 0.95, bitwise.
    states = []
    for options in ({}, {"error_decay": 0.95}):
        model = _model(seed=0)
        outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=0.05, **options)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2 * H):
            _inner_step(model, inner, rank, step)
            outer.step()
        states.append(outer.state_dict())
    for name in ("global", "accumulator"):
        assert all(torch.equal(a, b) for a, b in zip(states[0][name], states[1][name])), name
    assert states[0]["decayed"] == states[1]["decayed"] > 0.0


def _chunk_top(went_in: torch.Tensor, chunk: int, per_chunk: int) -> torch.Tensor:
    """The mask of each chunk's per_chunk largest |values| (a plain loop; ties: the lower index)."""
    mask = torch.zeros(went_in.numel(), dtype=torch.bool)
    for start in range(0, went_in.numel(), chunk):
        part = went_in[start:start + chunk].abs().tolist()
        order = sorted(range(len(part)), key=lambda i: (-part[i], i))[:per_chunk]
        mask[[start + i for i in order]] = True
    return mask


def _case_sparseloco(rank: int, world_size: int) -> None:
    """SparseLoCo's exchange: top-k per chunk, values on the 2-bit wire, each element averaged over the ranks that
    sent it, the accumulator decayed. Per sync: each rank sends exactly its chunks' top |pseudo-gradient + decay x
    old accumulator| (a plain loop decides), in at most two magnitudes; what it keeps is what went in less what
    it sent; and each element of the average is the sum of what was sent of it over the ranks that sent it (0
    where none did). Replicas bitwise equal; averaging by P instead, or a rounding not kept, fails these."""
    chunk, density, decay = 32, 0.125, 0.95
    model = _model(seed=rank)
    numel = sum(p.numel() for p in model.parameters())
    outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=density, collective="allgather",
                              compressor="chunktopk", compressor_kwargs={"chunk": chunk}, wire="2bit",
                              average="senders", error_decay=decay, buffers=model.buffers())
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    per_chunk = math.ceil(density * numel) // math.ceil(numel / chunk)
    shared = 0
    for step in range(4 * H):
        _inner_step(model, inner, rank, step)
        if (step + 1) % H:
            assert not outer.step()
            continue
        what = f"sync {outer.syncs + 1}"
        before = outer.state_dict()
        adopted = _flat(before["global"])
        went_in = adopted - _flat(model.parameters()) + decay * before["accumulator"][0].double()
        assert outer.step()
        after = outer.state_dict()
        sent = went_in - after["accumulator"][0].double()
        chosen = _chunk_top(went_in.float(), chunk, per_chunk)
        assert int(chosen.sum()) == outer.stats()["last_sync"]["selected"], what
        assert not sent[~chosen].abs().max() > 1e-7, f"{what}: kept back less than it did not send"
        magnitudes = sent[chosen].abs().sort().values  # float64 differences: equal up to float32's rounding
        levels = 1 + int((magnitudes.diff() > 1e-6 * float(magnitudes[-1])).sum())
        assert levels <= 2, f"{what}: {levels} magnitudes were sent, the 2-bit wire has two"
        senders = chosen.double()
        total = torch.cat([sent, senders])
        dist.all_reduce(total)
        expected = total[:numel] / total[numel:].clamp(min=1)
        averaged = adopted - _flat(after["global"])  # outer lr 1, no momentum
        torch.testing.assert_close(averaged, expected, rtol=0, atol=1e-6, msg=lambda m: f"{what}: {m}")
        shared += int((total[numel:] > 1).sum())
        _assert_replicas_equal(model, what)
    assert shared > 0, "no element was sent by two ranks: the average over senders was not tested against P"
    assert "averaged over senders" in outer.summary().splitlines()[0]


def _case_overlap(rank: int, world_size: int) -> None:
    """overlap: each exchange travels while the next inner steps train and is applied ``overlap`` steps after its
    sync (1 and H; and with H fragments, one synced each step, overlap 1). Until then neither the sync nor step()
    moves the weights; then the global weights of the exchange's fragment move by exactly its average (outer lr 1,
    no momentum), the rest not at all, bitwise equal on every rank, and each rank's weights there become the global
    ones plus its progress since the sync, elsewhere stay. The exchange conserves (what went in = what was sent +
    the new accumulator; each element of the average = its sum over its senders). The final sync() applies the
    exchange in flight, then exchanges and applies the rest, waiting: the replicas are one model."""
    for fragments, overlap in ((1, 1), (1, H), (H, 1)):
        model = _model(seed=rank)
        outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=0.125, compressor_kwargs={"chunk": 32},
                                  buffers=model.buffers(), overlap=overlap, fragments=fragments)
        assert f"sync_every 3{f', {fragments} fragments' * (fragments > 1)}, overlap {overlap}," in (
            outer.summary().splitlines()[0])
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        numel = sum(p.numel() for p in model.parameters())
        every = H // fragments
        started = None  # the exchange in flight: (its sync's step, what went in, the weights after its sync, its part)
        applied = 0
        for step in range(1, 4 * H + overlap + 1):
            what = f"fragments {fragments}, overlap {overlap}, step {step}"
            _inner_step(model, inner, rank, step)
            before = outer.state_dict()  # waits for the exchange in flight
            weights = _flat(model.parameters())
            due = started is not None and step == started[0] + overlap
            if due:
                part = started[3]
                sent = started[1] - before["accumulator"][0][part].double()
                senders = (sent.abs() > 1e-6).double()  # the rest differs from 0 by the float32 decay's rounding
                total = torch.cat([sent, senders])
                dist.all_reduce(total)
                expected = total[:len(sent)] / total[len(sent):].clamp(min=1)
                torch.testing.assert_close(before["pending"][0].double(), expected, rtol=0, atol=1e-6,
                                           msg=lambda m: f"{what}: the average: {m}")
            synced = outer.step()
            assert synced == (step % every == 0), what
            after = outer.state_dict()
            now = _flat(model.parameters())
            if due:
                outside = torch.ones(numel, dtype=torch.bool)
                outside[part] = False
                assert torch.equal(after["global"][0][part], before["global"][0][part] - before["pending"][0]), what
                assert torch.equal(after["global"][0][outside], before["global"][0][outside]), what
                torch.testing.assert_close(now[part], after["global"][0][part].double() + (weights[part] - started[2]),
                                           rtol=0, atol=1e-6, msg=lambda m: f"{what}: global + the progress since: {m}")
                assert torch.equal(now[outside], weights[outside]), f"{what}: another fragment's weights moved"
                _assert_equal_everywhere(after["global"][0], f"{what}: the global weights")
                started, applied = None, applied + 1
            else:  # neither a step between nor a sync moves the weights
                assert torch.equal(now, weights), f"{what}: the weights moved before the exchange was due"
            if synced:
                fragment = (step // every - 1) % fragments
                part = slice(numel * fragment // fragments, numel * (fragment + 1) // fragments)
                assert after["pending"] and after["due"] == step + overlap, what
                assert after["due_fragment"] == fragment and len(after["pending"][0]) == len(range(numel)[part]), what
                went_in = (after["global"][0][part].double() - now[part]
                           + 0.95 * before["accumulator"][0][part].double())
                started = (step, went_in, now[part], part)
        assert applied == 4 * fragments, f"{what}: {applied} exchanges applied"
        outer.sync()
        _assert_replicas_equal(model, f"fragments {fragments}, overlap {overlap}, after the final sync")
        assert not outer.state_dict()["pending"]
    # Fragments of 10 and 11 elements: k = 1 and 2 at density 0.1, every message padded to 2 slots (one payload
    # size for both); the padding is nobody's sending: rank 0 alone sends element 0 (the padding's index).
    vector = torch.zeros(21)
    outer = gx.SparseLocalSGD([vector], sync_every=2, density=0.1, fragments=2, overlap=1, wire="plain")
    with torch.no_grad():
        vector[0 if rank == 0 else 3] = -(rank + 1.0)  # the pseudo-gradient: the global weights (0) minus these
    assert outer.step() and outer.step()  # fragment 0's exchange applied, fragment 1's in flight
    expected = torch.zeros(10)
    expected[0], expected[3] = 1.0, sum(range(2, world_size + 1)) / (world_size - 1)
    assert torch.equal(-outer.state_dict()["global"][0][:10], expected), outer.state_dict()["global"][0][:10]
    outer.sync()
    # fragments without overlap: each step's sync adopts its fragment's global weights and leaves the rest
    model = _model(seed=rank)
    outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=0.125, compressor_kwargs={"chunk": 32},
                              buffers=model.buffers(), fragments=H)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    numel = sum(p.numel() for p in model.parameters())
    for step in range(1, 2 * H + 1):
        _inner_step(model, inner, rank, step)
        before, weights = outer.state_dict(), _flat(model.parameters())
        assert outer.step()
        after, now = outer.state_dict(), _flat(model.parameters())
        fragment = (step - 1) % H
        outside = torch.ones(numel, dtype=torch.bool)
        outside[numel * fragment // H:numel * (fragment + 1) // H] = False
        assert torch.equal(now[~outside], after["global"][0][~outside].double()), f"fragment sync {step}: not adopted"
        assert torch.equal(now[outside], weights[outside]), f"fragment sync {step}: another fragment moved"
        assert torch.equal(after["global"][0][outside], before["global"][0][outside]), f"fragment sync {step}"
        _assert_equal_everywhere(after["global"][0], f"fragment sync {step}: the global weights")


def _assert_equal_everywhere(tensor: torch.Tensor, what: str) -> None:
    for rank, other in enumerate(_gather(tensor.contiguous())):
        assert torch.equal(other, tensor), f"{what}: rank {rank}'s differ from rank {dist.get_rank()}'s"


def _diloco_reference(model: nn.Module, world_size: int, outer_lr: float, momentum: float):
    """A plain-PyTorch DiLoCo sync: every rank's pseudo-gradient averaged by allreduce, torch.optim.SGD on the
    global weights, which every rank adopts; buffers averaged."""
    global_params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    sgd = torch.optim.SGD(global_params, lr=outer_lr, momentum=momentum, nesterov=True)

    def sync() -> None:
        with torch.no_grad():
            for g, p in zip(global_params, model.parameters()):
                pseudo = g.detach() - p.detach()
                dist.all_reduce(pseudo)
                g.grad = pseudo / world_size
            sgd.step()
            for g, p in zip(global_params, model.parameters()):
                p.copy_(g)
            for b in model.buffers():
                if b.is_floating_point():
                    averaged = b / world_size
                    dist.all_reduce(averaged)
                    b.copy_(averaged)
    return sync


def _case_diloco(rank: int, world_size: int) -> None:
    """density 1.0 with the dense collective is DiLoCo: the same weights as the plain-PyTorch reference."""
    model, reference = _model(seed=0), _model(seed=0)
    outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=1.0, collective="dense", outer_lr=0.7,
                              outer_momentum=0.9, nesterov=True, buffers=model.buffers())
    reference_sync = _diloco_reference(reference, world_size, outer_lr=0.7, momentum=0.9)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_inner = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(4 * H):
        _inner_step(model, inner, rank, step)
        _inner_step(reference, reference_inner, rank, step)
        if outer.step():
            reference_sync()
            _assert_replicas_equal(model, f"DiLoCo, sync {outer.syncs}")
            torch.testing.assert_close(_flat([*model.parameters(), *model.buffers()]),
                                       _flat([*reference.parameters(), *reference.buffers()]), rtol=1e-5, atol=1e-6)
    moved = _flat(model.parameters()) - _flat(_model(seed=0).parameters())
    assert float(moved.abs().max()) > 1e-2  # it trained


def _case_local_sgd(rank: int, world_size: int) -> None:
    """The default outer step (lr 1, no momentum) is plain local SGD: each sync leaves the mean of the replicas."""
    model = _model(seed=0)
    outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=1.0, collective="dense")
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3 * H):
        _inner_step(model, inner, rank, step)
        mean = torch.stack(_gather(_flat(model.parameters()))).mean(0)
        if outer.step():
            torch.testing.assert_close(_flat(model.parameters()), mean, rtol=0, atol=1e-6)


def _case_summary(rank: int, world_size: int) -> None:
    """summary() reads stats(): the run's bytes are the sum of every sync's, next to dense DiLoCo's allreduce."""
    from gtopk_ext.costs import format_bytes, ring_allreduce_bytes

    model = _model(seed=0)
    outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=0.25, collective="gtopk",
                              outer_lr=0.7, outer_momentum=0.9, nesterov=True, buffers=model.buffers(),
                              compressor="gaussiank", wire="plain", error_decay=1.0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    assert outer.summary().splitlines()[-1] == "latest sync: none in this process yet"
    per_sync = []
    for step in range(2 * H):
        _inner_step(model, inner, rank, step)
        if outer.step():
            per_sync.append(outer.stats()["last_sync"]["bytes_sent"])
    stats, summary = outer.stats(), outer.summary()
    lines = summary.splitlines()
    numel = sum(p.numel() for p in model.parameters())
    last = stats["last_sync"]
    assert len(per_sync) == 2 and all(sent > 0 for sent in per_sync) and stats["bytes_sent"] == sum(per_sync)
    assert lines[0] == ("SparseLocalSGD: gtopk (gaussiank), density 0.25, plain wire, sync_every 3, outer lr 0.7, "
                        "momentum 0.9 nesterov"), summary
    assert lines[1] == (f"run: 2 syncs in {2 * H} local steps; this rank sent {format_bytes(sum(per_sync))}, "
                        f"received {format_bytes(stats['bytes_received'])} ({format_bytes(sum(per_sync) / 2)} "
                        f"sent a sync)"), summary
    dense = ring_allreduce_bytes(4 * numel, world_size)
    assert lines[2] == f"dense DiLoCo would send {format_bytes(dense)} a sync, {format_bytes(2 * dense)} in all"
    assert lines[3].startswith(f"latest sync (#2): sent {format_bytes(per_sync[-1])}, k {last['k']:,} of {numel:,} "
                               f"elements") and 0 < last["k"] < numel, summary
    assert f"selected {last['selected']:,}, received {format_bytes(last['bytes_received'])}, " in lines[3], summary
    assert len(lines) == 4 and max(map(len, lines)) <= 120, summary


def _case_resume(rank: int, world_size: int) -> None:
    """A run saved in the middle of a sync interval and restored into fresh objects continues bitwise, on every
    wire (the compact and 2-bit wires' rounding errors travel in the accumulator), and with the defaults
    (SparseLoCo's exchange)."""
    for wire, decay in (("plain", 1.0), ("compact", 1.0), ("plain", 0.9)):
        _resume(rank, wire, decay, {"collective": "gtopk", "compressor": "gaussiank", "wire": wire,
                                    "error_decay": decay})
    _resume(rank, "2bit", 0.95, {})  # the defaults
    for overlap in (1, H):  # saved with an exchange in flight
        _resume(rank, "2bit", 0.95, {"overlap": overlap})
    _resume(rank, "2bit", 0.95, {"fragments": H})  # one fragment synced at each step
    _resume(rank, "2bit", 0.95, {"fragments": H, "overlap": 1})


def _resume(rank: int, wire: str, decay: float, options: dict) -> None:
    def build(seed: int):
        model = _model(seed)
        outer = gx.SparseLocalSGD(model.parameters(), sync_every=H, density=0.1, outer_lr=0.7, outer_momentum=0.9,
                                  nesterov=True, buffers=model.buffers(), **options)
        assert (outer.wire, outer.error_decay) == (wire, decay)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), outer

    model, inner, outer = build(0)
    # after two syncs (the second decayed the accumulator): in the next interval, or right after the second sync,
    # with its exchange in flight
    steps, saved_at = 4 * H, 2 * H + (0 if options.get("overlap") else 1)
    for step in range(steps):
        if step == saved_at:
            saved = copy.deepcopy((model.state_dict(), inner.state_dict(), outer.state_dict()))
        _inner_step(model, inner, rank, step)
        outer.step()
    assert bool(saved[2]["pending"]) == bool(options.get("overlap")), "saved without the exchange in flight"
    resumed_model, resumed_inner, resumed_outer = build(seed=7)
    resumed_outer.load_state_dict(saved[2])  # after construction, which adopts rank 0's model
    resumed_model.load_state_dict(saved[0])
    resumed_inner.load_state_dict(saved[1])
    for step in range(saved_at, steps):
        _inner_step(resumed_model, resumed_inner, rank, step)
        resumed_outer.step()
    for a, b in zip([*model.state_dict().values()], [*resumed_model.state_dict().values()]):
        assert torch.equal(a, b), f"{wire}: the resumed run's model differs"
    for name in ("global", "momentum", "accumulator"):
        for a, b in zip(outer.state_dict()[name], resumed_outer.state_dict()[name]):
            assert torch.equal(a, b), f"{wire}: the resumed run's {name} differs"
    assert resumed_outer.state_dict()["wire"] == wire
    assert (saved[2]["decayed"] > 0) == (decay < 1), (wire, decay, saved[2]["decayed"])
    assert resumed_outer.stats()["decayed"] == outer.stats()["decayed"], (wire, decay)


def _expect_error(error: type[Exception], match: str, build) -> None:
    with pytest.raises(error, match=match):
        build()


def _case_errors(rank: int, world_size: int) -> None:
    """Bad arguments raise at once, naming the argument; disagreements between ranks raise on every rank."""
    model = _model(0)
    params = list(model.parameters())

    def make(**kwargs):
        return lambda: gx.SparseLocalSGD(kwargs.pop("params", params), **kwargs)

    _expect_error(ValueError, r"sync_every must be an int >= 1, got 0", make(sync_every=0))
    _expect_error(ValueError, r"sync_every must be an int >= 1, got '4'", make(sync_every="4"))
    _expect_error(ValueError, r"density must be a number in \(0, 1\], got 0", make(density=0))
    _expect_error(ValueError, r"density must be a number in \(0, 1\], got 1.5", make(density=1.5))
    _expect_error(ValueError, r"collective must be one of \(.*'gtopk'.*\), got 'ring'", make(collective="ring"))
    _expect_error(ValueError, r"collective='dense' sends every element: density must be 1.0, got 0.1",
                  make(collective="dense", density=0.1))
    _expect_error(ValueError, r"outer_lr must be a number in \(0, inf\), got 0", make(outer_lr=0))
    _expect_error(ValueError, r"outer_lr must be a number in \(0, inf\), got nan", make(outer_lr=float("nan")))
    _expect_error(ValueError, r"outer_momentum must be a number in \[0, 1\), got 1.0", make(outer_momentum=1.0))
    _expect_error(ValueError, r"outer_momentum must be a number in \[0, 1\), got -0.1", make(outer_momentum=-0.1))
    _expect_error(ValueError, r"nesterov=True needs outer_momentum > 0", make(nesterov=True))
    _expect_error(TypeError, r"nesterov must be a bool, got 'yes'", make(nesterov="yes"))
    _expect_error(ValueError, r"compressor must be one of .*, got 'sort'", make(compressor="sort"))
    _expect_error(ValueError, r"error_decay must be a number in \[0, 1\], got 1.5", make(error_decay=1.5))
    _expect_error(ValueError, r"error_decay must be a number in \[0, 1\], got -0.1", make(error_decay=-0.1))
    _expect_error(ValueError, r"error_decay must be a number in \[0, 1\], got nan", make(error_decay=float("nan")))
    _expect_error(ValueError, r"error_decay must be a number in \[0, 1\], got '0.9'", make(error_decay="0.9"))
    _expect_error(ValueError, r"collective='dense' has none and takes error_decay=1.0 only, got 0.9",
                  make(collective="dense", density=1.0, error_decay=0.9))
    _expect_error(ValueError, r"wire must be one of \('plain', 'compact', '2bit', '4bit'\), got 'zip'",
                  make(wire="zip"))
    _expect_error(ValueError, r"collective='dense' allreduces float32 on the plain wire, got wire='compact'",
                  make(collective="dense", density=1.0, wire="compact"))
    _expect_error(ValueError, r"average must be 'ranks' or 'senders', got 'mean'", make(average="mean"))
    _expect_error(ValueError, r"average='senders' divides each element by the ranks that sent it, which only "
                  r"collective='allgather' counts, got collective='gtopk'", make(collective="gtopk", average="senders"))
    _expect_error(ValueError, r"density x chunk must be >= 1, got 0.1 x 4", make(compressor_kwargs={"chunk": 4},
                                                                                  density=0.1))
    _expect_error(ValueError, r"overlap must be an int >= 0, got True", make(overlap=True))
    _expect_error(ValueError, r"overlap must be at most sync_every / fragments = 8 \(an exchange is applied before the "
                  r"next one starts\), got 9", make(overlap=9))
    _expect_error(ValueError, r"overlap must be at most sync_every / fragments = 2 \(an exchange is applied before the "
                  r"next one starts\), got 3", make(overlap=3, fragments=4))
    _expect_error(ValueError, r"fragments must divide sync_every=8 \(one fragment syncs every sync_every / fragments "
                  r"steps\), got 3", make(fragments=3))
    _expect_error(ValueError, r"params is empty", make(params=[]))
    _expect_error(TypeError, r"params must be an iterable of tensors .* got a single tensor", make(params=params[0]))
    _expect_error(TypeError, r"param groups are not supported", make(params=[{"params": params}]))
    _expect_error(ValueError, r"params holds the same tensor more than once", make(params=[params[0], params[0]]))
    _expect_error(ValueError, r"params\[0\] must be a non-empty dense float32, float16 or bfloat16 tensor, got "
                  r"torch.float64", make(params=[torch.zeros(3, dtype=torch.float64)]))

    # Every rank raises the same error when the ranks' models or settings differ.
    extra = [torch.zeros(2)] if rank == 0 else []
    _expect_error(ValueError, r"SparseLocalSGD: params differs across ranks", make(params=params + extra))
    _expect_error(ValueError, r"SparseLocalSGD: sync_every differs across ranks",
                  make(sync_every=H + (rank == world_size - 1)))
    _expect_error(ValueError, r"SparseLocalSGD: wire differs across ranks",
                  make(wire="compact" if rank == world_size - 1 else "plain"))

    outer = gx.SparseLocalSGD(params, sync_every=H, density=0.1)
    outer.local_step = rank  # as if ranks had called step() a different number of times
    _expect_error(ValueError, r"SparseLocalSGD.sync: local_step differs across ranks", outer.sync)
    outer.local_step = 0
    before = outer.state_dict()
    with torch.no_grad():
        if rank == world_size - 1:
            params[0][0, 0] = float("nan")
    _expect_error(FloatingPointError, rf"the pseudo-gradient of rank\(s\) \[{world_size - 1}\] is not finite",
                  outer.sync)
    after = outer.state_dict()
    for name in ("global", "accumulator", "momentum"):
        assert all(torch.equal(a, b) for a, b in zip(before[name], after[name])), f"a failed sync changed {name}"
    assert after["syncs"] == 0
    # With overlap the ranks check in the exchange's thread, from its payload's flags (from a round of headers where
    # the fragments' payloads differ in size: two pages of the compact wire against one): the error comes where the
    # exchange would apply, on every rank, and the sync is undone, the accumulators as they were.
    pages = [torch.zeros(2 * 65536 + 1)]  # fragments of 65,536 and 65,537 elements
    for collective, tensors in (("allgather", params), ("gtopk", params), ("oktopk", params), ("allgather", pages)):
        what = f"overlap, {collective}, {sum(t.numel() for t in tensors)} elements"
        overlapped = gx.SparseLocalSGD(tensors, sync_every=2, density=0.1, overlap=1, fragments=2,
                                       collective=collective, wire="compact")  # every rank takes rank 0's
        drift = torch.linspace(0, rank + 1.0, tensors[0].numel()).view_as(tensors[0])
        with torch.no_grad():
            tensors[0].add_(drift)
        assert overlapped.step() and overlapped.step(), what  # the first exchange applied, the second in flight
        overlapped.sync()  # the accumulators hold what was not sent
        with torch.no_grad():
            tensors[0].add_(drift)
        held = overlapped.state_dict()
        assert any(a.abs().sum() > 0 for a in held["accumulator"]), what
        in_payload = tensors is params
        nonfinite = (rf"a rank's pseudo-gradient is not finite \(inner training diverged; this rank's is "
                     rf"{'not ' if rank == world_size - 1 else ''}finite\)" if in_payload else
                     rf"the pseudo-gradient of rank\(s\) \[{world_size - 1}\] is not finite")
        counts = (r"the ranks' step counts differ \(this rank: local_step \d+, syncs \d+\); every rank must call "
                  r"step\(\) and sync\(\) as often" if in_payload else r"SparseLocalSGD.sync: local_step differs")
        for error, match, spoil in ((FloatingPointError, nonfinite, "nan"), (ValueError, counts, "local_step")):
            kept = tensors[0].view(-1)[0].item()
            with torch.no_grad():
                if spoil == "nan" and rank == world_size - 1:
                    tensors[0].view(-1)[0] = float("nan")
            overlapped.local_step += rank if spoil == "local_step" else 0  # as if a rank had stepped more
            assert overlapped.step(), f"{what}: the sync did not start"
            _expect_error(error, match, overlapped.step)
            now = overlapped.state_dict()
            for name in ("global", "accumulator"):
                assert all(torch.equal(a, b) for a, b in zip(held[name], now[name])), f"{what}: changed {name}"
            assert now["syncs"] == held["syncs"] and not now["pending"], f"{what}: the sync was not undone"
            overlapped.local_step = held["local_step"]
            with torch.no_grad():
                tensors[0].view(-1)[0] = kept

    other = gx.SparseLocalSGD(_model(1)[0].parameters(), sync_every=H, density=0.1)
    _expect_error(ValueError, r"state_dict holds shards of \[\d+\] elements, this optimizer's parameters make",
                  lambda: other.load_state_dict(before))
    _expect_error(ValueError, r"state_dict\['wire'\] must be one of \('plain', 'compact', '2bit', '4bit'\), got 'zip'",
                  lambda: outer.load_state_dict({**before, "wire": "zip"}))
    _expect_error(KeyError, r"state_dict is missing \['global'\]",
                  lambda: outer.load_state_dict({k: v for k, v in before.items() if k != "global"}))
    _expect_error(ValueError, r"state_dict\['decayed'\] must be a number in \[0, inf\), got -1.0",
                  lambda: outer.load_state_dict({**before, "decayed": -1.0}))
    outer.decayed = 2.0
    outer.load_state_dict({k: v for k, v in before.items() if k != "decayed"})  # saved before it was recorded
    assert outer.stats()["decayed"] == 0.0
    with_momentum = gx.SparseLocalSGD(params, sync_every=H, density=0.1, outer_momentum=0.9).state_dict()
    _expect_error(ValueError,
                  r"state_dict holds an outer momentum: construct with its outer_momentum \(this one: 0.0\)",
                  lambda: outer.load_state_dict(with_momentum))


CASES = {case.__name__: case for case in (_case_replicas_and_conservation, _case_error_decay, _case_sparseloco,
                                          _case_overlap, _case_diloco, _case_local_sgd, _case_resume, _case_errors,
                                          _case_summary)}


def _run_cases(rank: int, world_size: int, names: list[str]) -> None:
    for name in names:
        CASES[name](rank, world_size)


@pytest.mark.parametrize("world_size,names", [
    (2, ["_case_replicas_and_conservation", "_case_diloco", "_case_local_sgd", "_case_errors", "_case_summary"]),
    (3, ["_case_replicas_and_conservation", "_case_error_decay", "_case_sparseloco", "_case_overlap", "_case_diloco",
         "_case_resume"]),
    (4, ["_case_replicas_and_conservation", "_case_error_decay", "_case_sparseloco", "_case_local_sgd",
         "_case_resume"]),
])
def test_sparse_local_sgd(world_size: int, names: list[str]) -> None:
    run_distributed(_run_cases, world_size, names, timeout=300)


def test_local_sgd_benchmark_runs(tmp_path) -> None:
    """bench/local_sgd.py at a tiny size on loopback (it is not a timed test; this keeps it from rotting)."""
    out = tmp_path / "local_sgd.json"
    result = subprocess.run([sys.executable, "-m", "bench.local_sgd", "--loopback", "--world-size", "2", "--steps",
                             "8", "--eval-every", "4", "--methods", "ddp", "postlocal-4", "diloco-4", "diloco-equal",
                             "sparse-gtopk-0.05-4", "--json", str(out)], cwd=ROOT, timeout=600,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads(out.read_text())["table"]
    assert [row["method"] for row in table] == ["ddp", "postlocal-4", "diloco-4", "diloco-equal", "sparse-gtopk-0.05-4"]
    ddp, postlocal, diloco, diloco_equal, sparse = table
    assert ddp["bytes_vs_ddp"] == 1.0 and ddp["loss_vs_ddp"] == 0.0
    # Per rank, a ring allreduce of the model per exchange: DDP 8, PyTorch's averager 3 (steps 1, 5 and the
    # final one), DiLoCo 2 (steps 4 and 8) plus its headers.
    assert postlocal["mb_sent"] == pytest.approx(3 / 8 * ddp["mb_sent"])
    assert 2 / 8 * ddp["mb_sent"] < diloco["mb_sent"] < 2 / 8 * ddp["mb_sent"] + 1e-3
    assert diloco_equal["mb_sent"] < diloco["mb_sent"] and sparse["mb_sent"] < diloco["mb_sent"] / 5
    assert all(0 < row["val_loss"] < 10 and 0 <= row["accuracy"] <= 1 for row in table)


def test_the_transformer_example_runs_sparselocalsgds_defaults(tmp_path) -> None:
    """examples/train_transformer.py --method sparseloco (torch's AdamW inside): SparseLocalSGD's defaults sync every
    8 steps on the 2-bit wire, and the validation loss falls below the untrained model's (ln 256 = 5.55)."""
    from tests.test_adamw import run_transformer_example

    log, loss = run_transformer_example(tmp_path, "sparseloco", "--steps", "32")
    assert loss < 5.0, log[-3000:]
    assert ("SparseLocalSGD: allgather (chunktopk), density 0.015625, 2bit wire, averaged over senders, sync_every 8, "
            "outer lr 1") in log, log[-3000:]
    # steps 8, 16, 24, 32 and the script's final outer.sync() (what the accumulators still hold)
    assert "run: 5 syncs in 32 local steps" in log, log[-3000:]
