"""The benchmarks' training loop (``Trainer``, ``train_curve``), batches, evaluation and reductions over the ranks."""

from __future__ import annotations

import argparse
import copy
import math
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import gtopk_ext as gx
from bench.harness.methods import LocalExchange, Recipe, method as method_named, numel_of, optimizer_conflict


class Trainer:
    """One method (a name of bench.harness.methods, or a Recipe) on this rank: ``model`` under DDP with the
    method's hook, or a replica under a local method (``local``); :func:`make_optimizer` (a local method's inner one)
    with :func:`lr_schedule` and, with ``args.clip_norm``, gradient-norm clipping; the bytes sent by the method's
    count."""

    def __init__(self, method: str | Recipe, model: nn.Module, args: argparse.Namespace, world_size: int):
        found = method if isinstance(method, Recipe) else method_named(method)
        conflict = optimizer_conflict(method, getattr(args, "optimizer", "sgd"))
        if conflict:
            raise ValueError(conflict)
        self.model, self.trained, self.sent, self.mean = model, model, 0, None
        self.recipe = found if isinstance(found, Recipe) else None
        self.clip_norm = getattr(args, "clip_norm", None)
        adamw_in_hook = self.recipe is not None and self.recipe.adamw_in_hook
        if adamw_in_hook and self.clip_norm:  # the hook clips; an infinite max_norm only measures the norm
            self.clip_norm = math.inf
        if not adamw_in_hook:
            self.optimizer = make_optimizer(model, args, self.recipe is not None and self.recipe.momentum_in_hook)
        self.local = None if self.recipe is not None else LocalExchange(found, model, self.optimizer, args, world_size)
        if self.local is not None:
            self.schedule = lr_schedule(self.optimizer, args)  # of the inner optimizer, before the method wraps it
            self.optimizer = self.local.optimizer
        else:  # one bucket: a cap above the model's size (DDP's first bucket then has that cap too)
            cap_mb = numel_of(model) * 4 / 2**20 + 1 if self.recipe.one_bucket else getattr(args, "bucket_cap_mb", None)
            self.trained = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
            self.accounting = self.recipe.attach(self.trained, world_size, args)
            if adamw_in_hook:
                self.optimizer = adamw(model, args, state=self.accounting.state)
            self.schedule = lr_schedule(self.optimizer, args)

    def measured_step(self, loss_of, tx, last: bool = False) -> dict:
        """One step on ``loss_of(trained model)``, started by every rank together (with ``last``, then the exchange
        that leaves one model): its loss, seconds (the final exchange's also apart, ``finish_seconds``), the
        gradient's norm before clipping (with clipping; None without),
        CPU seconds (all threads), bytes sent by the method's count and by ``tx`` (a TxCounter), and its buckets'
        paths."""
        dist.barrier()
        tx_bytes, cpu, sent, start = tx.read(), time.process_time(), self.bytes_sent(), time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_of(self.trained)
        loss.backward()
        # the reduced gradient under DDP (the same on every rank), the replica's own under a local method
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm) if self.clip_norm else None
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        finish = 0.0  # seconds of the exchange that leaves one model, after the last step of a local method
        if self.local is not None:
            self.local.after_step()
            if last:
                finishing = time.perf_counter()
                self.local.finish()
                finish = time.perf_counter() - finishing
        else:
            self.sent += self.accounting.bytes_sent()
        return {"loss": float(loss.detach()), "seconds": time.perf_counter() - start, "finish_seconds": finish,
                "grad_norm": None if norm is None else float(norm),
                "cpu_seconds": time.process_time() - cpu, "bytes": self.bytes_sent() - sent,
                "tx_bytes": tx.read() - tx_bytes, "paths": self.accounting.paths() if self.local is None else None}

    def bytes_sent(self) -> int:
        return self.local.bytes_sent() if self.local is not None else self.sent

    def shared_model(self) -> nn.Module:
        """The model the ranks share: the replica where they are one model, else the replicas' mean in a copy (an
        allreduce the byte counts leave out)."""
        if self.local is None or self.local.synced():
            return self.model
        if self.mean is None:
            self.mean = copy.deepcopy(self.model)
        return load_consensus(self.model, self.mean)


def make_optimizer(model: nn.Module, args: argparse.Namespace, momentum_in_hook: bool = False) -> torch.optim.Optimizer:
    """``args.optimizer``'s (without that flag, SGD's): :func:`sgd` or :func:`adamw`."""
    return adamw(model, args) if getattr(args, "optimizer", "sgd") == "adamw" else sgd(model, args, momentum_in_hook)


def adamw(model: nn.Module, args: argparse.Namespace, state=None) -> torch.optim.AdamW:
    """AdamW with ``args.lr``, ``args.betas`` and ``args.weight_decay`` on the matrices only (the parameters of 2 or
    more dimensions: weights and embeddings; biases and LayerNorm gains get none, nanoGPT's rule); with a hook
    ``state`` of the AdamW recipe, ``gx.SparseAdamW`` on it with the same arguments."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if state is not None:
        return gx.SparseAdamW(groups, lr=args.lr, betas=tuple(args.betas), state=state)
    return torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas))


def lr_factor(step: int, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """The learning rate of update ``step`` (from 0) over the peak: a linear warm-up, (step + 1) / ``warmup`` over the
    first ``warmup`` updates, then a cosine from 1 at update ``warmup`` to ``min_ratio`` at update ``decay_steps - 1``
    (the last of a ``decay_steps`` run), and ``min_ratio`` after it."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay_steps - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    """:func:`lr_factor` with ``args.lr_warmup`` and ``args.min_lr_ratio`` over ``args.lr_decay_steps`` (None: over
    ``args.steps``), a LambdaLR stepped once per step; None (a constant rate) without --lr-warmup (benchmarks that
    lack it)."""
    if getattr(args, "lr_warmup", None) is None:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_factor, warmup=args.lr_warmup, decay_steps=args.lr_decay_steps or args.steps, min_ratio=args.min_lr_ratio))


def sgd(model: nn.Module, args: argparse.Namespace, momentum_in_hook: bool = False) -> torch.optim.SGD:
    """SGD with ``args.lr`` and, unless the hook applies them, ``args.momentum``, ``nesterov`` and ``weight_decay``."""
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if momentum_in_hook else args.momentum,
                           nesterov=getattr(args, "nesterov", False) and not momentum_in_hook,
                           weight_decay=0.0 if momentum_in_hook else getattr(args, "weight_decay", 0.0))


def train_curve(trainer: Trainer, steps: int, loss_at, evaluate, eval_every: int, tx, progress=None,
                after_step=None, stop=None) -> tuple[list[dict], list[dict]]:
    """Trains ``steps`` measured steps on ``loss_at(step)``, calling ``after_step(step)`` after each. Returns the curve
    (at step 0, every ``eval_every`` steps and the last: ``evaluate(shared model)``, the slowest rank's seconds and
    this rank's bytes) and every step's measurements. ``stop(point)``: stops there (on every rank: points agree)."""
    curve, measured = [], []
    for step in range(steps + 1):
        if step:
            measured.append(trainer.measured_step(loss_at(step), tx, last=step == steps))
            if after_step is not None:
                after_step(step)
            if progress is not None:
                progress.set_postfix(loss=f"{measured[-1]['loss']:.3f}", refresh=False)
                progress.update()
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "seconds": float(slowest([sum(m["seconds"] for m in measured)])),
                          "bytes_sent": trainer.bytes_sent(), "tx_bytes": sum(m["tx_bytes"] for m in measured),
                          **evaluate(trainer.shared_model())})
            if stop is not None and stop(curve[-1]):
                break
    return curve, measured


def epoch_batches(epoch: int, seed: int, n_train: int, rank: int, world_size: int, batch_size: int) -> list:
    """This rank's index batches of an epoch: one shuffle, each global batch split by rank, no incomplete one."""
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    global_batch = world_size * batch_size
    return [order[start + rank * batch_size: start + (rank + 1) * batch_size]
            for start in range(0, n_train - global_batch + 1, global_batch)]


def batch_loss(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor):
    """A ``loss_of(model)``: the classifier's cross-entropy on the examples ``index`` of (x, y)."""
    return lambda model: nn.functional.cross_entropy(model(x[index]), y[index])


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    logits = model(x)
    return float((logits.argmax(1) == y).float().mean()), float(nn.functional.cross_entropy(logits, y))


def evaluation(x: torch.Tensor, y: torch.Tensor, accuracy_key: str, loss_key: str):
    """An ``evaluate(model)`` for :func:`train_curve`: :func:`evaluate` on (x, y) as a point's two keys."""
    return lambda model: dict(zip((accuracy_key, loss_key), evaluate(model, x, y)))


@torch.no_grad()
def load_consensus(model: nn.Module, evaluation: nn.Module) -> nn.Module:
    """``evaluation`` (a model of the same shape, or ``model`` itself) set to the mean of the replicas of ``model``."""
    mean = parameters_to_vector(model.parameters()).detach().clone()
    dist.all_reduce(mean)
    vector_to_parameters(mean.div_(dist.get_world_size()), evaluation.parameters())
    return evaluation


def reduced(values, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``values`` (a number or a list) reduced over the ranks (by default summed), as float64."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor


def slowest(values) -> torch.Tensor:
    return reduced(values, dist.ReduceOp.MAX)


def slowest_rank(step_seconds: list[float]) -> list[float]:
    """The step times of the rank whose steps took longest in all: a run's wall time is that rank's, and the
    maximum of each step over the ranks would overstate it where the ranks do not wait for each other every step
    (local SGD)."""
    return max(gathered(step_seconds), key=sum)


def gathered(values) -> list:
    """Every rank's ``values`` (a list of numbers or of lists of numbers), in rank order."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def barrier_bytes(counter, probes: int = 20) -> float:
    """Bytes one barrier puts on this rank's link (``counter``: a TxCounter), to take off a measurement's."""
    dist.barrier()
    start = counter.read()
    for _ in range(probes):
        dist.barrier()
    return (counter.read() - start) / probes
