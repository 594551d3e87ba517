"""The benchmarks are not timed tests; these runs at tiny sizes only keep them from rotting."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], check=True, cwd=ROOT, timeout=600,
                   capture_output=True, text=True)


def test_selection_benchmark(tmp_path):
    out = tmp_path / "selection.json"
    run_bench("selection.py", "--sizes", "5000", "70001", "--densities", "0.01", "0.05", "--repeats", "2",
              "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["density"]) for r in rows] == [(5000, 0.01), (5000, 0.05), (70001, 0.01), (70001, 0.05)]
    for row in rows:
        assert row["k"] == -(-row["n"] * row["density"] // 1)
        assert set(row["median_ms"]) == {"floor", "gaussiank", "gaussiank_paper", "topk", "topk_sorted"}
        assert all(t > 0 for t in row["median_ms"].values())
