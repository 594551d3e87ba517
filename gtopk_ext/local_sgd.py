"""Local SGD with a sparse pseudo-gradient: DiLoCo (Douillard et al. 2023) and SparseLoCo (Sarfi et al. 2025) on
this package's compressors and collectives (docs/local_sgd.md).

    outer = gx.SparseLocalSGD(model.parameters(), sync_every=32, density=0.02, buffers=model.buffers())
    for x, y in loader:
        inner_opt.zero_grad(); loss_fn(model(x), y).backward(); inner_opt.step()
        outer.step()          # every sync_every calls: compress the pseudo-gradient, reduce, outer step
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from gtopk_ext._contract import FLOAT_DTYPES
from gtopk_ext._validate import check_int, check_number, tensor_list
from gtopk_ext.collectives import MAX_NUMEL, SPARSE_COLLECTIVES, Traffic, agree, group_rank_and_size
from gtopk_ext.collectives._transport import allreduce
from gtopk_ext.compressors import make_compressor
from gtopk_ext.config import SparseConfig
from gtopk_ext.costs import format_bytes, latest_line, ring_allreduce_bytes, sent_and_received
from gtopk_ext._worker import Disagreement
from gtopk_ext.message import padded
from gtopk_ext.reduction import TAG_MASK, reduce
from gtopk_ext.resume import StateDicts, plan_resume, world_fields
from gtopk_ext.wire import WIRES

__all__ = ["SparseLocalSGD"]


class _Shard:
    """Parameters of one device as one float32 vector of at most MAX_NUMEL elements (the collectives' limit), the
    layout of the global weights, the outer momentum and the accumulator."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.device = params[0].device

    def flat(self) -> torch.Tensor:
        """The parameters now, as one float32 vector."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def adopted(self, global_weights: torch.Tensor) -> torch.Tensor:
        """The weights the replicas hold after adopting ``global_weights`` (rounded to each parameter's dtype)."""
        if all(p.dtype == torch.float32 for p in self.params):
            return global_weights
        return torch.cat([part.to(p.dtype).float() for part, p in zip(global_weights.split(self.numels), self.params)])

    def adopt(self, global_weights: torch.Tensor) -> None:
        for part, p in zip(global_weights.split(self.numels), self.params):
            p.detach().copy_(part.view_as(p))


def _shards(params: list[torch.Tensor]) -> list[_Shard]:
    by_device: dict[torch.device, list[list[torch.Tensor]]] = {}
    for p in params:
        chunks = by_device.setdefault(p.device, [[]])
        if sum(q.numel() for q in chunks[-1]) + p.numel() > MAX_NUMEL:
            chunks.append([])
        chunks[-1].append(p)
    return [_Shard(chunk) for chunks in by_device.values() for chunk in chunks]


class SparseLocalSGD:
    r"""The outer optimizer of local SGD over a model that is not wrapped in DDP: every ``sync_every`` steps each
    rank compresses its pseudo-gradient (the global weights adopted at the last sync minus its weights now) plus
    its error-feedback accumulator, the collective averages it, and an outer SGD step on the global weights gives
    the model every rank adopts. The defaults are SparseLoCo's exchange (Sarfi et al. 2025: top-k per 4,096-element
    chunk, 2-bit values, each element averaged over the ranks that sent it, a decayed accumulator, outer lr 1, no
    outer momentum) with H and the density measured on a language model with AdamW inside (docs/local_sgd.md);
    ``density=1.0, collective="dense"`` is DiLoCo.

    Args:
        params: the model's parameters (``model.parameters()``), float32, float16 or bfloat16, the same shapes in
            the same order on every rank.
        sync_every: inner steps between syncs (H): :meth:`step` syncs at every ``sync_every``-th call.
        density: fraction of the pseudo-gradient each rank sends, in (0, 1]. ``collective="dense"`` sends all of
            it and needs ``density=1.0``.
        collective: ``"gtopk"`` (O(k log P)), ``"allgather"`` (O(kP)), ``"oktopk"`` or ``"dense"`` (DiLoCo).
        outer_lr, outer_momentum, nesterov: the outer step, ``torch.optim.SGD``'s on the global weights with the
            averaged pseudo-gradient as gradient (``nesterov`` needs a momentum); the defaults: docs/local_sgd.md.
        process_group: the group to reduce over (``None``: the default group).
        compressor: ``"chunktopk"`` (default: SparseLoCo's top-k per chunk, ``compressor_kwargs={"chunk": 4096}``),
            ``"gaussiank"``, ``"topk"`` or ``"randomk"``; ``compressor_kwargs`` are its extra arguments (see
            :func:`gtopk_ext.make_compressor`).
        buffers: tensors averaged densely at each sync (``model.buffers()``); integer buffers (BatchNorm's
            ``num_batches_tracked``) are taken from the group's first rank.
        wire: how a sparse collective sends its pairs (:mod:`gtopk_ext.wire`): ``"plain"``, ``"compact"``,
            ``"2bit"`` or ``"4bit"`` (whose rounding errors go into the accumulator); the dense collective takes
            ``"plain"`` only.
            None (default): ``"2bit"`` for a sparse collective, ``"plain"`` for the dense one.
        error_decay: in [0, 1]; each sync first multiplies the accumulator by it (SparseLoCo's decayed
            accumulator). 1.0 (default) is exact error feedback; below 1 the decayed part is dropped, and its L1
            norm counted in :meth:`stats`. Sparse collectives only. None (default): 0.95 for a sparse collective,
            1.0 for the dense one.
        average: ``"ranks"``: each element's sum over the ranks divided by P; ``"senders"``: by how many ranks
            sent it (SparseLoCo's; ``collective="allgather"`` only, the one that counts them), so an element one
            rank sent is applied whole. None (default): ``"senders"`` with the allgather, else ``"ranks"``.
        overlap: inner steps an exchange may take before its average is applied, in [0, ``sync_every``]. 0
            (default): the sync waits for it. From 1 (Streaming DiLoCo's overlap): the exchange runs in the
            background (a thread, on a process group of its own made at the first sync) while the next inner steps
            train from where the rank was, and ``overlap`` steps after the sync its outer step is applied with the
            rank's progress since the sync kept on top: ``weights = global + (weights - weights at the sync)``.
            A rank waits only when an exchange takes longer than ``overlap`` inner steps. A sparse exchange carries
            the ranks' checks (step counts, a finite pseudo-gradient) in its payload's flags, not in a round of its
            own (one round less of the link's latency), where its fragments' payloads are of one size (almost
            always: each padded to the largest fragment's k; else a round of headers first).
        fragments: F >= 1 dividing ``sync_every``: the parameters (each shard) in F consecutive slices, each synced
            every ``sync_every`` steps at its own offset, one every ``sync_every / F`` steps (Streaming DiLoCo's
            fragments): an exchange carries 1/F of the bytes, so ``overlap`` up to ``sync_every / F`` can hide it.

    Construction is collective over ``process_group``: the ranks check that they have the same parameters, and
    all adopt the first rank's parameters and buffers, as DDP does. The global weights, outer momentum and
    accumulator are float32 (a master copy for float16 and bfloat16 models).

    After every sync the parameters and buffers are bitwise equal on every rank (with ``overlap``: the global
    weights after every applied exchange, and the parameters after :meth:`sync`); with a sparse collective,
    ``sum over ranks (pseudo-gradient + error_decay x old accumulator) = P x averaged pseudo-gradient + sum over
    ranks (new accumulator)`` up to float rounding (``average="senders"``: ``P x averaged`` becomes the sum of
    what the ranks sent, and each element's average is that sum over its senders). A non-finite pseudo-gradient
    on any rank raises :class:`FloatingPointError` on every rank and changes nothing (with ``overlap``: where its
    exchange would have been applied; that sync is undone).
    """

    def __init__(self, params: Iterable[torch.Tensor], sync_every: int = 8, density: float = 1 / 64,
                 collective: str = "allgather", outer_lr: float = 1.0, outer_momentum: float = 0.0,
                 nesterov: bool = False, process_group: dist.ProcessGroup | None = None, *,
                 compressor: str = "chunktopk", compressor_kwargs: dict | None = None,
                 buffers: Iterable[torch.Tensor] = (), wire: str | None = None, error_decay: float | None = None,
                 average: str | None = None, overlap: int = 0, fragments: int = 1):
        check_int("sync_every", sync_every, 1)
        if sync_every % check_int("fragments", fragments, 1):
            raise ValueError(f"fragments must divide sync_every={sync_every} (one fragment syncs every "
                             f"sync_every / fragments steps), got {fragments!r}")
        if check_int("overlap", overlap) > sync_every // fragments:
            raise ValueError(f"overlap must be at most sync_every / fragments = {sync_every // fragments} (an exchange "
                             f"is applied before the next one starts), got {overlap!r}")
        sparse = collective != "dense"
        wire = ("2bit" if sparse else "plain") if wire is None else wire
        error_decay = (0.95 if sparse else 1.0) if error_decay is None else error_decay
        self.config = SparseConfig(density, make_compressor(compressor, density, **dict(compressor_kwargs or {})),
                                   collective, wire)
        if collective == "dense" and density != 1.0:
            raise ValueError(f"collective='dense' sends every element: density must be 1.0, got {density!r} "
                             f"(a sparse collective sends a fraction: {SPARSE_COLLECTIVES})")
        self.outer_lr = check_number("outer_lr", outer_lr, 0.0, math.inf, low_open=True, high_open=True)
        self.outer_momentum = check_number("outer_momentum", outer_momentum, 0.0, 1.0, high_open=True)
        self.error_decay = check_number("error_decay", error_decay, 0.0, 1.0)
        if collective == "dense" and self.error_decay != 1.0:
            raise ValueError(f"error_decay decays the accumulator of a sparse collective; collective='dense' has none "
                             f"and takes error_decay=1.0 only, got {error_decay!r}")
        if average is None:
            average = "senders" if self.config.reducer.counts_senders else "ranks"
        if average not in ("ranks", "senders"):
            raise ValueError(f"average must be 'ranks' or 'senders', got {average!r}")
        if average == "senders" and not self.config.reducer.counts_senders:
            raise ValueError(f"average='senders' divides each element by the ranks that sent it, which only "
                             f"collective='allgather' counts, got collective={collective!r}")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
        if nesterov and self.outer_momentum == 0.0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD): set a momentum or "
                             "nesterov=False")
        if collective == "dense" and wire != "plain":
            raise ValueError(f"collective='dense' allreduces float32 on the plain wire, got wire={wire!r} (the "
                             f"compact wire is for the sparse collectives: {SPARSE_COLLECTIVES})")
        self.params = tensor_list(params, "params")
        if not self.params:
            raise ValueError("params is empty: pass the model's parameters")
        for i, p in enumerate(self.params):
            if p.dtype not in FLOAT_DTYPES or p.is_sparse or p.numel() == 0:
                raise ValueError(f"params[{i}] must be a non-empty dense float32, float16 or bfloat16 tensor, got "
                                 f"{p.dtype} of shape {tuple(p.shape)}{' (sparse)' if p.is_sparse else ''}")
        self.buffers = tensor_list(buffers, "buffers")
        self.sync_every, self.density, self.collective, self.wire = sync_every, float(density), collective, wire
        self.nesterov, self.process_group, self.compressor, self.average = nesterov, process_group, compressor, average
        self.overlap, self.fragments = overlap, fragments
        self._pending: Future | dict | None = None  # an exchange in flight (overlap), or finished and not applied
        self._due = 0  # the local step at which the pending exchange is applied
        self._due_fragment: int | None = None  # the pending exchange's fragment (None: the whole model)
        self._at_sync: list[torch.Tensor] = []  # overlap: the weights at the sync whose exchange is pending
        self._pool: ThreadPoolExecutor | None = None
        self._exchange_group: dist.ProcessGroup | None = None
        self._compressor = self.config.compressor if collective != "dense" else None
        self.local_step = 0  # calls of step() so far
        self.syncs = 0
        self.traffic = Traffic()  # every sync's bytes, this rank
        self.decayed = 0.0  # L1 norm of what error_decay dropped from the accumulator, this rank, all syncs
        self._last: dict[str, Any] = {}
        self._send_accumulators = False  # load_state_dict(..., "fold"): the next sync sends them whole
        self._shards = _shards(self.params)
        group, _, _ = group_rank_and_size(self.process_group)
        signature = repr([(tuple(t.shape), str(t.dtype)) for t in [*self.params, *self.buffers]])
        agree({"params": len(self.params), "buffers": len(self.buffers), "numel": sum(p.numel() for p in self.params),
               "signature": zlib.crc32(signature.encode()), "sync_every": self.sync_every,
               "wire": self.config.wire.code, "senders": int(average == "senders"), "overlap": overlap,
               "fragments": fragments}, group,
              self._shards[0].device, "SparseLocalSGD")
        with torch.no_grad():  # every rank starts from the first rank's model
            for t in [*self.params, *self.buffers]:
                self._broadcast(t, group, None)
        self._global = [shard.flat() for shard in self._shards]
        # Each shard's messages padded to its largest fragment's k: then (where the wire's pages agree too) an
        # exchange's payload has one size whichever fragment it carries, so a rank out of step cannot garble it,
        # and an overlapped exchange carries the ranks' checks in its flags instead of a round of its own.
        numels = [[len(range(shard.numel)[self._part(shard, f)]) for f in range(fragments)] for shard in self._shards]
        self._k = [max(map(self.config.compressor.k_for, shard_numels)) for shard_numels in numels]
        self._checks_in_payload = self._compressor is not None and all(
            len({self.config.wire.payload_size(k, n, torch.float32, 2) for n in shard_numels}) == 1
            for k, shard_numels in zip(self._k, numels))
        self._momentum = [torch.zeros_like(g) for g in self._global] if self.outer_momentum else []
        self._accumulator = [torch.zeros_like(g) for g in self._global] if self._compressor is not None else []

    @torch.no_grad()
    def step(self) -> bool:
        """Counts one inner step; applies an exchange in flight when it is due (``overlap`` steps after its sync);
        syncs at every ``sync_every``-th call (with ``fragments``: the next fragment at every ``sync_every /
        fragments``-th). Returns whether it synced."""
        self.local_step += 1
        if self._pending is not None and self.local_step >= self._due:
            self._apply(self._join(), merge=True)
        every = self.sync_every // self.fragments
        if self.local_step % every:
            return False
        self._sync(wait=not self.overlap, fragment=(self.local_step // every - 1) % self.fragments)
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Syncs now and waits for it (collective): e.g. after the last inner step, so that every rank ends with the
        global model (an exchange in flight is applied first)."""
        if self._pending is not None:
            self._apply(self._join(), merge=True)
        self._sync(wait=True, fragment=None)

    def _slices(self, fragment: int | None) -> list[slice]:
        """Each shard's part of ``fragment`` (None: the whole shard)."""
        return [self._part(shard, fragment) for shard in self._shards]

    def _part(self, shard: _Shard, fragment: int | None) -> slice:
        if fragment is None or self.fragments == 1:
            return slice(None)
        return slice(shard.numel * fragment // self.fragments, shard.numel * (fragment + 1) // self.fragments)

    def _sync(self, wait: bool, fragment: int | None) -> None:
        """1. This period's pseudo-gradient: the global weights (as the replicas hold them) minus the weights now.
        2. The exchange (:meth:`_exchange`): waited for, its outer step applied and adopted by every rank; or
        (``overlap``) all of it, the ranks' checks included (in its payload where they can be), in the background,
        the weights now kept to apply it against: the inner steps wait on no collective here. 3. The buffers are
        averaged (once a round of fragments)."""
        group, _, size = group_rank_and_size(self.process_group)
        start = perf_counter()
        # 1.
        slices = self._slices(fragment)
        deltas = [shard.adopted(g)[part].sub(shard.flat()[part]) for shard, g, part in zip(self._shards, self._global,
                                                                                          slices)]
        finite = all(bool(torch.isfinite(d).all()) for d in deltas)
        counts = {"local_step": self.local_step, "syncs": self.syncs}
        # 2.
        exchanged = None
        if wait:
            exchanged = self._counted(self._exchange(deltas, slices, counts, finite, self._send_accumulators, group,
                                                     size, in_payload=False))
            self._apply(exchanged, merge=False)
        else:
            if self._pool is None:  # its own group: the main thread's collectives go on beside the exchange
                self._exchange_group = dist.new_group(dist.get_process_group_ranks(group),
                                                      use_local_synchronization=True)
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="SparseLocalSGD")
            self._at_sync = [shard.flat()[part] for shard, part in zip(self._shards, slices)]
            self._pending = self._pool.submit(self._exchange, deltas, slices, counts, finite, self._send_accumulators,
                                              self._exchange_group, size,
                                              self._checks_in_payload and not self._send_accumulators)
            self._due, self._due_fragment = self.local_step + self.overlap, fragment
        self._send_accumulators = False
        # 3.
        traffic = Traffic()
        if fragment is None or fragment == self.fragments - 1:
            self._average_buffers(group, size, traffic)
        self.syncs += 1
        self.traffic.add(traffic.sent, traffic.received)
        self._last = {"numel": sum(s.numel for s in self._shards), "k": 0, "selected": 0,
                      "bytes_sent": traffic.sent, "bytes_received": traffic.received, "decayed": 0.0,
                      "seconds": perf_counter() - start}
        if exchanged is not None:
            self._add_to_last(exchanged)

    def _exchange(self, deltas: list[torch.Tensor], slices: list[slice], counts: dict[str, int], finite: bool,
                  fold: bool, group: dist.ProcessGroup, size: int, in_payload: bool) -> dict:
        """1. The ranks check their step ``counts`` and that every pseudo-gradient is ``finite`` (else all raise,
        nothing changed): in a round of headers first, or (``in_payload``: an overlapped sparse exchange) in the
        exchange's own flags, a round less on the link, the accumulators restored if they fail. 2. The accumulators
        decay. 3. Every shard's pseudo-gradient (its part ``slices``) plus its accumulator compressed (``fold``:
        sent whole) and averaged over the ranks, the accumulators keeping the rest: ``{"averaged": deltas,
        "slices", "figures": (k, selected, bytes sent, bytes received), "decayed"}``."""
        traffic, k, selected = Traffic(), 0, 0
        # 1.
        tag, saved = None, []
        if in_payload:  # the counts as a tag: two ranks at different steps differ in it
            tag = zlib.crc32(f"{counts['local_step']} {counts['syncs']}".encode()) & TAG_MASK
            saved = [a[part].clone() for a, part in zip(self._accumulator, slices)]
        else:
            headers = agree(counts, group, self._shards[0].device, "SparseLocalSGD.sync", traffic=traffic,
                            reported={"finite": int(finite)})
            diverged = [rank for rank, h in enumerate(headers) if not h["finite"]]
            if diverged:
                raise FloatingPointError(f"SparseLocalSGD.sync: the pseudo-gradient of rank(s) {diverged} is not "
                                         f"finite (inner training diverged); nothing was applied")
        # 2.
        decayed = 0.0  # the L1 norm of what error_decay drops from the accumulators: (1 - decay) x |old|
        if self.error_decay != 1.0:
            decayed = (1.0 - self.error_decay) * sum(float(a[part].abs().sum(dtype=torch.float64))
                                                     for a, part in zip(self._accumulator, slices))
            for a, part in zip(self._accumulator, slices):
                a[part].mul_(self.error_decay)
        # 3.
        try:
            for index, (delta, part) in enumerate(zip(deltas, slices)):
                shard_k, shard_selected = self._reduce(index, delta, part, fold, finite, counts, tag, group, size,
                                                       traffic)
                k, selected = k + shard_k, selected + shard_selected
        except (FloatingPointError, Disagreement):
            for a, part, old in zip(self._accumulator, slices, saved):
                a[part].copy_(old)
            raise
        return {"averaged": deltas, "slices": slices, "figures": (k, selected, traffic.sent, traffic.received),
                "decayed": decayed}

    def _add_to_last(self, exchanged: dict) -> None:
        """The latest sync's figures, with its exchange's."""
        k, selected, sent, received = exchanged["figures"]
        self._last.update(k=k, selected=selected, bytes_sent=self._last["bytes_sent"] + sent,
                          bytes_received=self._last["bytes_received"] + received, decayed=exchanged["decayed"])

    def _counted(self, exchanged: dict) -> dict:
        """A finished exchange, its bytes and what its decay dropped added to this rank's."""
        self.traffic.add(*exchanged["figures"][2:])
        self.decayed += exchanged["decayed"]
        return exchanged

    def _join(self) -> dict | None:
        """The exchange in flight, finished (its bytes counted; kept pending), or None."""
        if isinstance(self._pending, Future):
            try:
                exchanged = self._pending.result()
            except Exception:  # the ranks' checks failed: the sync is undone (nothing of it was applied)
                self._pending, self._at_sync, self.syncs = None, [], self.syncs - 1
                raise
            self._pending = self._counted(exchanged)
            if self._last:  # the latest sync's figures, now that its exchange is done
                self._add_to_last(self._pending)
        return self._pending

    def _apply(self, exchanged: dict, merge: bool) -> None:
        """The outer step with an exchange's average (torch.optim.SGD's: dampening 0, no weight decay; from the same
        bits on every rank) on the global weights, which the parameters adopt; ``merge`` (an overlapped exchange):
        with this rank's progress since the sync kept on top."""
        for index, (averaged, part) in enumerate(zip(exchanged["averaged"], exchanged["slices"])):
            update = averaged
            if self.outer_momentum:
                momentum = self._momentum[index][part].mul_(self.outer_momentum).add_(averaged)
                update = averaged.add(momentum, alpha=self.outer_momentum) if self.nesterov else momentum
            self._global[index][part].add_(update, alpha=-self.outer_lr)
            shard, adopted = self._shards[index], self._global[index]
            if merge or part != slice(None):  # the other fragments' weights stay the rank's own
                adopted = shard.flat()
                adopted[part] = self._global[index][part] + (adopted[part] - self._at_sync[index] if merge else 0)
            shard.adopt(adopted)
        self._pending, self._at_sync = None, []

    def _reduce(self, index: int, delta: torch.Tensor, part: slice, fold: bool, finite: bool, counts: dict[str, int],
                tag: int | None, group: dist.ProcessGroup, size: int, traffic: Traffic) -> tuple[int, int]:
        """``delta`` becomes the average over the ranks of one shard's ``delta + accumulator`` compressed (the
        accumulator keeps the rest; a non-finite rank sends a flag instead), or sent whole: the dense collective,
        or a ``fold`` (the accumulator empties). Raises on every rank when a rank was not ``finite`` or the ranks'
        ``tag`` differed (see :meth:`_exchange`). Returns (k, elements selected)."""
        accumulator = self._accumulator[index][part] if self._accumulator else None
        if self._compressor is None or fold:
            if accumulator is not None:
                delta.add_(accumulator)
                accumulator.zero_()
            allreduce(delta, group, traffic).div_(size)
            return delta.numel(), delta.numel()
        msg = None
        if finite:
            msg = self._compressor.compress(delta, accumulator, step=counts["syncs"] * len(self._shards) + index)
            msg = padded(msg, self._k[index])
        outcome = reduce(delta, accumulator, msg, self.config.reducer, group, k=self._k[index],
                         wire=self.config.wire, backend=self._compressor.backend[delta.device], traffic=traffic,
                         senders=self.average == "senders", tag=tag)
        if outcome.nonfinite:
            raise FloatingPointError(f"SparseLocalSGD.sync: a rank's pseudo-gradient is not finite (inner training "
                                     f"diverged; this rank's is {'' if finite else 'not '}finite); nothing was applied")
        if outcome.disagreed:
            raise Disagreement(f"SparseLocalSGD.sync: the ranks' step counts differ (this rank: local_step "
                               f"{counts['local_step']}, syncs {counts['syncs']}); every rank must call step() and "
                               f"sync() as often")
        return outcome.msg.k, int(outcome.msg.count)

    def _average_buffers(self, group: dist.ProcessGroup, size: int, traffic: Traffic) -> None:
        floating = [b for b in self.buffers if b.is_floating_point()]
        for device in dict.fromkeys(b.device for b in floating):  # one order on every rank
            on_device = [b for b in floating if b.device == device]
            # Divided before the sum (float32), as torch's averagers do: large float16 statistics cannot overflow.
            flat = allreduce(torch.cat([b.reshape(-1).float() for b in on_device]).div_(size), group, traffic)
            for b, part in zip(on_device, flat.split([b.numel() for b in on_device])):
                b.copy_(part.view_as(b))
        for b in self.buffers:
            if not b.is_floating_point():
                self._broadcast(b, group, traffic)

    @staticmethod
    def _broadcast(tensor: torch.Tensor, group: dist.ProcessGroup, traffic: Traffic | None) -> None:
        data = tensor.detach()
        buffer = data if data.is_contiguous() else data.contiguous()
        dist.broadcast(buffer, dist.get_global_rank(group, 0), group=group)
        if buffer is not data:
            data.copy_(buffer)
        if traffic is not None:
            nbytes = buffer.numel() * buffer.element_size()
            traffic.add(nbytes if dist.get_rank(group) == 0 else 0, nbytes)

    def stats(self) -> dict[str, Any]:
        """``{"local_step", "syncs", "bytes_sent", "bytes_received", "decayed"}`` (this rank, all syncs; ``decayed``:
        the L1 norm ``error_decay`` dropped) and ``"last_sync"``: the latest sync's ``numel``, ``k`` (elements sent
        per rank), ``selected`` (by the compressor), ``bytes_sent``, ``bytes_received``, ``decayed``, ``seconds``."""
        return {"local_step": self.local_step, "syncs": self.syncs, "bytes_sent": self.traffic.sent,
                "bytes_received": self.traffic.received, "decayed": self.decayed, "last_sync": dict(self._last)}

    def summary(self) -> str:
        """:meth:`stats` as lines to print, the bytes next to dense DiLoCo's float32 allreduce of the parameters."""
        stats, last, numel = self.stats(), self._last, sum(shard.numel for shard in self._shards)
        dense = ring_allreduce_bytes(4 * numel, group_rank_and_size(self.process_group)[2])  # at this group's size
        momentum = f", momentum {self.outer_momentum:g}{' nesterov' * self.nesterov}" if self.outer_momentum else ""
        decay = [f"error decay {self.error_decay:g}: dropped {self.decayed:.4g} (L1 norm, this rank) in all, "
                 f"{last.get('decayed', 0.0):.4g} in the latest sync"] if self.error_decay != 1.0 else []
        return "\n".join([
            f"SparseLocalSGD: {self.collective}{f' ({self.compressor})' * bool(self._compressor)}, density "
            f"{self.density:g}, {self.wire} wire{', averaged over senders' * (self.average == 'senders')}, "
            f"sync_every {self.sync_every}{f', {self.fragments} fragments' * (self.fragments > 1)}"
            f"{f', overlap {self.overlap}' * bool(self.overlap)}, outer lr "
            f"{self.outer_lr:g}{momentum}",
            f"run: {stats['syncs']} syncs in {stats['local_step']} local steps; "
            + sent_and_received(stats["bytes_sent"], stats["bytes_received"], stats["syncs"], "sync"),
            f"dense DiLoCo would send {format_bytes(dense)} a sync, {format_bytes(dense * stats['syncs'])} in all",
            latest_line("sync", stats["syncs"], last["bytes_sent"], last["k"], numel, f"selected {last['selected']:,}, "
                        f"received {format_bytes(last['bytes_received'])}, {1e3 * last['seconds']:.2f} ms")
            if last else "latest sync: none in this process yet", *decay])

    def state_dict(self) -> dict[str, Any]:
        """This rank's resumable state (copies), to save with the model's and the inner optimizer's: the counters,
        ``world_size`` and ``rank``, and per shard the ``global`` weights, ``momentum`` and (this rank's)
        ``accumulator``; with an exchange in flight (``overlap``), it waits for it and saves its average as
        ``pending``, this rank's weights at its sync as ``at_sync`` and the step it is due at as ``due``."""
        pending = self._join()
        return {"local_step": self.local_step, "syncs": self.syncs, **world_fields(self.process_group),
                "wire": self.wire, "numels": [s.numel for s in self._shards], "decayed": self.decayed,
                "global": [g.clone() for g in self._global], "momentum": [m.clone() for m in self._momentum],
                "accumulator": [a.clone() for a in self._accumulator],
                "pending": [a.clone() for a in pending["averaged"]] if pending is not None else [],
                "at_sync": [w.clone() for w in self._at_sync], "due": self._due, "due_fragment": self._due_fragment}

    def load_state_dict(self, state_dict: StateDicts, on_world_size_change: str = "error") -> None:
        """Restores :meth:`state_dict`'s output; with the model's and the inner optimizer's states restored too,
        training continues bitwise. Momentum or an accumulator the saved optimizer did not have start at zero; a
        saved momentum this optimizer has none for raises.

        At another world size, ``on_world_size_change`` says what becomes of the per-rank accumulators:
        ``"error"`` (default) raises naming both sizes; ``"fold"`` takes every saved rank's state_dict as a list
        in rank order, this rank adds up those of the saved ranks ``q % world_size == rank`` and the next sync
        sends them whole (nothing is lost); ``"zero"`` drops them."""
        self._join()  # an exchange of this run in flight ends before the saved state replaces what it touches
        plan = plan_resume(state_dict, on_world_size_change, self.process_group, "SparseLocalSGD.load_state_dict")
        state_dict = plan.replicated
        missing = {"local_step", "syncs", "numels", "global"} - set(state_dict)
        if missing:
            raise KeyError(f"state_dict is missing {sorted(missing)} (expected SparseLocalSGD.state_dict()'s keys)")
        numels = [s.numel for s in self._shards]
        if list(state_dict["numels"]) != numels:
            raise ValueError(f"state_dict holds shards of {list(state_dict['numels'])} elements, this optimizer's "
                             f"parameters make {numels}: it was saved for another model")
        if "wire" in state_dict and state_dict["wire"] not in WIRES:
            raise ValueError(f"state_dict['wire'] must be one of {tuple(WIRES)}, got {state_dict['wire']!r}")
        for name in ("local_step", "syncs"):
            check_int(f"state_dict[{name!r}]", state_dict[name])
        if state_dict.get("momentum") and not self._momentum:  # dropping it would change what the run does
            raise ValueError("state_dict holds an outer momentum: construct with its outer_momentum (this one: 0.0)")
        vectors = {"global": self._global, "momentum": self._momentum, "accumulator": self._accumulator}
        restored = {name: self._checked_vectors(state_dict, name, mine) for name, mine in vectors.items()}
        if plan.policy is not None:
            taken = [self._checked_vectors(saved, "accumulator", self._accumulator) for saved in plan.own]
            taken = [vectors for vectors in taken if vectors is not None]
            restored["accumulator"] = [sum(parts) for parts in zip(*taken)] if taken else None
        if restored["global"] is None:
            raise ValueError("state_dict['global'] is empty: expected the global weights")
        due_fragment = state_dict.get("due_fragment")
        if due_fragment is not None and not 0 <= check_int("state_dict['due_fragment']", due_fragment) < self.fragments:
            raise ValueError(f"state_dict['due_fragment'] must be a fragment of this optimizer's {self.fragments}, got "
                             f"{due_fragment!r}")
        parts = [g[part] for g, part in zip(self._global, self._slices(due_fragment))]
        pending = self._checked_vectors(state_dict, "pending", parts)
        at_sync = self._checked_vectors(state_dict, "at_sync", parts)
        if (pending is None) != (at_sync is None):
            raise ValueError("state_dict holds one of 'pending' and 'at_sync' without the other: expected both (an "
                             "exchange in flight) or neither")
        if pending is not None and plan.policy is not None:
            raise ValueError("state_dict was saved with an exchange in flight (overlap), which is this rank's own: it "
                             "resumes at the same world size only")
        due = check_int("state_dict['due']", state_dict.get("due", 0))
        decayed = sum(check_number("state_dict['decayed']", saved.get("decayed", 0.0), 0.0, math.inf, high_open=True)
                      for saved in plan.own)
        for name, mine in vectors.items():
            for vector, saved in zip(mine, restored[name] or [torch.zeros_like(v) for v in mine]):
                vector.copy_(saved)
        self._pending = None if pending is None else {"averaged": [p.clone() for p in pending],
                                                      "slices": self._slices(due_fragment), "figures": (0, 0, 0, 0),
                                                      "decayed": 0.0}
        self._due_fragment = due_fragment
        self._at_sync = [] if at_sync is None else [w.clone() for w in at_sync]
        self._due = due
        self.local_step, self.syncs, self.decayed = state_dict["local_step"], state_dict["syncs"], float(decayed)
        self._send_accumulators = plan.policy == "fold"

    @staticmethod
    def _checked_vectors(state_dict: dict[str, Any], name: str, mine: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """state_dict[name] when this optimizer keeps such vectors and the state has them (checked), else None."""
        if not mine or not (saved := state_dict.get(name)):
            return None
        if len(saved) != len(mine) or any(not isinstance(s, torch.Tensor) or s.shape != m.shape
                                          for s, m in zip(saved, mine)):
            raise ValueError(f"state_dict[{name!r}] must hold {len(mine)} tensor(s) of {[m.numel() for m in mine]} "
                             f"elements, got {[tuple(getattr(s, 'shape', ())) for s in saved]}")
        return saved

    def __repr__(self) -> str:
        return (f"SparseLocalSGD(sync_every={self.sync_every}, density={self.density}, collective={self.collective!r}, "
                f"outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, nesterov={self.nesterov}, "
                f"compressor={self.compressor!r}, wire={self.wire!r}, error_decay={self.error_decay}, "
                f"average={self.average!r}, overlap={self.overlap}, fragments={self.fragments})")
