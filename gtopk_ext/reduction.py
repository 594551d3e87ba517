"""The one error-feedback reduction that every front end (the DDP hook, SparseLocalSGD, the hierarchical
collective) runs: a tensor plus its residual is compressed, reduced by a collective, and what this rank did not get
applied stays in its residual: not selected, dropped by a merge, or lost to the wire's rounding. Nothing is lost:
``tensor + old residual == what was applied + new residual`` on every rank, to float rounding.

    agree_plan(...)               the ranks check they share the step's plan (only when it changes)
    path = plan_path(...)         ... and take the same path: sparse, dense16, dense8 or dense (gtopk_ext.paths)
    outcome = reduce(...)         exchange a compressor's message, keep what was not applied, write the average
    reduce_rounded(...)           the dense bfloat16 or 8-bit path, its rounding kept
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext.backends import Backend
from gtopk_ext.collectives import COLLECTIVES, Agreement, Collective, agree
from gtopk_ext.collectives._protocol import message_fields
from gtopk_ext.costs import Traffic
from gtopk_ext.message import SparseMessage, padding_message
from gtopk_ext.paths import ROUNDED, PathPlan, PathPolicy, agreed_costs, predicted
from gtopk_ext.wire import Rounding, Wire

# Flag bits carried inside the sparse payload (every rank learns the OR).
FLAG_NONFINITE = 1


def agree_plan(tensor: torch.Tensor, group: dist.ProcessGroup, agreement: Agreement | None, *, sparse: bool, k: int,
               wire: Wire, what: str, volatile: dict[str, int] | None = None,
               traffic: Traffic | None = None) -> None:
    """Step 1 of every reduction: the ranks check that they reduce the same numel and dtype on the same path with
    the same k and wire, before anything changes (a mismatch raises the same error on every rank, before a payload
    of the wrong size could abort Gloo). With an ``agreement`` the header crosses only when the plan changes."""
    fields = message_fields(tensor.numel(), tensor.dtype, sparse, k, wire)
    agree(fields, group, tensor.device, what, traffic=traffic, agreement=agreement, volatile=volatile)


def plan_path(tensor: torch.Tensor, group: dist.ProcessGroup, plan: PathPlan, policy: PathPolicy, *,
              iteration: int, k: int | None, collective: Collective, wire: Wire, what: str,
              volatile: dict[str, int] | None = None, traffic: Traffic | None = None) -> str:
    """Step 1 with a path policy: the ranks check they share the plan (:func:`agree_plan`, with the policy) and
    all take the same path for ``tensor`` this step: ``"sparse"``, ``"dense16"``, ``"dense8"`` or ``"dense"``.
    ``k``: the step's k, or None when the tensor may not compress this step (a warm-up; it then goes dense). With
    ``auto`` the header also carries each rank's measured costs of the tensor (``plan.costs``), and the path
    follows from their mean."""
    numel, size = tensor.numel(), dist.get_world_size(group)
    compress = k is not None and numel >= max(policy.min_compress_numel, 1)
    auto = compress and policy.mode == "auto"
    if auto and iteration >= plan.until:
        plan.round += 1
    fields = {**message_fields(numel, tensor.dtype, compress, k if compress else numel, wire),
              "policy": policy.code, "round": plan.round if auto else 0}
    headers = agree(fields, group, tensor.device, what, traffic=traffic, agreement=plan.agreement,
                    volatile=volatile, reported=plan.costs.report())
    if not compress:
        plan.path = "dense"
    elif not auto:
        plan.path = "dense" if policy.mode in ROUNDED and tensor.dtype != torch.float32 else policy.mode
    elif headers is not None:
        agreed = agreed_costs(headers)
        plan.decide(policy, predicted(agreed, numel=numel, k=k, size=size, dtype=tensor.dtype,
                                      collective=collective, wire=wire), agreed, iteration, k=k, numel=numel)
    plan.sparse_steps = plan.sparse_steps + 1 if plan.path == "sparse" else 0
    return plan.path


def reduce_rounded(path: str, tensor: torch.Tensor, residual: torch.Tensor | None, group: dist.ProcessGroup,
                   traffic: Traffic | None = None) -> None:
    """A dense path whose rounding stays in the residual (``"dense16"``: :class:`gtopk_ext.collectives.Dense16`,
    ``"dense8"``: :class:`~gtopk_ext.collectives.Dense8`): ``tensor`` (float32) plus all of ``residual`` is
    averaged over the group into ``tensor``, and what the rounding took stays in ``residual``."""
    if residual is not None:
        tensor.add_(residual)
    COLLECTIVES[path]().reduce_dense(tensor, group, dist.get_world_size(group), traffic, lost=residual)


@dataclass
class Outcome:
    """What :func:`reduce` did on this rank. ``msg``: the slots it sent; ``applied``: the mask of those inside
    the average (None: all); ``errors``: (indices, errors) the wire's rounding took off its applied values, now in
    its residual; ``nonfinite``: a rank's sum was not finite, so nothing sparse was applied and every rank must
    send its tensor densely (this rank's tensor then holds what it must send)."""

    msg: SparseMessage
    applied: torch.Tensor | None
    errors: tuple[torch.Tensor, torch.Tensor]
    nonfinite: bool = False

    def taken(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values): what this step took out of the residual (the applied slots less the rounding
        errors kept)."""
        values = self.msg.values if self.applied is None else self.msg.values * self.applied
        error_indices, errors = self.errors
        return torch.cat([self.msg.indices, error_indices]), torch.cat([values, -errors])


def keep_unapplied(residual: torch.Tensor, msg: SparseMessage, applied: torch.Tensor | None, rounding: Rounding,
                   backend: Backend | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback's completion, after the compressor took the sent slots out of ``residual``: the slots the
    collective did not apply, and the wire's rounding errors, go back in. Returns the rounding's (indices,
    errors)."""
    if applied is not None:
        ops.scatter_add_(residual, msg.indices, msg.values * ~applied, backend=backend)
    error_indices, errors = rounding.pairs(residual.dtype, residual.device)
    ops.scatter_add_(residual, error_indices, errors, backend=backend)
    return error_indices, errors


def put_back(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, backend: Backend | None) -> None:
    """``residual[indices] += values``: what a step took out of the residual returns (a step the loss scaler
    skipped)."""
    ops.scatter_add_(residual, indices, values, backend=backend)


def reduce(tensor: torch.Tensor, residual: torch.Tensor | None, msg: SparseMessage | None, collective: Collective,
           group: dist.ProcessGroup, *, k: int, wire: Wire, backend: Backend | None, traffic: Traffic | None = None,
           state=None, out: torch.Tensor | None = None, **moved) -> Outcome:
    """Steps 3-4 of a sparse reduction of ``tensor`` (flat) over ``group``, after step 2 (select): ``msg`` is
    ``tensor + residual`` compressed to k slots, the rest left in ``residual`` (the compressor's contract), or None
    from a rank whose sum is not finite, which raises a flag instead. ``out`` (default ``tensor``) becomes the
    average over the group's ranks of what was applied.

    3. Exchange: ``collective`` reduces the messages; the flags ride inside its payloads.
    4. Keep: what was not applied goes back into the residual (:func:`keep_unapplied`), and ``out`` becomes the
       average. If any rank raised the flag nothing is applied: every rank must go dense, a finite rank sending
       all of ``tensor + residual`` (its ``tensor`` then holds it, its residual the same) and the others their
       tensor, their residual untouched.
    """
    if callable(msg):  # 0.3: a select callback, and finite=
        warnings.warn("reduction.reduce(tensor, residual, select, ..., finite=) is deprecated: pass the message "
                      "select() returns, or None where this rank's sum is not finite", DeprecationWarning, stacklevel=2)
        msg = msg() if moved.pop("finite", True) else None
    if moved:
        raise TypeError(f"reduce() got unexpected keyword argument(s) {sorted(moved)}")
    size = dist.get_world_size(group)
    finite = msg is not None
    flags = torch.zeros(1, dtype=torch.int32, device=tensor.device)
    if not finite:
        flags[0] = FLAG_NONFINITE
        msg = padding_message(tensor, k)
    rounding = Rounding()
    reduced = collective.reduce(msg, group, wire=wire, traffic=traffic, flags=flags, rounding=rounding, state=state)
    if int(flags) & FLAG_NONFINITE:
        if finite and residual is not None:  # all of this rank's sum goes into the dense average
            ops.scatter_add_(residual, msg.indices, msg.values, backend=backend)
            tensor.copy_(residual)
        nothing = torch.zeros_like(msg.indices, dtype=torch.bool)
        return Outcome(msg, nothing, rounding.pairs(tensor.dtype, tensor.device), nonfinite=True)
    errors = (keep_unapplied(residual, msg, reduced.applied, rounding, backend) if residual is not None
              else rounding.pairs(tensor.dtype, tensor.device))
    reduced.average_into(tensor if out is None else out, size, backend)
    return Outcome(msg, reduced.applied, errors)
