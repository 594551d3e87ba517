"""WAGMA-SGD: wait-avoiding group model averaging (Li et al., "Breaking (Global) Barriers in Parallel Stochastic
Optimization with Wait-Avoiding Group Averaging", TPDS 2021), on ``torch.distributed``.

Used like torch's ``PeriodicModelAverager``: every rank trains its own replica (no DDP) and calls
``averager.average_parameters(model.parameters())`` after each ``optimizer.step()``, and
``averager.finish(model.parameters())`` before evaluating and at the end.

- After each step a rank averages its weights with a group of ``group_size`` ranks; the groups rotate by a
  butterfly pattern (:func:`butterfly_groups`), so an update reaches every rank within about ``log_group_size(P)``
  steps. Every ``global_period`` steps (and during warm-up) a synchronous global average bounds the drift.
- Weights are divided by the group's size before the allreduce sums them, so float16 weights cannot overflow.
- ``wait_avoiding=True`` (default): a communication thread per rank joins every group allreduce with the weights
  its rank last published, and a round starts when the group's first member reaches it, so a straggler delays
  nobody until the next global average. Group averages move no mass: the sum of the weights over the ranks is
  what the optimizer steps put in. ``finish`` and ``state_dict`` are then collective; an error on one rank
  raises on every rank from its next call.

Requirements: constructing the averager is collective over the default group, like ``dist.new_group`` (also on
ranks outside ``process_group``, for which ``average_parameters`` does nothing). Every rank passes parameters of
the same shapes, dtypes and order, the same on every call, and all of them are averaged (also those without a
gradient). In wait-avoiding mode, call ``finish`` before ``destroy_process_group``.
"""

from gtopk_ext.averaging.averager import GroupModelAverager
from gtopk_ext.averaging.butterfly import butterfly_groups, group_schedule_length

__all__ = ["GroupModelAverager", "butterfly_groups", "group_schedule_length"]
