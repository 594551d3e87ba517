"""A language model: a small decoder-only transformer trained on the Python standard library's own source files,
with real DDP on ``--world-size`` Gloo processes on this machine's CPU, once per method, from the same initial
weights on the same batches; on loopback, or with ``--rate`` each rank in its own network namespace behind an
emulated link of that rate (bench/emulated_network.py; needs root). Nothing is downloaded: the corpus is every
``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages left out), read as bytes (a byte-level
vocabulary of 256), so it differs between Python versions: the version is recorded in the output.

The split is a function of each file's path relative to the standard library alone (``sha256(path) mod 100 <
--val-percent``): the same files are held out on every machine with the same Python version, whatever the order
in which they are found. Each step, every rank trains on ``--batch-size`` windows of ``--seq-len`` + 1 bytes drawn
at random from the training files (one generator per step shared by the ranks, each rank its own windows; the same
for every method). Validation: the mean cross-entropy (nats per byte) on ``--val-windows`` fixed windows of the
held-out files, every ``--eval-every`` steps, split over the ranks, of the model the ranks share (for a local
method between its exchanges: the mean of the replicas, formed by an allreduce that no count includes).

Methods (``--methods``): the names of bench/harness/methods.py, DDP hooks (``ddp``, ``fp16``, ``powersgd-2``,
``gtopk-<d>``, ``recipe-<d>``, ``dgc-<d>``, ``dgc-pt-<d>``) and local methods (``sparse-<coll>-<d>-<H>[-compact]``,
``diloco-<H>``, ``postlocal-<H>``). ``recipe-<d>`` is the hook with momentum correction and warm-up as a user gets
it, ``gx.SparseGradState.recipe(density=d, warmup_steps=--dgc-warmup, momentum=--momentum)``; ``dgc-<d>`` and
``dgc-pt-<d>`` build the same kind of hook by hand from the ``--dgc-*`` flags (Nesterov off unless
``--dgc-nesterov``, per-tensor selection, clipping, the path policy), to vary what the recipe fixes.

For gtopk_ext's hook it also counts, after every compressed step, the elements of each parameter that the step
updated (the nonzeros of its reduced gradient), grouped as embeddings, LayerNorms, attention, MLP and the output
head: a share far below the density means a per-bucket threshold starves that group.

Every method's validation curve, training seconds (the slowest rank's time in its steps and exchanges, evaluation
left out), bytes sent (each method's own count; on emulated links also the rank's interface counter, TCP/IP
headers included) and the selection shares go to ``--json`` after every method (a run cut short keeps what
finished); the table is printed and the curves plotted (``--plot``).

    python -m bench.lm --json lm.json --plot lm.png     # the full configuration: 600 steps of 8 x 128 bytes per rank
    python -m bench.lm --steps 160 --seq-len 64 --eval-every 20 --json lm.json --plot lm.png   # docs/language_model.md
    python -m bench.lm --world-size 2 --steps 4 --methods ddp gtopk-0.01 --layers 1 --d-model 32   # seconds
    python -m bench.lm --steps 160 --seq-len 64 --eval-every 20 --rate 100mbit --methods ddp diloco-10 \
        sparse-gtopk-0.05-10-compact --json lm_100mbit.json --plot lm_100mbit.png      # as root
"""

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from bench.emulated_network import TxCounter, network_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import START_ITER, add_dgc_arguments, add_outer_arguments, label, method_name, numel_of
from bench.harness.train import Trainer, reduced, train_curve

DEFAULT_METHODS = ("ddp", "fp16", "powersgd-2", "gtopk-0.01", "gtopk-0.001", "recipe-0.01", "recipe-0.001",
                   "sparse-gtopk-0.05-10", "dgc-pt-0.001", "diloco-10")
GROUPS = ("embedding", "layernorm", "attention", "mlp", "head")


# ------------------------------------------------------------------------------------------------------ corpus

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Optional[Path] = None) -> list[str]:
    """The standard library's ``*.py`` files as sorted paths relative to ``root`` (installed packages left out)."""
    root = stdlib_root() if root is None else root
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                  if path.is_file() and not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts))


def is_validation(relative_path: str, val_percent: float) -> bool:
    """Whether a file is held out: a function of its relative path only."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 10_000 < 100 * val_percent


def split_files(files: list[str], val_percent: float) -> tuple[list[str], list[str]]:
    """(training files, validation files), each in the order of ``files``."""
    held_out = [f for f in files if is_validation(f, val_percent)]
    chosen = set(held_out)
    return [f for f in files if f not in chosen], held_out


def load_bytes(root: Path, files: list[str]) -> torch.Tensor:
    """The files' bytes, concatenated, each followed by a NUL byte (which no source file contains)."""
    data = b"".join(path.read_bytes() + b"\0" for path in (root / f for f in files))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length`` bytes of ``stream`` as token ids: [count, length] int64."""
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return stream[starts.unsqueeze(1) + torch.arange(length)].long()


# ------------------------------------------------------------------------------------------------------- model

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    seq_len: int = 128
    d_model: int = 256
    layers: int = 7
    heads: int = 4


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.heads
        self.ln_attention = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.attention_out = nn.Linear(config.d_model, config.d_model)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln_mlp(x))


class TransformerLM(nn.Module):
    """A decoder-only transformer over bytes: token and learned position embeddings, pre-LN blocks, a final
    LayerNorm and an untied output head."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.token_embedding = nn.Embedding(config.vocab, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.layers) if name.endswith(
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
    if "embedding" in name:
        return "embedding"
    if ".ln_" in name or name.startswith("ln_"):
        return "layernorm"
    if ".qkv." in name or ".attention_out." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "head"


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy (nats per byte) of ``batch`` [B, T + 1]."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# ------------------------------------------------------------------------------------------------- worker side

def updated_per_group(model: nn.Module, groups: list[str]) -> dict[str, int]:
    """Elements of each group that the last step's reduced gradient touched (its nonzeros)."""
    counts = dict.fromkeys(GROUPS, 0)
    for group, p in zip(groups, model.parameters()):
        counts[group] += int(torch.count_nonzero(p.grad))
    return counts


@torch.no_grad()
def validation_loss(model: nn.Module, val_batches: torch.Tensor, rank: int, world_size: int) -> dict:
    """Mean loss over every validation window, each rank evaluating its share (an allreduce of the sums)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in val_batches[rank::world_size].split(16):
        total += torch.tensor([float(lm_loss(model, batch)) * len(batch), len(batch)], dtype=torch.float64)
    model.train()
    total = reduced(total.tolist())
    return {"val_loss": float(total[0] / total[1])}


def run_method(name: str, rank: int, world_size: int, args: argparse.Namespace, train: torch.Tensor,
               val_batches: torch.Tensor, tx: TxCounter, progress) -> dict:
    config = model_config(args)
    trainer = Trainer(name, TransformerLM(config, args.seed), args, world_size)  # the same weights for all
    groups = [parameter_group(n) for n, _ in trainer.model.named_parameters()]
    hook = trainer.accounting.state if trainer.local is None else None  # gtopk_ext's hook state, where it runs
    # steps before the target density: the recipe's and the dgc methods' warm-up (the hooks with momentum in them)
    warmed_up = args.dgc_warmup if trainer.recipe is not None and trainer.recipe.momentum_in_hook else START_ITER
    selections = []

    def loss_at(step: int):  # one generator per step shared by the ranks: each draws the global batch, keeps its rows
        batch = windows(train, world_size * args.batch_size, config.seq_len + 1,
                        torch.Generator().manual_seed(args.seed * 1_000_003 + step))
        return lambda model: lm_loss(model, batch[rank * args.batch_size:(rank + 1) * args.batch_size])

    def count_updated(step: int) -> None:
        if hook is not None and step > warmed_up:
            selections.append(updated_per_group(trainer.model, groups))

    curve, measured = train_curve(trainer, args.steps, loss_at,
                                  lambda model: validation_loss(model, val_batches, rank, world_size),
                                  args.eval_every, tx, progress, count_updated)
    numels = dict.fromkeys(GROUPS, 0)
    for group, p in zip(groups, trainer.model.parameters()):
        numels[group] += p.numel()
    record = {"method": name, "label": label(name), "curve": curve,
              "train_loss": (reduced([m["loss"] for m in measured]) / world_size).tolist(),
              **{key: curve[-1][key] for key in ("seconds", "bytes_sent", "tx_bytes")},
              "final_val_loss": curve[-1]["val_loss"], "group_numel": numels,
              "load_average": os.getloadavg()}  # the machine's load while it ran
    if selections:
        record["updated_per_step"] = {g: sum(s[g] for s in selections) / len(selections) for g in GROUPS}
    return record


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(seq_len=args.seq_len, d_model=args.d_model, layers=args.layers, heads=args.heads)


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> None:
    """One rank: every method in turn; rank 0 writes the records after each."""
    args.json = Path(args.json) if args.json else None
    tx = TxCounter(config["ifname"])
    root = stdlib_root()
    train_files, val_files = split_files(corpus_files(root), args.val_percent)
    train, val = load_bytes(root, train_files), load_bytes(root, val_files)
    val_batches = windows(val, args.val_windows, args.seq_len + 1, torch.Generator().manual_seed(12345))
    progress = report.progress(args.steps * len(args.methods), rank, args, config)
    records = []
    for name in args.methods:
        if progress is not None:
            progress.set_description(name)
        records.append(run_method(name, rank, world_size, args, train, val_batches, tx, progress))
        if rank == 0:  # after every method: a run cut short keeps what finished
            measured = {"corpus": {"files": len(train_files) + len(val_files), "train_files": len(train_files),
                                   "val_files": len(val_files), "train_bytes": len(train), "val_bytes": len(val),
                                   "val_file_list": val_files},
                        "records": records}
            Path(config["out"]).write_text(json.dumps(measured))
            if args.json:
                write_report(args, measured)
    if progress is not None:
        progress.close()


# ------------------------------------------------------------------------------------------------- driver side

def summarize(records: list[dict]) -> list[dict]:
    ddp = next((r for r in records if r["method"] == "ddp"), None)
    rows = []
    for r in records:
        row = {"method": r["method"], "label": r["label"], "final_val_loss": r["final_val_loss"],
               "mb_sent": r["bytes_sent"] / 1e6, "tx_mb": r.get("tx_bytes", 0) / 1e6, "seconds": r["seconds"],
               "loss_vs_ddp": r["final_val_loss"] / ddp["final_val_loss"] if ddp else None,
               "bytes_vs_ddp": r["bytes_sent"] / ddp["bytes_sent"] if ddp else None}
        if "updated_per_step" in r:  # each group's share of its elements updated per step
            row["updated_share"] = {g: r["updated_per_step"][g] / r["group_numel"][g] for g in GROUPS}
        rows.append(row)
    return rows


COLUMNS = [("method", "", "label"), ("final val loss", ".4f", "final_val_loss"),
           ("vs DDP", "", lambda r: r["loss_vs_ddp"] and f"{r['loss_vs_ddp']:.3f}x"),
           ("MB sent / rank", ".1f", "mb_sent"),
           ("bytes vs DDP", "", lambda r: r["bytes_vs_ddp"] and f"1/{1 / r['bytes_vs_ddp']:.0f}"),
           ("link MB / rank", ".1f", lambda r: r["tx_mb"] or None),  # the interface counter: emulated links only
           ("seconds", ".0f", "seconds"),
           ("updated per step: " + ", ".join(GROUPS), "", lambda r: "updated_share" in r and ", ".join(
               f"{100 * r['updated_share'][g]:.2g}%" for g in GROUPS) or None)]


def setting(args: argparse.Namespace, parameters: int, corpus: dict) -> str:
    return (f"{args.world_size} ranks, Gloo on {network_name(args.rate)}, Python {platform.python_version()} stdlib "
            f"({corpus['train_files']} training files, {corpus['val_files']} held out), byte-level transformer "
            f"({parameters / 1e6:.2f}M parameters, d={args.d_model}, {args.layers} layers, {args.heads} heads), "
            f"sequence {args.seq_len}, batch {args.batch_size}/rank, {args.steps} steps, SGD lr {args.lr:g} "
            f"momentum {args.momentum:g}, seed {args.seed}")


def plot(records: list[dict], path: Path, title: str) -> None:
    """Validation loss against steps, training seconds and MB sent per rank, one line per method."""
    report.plot_curves(records, path, title, "validation loss (nats per byte)", lambda c: min(c["val_loss"], 6.0),
                       [("step", lambda c: c["step"], "linear"),
                        ("training seconds (slowest rank)", lambda c: c.get("seconds", math.nan), "linear"),
                        ("MB sent per rank", lambda c: c["bytes_sent"] / 1e6, "log")],
                       style=lambda i, r: {"color": "black", "linewidth": 2} if r["method"] == "ddp" else
                       {"color": f"C{i % 10}"})


def write_report(args: argparse.Namespace, measured: dict) -> list[dict]:
    """The JSON report of what ``measured`` holds; returns its table's rows."""
    rows = summarize(measured["records"])
    parameters = numel_of(TransformerLM(model_config(args)))
    # the corpus is this Python's standard library
    report.write_json(args.json, args, setting=setting(args, parameters, measured["corpus"]), parameters=parameters,
                      python=platform.python_version(), corpus=measured["corpus"], table=rows,
                      runs=measured["records"])
    return rows


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--methods", nargs="+", type=method_name, default=list(DEFAULT_METHODS))
    cli.add_common(parser, world_size=4, steps=600, eval_every=50, batch_size=8, lr=0.1, momentum=0.9, seed=0,
                   json=None, plot=None, no_progress=False)  # --eval-every: a multiple of every local method's H
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--heads", type=int, default=4)
    add_dgc_arguments(parser)
    add_outer_arguments(parser)
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's (default: its own, 25)")
    parser.add_argument("--val-percent", type=float, default=5.0, help="share of the files held out")
    parser.add_argument("--val-windows", type=int, default=128, help="validation windows of --seq-len bytes")
    cli.add_network_args(parser, prefix="gxlm", rate=None, timeout=4 * 3600.0,
                         timeout_help="Gloo's timeout and the whole run's, seconds")
    parser.add_argument("--merge", type=Path, nargs="+",
                        help="run nothing: the table, --json and --plot of these reports' methods together (reports "
                             "of one configuration, written by parts of --methods)")
    args = parser.parse_args(argv)
    cli.check_positive(parser, args, "world_size", "steps", "eval_every", "batch_size", "seq_len", "d_model", "layers",
                       "heads", "val_windows")
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not 0 < args.val_percent < 100:
        parser.error(f"--val-percent must be in (0, 100), got {args.val_percent}")
    args.methods = list(dict.fromkeys(args.methods))
    return args


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "timeout"):
        return 0
    if args.merge:
        args, measured = merged(args)
        return present(args, measured)
    args.rate = cli.link_rate("bench.lm", args)
    args.json = args.json.resolve() if args.json else None  # the ranks run in the repository's root
    measured = run_group("bench.lm", args.world_size, args, args.timeout, rate_bps=args.rate, prefix=args.prefix)
    return present(args, measured)


# What makes two reports one experiment (--merge): everything but the methods and how they were run.
CONFIGURATION = ("world_size", "steps", "eval_every", "batch_size", "seq_len", "d_model", "layers", "heads", "lr",
                 "momentum", "outer_lr", "outer_momentum", "outer_nesterov", "error_decay", "bucket_cap_mb",
                 "val_percent", "val_windows", "seed", "rate")


def merged(args: argparse.Namespace) -> tuple[argparse.Namespace, dict]:
    """The settings and records of the reports ``args.merge`` names, which must share one configuration."""
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
    settings = argparse.Namespace(**{"rate": None, **first, "methods": names, "json": args.json, "plot": args.plot})
    return settings, {"records": records, "corpus": reports[0]["corpus"]}


def present(args: argparse.Namespace, measured: dict) -> int:
    """Prints the table; writes --json and --plot."""
    records, corpus = measured["records"], measured["corpus"]
    parameters = numel_of(TransformerLM(model_config(args)))
    title = setting(args, parameters, corpus)
    print(f"\n{title}\n")
    rows = summarize(records) if args.json is None else write_report(args, measured)
    print(report.table(rows, COLUMNS, markdown=True))
    if args.plot:
        plot(records, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
