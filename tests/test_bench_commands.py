"""Every benchmark and planner command that README.md and docs/*.md show (in code blocks, continued over lines with
``\\``, or in backticks in the prose), and those in the benchmarks' own docstrings, parses with its module's
``parse_args``: nothing runs, so a renamed or dropped flag fails here in seconds."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:python -m (?:bench\.\w+|gtopk_ext\.plan)|bash scripts/demo\.sh)\b.*")


def demo_script_flags() -> list[str]:
    """The flags scripts/demo.sh puts before the user's."""
    line = next(line for line in (ROOT / "scripts" / "demo.sh").read_text().splitlines()
                if line.startswith("exec python -m bench.demo"))
    return shlex.split(line.split("bench.demo", 1)[1].replace('"$@"', ""))


def commands(text: str, markdown: bool = True) -> list[str]:
    """The commands of a Markdown page (in its code blocks, and in backticks in its prose) or of a docstring (all of
    it): ``\\`` continuations joined, comments dropped, a loop's variable (``for rate in 1gbit 100mbit``) given
    its first value."""
    parts = text.split("```") if markdown else ["", text]
    found = []
    for block in parts[1::2]:
        block = re.sub(r"\\\n\s*", " ", block)
        loops = dict(re.findall(r"for (\w+) in (\S+)", block))
        for line in block.splitlines():
            match = COMMAND.search(re.split(r"(?:^|\s)#", line)[0])
            if match:
                found.append(re.sub(r"\$(\w+)", lambda var: loops.get(var[1], var[0]), match.group(0)).strip())
    for prose in parts[0::2]:  # a command in backticks may run on over a line break
        found += [" ".join(span.split()) for span in re.findall(r"`(python -m (?:bench\.\w+|gtopk_ext\.plan)[^`]*)`",
                                                               prose)]
    return list(dict.fromkeys(found))


def documented() -> list[tuple[str, str]]:
    """(where, command) of every command the pages and the benchmarks' docstrings show."""
    found = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in commands(page.read_text())]
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.stem not in ("__init__", "conftest"):
            doc = importlib.import_module(f"bench.{path.stem}").__doc__ or ""
            found += [(path.relative_to(ROOT).as_posix(), command) for command in commands(doc, markdown=False)]
    return found


COMMANDS = documented()


def worker_module(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of a benchmark that bench.emulated_network's torchrun launches (``-- -m bench.x ...``)."""
    if "--" in words and words[words.index("--") + 1:][:1] == ["-m"]:
        rest = words[words.index("--") + 2:]
        return (rest[0], rest[1:]) if rest[0].startswith("bench.") else None
    return None


def test_the_pages_show_commands_of_every_benchmark():
    shown = set()
    for where, command in COMMANDS:
        if where.endswith(".md"):
            words = shlex.split(command)
            shown.add("bench.demo" if words[0] == "bash" else words[2])
            launched = worker_module(words)
            if launched:
                shown.add(launched[0])
    benchmarks = {f"bench.{path.stem}" for path in (ROOT / "bench").glob("*.py")
                  if hasattr(importlib.import_module(f"bench.{path.stem}"), "parse_args")}
    assert benchmarks <= shown, f"no documented command for {sorted(benchmarks - shown)}"


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{where}: {command[:80]}" for where, command in COMMANDS])
def test_documented_command_parses(where, command):
    words = shlex.split(command)
    if words[0] == "bash":  # scripts/demo.sh: the demo with the script's flags, then the user's
        module, argv = "bench.demo", demo_script_flags() + words[2:]
    else:
        module, argv = words[2], words[3:]
    launched = worker_module(words)
    try:
        for name, arguments in [(module, argv), *([launched] if launched else [])]:
            importlib.import_module(name).parse_args(arguments)
    except SystemExit as error:
        pytest.fail(f"{where}: `{command}` does not parse (exit {error.code}); see the error above")
