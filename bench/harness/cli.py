"""The flags the benchmarks share, the checks of their values, and the ``--worker`` re-entry of a launched rank."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.digits import MODELS
from bench.emulated_network import check_can_emulate
from bench.harness.launch import as_rank
from gtopk_ext.costs import parse_rate

# The flags several benchmarks share: (argparse options but the default, help).
COMMON = {"world_size": ({"type": int}, "Gloo processes (DDP ranks)"),
          "steps": ({"type": int}, "steps of every method"),
          "eval_every": ({"type": int}, "steps between two evaluations"),
          "batch_size": ({"type": int}, "examples per rank and step"),
          "lr": ({"type": float}, "the learning rate (the inner optimizer's of a local method; with a schedule, its "
                                  "peak)"),
          "momentum": ({"type": float}, "SGD's momentum (in the hook for the methods with momentum correction)"),
          "nesterov": ({"action": "store_true"}, "Nesterov momentum in the optimizers that have the momentum (the "
                                                 "hook's momentum correction has its own: --dgc-nesterov, the recipe)"),
          "model": ({"choices": MODELS}, "the digits model (bench/digits.py)"),
          "seed": ({"type": int}, "initial weights and batches"),
          "seeds": ({"type": int, "nargs": "+"}, "one run per seed (initial weights and batches)"),
          "densities": ({"type": float, "nargs": "+"}, "densities of the sparse methods"),
          "json": ({"type": Path}, "write the settings and every measurement here"),
          "plot": ({"type": Path}, "write the figure here (PNG)"),
          "no_progress": ({"action": "store_true"}, "no progress bar")}


def parser(doc: str, **common) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, showing the defaults, with the COMMON flags named."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(parser, **common)
    return parser


def add_common(parser: argparse.ArgumentParser, **defaults) -> None:
    """The COMMON flags named, with these defaults."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), default=default, help=COMMON[name][1], **COMMON[name][0])


def add_optimizer_args(parser: argparse.ArgumentParser, defaults: dict, optimizer: str = "sgd") -> None:
    """--optimizer and AdamW's, the learning-rate schedule's and clipping's flags (bench.harness.train); those left
    None take ``defaults[the optimizer]`` (a dict of destinations and values: :func:`fill_optimizer_defaults`)."""
    told = "; ".join(f"{name}: " + ", ".join(f"{key.replace('_', '-')} {value:g}" for key, value in values.items())
                     for name, values in defaults.items())
    parser.add_argument("--optimizer", choices=tuple(defaults), default=optimizer,
                        help="the optimizer of every method (a local method's inner one; adamw: not with the "
                             "methods whose hook applies momentum, recipe- and dgc-), and the defaults of the flags "
                             f"left None ({told})")
    parser.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95], metavar=("BETA1", "BETA2"),
                        help="AdamW's")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="AdamW's decoupled weight decay, on the matrices (parameters of 2 or more dimensions) "
                             "only; SGD's, on every parameter")
    parser.add_argument("--lr-warmup", type=int, default=None,
                        help="steps of linear learning-rate warm-up, then a cosine decay to --min-lr-ratio")
    parser.add_argument("--lr-decay-steps", type=int, default=None,
                        help="the step the cosine ends at (then --min-lr-ratio stays; None: --steps)")
    parser.add_argument("--min-lr-ratio", type=float, default=None,
                        help="the learning rate at the cosine's end over the peak (1: no decay)")
    parser.add_argument("--clip-norm", type=float, default=None,
                        help="clip the gradient's global norm (after the hook's reduction) to this; 0: no clipping")


def fill_optimizer_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict) -> None:
    """Sets the flags left None to ``defaults[args.optimizer]``, and checks the :func:`add_optimizer_args` flags."""
    for name, value in defaults[args.optimizer].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check(parser, args, positive=("lr_decay_steps",))
    for name, ok, wanted in (("lr", args.lr > 0, "> 0"), ("weight_decay", args.weight_decay >= 0, ">= 0"),
                             ("lr_warmup", args.lr_warmup >= 0, ">= 0"), ("clip_norm", args.clip_norm >= 0, ">= 0"),
                             ("min_lr_ratio", 0 <= args.min_lr_ratio <= 1, "in [0, 1]"),
                             ("betas", all(0 <= beta < 1 for beta in args.betas), "in [0, 1)")):
        if not ok:
            parser.error(f"--{name.replace('_', '-')} must be {wanted}, got {getattr(args, name)}")


def add_network_args(parser: argparse.ArgumentParser, prefix: str, rate: str | None = "1gbit",
                     timeout: float = 1800.0, timeout_help: str = "seconds the whole job may take") -> None:
    """--rate (``rate`` None: loopback by default), --loopback (it wins over --rate), --prefix, --timeout, --worker."""
    parser.add_argument("--rate", type=parse_rate, default=parse_rate(rate) if rate else None,
                        help="every rank in its own network namespace behind a link of this rate, e.g. 100mbit "
                             "(needs root; none: loopback)")
    parser.add_argument("--loopback", action="store_true", help="plain processes on 127.0.0.1, no shaping")
    parser.add_argument("--prefix", default=prefix, help="name prefix of the namespaces this run creates")
    parser.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
    add_worker_arg(parser)


def add_worker_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace, positive=(), unit=()) -> None:
    """Refuses, naming its flag, a ``positive`` value below 1 or a ``unit`` one (a number or list) outside (0, 1]."""
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in unit:
        for value in getattr(args, name) if isinstance(getattr(args, name), list) else [getattr(args, name)]:
            if not 0 < value <= 1:
                parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {value}")


def link_rate(program: str, args: argparse.Namespace) -> int | None:
    """The rate of the links to run on, or None for loopback: asked for, or no emulated network here (said)."""
    reason = None if getattr(args, "loopback", False) or args.rate is None else check_can_emulate()
    if reason:
        print(f"{program}: no emulated network ({reason}); running on loopback", file=sys.stderr)
    return None if reason or getattr(args, "loopback", False) else args.rate


def require_emulation(program: str) -> None:
    """Exits with status 2, saying why, where the emulated network cannot run."""
    if check_can_emulate():
        print(f"{program} cannot run: {check_can_emulate()}", file=sys.stderr)
        sys.exit(2)


def ran_as_worker(args: argparse.Namespace, work, timeout_arg: str | None = None) -> bool:
    """With --worker: runs this rank's ``work`` (launch.as_rank) and says so."""
    if args.worker:
        as_rank(json.loads(args.worker.read_text()), work, timeout_arg)
    return bool(args.worker)
