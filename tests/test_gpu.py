"""The DDP hook on a GPU: two processes share the one GPU (Gloo with CUDA tensors; NCCL cannot put two ranks on
one device), for every sparse collective, both GPU backends (the CUDA kernels and the compiled Triton ones),
float32 and bfloat16, and the AdamW recipe on the compact and the 4-bit wire: the replicas are bitwise equal, the
asynchronous path is bitwise the synchronous one, no gradient is lost (float32, per bucket and step: what the
ranks put in = P * what was applied + what the residuals keep) and the model learns. The ops themselves run on CUDA
tensors in test_ops.py, test_triton_path.py and test_wire.py.

No `from __future__ import annotations` here: DDP checks a hook's annotations against dist.GradBucket.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from tests.distributed import run_distributed
from tests.test_hook import Recorder, conservation_failures, recording_hook, same_on_every_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

STEPS = 12
WIDTH = 64


def regress(ddp: DDP, optimizer: torch.optim.Optimizer, rank: int, device: torch.device,
            dtype: torch.dtype) -> list[float]:
    """STEPS steps of a linear regression (rank-specific inputs, one target), the losses."""
    target = torch.randn(WIDTH, 1, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    losses = []
    for step in range(STEPS):
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank)).to(device, dtype)
        optimizer.zero_grad()
        loss = (ddp(x) - x @ target / WIDTH**0.5).float().square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def train(rank: int, device: torch.device, backend: str, collective: str, dtype: torch.dtype, synchronous: bool,
          path: str = "sparse") -> tuple[list[torch.Tensor], list[float], list[str]]:
    """Parameters (copied to the CPU) after STEPS steps of a regression, the losses, and conservation failures."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, 4 * WIDTH), nn.Tanh(),
                          nn.Linear(4 * WIDTH, 1)).to(device=device, dtype=dtype)
    # 16 KiB buckets: the 16384-element layer, the others together.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=16 * 1024 * torch.finfo(dtype).bits / 8 / 2**20)
    state = gx.SparseGradState(density=0.05, collective=collective, start_iter=2,
                               path=gx.PathPolicy(path, min_compress_numel=1024),
                               stats_logging_frequency=0,
                               compressor=gx.make_compressor("gaussiank", 0.05, backend=backend))
    state.synchronous = synchronous
    recorder = Recorder(state)
    ddp.register_comm_hook(recorder, recording_hook)
    losses = regress(ddp, torch.optim.SGD(model.parameters(), lr=0.1), rank, device, dtype)
    state.stats()  # waits for the buckets in flight
    where = f"{backend} {collective} {dtype} synchronous={synchronous}"
    recorder.calls = {key: tuple(t.cpu() for t in call) for key, call in recorder.calls.items()}
    # bfloat16's average is rounded to 8 bits: the float32 tolerance of the balance holds for float32 only.
    failures = conservation_failures(recorder, where) if dtype == torch.float32 else []
    if not any(stats["path"] == path for stats in state.stats()["buckets"].values()):
        failures.append(f"{where}: no bucket went {path}")
    return [p.detach().cpu() for p in model.parameters()], losses, failures


def train_adamw(rank: int, device: torch.device, wire: str,
                synchronous: bool) -> tuple[list[torch.Tensor], list[float]]:
    """The AdamW recipe (the momentum decoupled in the hook, clipping, SparseAdamW) on ``wire``: parameters and
    losses after STEPS steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = gx.SparseGradState.recipe(density=0.05, optimizer="adamw", wire=wire, stats_logging_frequency=0)
    state.synchronous = synchronous
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    optimizer = gx.SparseAdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1, state=state)
    losses = regress(ddp, optimizer, rank, device, torch.float32)
    state.stats()  # waits for the buckets in flight
    return [p.detach().cpu() for p in model.parameters()], losses


def run_failures(where: str, parameters: list[torch.Tensor], losses: list[float],
                 synchronous: list[torch.Tensor] | None = None) -> list[str]:
    """What is wrong with a run: replicas that differ, parameters other than the synchronous run's, no learning."""
    failures = []
    if not same_on_every_rank(parameters):
        failures.append(f"{where}: the replicas differ")
    if synchronous is not None and not all(torch.equal(a, b) for a, b in zip(parameters, synchronous)):
        failures.append(f"{where}: the asynchronous path differs from the synchronous one")
    if not sum(losses[-3:]) < 0.7 * sum(losses[:3]):
        failures.append(f"{where}: the loss did not fall: {losses}")
    return failures


def hook_on_gpu(rank: int, size: int) -> list[str]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    failures = []
    for backend in ("cuda", "triton"):
        for collective in ("gtopk", "allgather", "oktopk"):
            for dtype in (torch.float32, torch.bfloat16):
                where = f"{backend} {collective} {dtype}"
                threaded, losses, broken = train(rank, device, backend, collective, dtype, False)
                inline, _, broken_inline = train(rank, device, backend, collective, dtype, True)
                failures += broken + broken_inline + run_failures(where, threaded, losses, inline)
    # The rounded dense paths on CUDA tensors (their ring sends from host memory on Gloo).
    for path in ("dense16", "dense8"):
        parameters, losses, broken = train(rank, device, "cuda", "gtopk", torch.float32, False, path)
        failures += broken + run_failures(path, parameters, losses)
    # The AdamW recipe (its momentum and the 4-bit wire's packing are torch ops on the gradient's device).
    for wire in ("compact", "4bit"):
        threaded, losses = train_adamw(rank, device, wire, False)
        inline, _ = train_adamw(rank, device, wire, True)
        failures += run_failures(f"adamw {wire}", threaded, losses, inline)
    return failures


def test_hook_on_cuda_tensors_two_ranks_one_gpu():
    failures = [f for rank_failures in run_distributed(hook_on_gpu, 2, timeout=600) for f in rank_failures]
    assert not failures, "\n".join(failures)
