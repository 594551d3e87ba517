"""bench/fsdp_lm.py is not a test; this keeps it from rotting: a tiny run under two torchrun agents as two nodes of
two ranks, on loopback (and, as root, in a regime: emulated links at the rate its --regime derives), writes a sane
report."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from bench.harness.launch import ROOT, run_torchrun

TINY = ["--steps", "6", "--eval-every", "3", "--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch-size",
        "4", "--val-windows", "8", "--start-iter", "2", "--settle", "1", "--methods", "hsdp", "sparse-0.05-sparse"]


def check_report(path, emulated: bool) -> dict:
    report = json.loads(path.read_text())
    runs = {run["method"]: run for run in report["runs"]}
    rows = {row["method"]: row for row in report["table"]}
    assert list(runs) == ["hsdp", "sparse-0.05-sparse"]
    assert report["link"].endswith("/s links (tbf), regime R = 3 (floor %.0f ms)" % report["settings"]["floor_ms"])\
        if emulated else report["link"] == "loopback"
    for run in runs.values():
        losses = [point["val_loss"] for point in run["curve"]]
        assert [point["step"] for point in run["curve"]] == [0, 3, 6] and all(map(math.isfinite, losses))
        assert losses[-1] < losses[0], run["curve"]  # it trains
        assert len(run["step_seconds"]) == 6 and all(s > 0 for s in run["step_seconds"])
        assert [len(node) for node in run["bytes_sent_per_node"]] == [2] * 6  # per step, each node
    hsdp, sparse = rows["hsdp"], rows["sparse-0.05-sparse"]
    # d = 0.05: 5% of the slots, twice the bytes per slot (index and value), one round between two nodes
    assert 0 < 5 * sparse["sent_step"] < hsdp["sent_step"], (sparse, hsdp)
    assert 0 < sparse["sent_run"] < hsdp["sent_run"] and sparse["sent_step_vs_hsdp"] < 0.2
    assert runs["sparse-0.05-sparse"]["paths"] == {"sparse": 2 * 4 * 3}  # 2 groups x 4 ranks x the 3 steady steps
    assert runs["hsdp"]["paths"] == {} and hsdp["final_val_loss_vs_hsdp"] == 1.0
    if emulated:  # the nodes' interface counters: HSDP's dense all-reduce crosses the links, the sparse hook less
        assert 0 < 3 * sparse["link_step"] < hsdp["link_step"] and hsdp["link_step"] >= hsdp["sent_step"]
    else:
        assert hsdp["link_step"] == sparse["link_step"] == 0  # nothing counted on loopback
    return report


def test_tiny_run_on_loopback(tmp_path):
    out = tmp_path / "fsdp_lm.json"
    run_torchrun(["-m", "bench.fsdp_lm", *TINY, "--json", str(out)], 2, 2, None, tmp_path, "fsdp-lm", timeout=240)
    check_report(out, emulated=False)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="namespaces and tc need root and iproute2")
def test_tiny_run_in_a_regime(tmp_path):
    """--regime 3: the floor measured (the method 'floor' on loopback), then links where HSDP's float32 all-reduce
    between the 2 nodes (a ring: each node sends 4 bytes x the parameters) takes 3 floors, TCP/IP's headers
    included."""
    out = tmp_path / "fsdp_lm.json"
    run = subprocess.run([sys.executable, "-m", "bench.fsdp_lm", "--regime", "3", *TINY, "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = check_report(out, emulated=True)
    floor_s = report["settings"]["floor_ms"] / 1e3
    assert 0 < floor_s < 5
    expected_bps = 8 * 4 * report["runs"][0]["parameters"] * (1448 + 66) / 1448 / (3 * floor_s)
    number, unit = re.search(r"([\d.]+)([KMG]?)bit/s links", report["link"]).groups()
    assert float(number) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[unit] == pytest.approx(expected_bps, rel=0.02)
    assert "regime R = 3: DDP sends" in run.stdout and "as HSDP ran" in run.stdout
    assert "gxfsdp" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_regime_under_torchrun_is_refused_clearly():
    """A worker on an emulated link (torchrun's LOCAL_RANK set, Gloo on the node's interface) given --regime without
    the floor the launcher passes: its link was not set by the regime."""
    from bench.emulated_network import RANK_IFNAME

    env = {**os.environ, "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": RANK_IFNAME}
    run = subprocess.run([sys.executable, "-m", "bench.fsdp_lm", "--regime", "3", *TINY], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--regime launches torchrun itself" in run.stderr, run.stderr[-2000:]
