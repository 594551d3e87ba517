"""setup.py's decisions, without compiling: the CUDA kernels where torch sees a GPU or when asked (FORCE_CUDA=1 or
GTOPK_EXT_CUDA=1, as PyTorch extensions do), the line the build starts with, its progress lines, and clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# setup.py run as a build runs it, but setuptools.setup left out: its functions, and nothing built.
PRELUDE = """
import json, os, sys, time, setuptools
setuptools.setup = lambda **kwargs: None
sys.argv = ["setup.py"]
ns = {"__name__": "__main__"}
exec(open("setup.py").read(), ns)
"""


def setup_py(code: str) -> str:
    """What ``code`` prints after setup.py ran (FORCE_CUDA and GTOPK_EXT_CUDA unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_CUDA", "GTOPK_EXT_CUDA")}
    result = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_cuda_kernels_where_torch_sees_a_gpu_or_when_asked_and_clear_errors():
    settings = [{}, {"GTOPK_EXT_CUDA": "0"}, {"FORCE_CUDA": "1"}, {"GTOPK_EXT_CUDA": "1"}, {"FORCE_CUDA": "0"},
                {"FORCE_CUDA": "2"}, {"GTOPK_EXT_CUDA": "yes"}, {"FORCE_CUDA": "1", "GTOPK_EXT_CUDA": "0"}]
    out = setup_py(f"""
results = []
for environ in {settings!r}:
    try:
        cuda, why = ns["cuda_choice"](environ)
        sources = ns["sources"](cuda)
        results.append([sum(s.endswith(".cu") for s in sources), ns["plan"](sources, why)])
    except SystemExit as error:
        results.append([None, str(error)])
print(json.dumps(results))
""")
    default, skipped, forced, asked, not_forced, *errors = json.loads(out.splitlines()[-1])
    if torch.cuda.is_available():
        assert default[0] == 6 and "(torch sees a GPU); the CUDA kernels take several minutes, GTOPK_EXT_CUDA=0 " \
            "skips them" in default[1], default
    else:
        assert default == not_forced == [0, "gtopk_ext: compiling 7 C++ sources, the CPU kernels only (torch sees no "
                                         "GPU); FORCE_CUDA=1 (or GTOPK_EXT_CUDA=1) compiles the CUDA kernels too, "
                                         "with no GPU (several minutes more)"], default
    assert skipped[0] == 0 and "the CPU kernels only (GTOPK_EXT_CUDA=0)" in skipped[1], skipped
    for result, name in ((forced, "FORCE_CUDA"), (asked, "GTOPK_EXT_CUDA")):
        if result[0] is not None:  # a CUDA toolkit and a CUDA build of torch: compiled with or without a GPU
            assert result[0] == 6 and "CUDA sources for" in result[1] and f"(asked for by {name}=1)" in result[1]
        else:
            assert "no CUDA toolkit was found" in result[1], result
    assert errors == [[None, "FORCE_CUDA must be 0 or 1, got '2'"],
                      [None, "GTOPK_EXT_CUDA must be auto, 0 or 1, got 'yes'"],
                      [None, "FORCE_CUDA=1 asks for the CUDA kernels and GTOPK_EXT_CUDA=0 skips them: unset one"]]


def test_progress_names_each_compiled_source_and_speaks_when_quiet(tmp_path):
    """A line at least every ``quiet`` seconds while nothing compiles, and one per object file the compilers write."""
    out = setup_py(f"""
progress = ns["Progress"]({str(tmp_path)!r}, ["csrc/ops.cpp", "csrc/cpu/merge.cpp", "csrc/cuda/merge.cu"], quiet=1.5)
progress.start()
time.sleep(2.5)
os.makedirs({str(tmp_path / "csrc" / "cuda")!r})
open({str(tmp_path / "csrc" / "cuda" / "merge.o")!r}, "w").close()
time.sleep(2.0)
progress.done.set()
progress.join()
""")
    lines = out.splitlines()
    assert lines[0].startswith("gtopk_ext: still compiling (0 of 3 sources done, "), lines
    assert any(line.startswith("gtopk_ext: compiled csrc/cuda/merge.cu (1 of 3, ") for line in lines), lines
