"""The language-model benchmark is not a test; this keeps it from rotting: its corpus split is a deterministic
function of the paths, and a tiny run (2 Gloo processes, a few steps, a one-layer model) writes a sane report."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lm import corpus_files, is_validation, split_files  # noqa: E402


def test_split_depends_on_the_paths_alone():
    files = corpus_files()
    assert len(files) > 100 and files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    train, held_out = split_files(files, 5.0)
    shuffled = files[:]
    random.Random(0).shuffle(shuffled)
    train_again, held_out_again = split_files(shuffled, 5.0)
    assert sorted(held_out_again) == held_out and sorted(train_again) == train  # order of discovery is irrelevant
    assert not set(train) & set(held_out) and len(train) + len(held_out) == len(files)
    assert 0.02 < len(held_out) / len(files) < 0.08  # about 5%
    # a file's side follows from its path alone, whatever else the corpus holds
    assert split_files(held_out[:3] + train[:3], 5.0) == (train[:3], held_out[:3])
    assert is_validation(held_out[0], 5.0) and not is_validation(train[0], 5.0)


def test_tiny_run_writes_a_sane_report(tmp_path):
    methods = ["ddp", "gtopk-0.01", "recipe-0.01", "sparse-gtopk-0.1-2", "sparse-gtopk-0.1-2-compact", "postlocal-3"]
    result = subprocess.run(
        [sys.executable, "-m", "bench.lm", "--world-size", "2", "--steps", "4", "--eval-every", "2", "--layers", "1",
         "--d-model", "32", "--seq-len", "16", "--batch-size", "4", "--val-windows", "8", "--no-progress",
         "--dgc-warmup", "2", "--methods", *methods, "--json", str(tmp_path / "lm.json")],
        cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final val loss" in result.stdout

    report = json.loads((tmp_path / "lm.json").read_text())
    assert report["python"] == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    assert report["corpus"]["val_file_list"] == split_files(corpus_files(), 5.0)[1]
    runs = {r["method"]: r for r in report["runs"]}
    assert list(runs) == methods
    for run in runs.values():
        assert [c["step"] for c in run["curve"]] == [0, 2, 4]
        losses = [c["val_loss"] for c in run["curve"]]
        assert all(math.isfinite(v) and 0 < v < 8 for v in losses)
        for before, after in zip(run["curve"], run["curve"][1:]):  # counted as the run goes
            assert before["seconds"] <= after["seconds"] and before["bytes_sent"] <= after["bytes_sent"]
        assert losses[0] == runs["ddp"]["curve"][0]["val_loss"]  # the same initial weights for every method
    # four steps of DDP learn something about bytes (ln 256 = 5.55 at the start)
    assert runs["ddp"]["curve"][-1]["val_loss"] < runs["ddp"]["curve"][0]["val_loss"]
    table = {row["method"]: row for row in report["table"]}
    assert table["ddp"]["loss_vs_ddp"] == 1.0
    assert 0 < table["gtopk-0.01"]["bytes_vs_ddp"] < 1 and 0 < table["sparse-gtopk-0.1-2"]["bytes_vs_ddp"] < 0.2
    # the compact wire: 4 bytes a pair instead of 8 (plus a few words per message)
    assert 0.4 < table["sparse-gtopk-0.1-2-compact"]["mb_sent"] / table["sparse-gtopk-0.1-2"]["mb_sent"] < 0.65
    # PyTorch's local SGD averages at steps 1 and 4 (every 3 steps from the first): a ring allreduce of the model
    # each, 2 (P - 1) / P of its float32 bytes, against DDP's 4
    assert table["postlocal-3"]["bytes_vs_ddp"] == pytest.approx(2 / 4)
    # the hook's updated elements per group: step 3 and 4 are compressed (2 dense warm-up steps)
    shares = table["gtopk-0.01"]["updated_share"]
    assert set(shares) == {"embedding", "layernorm", "attention", "mlp", "head"}
    updated = runs["gtopk-0.01"]["updated_per_step"]
    numel = sum(runs["gtopk-0.01"]["group_numel"].values())
    assert 0 < sum(updated.values()) <= 2 * math.ceil(0.01 * numel) + 2  # about k per bucket, far below numel
    # gx.SparseGradState.recipe with a 2-step warm-up: the density 0.25 of steps 0-1 is dense (2 dense steps), step 2
    # at 0.05, 3 at 0.01 (the path policy may send a step dense: at most every element), counted after the warm-up
    assert runs["recipe-0.01"]["label"] == "gtopk_ext recipe, d=0.01"
    assert 0 < sum(runs["recipe-0.01"]["updated_per_step"].values()) <= numel
    assert 0 < table["recipe-0.01"]["bytes_vs_ddp"] < 1


def test_race_stops_each_method_at_the_target_or_its_budget(tmp_path):
    """--target-loss: a method stops at its first evaluation at or below it, and the table says when (seconds and
    steps, first); --budget: one that has not reached it by then stops too and is reported as not reached. The
    losses are those of a run without either (the same batches and weights)."""
    common = [sys.executable, "-m", "bench.lm", "--world-size", "2", "--steps", "8", "--eval-every", "2", "--layers",
              "1", "--d-model", "32", "--seq-len", "16", "--batch-size", "4", "--val-windows", "8", "--no-progress",
              "--methods", "ddp", "gtopk-0.01"]

    def run(name: str, *flags: str) -> tuple[str, dict, dict]:
        result = subprocess.run([*common, *flags, "--json", str(tmp_path / name)], cwd=ROOT, timeout=300,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        report = json.loads((tmp_path / name).read_text())
        return (result.stdout, {r["method"]: r for r in report["runs"]},
                {row["method"]: row for row in report["table"]})

    _, free, _ = run("free.json")
    target = free["ddp"]["curve"][2]["val_loss"]  # DDP's loss at step 4
    first = {name: next((c["step"] for c in r["curve"] if c["val_loss"] <= target), None) for name, r in free.items()}
    out, runs, table = run("race.json", "--target-loss", repr(target))
    assert "| s to target | steps to target | method |" in out
    for name, r in runs.items():
        assert table[name]["steps_to_target"] == first[name]
        assert r["curve"][-1]["step"] == (first[name] or 8) and len(r["step_seconds"]) == r["curve"][-1]["step"]
        assert [c["val_loss"] for c in r["curve"]] == [c["val_loss"] for c in free[name]["curve"][:len(r["curve"])]]
    assert table["ddp"]["seconds_to_target"] == runs["ddp"]["curve"][-1]["seconds"] > 0
    _, runs, table = run("budget.json", "--target-loss", repr(target), "--budget", "1e-9")
    for name, r in runs.items():  # out of time at the first evaluation after step 0
        assert [c["step"] for c in r["curve"]] == [0, 2]
        assert table[name]["steps_to_target"] == (first[name] if first[name] == 2 else None)
