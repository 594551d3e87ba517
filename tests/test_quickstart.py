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


def readme_adamw_lines() -> list[str]:
    """The python code block of README.md's "With AdamW" section: lines for the quick start's train()."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## With AdamW", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "README.md's With AdamW section has no python code block"
    return match.group(1).splitlines()


def test_readme_adamw_lines_run_in_the_quickstart(tmp_path):
    """The quick start with README's AdamW lines in place of its optimizer and state: it trains sparsely from the
    first step and resumes from its checkpoints."""
    quickstart = (ROOT / "examples" / "quickstart.py").read_text().splitlines()
    optimizer = next(i for i, line in enumerate(quickstart) if line.strip().startswith("optimizer = torch.optim.SGD"))
    state = next(i for i, line in enumerate(quickstart) if line.strip().startswith("state = gx.SparseGradState"))
    script = quickstart[:optimizer] + readme_adamw_lines() + quickstart[optimizer + 1:state] + quickstart[state + 1:]
    (tmp_path / "adamw_quickstart.py").write_text("\n".join(script) + "\n")
    checkpoints = tmp_path / "checkpoints"

    def run(steps: int) -> str:
        command = [str(tmp_path / "adamw_quickstart.py"), "--steps", str(steps), "--checkpoint-dir", str(checkpoints)]
        return "".join(run_torchrun(command, 1, 2, None, tmp_path, f"adamw{steps}", timeout=120,
                                    env={"CUDA_VISIBLE_DEVICES": ""}))

    first = run(30)
    assert "AdamW's momentum decoupled in the hook" in first and "run: 30 steps (30 compressed)" in first, first[-3000:]
    resumed = run(36)
    assert "resumed from step 30" in resumed and "run: 36 steps (36 compressed)" in resumed, resumed[-3000:]
