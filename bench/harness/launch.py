"""One way to run a benchmark's ranks: ``python -m <module> --worker <config>`` once per rank
(bench/emulated_network.py's ``run_ranks``), on loopback or each rank (or node) in its own network namespace, and
rank 0's result back."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.emulated_network import Networks, cleanup_stale, join_group, run_ranks
from bench.harness.report import jsonable


def run_group(module: str, world_size: int, settings, timeout: float, *, rate_bps: int | None = None,
              namespaces: bool = False, prefix: str = "gx", ranks_per_host: int = 1, **config):
    """Runs the ranks of ``module`` on loopback, or (``rate_bps`` given, or ``namespaces``) each host of
    ``ranks_per_host`` ranks in its own namespace behind a link of ``rate_bps`` (None: unshaped), the namespaces
    named ``<prefix><pid>-...``. The worker gets ``config`` plus ``args`` (``settings``), ``out`` and ``tty``
    (whether the driver's output is a terminal); returns what rank 0 wrote (JSON)."""
    namespaces = namespaces or rate_bps is not None
    if namespaces:
        cleanup_stale(prefix)
    networks = Networks(prefix)
    name = module.rsplit(".", 1)[-1]
    try:
        with tempfile.TemporaryDirectory(prefix=f"{name}_") as tmp:
            network = networks.create(world_size // ranks_per_host, rate_bps) if namespaces else None
            out = Path(tmp) / "out.json"
            config = {**config, "args": jsonable(settings), "out": str(out), "tty": sys.stdout.isatty()}
            run_ranks(module, world_size, network, config, Path(tmp), name, timeout, ranks_per_host=ranks_per_host)
            return json.loads(out.read_text())
    finally:
        networks.close()


def as_rank(config: dict, work, timeout_arg: str | None = None) -> None:
    """In a worker: joins the group, runs ``work(args, rank, world_size, config)`` and, on rank 0, writes what it
    returns (unless None) to ``config["out"]``."""
    from gtopk_ext.utils import destroy_process_group

    args, rank, world_size = join_group(config, timeout_arg)
    try:
        result = work(args, rank, world_size, config)
        if rank == 0 and result is not None:
            Path(config["out"]).write_text(json.dumps(result))
    finally:
        destroy_process_group()
