"""Keeps the emulated-network scaling benchmark and its cost model from rotting: a tiny loopback run (P = 2, no
namespaces, no shaping) through both CLIs, the cost model's recovery of known costs, and the namespace cleanup."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a directory of the checkout, not part of the installed package
from bench import cost_model  # noqa: E402
from bench.netem_scaling import payload_bytes_per_rank  # noqa: E402


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"bench.{module}", *args], cwd=ROOT, timeout=300,
                          capture_output=True, text=True)


def test_loopback_run_and_model(tmp_path):
    rows_path, model_path, png = tmp_path / "netem.json", tmp_path / "model.json", tmp_path / "scaling.png"
    result = run_module("netem_scaling", "--loopback", "--sizes", "30000", "--densities", "0.001", "0.01",
                        "--world-sizes", "2", "--repeats", "2", "--json", str(rows_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(rows_path.read_text())["rows"]
    assert [(r["method"], r["density"]) for r in rows] == [("dense", None), ("allgather", 0.001),
                                                          ("allgather", 0.01), ("gtopk", 0.001), ("gtopk", 0.01),
                                                          ("oktopk", 0.001), ("oktopk", 0.01)]
    for row in rows:
        assert row["skipped"] is None and row["repeats"] == 2 and len(row["times_s"]) == 2
        assert row["time_s"] > 0 and row["tx_bytes"] is None  # loopback: no per-rank interface to count
        assert row["k"] == (30000 if row["density"] is None else math.ceil(row["density"] * 30000))
        assert row["model_bytes"] == payload_bytes_per_rank(row["method"], 30000, row["k"], 2)
        assert (row["select_s"] is None) == (row["method"] == "dense")

    result = run_module("cost_model", "--json", str(rows_path), "--plot", str(png), "--out", str(model_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(model_path.read_text())
    assert report["quality"]["rows"] == 7
    assert len(report["efficiency"]) == 3 * 10 * 7  # rates x world sizes x series
    assert all(0 < e["efficiency"] <= 1 for e in report["efficiency"])


def test_bad_arguments_are_named():
    result = run_module("netem_scaling", "--world-sizes", "2", "3")
    assert result.returncode == 2 and "--world-sizes must be powers of two" in result.stderr


def synthetic_rows(truth: dict, noise: float) -> list[dict]:
    """Exchange times from the standard formulas (written out here, independently of the module), with
    multiplicative noise, on 2 cores so that the compute terms of P = 4 and 8 are shared."""
    rng = np.random.default_rng(0)
    rows = []
    for rate, bps in (("1gbit", 10**9), ("100mbit", 10**8)):
        beta = truth["beta"][rate]
        for p in (2, 4, 8):
            share = max(1, p / 2)
            for n in (10**6, 25 * 10**6, 10**8):
                for method, density in (("dense", None), ("allgather", 0.001), ("allgather", 0.01),
                                        ("gtopk", 0.001), ("gtopk", 0.01), ("oktopk", 0.01)):
                    k = n if density is None else math.ceil(density * n)
                    if method == "dense":
                        t = 2 * (p - 1) * truth["alpha"] + 2 * (p - 1) / p * 4 * n * beta
                    elif method == "allgather":
                        t = ((p - 1) * (truth["alpha"] + (4 + 8 * k) * beta)
                             + share * (truth["scatter"] * p * k + truth["zero"] * n))
                    elif method == "gtopk":
                        t = math.log2(p) * (truth["alpha"] + (4 + 8 * k) * beta + share * truth["merge"] * 2 * k)
                    else:  # Ok-Topk's steady step: 4(P-1) messages, (P-1)/P of k pairs twice, 24 B of counts
                        t = (4 * (p - 1) * truth["alpha"] + ((p - 1) / p * 16 * k + 24 * (p - 1)) * beta
                             + share * truth["merge"] * 2 * k)
                    rows.append({"method": method, "numel": n, "density": density, "k": k, "world_size": p,
                                 "rate": rate, "rate_bps": bps, "cores": 2, "skipped": None,
                                 "time_s": t * (1 + noise * rng.standard_normal()),
                                 "select_s": None if density is None else truth["select"] * n})
    return rows


def test_cost_model_recovers_known_costs():
    truth = {"alpha": 200e-6, "beta": {"1gbit": 8.4e-9, "100mbit": 84e-9}, "merge": 40e-9, "scatter": 10e-9,
             "zero": 1e-9, "select": 3e-9}
    model = cost_model.fit(synthetic_rows(truth, noise=0.01)).model
    assert model.alpha == pytest.approx(truth["alpha"], rel=0.1)
    assert model.beta == pytest.approx(truth["beta"], rel=0.03)
    assert model.wire_overhead() == pytest.approx(1.05, rel=0.03)
    for name in ("merge", "scatter", "zero"):
        assert getattr(model, name) == pytest.approx(truth[name], rel=0.15), name
    assert model.select == pytest.approx(truth["select"], rel=1e-9)

    exact = cost_model.fit(synthetic_rows(truth, noise=0.0))
    assert exact.quality["max_abs_rel_error"] < 1e-6 and exact.quality["r2"] > 0.999999
    # The prediction on a 10 Gbit/s link of P = 64 machines (own cores: share 1) follows the same formulas.
    k = math.ceil(0.001 * 25_600_000)
    expected = 6 * (200e-6 + (4 + 8 * k) * 0.84e-9 + 40e-9 * 2 * k) + 3e-9 * 25_600_000
    assert cost_model.comm_time(exact.model, "gtopk", 25_600_000, 0.001, 64, 10**10) == pytest.approx(expected,
                                                                                                   rel=1e-6)
    expected = (4 * 63 * 200e-6 + (63 / 64 * 16 * k + 24 * 63) * 0.84e-9 + 40e-9 * 2 * k) + 3e-9 * 25_600_000
    assert cost_model.comm_time(exact.model, "oktopk", 25_600_000, 0.001, 64, 10**10) == pytest.approx(expected,
                                                                                                    rel=1e-6)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_cleanup_removes_only_stale_namespaces():
    stale, live = "gxsmoke999999999-r0", f"gxsmoke{os.getpid()}-r0"  # no process has pid 999999999
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        result = run_module("netem_scaling", "--cleanup", "--prefix", "gxsmoke")
        assert result.returncode == 0, result.stderr
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names and live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
