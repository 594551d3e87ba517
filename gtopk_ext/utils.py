"""Helpers around torch.distributed that every multi-process program using gtopk_ext needs."""

from __future__ import annotations

import gc

import torch.distributed as dist

from gtopk_ext import _worker, hierarchical


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` after closing the background workers (the DDP hooks', WAGMA's rounds),
    letting go of the hierarchical collective's node groups and freeing the objects that still hold a group (DDP
    models sit in reference cycles), so that the groups and their worker threads end while the interpreter is fully
    alive.

    Left to the interpreter's exit, a thread that is inside a torch call (a Gloo worker dropping a finished work,
    a hook thread waiting for a peer) takes the GIL during finalization, which ends the thread by unwinding a
    noexcept destructor: the process aborts with "terminate called without an active exception" after its work
    is done (seen in about 1 run in 10).

    With no default process group (never initialized, or already destroyed) it closes the workers and returns:
    like closing a file twice, so that it can sit in a ``finally`` block whether or not the group was made
    (``torch.distributed.destroy_process_group()`` raises a bare ``AssertionError`` there)."""
    _worker.close_workers()
    hierarchical.forget_node_groups()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
