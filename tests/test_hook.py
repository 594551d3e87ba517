"""sparse_grad_hook on real DDP models over real Gloo process groups: identical models on every rank,
conservation per bucket through the hook, exact resume from a checkpoint in fresh processes, statistics and
logging, argument checks, pickling. (tests/test_hook_lightning.py: through PyTorch Lightning's DDPStrategy.)

No `from __future__ import annotations` here: DDP checks a hook's annotations against dist.GradBucket.
"""

import copy
import logging
import os
import pickle
import re
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from tests.distributed import run_distributed

WORLD_SIZE = 3  # folds rank 2 into rank 0: the general case of the butterfly
# (compressor, collective, compressor_kwargs)
CONFIGS = [("gaussiank", "gtopk", {}), ("topk", "allgather", {}), ("randomk", "gtopk", {}),
           ("gaussiank", "oktopk", {}), ("gaussiank", "allgather", {"mode": "paper"})]
# Resumed runs: four of CONFIGS, and momentum correction (the optimizer then has no momentum of its own).
RESUMED = [(*config, {}) for config in CONFIGS[:4]] + [
    ("gaussiank", "gtopk", {}, {"momentum": gx.MomentumCorrection(0.9, nesterov=True, weight_decay=1e-3)})]
MIN_COMPRESS_NUMEL = 2500  # the 2112-element bucket goes dense
DENSITY = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def make_ddp(model: nn.Module, state: gx.SparseGradState, hook=gx.sparse_grad_hook, hook_state=None) -> DDP:
    # A small bucket cap: several buckets, one of them (the first layer's bias and the last layer) small enough
    # to go dense. DDP reduces the first iteration in one bucket and rebuilds them after it.
    ddp = DDP(model, bucket_cap_mb=0.012)
    ddp.register_comm_hook(hook_state if hook_state is not None else state, hook)
    return ddp


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)


def train(ddp: DDP, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()


def make_state(compressor: str, collective: str, kwargs: dict, **extra) -> gx.SparseGradState:
    return gx.SparseGradState(density=DENSITY, compressor=gx.make_compressor(compressor, DENSITY, **kwargs),
                              collective=collective, start_iter=2,
                              path=gx.PathPolicy("sparse", min_compress_numel=MIN_COMPRESS_NUMEL), **extra)


def same_on_every_rank(tensors) -> bool:
    mine = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, mine) for g in gathered)


# ----- conservation through the hook, seen by a hook that wraps it -----


@dataclass
class Recorder:
    """State of recording_hook: the SparseGradState and, per (iteration, bucket index), (input, old residual,
    new residual, output). Keyed, because dense buckets finish later (in Gloo's thread) than sparse ones."""

    state: gx.SparseGradState
    calls: dict = field(default_factory=dict)


def recording_hook(recorder: Recorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    index, state = bucket.index(), recorder.state
    key = (state.iter, index)
    grad = bucket.buffer().clone()
    old = state.store.residuals.get(index)
    old = old.clone() if old is not None else torch.zeros_like(grad)

    def record(future):
        output = future.value()
        new = state.store.residuals.get(index)
        new = new.clone() if new is not None else torch.zeros_like(grad)
        recorder.calls[key] = (grad, old, new, output.clone())
        return output

    return gx.sparse_grad_hook(state, bucket).then(record)


def conservation_failures(recorder: Recorder, name: str) -> list[str]:
    """sum_r new_residual_r + P * output == sum_r (input_r + old_residual_r), per bucket and step."""
    failures, size = [], dist.get_world_size()
    for (step, index), (grad, old, new, output) in sorted(recorder.calls.items()):
        local = torch.cat([new.double() - grad.double() - old.double(), grad.double().abs() + old.double().abs()])
        dist.all_reduce(local)
        imbalance = local[:grad.numel()] + size * output.double()
        if not float(imbalance.abs().max()) <= 1e-5 * float(local[grad.numel():].max()):  # a NaN fails too
            failures.append(f"{name}: step {step}, bucket {index}: conservation broken by "
                            f"{float(imbalance.abs().max()):.3g}")
    return failures


@dataclass
class LayoutRecorder:
    """State of layout_hook: per iteration, the layout of each bucket DDP hands the hook."""

    state: gx.SparseGradState
    layouts: dict = field(default_factory=dict)


def layout_hook(recorder: LayoutRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state = recorder.state
    layout = state.store.layout_of(bucket.parameters(), bucket.buffer().numel())
    recorder.layouts.setdefault(state.iter, []).append(layout)
    return gx.sparse_grad_hook(state, bucket)


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def ddp_worker(rank: int, size: int, checkpoint_dir: str) -> list[str]:
    failures = []
    for compressor, collective, kwargs in CONFIGS:
        name = f"{compressor}/{collective}{kwargs or ''}"
        recorder = Recorder(make_state(compressor, collective, kwargs, stats_logging_frequency=3))
        handler = ListHandler()
        logging.getLogger("gtopk_ext.ddp").addHandler(handler)
        logging.getLogger("gtopk_ext.ddp").setLevel(logging.INFO)
        model = make_model()
        ddp = make_ddp(model, recorder.state, recording_hook, recorder)
        train(ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, range(6))
        logging.getLogger("gtopk_ext.ddp").removeHandler(handler)
        if not same_on_every_rank(model.parameters()):
            failures.append(f"{name}: the models differ across ranks after 6 steps")
        failures += conservation_failures(recorder, name)
        stats = recorder.state.stats()
        paths = sorted({b["path"] for b in stats["buckets"].values()})
        if stats["iter"] != 6 or paths != ["dense", "sparse"] or stats["total"]["bytes_sent"] <= 0:
            failures.append(f"{name}: stats after 6 steps: {stats}")
        if len(handler.messages) != 2 or not all(re.match(r"sparse_grad_hook iter [36]: selected \d+ for k", m)
                                                 for m in handler.messages):
            failures.append(f"{name}: expected 2 stats log lines, got {handler.messages}")

    # Resume: 10 steps straight, or 5 steps, a checkpoint, and 5 more in fresh processes (resume_worker).
    for compressor, collective, kwargs, extra in RESUMED:
        state = make_state(compressor, collective, kwargs, **extra)
        model = make_model()
        ddp = make_ddp(model, state)
        optimizer = make_optimizer(model, extra)
        train(ddp, optimizer, rank, range(5))
        name = resumed_name(compressor, collective, extra)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()},
                   os.path.join(checkpoint_dir, f"{name}-rank{rank}.pt"))
        train(ddp, optimizer, rank, range(5, 10))
        torch.save([p.detach().clone() for p in model.parameters()],
                   os.path.join(checkpoint_dir, f"{name}-rank{rank}-straight.pt"))

    # One bucket (DDP's default cap), rebuilt after the first iteration in another order: the state takes the new
    # layout, so no later step is reduced in the first iteration's parts (only a resumed run's first one is).
    recorder = LayoutRecorder(make_state("gaussiank", "gtopk", {}))
    model = make_model()
    ddp = DDP(model)
    ddp.register_comm_hook(recorder, layout_hook)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), rank, range(4))
    first, last = recorder.layouts[0], recorder.layouts[3]
    if first == last:
        failures.append(f"DDP's rebuilt bucket has the first iteration's layout {first}: this case tests nothing")
    elif recorder.state.store.layouts != dict(enumerate(last)):
        failures.append(f"after DDP rebuilt its bucket ({last}) the state still keeps the layouts "
                        f"{recorder.state.store.layouts}")

    # Pickling drops the process group, as PowerSGDState's does; the residuals and counters stay.
    state = make_state("gaussiank", "gtopk", {}, process_group=dist.new_group(list(range(size))))
    state.store.residuals[0] = torch.ones(3)
    copied = pickle.loads(pickle.dumps(state))
    kept = copied.store.residuals[0]
    if copied.process_group is not None or copied.iter != 0 or not torch.equal(kept, torch.ones(3)):
        failures.append("pickling the state kept the process group or lost the residuals")
    return failures


def resumed_name(compressor: str, collective: str, extra: dict) -> str:
    return f"{compressor}-{collective}" + ("-momentum" if extra else "")


def make_optimizer(model: nn.Module, extra: dict) -> torch.optim.Optimizer:
    """Momentum in the optimizer, or in the hook (momentum correction) and none in the optimizer."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if extra.get("momentum") else 0.9)


def resume_worker(rank: int, size: int, checkpoint_dir: str) -> list[str]:
    failures = []
    for compressor, collective, kwargs, extra in RESUMED:
        name = resumed_name(compressor, collective, extra)
        checkpoint = torch.load(os.path.join(checkpoint_dir, f"{name}-rank{rank}.pt"))
        state = make_state(compressor, collective, kwargs, **extra)
        state.load_state_dict(checkpoint["hook"])
        model = make_model()
        model.load_state_dict(checkpoint["model"])
        ddp = make_ddp(model, state)
        optimizer = make_optimizer(model, extra)
        optimizer.load_state_dict(checkpoint["optimizer"])
        train(ddp, optimizer, rank, range(5, 10))
        straight = torch.load(os.path.join(checkpoint_dir, f"{name}-rank{rank}-straight.pt"))
        if not all(torch.equal(a, b) for a, b in zip(model.parameters(), straight)):
            diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), straight))
            failures.append(f"{name}: resumed run differs from the straight one by {diff:.3g}")
    return failures


def test_ddp_training_conservation_and_exact_resume(tmp_path):
    results = run_distributed(ddp_worker, WORLD_SIZE, str(tmp_path), timeout=300)
    # Fresh processes: nothing of the first run survives but the checkpoint files.
    results += run_distributed(resume_worker, WORLD_SIZE, str(tmp_path), timeout=300)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


# ----- the state's own checks (no process group needed) -----


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"density": 0.0}, ValueError, "density must be a number in"),
    ({"density": 1.01}, ValueError, "density must be a number in"),
    ({"compressor": "powersgd"}, ValueError, "compressor must be one of"),
    ({"collective": "ring"}, ValueError, "collective must be one of"),
    ({"start_iter": -1, "error_feedback": False}, ValueError, "start_iter must be an int >= 0"),
    ({"stats_logging_frequency": -1}, ValueError, "stats_logging_frequency must be an int >= 0"),
    ({"density": [(0, 0.1), (10, 2.0)]}, ValueError, "the density for iteration 10 must be a number"),
    ({"density": [(-1, 0.1)]}, ValueError, "density schedule: start_iter must be an int >= 0"),
    ({"density": "0.1"}, ValueError, "density must be a number in \\(0, 1\\], a callable"),
    ({"density": []}, ValueError, "the schedule is empty"),
    ({"optimizer_check": "ignore"}, ValueError, "optimizer_check must be one of"),
    ({"error_feedback": 1}, TypeError, "error_feedback must be a bool"),
])
def test_bad_state_arguments_are_rejected(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        gx.SparseGradState(**kwargs)


def test_compressing_from_the_start_is_allowed():
    """With error feedback too: the residuals follow the parameters through DDP's bucket rebuild (tested in
    tests/test_adamw.py, the AdamW recipe's start)."""
    assert gx.SparseGradState(start_iter=0).config.start_iter == 0
    assert gx.SparseGradState(start_iter=0, error_feedback=False).config.start_iter == 0
    assert gx.SparseGradState(start_iter=0, collective="dense").config.start_iter == 0


def test_density_schedule():
    listed = gx.SparseGradState(density=[(0, 0.016), (2000, 0.001), (1000, 0.004)])
    expected = [0.016, 0.016, 0.004, 0.004, 0.001, 0.001]
    assert [listed.config.density_at(i) for i in (0, 999, 1000, 1999, 2000, 10**6)] == expected
    called = gx.SparseGradState(density=lambda i: 0.1 if i < 5 else 0.01)
    assert called.config.density_at(4) == 0.1 and called.config.density_at(5) == 0.01
    broken = gx.SparseGradState(density=lambda i: 0.0)
    with pytest.raises(ValueError, match=r"density\(7\) must be a number in \(0, 1\]"):
        broken.config.density_at(7)


def test_state_dict_round_trip_and_bad_state_dicts():
    state = gx.SparseGradState(path="sparse")
    state.iter = 7
    state.store.tensors["residual"] = {0: torch.arange(4.0), 3: torch.ones(2)}
    saved = state.state_dict()
    state.store.residuals[0].add_(1)  # the saved copy must not follow
    restored = gx.SparseGradState(path="sparse")
    restored.load_state_dict(copy.deepcopy(saved))
    assert restored.iter == 7 and torch.equal(restored.store.residuals[0], torch.arange(4.0))
    assert torch.equal(restored.store.residuals[3], torch.ones(2))
    with pytest.raises(KeyError, match="missing \\['residuals'\\]"):
        restored.load_state_dict({"iter": 1})
    with pytest.raises(ValueError, match="state_dict\\['iter'\\] must be an int >= 0"):
        restored.load_state_dict({"iter": -1, "residuals": {}})


def test_reduce_rejects_a_bad_buffer():
    state = gx.SparseGradState(path="sparse")
    with pytest.raises(ValueError, match="buffer must be a flat float32, float16 or bfloat16 tensor"):
        reduce_buffer(state, torch.zeros(3, 3), 0)
    with pytest.raises(ValueError, match="buffer must be a flat"):
        reduce_buffer(state, torch.zeros(3, dtype=torch.int64), 0)
