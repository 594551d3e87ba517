"""The density schedule of the DDP hook: a density per iteration (DGC's exponential warm-up, or any list or
function), the same on every rank."""

from __future__ import annotations

from typing import Callable, Sequence, Union

from gtopk_ext.compressors import check_density

# A density, a list of (start_iter, density) pairs (each from its iteration on), or a function iter -> density.
DensitySchedule = Union[float, Sequence[tuple[int, float]], Callable[[int], float]]


def exponential_warmup(final_density: float, warmup_iters: int, start_density: float = 0.25, stages: int = 4,
                       start_iter: int = 0) -> list[tuple[int, float]]:
    """DGC's exponential sparsity warm-up as a ``density_schedule``: the density falls geometrically from
    ``start_density`` to ``final_density`` in ``stages`` equal steps over the ``warmup_iters`` iterations from
    ``start_iter`` on (DGC: 0.25, 0.0625, 0.0156, 0.004, 0.001 over four epochs; geometric: 0.25, 0.0629, 0.0158,
    0.0040, 0.001). No warm-up (``warmup_iters=0`` or a start at or below the final density): the final density."""
    check_density(final_density, "final_density")
    check_density(start_density, "start_density")
    for name, value, least in (("warmup_iters", warmup_iters, 0), ("stages", stages, 1), ("start_iter", start_iter, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if warmup_iters == 0 or start_density <= final_density:
        return [(0, final_density)]
    ratio = final_density / start_density
    return [(start_iter + round(j * warmup_iters / stages), start_density * ratio ** (j / stages))
            for j in range(stages + 1)]


def checked_schedule(schedule) -> Union[None, Callable[[int], float], list[tuple[int, float]]]:
    """``schedule`` checked: None, a callable, or the (start_iter, density) pairs sorted by start_iter; of pairs
    with the same start_iter the last one given holds (a warm-up shorter than its stages has such pairs)."""
    if schedule is None or callable(schedule):
        return schedule
    try:
        entries = [(start, density) for start, density in schedule]
    except (TypeError, ValueError):
        raise ValueError(f"density_schedule must be None, a callable iter -> density or a list of "
                         f"(start_iter, density) pairs, got {schedule!r}") from None
    for start, density in entries:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"density_schedule: start_iter must be an int >= 0, got {start!r}")
        check_density(density, f"density_schedule density for iteration {start}")
    return sorted(entries, key=lambda entry: entry[0])  # stable: the order given settles equal starts


def density_at(density: float, schedule, iteration: int) -> float:
    """The density of ``iteration``: the schedule's (checked), else ``density``."""
    if callable(schedule):
        scheduled = schedule(iteration)
        check_density(scheduled, f"density_schedule({iteration})")
        return float(scheduled)
    for start, scheduled in schedule or ():
        if iteration >= start:
            density = scheduled
    return density
