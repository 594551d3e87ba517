"""Record what gtopk_ext computes on real Gloo process groups, and compare two recordings bitwise.

A refactor that keeps behaviour must reproduce a baseline's recording byte for byte: every gradient the DDP
hook hands back, every residual, velocity and Ok-Topk state it keeps, every parameter after training, the
local-SGD outer optimizer's replicas and state, and every tensor the collectives return.

Usage (PYTHONPATH selects the checkout whose gtopk_ext is recorded; the compiled extension must be built)::

    PYTHONPATH=/path/to/checkout python scripts/hook_outputs.py dump OUT.pt [--world-sizes 2 3 4] [--only TEXT ...]
    python scripts/hook_outputs.py compare A.pt B.pt
    python scripts/hook_outputs.py list [--world-sizes 2 3 4] [--only TEXT ...]

``dump`` runs every configuration of :func:`configurations` (``--only``: those whose name contains one of the
texts) on one Gloo group per world size (spawned processes, file:// rendezvous, one CPU thread each) and saves
``{config name: {rank: [tensors]}}`` with :func:`torch.save`; the key ``"__labels__"`` holds, in the same shape,
what each tensor is (``"step3/grad/fc1.weight"``), and ``"__meta__"`` the torch version and world sizes: both
are for reading, not compared. A configuration that raises makes the whole dump fail with its traceback.

``compare`` compares two dumps tensor by tensor (dtype, shape and raw bytes), prints one line per configuration
and a summary, and exits with status 1 if any configuration differs or is missing on one side.

Inputs are deterministic functions of (configuration, rank, step); the configuration's seed is the CRC32 of its
name, so adding a configuration leaves the others' recordings unchanged. Only gtopk_ext's public API is used
(two entry points that moved in 0.2 are looked up where they are: see :func:`reduce_buffer`).
"""

import argparse
import gc
import os
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from gtopk_ext.utils import destroy_process_group

STEPS = 10  # training steps (DDP, bare state.reduce, local SGD) of every configuration
DENSITY = 0.05
START_ITER = 2
MIN_COMPRESS_NUMEL = 256  # every bucket of the model compresses (after the warm-up)
BUCKET_ELEMENTS = 2000  # bucket cap in elements: the model's 5592 parameters make 2 buckets (2888, 2704)
MOMENTUM = dict(momentum=0.9, nesterov=True, weight_decay=1e-4, masking_start_iter=4)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REDUCE_NUMELS = (3000, 1500)  # the flat buffers of the bare state.reduce configurations (2 buckets)
INF_STEP = 5  # step of the non-finite configurations and of the loss-scaler one


# ------------------------------------------------------------------------------------- the configurations


@dataclass(frozen=True)
class Config:
    name: str
    world_size: int
    run: str  # "ddp", "reduce", "local_sgd" or "collective": the runner below
    options: dict = field(default_factory=dict, compare=False, hash=False)


def hierarchical_local_sizes(world_size: int) -> list[int]:
    """1 (every rank a node), 2 when it divides P, and P (one node)."""
    return sorted({1, world_size} | ({2} if world_size % 2 == 0 else set()))


def inner_local_size(world_size: int) -> int:
    """The local size of the hierarchical configurations that pick one: 2 when P is even, else 1."""
    return 2 if world_size % 2 == 0 else 1


def configurations(world_sizes: list[int]) -> list[Config]:
    """The table of configurations. Names: ``P<size>/<runner>/<what>``; hook options are SparseGradState's
    keywords (besides density=DENSITY, start_iter=START_ITER, min_compress_numel=MIN_COMPRESS_NUMEL)."""
    configs = []

    def add(size: int, run: str, name: str, **options) -> None:
        configs.append(Config(f"P{size}/{run}/{name}", size, run, options))

    for P in world_sizes:
        # 1. The DDP hook, float32: collective x wire x momentum (hierarchical: no momentum, per local size).
        for collective in ("gtopk", "allgather", "oktopk", "dense"):
            for wire in ("plain", "compact"):
                add(P, "ddp", f"{collective}/{wire}/mom0/float32", hook=dict(collective=collective, wire=wire))
                add(P, "ddp", f"{collective}/{wire}/mom0.9/float32",
                    hook=dict(collective=collective, wire=wire, **MOMENTUM))
        for local_size in hierarchical_local_sizes(P):
            for wire in ("plain", "compact"):
                add(P, "ddp", f"hierarchical-ls{local_size}/{wire}/mom0/float32",
                    hook=dict(collective="hierarchical", local_size=local_size, wire=wire))
        # 2. Half precision through DDP (Gloo on the CPU reduces bfloat16 and float16).
        for wire in ("plain", "compact"):
            for collective in ("gtopk", "allgather", "oktopk"):
                add(P, "ddp", f"{collective}/{wire}/mom0/bfloat16", dtype="bfloat16",
                    hook=dict(collective=collective, wire=wire))
                add(P, "ddp", f"{collective}/{wire}/mom0.9/bfloat16", dtype="bfloat16",
                    hook=dict(collective=collective, wire=wire, **MOMENTUM))
            local_size = inner_local_size(P)
            add(P, "ddp", f"hierarchical-ls{local_size}/{wire}/mom0/bfloat16", dtype="bfloat16",
                hook=dict(collective="hierarchical", local_size=local_size, wire=wire))
        for collective in ("gtopk", "hierarchical"):
            extra = dict(local_size=inner_local_size(P)) if collective == "hierarchical" else {}
            add(P, "ddp", f"{collective}/compact/mom0/float16", dtype="float16",
                hook=dict(collective=collective, wire="compact", **extra))
            # Bare state.reduce on flat buffers (parameters=None), float16 and bfloat16.
            for dtype in ("float16", "bfloat16"):
                for wire in ("plain", "compact"):
                    add(P, "reduce", f"{collective}/{wire}/{dtype}", dtype=dtype,
                        hook=dict(collective=collective, wire=wire, **extra))
            # 3. A non-finite step: one rank's bucket 0 holds an inf at step INF_STEP.
            for wire in ("plain", "compact"):
                add(P, "reduce", f"{collective}/{wire}/float32/inf-at-step{INF_STEP}", inf_step=INF_STEP,
                    hook=dict(collective=collective, wire=wire, **extra))
        # 4. SparseLocalSGD, sync_every=2.
        for collective in ("gtopk", "allgather", "oktopk"):
            for wire in ("plain", "compact"):
                add(P, "local_sgd", f"{collective}/{wire}", collective=collective, wire=wire, density=DENSITY)
        add(P, "local_sgd", "dense/plain", collective="dense", wire="plain", density=1.0)
        # 5. The collectives on fixed messages.
        for op in ("allgather", "gtopk", "oktopk"):
            for wire in ("plain", "compact"):
                for dtype in DTYPES:
                    add(P, "collective", f"{op}/{wire}/{dtype}", op=op, wire=wire, dtype=dtype)
        for local_size in hierarchical_local_sizes(P):
            for inner in ("gtopk", "allgather", "oktopk"):
                for wire in ("plain", "compact"):
                    add(P, "collective", f"hierarchical-ls{local_size}-{inner}/{wire}/float32", op="hierarchical",
                        local_size=local_size, inner=inner, wire=wire, dtype="float32")
        for dtype in ("bfloat16", "float16"):
            add(P, "collective", f"hierarchical-ls{inner_local_size(P)}-gtopk/compact/{dtype}", op="hierarchical",
                local_size=inner_local_size(P), inner="gtopk", wire="compact", dtype=dtype)

    if 4 in world_sizes:  # 1'. Features of the hook, at P = 4, float32.
        features = {
            "per_tensor": dict(per_tensor=True),
            "per_tensor/allgather/compact": dict(per_tensor=True, collective="allgather", wire="compact"),
            "per_tensor/mom0.9": dict(per_tensor=True, **MOMENTUM),
            "density_schedule": dict(density_schedule=gx.exponential_warmup(0.01, 6, start_iter=2)),
            "density_schedule/oktopk": dict(collective="oktopk",
                                            density_schedule=gx.exponential_warmup(0.01, 6, start_iter=2)),
            "topk": dict(compressor="topk"),
            "randomk": dict(compressor="randomk", random_seed=7),
            "randomk/allgather/compact": dict(compressor="randomk", collective="allgather", wire="compact"),
            "gaussiank-paper": dict(compressor_kwargs={"mode": "paper"}),
            "clip_norm": dict(clip_norm=1.0),
            "clip_norm/mom0.9": dict(clip_norm=1.0, **MOMENTUM),
            "no-error-feedback": dict(error_feedback=False),
            "no-error-feedback/oktopk/compact": dict(error_feedback=False, collective="oktopk", wire="compact"),
            "synchronous": dict(synchronous=True),
            "synchronous/hierarchical-ls2/compact": dict(synchronous=True, collective="hierarchical", local_size=2,
                                                         wire="compact"),
            "hierarchical-ls2-allgather": dict(collective="hierarchical", local_size=2, inner_collective="allgather"),
            "hierarchical-ls2-oktopk/compact": dict(collective="hierarchical", local_size=2,
                                                    inner_collective="oktopk", wire="compact"),
        }
        for name, hook in features.items():
            add(4, "ddp", f"feature/{name}", hook=hook)
        # A parameter unused by rank 1 on some steps and by every rank on one step.
        for name, hook in {"gtopk": {}, "gtopk/mom0.9": dict(MOMENTUM), "allgather/compact":
                           dict(collective="allgather", wire="compact"), "oktopk": dict(collective="oktopk"),
                           "hierarchical-ls2": dict(collective="hierarchical", local_size=2)}.items():
            add(4, "ddp", f"feature/find_unused_parameters/{name}", hook=hook, find_unused=True)
        # A GradScaler attached (its scale grows every 2 steps; an inf on one rank at INF_STEP makes it skip).
        for name, hook in {"gtopk": {}, "gtopk/mom0.9": dict(MOMENTUM),
                           "allgather/compact": dict(collective="allgather", wire="compact")}.items():
            add(4, "ddp", f"feature/grad_scaler/{name}", hook=hook, scaler=True)
    return configs


# ------------------------------------------------------------------------------ entry points that moved
# The baseline's names are used when they exist. Two of them moved in the 0.2 restructuring (c584e76):
# SparseGradState.reduce became gtopk_ext.ddp.reduce_buffer, and gx.collectives.hierarchical_allreduce
# became gtopk_ext.hierarchical.hierarchical_allreduce; the fallbacks call the same computation there.


def reduce_buffer(state: "gx.SparseGradState", buffer: torch.Tensor, index: int, is_last: bool) -> torch.futures.Future:
    if hasattr(state, "reduce"):
        return state.reduce(buffer, index, is_last=is_last)
    from gtopk_ext.ddp import reduce_buffer as moved  # noqa: PLC0415 (0.2 and later)
    return moved(state, buffer, index, is_last=is_last)


def hook_state(scaler=None, **hook) -> "gx.SparseGradState":
    """The hook's state with the table's options; from 0.3 on with ``path="sparse"`` (0.3's default ``auto``
    chooses from measured times, so its paths would differ from run to run; ``sparse`` is the earlier
    behaviour). The table names options as 0.2 and 0.3 did; with the configuration object (0.4) they are
    translated to the arguments that replaced them (:func:`current_options`)."""
    options = {"density": DENSITY, "start_iter": START_ITER, **hook}
    if hasattr(gx, "SparseConfig"):
        options, synchronous = current_options(options)
        state = gx.SparseGradState(**options, path=gx.PathPolicy("sparse", MIN_COMPRESS_NUMEL), scaler=scaler)
        state.synchronous = synchronous
        return state
    if hasattr(gx, "PathPolicy"):
        state = gx.SparseGradState(**options, path=gx.PathPolicy("sparse", MIN_COMPRESS_NUMEL))
    else:
        state = gx.SparseGradState(**options, min_compress_numel=MIN_COMPRESS_NUMEL)
    if scaler is not None:
        state.attach_scaler(scaler)
    return state


def current_options(options: dict) -> tuple[dict, bool]:
    """The table's 0.2/0.3 option names as 0.4's SparseGradState arguments, and whether to run synchronously."""
    options = dict(options)
    synchronous = options.pop("synchronous", False)
    if "density_schedule" in options:
        options["density"] = options.pop("density_schedule")
    kind = options.pop("compressor", "gaussiank")
    kwargs = dict(options.pop("compressor_kwargs", None) or {})
    if options.pop("per_tensor", False):
        kwargs["per_tensor"] = True
    if "random_seed" in options:
        kwargs["seed"] = kwargs.get("seed", 0) + options.pop("random_seed")
    options["compressor"] = gx.make_compressor(kind, DENSITY, **kwargs)
    parts = {name: options.pop(name) for name in ("nesterov", "weight_decay", "masking_start_iter", "clip_norm")
             if name in options}
    momentum = options.pop("momentum", 0.0)
    if momentum or parts:
        options["momentum"] = gx.MomentumCorrection(momentum, **parts)
    if options.get("collective") == "hierarchical":
        options["collective"] = options.pop("inner_collective", "gtopk")
        options["hierarchical"] = gx.Hierarchical(options.pop("local_size"))
    return options, synchronous


def hierarchical_allreduce(*args, **kwargs):
    function = getattr(gx.collectives, "hierarchical_allreduce", None)
    if function is None:
        from gtopk_ext.hierarchical import hierarchical_allreduce as function  # noqa: PLC0415 (0.2 and later)
    return function(*args, **kwargs)


# ------------------------------------------------------------------------------------------ recording


def generator(seed: int, rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + rank * 10_007 + step) % (1 << 62))


def config_seed(name: str) -> int:
    return zlib.crc32(name.encode())


class Recording:
    """The tensors of one rank in one configuration, in order, with a label each.

    A structure (a state dict: dicts, lists, tuples) is recorded as its tensors, in the order of a walk with
    dict keys sorted, preceded by one uint8 tensor: the text of the structure with each tensor written as
    ``T<dtype><shape>`` (Python floats as their repr, which is exact)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.labels: list[str] = []

    def add(self, label: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors.append(value.detach().clone().cpu())
            self.labels.append(label)
            return
        found: list[tuple[str, torch.Tensor]] = []
        text = self._skeleton(value, label, found)
        self.tensors.append(torch.tensor(list(text.encode()), dtype=torch.uint8))
        self.labels.append(f"{label}:structure")
        for path, tensor in found:
            self.add(path, tensor)

    @classmethod
    def _skeleton(cls, value: Any, path: str, found: list) -> str:
        if isinstance(value, torch.Tensor):
            found.append((path, value))
            return f"T{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        if isinstance(value, dict):
            keys = sorted(value, key=lambda k: (type(k).__name__, k))
            return "{" + ", ".join(f"{k!r}: {cls._skeleton(value[k], f'{path}/{k}', found)}" for k in keys) + "}"
        if isinstance(value, (list, tuple)):
            items = ", ".join(cls._skeleton(item, f"{path}[{i}]", found) for i, item in enumerate(value))
            return f"[{items}]" if isinstance(value, list) else f"({items})"
        if value is None or isinstance(value, (bool, int, float, str)):
            return repr(value)
        raise TypeError(f"cannot record {path}: {type(value).__name__}")


class Net(nn.Module):
    """Parameters of different sizes and gradient scales: an embedding (rows touched sparsely), linear layers, a
    LayerNorm, and ``extra``, which a forward can skip (unused parameters)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.fc1 = nn.Linear(32, 48)
        self.norm = nn.LayerNorm(48)
        self.fc2 = nn.Linear(48, 32)
        self.extra = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.cat([self.embed(tokens), x], dim=1)
        h = self.fc2(nn.functional.gelu(self.norm(self.fc1(h))))
        if use_extra:
            h = h + 2.0 * torch.tanh(self.extra(h))
        return self.head(h)


def net_batch(seed: int, rank: int, step: int, dtype: torch.dtype):
    g = generator(seed, rank, step)
    tokens = torch.randint(0, 64, (8,), generator=g)
    x = (torch.randn(8, 16, generator=g) * (1.0 + rank)).to(dtype)
    y = torch.randn(8, 8, generator=g)
    return tokens, x, y


def run_ddp(rank: int, size: int, seed: int, rec: Recording, *, hook: dict, dtype: str = "float32",
            find_unused: bool = False, scaler: bool = False) -> None:
    """DDP with the hook registered, 10 SGD steps: per step every parameter's reduced gradient and the state's
    state_dict(); the parameters at the end."""
    torch_dtype = DTYPES[dtype]
    torch.manual_seed(seed)
    model = Net().to(torch_dtype)
    element_size = torch.empty((), dtype=torch_dtype).element_size()
    ddp = DDP(model, bucket_cap_mb=BUCKET_ELEMENTS * element_size / 2**20, find_unused_parameters=find_unused)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaler else None
    state = hook_state(grad_scaler, **hook)
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    names = [name for name, _ in model.named_parameters()]
    for step in range(STEPS):
        tokens, x, y = net_batch(seed, rank, step, torch_dtype)
        if scaler and step == INF_STEP and rank == size - 1:
            x[0, 0] = float("inf")
        # Unused parameters: rank 1 skips `extra` on steps 1, 4, 7; every rank skips it on step 8.
        use_extra = not (find_unused and ((rank == 1 and step % 3 == 1) or step == 8))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(tokens, x, use_extra).float(), y)
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
        else:
            loss.backward()
        for name, p in zip(names, model.parameters()):
            rec.add(f"step{step}/grad/{name}", p.grad)
        if grad_scaler is not None:
            grad_scaler.step(optimizer)
            grad_scaler.update()
            rec.add(f"step{step}/scale", grad_scaler.get_scale())
        else:
            optimizer.step()
        rec.add(f"step{step}/state", state.state_dict())
    for name, p in model.named_parameters():
        rec.add(f"param/{name}", p)


def run_reduce(rank: int, size: int, seed: int, rec: Recording, *, hook: dict, dtype: str = "float32",
               inf_step: int = -1) -> None:
    """state.reduce on two bare flat buffers per step (parameters=None): per step both outputs and the
    state_dict()."""
    torch_dtype = DTYPES[dtype]
    state = hook_state(**hook)
    for step in range(STEPS):
        g = generator(seed, rank, step)
        buffers = [(torch.randn(n, generator=g) * (0.5 + index + rank)).to(torch_dtype)
                   for index, n in enumerate(REDUCE_NUMELS)]
        if step == inf_step and rank == size - 1:
            buffers[0][17] = float("inf")
        futures = [reduce_buffer(state, buffer, index, index == len(buffers) - 1)
                   for index, buffer in enumerate(buffers)]
        for index, future in enumerate(futures):
            rec.add(f"step{step}/output{index}", future.wait())
        rec.add(f"step{step}/state", state.state_dict())


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x)))))))


def run_local_sgd(rank: int, size: int, seed: int, rec: Recording, *, collective: str, wire: str,
                  density: float) -> None:
    """SparseLocalSGD (sync_every=2) over a plain SGD inner optimizer: the parameters and buffers after every
    step, the state_dict() at the end."""
    torch.manual_seed(seed + rank)  # different on every rank: construction adopts rank 0's
    model = SmallNet()
    # Every setting named (the defaults before 0.3.0 and before SparseLoCo's): recordings across the default
    # changes stay comparable, and the state holds a Nesterov momentum.
    outer = gx.SparseLocalSGD(model.parameters(), sync_every=2, density=density, collective=collective, wire=wire,
                              outer_lr=0.7, outer_momentum=0.9, nesterov=True, buffers=model.buffers(),
                              compressor="gaussiank", error_decay=1.0, average="ranks")
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        g = generator(seed, rank, step)
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)
        inner.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        rec.add(f"step{step}/synced", outer.step())
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            rec.add(f"step{step}/{name}", t)
    rec.add("state", outer.state_dict())


def run_collective(rank: int, size: int, seed: int, rec: Recording, *, op: str, wire: str, dtype: str,
                   local_size: int = 1, inner: str = "gtopk") -> None:
    """A collective over messages of gx.make_compressor("gaussiank", 0.05).compress(grad, residual): 3 calls
    (Ok-Topk: 5, with one OkTopkState), flags raised on call 1; every returned tensor, the residuals, the flags
    and the Rounding's pairs."""
    torch_dtype = DTYPES[dtype]
    numel = 5000
    calls = 5 if "oktopk" in (op, inner) else 3
    ok_state = gx.collectives.OkTopkState()
    compressor = gx.make_compressor("gaussiank", 0.05)
    residual = torch.zeros(numel, dtype=torch_dtype)
    for call in range(calls):
        g = generator(seed, rank, call)
        grad = (torch.randn(numel, generator=g) * (1.0 + rank)).to(torch_dtype)
        rounding = gx.wire.Rounding()
        where = f"call{call}"
        if op == "hierarchical":
            k = compressor.k_for(numel)
            flags = torch.tensor([(2 << rank) if call == 1 else 0], dtype=torch.int32)
            result = hierarchical_allreduce(
                grad, residual, compressor, k, local_size, inner=inner,
                inner_state=ok_state if inner == "oktopk" else None, step=call, flags=flags, wire=wire,
                rounding=rounding)
            rec.add(f"{where}/average", result.average)
            rec.add(f"{where}/msg", [result.msg.values, result.msg.indices, result.msg.count, result.msg.numel])
            rec.add(f"{where}/applied", result.applied)
            rec.add(f"{where}/shard", [result.shard.start, result.shard.stop])
            rec.add(f"{where}/flags", flags)
        else:
            if call == 0:  # a residual to start from
                residual.copy_((0.1 * torch.randn(numel, generator=g)).to(torch_dtype))
            msg = compressor.compress(grad, residual)
            rec.add(f"{where}/msg", [msg.values, msg.indices, msg.count, msg.numel, msg.stats])
            flags = torch.tensor([(2 << rank) if call == 1 else 0], dtype=torch.int32)
            wire_options = dict(flags=flags, wire=wire, rounding=rounding)
            if op == "allgather":
                rec.add(f"{where}/sum", gx.collectives.sparse_allgather(msg, dtype=torch.float32, **wire_options))
            else:
                if op == "gtopk":
                    glob, applied = gx.collectives.gtopk_allreduce(msg, **wire_options)
                else:
                    glob, applied = gx.collectives.oktopk_allreduce(msg, state=ok_state, **wire_options)
                    rec.add(f"{where}/oktopk_state", ok_state.state_dict())
                rec.add(f"{where}/glob", [glob.values, glob.indices, glob.count, glob.numel])
                rec.add(f"{where}/applied", applied)
                rec.add(f"{where}/dense", glob.to_dense(torch.float32))
            rec.add(f"{where}/flags", flags)
        rec.add(f"{where}/residual", residual)
        rec.add(f"{where}/rounding", list(rounding.pairs(torch_dtype, torch.device("cpu"))))
    if op == "hierarchical" and inner == "oktopk":
        rec.add("oktopk_state", ok_state.state_dict())


RUNNERS: dict[str, Callable[..., None]] = {"ddp": run_ddp, "reduce": run_reduce, "local_sgd": run_local_sgd,
                                           "collective": run_collective}


# ------------------------------------------------------------------------------------------------- dump


def worker(rank: int, size: int, init_file: str, names: list[str], out_dir: str, status, verbose: bool) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        try:
            by_name = {c.name: c for c in configurations([size])}
            tensors, labels = {}, {}
            for name in names:
                config = by_name[name]
                begun = time.perf_counter()
                try:
                    rec = Recording()
                    RUNNERS[config.run](rank, size, config_seed(name), rec, **config.options)
                except BaseException as error:
                    raise RuntimeError(f"configuration {name} failed on rank {rank}") from error
                tensors[name], labels[name] = rec.tensors, rec.labels
                gc.collect()  # DDP models sit in reference cycles
                if verbose and rank == 0:
                    print(f"  {name}: {time.perf_counter() - begun:.2f} s", flush=True)
            torch.save({"tensors": tensors, "labels": labels}, os.path.join(out_dir, f"rank{rank}.pt"))
        finally:
            destroy_process_group()
        status.put((rank, None))
    except BaseException:  # the parent prints it
        status.put((rank, traceback.format_exc()))


def dump_world(size: int, names: list[str], timeout: float, verbose: bool) -> tuple[dict, dict]:
    """Runs ``names`` (configurations of world size ``size``) in one group: ({name: {rank: tensors}}, labels)."""
    ctx = mp.get_context("spawn")
    status = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, size, init_file, names, tmp, status, verbose),
                             daemon=True)
                 for r in range(size)]
        for p in procs:
            p.start()
        failures, done, deadline = [], 0, time.monotonic() + timeout
        try:
            while done < size:
                rank, error = status.get(timeout=max(1.0, deadline - time.monotonic()))
                done += 1
                if error is not None:
                    failures.append(f"P={size} rank {rank} failed:\n{error}")
                    deadline = min(deadline, time.monotonic() + 10.0)  # the others fail soon, or hang
        except Exception:  # queue.Empty
            failures.append(f"P={size}: timed out after {timeout:.0f} s ({done} of {size} ranks reported)")
        finally:
            for p in procs:
                p.join(timeout=10 if not failures else 0.1)
                if p.is_alive():
                    p.kill()
        if failures:
            raise SystemExit("\n".join(failures))
        outputs: dict[str, dict[int, list[torch.Tensor]]] = {name: {} for name in names}
        labels: dict[str, dict[int, list[str]]] = {name: {} for name in names}
        for r in range(size):
            saved = torch.load(os.path.join(tmp, f"rank{r}.pt"))
            for name in names:
                outputs[name][r] = saved["tensors"][name]
                labels[name][r] = saved["labels"][name]
    return outputs, labels


def selected(configs: list[Config], only: list[str] | None) -> list[Config]:
    return [c for c in configs if not only or any(text in c.name for text in only)]


def command_dump(args) -> int:
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    configs = selected(configurations(args.world_sizes), args.only)
    result: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    start = time.perf_counter()
    for size in args.world_sizes:
        names = [c.name for c in configs if c.world_size == size]
        if not names:
            continue
        begun = time.perf_counter()
        outputs, names_labels = dump_world(size, names, args.timeout, args.verbose)
        result.update(outputs)
        labels.update(names_labels)
        print(f"P={size}: {len(names)} configurations in {time.perf_counter() - begun:.1f} s", flush=True)
    result["__labels__"] = labels
    result["__meta__"] = {"torch": str(torch.__version__), "world_sizes": list(args.world_sizes),
                          "gtopk_ext": os.path.dirname(gx.__file__)}
    torch.save(result, args.out)
    count = sum(1 for name in result if not name.startswith("__"))
    print(f"{count} configurations written to {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------- compare


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def first_difference(a: dict, b: dict, labels: dict) -> str | None:
    """None when the ranks' tensors are bitwise equal, else where they first differ."""
    if sorted(a) != sorted(b):
        return f"ranks {sorted(a)} vs {sorted(b)}"
    for rank in sorted(a):
        for index, (x, y) in enumerate(zip(a[rank], b[rank])):
            if not same_tensor(x, y):
                label = labels.get(rank, [])
                what = f" ({label[index]})" if index < len(label) else ""
                detail = (f"{x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
                          if x.dtype != y.dtype or x.shape != y.shape else "bytes")
                return f"rank {rank}, tensor {index}{what}: {detail}"
        if len(a[rank]) != len(b[rank]):
            return f"rank {rank}: {len(a[rank])} vs {len(b[rank])} tensors"
    return None


def without_structure(recorded: dict, labels: dict) -> dict:
    """The ranks' tensors without the structure texts (state dicts that gained keys holding no tensors, such as a
    world size, still align tensor by tensor)."""
    return {rank: [t for t, label in zip(tensors, labels.get(rank, [])) if not label.endswith(":structure")]
            for rank, tensors in recorded.items()}


def command_compare(args) -> int:
    a, b = torch.load(args.a), torch.load(args.b)
    labels = a.get("__labels__", {})
    if args.tensors_only:
        b_labels = b.get("__labels__", {})
        a = {n: without_structure(v, labels.get(n, {})) if not n.startswith("__") else v for n, v in a.items()}
        b = {n: without_structure(v, b_labels.get(n, {})) if not n.startswith("__") else v for n, v in b.items()}
        labels = {n: without_structure(per, per) for n, per in labels.items()}
    names = sorted({n for n in (*a, *b) if not n.startswith("__")}, key=lambda n: (n.split("/")[0], n))
    equal = differ = 0
    for name in names:
        if name not in a or name not in b:
            print(f"{name}: missing in {args.a if name not in a else args.b}")
            differ += 1
            continue
        difference = first_difference(a[name], b[name], labels.get(name, {}))
        if difference is None:
            print(f"{name}: equal")
            equal += 1
        else:
            print(f"{name}: differs: {difference}")
            differ += 1
    print(f"{equal} configs equal, {differ} differ")
    return 1 if differ else 0


def command_list(args) -> int:
    configs = selected(configurations(args.world_sizes), args.only)
    for config in configs:
        print(f"{config.name:60s} {config.options}")
    for size in args.world_sizes:
        print(f"P={size}: {sum(c.world_size == size for c in configs)} configurations")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in ("dump", "list"):
        sub = commands.add_parser(command)
        if command == "dump":
            sub.add_argument("out", help="the .pt file to write")
            sub.add_argument("--timeout", type=float, default=600.0, help="seconds per world size (default 600)")
            sub.add_argument("--verbose", action="store_true", help="print each configuration's time (rank 0)")
        sub.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
        sub.add_argument("--only", nargs="+", metavar="TEXT",
                         help="only the configurations whose name contains one of these")
    sub = commands.add_parser("compare")
    sub.add_argument("a")
    sub.add_argument("b")
    sub.add_argument("--tensors-only", action="store_true",
                     help="leave out the structure texts of recorded state dicts (keys added since A)")
    args = parser.parse_args(argv)
    return {"dump": command_dump, "compare": command_compare, "list": command_list}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
