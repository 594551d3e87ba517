"""A language model: a byte-level decoder-only transformer trained on this Python's standard library (nothing
downloaded; the held-out files are a function of their paths), with real DDP on Gloo processes, once per method from
the same weights on the same batches, on loopback or emulated links (as root). docs/language_model.md.

    python -m bench.lm --world-size 2 --steps 4 --methods ddp gtopk-0.01 --layers 1 --d-model 32   # seconds

By default every method trains as transformers train: AdamW, a warm-up then a cosine, clipping at 1.0;
``--optimizer sgd`` the earlier measurements' SGD (its default methods and learning rate).
"""

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
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
from bench.harness.methods import (START_ITER, add_dgc_arguments, add_outer_arguments, method, method_name, numel_of,
                                   optimizer_conflict)
from bench.harness.regime import (CALIBRATION_STEPS, Regime, add_regime_args, check_regime_args, floor_seconds,
                                  link_rate, measured_ratio, probe_steps, seconds_for, steady_seconds)
from bench.harness.train import Trainer, reduced, slowest_rank, train_curve

# Per --optimizer: the methods by default (no momentum-correcting hook under AdamW) and the defaults of the flags
# left None. AdamW's: nanoGPT's betas, decay and clipping; the learning rate tuned for DDP (docs/language_model.md).
DEFAULT_METHODS = {"adamw": ("ddp", "fp16", "bf16", "powersgd-4", "gtopk-0.01", "gtopk-0.001", "floor"),
                   "sgd": ("ddp", "fp16", "powersgd-2", "gtopk-0.01", "gtopk-0.001", "recipe-0.01", "recipe-0.001",
                           "sparse-gtopk-0.05-10", "dgc-pt-0.001", "diloco-10")}
OPTIMIZER_DEFAULTS = {"adamw": {"lr": 2e-3, "weight_decay": 0.1, "lr_warmup": 50, "min_lr_ratio": 0.1,
                                "clip_norm": 1.0},
                      "sgd": {"lr": 0.1, "weight_decay": 0.0, "lr_warmup": 0, "min_lr_ratio": 1.0, "clip_norm": 0.0}}
GROUPS = ("embedding", "layernorm", "attention", "mlp", "head")
# What makes two reports one experiment (--merge): everything but the methods, the seed and how they were run (the
# steps: a learning rate's schedule ends at --lr-decay-steps, --steps by default).
CONFIGURATION = ("model", "world_size", "eval_every", "batch_size", "seq_len", "d_model", "layers", "heads", "lr",
                 "momentum", "nesterov", "outer_lr", "outer_momentum", "outer_nesterov", "error_decay", "bucket_cap_mb",
                 "val_percent", "val_windows", "rate", "optimizer", "betas", "weight_decay", "lr_warmup",
                 "lr_decay_steps", "min_lr_ratio", "clip_norm")
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


class HuggingFaceGPT2(nn.Module):
    """Hugging Face ``transformers``' GPT2LMHeadModel of the same shape over bytes, as a user builds it: its default
    configuration otherwise (tied input and output embeddings, dropout 0.1, its initialisation); returns the logits."""

    def __init__(self, args: argparse.Namespace, seed: int = 0):
        super().__init__()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as error:
            raise SystemExit("--model gpt2 needs Hugging Face transformers: pip install transformers") from error
        torch.manual_seed(seed)
        self.gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.d_model,
                                               n_layer=args.layers, n_head=args.heads, bos_token_id=None,
                                               eos_token_id=None))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=tokens).logits


MODELS = {"transformer": TransformerLM, "gpt2": HuggingFaceGPT2}


def build_model(args: argparse.Namespace, seed: int = 0) -> nn.Module:
    """--model's, with --seq-len, --d-model, --layers and --heads."""
    return MODELS[args.model](args, seed)


def parameter_group(name: str) -> str:
    """Which of GROUPS a parameter of TransformerLM or HuggingFaceGPT2 belongs to."""
    return next((group for group, keys in (("embedding", ("embedding", ".wte.", ".wpe.")),
                                           ("layernorm", (".ln_", "ln_final")),
                                           ("attention", (".qkv.", ".attention_out.", ".attn.")),
                                           ("mlp", (".mlp.",)))
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
    trainer = Trainer(name, build_model(args, args.seed), args, world_size)  # the same weights for all
    groups = [parameter_group(n) for n, _ in trainer.model.named_parameters()]
    # steps before the target density: the SGD recipe's and the dgc methods' warm-up (the hooks with momentum in them)
    warmed_up = START_ITER
    if trainer.recipe is not None and trainer.recipe.momentum_in_hook:
        warmed_up = args.dgc_warmup
    period = trainer.local.method.period if trainer.local is not None else None
    # --steps-from: only as long as its steady step time takes to measure
    steps = probe_steps(warmed_up, period) if args.steps_from else args.steps
    updated = []  # after each compressed step of gtopk_ext's hook: each group's elements its reduced gradient touched

    def loss_at(step: int):
        return partial(lm_loss, batch=batch_at(train, step, rank, world_size, args))

    def count_updated(step: int) -> None:
        if trainer.local is None and trainer.accounting.state is not None and step > warmed_up:
            updated.append([(g, int(torch.count_nonzero(p.grad))) for g, p in zip(groups, trainer.model.parameters())])

    def stop(point: dict) -> bool:  # the race: at the target, or out of time
        return ((args.target_loss is not None and point["val_loss"] <= args.target_loss)
                or (args.budget is not None and point["seconds"] >= args.budget))

    curve, measured = train_curve(trainer, steps, loss_at,
                                  lambda model: validation_loss(model, val_batches, rank, world_size),
                                  args.eval_every, tx, progress, count_updated, stop)
    record = {"method": name, "label": method(name).label, "seed": args.seed, "curve": curve, "period": period,
              "train_loss": (reduced([m["loss"] for m in measured]) / world_size).tolist(),
              # the steps alone: the final exchange that leaves one model (an overlapped one's) is not a step's
              "step_seconds": slowest_rank([m["seconds"] - m["finish_seconds"] for m in measured]),
              "steady_from": period if trainer.local is not None and trainer.local.method.overlap else 0,
              **{key: curve[-1][key] for key in ("seconds", "bytes_sent", "tx_bytes")},
              "final_val_loss": curve[-1]["val_loss"],
              "group_numel": {g: sum(p.numel() for h, p in zip(groups, trainer.model.parameters()) if h == g)
                              for g in GROUPS},
              "load_average": os.getloadavg()}  # the machine's load while it ran
    if args.clip_norm:  # the norm before clipping: the ranks' mean (theirs differ under a local method)
        record["grad_norm"] = (reduced([m["grad_norm"] for m in measured]) / world_size).tolist()
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


def summarize(records: list[dict], target: Optional[float] = None, horizon: Optional[int] = None) -> list[dict]:
    """A row per record (per method and seed), against DDP's of its seed: with ``target``, when the record first
    reached it; with ``horizon`` (the schedule's last step), its validation loss there (None: it stopped before)."""
    ddp = {r.get("seed"): r for r in records if r["method"] == "ddp"}
    rows = []
    for r in records:
        base = ddp.get(r.get("seed"))
        rows.append({
            "method": r["method"], "label": r["label"], "seed": r.get("seed"), "final_val_loss": r["final_val_loss"],
            "steps": r["curve"][-1]["step"],
            **(report.to_target([r["curve"]], lambda point: point["val_loss"] <= target, "seconds", "bytes_sent")
               if target is not None else {}),
            **({"horizon_val_loss": next((c["val_loss"] for c in r["curve"] if c["step"] == horizon), None)}
               if horizon is not None else {}),
            "mb_sent": r["bytes_sent"] / 1e6, "tx_mb": r.get("tx_bytes", 0) / 1e6, "seconds": r["seconds"],
            "ms_per_step": 1e3 * statistics.median(r["step_seconds"]) if r.get("step_seconds") else None,
            "loss_vs_ddp": r["final_val_loss"] / base["final_val_loss"] if base else None,
            "bytes_vs_ddp": r["bytes_sent"] / base["bytes_sent"] if base else None,
            **({"updated_share": {g: r["updated_per_step"][g] / r["group_numel"][g] if r["group_numel"][g] else None
                                   for g in GROUPS}}
               if "updated_per_step" in r else {})})
    return rows


def mean_or_none(values: list) -> Optional[float]:
    return None if not values or None in values else statistics.mean(values)


def across_seeds(rows: list[dict]) -> list[dict]:
    """A row per method of ``summarize``'s rows of several seeds: its seeds' rows ("per_seed", by seed) and the means
    over them (None where a seed has none: steps and bytes to the target where it did not reach it), MB per rank and
    step, and the ratios to DDP's."""
    out = []
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["seed"])
        out.append({"method": name, "label": mine[0]["label"], "per_seed": mine,
                    **{key: mean_or_none([r.get(key) for r in mine])
                       for key in ("steps_to_target", "bytes_to_target", "horizon_val_loss", "ms_per_step")},
                    "final_val_loss": statistics.mean(r["final_val_loss"] for r in mine),
                    "mb_per_step": statistics.mean(r["mb_sent"] / r["steps"] for r in mine)})
    ddp = next((row for row in out if row["method"] == "ddp"), None)
    for row in out:
        row["bytes_to_target_vs_ddp"] = (row["bytes_to_target"] / ddp["bytes_to_target"]
                                         if ddp and ddp["bytes_to_target"] and row["bytes_to_target"] is not None
                                         else None)
        row["bytes_vs_ddp"] = row["mb_per_step"] / ddp["mb_per_step"] if ddp else None
    return out


def fraction(ratio: Optional[float]) -> Optional[str]:
    """A ratio to DDP's as a share: 1/2, 1/37; 0 for nothing."""
    if ratio is None or ratio == 0 or ratio >= 1:
        return None if ratio is None else f"{ratio:.2g}"
    return f"1/{1 / ratio:.0f}" if ratio <= 0.1 else f"1/{1 / ratio:.2g}"


# The race's columns first (with --target-loss): seconds, steps and MB per rank to the target, "-" where not reached.
RACE_COLUMNS = [(f"{what} to target", form, key) for what, key, form in (
    ("s", "seconds_to_target", ".1f"), ("steps", "steps_to_target", "g"))] + [
    ("MB / rank to target", ".1f", lambda r: r["bytes_to_target"] and r["bytes_to_target"] / 1e6)]
COLUMNS = [("method", "", "label"), ("steps", "", "steps"), ("final val loss", ".4f", "final_val_loss"),
           ("vs DDP", "", lambda r: r["loss_vs_ddp"] and f"{r['loss_vs_ddp']:.3f}x"),
           ("MB sent / rank", ".1f", "mb_sent"),
           ("bytes vs DDP", "", lambda r: r["bytes_vs_ddp"] and f"1/{1 / r['bytes_vs_ddp']:.0f}"),
           ("link MB / rank", ".1f", lambda r: r["tx_mb"] or None),  # the interface counter: emulated links only
           ("seconds", ".0f", "seconds"),
           ("updated per step: " + ", ".join(GROUPS), "", lambda r: "updated_share" in r and ", ".join(
               "-" if r["updated_share"][g] is None else f"{100 * r['updated_share'][g]:.2g}%" for g in GROUPS)
                                                                    or None)]


def per_seed(key: str, form: str, missing):
    """A column of each seed's ``key``, "a / b"; ``missing(row)`` where it is None."""
    return lambda row: " / ".join(missing(r) if r.get(key) is None else format(r[key], form) for r in row["per_seed"])


def seeds_columns(horizon: int, target: bool) -> list[tuple]:
    """The columns of ``across_seeds``' rows (with ``target``, the race's first): a seed that did not reach the target
    shows the steps it ran (">750"), the loss at ``horizon`` "-" for a seed that stopped before it (at the target)."""
    return [("method", "", "label")] + [
        ("steps to target, per seed", "", per_seed("steps_to_target", "g", lambda r: f">{r['steps']}")),
        ("mean", "g", "steps_to_target"),
        ("MB / rank to target", ".0f", lambda row: row["bytes_to_target"] and row["bytes_to_target"] / 1e6),
        ("vs DDP", "", lambda row: fraction(row["bytes_to_target_vs_ddp"]))] * target + [
            (f"val loss at step {horizon}, per seed", "", per_seed("horizon_val_loss", ".4f", lambda r: "-")),
            ("mean", ".4f", "horizon_val_loss"),
            ("MB / rank / step", ".2f", "mb_per_step"), ("bytes vs DDP", "", lambda row: fraction(row["bytes_vs_ddp"])),
            ("ms / step", ".0f", "ms_per_step")]


def race_rows(probes: list[dict], references: list[dict], target: float, regime: Regime) -> list[dict]:
    """The race at ``regime``: a row per method timed there (``probes``, this run's records; the floor left out)
    with its steps to ``target`` in each seed's full run (``references``), its steady step time at the regime, its
    seconds to the target (estimated: regime.seconds_for), MB per rank to it, and its seconds over the best peer's
    and over the ideal's (the floor's step x DDP's steps)."""
    rows = []
    for probe in (p for p in probes if p["method"] != "floor"):
        runs = sorted((r for r in references if r["method"] == probe["method"]), key=lambda r: r["seed"])
        if not runs:
            raise SystemExit(f"--steps-from: no full run of {probe['method']} in the reports")
        reached = [report.to_target([r["curve"]], lambda point: point["val_loss"] <= target, "seconds", "bytes_sent")
                   for r in runs]
        steps = [found["steps_to_target"] for found in reached]
        timing = (probe["step_seconds"], probe["period"], probe.get("steady_from", 0))
        rows.append({"method": probe["method"], "label": probe["label"], "peer": method(probe["method"]).peer,
                     "per_seed": [{"seed": r["seed"], "steps": r["curve"][-1]["step"], "steps_to_target": n}
                                  for r, n in zip(runs, steps)],
                     "steps_to_target": mean_or_none(steps),
                     "ms_per_step": 1e3 * steady_seconds(*timing),
                     "seconds_to_target": mean_or_none([n and seconds_for(n, *timing) for n in steps]),
                     "mb_to_target": mean_or_none([found["bytes_to_target"] and found["bytes_to_target"] / 1e6
                                                   for found in reached]),
                     "step_seconds": probe["step_seconds"], "period": probe["period"], "steady_from": timing[2]})
    ddp = next((row for row in rows if row["method"] == "ddp"), None)
    ideal = regime.floor_seconds * ddp["steps_to_target"] if ddp and ddp["steps_to_target"] else None
    best = min((row["seconds_to_target"] for row in rows if row["peer"] and row["seconds_to_target"]), default=None)
    for row in rows:
        row["vs_best_peer"] = row["seconds_to_target"] and best and row["seconds_to_target"] / best
        row["vs_ideal"] = row["seconds_to_target"] and ideal and row["seconds_to_target"] / ideal
    return rows


RACE_AT_REGIME_COLUMNS = [
    ("method", "", "label"),
    ("steps to target, per seed", "", per_seed("steps_to_target", "g", lambda r: f">{r['steps']}")),
    ("mean", "g", "steps_to_target"), ("ms / step", ".0f", "ms_per_step"),
    ("s to target (estimated)", ".0f", "seconds_to_target"),
    ("vs best peer", "", lambda r: r["vs_best_peer"] and f"{r['vs_best_peer']:.2f}x"),
    ("vs ideal", "", lambda r: r["vs_ideal"] and f"{r['vs_ideal']:.2f}x"),
    ("MB / rank to target", ".0f", "mb_to_target")]


def describe_optimizer(args: argparse.Namespace) -> str:
    if args.optimizer == "sgd":
        return f"SGD lr {args.lr:g} momentum {args.momentum:g}"
    return (f"AdamW lr {args.lr:g} betas {args.betas[0]:g}/{args.betas[1]:g}, weight decay {args.weight_decay:g} on "
            f"the matrices, {args.lr_warmup} warm-up steps then cosine to {args.min_lr_ratio:g}x at step "
            f"{args.lr_decay_steps}, clipping at {args.clip_norm:g}")


def setting(args: argparse.Namespace, corpus: dict) -> str:
    seeds = args.seed if isinstance(args.seed, list) else [args.seed]
    return (f"{args.world_size} ranks, Gloo on {network_name(args.rate)}, Python {platform.python_version()} stdlib "
            f"({corpus['train_files']} training files, {corpus['val_files']} held out), byte-level "
            f"{'Hugging Face GPT-2' if args.model == 'gpt2' else 'transformer'} "
            f"({numel_of(build_model(args)) / 1e6:.2f}M parameters, d={args.d_model}, {args.layers} "
            f"layers, {args.heads} heads), sequence {args.seq_len}, batch {args.batch_size}/rank, {args.steps} steps, "
            f"{describe_optimizer(args)}, seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"
            + (f", regime R = {args.regime:g} (floor {args.floor_ms:.0f} ms)" if getattr(args, "regime", None) else ""))


def seeds_of(records: list[dict]) -> list:
    return sorted({r["seed"] for r in records})


def tables(args: argparse.Namespace, records: list[dict]) -> dict:
    """The rows of the report's tables: "table" (a row per record), and over several seeds "seeds_table"."""
    rows = summarize(records, args.target_loss, args.lr_decay_steps)
    return {"table": rows, **({"seeds_table": across_seeds(rows)} if len(seeds_of(records)) > 1 else {})}


def write_report(args: argparse.Namespace, corpus: dict, records: list[dict]) -> None:
    """The JSON report, where --json asks for one (the corpus is this Python's standard library)."""
    if args.json:
        report.write_json(args.json, args, setting=setting(args, corpus), parameters=numel_of(build_model(args)),
                          python=platform.python_version(), corpus=corpus, **tables(args, records), runs=records)


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    # --eval-every: a multiple of every local method's H
    parser = cli.parser(__doc__, world_size=4, steps=500, eval_every=20, batch_size=8, lr=None, momentum=0.9, seed=0,
                        nesterov=False, json=None, plot=None, no_progress=False)
    cli.add_optimizer_args(parser, OPTIMIZER_DEFAULTS, "adamw")
    parser.add_argument("--methods", nargs="+", type=method_name, default=None,
                        help=f"default: with AdamW {' '.join(DEFAULT_METHODS['adamw'])}; with SGD "
                             f"{' '.join(DEFAULT_METHODS['sgd'])}")
    parser.add_argument("--model", choices=tuple(MODELS), default="transformer",
                        help="the byte-level model: this benchmark's transformer, or Hugging Face's GPT2LMHeadModel "
                             "(needs transformers; tied embeddings, dropout 0.1) of the same shape")
    for flag, default in (("--seq-len", 64), ("--d-model", 256), ("--layers", 7), ("--heads", 4)):
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
    add_regime_args(parser)
    parser.add_argument("--steps-from", type=Path, nargs="+",
                        help="with --regime and --target-loss: the race there from these full runs' reports (one "
                             "configuration, any link): each method trains only as long as its step time at the "
                             "regime takes to measure (its warm-up and 20 steps, or whole periods), and its seconds "
                             "to the target are its steps to it in each seed's full run at that step time")
    parser.add_argument("--timed-from", type=Path, nargs="+",
                        help="with --steps-from: run nothing, the step times and regime of these earlier --steps-from "
                             "runs' --json (one regime; a method timed in several: the last one's), with other or "
                             "more full runs")
    parser.add_argument("--merge", type=Path, nargs="+",
                        help="run nothing: the table, --json and --plot of these reports' methods together (reports "
                             "of one configuration, written by parts of --methods or with other seeds: then a table "
                             "across the seeds too)")
    args = parser.parse_args(argv)
    cli.check(parser, args, positive=("world_size", "steps", "eval_every", "batch_size", "seq_len", "d_model",
                                      "layers", "heads", "val_windows"))
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not 0 < args.val_percent < 100:
        parser.error(f"--val-percent must be in (0, 100), got {args.val_percent}")
    check_regime_args(parser, args)
    if args.steps_from and args.target_loss is None or args.timed_from and not args.steps_from:
        parser.error("--steps-from needs --target-loss; --timed-from needs --steps-from")
    if args.steps_from and (args.regime is None) == (args.timed_from is None):
        parser.error("--steps-from needs --regime (time the methods now) or --timed-from (as timed before)")
    cli.fill_optimizer_defaults(parser, args, OPTIMIZER_DEFAULTS)
    args.lr_decay_steps = args.lr_decay_steps or args.steps
    args.methods = list(dict.fromkeys(args.methods or DEFAULT_METHODS[args.optimizer]))
    for name in args.methods:
        if optimizer_conflict(name, args.optimizer):
            parser.error(f"--methods: {optimizer_conflict(name, args.optimizer)}")
    return args


def settings_of(report_: dict) -> dict:
    """A report's settings, with what the reports from before a flag ran with: loopback (--rate), SGD without a
    schedule (--optimizer)."""
    old = {"model": "transformer", "rate": None, "regime": None, "target_loss": None, "budget": None,
           "optimizer": "sgd", "betas": [0.9, 0.95], **OPTIMIZER_DEFAULTS["sgd"],
           "lr_decay_steps": report_["settings"]["steps"]}
    return {**old, **report_["settings"]}


def load_reports(paths: list[Path], flag: str, ignore=()) -> tuple[list[dict], list[dict]]:
    """The reports at ``paths`` and their records (a method once per seed), which must share one configuration
    (CONFIGURATION but ``ignore``); ``flag`` names the option in the errors."""
    reports = [json.loads(path.read_text()) for path in paths]
    first = settings_of(reports[0])
    for path, other in zip(paths[1:], reports[1:]):
        differ = [key for key in CONFIGURATION if key not in ignore and settings_of(other).get(key) != first.get(key)]
        if differ:
            raise SystemExit(f"{flag}: {path} differs from {paths[0]} in {differ}: not one experiment")
    records = [{"seed": r["settings"]["seed"], **record} for r in reports for record in r["runs"]]  # older: no seed
    runs = [(record["method"], record["seed"]) for record in records]
    if len(set(runs)) != len(runs):
        raise SystemExit(f"{flag}: a method appears more than once with one seed: {runs}")
    return reports, records


def merged(args: argparse.Namespace) -> tuple[argparse.Namespace, dict, list[dict]]:
    """The settings, corpus and records of the reports ``args.merge`` names (:func:`load_reports`; "seed" of the
    settings: the list of the seeds where there are several)."""
    reports, records = load_reports(args.merge, "--merge")
    first = settings_of(reports[0])
    seeds = seeds_of(records)
    settings = argparse.Namespace(**{**first, "methods": list(dict.fromkeys(r["method"] for r in records)),
                                     "seed": seeds if len(seeds) > 1 else seeds[0],
                                     "steps": max(r["settings"]["steps"] for r in reports),
                                     "json": args.json, "plot": args.plot,
                                     **({"target_loss": args.target_loss} if args.target_loss is not None else {})})
    return settings, reports[0]["corpus"], records


def measure_floor(args: argparse.Namespace) -> float:
    """The compute floor's step here (seconds): the floor method for CALIBRATION_STEPS steps on loopback."""
    settings = argparse.Namespace(**{**vars(args), "methods": ["floor"], "steps": CALIBRATION_STEPS, "json": None,
                                     "eval_every": CALIBRATION_STEPS, "target_loss": None, "budget": None,
                                     "steps_from": None, "no_progress": True})
    measured = run_group("bench.lm", args.world_size, settings, args.timeout, prefix=args.prefix)
    return floor_seconds(measured["records"][0]["step_seconds"])


OUTER = ("outer_lr", "outer_momentum", "outer_nesterov", "error_decay")


def outer_step(settings: dict) -> str:
    """A report's outer step of DiLoCo and SparseLocalSGD, in words."""
    momentum = settings["outer_momentum"]
    return (f"outer lr {settings['outer_lr']:g}"
            + (f", {'Nesterov ' * settings['outer_nesterov']}momentum {momentum:g}" if momentum else "")
            + (f", error decay {settings['error_decay']:g}" if settings.get("error_decay", 1.0) != 1.0 else ""))


def curve_style(records: list[dict]):
    """A plot_curves style: a colour per method (DDP black), a line style per seed."""
    seeds, methods = seeds_of(records), list(dict.fromkeys(r["method"] for r in records))
    return lambda i, r: {"linestyle": ("-", "--", ":", "-.")[seeds.index(r["seed"]) % 4],
                         **({"color": "black", "linewidth": 2} if r["method"] == "ddp" else
                            {"color": f"C{methods.index(r['method']) % 10}"})}


def race_at_regime(args: argparse.Namespace, regime: Regime, corpus: dict, probes: list[dict]) -> None:
    """--steps-from's table, --json and --plot (validation loss against the estimated seconds)."""
    # what changes no step's time: the link, the evaluations, and the steps and outer step of each method's own run
    ignore = ("rate", "eval_every", "lr_decay_steps", *OUTER)
    reports, references = load_reports(args.steps_from, "--steps-from", ignore)
    differ = [key for key in CONFIGURATION if key not in ignore and settings_of(reports[0]).get(key) != vars(args)[key]]
    if differ:
        raise SystemExit(f"--steps-from: {args.steps_from[0]} differs from the timed run in {differ}")
    rows = race_rows(probes, references, args.target_loss, regime)
    args.steps, args.seed = max(r["settings"]["steps"] for r in reports), seeds_of(references)  # the full runs'
    for row in (row for row in rows if getattr(method(row["method"]), "kind", None) in ("diloco", "sparse")):
        row["label"] += "; " + " / ".join(sorted({outer_step(settings_of(r)) for r in reports  # as its runs had it
                                                  if any(run["method"] == row["method"] for run in r["runs"])}))
    title = f"{setting(args, corpus)}; to a validation loss of {args.target_loss:g}"
    ddp = next((row for row in rows if row["method"] == "ddp"), None)
    print(f"\n{title}\n{regime.describe()}"
          + (f"\n{measured_ratio(ddp['ms_per_step'] / 1e3, regime.floor_seconds)}" if ddp else "")
          + f"\n\n{report.table(rows, RACE_AT_REGIME_COLUMNS, markdown=True)}")
    if args.json:
        report.write_json(args.json, args, setting=title, regime=regime.describe(), corpus=corpus, race=rows,
                          runs=probes)
    if args.plot:
        timed = {row["method"]: row for row in rows}
        curves = [{**r, "label": f"{r['label']}, seed {r['seed']}", "curve": [
            {**point, "seconds": seconds_for(point["step"], timed[r["method"]]["step_seconds"],
                                             timed[r["method"]]["period"], timed[r["method"]]["steady_from"])}
            for point in r["curve"]]} for r in references if r["method"] in timed]
        report.plot_curves(curves, args.plot, title, "validation loss (nats per byte)", lambda c: min(c["val_loss"], 4),
                           [("seconds at R = {:g} (estimated)".format(args.regime), lambda c: c["seconds"], "log")],
                           style=curve_style(references))


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "timeout"):
        return 0
    if args.merge:
        args, corpus, records = merged(args)
        write_report(args, corpus, records)
    elif args.timed_from:
        timed = [json.loads(path.read_text()) for path in args.timed_from]
        for key in (*CONFIGURATION, "regime", "floor_ms"):  # the timed runs' configuration, regime and link
            if len({json.dumps(t["settings"][key]) for t in timed}) > 1:
                raise SystemExit(f"--timed-from: the runs differ in {key}: not one regime")
            setattr(args, key, timed[0]["settings"][key])
        regime = Regime.of(args.regime, args.floor_ms / 1e3, numel_of(build_model(args)), args.world_size)
        probes = {r["method"]: r for t in timed for r in t["runs"]}
        race_at_regime(args, regime, timed[0]["corpus"], list(probes.values()))
        return 0
    else:
        args.rate, regime = link_rate(args, "bench.lm", numel_of(build_model(args)), lambda: measure_floor(args))
        args.json = args.json.resolve() if args.json else None  # the ranks run in the repository's root
        # the probes run their steps whatever the loss (no stop at the target); their report is race_at_regime's
        settings = ({**vars(args), "json": None, "target_loss": None, "budget": None,
                     "steps_from": list(map(str, args.steps_from))} if args.steps_from else args)
        measured = run_group("bench.lm", args.world_size, settings, args.timeout, rate_bps=args.rate,
                             prefix=args.prefix)
        corpus, records = measured["corpus"], measured["records"]
        if args.steps_from:
            if args.json:  # the step times first: for --timed-from, whatever the table's fate
                report.write_json(args.json, args, regime=regime.describe(), corpus=corpus, runs=records)
            race_at_regime(args, regime, corpus, records)
            return 0
    title = setting(args, corpus)
    print(f"\n{title}\n")
    found = tables(args, records)
    columns = (RACE_COLUMNS if args.target_loss is not None else []) + COLUMNS
    print(report.table(found["table"], columns, markdown=True))
    if "seeds_table" in found:
        print(f"\nOver seeds {', '.join(map(str, args.seed))}"
              + (f", to a validation loss of {args.target_loss:g}:\n" if args.target_loss is not None else ":\n"))
        print(report.table(found["seeds_table"], seeds_columns(args.lr_decay_steps, args.target_loss is not None),
                           markdown=True))
    if args.plot:  # validation loss against steps, training seconds and MB sent per rank; each step's time apart
        seeds = seeds_of(records)
        shown = [{**r, "label": r["label"] + f", seed {r['seed']}" * (len(seeds) > 1)} for r in records]
        report.plot_curves(shown, args.plot, title, "validation loss (nats per byte)",
                           lambda c: min(c["val_loss"], 6.0),
                           [("step", lambda c: c["step"], "linear"),
                            ("training seconds (slowest rank)", lambda c: c.get("seconds", math.nan), "linear"),
                            ("MB sent per rank", lambda c: c["bytes_sent"] / 1e6, "log")],
                           style=curve_style(records))
        timed = [{**r, "curve": [{"step": i + 1, "ms": 1e3 * t} for i, t in enumerate(r["step_seconds"])]}
                 for r in records if "step_seconds" in r]
        report.plot_curves(timed, args.plot.with_name(f"{args.plot.stem}_steps.png"), title,
                           "ms per step (slowest rank)", lambda c: c["ms"], [("step", lambda c: c["step"], "linear")],
                           yscale="log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
