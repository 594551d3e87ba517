"""Ok-Topk (Li and Hoefler, PPoPP 2022): a global top-k with about 2k pairs sent per rank, for any world size."""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext.backends import BackendLike
from gtopk_ext.collectives._protocol import (Collective, Reduced, agree_on_message, carried_dtype, check_cost,
                                             group_rank_and_size)
from gtopk_ext.collectives._transport import (Traffic, allreduce_counts, exchange_counts, gather_counts, in_set,
                                              raise_if_corrupt, sparse_alltoallv)
from gtopk_ext.message import SparseMessage
from gtopk_ext.wire import Rounding, WireLike, rounding_error, wire_named

OKTOPK_PERIOD = 32  # calls between re-estimations of the regions and of the threshold, as in the paper
# A reused global threshold stays while the pairs it selects over all regions number within these fractions of k
# (the bounds the paper's code keeps its local selection in); outside them it is re-estimated in the same step.
OKTOPK_REUSE_BOUNDS = (0.75, 1.25)
OKTOPK_SUB_BINS = 256  # sub-bins per octave of the threshold's second histogram: a resolution of 1/256


@dataclass
class OkTopkState:
    """What :func:`oktopk_allreduce` keeps between the steps of one bucket, the same on every rank.

    ``boundaries`` (the first indices of regions 1..P-1) are re-estimated every ``boundary_period`` calls,
    ``threshold`` (on |summed value|) every ``threshold_period`` calls and whenever the pairs it selects leave
    ``OKTOPK_REUSE_BOUNDS`` times k; both also when the numel or the world size change. ``step`` counts the calls.
    """

    boundary_period: int = OKTOPK_PERIOD
    threshold_period: int = OKTOPK_PERIOD
    step: int = 0
    boundaries: list[int] | None = None
    threshold: float | None = None
    shape: tuple[int, int] | None = None  # (numel, world size) that boundaries and threshold were estimated for

    def __post_init__(self) -> None:
        for name in ("boundary_period", "threshold_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OkTopkState: {name} must be an int >= 1, got {value!r}")

    def plan(self, numel: int, size: int) -> tuple[bool, bool]:
        """(re-estimate the boundaries, re-estimate the threshold) for a call on ``numel`` elements and ``size``
        ranks. Pure: ranks compare it before anything changes."""
        fresh = self.shape != (numel, size)
        return (fresh or self.boundaries is None or self.step % self.boundary_period == 0,
                fresh or self.threshold is None or self.step % self.threshold_period == 0)

    def state_dict(self) -> dict:
        return {**asdict(self), "shape": None if self.shape is None else list(self.shape)}

    def load_state_dict(self, state_dict: dict) -> None:
        restored = OkTopkState(**{**state_dict, "shape": None if state_dict.get("shape") is None
                                  else tuple(state_dict["shape"])})
        self.__dict__.update(restored.__dict__)


def _balanced_boundaries(sorted_indices: torch.Tensor, numel: int, group: dist.ProcessGroup, size: int,
                         traffic: Traffic | None) -> list[int]:
    """The paper's region boundaries: each rank splits its own selected indices into P runs of equal count, and
    the ranks average those P - 1 split points (one allreduce of P - 1 integers). Averages of ascending lists
    ascend, so the regions are ordered; a rank that selected nothing proposes equal-width regions."""
    n = sorted_indices.numel()
    if n:
        positions = torch.tensor([n * i // size for i in range(1, size)], device=sorted_indices.device)
        proposal = sorted_indices[positions].long()
    else:
        proposal = torch.tensor([numel * i // size for i in range(1, size)], dtype=torch.int64,
                                device=sorted_indices.device)
    return (allreduce_counts(proposal, group, traffic) // size).tolist()


def _octave_edges(device: torch.device) -> torch.Tensor:
    """2^-149 (float32's smallest subnormal), 2^-148, ..., 2^127, then +inf: float32 magnitudes by octave."""
    powers = torch.ldexp(torch.ones(277, dtype=torch.float32), torch.arange(-149, 128, dtype=torch.int32))
    return torch.cat([powers, torch.tensor([math.inf])]).to(device)


def _count_at_least(magnitude: torch.Tensor, edges: torch.Tensor, group: dist.ProcessGroup,
                    traffic: Traffic | None) -> torch.Tensor:
    """``at_least[i]`` = how many magnitudes over all ranks are >= edges[i] (exact: the same comparisons as the
    selection's), from one allreduce of a histogram."""
    bins = torch.bucketize(magnitude, edges, right=True)  # how many edges each magnitude reaches
    # Bin 0 (below every edge) counts for nothing. int32 is enough: the sums of all regions have distinct
    # indices, fewer than numel < 2^31.
    histogram = torch.bincount(bins, minlength=edges.numel() + 1)[1:].int()
    return allreduce_counts(histogram, group, traffic).flip(0).cumsum(0).flip(0)


def _global_threshold(magnitude: torch.Tensor, k: int, group: dist.ProcessGroup, traffic: Traffic | None) -> float:
    """The threshold on the regions' |sums| that the k-th largest of them over all ranks reaches, to 1/256 of its
    value: the lowest edge that at least k magnitudes reach (all nonzero ones when fewer than k are nonzero).

    Two histogram allreduces of O(1) bytes (where the paper allgathers every region's sums): one by octave, then
    one of 256 sub-bins inside the octave that holds the k-th largest. The lower edge of its sub-bin keeps at least
    k, so nothing starves when many values are equal; the surplus is cut at the end."""
    edges = _octave_edges(magnitude.device)
    at_least = _count_at_least(magnitude, edges, group, traffic)
    octave = int((at_least >= k).sum()) - 1  # at_least descends: the last edge that k magnitudes reach
    if octave < 0:
        return float(edges[0])
    if octave == edges.numel() - 1:  # k or more infinite (or NaN) sums
        return math.inf
    low, high = edges[octave], edges[octave + 1]
    sub_edges = low * (1 + torch.arange(OKTOPK_SUB_BINS, dtype=torch.float32, device=low.device) / OKTOPK_SUB_BINS)
    inside = magnitude[(magnitude >= low) & (magnitude < high)]
    sub_at_least = _count_at_least(inside, sub_edges, group, traffic) + at_least[octave + 1]
    return float(sub_edges[int((sub_at_least >= k).sum()) - 1])


def _threshold_holds(kept: int, nonzero: int, k: int) -> bool:
    """Whether a reused threshold that keeps ``kept`` of the ``nonzero`` nonzero sums may stay: it keeps between
    ``OKTOPK_REUSE_BOUNDS`` times k, or every nonzero sum when there are at most k (as a fresh estimate would:
    density 1 stays the dense sum)."""
    low, high = OKTOPK_REUSE_BOUNDS
    return kept == nonzero if nonzero <= k else low * k <= kept <= high * k


def _sum_by_index(runs: list[tuple[torch.Tensor, torch.Tensor]], backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending distinct indices, float32 sums of their values) of ascending runs of pairs, summed in run order
    then slot order: one linear merge per run (:func:`gtopk_ext.ops.merge_topk` with room for the whole union)."""
    indices, sums = runs[0][0][:0], torch.zeros(0, dtype=torch.float32, device=runs[0][1].device)
    for run_indices, run_values in runs:
        room = indices.numel() + run_indices.numel()
        if room:
            indices, sums, union = ops.merge_topk(indices, sums, run_indices, run_values.float(), room,
                                                  backend=backend)
            indices, sums = indices[:int(union)], sums[:int(union)]
    return indices, sums


def _largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the k largest |values| (NaN as +inf), ascending; among equal ones the lower positions."""
    magnitude = values.float().abs().nan_to_num(nan=math.inf, posinf=math.inf)
    kth = torch.kthvalue(magnitude, magnitude.numel() - k + 1).values
    above, tied = magnitude > kth, magnitude == kth
    return (above | (tied & (tied.cumsum(0) <= k - above.sum()))).nonzero().squeeze(1)


def oktopk_allreduce(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, state: OkTopkState | None = None,
                     check: bool = True, traffic: Traffic | None = None, flags: torch.Tensor | None = None,
                     wire: WireLike = "plain", rounding: Rounding | None = None,
                     backend: BackendLike = None) -> tuple[SparseMessage, torch.Tensor]:
    """Ok-Topk (Li and Hoefler, PPoPP 2022): a global top-k of the sum of every rank's sparse message with about
    2k(P-1)/P pairs sent per rank, for any world size P.

    1. Split and reduce: the index space is cut into P regions, region r owned by rank r; each rank sends its
       pairs (its first ``min(count, k)`` slots) to the owners of their regions, which sum them per index.
    2. Each owner keeps its sums whose |value| reaches the global threshold (NaN and inf always).
    3. Every owner sends what it kept to every rank. If more than k were kept, the k largest |sums| stay (NaN
       counts as infinite; ties to the lower index).

    The region boundaries (averages of the points that split each rank's selection into equal counts) and the
    threshold are reused between re-estimations as ``state`` says (:class:`OkTopkState`; None: both estimated in
    the call). Each phase first exchanges its counts (O(P) bytes), so payloads carry exactly the pairs.

    Returns ``(glob, applied)`` as :func:`gtopk_allreduce` does, glob's indices ascending and distinct, padded
    with (0, 0) to k slots, ``glob.count`` how many sums reached the threshold. ``check`` and ``flags`` as in
    :func:`sparse_allgather` (with ``check``, the ranks also compare their states' plans).

    ``wire="compact"`` (:mod:`gtopk_ext.wire`) sends the pairs of both phases in 4 bytes a pair; the rounding
    errors that reach glob go to ``rounding`` (when given). A corrupted compact payload raises ValueError on every
    rank, nothing of it written out of bounds.
    """
    group, rank, size = group_rank_and_size(group)
    if state is None:
        state = OkTopkState()
    if check:
        def plan_fields() -> dict[str, int]:
            if not isinstance(state, OkTopkState):
                raise TypeError(f"state must be an OkTopkState or None, got {type(state).__name__}")
            repartition, reestimate = state.plan(msg.numel, size)
            return {"state_step": state.step, "repartition": int(repartition), "reestimate": int(reestimate)}

        agree_on_message(msg, flags, group, "oktopk_allreduce", traffic, plan_fields,
                          ("state_step", "repartition", "reestimate"), wire=wire)
    k, numel, device = msg.values.numel(), msg.numel, msg.values.device
    dtype = carried_dtype(msg.values.dtype)
    if size == 1:
        return (SparseMessage(msg.values.to(dtype, copy=True), msg.indices.clone(), msg.count.clone(), numel),
                torch.ones(k, dtype=torch.bool, device=device))
    repartition, reestimate = state.plan(numel, size)
    state.shape = (numel, size)

    # 1. Split and reduce.
    used = min(max(int(msg.count), 0), k)
    indices, values = msg.indices[:used], msg.values[:used]
    if used > 1 and not bool((indices[1:] >= indices[:-1]).all()):  # compressors send them ascending already
        indices, order = torch.sort(indices, stable=True)
        values = values[order]
    if repartition:
        state.boundaries = _balanced_boundaries(indices, numel, group, size, traffic)
    region_starts = torch.tensor(state.boundaries, dtype=torch.int32, device=device)
    cuts = [0, *torch.searchsorted(indices, region_starts).tolist(), used]
    send_counts = [end - start for start, end in zip(cuts, cuts[1:])]
    recv_counts = exchange_counts(send_counts, group, device, traffic)
    wire = wire_named(wire)
    compact = wire.lossy
    invalid = torch.zeros(1, dtype=torch.int32, device=device)  # signs of corruption in what this rank decoded
    sent_errors = []  # (indices, rounding errors) of the pairs this rank sent, with compact
    outgoing = []
    for r, (start, end) in enumerate(zip(cuts, cuts[1:])):
        run = (indices[start:end], values[start:end])
        if r == rank:  # its own region's pairs stay here, exact
            outgoing.append(run[0][:0].view(torch.uint8))
            continue
        payload, _, sent = wire.pack_pairs(*run, numel, backend)
        outgoing.append(payload)
        if compact:
            sent_errors.append((run[0], rounding_error(run[1], sent)))
    incoming = sparse_alltoallv(outgoing, [wire.pairs_size(c, numel, values.dtype) for c in recv_counts], group,
                                 rank, traffic)
    runs = [wire.unpack_pairs(incoming[r], recv_counts[r], numel, values.dtype, backend, invalid) if r != rank
            else (indices[cuts[r]:cuts[r + 1]], values[cuts[r]:cuts[r + 1]]) for r in range(size)
            if r == rank or incoming[r] is not None]
    region_indices, region_sums = _sum_by_index(runs, backend)

    # 2. The global threshold.
    magnitude = region_sums.abs().nan_to_num(nan=math.inf, posinf=math.inf)
    threshold = _global_threshold(magnitude, k, group, traffic) if reestimate else state.threshold
    nonzero = int((magnitude > 0).sum())
    raised = [] if flags is None else [int(flags)]
    while True:
        kept = magnitude >= threshold
        counts = gather_counts([int(kept.sum()), nonzero, *raised], group, device, traffic)
        kept_counts = [c[0] for c in counts]
        if reestimate or _threshold_holds(sum(kept_counts), sum(c[1] for c in counts), k):
            break
        threshold, reestimate = _global_threshold(magnitude, k, group, traffic), True
    if flags is not None:
        flags.fill_(functools.reduce(operator.or_, (c[2] for c in counts)))
    state.threshold = threshold
    state.step += 1

    # 3. Allgatherv of the kept sums.
    own_indices, own_sums = region_indices[kept], region_sums[kept].to(dtype)
    payload, _, sent_sums = wire.pack_pairs(own_indices, own_sums, numel, backend)
    if compact:  # every rank, this one included, uses the sums as the wire carries them
        sent_errors.append((own_indices, rounding_error(own_sums, sent_sums)))
    incoming = sparse_alltoallv([payload] * size, [wire.pairs_size(c, numel, dtype) for c in kept_counts], group,
                                 rank, traffic)
    parts = [(own_indices, sent_sums) if r == rank else
             wire.unpack_pairs(incoming[r], kept_counts[r], numel, dtype, backend, invalid) for r in range(size)
             if r == rank or incoming[r] is not None]
    glob_indices, glob_values = torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])
    if glob_indices.numel() > k:
        best = _largest(glob_values, k)
        glob_indices, glob_values = glob_indices[best], glob_values[best]
    applied = torch.zeros(k, dtype=torch.bool, device=device)
    applied[:used] = in_set(glob_indices, [msg.indices[:used]], numel)[0]
    if compact:
        raise_if_corrupt(int(allreduce_counts(invalid, group, traffic)), "oktopk_allreduce")
        if rounding is not None:
            for error_indices, errors in sent_errors:
                rounding.add(error_indices, torch.where(in_set(glob_indices, [error_indices], numel)[0], errors, 0))
    padding = k - glob_indices.numel()
    glob = SparseMessage(torch.cat([glob_values, glob_values.new_zeros(padding)]),
                         torch.cat([glob_indices, glob_indices.new_zeros(padding)]),
                         torch.tensor([sum(kept_counts)], dtype=torch.int32, device=device), numel)
    return glob, applied


class OkTopk(Collective):
    """:func:`oktopk_allreduce`, with an :class:`OkTopkState` per tensor (called on every compressed step, so the
    states stay equal across ranks)."""

    name = "oktopk"

    def messages(self, size):
        return 2 * (size - 1) / size  # a reduce-scatter and an allgather of k / P slots per peer

    def cost_terms(self, numel, k, size, local, share, wire):
        pair = wire.payload_size(1, numel, torch.float32, 0) - wire.payload_size(0, numel, torch.float32, 0)
        # Each of its messages carries its own header: the compact wire's page table counts, the plain wire's count
        # is in the 24 bytes per peer of the boundaries' exchange.
        header = wire.payload_size(0, numel, torch.float32, 1) if wire.lossy else 0
        between, inside = local * (size - local), local - 1
        terms = {"alpha": 4 * (size - 1),
                 "beta": between / size * 2 * k * pair + 2 * between * header + 24 * (size - 1),
                 "beta_intra": inside / size * 2 * k * pair + 2 * inside * header, "merge": 2 * k * share}
        if wire.lossy:
            terms.update(encode=k * share, decode=(1 + 2 * (size - 1) / size) * k * share)
        messages, sent = check_cost(size, wire)
        terms["alpha"] += messages
        terms["beta"] += sent
        return terms

    def new_state(self) -> OkTopkState:
        return OkTopkState()

    def reduce(self, msg, group, *, wire, traffic=None, flags=None, rounding=None, state=None):
        glob, applied = oktopk_allreduce(msg, group, state=state, check=False, traffic=traffic, flags=flags,
                                         wire=wire, rounding=rounding, backend=self.backend[msg.values.device])
        return Reduced(glob=glob, applied=applied)
