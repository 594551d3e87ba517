"""A language model: a byte-level decoder-only transformer trained on this Python's standard library (nothing
downloaded; the held-out files are a function of their paths), with real DDP on Gloo processes, once per method from
the same weights on the same batches, on loopback or emulated links (as root). docs/language_model.md.

    python -m bench.lm --world-size 2 --steps 4 --methods ddp gtopk-0.01 --layers 1 --d-model 32   # seconds
"""

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
from functools import partial
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from bench.emulated_network import TxCounter, network_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import START_ITER, add_dgc_arguments, add_outer_arguments, method, method_name, numel_of
from bench.harness.train import Trainer, reduced, slowest, train_curve

DEFAULT_METHODS = ("ddp", "fp16", "powersgd-2", "gtopk-0.01", "gtopk-0.001", "recipe-0.01", "recipe-0.001",
                   "sparse-gtopk-0.05-10", "dgc-pt-0.001", "diloco-10")
GROUPS = ("embedding", "layernorm", "attention", "mlp", "head")
# What makes two reports one experiment (--merge): everything but the methods and how they were run.
CONFIGURATION = ("world_size", "steps", "eval_every", "batch_size", "seq_len", "d_model", "layers", "heads", "lr",
                 "momentum", "nesterov", "outer_lr", "outer_momentum", "outer_nesterov", "error_decay", "bucket_cap_mb",
                 "val_percent", "val_windows", "seed", "rate")
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> list[str]:
    """The standard library's ``*.py`` files as sorted paths relative to it (installed packages left out)."""
    paths = (path.relative_to(STDLIB) for path in STDLIB.rglob("*.py") if path.is_file())
    return sorted(path.as_posix() for path in paths if not {"site-packages", "dist-packages"} & set(path.parts))


def is_validation(relative_path: str, val_percent: float) -> bool:
    """Whether a file is held out: a function of its relative path only."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 10_000 < 100 * val_percent


def split_files(files: list[str], val_percent: float) -> tuple[list[str], list[str]]:
    """(training files, validation files), each in the order of ``files``."""
    return [f for f in files if not is_validation(f, val_percent)], [f for f in files if is_validation(f, val_percent)]


def windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length`` bytes of ``stream`` as token ids: [count, length] int64."""
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return stream[starts.unsqueeze(1) + torch.arange(length)].long()


def load_corpus(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The training bytes, the validation windows (the same for every run) and the corpus's figures. The bytes are
    the files', each followed by a NUL byte (which no source file contains)."""
    train_files, val_files = split_files(corpus_files(), args.val_percent)
    train, val = (torch.frombuffer(bytearray(b"".join((STDLIB / f).read_bytes() + b"\0" for f in files)),
                                   dtype=torch.uint8) for files in (train_files, val_files))
    corpus = {"files": len(train_files) + len(val_files), "train_files": len(train_files), "val_files": len(val_files),
              "train_bytes": len(train), "val_bytes": len(val), "val_file_list": val_files}
    return train, windows(val, args.val_windows, args.seq_len + 1, torch.Generator().manual_seed(12345)), corpus


def batch_at(train: torch.Tensor, step: int, rank: int, world_size: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's rows of step ``step``'s batch: one generator per step shared by the ranks, each drawing the
    global batch."""
    batch = windows(train, world_size * args.batch_size, args.seq_len + 1,
                    torch.Generator().manual_seed(args.seed * 1_000_003 + step))
    return batch[rank * args.batch_size:(rank + 1) * args.batch_size]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_attention, self.ln_mlp = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.attention_out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln_mlp(x))


class TransformerLM(nn.Module):
    """A decoder-only transformer over bytes (its shape: ``args``' --seq-len, --d-model, --layers and --heads): token
    and learned position embeddings, pre-LN blocks, a final LayerNorm and an untied output head; GPT-2's
    initialisation."""

    def __init__(self, args: argparse.Namespace, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.token_embedding = nn.Embedding(256, args.d_model)
        self.position_embedding = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(Block(args.d_model, args.heads) for _ in range(args.layers))
        self.ln_final, self.head = nn.LayerNorm(args.d_model), nn.Linear(args.d_model, 256)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * args.layers) if name.endswith(
                    ("attention_out.weight", "mlp.2.weight")) else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens) + self.position_embedding.weight[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def parameter_group(name: str) -> str:
    """Which of GROUPS a parameter of TransformerLM belongs to."""
    return next((group for group, keys in (("embedding", ("embedding",)), ("layernorm", (".ln_", "ln_final")),
                                           ("attention", (".qkv.", ".attention_out.")), ("mlp", (".mlp.",)))
                 if any(key in name for key in keys)), "head")


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy (nats per byte) of ``batch`` [B, T + 1]."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def validation_loss(model: nn.Module, val_batches: torch.Tensor, rank: int, world_size: int) -> dict:
    """Mean loss over every validation window, each rank evaluating its share (an allreduce of the sums)."""
    model.eval()
    shares = [(float(lm_loss(model, batch)) * len(batch), len(batch))
              for batch in val_batches[rank::world_size].split(16)]
    model.train()
    total = reduced([sum(s for s, _ in shares), sum(n for _, n in shares)])
    return {"val_loss": float(total[0] / total[1])}


def run_method(name: str, rank: int, world_size: int, args: argparse.Namespace, train: torch.Tensor,
               val_batches: torch.Tensor, tx: TxCounter, progress) -> dict:
    trainer = Trainer(name, TransformerLM(args, args.seed), args, world_size)  # the same weights for all
    groups = [parameter_group(n) for n, _ in trainer.model.named_parameters()]
    # steps before the target density: the recipe's and the dgc methods' warm-up (the hooks with momentum in them)
    warmed_up = args.dgc_warmup if trainer.recipe is not None and trainer.recipe.momentum_in_hook else START_ITER
    updated = []  # after each compressed step of gtopk_ext's hook: each group's elements its reduced gradient touched

    def loss_at(step: int):
        return partial(lm_loss, batch=batch_at(train, step, rank, world_size, args))

    def count_updated(step: int) -> None:
        if trainer.local is None and trainer.accounting.state is not None and step > warmed_up:
            updated.append([(g, int(torch.count_nonzero(p.grad))) for g, p in zip(groups, trainer.model.parameters())])

    def stop(point: dict) -> bool:  # the race: at the target, or out of time
        return ((args.target_loss is not None and point["val_loss"] <= args.target_loss)
                or (args.budget is not None and point["seconds"] >= args.budget))

    curve, measured = train_curve(trainer, args.steps, loss_at,
                                  lambda model: validation_loss(model, val_batches, rank, world_size),
                                  args.eval_every, tx, progress, count_updated, stop)
    record = {"method": name, "label": method(name).label, "curve": curve,
              "train_loss": (reduced([m["loss"] for m in measured]) / world_size).tolist(),
              "step_seconds": slowest([m["seconds"] for m in measured]).tolist(),
              **{key: curve[-1][key] for key in ("seconds", "bytes_sent", "tx_bytes")},
              "final_val_loss": curve[-1]["val_loss"],
              "group_numel": {g: sum(p.numel() for h, p in zip(groups, trainer.model.parameters()) if h == g)
                              for g in GROUPS},
              "load_average": os.getloadavg()}  # the machine's load while it ran
    if updated:
        record["updated_per_step"] = {g: sum(n for step in updated for h, n in step if h == g) / len(updated)
                                      for g in GROUPS}
    return record


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> dict:
    """One rank: every method in turn; rank 0 writes --json after each (a run cut short keeps what finished)."""
    args.json = Path(args.json) if args.json else None
    train, val_batches, corpus = load_corpus(args)
    progress = report.progress(args.steps * len(args.methods), rank, args, config)
    records = []
    for name in args.methods:
        progress.set_description(name)
        records.append(run_method(name, rank, world_size, args, train, val_batches, TxCounter(config["ifname"]),
                                  progress))
        if rank == 0:
            write_report(args, corpus, records)
    progress.close()
    return {"corpus": corpus, "records": records}


def summarize(records: list[dict], target: Optional[float] = None) -> list[dict]:
    ddp = next((r for r in records if r["method"] == "ddp"), None)
    return [{"method": r["method"], "label": r["label"], "final_val_loss": r["final_val_loss"],
             "steps": r["curve"][-1]["step"],
             **(report.to_target([r["curve"]], lambda point: point["val_loss"] <= target, "seconds")
                if target is not None else {}),
             "mb_sent": r["bytes_sent"] / 1e6, "tx_mb": r.get("tx_bytes", 0) / 1e6, "seconds": r["seconds"],
             "loss_vs_ddp": r["final_val_loss"] / ddp["final_val_loss"] if ddp else None,
             "bytes_vs_ddp": r["bytes_sent"] / ddp["bytes_sent"] if ddp else None,
             **({"updated_share": {g: r["updated_per_step"][g] / r["group_numel"][g] for g in GROUPS}}
                if "updated_per_step" in r else {})} for r in records]


# The race's columns first (with --target-loss): seconds and steps to the target, "-" where not reached.
RACE_COLUMNS = [(f"{what} to target", "", lambda r, key=key, form=form: "-" if r[key] is None else format(r[key], form))
                for what, key, form in (("s", "seconds_to_target", ".1f"), ("steps", "steps_to_target", "g"))]
COLUMNS = [("method", "", "label"), ("steps", "", "steps"), ("final val loss", ".4f", "final_val_loss"),
           ("vs DDP", "", lambda r: r["loss_vs_ddp"] and f"{r['loss_vs_ddp']:.3f}x"),
           ("MB sent / rank", ".1f", "mb_sent"),
           ("bytes vs DDP", "", lambda r: r["bytes_vs_ddp"] and f"1/{1 / r['bytes_vs_ddp']:.0f}"),
           ("link MB / rank", ".1f", lambda r: r["tx_mb"] or None),  # the interface counter: emulated links only
           ("seconds", ".0f", "seconds"),
           ("updated per step: " + ", ".join(GROUPS), "", lambda r: "updated_share" in r and ", ".join(
               f"{100 * r['updated_share'][g]:.2g}%" for g in GROUPS) or None)]


def setting(args: argparse.Namespace, corpus: dict) -> str:
    return (f"{args.world_size} ranks, Gloo on {network_name(args.rate)}, Python {platform.python_version()} stdlib "
            f"({corpus['train_files']} training files, {corpus['val_files']} held out), byte-level transformer "
            f"({numel_of(TransformerLM(args)) / 1e6:.2f}M parameters, d={args.d_model}, {args.layers} "
            f"layers, {args.heads} heads), sequence {args.seq_len}, batch {args.batch_size}/rank, {args.steps} steps, "
            f"SGD lr {args.lr:g} momentum {args.momentum:g}, seed {args.seed}")


def write_report(args: argparse.Namespace, corpus: dict, records: list[dict]) -> None:
    """The JSON report, where --json asks for one (the corpus is this Python's standard library)."""
    if args.json:
        report.write_json(args.json, args, setting=setting(args, corpus), parameters=numel_of(TransformerLM(args)),
                          python=platform.python_version(), corpus=corpus, table=summarize(records, args.target_loss),
                          runs=records)


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    # --eval-every: a multiple of every local method's H
    parser = cli.parser(__doc__, world_size=4, steps=600, eval_every=50, batch_size=8, lr=0.1, momentum=0.9, seed=0,
                        nesterov=False, json=None, plot=None, no_progress=False)
    parser.add_argument("--methods", nargs="+", type=method_name, default=list(DEFAULT_METHODS))
    for flag, default in (("--seq-len", 128), ("--d-model", 256), ("--layers", 7), ("--heads", 4)):
        parser.add_argument(flag, type=int, default=default, help="the transformer's")
    add_dgc_arguments(parser)
    add_outer_arguments(parser)
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's (default: its own, 25)")
    parser.add_argument("--val-percent", type=float, default=5.0, help="share of the files held out")
    parser.add_argument("--val-windows", type=int, default=128, help="validation windows of --seq-len bytes")
    cli.add_network_args(parser, prefix="gxlm", rate=None, timeout=4 * 3600.0,
                         timeout_help="Gloo's timeout and the whole run's, seconds")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="the race's validation loss: each method's training seconds and steps to its first "
                             "evaluation at or below it (the first columns), where the method stops")
    parser.add_argument("--budget", type=float, default=None,
                        help="training seconds after which a method stops (then: not reached)")
    parser.add_argument("--merge", type=Path, nargs="+",
                        help="run nothing: the table, --json and --plot of these reports' methods together (reports "
                             "of one configuration, written by parts of --methods)")
    args = parser.parse_args(argv)
    cli.check(parser, args, positive=("world_size", "steps", "eval_every", "batch_size", "seq_len", "d_model",
                                      "layers", "heads", "val_windows"))
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not 0 < args.val_percent < 100:
        parser.error(f"--val-percent must be in (0, 100), got {args.val_percent}")
    args.methods = list(dict.fromkeys(args.methods))
    return args


def merged(args: argparse.Namespace) -> tuple[argparse.Namespace, dict, list[dict]]:
    """The settings, corpus and records of the reports ``args.merge`` names, which must share one configuration."""
    reports = [json.loads(path.read_text()) for path in args.merge]
    first = reports[0]["settings"]
    for path, other in zip(args.merge[1:], reports[1:]):
        differ = [key for key in CONFIGURATION if other["settings"].get(key) != first.get(key)]
        if differ:
            raise SystemExit(f"--merge: {path} differs from {args.merge[0]} in {differ}: not one experiment")
    records = [record for r in reports for record in r["runs"]]
    names = [record["method"] for record in records]
    if len(set(names)) != len(names):
        raise SystemExit(f"--merge: a method appears in more than one report: {names}")
    # Reports from before --rate ran on loopback.
    settings = argparse.Namespace(**{"rate": None, "target_loss": None, "budget": None, **first, "methods": names,
                                     "json": args.json, "plot": args.plot,
                                     **({"target_loss": args.target_loss} if args.target_loss is not None else {})})
    return settings, reports[0]["corpus"], records


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "timeout"):
        return 0
    if args.merge:
        args, corpus, records = merged(args)
        write_report(args, corpus, records)
    else:
        args.rate = cli.link_rate("bench.lm", args)
        args.json = args.json.resolve() if args.json else None  # the ranks run in the repository's root
        measured = run_group("bench.lm", args.world_size, args, args.timeout, rate_bps=args.rate, prefix=args.prefix)
        corpus, records = measured["corpus"], measured["records"]
    title = setting(args, corpus)
    print(f"\n{title}\n")
    columns = (RACE_COLUMNS if args.target_loss is not None else []) + COLUMNS
    print(report.table(summarize(records, args.target_loss), columns, markdown=True))
    if args.plot:  # validation loss against steps, training seconds and MB sent per rank; each step's time apart
        report.plot_curves(records, args.plot, title, "validation loss (nats per byte)",
                           lambda c: min(c["val_loss"], 6.0),
                           [("step", lambda c: c["step"], "linear"),
                            ("training seconds (slowest rank)", lambda c: c.get("seconds", math.nan), "linear"),
                            ("MB sent per rank", lambda c: c["bytes_sent"] / 1e6, "log")],
                           style=lambda i, r: {"color": "black", "linewidth": 2} if r["method"] == "ddp" else
                           {"color": f"C{i % 10}"})
        timed = [{**r, "curve": [{"step": i + 1, "ms": 1e3 * t} for i, t in enumerate(r["step_seconds"])]}
                 for r in records if "step_seconds" in r]
        report.plot_curves(timed, args.plot.with_name(f"{args.plot.stem}_steps.png"), title,
                           "ms per step (slowest rank)", lambda c: c["ms"], [("step", lambda c: c["step"], "linear")],
                           yscale="log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
