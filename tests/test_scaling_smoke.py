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


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"bench.{module}", *args], cwd=ROOT, timeout=300,
                          capture_output=True, text=True)


def test_loopback_run_and_model(tmp_path):
    """Two emulated nodes of two ranks on loopback: every method, both wires, the hierarchical collective and the
    dense allreduce inside a node; then the model fits them and draws both plots."""
    rows_path, model_path = tmp_path / "netem.json", tmp_path / "model.json"
    result = run_module("netem_scaling", "--loopback", "--sizes", "30000", "--densities", "0.01", "--world-sizes",
                        "4", "--local-size", "2", "--repeats", "2", "--json", str(rows_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(rows_path.read_text())["rows"]
    assert [(r["method"], r["wire"], r["world_size"]) for r in rows] == [
        ("dense", "plain", 4), ("dense", "plain", 2), ("allgather", "plain", 4), ("allgather", "compact", 4),
        ("gtopk", "plain", 4), ("gtopk", "compact", 4), ("oktopk", "plain", 4), ("oktopk", "compact", 4),
        ("hierarchical", "plain", 4)]
    for row in rows:
        assert row["skipped"] is None and row["repeats"] == 2 and len(row["times_s"]) == 2
        assert row["time_s"] > 0 and row["tx_bytes"] is None  # loopback: no interface to count
        assert row["local_size"] == 2 and row["k"] == (30000 if row["density"] is None else 300)
        assert (row["select_s"] is None) == (row["method"] == "dense")
    # What the model puts on a node's link: gTop-k's one round between the 2 nodes carries both ranks' sets.
    assert rows[4]["model_bytes"] == 2 * (4 + 8 * 300) and rows[5]["model_bytes"] == 2 * (4 * 4 + 4 * 300) + 6

    plots = tmp_path / "flat.png", tmp_path / "two_level.png"
    result = run_module("cost_model", "--json", str(rows_path), "--plot", str(plots[0]), "--plot-two-level",
                        str(plots[1]), "--out", str(model_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    report = json.loads(model_path.read_text())
    assert report["quality"]["rows"] == 9
    assert len(report["efficiency"]) == 3 * 10 * 13  # rates x world sizes x (dense + 2 densities x 3 x 2 wires)
    assert len(report["two_level"]) == 2 * 3 * 7 * 13  # intra links x rates x world sizes x series
    assert all(0 < e["efficiency"] <= 1 for e in report["efficiency"] + report["two_level"])
    [comparison] = report["hierarchical_against_flat"]
    assert comparison["hierarchical_s"] == rows[8]["time_s"] and comparison["flat_gtopk_s"] == rows[4]["time_s"]


def test_bad_arguments_are_named():
    result = run_module("netem_scaling", "--local-size", "2", "--world-sizes", "2", "3")
    assert result.returncode == 2 and "--world-sizes must be >= 2 and multiples of --local-size 2" in result.stderr


def test_bytes_by_hand():
    """n = 100,000 (2 pages of 65,536), k = 1000: plain message 4 + 8000 bytes, compact 4 * (1 + 2 + 2) + 4000."""
    n, k = 100_000, 1000
    assert cost_model.bytes_per_rank("dense", n, n, 4) == 600_000
    assert cost_model.bytes_per_rank("allgather", n, k, 8) == 7 * 8004
    assert cost_model.bytes_per_rank("allgather", n, k, 8, "compact") == 7 * 4020
    assert cost_model.bytes_per_rank("gtopk", n, k, 8) == 3 * 8004
    assert cost_model.bytes_per_rank("gtopk", n, k, 8, "compact") == 3 * 4020 + 7  # + the int32 check: 2*7*4//8
    # P = 6: 4 ranks in the butterfly (2 rounds), 2 fold in and get the result back with a 125-byte mask.
    assert cost_model.bytes_per_rank("gtopk", n, k, 6) == pytest.approx((4 * 2 * 8004 + 2 * (2 * 8004 + 125)) / 6)
    # Ok-Topk, P = 4: 2 x 3 messages of k/4 pairs, 24 bytes of counts per other rank.
    assert cost_model.bytes_per_rank("oktopk", n, k, 4) == 2 * 3 * 8 * 250 + 72
    assert cost_model.bytes_per_rank("oktopk", n, k, 4, "compact") == 2 * 3 * (20 + 4 * 250) + 72 + 6
    # Two levels, 4 nodes x 2: gTop-k's first round inside the node, two rounds carry 2 sets on the node's link.
    assert cost_model.features("gtopk", n, k, 8, 1.0, local=2) == {
        "alpha": 2, "alpha_intra": 1, "beta": 2 * 2 * 8004, "beta_intra": 8004, "merge": 3 * 2 * k}
    # Hierarchical, 2 nodes x 2: reduce-scatter of 50,000-element shards, allgather of the shard's k/2 pairs (+ an
    # 8-byte header), gTop-k of k/2 pairs between the 2 nodes, both local ranks' sets on the node's link.
    assert cost_model.features("hierarchical", n, k, 4, 1.0, local=2) == {
        "alpha_intra": 2, "beta_intra": 4 * 50_000 + 8 + 8 * 500, "copy": n, "alpha": 1, "beta": 2 * (4 + 8 * 500),
        "merge": 1000}


def pages(n: int) -> int:
    return -(-n // 65536)


def synthetic_rows(truth: dict, noise: float) -> list[dict]:
    """Exchange times from the standard formulas (written out here, independently of the module), with
    multiplicative noise, on 2 cores so that the compute terms of P = 4 and 8 are shared; one level (plain and
    compact wire) and two nodes of two ranks."""
    rng = np.random.default_rng(0)
    rows = []
    alpha, alpha_i, beta_i = truth["alpha"], truth["alpha_intra"], truth["beta_intra"]

    def add(method, n, density, p, rate, bps, t, wire="plain", local=1):
        k = n if density is None else math.ceil(density * n)
        rows.append({"method": method, "wire": wire, "local_size": local, "numel": n, "density": density, "k": k,
                     "world_size": p, "rate": rate, "rate_bps": bps, "cores": 2, "skipped": None,
                     "time_s": t * (1 + noise * rng.standard_normal()),
                     "select_s": None if density is None else truth["select"] * n})

    for rate, bps in (("1gbit", 10**9), ("100mbit", 10**8)):
        beta = truth["beta"][rate]
        for p in (2, 4, 8):
            share = max(1, p / 2)
            check = 2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * beta  # compact: the int32 allreduce
            for n in (10**6, 25 * 10**6, 10**8):
                add("dense", n, None, p, rate, bps, 2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * n * beta)
                for density in (0.001, 0.01):
                    k = math.ceil(density * n)
                    plain, compact = 4 + 8 * k, 4 * (3 + pages(n)) + 4 * k
                    add("allgather", n, density, p, rate, bps, (p - 1) * (alpha + plain * beta)
                        + share * (truth["scatter"] * p * k + truth["zero"] * n))
                    add("allgather", n, density, p, rate, bps, (p - 1) * (alpha + compact * beta)
                        + share * (truth["scatter"] * p * k + truth["zero"] * n + truth["encode"] * k
                                   + truth["decode"] * (p + 1) * k), "compact")
                    add("gtopk", n, density, p, rate, bps,
                        math.log2(p) * (alpha + plain * beta + share * truth["merge"] * 2 * k))
                    add("gtopk", n, density, p, rate, bps, check + math.log2(p) * (
                        alpha + compact * beta + share * k * (2 * truth["merge"] + truth["encode"]
                                                              + 2 * truth["decode"])), "compact")
                    # Ok-Topk's steady step: 4(P-1) messages, (P-1)/P of k pairs twice, 24 B of counts
                    add("oktopk", n, density, p, rate, bps, 4 * (p - 1) * alpha
                        + ((p - 1) / p * 16 * k + 24 * (p - 1)) * beta + share * truth["merge"] * 2 * k)
                    add("oktopk", n, density, p, rate, bps, check + 4 * (p - 1) * alpha
                        + ((p - 1) / p * 8 * k + 2 * (p - 1) * 4 * (3 + pages(n)) + 24 * (p - 1)) * beta
                        + share * k * (2 * truth["merge"] + truth["encode"] + (1 + 2 * (p - 1) / p)
                                       * truth["decode"]), "compact")
        for n in (10**6, 4 * 10**6, 16 * 10**6):  # 2 nodes x 2 ranks on 2 cores: share 2
            add("dense", n, None, 2, rate, bps, 2 * alpha_i + 4 * n * beta_i, local=2)
            add("dense", n, None, 4, rate, bps, 6 * alpha + 6 / 4 * 4 * n * beta, local=2)
            for density in (0.001, 0.01):
                k = math.ceil(density * n)
                add("gtopk", n, density, 4, rate, bps, alpha_i + (4 + 8 * k) * beta_i + alpha
                    + 2 * (4 + 8 * k) * beta + 2 * truth["merge"] * 2 * 2 * k, local=2)
                add("hierarchical", n, density, 4, rate, bps, 2 * alpha_i + (2 * n + 8 + 4 * k) * beta_i + alpha
                    + 2 * (4 + 8 * k / 2) * beta + 2 * truth["merge"] * k + 2 * (truth["select"] * n / 2
                                                                                 + truth["copy"] * n), local=2)
    return rows


def test_cost_model_recovers_known_costs():
    truth = {"alpha": 200e-6, "beta": {"1gbit": 8.4e-9, "100mbit": 84e-9}, "merge": 40e-9, "scatter": 10e-9,
             "zero": 1e-9, "select": 3e-9, "encode": 6e-9, "decode": 4e-9, "copy": 2e-9, "alpha_intra": 50e-6,
             "beta_intra": 0.5e-9}
    model = cost_model.fit(synthetic_rows(truth, noise=0.01)).model
    assert model.alpha == pytest.approx(truth["alpha"], rel=0.1)
    assert model.beta == pytest.approx(truth["beta"], rel=0.03)
    assert model.wire_overhead() == pytest.approx(1.05, rel=0.03)
    for name in ("merge", "scatter", "zero", "encode", "decode", "copy", "beta_intra"):
        assert getattr(model, name) == pytest.approx(truth[name], rel=0.2), name
    assert model.select == pytest.approx(truth["select"], rel=1e-9)

    exact = cost_model.fit(synthetic_rows(truth, noise=0.0))
    assert exact.quality["max_abs_rel_error"] < 1e-6 and exact.quality["r2"] > 0.999999
    # A few messages inside a node next to the link's: alpha_intra is found without noise only.
    assert exact.model.alpha_intra == pytest.approx(truth["alpha_intra"], rel=1e-3)
    # The prediction on a 10 Gbit/s link of P = 64 machines (own cores: share 1) follows the same formulas.
    k = math.ceil(0.001 * 25_600_000)
    expected = 6 * (200e-6 + (4 + 8 * k) * 0.84e-9 + 40e-9 * 2 * k) + 3e-9 * 25_600_000
    assert cost_model.comm_time(exact.model, "gtopk", 25_600_000, 0.001, 64, 10**10) == pytest.approx(expected,
                                                                                                   rel=1e-6)
    expected = (4 * 63 * 200e-6 + (63 / 64 * 16 * k + 24 * 63) * 0.84e-9 + 40e-9 * 2 * k) + 3e-9 * 25_600_000
    assert cost_model.comm_time(exact.model, "oktopk", 25_600_000, 0.001, 64, 10**10) == pytest.approx(expected,
                                                                                                    rel=1e-6)
    # Hierarchical on 8 nodes of 8 behind 10 Gbit/s links, NVLink-like links inside (5 us, 200 GB/s).
    shard, shard_k = 3_200_000, 3200
    expected = (14 * 5e-6 + 7 * (4 * shard + 8 + 8 * shard_k) / 200e9 + 3e-9 * shard + 2e-9 * 25_600_000
                + 3 * (200e-6 + 8 * (4 + 8 * shard_k) * 0.84e-9 + 40e-9 * 2 * shard_k))
    assert cost_model.comm_time(exact.model, "hierarchical", 25_600_000, 0.001, 64, 10**10, local=8,
                                intra=(5e-6, 200e9)) == pytest.approx(expected, rel=1e-6)
    # Where hierarchical beats flat gTop-k: the intra-node bandwidth at which both times are equal.
    n, density = 4 * 10**6, 0.01
    bandwidth = cost_model.break_even_intra(exact.model, n, density, 4, 2, truth["beta"]["1gbit"], share=2.0)
    at = {}
    for method in ("hierarchical", "gtopk"):
        rows = [r for r in synthetic_rows({**truth, "beta_intra": 1 / bandwidth}, 0.0)
                if r["method"] == method and r["local_size"] == 2 and r["numel"] == n and r["density"] == density
                and r["rate"] == "1gbit"]
        at[method] = rows[0]["time_s"] + (2 * truth["select"] * n if method == "gtopk" else 0)
    assert at["hierarchical"] == pytest.approx(at["gtopk"], rel=1e-6)


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
