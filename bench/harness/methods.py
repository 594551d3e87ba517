"""The methods the training benchmarks compare, by name (``METHODS``: a new method is one entry)."""

# No `from __future__ import annotations`: DDP checks the hooks' annotations against dist.GradBucket.
import argparse
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters

import gtopk_ext as gx
from gtopk_ext.collectives import ring_allreduce_bytes

START_ITER = 2  # dense iterations of every compressing hook (PowerSGD and gtopk_ext need at least 2)


def numel_of(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def hook_state(density: float, *, start_iter: int = START_ITER, warmup_steps: int = 0, warmup_density: float = 0.25,
               warmup_from: int = 0, compressor: str = "gaussiank", per_tensor: bool = False, momentum: float = 0.0,
               nesterov: bool = False, weight_decay: float = 0.0, masking_start_iter: int = 0,
               clip_norm: float | None = None, path="sparse", min_compress_numel: int | None = None,
               synchronous: bool = False, **options) -> gx.SparseGradState:
    """gtopk_ext's hook state built by hand (by default every compressed step sparse), with DGC's warm-up from
    ``warmup_density`` over ``warmup_steps`` iterations from ``warmup_from``; ``options``: SparseGradState's."""
    schedule = (gx.exponential_warmup(density, warmup_steps, warmup_density, start_iter=warmup_from)
                if warmup_steps else density)
    correction = (gx.MomentumCorrection(momentum, nesterov=nesterov, weight_decay=weight_decay,
                                        masking_start_iter=masking_start_iter, clip_norm=clip_norm)
                  if momentum or clip_norm is not None else None)
    if min_compress_numel is not None:
        path = gx.PathPolicy(gx.paths.path_policy(path).mode, min_compress_numel=min_compress_numel)
    compressor = gx.make_compressor(compressor, density, per_tensor=per_tensor)
    state = gx.SparseGradState(density=schedule, compressor=compressor, start_iter=start_iter, momentum=correction,
                               path=path, stats_logging_frequency=0, **options)
    state.synchronous = synchronous
    return state


def recipe_state(density: float, warmup_steps: int, momentum: float, choices: list[str] | None = None,
                 path: str = "auto") -> gx.SparseGradState:
    """``gx.SparseGradState.recipe`` as a user calls it, without the periodic log; ``path``: its path policy's mode
    (a forced path is the same every run, auto's choices follow timings); ``choices``: auto's paths."""
    path = gx.PathPolicy("auto", choices=choices) if choices else path
    return gx.SparseGradState.recipe(density=density, warmup_steps=warmup_steps, momentum=momentum, path=path,
                                     stats_logging_frequency=0)


@dataclass(frozen=True)
class Accounting:
    """A method's own count: this rank's bytes in the last step, its hook's buckets and their last paths."""

    bytes_sent: Callable[[], int] = lambda: 0
    buckets: Callable[[], Optional[int]] = lambda: None
    paths: Callable[[], Optional[str]] = lambda: None
    state: Optional[gx.SparseGradState] = None


@dataclass(frozen=True)
class Recipe:
    """One DDP method: ``attach(ddp_model, world_size, args)`` registers its hook (or none), returns its Accounting."""

    label: str
    attach: Callable
    one_bucket: bool = False
    momentum_in_hook: bool = False
    adamw_in_hook: bool = False  # the AdamW recipe: its optimizer is gx.SparseAdamW on the hook's state
    peer: bool = False  # what users have without gtopk_ext (DDP, PyTorch's hooks): the races' "best peer"


def attached(ddp, state: gx.SparseGradState) -> Accounting:
    """gtopk_ext's hook with ``state`` on ``ddp``, counted by its ``stats()``."""
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    return Accounting(lambda: state.stats()["total"]["bytes_sent"], lambda: len(state.stats()["buckets"]),
                      lambda: ",".join(bucket["path"] for bucket in state.stats()["buckets"].values()), state)


def hook_recipe(label: str, state: Callable, momentum_in_hook: bool = False) -> Recipe:
    """gtopk_ext's hook with the state ``state(args)`` makes."""
    return Recipe(label, lambda ddp, world_size, args: attached(ddp, state(args)), momentum_in_hook=momentum_in_hook)


def adamw_recipe(density: float, wire: str | None = None) -> Recipe:
    """``gx.SparseGradState.recipe(optimizer="adamw")`` (AdamW's momentum decoupled in the hook, sparse from the
    third step) with ``--clip-norm`` in the hook; ``wire``: another wire than the recipe's."""
    options = {} if wire is None else {"wire": wire}
    return Recipe(f"gtopk_ext AdamW recipe, d={density:g}" + (f", {wire} wire" if wire else ""),
                  lambda ddp, world_size, args: attached(ddp, gx.SparseGradState.recipe(
                      density=density, optimizer="adamw", clip_norm=args.clip_norm or None,
                      stats_logging_frequency=0, **options)), adamw_in_hook=True)


def no_communication_hook(_, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The compute floor: the bucket divided by the world size, as every averaging hook does, and nothing sent."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer().div_(dist.get_world_size()))
    return future


def allreduce_recipe(label: str, hook=None, wire_bytes: int = 4) -> Recipe:
    """DDP's allreduce, through ``hook`` if given, of ``wire_bytes`` per element."""
    def attach(ddp, world_size, args):
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        return Accounting(lambda: ring_allreduce_bytes(numel_of(ddp) * wire_bytes, world_size))
    return Recipe(label, attach, peer=True)


def powersgd_recipe(rank: int) -> Recipe:
    """PowerSGD with one bucket: with several on Gloo, the ranks' allreduces of P and Q (on Gloo's threads) and of the
    next bucket go out of order, and the group fails ("Received data size doesn't match expected size") or hangs."""
    def attach(ddp, world_size, args):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=START_ITER)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        counted, numel = [0], numel_of(ddp)

        def bytes_sent() -> int:  # the elements it allreduced since the last call; none: a dense warm-up step
            added, counted[0] = state.total_numel_after_compression - counted[0], state.total_numel_after_compression
            return ring_allreduce_bytes((added or numel) * 4, world_size)
        return Accounting(bytes_sent, lambda: len(state.error_dict))
    return Recipe(f"PowerSGD rank {rank} (one bucket)", attach, one_bucket=True, peer=True)


def dgc_recipe(density: float, per_tensor: bool = False, path: str | None = None) -> Recipe:
    """Deep Gradient Compression's momentum correction (in the hook), warm-up over ``--dgc-warmup`` iterations and
    momentum factor masking after it (during it most elements go nearly every step), and the other ``--dgc-*``."""
    return hook_recipe(
        f"Gaussian-k + gTop-k, d={density:g}, momentum correction + warm-up" + (" + per-tensor" * per_tensor)
        + (f", path {path}" if path else ""),
        lambda args: hook_state(density, start_iter=args.dgc_dense_steps, warmup_steps=args.dgc_warmup,
                                warmup_density=args.dgc_warmup_start, momentum=args.momentum,
                                nesterov=args.dgc_nesterov, clip_norm=args.dgc_clip_norm,
                                per_tensor=per_tensor or args.dgc_per_tensor, masking_start_iter=args.dgc_warmup,
                                path=path or args.dgc_path, min_compress_numel=args.dgc_min_compress_numel),
        momentum_in_hook=True)


def add_dgc_arguments(parser: argparse.ArgumentParser) -> None:
    """The levers of :func:`dgc_recipe`: the defaults are the recipe."""
    parser.add_argument("--dgc-warmup", type=int, default=20,
                        help="iterations of the dgc methods' sparsity warm-up (masking starts after it)")
    parser.add_argument("--dgc-warmup-start", type=float, default=0.25,
                        help="the density the warm-up starts from (falling geometrically to the method's)")
    parser.add_argument("--dgc-dense-steps", type=int, default=START_ITER,
                        help="dense allreduce steps (at least 2), the warm-up's first iterations included")
    parser.add_argument("--dgc-per-tensor", action="store_true",
                        help="each parameter of a bucket selects its share of k")
    parser.add_argument("--dgc-nesterov", action="store_true", help="Nesterov momentum correction")
    parser.add_argument("--dgc-clip-norm", type=float, default=None,
                        help="local gradient clipping: each bucket's norm at most this / sqrt(P)")
    parser.add_argument("--dgc-min-compress-numel", type=int, default=None,
                        help="buckets of fewer elements go dense (default: the hook's)")
    parser.add_argument("--dgc-path", default="auto", choices=gx.paths.MODES,
                        help="each bucket's path (gx.PathPolicy): auto, or sparse, dense16, dense8, dense every step")
    parser.add_argument("--auto-choices", nargs="+", default=None, choices=gx.paths.PATHS,
                        help="the paths the recipe methods' auto may take (gx.PathPolicy(choices=); default: "
                             "the hook's, all but dense8)")


@dataclass(frozen=True)
class LocalMethod:
    """A local method: ``kind`` "postlocal", "diloco" or "sparse", exchanging every ``period`` (H) steps;
    ``sparseloco``: SparseLoCo's exchange (top-k per 4,096-element chunk, the 2-bit wire, each element averaged over
    its senders, the accumulator decayed by 0.95 a sync) in place of the sparse collective's, but ``without`` one
    of its pieces (:data:`SPARSELOCO_PIECES`), which then takes SparseLocalSGD's earlier choice."""

    kind: str
    period: int
    collective: str = "dense"
    density: float = 1.0
    wire: str = "plain"
    sparseloco: bool = False
    without: str = ""
    overlap: int = 0  # SparseLocalSGD's overlap: inner steps an exchange runs before it is applied
    fragments: int = 1  # SparseLocalSGD's fragments: slices of the model synced at staggered steps

    @property
    def peer(self) -> bool:
        """PyTorch's local SGD and DiLoCo are what users have; SparseLocalSGD's sparse exchange is gtopk_ext's."""
        return self.kind != "sparse"

    @property
    def label(self) -> str:
        if self.sparseloco:
            without = f", without {SPARSELOCO_PIECES[self.without][0]}" if self.without else ""
            overlap = (f", {self.fragments} fragments" if self.fragments > 1 else "") + (
                f", overlap {self.overlap}" if self.overlap else "")
            return f"SparseLocalSGD as SparseLoCo, d={self.density:g}, H={self.period}{without}{overlap}"
        compact = ", compact wire" if self.wire == "compact" else ""
        return {"postlocal": "PyTorch PostLocalSGD", "diloco": "DiLoCo (dense)"}.get(
            self.kind, f"SparseLocalSGD {self.collective} d={self.density:g}") + f", H={self.period}{compact}"

    def options(self, error_decay: float) -> dict:
        """SparseLocalSGD's keyword arguments for this method (``error_decay``: the command's, for sparse ones)."""
        if self.sparseloco:
            options = {"compressor": "chunktopk", "wire": "2bit", "average": "senders", "error_decay": 0.95,
                       "overlap": self.overlap, "fragments": self.fragments}
            return {**options, **(SPARSELOCO_PIECES[self.without][1] if self.without else {})}
        if self.kind == "sparse":  # the exchange SparseLocalSGD's defaults were before SparseLoCo's
            return {"compressor": "gaussiank", "wire": self.wire, "average": "ranks", "error_decay": error_decay}
        return {}  # DiLoCo: the dense collective's


# The sparseloco- methods' pieces that a name can leave out: (the piece in words, what replaces it).
SPARSELOCO_PIECES = {"nochunk": ("the chunks (one top-k)", {"compressor": "topk"}),
                     "plain": ("the 2-bit wire (float32)", {"wire": "plain"}),
                     "ranks": ("the average over senders (over P)", {"average": "ranks"}),
                     "nodecay": ("the decay", {"error_decay": 1.0})}


def one_of(choices) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text
    return parse


def density_of(text: str) -> float:
    gx.compressors.check_density(float(text))
    return float(text)


# What a <field> of a method's name holds.
FIELDS = {"collective": one_of(gx.collectives.SPARSE_COLLECTIVES), "d": density_of, "rank": int, "H": int,
          "path": one_of(gx.paths.MODES), "warmup": int, "without": one_of(SPARSELOCO_PIECES),
          "overlap": int, "fragments": int, "wire": one_of(tuple(gx.wire.WIRES))}
# Every method: the pattern of its name and what builds it from the pattern's fields.
METHODS = {
    "ddp": lambda: allreduce_recipe("DDP allreduce"),
    "fp16": lambda: allreduce_recipe("fp16_compress_hook", default_hooks.fp16_compress_hook, 2),
    "bf16": lambda: allreduce_recipe("bf16_compress_hook", default_hooks.bf16_compress_hook, 2),
    "floor": lambda: allreduce_recipe("no communication (compute floor)", no_communication_hook, 0),
    "powersgd-<rank>": powersgd_recipe,
    "dgc-<d>": lambda d: dgc_recipe(d),  # the --dgc-* flags
    "dgc-<d>-<path>": lambda d, path: dgc_recipe(d, path=path),  # the recipe on one path, or auto
    "recipe-<d>": lambda d: hook_recipe(  # gx.SparseGradState.recipe, --dgc-warmup steps of warm-up
        f"gtopk_ext recipe, d={d:g}",
        lambda args: recipe_state(d, args.dgc_warmup, args.momentum, args.auto_choices), True),
    "recipe-<d>-<warmup>": lambda d, warmup: hook_recipe(  # its own warm-up: two lengths in one run
        f"gtopk_ext recipe, d={d:g}, {warmup}-step warm-up",
        lambda args: recipe_state(d, warmup, args.momentum, args.auto_choices), True),
    "dgc-pt-<d>": lambda d: dgc_recipe(d, per_tensor=True),
    "adamw-<d>": lambda d: adamw_recipe(d),  # the AdamW recipe (--optimizer adamw)
    "adamw-<d>-<wire>": lambda d, wire: adamw_recipe(d, wire),  # the AdamW recipe on another wire
    "<collective>-<d>": lambda collective, d: hook_recipe(f"Gaussian-k + {collective}, d={d:g}",
                                                          lambda args: hook_state(d, collective=collective)),
    "hook-<collective>-<d>": lambda collective, d: METHODS["<collective>-<d>"](collective, d),
    "<collective>-<d>-sync": lambda collective, d: hook_recipe(  # each bucket finished inside the hook call
        f"Gaussian-k + {collective}, d={d:g}, each bucket finished in the hook call",
        lambda args: hook_state(d, collective=collective, synchronous=True)),
    "postlocal-<H>": lambda H: LocalMethod("postlocal", H),  # PyTorch's local SGD
    "diloco-<H>": lambda H: LocalMethod("diloco", H),  # SparseLocalSGD, density 1, dense
    "sparse-<collective>-<d>-<H>": lambda collective, d, H: LocalMethod("sparse", H, collective, d),
    "sparse-<collective>-<d>-<H>-compact": lambda collective, d, H: LocalMethod("sparse", H, collective, d, "compact"),
    "sparseloco-<d>-<H>": lambda d, H: LocalMethod("sparse", H, "allgather", d, "2bit", sparseloco=True),
    "sparseloco-<d>-<H>-<without>": lambda d, H, without: LocalMethod("sparse", H, "allgather", d, "2bit", True,
                                                                      without),
    "sparseloco-<d>-<H>-overlap-<overlap>": lambda d, H, overlap: LocalMethod("sparse", H, "allgather", d, "2bit",
                                                                              True, overlap=overlap),
    "sparseloco-<d>-<H>-fragments-<fragments>-overlap-<overlap>": lambda d, H, fragments, overlap: LocalMethod(
        "sparse", H, "allgather", d, "2bit", True, overlap=overlap, fragments=fragments),
}


def method(name: str) -> "Recipe | LocalMethod":
    """The method of a name; ValueError for no method."""
    for pattern, build in METHODS.items():
        words, parts, fields = pattern.split("-"), name.split("-"), {}
        try:
            for word, part in zip(words, parts, strict=True):
                if word.startswith("<"):
                    fields[word[1:-1]] = FIELDS[word[1:-1]](part)
                elif word != part:
                    raise ValueError(part)
        except ValueError:
            continue
        return build(**fields)
    raise ValueError(f"no method {name!r}; the methods: {', '.join(METHODS)}")


def optimizer_conflict(which: "str | Recipe", optimizer: str) -> Optional[str]:
    """Why a method (a name or a Recipe) cannot train under ``optimizer`` (None: it can). The hooks with momentum
    correction apply SGD's momentum themselves, for an optimizer without it: there is no such split of AdamW."""
    found = method(which) if isinstance(which, str) else which
    if optimizer != "adamw" and isinstance(found, Recipe) and found.adamw_in_hook:
        return (f"{which if isinstance(which, str) else found.label} is the AdamW recipe: run it with --optimizer "
                f"adamw, not --optimizer {optimizer}")
    if optimizer != "sgd" and isinstance(found, Recipe) and found.momentum_in_hook:
        return (f"{which if isinstance(which, str) else found.label} applies SGD momentum in its hook (momentum "
                f"correction): run it with --optimizer sgd, not --optimizer {optimizer}")
    return None


def method_name(text: str) -> str:
    """An argparse type: a method's name."""
    try:
        method(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def add_outer_arguments(parser: argparse.ArgumentParser) -> None:
    """The outer step of DiLoCo and SparseLocalSGD (the ``diloco-`` and ``sparse-`` methods)."""
    # DiLoCo's published outer step (lr 0.7, Nesterov 0.9, for H = 500 AdamW steps of a language model)
    # overshoots on the digits (docs/local_sgd.md); lr 1 without momentum did best for every local method there.
    parser.add_argument("--outer-lr", type=float, default=1.0, help="the outer SGD's learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="the outer SGD's momentum")
    parser.add_argument("--outer-nesterov", action=argparse.BooleanOptionalAction, default=True,
                        help="Nesterov momentum (when --outer-momentum > 0)")
    parser.add_argument("--error-decay", type=float, default=1.0,
                        help="SparseLocalSGD's error_decay (the sparse- methods; 1: exact error feedback)")


class LocalExchange:
    """A local method around its inner optimizer (use :attr:`optimizer`; :meth:`after_step` after each step): PyTorch's
    local SGD (averaging from the first step) or SparseLocalSGD, and the bytes this rank sent by its count."""

    def __init__(self, method: LocalMethod, model: torch.nn.Module, inner: torch.optim.Optimizer,
                 args: argparse.Namespace, world_size: int):
        self.method, self.model, self.optimizer, self.outer = method, model, inner, None
        self.average_bytes = ring_allreduce_bytes(4 * numel_of(model), world_size)
        self.counted, self.steps, self.finished = 0, 0, False
        if method.kind == "postlocal":
            # Imported here: torch.distributed.optim imports FSDP, a second of every rank's start for other methods.
            from torch.distributed.optim import PostLocalSGDOptimizer

            self.optimizer = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=method.period, warmup_steps=0))
        else:
            self.outer = gx.SparseLocalSGD(
                model.parameters(), sync_every=method.period, density=method.density, collective=method.collective,
                outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                nesterov=args.outer_nesterov and args.outer_momentum > 0, **method.options(args.error_decay))

    def after_step(self) -> None:
        self.steps += 1
        if self.outer is not None:
            self.outer.step()
        elif self.synced():
            self.counted += self.average_bytes

    def synced(self) -> bool:
        """Whether the replicas are one model now (right after an average or a sync, or :meth:`finish`; with an
        overlapped exchange only after :meth:`finish`)."""
        if self.outer is not None and (self.outer.overlap or self.outer.fragments > 1) and not self.finished:
            return False
        return self.finished or (self.steps - (self.outer is None)) % self.method.period == 0

    def finish(self) -> None:
        """Exchanges once more unless the last step was an exchange: every method ends with one model."""
        if not self.synced():
            if self.outer is not None:
                self.outer.sync()
            else:
                average_parameters(self.model.parameters(), dist.group.WORLD)
                self.counted += self.average_bytes
            self.finished = True

    def bytes_sent(self) -> int:
        return self.outer.stats()["bytes_sent"] if self.outer is not None else self.counted
