"""The demo is not a test; this tiny run (2 Gloo processes, 1 epoch, 5 methods) keeps it from rotting, and the
default run is pinned to what docs/convergence.md states it runs."""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_demo_writes_sane_json_and_png(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--world-size", "2", "--epochs", "1", "--methods", "dense", "fp16",
         "powersgd-2", "gaussiank-gtopk", "gaussiank-gtopk-recipe", "--densities", "0.01", "--model", "mlp",
         "--batch-size", "32", "--warmup-steps", "8", "--eval-every", "5", "--target", "0.3", "--no-progress",
         "--out", str(tmp_path)],
        cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gaussiank-gtopk" in result.stdout and "test acc" in result.stdout

    report = json.loads((tmp_path / "demo.json").read_text())
    # the regime: DDP's step and the compute floor's, timed, and R from them, in the output and the picture's text
    regime = report["regime"]
    assert 0 < regime["floor_ms_per_step"] and 0 < regime["ddp_ms_per_step"]
    assert regime["R"] == pytest.approx((regime["ddp_ms_per_step"] - regime["floor_ms_per_step"])
                                        / regime["floor_ms_per_step"])
    assert f"regime R = {regime['R']:.1f}: DDP's float32 gradient exchange takes" in result.stdout
    assert f"demo.png: test accuracy against steps, training seconds (the slowest rank's) and MB sent per rank, a " \
           f"line per method, at R = {regime['R']:.1f}; first to 30% test accuracy: " in result.stdout
    runs = {r["method"]: r for r in report["runs"]}
    assert set(runs) == {"dense", "fp16", "powersgd-2", "gaussiank-gtopk", "gaussiank-gtopk-recipe"}
    assert [runs[m]["recipe"] for m in runs] == [None] * 5
    assert ("gaussiank-gtopk-recipe: gx.SparseGradState.recipe(density, warmup_steps=8, momentum=0.9, path='sparse')"
            in result.stdout)
    assert "steps to 30%" in result.stdout and "s to 30%" in result.stdout
    steps = 1438 // (2 * 32)  # the training split's images // the global batch
    dense, sparse = runs["dense"], runs["gaussiank-gtopk"]
    for run in (dense, sparse):
        assert len(run["train_loss"]) == len(run["bytes_sent"]) == len(run["step_ms"]) == steps
        assert all(math.isfinite(v) and v > 0 for v in run["train_loss"] + run["step_ms"])
        assert [e["step"] for e in run["eval"]] == [0, 5, 10, 15, 20, steps]
        assert run["train_loss"][-1] < run["train_loss"][0]
    # chance is 0.1; one short epoch of either method learns the digits (the sparse one more slowly)
    assert dense["final_test_accuracy"] > 0.5 and sparse["final_test_accuracy"] > 0.3
    assert runs["gaussiank-gtopk-recipe"]["final_test_accuracy"] > 0.3
    for run in runs.values():  # the first evaluation at 30% or more: its step and the training seconds until then
        first = next(e for e in run["eval"] if e["test_accuracy"] >= 0.3)
        assert (run["steps_to_target"], run["seconds_to_target"]) == (first["step"], first["seconds"]) != (0, 0.0)
    assert sparse["density"] == 0.01 and dense["density"] == 1.0
    # the MLP's 0.3M parameters at density 0.01, against a ring allreduce of all of them
    assert sparse["bytes_per_step"] < dense["bytes_per_step"] / 20
    assert runs["fp16"]["bytes_per_step"] == dense["bytes_per_step"] / 2 and runs["fp16"]["density"] == 1.0
    assert 0 < runs["powersgd-2"]["bytes_per_step"] < dense["bytes_per_step"] / 20
    # dense iterations (residual warm-up), then the density warm-up, then the target density
    assert sparse["bytes_sent"][0] > sparse["bytes_sent"][5] > sparse["bytes_per_step"] == sparse["bytes_sent"][-1]
    assert 0.8 <= sparse["selected_over_k"] <= 1.25
    assert [(row["method"], row["density"]) for row in report["table"]] == [
        ("dense", 1.0), ("fp16", 1.0), ("powersgd-2", 1.0), ("gaussiank-gtopk", 0.01), ("gaussiank-gtopk-recipe", 0.01)]
    for row in report["table"]:  # one seed: its run's
        assert row["seconds_to_target"] == runs[row["method"]]["seconds_to_target"] > 0

    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 800 and height >= 600 and len(png) > 20_000


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="namespaces and tc need root and iproute2")
def test_demo_on_emulated_links_reports_seconds_to_target(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--rate", "1gbit", "--prefix", "gxsmokedemo", "--world-size", "2",
         "--epochs", "1", "--methods", "dense", "gaussiank-gtopk-recipe", "--densities", "0.01", "--model", "mlp",
         "--batch-size", "32", "--warmup-steps", "8", "--eval-every", "5", "--target", "0.3", "--no-progress",
         "--out", str(tmp_path)], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 Gloo processes on" in result.stdout and "1gbit links (namespaces, tbf)" in result.stdout
    assert "s to 30%" in result.stdout
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["settings"]["rate"] == 1_000_000_000
    for row, run in zip(report["table"], report["runs"]):
        assert 0 < row["steps_to_target"] <= 22 and row["seconds_to_target"] == run["seconds_to_target"] > 0
        assert run["eval"][-1]["tx_bytes"] > 0  # the ranks' interface counter: they talked over the emulated links
    assert "gxsmokedemo" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_recipe_sets_the_hook_and_explicit_flags_win():
    sys.path.insert(0, str(ROOT))
    from bench.demo import make_hook_state, parse_args

    args = parse_args(["--recipe", "dgc-0.001"])
    assert args.methods == ["dense", "gaussiank-gtopk-mc", "gaussiank-allgather-mc"] and args.densities == [0.001]
    state = make_hook_state("gaussiank-gtopk-mc", 0.001, args)
    # momentum in the hook, DGC's warm-up over 4 epochs of 22 steps, masking after it
    config = state.config
    assert (config.momentum.momentum, config.compressor.per_tensor, config.start_iter,
            config.momentum.masking_start_iter) == (0.9, False, 2, 90)
    assert config.density_at(2) == 0.25 and config.density_at(89) > 0.001 and config.density_at(90) == 0.001
    explicit = parse_args(["--recipe", "dgc-0.001", "--warmup-steps", "44", "--methods", "gaussiank-gtopk-mc"])
    assert explicit.methods == ["gaussiank-gtopk-mc"] and not explicit.per_tensor
    assert make_hook_state("gaussiank-gtopk-mc", 0.001, explicit).config.momentum.masking_start_iter == 46
    at_001 = parse_args(["--recipe", "dgc-0.01"])
    assert at_001.densities == [0.01] and at_001.per_tensor
    conv = parse_args(["--recipe", "dgc-0.001-dense-conv"])
    assert (conv.per_tensor, conv.min_compress_numel, conv.warmup_steps) == (True, 20_000, 44)
    assert not parse_args(["--recipe", "dgc-0.001-dense-conv", "--no-per-tensor"]).per_tensor
    # without the recipe: masking from the first compressed step, as the hook's default
    assert make_hook_state("gaussiank-gtopk-mc", 0.001, parse_args([])).config.momentum.masking_start_iter == 0


def test_default_run_compares_the_package_recipe():
    """The default run: DDP, fp16_compress_hook, PowerSGD rank 2 and gx.SparseGradState.recipe at 0.01 and 0.001 with
    the demo's 44-step warm-up, as a user calls it but with every compressed step sparse (auto's choices follow
    timings: the same run twice would differ); the hand-built Gaussian-k + gTop-k keeps its momentum in the optimizer
    and every compressed step sparse."""
    sys.path.insert(0, str(ROOT))
    import gtopk_ext as gx
    from bench.demo import make_hook_state, momentum_in_hook, parse_args, planned_runs
    from bench.digits import make_model
    from bench.harness.train import sgd

    args = parse_args(["--seeds", "0", "1", "2"])
    assert (args.epochs, args.world_size, args.model, args.batch_size, args.lr) == (10, 4, "cnn", 16, 0.05)
    assert [(m, d) for m, d, seed in planned_runs(args) if seed == 0] == [
        ("dense", 1.0), ("fp16", 1.0), ("powersgd-2", 1.0), ("gaussiank-gtopk-recipe", 0.01),
        ("gaussiank-gtopk-recipe", 0.001)]
    model = make_model("mlp", 0)
    for method in ("dense", "fp16", "powersgd-2"):
        assert make_hook_state(method, 1.0, args) is None and not momentum_in_hook(method)
        assert sgd(model, args, momentum_in_hook(method)).defaults["momentum"] == 0.9
    for density in (0.01, 0.001):  # the recipe method is the package's recipe, not a copy of it
        ours, package = make_hook_state("gaussiank-gtopk-recipe", density, args), gx.SparseGradState.recipe(
            density=density, warmup_steps=44)
        assert ours.config.schedule == package.config.schedule
        assert ours.config.momentum == package.config.momentum
        correction = ours.config.momentum
        assert (correction.momentum, correction.nesterov, correction.masking_start_iter, ours.config.path.mode) == (
            0.9, True, 44, "sparse")
        auto = make_hook_state("gaussiank-gtopk-recipe", density, parse_args(["--path", "auto"]))
        assert auto.config.path.mode == package.config.path.mode == "auto"
        assert sgd(model, args, momentum_in_hook("gaussiank-gtopk-recipe")).defaults["momentum"] == 0.0
        plain = make_hook_state("gaussiank-gtopk", density, args)  # the warm-up from the dense steps' end
        assert (plain.config.momentum, plain.config.compressor.per_tensor, plain.config.path.mode) == (
            None, False, "sparse")
        density_at = plain.config.density_at
        assert density_at(2) == 0.25 and density_at(45) > density == density_at(46)


def test_recipe_method_takes_warmup_and_momentum_and_refuses_weight_decay(capsys):
    sys.path.insert(0, str(ROOT))
    from bench.demo import make_hook_state, parse_args

    args = parse_args(["--warmup-steps", "20", "--momentum", "0.8", "--per-tensor", "--densities", "0.005"])
    state = make_hook_state("gaussiank-gtopk-recipe", 0.005, args)
    # the hand-built methods' flags (--per-tensor here) are not the recipe's
    assert (state.config.momentum.momentum, state.config.momentum.masking_start_iter,
            state.config.compressor.per_tensor) == (0.8, 20, False)
    assert state.config.density_at(19) > 0.005 and state.config.density_at(20) == 0.005
    assert make_hook_state("gaussiank-gtopk-mc", 0.005, args).config.compressor.per_tensor
    with pytest.raises(SystemExit):
        parse_args(["--weight-decay", "1e-4"])
    assert "--weight-decay is not part of gaussiank-gtopk-recipe" in capsys.readouterr().err
    parse_args(["--weight-decay", "1e-4", "--methods", "dense", "gaussiank-gtopk-mc"])  # applied in the hook there
