"""Resuming at another world size on real Gloo groups: states saved by 3 ranks, loaded by 2. The hook's state and
SparseLocalSGD raise on every rank unless a policy is named; "fold" loses nothing (the saved residuals and
accumulators are all sent in the first step), "zero" drops them; state_dicts without the world size (older
versions) still load. examples/train_ddp.py keeps the other world size's checkpoints, and resumes from them only
when asked."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gtopk_ext as gx
from examples import train_ddp
from gtopk_ext.ddp import reduce_buffer
from tests.distributed import run_distributed

SAVED_SIZE, LOADED_SIZE = 3, 2
BUCKETS = (3000, 2000)  # elements of the two buckets of every iteration
SAVED_STEPS = 4  # iterations before the checkpoint: 2 dense, 2 compressed
SYNCS = 2


def gradient(step: int, rank: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + 10 * rank + index)
    return torch.randn(BUCKETS[index], generator=generator)


def hook_step(state: gx.SparseGradState, step: int, rank: int) -> list[torch.Tensor]:
    """One iteration of the hook over both buckets; their averages."""
    futures = [reduce_buffer(state, gradient(step, rank, i), i, is_last=i == len(BUCKETS) - 1)
               for i in range(len(BUCKETS))]
    return [f.wait() for f in futures]


def make_state() -> gx.SparseGradState:
    return gx.SparseGradState(density=0.05, start_iter=2, path=gx.PathPolicy("sparse", min_compress_numel=0))


def make_outer() -> tuple[nn.Module, gx.SparseLocalSGD]:
    torch.manual_seed(0)
    model = nn.Linear(40, 30)
    # Plain local SGD (no outer momentum, outer_lr 1): the global weights after a sync are the mean of the
    # replicas minus the mean of what the accumulators add.
    return model, gx.SparseLocalSGD(model.parameters(), sync_every=1, density=0.05, collective="gtopk",
                                    compressor="gaussiank", wire="plain", error_decay=1.0, outer_lr=1.0,
                                    outer_momentum=0.0, nesterov=False)


def drift(model: nn.Module, rank: int, step: int) -> None:
    """An inner step's change of the replica: a pure function of (rank, step)."""
    generator = torch.Generator().manual_seed(1000 + 10 * step + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator), alpha=0.1)


def example_args(directory: Path, steps: int, policy: str) -> argparse.Namespace:
    return train_ddp.parse_args(["--steps", str(steps), "--width", "32", "--bucket-cap-mb", "0.005", "--log-every",
                                 "0", "--checkpoint-dir", str(directory), "--checkpoint-every", "10",
                                 "--on-world-size-change", policy])


def save_worker(rank: int, size: int, out: str) -> list[str]:
    failures = []
    state = make_state()
    for step in range(SAVED_STEPS):
        hook_step(state, step, rank)
    saved = state.state_dict()
    if (saved["world_size"], saved["rank"]) != (size, rank) or not saved["residuals"]:
        failures.append(f"hook state_dict: world_size {saved.get('world_size')}, rank {saved.get('rank')}, "
                        f"residuals of buckets {sorted(saved['residuals'])}")
    torch.save(saved, os.path.join(out, f"hook-rank{rank}.pt"))
    model, outer = make_outer()
    for step in range(SYNCS):
        drift(model, rank, step)
        outer.step()
    saved = outer.state_dict()
    if (saved["world_size"], saved["rank"]) != (size, rank) or not saved["accumulator"][0].any():
        failures.append(f"SparseLocalSGD state_dict: world_size {saved.get('world_size')}, rank {saved.get('rank')}")
    torch.save(saved, os.path.join(out, f"local-rank{rank}.pt"))
    train_ddp.train(example_args(Path(out) / "checkpoints", 20, "restart"))
    return failures


def raises(load, pattern: str) -> str:
    """'' when ``load()`` raises a ValueError matching ``pattern``, else what happened."""
    try:
        load()
    except ValueError as error:
        return "" if re.search(pattern, str(error)) else f"the error does not match {pattern!r}: {error}"
    return f"no error (expected one matching {pattern!r})"


def summed(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = torch.stack([t.double() for t in tensors]).sum(0)
    dist.all_reduce(total)
    return total


def load_worker(rank: int, size: int, out: str) -> dict:
    hooks = [torch.load(os.path.join(out, f"hook-rank{q}.pt")) for q in range(SAVED_SIZE)]
    locals_ = [torch.load(os.path.join(out, f"local-rank{q}.pt")) for q in range(SAVED_SIZE)]
    errors = {
        "hook": raises(lambda: make_state().load_state_dict(hooks[rank]), r"world size 3.*world size 2"),
        "hook list": raises(lambda: make_state().load_state_dict(hooks), r"world size 3.*world size 2"),
        "hook policy": raises(lambda: make_state().load_state_dict(hooks, on_world_size_change="sum"),
                              r"on_world_size_change must be one of \('error', 'fold', 'zero'\), got 'sum'"),
        "local SGD": raises(lambda: make_outer()[1].load_state_dict(locals_[rank]), r"world size 3.*world size 2"),
        # saved with an overlapped exchange in flight (its average and each rank's weights at the sync)
        "local SGD in flight": raises(lambda: make_outer()[1].load_state_dict(
            [{**saved, "pending": saved["global"], "at_sync": saved["global"]} for saved in locals_],
            on_world_size_change="fold"), r"saved with an exchange in flight \(overlap\), which is this rank's own: "
                                          r"it resumes at the same world size only"),
    }
    failures = []

    # fold: this rank takes saved ranks q % 2 == rank; across the new ranks every saved residual is there once, and
    # the first step sends all of it: each bucket's average is that of grad + the folded residual.
    state = make_state()
    state.load_state_dict(hooks, on_world_size_change="fold")
    if state.iter != SAVED_STEPS or state.config.start_iter != SAVED_STEPS + 1:
        failures.append(f"fold: iter {state.iter}, start_iter {state.config.start_iter}")
    folded = [state.store.residuals.get(i, torch.zeros(n)).clone() for i, n in enumerate(BUCKETS)]
    for i in range(len(BUCKETS)):
        every_saved = torch.stack([h["residuals"][i].double() for h in hooks]).sum(0)
        if not torch.allclose(summed([folded[i]]), every_saved, atol=1e-5):
            failures.append(f"fold: bucket {i}: the new ranks' residuals do not add up to the saved ranks'")
    outputs = hook_step(state, SAVED_STEPS, rank)
    for i, output in enumerate(outputs):
        expected = summed([gradient(SAVED_STEPS, rank, i), folded[i]]) / size
        if not torch.allclose(output.double(), expected, rtol=1e-5, atol=1e-6) or i in state.store.residuals:
            failures.append(f"fold: bucket {i}: the first step did not send grad + the whole folded residual")
    if {b["path"] for b in state.stats()["buckets"].values()} != {"dense"}:
        failures.append(f"fold: the first step was not dense: {state.stats()['buckets']}")

    # zero: the iteration goes on, the residuals start empty, the next step compresses as it would have.
    state = make_state()
    state.load_state_dict(hooks, on_world_size_change="zero")
    residuals = state.store.residuals
    if state.iter != SAVED_STEPS or state.config.start_iter != 2 or any(r.any() for r in residuals.values()):
        failures.append(f"zero: iter {state.iter}, start_iter {state.config.start_iter}, residuals {residuals}")
    hook_step(state, SAVED_STEPS, rank)
    if {b["path"] for b in state.stats()["buckets"].values()} != {"sparse"}:
        failures.append("zero: the first step did not compress")

    # A state_dict of an older version (no world size, no rank) loads as this rank's, as before.
    old = {key: value for key, value in hooks[rank].items() if key not in ("world_size", "rank")}
    state = make_state()
    state.load_state_dict(old)
    if state.iter != SAVED_STEPS or not torch.equal(state.store.residuals[0], hooks[rank]["residuals"][0]):
        failures.append("an old state_dict (without world_size) did not load as before")

    # SparseLocalSGD, fold: the next sync sends every accumulator whole, so the global weights become the mean of
    # the replicas minus the sum of the saved accumulators over the new world size; zero drops them.
    model, outer = make_outer()
    outer.load_state_dict(locals_, on_world_size_change="fold")
    with torch.no_grad():
        for p, g in zip(model.parameters(), torch.split(locals_[0]["global"][0], [30 * 40, 30])):
            p.copy_(g.view_as(p))
    drift(model, rank, SYNCS)
    replicas = summed([torch.cat([p.detach().reshape(-1) for p in model.parameters()])]) / size
    outer.step()
    accumulators = torch.stack([s["accumulator"][0].double() for s in locals_]).sum(0)
    weights = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    if not torch.allclose(weights, replicas - accumulators / size, atol=1e-6) or outer.state_dict()["accumulator"][
            0].any():
        failures.append("local SGD fold: the first sync did not apply every saved accumulator")
    _, outer = make_outer()
    outer.load_state_dict(locals_, on_world_size_change="zero")
    if outer.state_dict()["accumulator"][0].any() or outer.syncs != SYNCS:
        failures.append("local SGD zero: the accumulator did not start at zero")
    _, outer = make_outer()
    outer.load_state_dict({key: value for key, value in locals_[rank].items() if key not in ("world_size", "rank")})
    if not torch.equal(outer.state_dict()["accumulator"][0], locals_[rank]["accumulator"][0]):
        failures.append("local SGD: an old state_dict (without world_size) did not load as before")

    # The example: by default a run at another world size starts afresh and leaves the saved one's checkpoints;
    # with --on-world-size-change fold it resumes from them, still in its own folder.
    for policy in ("restart", "fold"):
        directory = Path(out) / f"checkpoints-{policy}"
        if rank == 0:
            shutil.copytree(Path(out) / "checkpoints", directory)
        dist.barrier()
        train_ddp.train(example_args(directory, 30, policy))
        dist.barrier()
    return {"errors": errors, "failures": failures}


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*.pt"))}


def test_another_world_size_raises_on_every_rank_unless_a_policy_is_named(tmp_path):
    failures = run_distributed(save_worker, SAVED_SIZE, str(tmp_path), timeout=300)
    assert not sum(failures, [])
    saved = digests(tmp_path / "checkpoints")
    assert sorted(saved) == [f"world3/step000000{s}-rank{q}.pt" for s in (10, 20) for q in range(3)]
    results = run_distributed(load_worker, LOADED_SIZE, str(tmp_path), timeout=300)
    for rank, result in enumerate(results):
        assert not [f"{what}: {error}" for what, error in result["errors"].items() if error], (rank, result)
        assert not result["failures"], (rank, result["failures"])
    for policy, resumed_steps in (("restart", (20, 30)), ("fold", (30,))):
        after = digests(tmp_path / f"checkpoints-{policy}")
        assert {name: digest for name, digest in after.items() if name.startswith("world3/")} == saved, policy
        assert sorted(n for n in after if n.startswith("world2/")) == [
            f"world2/step000000{s}-rank{q}.pt" for s in resumed_steps for q in range(2)], (policy, sorted(after))
