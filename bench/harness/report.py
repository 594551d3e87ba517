"""What a benchmark writes: tables, a JSON record with the machine it ran on, and figures."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
from pathlib import Path


def jsonable(settings) -> dict:
    """An argparse namespace (or dict) as JSON can hold it: paths as strings."""
    items = settings.items() if isinstance(settings, dict) else vars(settings).items()
    return {key: str(value) if isinstance(value, Path) else value for key, value in items}


def write_json(path, settings, **record) -> None:
    """``record`` with the settings it ran with and the machine, at ``path``."""
    import torch

    machine = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
               "cpus": os.cpu_count()}
    Path(path).write_text(json.dumps({"settings": jsonable(settings), "machine": machine, **record}, indent=1,
                                     default=str))
    print(f"wrote {path}")


def table(rows: list, columns: list[tuple], markdown: bool = False, header: bool = True) -> str:
    """``rows`` as a text or Markdown table of ``columns``: (title, format spec, a row's key or function of a row);
    None shows as "-"."""
    lines = [[title for title, _, _ in columns]] if header else []
    for row in rows:
        values = [get(row) if callable(get) else row[get] for _, _, get in columns]
        lines.append(["-" if value is None else format(value, spec) for value, (_, spec, _) in zip(values, columns)])
    if markdown:
        rule = ["---"] + ["---:"] * (len(columns) - 1)
        return "\n".join("| " + " | ".join(line) + " |" for line in lines[:1] + [rule] + lines[1:])
    widths = [max([len(title), int(re.match(r"[<>^]?(\d*)", spec)[1] or 0)] + [len(line[i]) for line in lines])
              for i, (title, spec, _) in enumerate(columns)]
    return "\n".join(" ".join(text.ljust(width) if i == 0 else text.rjust(width)
                              for i, (text, width) in enumerate(zip(line, widths))) for line in lines)


def streamed(rows, columns: list[tuple]) -> list[dict]:
    """``rows`` (an iterable) printed as a table a row at a time, as they come; returns them."""
    print(table([], columns), flush=True)
    out = []
    for row in rows:
        out.append(row)
        print(table([row], columns, header=False), flush=True)
    return out


def to_target(curves: list[list[dict]], reached, seconds_key: str, bytes_key: str | None = None) -> dict:
    """Medians over ``curves`` of ``step``, ``seconds_key`` (and ``bytes_key``, as "bytes_to_target") where first
    ``reached``; None unless all got there."""
    firsts = [next((point for point in curve if reached(point)), None) for curve in curves]
    keys = {"steps_to_target": "step", "seconds_to_target": seconds_key, **({"bytes_to_target": bytes_key}
                                                                             if bytes_key else {})}
    return {name: None if not firsts or None in firsts else statistics.median(p[key] for p in firsts)
            for name, key in keys.items()}


def figure(rows: int, columns: int, size: tuple[float, float]):
    """A matplotlib figure drawn to files only (no display needed) and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, figsize=size, squeeze=False)


def save(figure, path) -> None:
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


def plot_curves(runs: list[dict], path, title: str, ylabel: str, y, panels: list[tuple], yscale: str = "linear",
                style=None) -> None:
    """A line per run (its ``curve``, labelled ``label``) of ``y(point)`` against each panel's ``x(point)``: ``panels``
    are (x label, x, x scale); ``style(index, run)``: the line's matplotlib options."""
    import matplotlib.ticker

    fig, axes = figure(1, len(panels), (max(9.0, 5.5 * len(panels) + 0.5), 5.5))
    for axis, (xlabel, x, xscale) in zip(axes[0], panels):
        for index, run in enumerate(runs):
            points = [(x(c), y(c)) for c in run["curve"]
                      if (xscale != "log" or x(c) > 0) and (yscale != "log" or y(c) > 0)]  # a log axis has no 0
            axis.plot(*zip(*points), marker=".", label=run["label"] if axis is axes[0, 0] else None,
                      **(style(index, run) if style else {"color": f"C{index % 10}"}))
        axis.set(xlabel=xlabel, ylabel=ylabel, xscale=xscale, yscale=yscale)
        axis.grid(True, which="both", alpha=0.3)
        for scaled in (axis.xaxis, axis.yaxis):  # plain numbers on log scales: 0.1 and 20, not 10^-1 and 2 x 10^1
            if scaled.get_scale() == "log":
                scaled.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
                scaled.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(title, fontsize=8, wrap=True)
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.93), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    save(fig, path)


def progress(total: int, rank: int, args, config: dict):
    """Rank 0's progress bar in steps (none elsewhere, or with ``args.no_progress``). The driver streams it from a
    log: redrawn every 0.1 s it would flood a redirect of the driver's output."""
    from tqdm import tqdm

    return tqdm(total=total, unit="step", mininterval=0.5 if config["tty"] else 30, file=sys.stdout,
                disable=rank != 0 or args.no_progress)
