"""The route of one bucket through gtopk_ext, traced at run time: which of the package's files a steady sparse step
of the DDP hook passes through, in order (docs/architecture.md, "One bucket through the DDP hook").

    python scripts/bucket_route.py [--collective gtopk] [--wire plain]

Two ranks on a Gloo group train a 2-layer MLP in one DDP bucket with ``SparseGradState(density=0.01,
path="sparse")`` (the other settings the defaults); rank 0's sixth step is traced (every thread: the hook runs
on the state's worker). Two counts, each as file visits (a change of file, by a call or a return), returns to a
file already left, and files:

- every call: each function of the package that the step runs, what a reader follows from the hook to the
  kernels and back;
- the bucket's tensor: only the calls that receive the bucket's buffer or a view of it as an argument.
"""

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from gtopk_ext.utils import destroy_process_group

PACKAGE = str(Path(gx.__file__).parent) + os.sep
TRACED_STEP = 5


class Tracer:
    """The hook's state for ``traced_hook``, and a profile function that records (thread, event, file, whether an
    argument is the bucket's storage, frame)."""

    def __init__(self, state: gx.SparseGradState):
        self.state, self.on, self.storage, self.events = state, False, None, []

    def __call__(self, frame, event, arg):
        filename = frame.f_code.co_filename
        if not self.on or event not in ("call", "return") or not filename.startswith(PACKAGE):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        passed = event == "call" and any(
            isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == self.storage
            for value in (frame.f_locals.get(name) for name in names))
        self.events.append((threading.get_ident(), event, filename[len(PACKAGE):], passed, id(frame)))


def visits(events, only_passed: bool) -> list[str]:
    """The file the step is in after each call and return (of the calls that pass the bucket, if only_passed),
    one entry per stay; thread by thread, in the order the threads start (interleaved, the count would vary)."""
    route = []
    for thread in dict.fromkeys(thread for thread, *_ in events):
        stack, followed = [], set()
        for _, event, filename, passed, frame in (e for e in events if e[0] == thread):
            if event == "call" and (passed or not only_passed):
                stack.append(filename)
                followed.add(frame)
                route.append(filename)
            elif event == "return" and frame in followed:
                followed.discard(frame)
                stack.pop()
                if stack:
                    route.append(stack[-1])
    return [f for i, f in enumerate(route) if i == 0 or route[i - 1] != f]


def describe(title: str, route: list[str]) -> str:
    returns = sum(f in route[:i] for i, f in enumerate(route))
    return (f"{title}: {len(route)} file visits, {returns} returns to a file already left, {len(set(route))} files\n"
            f"  {' -> '.join(route)}")


def traced_hook(tracer: Tracer, bucket):
    tracer.storage = bucket.buffer().untyped_storage().data_ptr()
    return gx.sparse_grad_hook(tracer.state, bucket)


def run(rank: int, world_size: int, init: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)))
    tracer = Tracer(gx.SparseGradState(density=0.01, path="sparse", collective=args.collective, wire=args.wire))
    model.register_comm_hook(tracer, traced_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        sys.setprofile(tracer)
        threading.setprofile(tracer)
    for step in range(TRACED_STEP + 1):
        x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
        optimizer.zero_grad()
        tracer.on = rank == 0 and step == TRACED_STEP
        nn.functional.cross_entropy(model(x), y).backward()
        tracer.state.worker.drain()
        tracer.on = False
        optimizer.step()
    sys.setprofile(None)
    threading.setprofile(None)
    if rank == 0:
        print(describe("every call", visits(tracer.events, only_passed=False)))
        print(describe("the bucket's tensor", visits(tracer.events, only_passed=True)))
    destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective", default="gtopk", choices=sorted(gx.collectives.COLLECTIVES))
    parser.add_argument("--wire", default="plain", choices=sorted(gx.wire.WIRES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(2, f"file://{tmp}/rendezvous", args), nprocs=2)


if __name__ == "__main__":
    main()
