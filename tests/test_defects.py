"""Defects that once lost gradient, hung or overflowed, each checked where it happened, on real Gloo groups:
a parameter unused by every rank under ``find_unused_parameters=True``, float16 sums in gTop-k's merges and in
residual + gradient, a malformed ``SparseMessage.count``, resuming at ``iter == start_iter`` or without error
feedback, WAGMA's float16 sums, AMP loss scaling (``scaler=``), Gaussian-k's paper mode on equal values,
and residual parts of a bucket that went dense after its layout changed.

One spawn of 4 processes runs every distributed check, on subgroups of 2, 3 and 4 ranks (starting processes is
the expensive part). Every check returns failures as strings, so one rank's failure cannot leave another waiting.

No `from __future__ import annotations` here: DDP checks a hook's annotations against dist.GradBucket.
"""

import copy
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from gtopk_ext.averaging import GroupModelAverager
from tests.distributed import run_distributed

WORLD_SIZE = 4
ERROR_DEADLINE_S = 30.0  # every rank must raise within this, while the group's timeout is 300 s


@dataclass
class Group:
    group: dist.ProcessGroup
    size: int
    name: str


def subgroups(rank: int) -> dict[int, Group | None]:
    """Groups of the first 2, 3 and 4 ranks (None where this rank is not a member); every rank creates all."""
    groups = {}
    for size in (2, 3, 4):
        group = dist.new_group(list(range(size)), timeout=timedelta(seconds=300))
        groups[size] = Group(group, size, f"P={size}") if rank < size else None
    return groups


def total_over(group: Group, tensor: torch.Tensor) -> torch.Tensor:
    summed = tensor.double().clone()
    dist.all_reduce(summed, group=group.group)
    return summed


def imbalance_failure(where: str, went_in: torch.Tensor, applied: torch.Tensor, kept: torch.Tensor,
                      rtol: float) -> list[str]:
    """went_in == applied + kept, relative to the largest magnitude involved."""
    error = float((went_in - applied - kept).abs().max())
    scale = max(float(t.abs().max()) for t in (went_in, applied, kept)) or 1.0
    return [f"{where}: conservation broken by {error:.3g} (scale {scale:.3g})"] if error > rtol * scale else []


# ----- recording what the hook saw and returned -----


@dataclass
class Recorder:
    """Per (iteration, bucket index): parameters, input, output, the loss scale of the step and the velocity of
    momentum correction after it (None without)."""

    state: gx.SparseGradState
    scaler: object = None
    calls: dict = field(default_factory=dict)


def recording_hook(recorder: Recorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    key = (recorder.state.iter, bucket.index())
    grad, params = bucket.buffer().clone(), bucket.parameters()
    scale = recorder.scaler.get_scale() if recorder.scaler is not None else 1.0

    def record(future):
        velocity = recorder.state.store.tensors["velocity"].get(key[1])
        recorder.calls[key] = (params, grad, future.value().clone(), scale,
                               None if velocity is None else velocity.clone())
        return future.value()

    return gx.sparse_grad_hook(recorder.state, bucket).then(record)


def residual_per_parameter(state: gx.SparseGradState, recorder: Recorder) -> dict[int, torch.Tensor]:
    """This rank's residual of each parameter (by id)."""
    last = max(step for step, _ in recorder.calls)
    kept = {}
    for (step, index), (params, *_rest) in recorder.calls.items():
        if step != last:
            continue
        residual, offset = state.store.residuals.get(index), 0
        for p in params:
            kept[id(p)] = (residual[offset:offset + p.numel()].double() if residual is not None
                           else torch.zeros(p.numel(), dtype=torch.float64))
            offset += p.numel()
    return kept


# ----- 1. find_unused_parameters=True: a parameter no rank uses in a step -----


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(16, 64)
        self.extra = nn.Linear(64, 64)  # its weight fills a bucket of its own
        self.head = nn.Linear(64, 4)

    def forward(self, x, use_extra: bool):
        h = torch.relu(self.trunk(x))
        if use_extra:
            h = h + torch.relu(self.extra(h))
        return self.head(h)


def uses_extra(step: int, rank: int) -> bool:
    """Every rank until step 4, rank 0 only at step 4, every rank at step 5, no rank at steps 6 and 7."""
    return step < 4 or step == 5 or (step == 4 and rank == 0)


def check_unused_parameters(group: Group, rank: int, compressor: str, collective: str, dtype: torch.dtype,
                            rtol: float) -> list[str]:
    where = f"{group.name} {compressor}/{collective} {dtype} find_unused_parameters"
    state = gx.SparseGradState(group.group, density=0.05, compressor=compressor, collective=collective,
                               start_iter=2,
                               path=gx.PathPolicy("sparse", min_compress_numel=1000), stats_logging_frequency=0)
    recorder = Recorder(state)
    model = Branchy().to(dtype)
    ddp = DDP(model, process_group=group.group, bucket_cap_mb=0.012 * dtype.itemsize / 4,
              find_unused_parameters=True)
    ddp.register_comm_hook(recorder, recording_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    applied = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()}
    for step in range(8):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=generator).to(dtype), torch.randn(8, 4, generator=generator).to(dtype)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x, uses_extra(step, rank)), y).backward()
        for p in model.parameters():
            if p.grad is not None:  # None: DDP applied nothing to it (no rank used it)
                applied[id(p)] += p.grad.double().reshape(-1)
        optimizer.step()
    went_in = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()}
    for params, grad, *_ in recorder.calls.values():
        offset = 0
        for p in params:
            went_in[id(p)] += grad[offset:offset + p.numel()].double()
            offset += p.numel()
    kept = residual_per_parameter(state, recorder)
    failures = []
    for name, p in model.named_parameters():
        failures += imbalance_failure(f"{where}, {name}", total_over(group, went_in[id(p)]),
                                      group.size * applied[id(p)], total_over(group, kept[id(p)]), rtol)
    return failures


# ----- 2. and 3. float16 sums: gTop-k's merges, residual + gradient -----


def fp16_message(rank: int, big: float) -> gx.SparseMessage:
    values = torch.tensor([big, 1.0, -2.0, 0.5 * (rank + 1)], dtype=torch.float16)
    indices = torch.tensor([5, 10 + rank, 20, 30], dtype=torch.int32)
    return gx.SparseMessage(values, indices, torch.tensor([4], dtype=torch.int32), 100)


def check_fp16_merge(group: Group, rank: int) -> list[str]:
    failures = []
    glob, applied = gx.collectives.gtopk_allreduce(fp16_message(rank, 40000.0), group.group)
    summed = glob.to_dense(torch.float32)
    if float(summed[5]) != 80000.0 or not bool(applied[0]):
        failures.append(f"{group.name}: gtopk_allreduce of 40000 on each rank gave {float(summed[5])} "
                        f"(applied {applied.tolist()})")
    for collective in ("gtopk", "allgather", "dense"):
        state = gx.SparseGradState(group.group, density=0.005, compressor="topk", collective=collective,
                                   start_iter=2,
                                   path=gx.PathPolicy("sparse", min_compress_numel=100), stats_logging_frequency=0)
        outputs = []
        for step in range(3):  # two dense warm-up steps, then a sparse one
            grad = torch.full((1000,), 0.01 * (rank + 1), dtype=torch.float16)
            grad[5] = 40000.0
            residual_before = state.store.residuals.get(0, torch.zeros_like(grad)).clone()
            output = reduce_buffer(state, grad.clone(), 0).wait()
            outputs.append(output)
            residual = state.store.residuals.get(0, torch.zeros_like(grad))
            failures += imbalance_failure(f"{group.name} float16 {collective} step {step}",
                                          total_over(group, grad.double() + residual_before.double()),
                                          group.size * output.double(), total_over(group, residual), 2e-3)
        if any(float(o[5]) != 40000.0 for o in outputs):
            failures.append(f"{group.name} float16 {collective}: the average of 40000 and 40000 came out as "
                            f"{[float(o[5]) for o in outputs]}")
    return failures


def check_fp16_residual_overflow(group: Group, rank: int) -> list[str]:
    """15000 left in rank 0's residual, then 55000 in its gradient: the bucket goes dense, the residual stays."""
    failures, where = [], f"{group.name} float16 residual + gradient overflow"
    state = gx.SparseGradState(group.group, density=0.01, compressor="topk", collective="gtopk", start_iter=2,
                               path=gx.PathPolicy("sparse", min_compress_numel=100), stats_logging_frequency=0)
    for step in range(5):
        grad = (torch.randn(2000, generator=torch.Generator().manual_seed(10 * step + rank)) * 0.01).half()
        if step == 2:
            grad[100:120] = 30000.0  # the k = 20 slots of both ranks: index 7 stays in the residual
            grad[7] = 15000.0 if rank == 0 else 0.0
        if step == 3:
            grad[7] = 55000.0 if rank == 0 else 0.0
        residual_before = state.store.residuals.get(0, torch.zeros_like(grad)).clone()
        output = reduce_buffer(state, grad.clone(), 0).wait()
        residual = state.store.residuals.get(0, torch.zeros_like(grad))
        if not bool(torch.isfinite(residual).all()) or not bool(torch.isfinite(output).all()):
            failures.append(f"{where}: step {step}: non-finite residual or output")
            break
        failures += imbalance_failure(f"{where}, step {step}", total_over(group, grad.double() + residual_before),
                                      group.size * output.double(), total_over(group, residual), 2e-3)
        if step == 3:  # rank 0 keeps its residual; the others apply theirs with the gradient
            path = state.stats()["buckets"][0]["path"]
            expected = residual_before if rank == 0 else torch.zeros_like(residual)
            if path != "nonfinite" or not torch.equal(residual, expected):
                failures.append(f"{where}: step 3 took path {path}, residual as expected "
                                f"{torch.equal(residual, expected)}")
    return failures


# ----- 4. a malformed count fails on every rank, quickly -----


def check_malformed_count(group: Group, rank: int) -> list[str]:
    failures, last = [], group.size - 1
    good = gx.make_compressor("topk", 0.1).compress(torch.randn(100, generator=torch.Generator().manual_seed(rank)))
    meta = gx.SparseMessage(good.values.to("meta"), good.indices.to("meta"), good.count.to("meta"), 100)
    malformed = {
        "count of shape [2]": (gx.SparseMessage(good.values, good.indices, torch.zeros(2, dtype=torch.int32), 100),
                               r"msg.count must be int32 of shape \(1,\)"),
        "count None": (gx.SparseMessage(good.values, good.indices, None, 100), r"msg.count must be a tensor"),
        "count int64": (gx.SparseMessage(good.values, good.indices, good.count.long(), 100),
                        r"msg.count must be int32"),
        "count on meta": (gx.SparseMessage(good.values, good.indices, good.count.to("meta"), 100),
                          r"msg's tensors must be on one device"),
        "all on meta": (meta, r"."),  # fails inside the checks with torch's own error type
    }
    for collective in (gx.collectives.sparse_allgather, gx.collectives.gtopk_allreduce):
        for case, (bad, pattern) in malformed.items():
            msg, expected = (bad, pattern) if rank == last else (good, rf"input of rank\(s\) \[{last}\] was invalid")
            started = time.monotonic()
            try:
                collective(msg, group.group)
                failures.append(f"{group.name} {collective.__name__} with {case} on rank {last}: no error")
            except Exception as error:  # noqa: BLE001 - what it is and how fast it came are the test
                if not re.search(expected, str(error)):
                    failures.append(f"{group.name} {collective.__name__} with {case}: {type(error).__name__}: "
                                    f"{error} (expected {expected!r})")
            elapsed = time.monotonic() - started
            if elapsed > ERROR_DEADLINE_S:
                failures.append(f"{group.name} {collective.__name__} with {case}: raised after {elapsed:.0f} s")
    return failures


# ----- 5. bitwise resume at iter == start_iter and without error feedback -----


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def train(ddp, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()


def check_resume(group: Group, rank: int, checkpoint_at: int, **options) -> list[str]:
    def fresh():
        model = make_model()
        state = gx.SparseGradState(group.group, density=0.05,
                                   path=gx.PathPolicy("sparse", min_compress_numel=2500), stats_logging_frequency=0,
                                   **options)
        ddp = DDP(model, process_group=group.group, bucket_cap_mb=0.012)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, ddp, state, optimizer = fresh()
    train(ddp, optimizer, rank, range(checkpoint_at))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "hook": state.state_dict()})
    train(ddp, optimizer, rank, range(checkpoint_at, 7))
    straight = [p.detach().clone() for p in model.parameters()]

    model, ddp, state, optimizer = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["hook"])
    train(ddp, optimizer, rank, range(checkpoint_at, 7))
    if not all(torch.equal(a, b) for a, b in zip(model.parameters(), straight)):
        diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), straight))
        return [f"{group.name} resume at iteration {checkpoint_at} with {options}: differs by {diff:.3g}"]
    return []


# ----- 6. WAGMA with float16 weights -----


def check_wagma_fp16(group: Group, rank: int) -> list[str]:
    failures = []
    for wait_avoiding, global_period in ((False, 1), (True, 10)):
        weight = torch.nn.Parameter(torch.full((8,), 30000.0 + 1000.0 * rank, dtype=torch.float16))
        averager = GroupModelAverager(group_size=group.size, global_period=global_period, wait_avoiding=wait_avoiding)
        averager.average_parameters([weight])
        averager.finish([weight])
        # The mean 31500, within float16's rounding (its spacing there is 16), as torch's own averagers give.
        if not torch.allclose(weight.detach().double(), torch.full((8,), 31500.0, dtype=torch.float64), rtol=1e-3,
                              atol=0):
            failures.append(f"{group.name} WAGMA float16 (wait_avoiding={wait_avoiding}): the mean of 30000 to "
                            f"33000 came out as {weight[0].item()}")
    return failures


# ----- 7. AMP: autocast and a GradScaler -----


def check_amp(group: Group, rank: int, autocast_dtype: torch.dtype, collective: str,
              momentum: float = 0.0) -> list[str]:
    where = f"{group.name} AMP {autocast_dtype} {collective} momentum={momentum}"
    state = gx.SparseGradState(group.group, density=0.05, collective=collective, start_iter=2,
                               path=gx.PathPolicy("sparse", min_compress_numel=1000),
                               stats_logging_frequency=0, momentum=momentum,
                               scaler=(scaler := torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)))
    recorder = Recorder(state, scaler)
    model = make_model()
    ddp = DDP(model, process_group=group.group, bucket_cap_mb=0.012)
    ddp.register_comm_hook(recorder, recording_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    skipped, poisoned_step = {}, 6
    for step in range(10):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = nn.functional.mse_loss(ddp(x).float(), y)
        # An inf in the first layer's weight gradient on rank 0 only: one bucket goes dense, the others sparse.
        poisoned = (step, rank) == (poisoned_step, 0)
        poison = model[0].weight.register_hook(lambda g: g * float("inf")) if poisoned else None
        scaler.scale(loss).backward()
        if poison is not None:
            poison.remove()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped[step] = scaler.get_scale() < before
    failures = [] if skipped[poisoned_step] else [f"{where}: the scaler did not skip the poisoned step"]
    # Per bucket, in the unscaled domain. Without momentum, from iteration 1 on (DDP's rebuilt buckets): what
    # entered is the gradient. With momentum, from iteration 2 on (the first compressed one), what entered is the
    # velocity after u = momentum * u + g, replayed from the velocity seen after iteration 1 and checked against
    # the one seen after every step (equal but where the step's masking cleared it). A rank's non-finite gradient
    # leaves u alone. When the scaler skips a step, a dense bucket's increment is dropped and u goes back to
    # before the step; a compressed bucket's increment stays in the residual (nothing lost), so u keeps its update
    # and loses only the masking.
    first = 2 if momentum else 1
    went_in, applied, start = {}, {}, {}
    for (step, index), (_, grad, output, scale, seen) in sorted(recorder.calls.items()):
        if step < first:
            if momentum and step == first - 1:
                start[index] = seen.double() / scale
            continue
        finite_here = bool(torch.isfinite(grad).all())
        compressed = step >= 2 and grad.numel() >= 1000
        increment = grad.double() / scale
        if momentum:
            before = start[index]
            increment = momentum * before + increment if finite_here else before
            seen = seen.double() / scale
            kept_slots = seen != 0 if compressed and finite_here else torch.ones_like(seen, dtype=torch.bool)
            failures += imbalance_failure(f"{where}, velocity of bucket {index} at iteration {step}",
                                          increment[kept_slots], seen[kept_slots], torch.zeros(1), 1e-5)
            start[index] = seen if not skipped[step] else increment if compressed else before
        zeros = torch.zeros(grad.numel(), dtype=torch.float64)
        if finite_here and (compressed or not skipped[step]):
            went_in[index] = went_in.get(index, zeros) + increment
        if not skipped[step]:
            applied[index] = applied.get(index, zeros) + group.size * output.double() / scale
    for index in went_in:
        kept = state.store.residuals.get(index, torch.zeros(1)).double() / state.loss_scaling.scale
        failures += imbalance_failure(f"{where}, bucket {index}", total_over(group, went_in[index]),
                                      applied.get(index, torch.zeros(1, dtype=torch.float64)),
                                      total_over(group, kept), 1e-5)
    return failures


# ----- 9. a bucket that goes dense after its layout changed -----


def check_dense_after_new_layout(group: Group, rank: int) -> list[str]:
    failures = []
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        where = f"{group.name} {dtype} dense bucket after a new layout"
        p0, p1 = torch.zeros(2000, dtype=dtype), torch.zeros(600, dtype=dtype)

        def grads(step):
            generator = torch.Generator().manual_seed(10 * step + rank)
            return torch.randn(2000, generator=generator).to(dtype), torch.randn(600, generator=generator).to(dtype)

        def make_state():
            return gx.SparseGradState(group.group, density=0.02, start_iter=2,
                                      path=gx.PathPolicy("sparse", min_compress_numel=1000),
                                      stats_logging_frequency=0)

        state = make_state()
        went_in, applied = torch.zeros(2600, dtype=torch.float64), torch.zeros(2600, dtype=torch.float64)
        for step in range(4):  # one bucket of both
            g0, g1 = grads(step)
            went_in += torch.cat([g0, g1]).double()
            applied += reduce_buffer(state, torch.cat([g0, g1]), 0, parameters=[p0, p1]).wait().double()
        resumed = make_state()
        resumed.load_state_dict(state.state_dict())
        for step in range(4, 6):  # two buckets: p0 (compressed), p1 (dense: below min_compress_numel)
            g0, g1 = grads(step)
            went_in += torch.cat([g0, g1]).double()
            out0 = reduce_buffer(resumed, g0.clone(), 0, is_last=False, parameters=[p0]).wait()
            out1 = reduce_buffer(resumed, g1.clone(), 1, parameters=[p1]).wait()
            applied += torch.cat([out0, out1]).double()
        kept = torch.cat([resumed.store.residuals[0], torch.zeros(600, dtype=dtype)]).double()
        if resumed.state_dict()["unclaimed"] or 1 in resumed.store.residuals:
            failures.append(f"{where}: residual parts left behind")
        failures += imbalance_failure(where, total_over(group, went_in), group.size * applied,
                                      total_over(group, kept), rtol)
    return failures


# ----- the spawn -----


def defects_worker(rank: int, world_size: int) -> list[str]:
    groups = subgroups(rank)
    failures = []
    if groups[2] is not None:
        for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
            failures += check_unused_parameters(groups[2], rank, "gaussiank", "gtopk", dtype, rtol)
        failures += check_fp16_merge(groups[2], rank)
        failures += check_fp16_residual_overflow(groups[2], rank)
        failures += check_dense_after_new_layout(groups[2], rank)
        for autocast_dtype, collective, momentum in ((torch.bfloat16, "gtopk", 0.0), (torch.float16, "allgather", 0.0),
                                                     (torch.bfloat16, "gtopk", 0.9)):
            failures += check_amp(groups[2], rank, autocast_dtype, collective, momentum)
    if groups[3] is not None:
        for dtype, rtol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            failures += check_unused_parameters(groups[3], rank, "gaussiank", "allgather", dtype, rtol)
        failures += check_resume(groups[3], rank, checkpoint_at=2, start_iter=2)
        failures += check_resume(groups[3], rank, checkpoint_at=3, start_iter=0, error_feedback=False)
    failures += check_malformed_count(groups[4], rank)
    failures += check_wagma_fp16(groups[4], rank)
    return [f"rank {rank}: {f}" for f in failures]


def test_defects_on_real_groups():
    results = run_distributed(defects_worker, WORLD_SIZE, timeout=300)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:30])


# ----- 9. Gaussian-k's paper mode on equal values (no group) -----


def test_paper_mode_sends_equal_values():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grad, residual = torch.full((1000,), 0.5, dtype=dtype), torch.zeros(1000, dtype=dtype)
        msg = gx.make_compressor("gaussiank", 0.01, mode="paper").compress(grad, residual)
        sent = msg.to_dense()
        assert int((sent != 0).sum()) == msg.k == 10, dtype
        assert torch.equal(sent.double() + residual.double(), grad.double()), dtype
