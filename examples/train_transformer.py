"""A byte-level transformer trained as transformers train (AdamW, a warm-up then a cosine, clipping at 1.0) under
DDP with gtopk_ext's AdamW recipe, or each rank on its own with SparseLocalSGD, launched by torchrun. On one
machine, 4 ranks:

    torchrun --nproc-per-node 4 examples/train_transformer.py                  # the AdamW recipe, density 0.01
    torchrun --nproc-per-node 4 examples/train_transformer.py --density 0.004 --wire 4bit  # 1/4 of its bytes
    torchrun --nproc-per-node 4 examples/train_transformer.py --method sparseloco  # SparseLocalSGD's defaults
    torchrun --nproc-per-node 4 examples/train_transformer.py --method ddp     # DDP + torch.optim.AdamW, to compare

The text is the running Python's standard library (every rank reads its own windows); with ``--hf``, Hugging
Face's GPT2LMHeadModel of the same shape (``pip install transformers``). What changes from a DDP + AdamW script
is marked "gtopk_ext:" below: the hook's state, SparseAdamW in place of AdamW with the same arguments, and no
``clip_grad_norm_`` (the hook clips: the optimizer never sees a gradient, only the momentum the ranks sent). With
``--method sparseloco`` the model is not wrapped in DDP: torch's AdamW trains each replica, and
``gx.SparseLocalSGD(model.parameters())`` (SparseLoCo's exchange: every 8 steps, 1/64 of the drift, 2 bits a value)
syncs them.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="adamw-recipe", choices=("adamw-recipe", "sparseloco", "ddp", "bf16"),
                        help="the AdamW recipe, DDP's allreduce, or bf16_compress_hook (both with torch's AdamW)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--wire", default="compact", choices=tuple(gx.wire.WIRES),
                        help="the AdamW recipe's wire: 4bit sends a coefficient in 2 bytes, compact in 4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps (then a cosine)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--hf", action="store_true", help="Hugging Face's GPT2LMHeadModel")
    parser.add_argument("--log-every", type=int, default=50)
    return parser.parse_args()


class ByteTransformer(nn.Module):
    """A decoder-only transformer over bytes: embeddings, pre-LayerNorm blocks under a causal mask, a head."""

    def __init__(self, width: int, layers: int, seq_len: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(256, width), nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    if not args.hf:
        return ByteTransformer(args.width, args.layers, args.seq_len)
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.width,
                                      n_layer=args.layers, n_head=4))
    return _Logits(gpt2)


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's bytes: every 20th file held out for validation."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for f in files if "site-packages" not in f.parts]
    pieces = [[], []]
    for i, path in enumerate(files):
        pieces[i % 20 == 0].append(path.read_bytes())
    return tuple(torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8).long() for p in pieces)


def windows(text: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    starts = torch.randint(0, text.numel() - length - 1, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([text[s:s + length + 1] for s in starts.tolist()])


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    train, held_out = corpus()
    model = make_model(args)
    local = args.method == "sparseloco"
    ddp = model if local else DDP(model)
    decayed = [p for p in model.parameters() if p.dim() >= 2]  # weight decay on the matrices only
    groups = [{"params": decayed, "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    state = outer = None
    if local:
        # gtopk_ext: each rank trains its replica with torch's AdamW; SparseLocalSGD syncs them every 8 steps.
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        outer = gx.SparseLocalSGD(model.parameters())
    elif args.method == "adamw-recipe":
        # gtopk_ext: the hook's state and the optimizer that goes with it (AdamW's arguments, plus the state).
        state = gx.SparseGradState.recipe(density=args.density, optimizer="adamw", wire=args.wire,
                                          stats_logging_frequency=0)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        optimizer = gx.SparseAdamW(groups, lr=args.lr, betas=(0.9, 0.95), state=state)
    else:
        if args.method == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / args.warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))))
    for step in range(args.steps):
        batch = windows(train, args.batch_size, args.seq_len, 1_000_003 * step + rank)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(ddp, batch)
        loss.backward()
        if state is None:  # gtopk_ext: the recipe's hook clips (recipe(clip_norm=1.0))
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if outer is not None:
            outer.step()  # gtopk_ext: a sync every sync_every calls
        if args.log_every and rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: training loss {loss.item():.4f}", flush=True)
    if outer is not None:
        outer.sync()  # gtopk_ext: every rank ends with the global model
    with torch.no_grad():
        model.eval()
        held = torch.stack([loss_of(model, b) for b in windows(held_out, 64, args.seq_len, 7 + rank).split(16)])
    mean = held.mean().reshape(1)
    dist.all_reduce(mean)
    if rank == 0:
        print(f"{args.method}: validation loss {float(mean) / world_size:.4f} after {args.steps} steps", flush=True)
        if state is not None or outer is not None:
            print((state or outer).summary(), flush=True)
    gx.destroy_process_group()


if __name__ == "__main__":
    main()
