"""torchrun across two emulated nodes (two agents, c10d rendezvous, 2 ranks each, Gloo on loopback) training
examples/train_ddp.py's model with collective="hierarchical": every step's reduced gradients bitwise equal on every
rank, conservation per bucket, the parameters equal at the end (tests/torchrun_worker.py checks them). Then an
elastic restart: a worker killed mid-run under --max-restarts 1; the workers resume from the latest checkpoint
and end bitwise where the uninterrupted run ended.
"""

import json

import torch

from bench.harness.launch import run_torchrun

NNODES, NPROC_PER_NODE = 2, 2
STEPS, CHECKPOINT_EVERY, KILL_RANK, KILL_STEP = 24, 8, 3, 13


def launch(tmp_path, name: str, kill_step: int) -> tuple[list[str], list]:
    """Runs the worker under torchrun; returns the agents' logs and every rank's final parameters."""
    out = tmp_path / name
    out.mkdir()
    # path sparse: the same paths in the killed and resumed run as in the straight one (auto's follow timings)
    script = ["tests/torchrun_worker.py", "--collective", "hierarchical", "--density", "0.05", "--width", "64",
              "--path", "sparse",
              "--bucket-cap-mb", "0.01", "--steps", str(STEPS), "--checkpoint-dir", str(out / "checkpoints"),
              "--checkpoint-every", str(CHECKPOINT_EVERY), "--log-every", "0",
              "--out", str(out), "--kill-rank", str(KILL_RANK), "--kill-step", str(kill_step)]
    logs = run_torchrun(script, NNODES, NPROC_PER_NODE, None, tmp_path, name, timeout=240, max_restarts=1)
    size = NNODES * NPROC_PER_NODE
    failures = [f for rank in range(size) for f in json.loads((out / f"failures-rank{rank}.json").read_text())]
    assert not failures, "\n".join(failures[:20])
    return logs, [torch.load(out / f"params-rank{rank}.pt") for rank in range(size)]


def test_two_torchrun_agents_train_hierarchically_and_a_killed_worker_resumes_exactly(tmp_path):
    _, straight = launch(tmp_path, "straight", kill_step=-1)
    logs, resumed = launch(tmp_path, "killed", kill_step=KILL_STEP)
    assert "resumed from step 8" in "".join(logs), "".join(logs)[-3000:]
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}: the resumed run ended elsewhere"
