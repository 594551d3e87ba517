"""The language-model benchmark is not a test; this keeps it from rotting: its corpus split is a deterministic
function of the paths, a tiny run (2 Gloo processes, a few steps, a one-layer model) writes a sane report, under SGD
(the earlier measurements) and AdamW (the default), and the harness's AdamW, schedule and clipping do what they
say."""

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lm import corpus_files, is_validation, split_files  # noqa: E402

TINY = ["--world-size", "2", "--eval-every", "2", "--layers", "1", "--d-model", "32", "--seq-len", "16",
        "--batch-size", "4", "--val-windows", "8", "--no-progress"]


def run_lm(*flags: str) -> str:
    """``python -m bench.lm`` with ``flags``: its output; fails the test where it fails."""
    result = subprocess.run([sys.executable, "-m", "bench.lm", *flags], cwd=ROOT, timeout=300, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_split_depends_on_the_paths_alone():
    files = corpus_files()
    assert len(files) > 100 and files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    train, held_out = split_files(files, 5.0)
    shuffled = files[:]
    random.Random(0).shuffle(shuffled)
    train_again, held_out_again = split_files(shuffled, 5.0)
    assert sorted(held_out_again) == held_out and sorted(train_again) == train  # order of discovery is irrelevant
    assert not set(train) & set(held_out) and len(train) + len(held_out) == len(files)
    assert 0.02 < len(held_out) / len(files) < 0.08  # about 5%
    # a file's side follows from its path alone, whatever else the corpus holds
    assert split_files(held_out[:3] + train[:3], 5.0) == (train[:3], held_out[:3])
    assert is_validation(held_out[0], 5.0) and not is_validation(train[0], 5.0)


def test_tiny_run_writes_a_sane_report(tmp_path):
    methods = ["ddp", "gtopk-0.01", "recipe-0.01", "sparse-gtopk-0.1-2", "sparse-gtopk-0.1-2-compact", "postlocal-3",
               "sparseloco-0.0625-2", "sparseloco-0.0625-2-plain"]
    out = run_lm(*TINY, "--optimizer", "sgd", "--steps", "4", "--dgc-warmup", "2", "--methods", *methods,
                 "--json", str(tmp_path / "lm.json"))
    assert "final val loss" in out and "SGD lr 0.1 momentum 0.9" in out

    report = json.loads((tmp_path / "lm.json").read_text())
    assert report["python"] == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    assert report["corpus"]["val_file_list"] == split_files(corpus_files(), 5.0)[1]
    runs = {r["method"]: r for r in report["runs"]}
    assert list(runs) == methods
    for run in runs.values():
        assert [c["step"] for c in run["curve"]] == [0, 2, 4]
        losses = [c["val_loss"] for c in run["curve"]]
        assert all(math.isfinite(v) and 0 < v < 8 for v in losses)
        for before, after in zip(run["curve"], run["curve"][1:]):  # counted as the run goes
            assert before["seconds"] <= after["seconds"] and before["bytes_sent"] <= after["bytes_sent"]
        assert losses[0] == runs["ddp"]["curve"][0]["val_loss"]  # the same initial weights for every method
    # four steps of DDP learn something about bytes (ln 256 = 5.55 at the start)
    assert runs["ddp"]["curve"][-1]["val_loss"] < runs["ddp"]["curve"][0]["val_loss"]
    table = {row["method"]: row for row in report["table"]}
    assert table["ddp"]["loss_vs_ddp"] == 1.0
    assert 0 < table["gtopk-0.01"]["bytes_vs_ddp"] < 1 and 0 < table["sparse-gtopk-0.1-2"]["bytes_vs_ddp"] < 0.2
    # the compact wire: 4 bytes a pair instead of 8 (plus a few words per message)
    assert 0.4 < table["sparse-gtopk-0.1-2-compact"]["mb_sent"] / table["sparse-gtopk-0.1-2"]["mb_sent"] < 0.65
    # SparseLoCo's 2-bit wire: 2.25 bytes a pair instead of the plain wire's 8
    assert 0.25 < table["sparseloco-0.0625-2"]["mb_sent"] / table["sparseloco-0.0625-2-plain"]["mb_sent"] < 0.33
    # PyTorch's local SGD averages at steps 1 and 4 (every 3 steps from the first): a ring allreduce of the model
    # each, 2 (P - 1) / P of its float32 bytes, against DDP's 4
    assert table["postlocal-3"]["bytes_vs_ddp"] == pytest.approx(2 / 4)
    # the hook's updated elements per group: step 3 and 4 are compressed (2 dense warm-up steps)
    shares = table["gtopk-0.01"]["updated_share"]
    assert set(shares) == {"embedding", "layernorm", "attention", "mlp", "head"}
    updated = runs["gtopk-0.01"]["updated_per_step"]
    numel = sum(runs["gtopk-0.01"]["group_numel"].values())
    assert 0 < sum(updated.values()) <= 2 * math.ceil(0.01 * numel) + 2  # about k per bucket, far below numel
    # gx.SparseGradState.recipe with a 2-step warm-up: the density 0.25 of steps 0-1 is dense (2 dense steps), step 2
    # at 0.05, 3 at 0.01 (the path policy may send a step dense: at most every element), counted after the warm-up
    assert runs["recipe-0.01"]["label"] == "gtopk_ext recipe, d=0.01"
    assert 0 < sum(runs["recipe-0.01"]["updated_per_step"].values()) <= numel
    assert 0 < table["recipe-0.01"]["bytes_vs_ddp"] < 1


def test_race_stops_each_method_at_the_target_or_its_budget(tmp_path):
    """--target-loss: a method stops at its first evaluation at or below it, and the table says when (seconds and
    steps, first); --budget: one that has not reached it by then stops too and is reported as not reached. The
    losses are those of a run without either (the same batches and weights)."""
    def run(name: str, *flags: str) -> tuple[str, dict, dict]:
        out = run_lm(*TINY, "--steps", "8", "--methods", "ddp", "gtopk-0.01", *flags, "--json", str(tmp_path / name))
        report = json.loads((tmp_path / name).read_text())
        return out, {r["method"]: r for r in report["runs"]}, {row["method"]: row for row in report["table"]}

    _, free, _ = run("free.json")
    target = free["ddp"]["curve"][2]["val_loss"]  # DDP's loss at step 4
    first = {name: next((c["step"] for c in r["curve"] if c["val_loss"] <= target), None) for name, r in free.items()}
    out, runs, table = run("race.json", "--target-loss", repr(target))
    assert "| s to target | steps to target | MB / rank to target | method |" in out
    for name, r in runs.items():
        assert table[name]["steps_to_target"] == first[name]
        reached = next((c for c in free[name]["curve"] if c["val_loss"] <= target), None)
        assert table[name]["bytes_to_target"] == (reached and reached["bytes_sent"])
        assert r["curve"][-1]["step"] == (first[name] or 8) and len(r["step_seconds"]) == r["curve"][-1]["step"]
        assert [c["val_loss"] for c in r["curve"]] == [c["val_loss"] for c in free[name]["curve"][:len(r["curve"])]]
    assert table["ddp"]["seconds_to_target"] == runs["ddp"]["curve"][-1]["seconds"] > 0
    _, runs, table = run("budget.json", "--target-loss", repr(target), "--budget", "1e-9")
    for name, r in runs.items():  # out of time at the first evaluation after step 0
        assert [c["step"] for c in r["curve"]] == [0, 2]
        assert table[name]["steps_to_target"] == (first[name] if first[name] == 2 else None)


def test_adamw_runs_every_peer_and_the_seeds_table_reads_the_curves(tmp_path):
    """The default optimizer, AdamW with a schedule and clipping, under DDP's hooks, PowerSGD, the sparse hook, the
    AdamW recipe (sparse from step 3), the floor and DiLoCo; two seeds merged with a target: each seed's steps and
    bytes to it, their means, the loss at the schedule's end."""
    flags = [*TINY, "--steps", "6", "--lr-warmup", "2", "--lr-decay-steps", "4", "--clip-norm", "0.5"]
    methods = ["ddp", "bf16", "powersgd-2", "gtopk-0.01", "adamw-0.01", "floor", "diloco-2"]
    out = run_lm(*flags, "--methods", *methods, "--json", str(tmp_path / "seed0.json"))
    assert "AdamW lr 0.002 betas 0.9/0.95, weight decay 0.1 on the matrices, 2 warm-up steps then cosine to 0.1x at " \
           "step 4, clipping at 0.5" in out
    run_lm(*flags, "--seed", "1", "--methods", "ddp", "gtopk-0.01", "--json", str(tmp_path / "seed1.json"))
    reports = [json.loads((tmp_path / f"seed{seed}.json").read_text()) for seed in (0, 1)]
    settings = reports[0]["settings"]
    assert (settings["optimizer"], settings["lr"], settings["betas"], settings["weight_decay"]) == (
        "adamw", 0.002, [0.9, 0.95], 0.1)
    runs = {(r["method"], r["seed"]): r for report in reports for r in report["runs"]}
    for run in runs.values():
        assert [c["step"] for c in run["curve"]] == [0, 2, 4, 6]
        assert all(math.isfinite(c["val_loss"]) for c in run["curve"])
        assert len(run["grad_norm"]) == 6 and all(n > 0 for n in run["grad_norm"])
    assert runs[("ddp", 0)]["curve"][-1]["val_loss"] < runs[("ddp", 0)]["curve"][0]["val_loss"]
    assert runs[("floor", 0)]["bytes_sent"] == 0 < runs[("bf16", 0)]["bytes_sent"] < runs[("ddp", 0)]["bytes_sent"]

    ddp = [runs[("ddp", seed)]["curve"] for seed in (0, 1)]
    target = (ddp[0][2]["val_loss"] + ddp[1][2]["val_loss"]) / 2  # DDP's mean at step 4, the schedule's end
    out = run_lm("--merge", str(tmp_path / "seed0.json"), str(tmp_path / "seed1.json"), "--target-loss", repr(target),
                 "--json", str(tmp_path / "merged.json"), "--plot", str(tmp_path / "merged.png"))
    assert "Over seeds 0, 1, to a validation loss of" in out and "| val loss at step 4, per seed |" in out
    merged = json.loads((tmp_path / "merged.json").read_text())
    rows = {row["method"]: row for row in merged["seeds_table"]}
    assert list(rows) == methods
    for name, row in rows.items():
        mine = [runs[(name, seed)] for seed in (0, 1) if (name, seed) in runs]
        firsts = [next((c for c in r["curve"] if c["val_loss"] <= target), None) for r in mine]
        assert [r["steps_to_target"] for r in row["per_seed"]] == [f and f["step"] for f in firsts]
        for key, point_key in (("steps_to_target", "step"), ("bytes_to_target", "bytes_sent")):
            assert row[key] == (None if None in firsts else sum(f[point_key] for f in firsts) / len(firsts))
        assert row["horizon_val_loss"] == pytest.approx(sum(r["curve"][2]["val_loss"] for r in mine) / len(mine))
    assert rows["ddp"]["bytes_vs_ddp"] == 1 and rows["floor"]["bytes_vs_ddp"] == 0
    assert (tmp_path / "merged.png").stat().st_size > 0


def schedule_and_clipping(rank: int, world_size: int) -> dict:
    """Under DDP and DiLoCo (SparseLocalSGD: the inner optimizer's rate): each step's learning rate, and the
    gradient's norm before the step's clipping (measured_step's) and after it (the parameters')."""
    from torch import nn

    from bench.emulated_network import TxCounter
    from bench.harness.train import Trainer

    args = argparse.Namespace(optimizer="adamw", lr=0.01, betas=[0.9, 0.95], weight_decay=0.1, lr_warmup=3,
                              lr_decay_steps=8, steps=10, min_lr_ratio=0.1, clip_norm=0.05, outer_lr=1.0,
                              outer_momentum=0.0, outer_nesterov=False, error_decay=1.0)
    seen = {}
    for name in ("ddp", "diloco-2"):
        torch.manual_seed(0)
        trainer = Trainer(name, nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Linear(16, 2)), args, world_size)
        data = torch.Generator().manual_seed(rank)
        lrs, before, after = [], [], []
        for _ in range(args.steps):
            x, y = torch.randn(8, 4, generator=data), torch.randint(2, (8,), generator=data)
            lrs.append([group["lr"] for group in trainer.optimizer.param_groups])
            step = trainer.measured_step(lambda model: nn.functional.cross_entropy(model(x), y), TxCounter(None))
            before.append(step["grad_norm"])
            after.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in trainer.model.parameters()]))))
        seen[name] = {"lrs": lrs, "before": before, "after": after}
    return seen


def test_schedule_warms_up_linearly_then_decays_as_a_cosine_and_clipping_bounds_the_norm():
    from tests.distributed import run_distributed

    # peak 0.01: 3 warm-up updates (1/3, 2/3, 1), the cosine 0.1 + 0.45 (1 + cos(pi t)) over updates 3..7 (t = 0, 1/4,
    # ..., 1: the last of the 8 steps at 0.1x), then 0.1x
    expected = [0.01 * f for f in (1 / 3, 2 / 3, 1, 1, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55,
                                   0.1 + 0.45 * (1 - math.cos(math.pi / 4)), 0.1, 0.1, 0.1)]
    for seen in run_distributed(schedule_and_clipping, 2):
        for name, run in seen.items():
            for lrs, want in zip(run["lrs"], expected, strict=True):  # both parameter groups: decayed or not
                assert lrs == pytest.approx([want, want], rel=1e-12), name
            assert all(before > 0.05 for before in run["before"]), name  # the test clips every step
            assert run["after"] == pytest.approx([0.05] * 10, rel=1e-4), name


def test_adamw_decays_the_matrices_only():
    """One AdamW step on zero gradients moves nothing but the decay: the weights of the linear layers and the
    embeddings shrink by lr x weight decay, the biases and LayerNorm gains stay."""
    from bench.harness.train import make_optimizer
    from bench.lm import TransformerLM, parse_args

    args = parse_args(["--layers", "1", "--d-model", "32", "--seq-len", "16", "--lr", "0.01", "--weight-decay", "0.5"])
    model = TransformerLM(args)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = make_optimizer(model, args)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    decayed = {name for name in before if name.endswith("weight") and "ln_" not in name}
    assert decayed >= {"token_embedding.weight", "position_embedding.weight", "blocks.0.qkv.weight", "head.weight"}
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name] * (1 - 0.01 * 0.5) if name in decayed else before[name]), name


def test_gpt2_is_hugging_faces_model_of_the_same_shape():
    """--model gpt2: transformers' GPT2LMHeadModel over bytes (tied embeddings), the logits for every position, and
    every parameter in its group (as the updated-elements column counts them)."""
    from transformers import GPT2LMHeadModel

    from bench.lm import build_model, parameter_group, parse_args

    args = parse_args(["--model", "gpt2", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16"])
    model = build_model(args, seed=3)
    assert isinstance(model.gpt2, GPT2LMHeadModel) and model.gpt2.lm_head.weight is model.gpt2.transformer.wte.weight
    assert model(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)
    groups = {name: parameter_group(name) for name, _ in model.named_parameters()}
    assert groups["gpt2.transformer.wte.weight"] == groups["gpt2.transformer.wpe.weight"] == "embedding"
    assert groups["gpt2.transformer.h.1.attn.c_attn.weight"] == groups["gpt2.transformer.h.0.attn.c_proj.bias"] == (
        "attention")
    assert groups["gpt2.transformer.h.0.mlp.c_fc.weight"] == "mlp"
    assert groups["gpt2.transformer.h.0.ln_2.weight"] == groups["gpt2.transformer.ln_f.bias"] == "layernorm"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), build_model(args, seed=3).parameters()))


def test_optimizer_defaults_and_the_hooks_that_cannot_take_adamw(capsys):
    from bench.harness.train import Trainer
    from bench.lm import parse_args

    adamw = parse_args([])
    assert (adamw.optimizer, adamw.lr, adamw.betas, adamw.weight_decay, adamw.lr_warmup, adamw.lr_decay_steps,
            adamw.min_lr_ratio, adamw.clip_norm) == ("adamw", 2e-3, [0.9, 0.95], 0.1, 50, 500, 0.1, 1.0)
    assert adamw.methods == ["ddp", "fp16", "bf16", "powersgd-4", "gtopk-0.01", "gtopk-0.001", "floor"]
    sgd = parse_args(["--optimizer", "sgd", "--steps", "160"])  # the earlier measurements: no schedule, no clipping
    assert (sgd.lr, sgd.momentum, sgd.weight_decay, sgd.lr_warmup, sgd.min_lr_ratio, sgd.clip_norm) == (
        0.1, 0.9, 0.0, 0, 1.0, 0.0)
    assert "recipe-0.01" in sgd.methods and parse_args(["--optimizer", "sgd", "--methods", "dgc-0.001"])
    for method in ("recipe-0.01", "dgc-0.001", "recipe-0.001-44"):
        with pytest.raises(SystemExit):
            parse_args(["--methods", "ddp", method])
        assert f"{method} applies SGD momentum in its hook" in capsys.readouterr().err
    with pytest.raises(ValueError, match="run it with --optimizer sgd, not --optimizer adamw"):
        Trainer("recipe-0.01", torch.nn.Linear(2, 2), adamw, 2)  # before any process group
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "sgd", "--methods", "adamw-0.01"])
    assert "adamw-0.01 is the AdamW recipe: run it with --optimizer adamw" in capsys.readouterr().err
    for argv, flag in ((["--lr", "0"], "--lr"), (["--min-lr-ratio", "1.5"], "--min-lr-ratio"),
                       (["--betas", "0.9", "1.0"], "--betas"), (["--clip-norm", "-1"], "--clip-norm")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert f"{flag} must be" in capsys.readouterr().err
