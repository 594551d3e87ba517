"""WAGMA-SGD: wait-avoiding group model averaging (Li et al., "Breaking (Global) Barriers in Parallel Stochastic
Optimization with Wait-Avoiding Group Averaging", TPDS 2021), on ``torch.distributed``.

Use it like ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``: every rank trains
its own replica (no DDP gradient allreduce) and calls ``averager.average_parameters(model.parameters())`` after
each ``optimizer.step()``, and every rank calls ``averager.finish(model.parameters())`` at the end (and before
evaluating the averaged model).

- Group averaging: after each local step a rank averages its weights with a group of ``group_size`` ranks only,
  and the groups change every step by a butterfly pattern (:func:`butterfly_groups`), so a rank's update reaches
  every rank within about ``log_group_size(P)`` steps (exactly, with exact averages, when P is a power of the
  group size; within ``ceil(log_S P) + 1`` steps for the other world sizes the tests enumerate).
- A global average every ``global_period`` steps (and at every warm-up step) bounds how far replicas drift; it is
  synchronous, as in the paper.
- One flattened buffer per step and dtype. Each rank divides its weights by the group's size before the allreduce
  sums them (as torch's averagers do): float16 weights of 30000 on 4 ranks would sum to inf.

Wait avoidance (``wait_avoiding=True``), as in the paper: a straggler delays nobody between global averages.
Gloo and NCCL collectives start only when every member calls them, so each rank has a communication thread (the
background worker of :mod:`gtopk_ext._worker`, as the DDP hook's) that takes part in every group allreduce on the
rank's behalf, with the rank's *published* weights p:

- ``average_parameters`` at step t applies the corrections that arrived since its last call, publishes the
  weights (a copy) and returns at once: the training loop never waits for a group round.
- Group round t is activated by the first member of its group whose training loop reaches step t: that member's
  thread tells the others' threads (a small message), and every member's thread then joins the allreduce with the
  weights its rank last published, also when that rank is still computing an earlier step.
- A round turns p into the group mean a; the thread keeps p <- a and adds the correction ``a - p`` to what the
  rank applies at its next call. Over each group these corrections sum to zero, so the sum of the weights over
  all ranks is exactly what the updates put in: no rank's progress is lost or counted twice. A rank that is
  behind is represented by its last weights with every later group average applied (what its replica would be),
  and its own progress is added on top when it arrives.
- The global average of step t waits for every rank (the threads run it once every rank reached step t);
  staleness is therefore bounded by ``global_period``.

Why threads and messages: the paper's MPI code starts the group allreduce on the first arrival inside the
library; with Gloo and NCCL only a participant that is always ready (the thread) can stand in for a busy rank. The
activation and end-of-run messages go over a Gloo group of their own (small CPU tensors), so the data
allreduces may use any backend: NCCL's communicators are then used by one thread per rank, in the same round
order on every member, and a member enters an allreduce only after every member of its group has committed to
it, so an error never strands a rank inside a collective. The thread's buffers cost four copies of the
parameters.

``finish(params)`` is collective: every rank's thread completes the rounds up to the rank's current step, the
ranks check that they all stopped at the same step (a clear error otherwise), and each rank applies its last
corrections; it returns once every rank has called it. ``state_dict()`` does the same wait (it is collective in
wait-avoiding mode) and saves the corrections not yet applied, so a checkpoint of (weights, state_dict) loses
nothing. An error on one rank (bad parameters, a failed collective, a timeout) reaches every rank through the
worker: each raises it from its next call of the averager.

Requirements: constructing the averager is collective over the default process group, like ``dist.new_group``:
every rank of the default group constructs it (with the same arguments, in the same order relative to other
group creations), also ranks outside ``process_group``, for which ``average_parameters`` does nothing. The
parameters given to ``average_parameters`` must have the same shapes, dtypes and order on every rank, and the
same on every call; it averages all of them, also those without a gradient this step (filtering by gradient, as
torch's averagers do, would give ranks different buffer layouts). In wait-avoiding mode, call ``finish`` before
``destroy_process_group``.
"""

from gtopk_ext.averaging.averager import GroupModelAverager
from gtopk_ext.averaging.butterfly import butterfly_groups, group_schedule_length

__all__ = ["GroupModelAverager", "butterfly_groups", "group_schedule_length"]
