"""What the DDP hook tells its user, on real DDP models over a real Gloo group: the run's totals in stats() (the sum
of the steps' bytes), the summary, and an optimizer that adds its own momentum or weight decay to the hook's
momentum correction, reported before its step. Also gx.destroy_process_group() without a group and the examples'
--help.

No `from __future__ import annotations` here: DDP checks a hook's annotations against dist.GradBucket.
"""

import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

import gtopk_ext as gx
from tests.distributed import run_distributed
from tests.test_hook import DENSITY, MIN_COMPRESS_NUMEL, make_ddp, make_model, train

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def totals_and_summary(rank: int) -> list[str]:
    failures = []
    state = gx.SparseGradState(density=DENSITY, path=gx.PathPolicy("sparse", min_compress_numel=MIN_COMPRESS_NUMEL))
    model = make_model()
    ddp = make_ddp(model, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    summed = {"steps": 0, "compressed_steps": 0, "bytes_sent": 0, "bytes_received": 0, "paths": Counter(),
              "measured_decisions": 0}  # a forced path: no decision from timings
    for step in range(STEPS):
        train(ddp, optimizer, rank, range(step, step + 1))
        latest = state.stats()
        summed["steps"] += 1
        summed["compressed_steps"] += any(b["path"] == "sparse" for b in latest["buckets"].values())
        summed["bytes_sent"] += latest["total"]["bytes_sent"]
        summed["bytes_received"] += latest["total"]["bytes_received"]
        summed["paths"].update(b["path"] for b in latest["buckets"].values())
    run = state.stats()["run"]
    if run != summed or run["compressed_steps"] != STEPS - 2:
        failures.append(f"run totals {run}, the steps' sum {summed}")
    summary = state.summary()
    lines = summary.splitlines()
    taken = ", ".join(f"{path} {count}" for path, count in summed["paths"].most_common())
    if (f"run: {STEPS} steps ({STEPS - 2} compressed)" not in summary or len(lines) > 24
            or max(map(len, lines)) > 120 or f"paths taken (bucket steps): {taken}; forced 'sparse'" not in summary):
        failures.append(f"summary:\n{summary}")
    resumed = gx.SparseGradState()
    resumed.load_state_dict(state.state_dict())
    if resumed.stats()["run"] != run:
        failures.append(f"the run totals did not resume: {resumed.stats()['run']}")
    return failures


def step_error(state: gx.SparseGradState, make_optimizer, rank: int) -> str:
    """'' if a step of a fresh model with ``make_optimizer(model)`` goes through, else the error's message."""
    model = make_model()
    ddp = make_ddp(model, state)
    try:
        train(ddp, make_optimizer(model), rank, range(1))
    except ValueError as error:
        return str(error)
    return ""


def optimizer_checks(rank: int) -> list[str]:
    failures = []
    hook_momentum = gx.MomentumCorrection(0.9)
    doubled = step_error(gx.SparseGradState(momentum=hook_momentum),
                         lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), rank)
    if not re.search(r"SGD has momentum=0.9 on 6 parameter\(s\).*applied twice.*optimizer_check='warn'", doubled):
        failures.append(f"momentum in both the hook and SGD: {doubled!r}")
    decayed = step_error(gx.SparseGradState(momentum=hook_momentum),
                         lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), rank)
    if not re.search(r"AdamW has weight_decay=0.01, betas=\(0.9, 0.999\)", decayed):
        failures.append(f"momentum in the hook, AdamW: {decayed!r}")
    plain = step_error(gx.SparseGradState(momentum=hook_momentum),
                       lambda m: torch.optim.SGD(m.parameters(), lr=0.1), rank)
    no_hook_momentum = step_error(gx.SparseGradState(),
                                  lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), rank)
    other_parameters = step_error(gx.SparseGradState(momentum=hook_momentum),
                                  lambda m: torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9),
                                  rank)
    if plain or no_hook_momentum or other_parameters:
        failures.append(f"reported without a conflict: {plain!r} {no_hook_momentum!r} {other_parameters!r}")
    state = gx.SparseGradState(momentum=hook_momentum, optimizer_check="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = step_error(state, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), rank)
    if kept or [str(w.message) for w in caught if "applied twice" in str(w.message)] == []:
        failures.append(f"optimizer_check='warn': {kept!r}, warnings {[str(w.message) for w in caught]}")
    return failures


def stats_and_checks_worker(rank: int, size: int) -> list[str]:
    return totals_and_summary(rank) + optimizer_checks(rank)


def test_run_totals_summary_and_doubled_momentum_reported():
    failures = run_distributed(stats_and_checks_worker, 2, timeout=300)
    assert not sum(failures, []), sum(failures, [])


def test_destroy_process_group_without_a_group_returns():
    assert not torch.distributed.is_initialized()
    gx.destroy_process_group()
    gx.destroy_process_group()


def test_every_option_has_help_and_its_default():
    for module in ("examples.train_ddp", "bench.demo"):
        text = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        options = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
        bare = [o.split()[0] for o in options if not o.startswith("-h") and "(default:" not in o]
        assert not bare, f"{module}: options without help or default: {bare}"
