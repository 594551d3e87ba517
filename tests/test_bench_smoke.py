"""The benchmarks are not timed tests; these runs at tiny sizes only keep them from rotting."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The benchmarks' emulated links where this machine can make them (root and iproute2's tc), else loopback, which
# every other benchmark test runs on.
NETWORK = "--rate=1gbit" if os.geteuid() == 0 and shutil.which("tc") is not None else "--loopback"


def run_bench(module: str, *args: str) -> None:
    result = subprocess.run([sys.executable, "-m", f"bench.{module}", *args], cwd=ROOT, timeout=600,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_selection_benchmark(tmp_path):
    out = tmp_path / "selection.json"
    run_bench("selection", "--sizes", "5000", "70001", "--densities", "0.01", "0.05", "--repeats", "2",
              "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["density"]) for r in rows] == [(5000, 0.01), (5000, 0.05), (70001, 0.01), (70001, 0.05)]
    for row in rows:
        assert row["k"] == -(-row["n"] * row["density"] // 1)
        assert set(row["median_ms"]) == {"floor", "gaussiank", "gaussiank_paper", "topk", "topk_sorted"}
        assert all(t > 0 for t in row["median_ms"].values())


def test_selection_profile():
    result = subprocess.run([sys.executable, "-m", "bench.selection", "--profile", "--sizes", "20000",
                             "--densities", "0.01"], cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "n=20000, density=0.01" in result.stdout and "gtopk_ext::gaussian_select" in result.stdout


def test_threshold_accuracy_benchmark(tmp_path):
    out = tmp_path / "accuracy.json"
    run_bench("threshold_accuracy", "--sizes", "20000", "--densities", "0.01", "--distributions", "laplace",
              "spiky", "--real-steps", "0", "2", "--real-sizes", "5000", "--repeats", "1", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["gradient"] for r in rows] == ["laplace", "spiky", "cnn-step0", "cnn-step2", "mlp0.005M-step0",
                                             "mlp0.005M-step2"]
    assert 4000 < rows[-1]["n"] < 6000  # the wide MLP has about the asked number of parameters
    for row in rows:
        assert row["quality"]["topk"]["recall"] == 1.0 and row["quality"]["topk"]["norm"] == 1.0
        assert 0 < row["quality"]["accurate"]["count_over_k"]


def test_wagma_benchmark(tmp_path):
    out = tmp_path / "wagma.json"
    run_bench("wagma", NETWORK, "--world-size", "2", "--group-size", "2", "--global-period", "3", "--steps", "12",
              "--delay-ms", "0", "20", "--sleep-ms", "5", "--repeats", "1", "--prefix", "gxsmokewagma",
              "--json", str(out), "--plot", str(tmp_path / "wagma.png"))
    report = json.loads(out.read_text())
    assert list(report["tables"]) == ["random", "straggler"]
    for rows in report["tables"].values():
        assert [row["method"] for row in rows] == ["ddp", "group-sync", "group-wait-avoiding", "no-group"]
        for row in rows:
            assert row["steps_per_s"] > 0 and 0.0 <= row["accuracy"] <= 1.0
        assert rows[0]["speedup_vs_ddp"] == 1.0 and rows[0]["spread"] is None
        assert rows[-1]["spread_vs_no_group"] == 1.0
    assert (tmp_path / "wagma.png").stat().st_size > 0
    if NETWORK != "--loopback":  # the run removed the namespaces it made
        assert "gxsmokewagma" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_kernel_benchmark_suite_runs():
    """bench/test_kernels_benchmark.py (pytest-benchmark), each case run once at a tiny size."""
    result = subprocess.run([sys.executable, "-m", "pytest", "bench", "-q", "-p", "no:cacheprovider",
                             "--benchmark-disable", "--kernel-sizes", "5000", "--kernel-densities", "0.01"],
                            cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "9 passed" in result.stdout, result.stdout[-3000:]


def test_peers_benchmark(tmp_path):
    out, figure = tmp_path / "peers.json", tmp_path / "peers.png"
    methods = ["powersgd-1", "gtopk-0.01", "sparseloco-0.05-2", "floor"]  # a local method too: SparseLocalSGD
    run_bench("peers", NETWORK, "--world-size", "2", "--model", "mlp", "--mlp-params", "20000", "--steps", "5",
              "--eval-every", "2", "--methods", *methods, "--prefix", "gxsmokepeers", "--no-progress",
              "--json", str(out), "--plot", str(figure))
    report = json.loads(out.read_text())
    assert figure.stat().st_size > 0
    numel = 64 * 108 + 108 + 108 * 108 + 108 + 108 * 10 + 10  # 64-h-h-10 with h = 108: about 20000 parameters
    assert report["parameters"] == numel
    dense_bytes = 4 * numel  # a ring allreduce of the fp32 model on 2 ranks sends it once
    rows = {row["method"]: row for row in report["table"]}
    assert list(rows) == methods
    for name, row in rows.items():
        assert 0 < row["ms_per_step_p25"] <= row["ms_per_step"] <= row["ms_per_step_p75"]
        assert row["cpu_ms_per_step"] > 0
        assert [point["step"] for point in row["curves"][0]] == [0, 2, 4, 5]
        assert all(0.0 <= point["accuracy"] <= 1.0 for point in row["curves"][0])
        assert all(a["train_seconds"] < b["train_seconds"] for a, b in zip(row["curves"][0], row["curves"][0][1:]))
        wire = row["tx_mb_per_step"]
        assert (wire is None) == (NETWORK == "--loopback")
        if name == "floor":  # nothing sent; a stray TCP ACK of the barrier before a step may land in its window
            assert row["own_mb_per_step"] == 0 and (wire is None or wire * 1e6 < 200)
        else:  # the compressing hooks send a small fraction of the dense allreduce, and the link carries it
            assert 0 < row["own_mb_per_step"] * 1e6 < 0.5 * dense_bytes
            assert wire is None or row["own_mb_per_step"] <= wire < 2 * row["own_mb_per_step"] + 0.01
    assert rows["powersgd-1"]["buckets"] == 1 and rows["gtopk-0.01"]["buckets"] >= 1
    assert rows["sparseloco-0.05-2"]["buckets"] is None  # no DDP
    assert report["load"]["other_processes_cores"] >= 0
    if NETWORK != "--loopback":  # the run removed the namespaces it made
        assert "gxsmokepeers" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout



def peers_contestants(rank: int, world_size: int, argvs: list) -> list[dict]:
    """Under each of the options ``argvs``: the SparseGradState that bench.peers' ``dgc-0.001`` recipe attaches
    and the optimizers of it and of ``ddp``."""
    from bench.harness.train import Trainer
    from bench.peers import build_model, parse_args

    described = []
    for argv in argvs:
        args = parse_args(["--model", "mlp", "--mlp-params", "20000", *argv])
        dgc, ddp, recipe = (Trainer(name, build_model(args, 0), args, world_size)
                            for name in ("dgc-0.001", "ddp", "recipe-0.01-44"))
        config, recipe_config = dgc.accounting.state.config, recipe.accounting.state.config
        described.append({
            "start_iter": config.start_iter, "momentum": config.momentum.momentum, "nesterov": config.momentum.nesterov,
            "clip_norm": config.momentum.clip_norm, "per_tensor": config.compressor.per_tensor,
            "min_compress_numel": config.path.min_compress_numel, "density_schedule": config.schedule,
            "masking_start_iter": config.momentum.masking_start_iter,
            "dgc_optimizer": {key: dgc.optimizer.param_groups[0][key] for key in ("momentum", "nesterov")},
            "ddp_optimizer": {key: ddp.optimizer.param_groups[0][key] for key in ("momentum", "nesterov")},
            "recipe_44": (recipe_config.schedule, recipe_config.momentum.masking_start_iter)})
    return described


def test_peers_dgc_options_reach_the_hook():
    from tests.distributed import run_distributed

    default, levers = run_distributed(peers_contestants, 1, [[], [
        "--dgc-warmup", "40", "--dgc-warmup-start", "0.5", "--dgc-dense-steps", "6", "--dgc-per-tensor",
        "--dgc-nesterov", "--dgc-clip-norm", "2.5", "--dgc-min-compress-numel", "50000", "--momentum", "0.8",
        "--nesterov"]])[0]
    # The defaults are the recipe docs/performance.md measured: DGC's warm-up from 0.25 over 20 steps (0.25 ... 0.001
    # in four geometric stages), masking after it, 2 dense steps, the hook's own small-bucket limit.
    assert default["density_schedule"][0] == (0, 0.25) and default["density_schedule"][-1] == (20, 0.001)
    assert (default["start_iter"], default["masking_start_iter"], default["momentum"]) == (2, 20, 0.9)
    assert not default["per_tensor"] and not default["nesterov"] and default["clip_norm"] is None
    assert default["min_compress_numel"] == 1024
    assert levers["density_schedule"][0] == (0, 0.5) and levers["density_schedule"][-1] == (40, 0.001)
    assert (levers["start_iter"], levers["masking_start_iter"], levers["momentum"]) == (6, 40, 0.8)
    assert levers["per_tensor"] and levers["nesterov"] and levers["clip_norm"] == 2.5
    assert levers["min_compress_numel"] == 50000
    # The momentum is in the hook or in the optimizer, never both; --nesterov is the optimizer's.
    assert default["dgc_optimizer"] == levers["dgc_optimizer"] == {"momentum": 0.0, "nesterov": False}
    assert default["ddp_optimizer"] == {"momentum": 0.9, "nesterov": False}
    assert levers["ddp_optimizer"] == {"momentum": 0.8, "nesterov": True}
    # recipe-<d>-<warmup>: gx.SparseGradState.recipe with its own warm-up length, whatever --dgc-warmup says.
    for described in (default, levers):
        schedule, masking = described["recipe_44"]
        assert schedule[0] == (0, 0.25) and schedule[-1] == (44, 0.01) and masking == 44


def test_bytes_per_step_exchange_benchmark(tmp_path):
    out = tmp_path / "bytes.json"
    run_bench("bytes_per_step", "--exchange", "--world-sizes", "2", "--steps", "2", "--hidden", "64", "32",
              "--density", "0.05", "--wire", "plain", "compact", "--json", str(out))
    rows = json.loads(out.read_text())
    numel = 784 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10
    k = -(-numel * 5 // 100)
    assert [(r["collective"], r["wire"]) for r in rows] == [
        ("dense", "plain"), ("allgather", "plain"), ("allgather", "compact"), ("gtopk", "plain"), ("gtopk", "compact"),
        ("oktopk", "plain"), ("oktopk", "compact")]
    assert all(r["parameters"] == numel and r["level"] == "exchange" for r in rows)
    dense, allgather, allgather_compact, gtopk, gtopk_compact, oktopk, _ = rows
    # count and flags (the exchange runs the reduction, which sends the hook's non-finite flag), k lows, k float16
    # values, the shift and the page table (one page: two entries); gTop-k also allreduces its int32 corruption count
    assert allgather_compact["sent_mean"] == gtopk_compact["sent_mean"] - 4 == 8 + 4 * k + 4 + 8
    assert dense["sent_mean"] == 4 * numel  # ring allreduce on 2 ranks: 2(P-1)/P of the buffer
    assert allgather["sent_mean"] == gtopk["sent_mean"] == 8 + 8 * k  # count, flags, k indices, k values
    # Mean over the 2 ranks: at most k pairs to the other region, half of at most 1.25k kept sums back, the
    # counts and (the median of 2 steps) half of the first step's histograms.
    assert 8 * k // 4 < oktopk["sent_mean"] <= 8 * (k + 5 * k // 8) + 2500


def test_bytes_per_step_hook_benchmark(tmp_path):
    """Through the hook: its own counters, every collective it offers."""
    out = tmp_path / "bytes.json"
    run_bench("bytes_per_step", "--world-sizes", "2", "--steps", "2", "--hidden", "64", "32", "--density", "0.05",
              "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["collective"] for r in rows] == ["dense", "allgather", "gtopk", "oktopk"]
    assert all(r["level"] == "hook" and r["sent_mean"] > 0 and r["seconds_median"] > 0 for r in rows)
    assert rows[0]["sent_mean"] == 4 * rows[0]["parameters"]  # ring allreduce on 2 ranks: the buffer once


def test_demo_overhead(tmp_path):
    run_bench("demo", "--overhead", "--world-size", "2", "--methods", "dense", "gaussiank-gtopk", "--densities",
              "0.01", "--model", "mlp", "--warmup-steps", "2", "--overhead-steps", "2", "--overhead-repeats", "2",
              "--out", str(tmp_path))
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [(r["method"], r["density"]) for r in rows] == [("dense", 1.0), ("gaussiank-gtopk", 0.01)]
    assert all(len(r["ms_per_step_rounds"]) == 2 and r["ms_per_step"] > 0 for r in rows)


def test_wire_coding_benchmark(tmp_path):
    out = tmp_path / "wire.json"
    run_bench("wire_coding", "--densities", "0.05", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["gradient"] for r in rows] == ["cnn step 0", "cnn step 100", "mlp 3M step 20", "gaussian 1M",
                                             "student_t3 1M"]
    for row in rows:  # the compact wire's 16-bit lows and page table: about 2 bytes an index
        assert 2 <= row["wire (lows + pages)"] < 2.1 and row["gap entropy"] <= row["varint gaps"]


def test_torchrun_on_emulated_nodes_cli():
    """python -m bench.emulated_network torchrun, on loopback: one agent per node."""
    result = subprocess.run([sys.executable, "-m", "bench.emulated_network", "torchrun", "--loopback", "--nnodes", "2",
                             "--nproc-per-node", "1", "--timeout", "300", "--", "examples/train_ddp.py", "--steps", "4",
                             "--width", "16", "--log-every", "0"],
                            cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 nodes x 1 ranks over loopback" in result.stdout
