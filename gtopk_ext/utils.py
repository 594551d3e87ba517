"""Helpers around torch.distributed that every multi-process program using gtopk_ext needs."""

from __future__ import annotations

import gc

import torch.distributed as dist

from gtopk_ext import _worker, hierarchical


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` after closing the background workers (the DDP hooks', WAGMA's rounds),
    letting go of the hierarchical collective's node groups and freeing the objects that still hold a group (DDP
    models sit in reference cycles): left to the interpreter's exit, a thread inside a torch call can abort the
    process ("terminate called without an active exception") after its work is done. Without a default process
    group it only closes the workers, so that it can sit in a ``finally`` block."""
    _worker.close_workers()
    hierarchical.forget_node_groups()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
