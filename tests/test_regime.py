"""The races in the users' regime (bench/harness/regime.py, ``bench.lm --regime R --steps-from``): R from a GPU
deployment, the link rate that gives DDP's exchange R x the compute's step, seconds from steps and a probe's step
times, the race's rows; and a tiny race on shaped links (as root)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.regime import (TIMED_STEPS, WIRE_OVERHEAD, Regime, nearest_deployment, probe_steps, seconds_for,
                                  steady_seconds)
from bench.lm import race_rows
from gtopk_ext.plan import gpu_ratio

ROOT = Path(__file__).resolve().parents[1]


def test_ratio_of_gpu_nodes_is_the_issues_formula():
    # R = 4F / (3 T bw): H100s at 400 Tflop/s achieved, 16,384 tokens a GPU, bw in bytes per second
    assert gpu_ratio(400, 16384, 100e9) == pytest.approx(4 * 400e12 / (3 * 16384 * 12.5e9))
    assert [round(gpu_ratio(400, 16384, bw), 1) for bw in (100e9, 10e9, 1e9)] == [2.6, 26.0, 260.4]
    assert nearest_deployment(30)[0].endswith("10 Gbit/s Ethernet")
    assert nearest_deployment(300)[0].endswith("1 Gbit/s between sites")


def test_rate_makes_ddps_exchange_r_times_the_floor():
    regime = Regime(ratio=30, floor_seconds=0.25, ddp_bytes=2.6e6)
    # 2.6 MB in 30 x 0.25 s = 7.5 s, with the frames' headers
    assert regime.rate_bps == round(2.6e6 * 8 * WIRE_OVERHEAD / 7.5)
    assert 1.04 < WIRE_OVERHEAD < 1.05
    assert "R = 30" in regime.describe() and "7.5 s" in regime.describe()


def test_probe_lengths_and_seconds_from_steps():
    assert probe_steps(24) == 24 + TIMED_STEPS and probe_steps(0, period=32) == 32 and probe_steps(2, period=8) == 24
    # a warm-up of 4 slow steps, then 20 steady ones at 1 s (one outlier: the median ignores it)
    probe = [5.0] * 4 + [1.0] * 19 + [9.0]
    assert seconds_for(3, probe) == 15.0
    assert seconds_for(len(probe), probe) == sum(probe) == 48.0
    assert seconds_for(100, probe) == 48.0 + 76 * 1.0
    # every H = 4 steps a 3 s sync: the mean over the whole periods, (3 x 0.5 + 3) / 4 per step
    periodic = [0.5, 0.5, 0.5, 3.0] * 5
    assert seconds_for(40, periodic, period=4) == pytest.approx(sum(periodic) + 20 * 1.125)
    # an overlapped exchange: the first period waits for none, each later one for one (2 s); the first is left out
    overlapped = [0.5] * 4 + [0.5, 0.5, 0.5, 2.0] * 2
    assert steady_seconds(overlapped, period=4, skip=4) == pytest.approx(0.875)
    assert seconds_for(20, overlapped, period=4, skip=4) == pytest.approx(sum(overlapped) + 8 * 0.875)


def curve(losses: list[float], bytes_per_step: float, every: int = 10) -> list[dict]:
    return [{"step": every * i, "val_loss": loss, "bytes_sent": every * i * bytes_per_step, "seconds": 0.0}
            for i, loss in enumerate(losses)]


def test_race_rows_read_each_seeds_steps_and_time_them_at_the_regime():
    regime = Regime(ratio=30, floor_seconds=0.1, ddp_bytes=1e6)
    references = [  # seed 0 and 1 of each method: the target 2.0 is first reached at these steps
        {"method": "ddp", "seed": 0, "curve": curve([5, 3, 2.0], 1e6)},  # step 20
        {"method": "ddp", "seed": 1, "curve": curve([5, 3, 2.5, 1.9], 1e6)},  # step 30
        {"method": "bf16", "seed": 0, "curve": curve([5, 3, 1.9], 5e5)},  # 20
        {"method": "bf16", "seed": 1, "curve": curve([5, 3, 1.8], 5e5)},  # 20
        {"method": "adamw-0.01", "seed": 0, "curve": curve([5, 4, 3, 2.5, 2.0], 2e4)},  # 40
        {"method": "adamw-0.01", "seed": 1, "curve": curve([5, 4, 3, 2.5, 2.1], 2e4)},  # not in 40
        {"method": "floor", "seed": 0, "curve": curve([5, 3, 2], 0)}]
    probes = [{"method": name, "label": name, "period": None, "step_seconds": [seconds] * 22}
              for name, seconds in (("ddp", 3.1), ("bf16", 1.6), ("adamw-0.01", 0.2), ("floor", 0.1))]
    rows = {row["method"]: row for row in race_rows(probes, references, 2.0, regime)}
    assert list(rows) == ["ddp", "bf16", "adamw-0.01"]  # the floor is the ideal's, not a racer
    assert [r["steps_to_target"] for r in rows["ddp"]["per_seed"]] == [20, 30] and rows["ddp"]["steps_to_target"] == 25
    assert rows["ddp"]["seconds_to_target"] == pytest.approx((20 * 3.1 + 22 * 3.1 + 8 * 3.1) / 2)
    assert rows["bf16"]["seconds_to_target"] == pytest.approx(20 * 1.6)
    assert rows["bf16"]["vs_best_peer"] == 1.0 and rows["ddp"]["vs_best_peer"] == pytest.approx(77.5 / 32)
    assert rows["ddp"]["vs_ideal"] == pytest.approx(77.5 / (0.1 * 25))  # the floor's step x DDP's steps
    assert rows["ddp"]["mb_to_target"] == pytest.approx(25.0) and rows["bf16"]["mb_to_target"] == pytest.approx(10.0)
    # a seed that never reached the target: no mean, no seconds
    assert [r["steps_to_target"] for r in rows["adamw-0.01"]["per_seed"]] == [40, None]
    assert rows["adamw-0.01"]["seconds_to_target"] is None and rows["adamw-0.01"]["vs_ideal"] is None
    assert not rows["adamw-0.01"]["peer"] and rows["ddp"]["peer"] and rows["bf16"]["peer"]


def test_race_rows_need_a_full_run_of_every_method():
    probes = [{"method": "powersgd-4", "label": "p", "period": None, "step_seconds": [1.0] * 20}]
    with pytest.raises(SystemExit, match="no full run of powersgd-4"):
        race_rows(probes, [{"method": "ddp", "seed": 0, "curve": curve([5, 1], 1)}], 2.0,
                  Regime(3, 0.1, 1e6))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="namespaces and tc need root and iproute2")
def test_tiny_race_at_a_regime(tmp_path):
    """A full run on loopback, then each method timed at R = 20 with the floor given: the links' rate is the
    formula's, each method ran its probe's steps, and DDP's step took at least its exchange's time at that rate."""
    tiny = ["--world-size", "2", "--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch-size", "4",
            "--val-windows", "8", "--no-progress", "--steps", "8", "--eval-every", "2"]
    methods = ["ddp", "adamw-0.01", "sparse-gtopk-0.1-4"]

    def run(*flags: str) -> str:
        result = subprocess.run([sys.executable, "-m", "bench.lm", *tiny, "--methods", *methods, *flags], cwd=ROOT,
                                timeout=600, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    run("--json", str(tmp_path / "full.json"))
    full = {r["method"]: r for r in json.loads((tmp_path / "full.json").read_text())["runs"]}
    target = full["ddp"]["curve"][2]["val_loss"]  # DDP's at step 4
    out = run("--regime", "20", "--floor-ms", "20", "--steps-from", str(tmp_path / "full.json"), "--target-loss",
              repr(target), "--json", str(tmp_path / "race.json"))
    race = json.loads((tmp_path / "race.json").read_text())
    # embeddings, the block's two LayerNorms, qkv, attention out, the MLP's two layers, the final LayerNorm, the head
    numel = (256 * 32 + 16 * 32 + 4 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
             + 2 * 32 + (32 * 256 + 256))
    ddp_bytes = 4 * numel  # a ring allreduce of 2 ranks: each sends half the float32 gradient twice
    rate = round(8 * WIRE_OVERHEAD * ddp_bytes / (20 * 0.020))
    assert race["settings"]["rate"] == rate and f"links of {rate / 1e6:.4g} Mbit/s" in out
    probes = {r["method"]: r for r in race["runs"]}
    assert [len(probes[m]["step_seconds"]) for m in methods] == [2 + 20, 2 + 20, 20]
    rows = {row["method"]: row for row in race["race"]}
    assert rows["ddp"]["steps_to_target"] == 4
    assert rows["ddp"]["ms_per_step"] >= 0.9 * 8e3 * ddp_bytes / rate  # at least the bytes at the link's rate
    for name in methods:
        reached = next((c["step"] for c in full[name]["curve"] if c["val_loss"] <= target), None)
        assert rows[name]["per_seed"][0]["steps_to_target"] == reached
        assert rows[name]["seconds_to_target"] == (reached and pytest.approx(
            sum(probes[name]["step_seconds"][:reached])))
    assert math.isfinite(rows["ddp"]["vs_ideal"]) and rows["ddp"]["vs_ideal"] > 1
    # --timed-from: the same table again from the recorded step times, nothing run (no --regime, no model flags)
    again = subprocess.run([sys.executable, "-m", "bench.lm", "--steps-from", str(tmp_path / "full.json"),
                            "--timed-from", str(tmp_path / "race.json"), "--target-loss", repr(target), "--json",
                            str(tmp_path / "again.json"), "--plot", str(tmp_path / "again.png")], cwd=ROOT, timeout=120,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "again.json").read_text())["race"] == race["race"]
    # full runs of another model are not this race's
    other = json.loads((tmp_path / "full.json").read_text())
    other["settings"]["d_model"] = 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    refused = subprocess.run([sys.executable, "-m", "bench.lm", "--steps-from", str(tmp_path / "other.json"),
                              "--timed-from", str(tmp_path / "race.json"), "--target-loss", repr(target)], cwd=ROOT,
                             timeout=120, capture_output=True, text=True)
    assert refused.returncode != 0 and "differs from the timed run in ['d_model']" in refused.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="namespaces and tc need root and iproute2")
def test_peers_at_a_regime(tmp_path):
    """bench.peers --regime: the MLP's links at the formula's rate; DDP's step at least its exchange at that rate."""
    result = subprocess.run([sys.executable, "-m", "bench.peers", "--world-size", "2", "--model", "mlp", "--mlp-params",
                             "1e5", "--steps", "8", "--methods", "ddp", "floor", "--regime", "10", "--floor-ms", "10",
                             "--no-progress", "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "p.json")],
                            cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "p.json").read_text())
    ddp_bytes = 4 * report["parameters"]  # 2 ranks: a ring allreduce sends the float32 gradient once in all
    assert report["settings"]["rate"] == round(8 * WIRE_OVERHEAD * ddp_bytes / (10 * 0.010))
    rows = {row["method"]: row for row in report["table"]}
    assert rows["ddp"]["ms_per_step"] >= 0.9 * 10 * 10 and "regime R = 10" in result.stdout
    assert "R = " in result.stdout.split("measured: DDP's step")[1]
