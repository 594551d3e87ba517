"""Argument checks that raise naming the argument: numbers in an interval, ints, lists of tensors."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def check_number(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> float:
    """``value`` as a float when it is a finite int or float (not a bool) in the interval (closed unless said
    open), else a ValueError naming ``name`` and the interval."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if low_open else value >= low) and (value < high if high_open else value <= high))
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, least: int = 0) -> int:
    """``value`` when it is an int (not a bool) of at least ``least``, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def tensor_list(items: Iterable[torch.Tensor], name: str) -> list[torch.Tensor]:
    """``items`` as a list of distinct tensors (``model.parameters()``, ``model.buffers()``), else a TypeError or
    ValueError naming ``name``."""
    if isinstance(items, torch.Tensor):
        raise TypeError(f"{name} must be an iterable of tensors (e.g. model.{name}()), got a single tensor")
    tensors = list(items)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must hold tensors, got {type(t).__name__}"
                            + (" (param groups are not supported: pass model.parameters())" if isinstance(t, dict)
                               else ""))
    if len({id(t) for t in tensors}) != len(tensors):
        raise ValueError(f"{name} holds the same tensor more than once")
    return tensors
