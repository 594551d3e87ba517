"""The butterfly schedule of WAGMA's group rounds: which ranks average together in each round."""

from __future__ import annotations

__all__ = ["butterfly_groups", "group_schedule_length"]


def _check_group_size(world_size: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if group_size < 1 or world_size % group_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"group_size must divide the process group's size {world_size} (one of {divisors}), "
                         f"got {group_size}")


def _butterfly_shape(world_size: int, group_size: int) -> tuple[int, int, int]:
    """``(levels, block, rest)``: world_size = block * rest with block = group_size**levels the largest such
    power, and ``rest`` not divisible by group_size."""
    levels, block = 0, 1
    while world_size % (block * group_size) == 0:
        levels, block = levels + 1, block * group_size
    return levels, block, world_size // block


def group_schedule_length(world_size: int, group_size: int) -> int:
    """How many group rounds the butterfly schedule has before it repeats (1 when group_size is 1 or world_size)."""
    _check_group_size(world_size, group_size)
    if group_size in (1, world_size):
        return 1
    levels, _, rest = _butterfly_shape(world_size, group_size)
    diagonal = 0  # levels that spread an update over the rest blocks: the smallest K with group_size**K >= rest
    while group_size**diagonal < rest:
        diagonal += 1
    return levels + diagonal


def butterfly_groups(world_size: int, group_size: int, round_index: int) -> list[list[int]]:
    """The partition of ranks ``0 .. world_size-1`` into groups of ``group_size`` used by group round
    ``round_index``; consecutive rounds use different partitions (unless group_size is 1 or world_size).

    Write world_size = S**L * r with S = group_size and r not divisible by S, and a rank as the digits
    ``x = d_0 + S*d_1 + ... + S**(L-1)*d_(L-1) + S**L * d_L`` (d_L < r). Round levels 0 .. L-1 are the butterfly
    of the paper: the group of x varies digit d_level (partner stride S**level). When r > 1, K more "diagonal"
    levels (S**K >= r) merge the r blocks: level L+k groups ``{(d_0 = i, d_L = c + i * S**k mod r)}`` for
    i < S, with the middle digits fixed, so the block offsets an update reaches grow like S**k. The schedule
    cycles through the levels.
    """
    if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
        raise ValueError(f"round_index must be a non-negative int, got {round_index!r}")
    length = group_schedule_length(world_size, group_size)
    if group_size in (1, world_size):
        return [list(range(start, start + group_size)) for start in range(0, world_size, group_size)]
    levels, block, rest = _butterfly_shape(world_size, group_size)
    level = round_index % length
    if level < levels:
        stride = group_size**level
        return [[base + i * stride for i in range(group_size)]
                for base in range(world_size) if (base // stride) % group_size == 0]
    slope = group_size ** (level - levels)
    groups = []
    for middle in range(0, block, group_size):  # d_0 = 0, middle digits fixed
        for offset in range(rest):
            groups.append([i + middle + block * ((offset + i * slope) % rest) for i in range(group_size)])
    return groups
