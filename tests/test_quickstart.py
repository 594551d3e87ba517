"""The README's quick start is examples/quickstart.py, and it runs as written: under torchrun with 2 ranks (CPU,
Gloo), a few steps, then again from its checkpoints."""

import re
import subprocess
from pathlib import Path

import pytest

from bench.harness.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


def readme_quickstart() -> str:
    """The first python code block of README.md's "Quick start" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "README.md's Quick start section has no python code block"
    return match.group(1)


def test_readme_quickstart_is_the_example():
    assert readme_quickstart() == (ROOT / "examples" / "quickstart.py").read_text(), \
        "README.md's quick start and examples/quickstart.py differ: copy one onto the other"


def test_quickstart_runs_under_torchrun_and_resumes(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    env = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU and Gloo path, on any machine

    def run(steps: int) -> str:
        script = ["examples/quickstart.py", "--steps", str(steps), "--warmup-steps", "4",
                  "--checkpoint-dir", str(checkpoints)]
        return "".join(run_torchrun(script, 1, 2, None, tmp_path, f"quickstart{steps}", timeout=120, env=env))

    first = run(8)
    assert "SparseGradState: gaussiank + gtopk" in first and "run: 8 steps" in first, first[-3000:]
    assert re.search(r"step 8: loss \d+\.\d{3} \(mean of 8 steps\)", first), first[-3000:]
    # beside the hook's bytes, DDP's: at 2 ranks a ring allreduce sends the float32 gradient once, 8 times
    numel = (32 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10)
    assert f"{8 * 4 * numel / 1e6:.2f} MB with DDP's allreduce" in first, first[-3000:]
    assert sorted(p.name for p in (checkpoints / "world2").iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = run(12)
    assert "resumed from step 8" in resumed and "run: 12 steps" in resumed, resumed[-3000:]
    assert "step 12: loss" in resumed and "(mean of 4 steps)" in resumed, resumed[-3000:]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git repository")
def test_default_checkpoints_are_ignored_by_git():
    """Run from the repository's root, as the README says, the quick start leaves no untracked files."""
    default = re.search(r'"--checkpoint-dir", default="([^"]+)"', (ROOT / "examples" / "quickstart.py").read_text())
    assert default, "examples/quickstart.py has no --checkpoint-dir default"
    checkpoint = f"{default.group(1)}/world2/rank0.pt"
    assert subprocess.run(["git", "check-ignore", "-q", checkpoint], cwd=ROOT).returncode == 0, \
        f"{checkpoint} is not in .gitignore"
