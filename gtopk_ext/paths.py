"""Which path a tensor takes in a step: the sparse collective at the step's density, a dense allreduce in bfloat16
or in scaled 8-bit floats whose rounding stays in the residual, or a dense allreduce in the tensor's dtype.
``auto`` takes the one a cost model predicts cheapest (docs/architecture.md), learned per tensor from the steps
themselves: each rank reports its measured costs in the header the ranks exchange when the tensor's plan changes,
and every rank decides from their mean by integer arithmetic, the same path everywhere.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from gtopk_ext._validate import check_int
from gtopk_ext.collectives import COLLECTIVES, Agreement, Collective, DenseAllreduce, RoundedDense
from gtopk_ext.wire import Wire

PATHS = ("sparse", "dense16", "dense", "dense8")  # ties go to the first: the more precise of two dense paths
MODES = ("auto", *PATHS)
ROUNDED = ("dense16", "dense8")  # the dense paths whose rounding stays in the residual (float32 tensors only)
# The paths ``auto`` takes unless told otherwise. Not dense8: its rounding (up to 1/8 of an element) costs progress
# per step, which the cost model does not price (docs/performance.md).
AUTO_CHOICES = ("sparse", "dense16", "dense")
_PS = 1e12  # the figures travel as integer picoseconds a unit
_UNKNOWN = -1
_EMA = 0.5  # weight of the newest measurement: the costs follow a change of load within a few steps
# An untimed sparse exchange is predicted at this many times its bytes' time on the dense path's link: its merges
# and packing cost more than its bytes. Too high only delays the first sparse step to a lower density.
UNTIMED_SPARSE = 4
# A dense step sends a tensor's whole residual at once: after many sparse steps, many steps' worth, which can make
# training diverge. So ``auto`` leaves the sparse path only while the residual holds at most this many steps' worth.
MAX_FLUSH_STEPS = 4


@dataclass(frozen=True)
class PathPolicy:
    """How a tensor's path is chosen each step.

    Args:
        mode: ``"auto"`` (default: the path the cost model predicts cheapest), or one path for every step that may
            compress: ``"sparse"`` (the collective at the step's density), ``"dense16"`` (bfloat16 on the wire,
            float32 sums, the rounding kept in the residual), ``"dense8"`` (8-bit floats scaled per message, the
            same way; a tensor not in float32 takes ``"dense"`` for both) or ``"dense"`` (the tensor's dtype).
        min_compress_numel: tensors with fewer elements always take ``"dense"``.
        recalibrate_every: with ``"auto"``, the iterations between two agreements of the measured costs (a path
            taken for the first time is agreed on again at the next iteration, once it has been timed).
        choices: with ``"auto"``, the paths it may take (default :data:`AUTO_CHOICES`: all but ``"dense8"``).
        calibration: with ``"auto"``, the costs to decide from instead of this run's timings, per tensor index: a
            front end's ``state_dict()["calibration"]``. Every run given it takes the same paths.
    """

    mode: str = "auto"
    min_compress_numel: int = 1024
    recalibrate_every: int = 50
    choices: tuple[str, ...] = AUTO_CHOICES
    calibration: Optional[dict] = field(default=None, hash=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"path mode must be one of {MODES}, got {self.mode!r}")
        check_int("min_compress_numel", self.min_compress_numel)
        check_int("recalibrate_every", self.recalibrate_every, 1)
        choices = None if isinstance(self.choices, str) else tuple(self.choices)
        if not choices or any(c not in PATHS for c in choices) or len(set(choices)) < len(choices):
            raise ValueError(f"choices must be distinct paths of {PATHS}, got {self.choices!r}")
        object.__setattr__(self, "choices", choices)
        if self.calibration is not None:
            object.__setattr__(self, "calibration", _checked_calibration(self.calibration))

    @property
    def code(self) -> int:
        """The mode, the choices and the calibration as one integer, for the header the ranks agree on."""
        code = MODES.index(self.mode) + len(MODES) * sum(1 << PATHS.index(path) for path in self.choices)
        if self.calibration is not None:
            code += 1024 * (1 + zlib.crc32(repr(sorted(self.calibration.items())).encode()))
        return code


def _checked_calibration(calibration) -> dict[int, dict[str, Optional[int]]]:
    """``calibration`` as ``{index: {"numel": int, figure: int picoseconds or None}}``, checked."""
    try:
        checked = {int(index): {"numel": int(entry["numel"]),
                                **{name: None if entry[name] is None else int(entry[name])
                                   for name in CostModel.FIGURES}}
                   for index, entry in dict(calibration).items()}
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"calibration must map tensor indices to {{'numel', {', '.join(CostModel.FIGURES)}}} "
                         f"(a state_dict()['calibration']), got {calibration!r} ({error})") from None
    return checked


def path_policy(path) -> PathPolicy:
    """``path`` as a :class:`PathPolicy` (a mode's name is its policy with the other defaults)."""
    if isinstance(path, PathPolicy):
        return path
    if isinstance(path, str):
        return PathPolicy(path)
    raise TypeError(f"path must be one of {MODES} or a gx.PathPolicy, got {path!r}")


class CostModel:
    """This rank's measured costs of one tensor's paths, in seconds: ``select`` per element of the tensor
    compressed, ``slot`` per slot of a sparse exchange (bytes, merges and waiting together), ``dense16``,
    ``dense`` and ``dense8`` per element of the dense paths (None: not measured yet)."""

    __slots__ = FIGURES = ("select", "slot", "dense16", "dense", "dense8")

    def __init__(self):
        self.select = self.slot = self.dense16 = self.dense = self.dense8 = None

    def _observe(self, figure: str, seconds: float, units: int) -> None:
        if units > 0 and seconds >= 0:
            old, new = getattr(self, figure), seconds / units
            setattr(self, figure, new if old is None else (1 - _EMA) * old + _EMA * new)

    def observe_sparse(self, numel: int, k: int, select_seconds: float, exchange_seconds: float) -> None:
        self._observe("select", select_seconds, numel)
        self._observe("slot", exchange_seconds, k)

    def observe_dense(self, numel: int, seconds: float, path: str = "dense") -> None:
        """``seconds`` of one exchange of ``numel`` elements on the dense path ``path``."""
        self._observe(path, seconds, numel)

    def report(self) -> dict[str, int]:
        return {f"cost_{name}": _UNKNOWN if getattr(self, name) is None else round(getattr(self, name) * _PS)
                for name in self.FIGURES}


def own_seconds(queue, start: float, end: float) -> float:
    """The seconds of its own of a collective issued at ``start`` and completed at ``end`` (``perf_counter``) on a
    group that runs its collectives one after another: from the later of its issue and the completion of the one
    before it, ``queue.busy_until``, which becomes ``end``."""
    seconds = end - max(start, queue.busy_until)
    queue.busy_until = end
    return seconds


def agreed_costs(headers: list[dict[str, int]]) -> dict[str, int | None]:
    """The mean over the ranks of each reported figure (picoseconds a unit; None when a rank has not measured it):
    integers, so every rank computes the same."""
    costs = {}
    for name in CostModel.FIGURES:
        values = [h[f"cost_{name}"] for h in headers]
        costs[name] = None if min(values) == _UNKNOWN else sum(values) // len(values)
    return costs


def predicted(costs: dict[str, int | None], *, numel: int, k: int, size: int, dtype: torch.dtype,
              collective: Collective, wire: Wire) -> dict[str, int | None]:
    """Each path's predicted picoseconds for one exchange (None: nothing to predict it from). A path not timed yet
    is predicted from the dense path's time per byte: a rounded one from its bytes, sparse from :data:`UNTIMED_SPARSE`
    times its bytes; once it was taken, from its own time."""
    dense = None if costs["dense"] is None else costs["dense"] * numel
    dense_bytes = DenseAllreduce().wire_bytes(numel, numel, size, dtype)

    def on_the_link(nbytes: int, factor: int = 1) -> int | None:  # the dense path's time for nbytes
        return None if dense is None or not dense_bytes else factor * dense * nbytes // dense_bytes

    times = {"dense": dense}
    if dtype == torch.float32:
        for path in ROUNDED:
            rounded: RoundedDense = COLLECTIVES[path]()
            times[path] = (costs[path] * numel if costs[path] is not None else
                           on_the_link(rounded.wire_bytes(numel, k, size, dtype)))
    exchange = (costs["slot"] * k if costs["slot"] is not None else
                on_the_link(collective.wire_bytes(numel, k, size, dtype, wire), UNTIMED_SPARSE))
    times["sparse"] = None if exchange is None else exchange + (costs["select"] or 0) * numel
    return times


def choose(times: dict[str, int | None]) -> str:
    """The cheapest predicted path; ties and unknowns go to the first of :data:`PATHS` (sparse: what was asked
    for, and then timed)."""
    known = {path: t for path, t in times.items() if t is not None}
    if "sparse" not in known and "sparse" in times:
        return "sparse"
    if not known:
        return min(times, key=PATHS.index)
    return min(known, key=lambda path: (known[path], PATHS.index(path)))


class PathPlan:
    """What the ranks agreed for one tensor: the ``agreement`` of its header, the ``path`` decided with it, and,
    for ``auto``, the ``round`` of agreement (a header field), the iteration ``until`` which it holds, this rank's
    measured ``costs``, the ``sparse_steps`` since its last dense one, the header ``decided`` from (one agreed again
    unchanged, after a resume, is not decided again), the ``agreed`` costs, and how many decisions were
    ``measured`` (from this run's timings, not a calibration)."""

    __slots__ = ("agreement", "path", "round", "until", "costs", "sparse_steps", "decided", "agreed", "measured")
    SAVED = ("path", "round", "until", "sparse_steps", "decided", "agreed", "measured")

    def __init__(self):
        self.agreement = Agreement()
        self.path = "dense"
        self.round = 0
        self.until = 0
        self.costs = CostModel()
        self.sparse_steps = 0
        self.decided: Optional[dict[str, int]] = None
        self.agreed: Optional[dict[str, Optional[int]]] = None
        self.measured = 0

    def decide(self, policy: PathPolicy, times: dict[str, int | None], costs: dict[str, int | None],
               iteration: int, *, k: int, numel: int) -> None:
        """The cheapest path of the policy's choices (dense when it has none for this tensor), agreed on again at
        the next iteration when it has not been timed yet; sparse again when a dense step would send more than
        :data:`MAX_FLUSH_STEPS` steps' worth of residual at once."""
        times = {path: t for path, t in times.items() if path in policy.choices} or {"dense": times["dense"]}
        if self.sparse_steps > MAX_FLUSH_STEPS and k * MAX_FLUSH_STEPS < numel:
            times = {"sparse": times["sparse"]}
        self.path = choose(times)
        timed = costs["slot"] if self.path == "sparse" else costs[self.path]
        self.until = iteration + (1 if timed is None else policy.recalibrate_every)

    def state_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in self.SAVED},
                "costs": {name: getattr(self.costs, name) for name in CostModel.FIGURES}}

    def load_state_dict(self, saved: dict) -> None:
        for name in self.SAVED:
            setattr(self, name, saved[name])
        for name in CostModel.FIGURES:
            setattr(self.costs, name, saved["costs"][name])
