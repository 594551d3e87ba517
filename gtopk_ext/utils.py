"""Helpers around torch.distributed that every multi-process program using gtopk_ext needs."""

from __future__ import annotations

import gc

import torch.distributed as dist

from gtopk_ext import _worker, hierarchical


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` after closing the background workers (the DDP hooks', WAGMA's rounds) and
    letting go of every object that holds a group: left to the interpreter's exit, their threads can abort the
    process. Without a default process group it only closes the workers (it can sit in a ``finally`` block)."""
    _worker.close_workers()
    hierarchical.cached_node_groups.clear()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
