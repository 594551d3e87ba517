"""How the benchmarks start processes, on loopback or emulated links: once per rank, or a torchrun agent per node."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from bench.emulated_network import RANK_IFNAME, Network, cleanup_stale, unwind_on_sigterm
from bench.harness.report import jsonable

ROOT = Path(__file__).resolve().parents[2]
GLOO_PORT = 29500  # each run has its own namespaces, hence its own port space
RDZV_PORT = 29400  # torchrun's rendezvous store, on the first node
# A fresh store per rendezvous round: the one the agents share by default keeps a failed attempt's keys, where a
# restarted worker can read a dead peer's address (Gloo: connection refused) or the failure the hook published.
RESTARTABLE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def free_port() -> int:
    """A loopback port free now and below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be
    taken by another connection's local end before the store binds it (EADDRINUSE; seen in CI)."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    ports = range(10000, max(first_ephemeral, 10001))
    for port in random.Random().sample(ports, min(200, len(ports))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000-{first_ephemeral - 1}")


def run_on_hosts(commands: list[list[str]], network: Network | None, workdir: Path, names: list[str],
                 timeout: float, env: dict[str, str] | None = None, ranks_per_host: int = 1) -> list[str]:
    """Runs ``commands[i]`` in host namespace i // ``ranks_per_host`` (or on loopback), Gloo on its interface, logged
    to ``workdir/log-<names[i]>.txt``; streams the first log, returns every log, raises with a failed one's."""
    unwind_on_sigterm()  # the finally below kills the processes
    env = dict(os.environ, GLOO_SOCKET_IFNAME=RANK_IFNAME if network else "lo", OMP_NUM_THREADS="1", **(env or {}))
    logs, procs, shown = [workdir / f"log-{name}.txt" for name in names], [], 0
    try:
        for host, (command, log) in enumerate(zip(commands, logs)):
            netns = ["ip", "netns", "exec", network.rank_ns[host // ranks_per_host]] if network else []
            with open(log, "w") as out:
                procs.append(subprocess.Popen(netns + command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while True:
            text = logs[0].read_text()
            print(text[shown:], end="", flush=True)
            shown = len(text)
            codes = [proc.poll() for proc in procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                tail = logs[failed[0]].read_text()[-3000:]
                raise RuntimeError(f"rank {failed[0]} exited with status {codes[failed[0]]}:\n{tail}")
            if all(code == 0 for code in codes):
                return [log.read_text() for log in logs]
            if time.monotonic() > deadline:
                raise TimeoutError(f"the group did not finish within --group-timeout {timeout:g} s")
            time.sleep(0.5)
    finally:
        for proc in procs:  # a no-op on those that have exited
            proc.kill()
            proc.wait()


def run_torchrun(script: list[str], nnodes: int, nproc_per_node: int, network: Network | None, workdir: Path,
                 name: str, timeout: float, max_restarts: int = 0, env: dict[str, str] | None = None) -> list[str]:
    """Runs ``script`` (and its arguments) under one torchrun agent per node, each in its node's namespace (or all
    on loopback); the agents meet by c10d rendezvous at the first node's. Returns every node's log."""
    endpoint = f"{Network.address(0)}:{RDZV_PORT}" if network else f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
                 str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", name,
                 "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", str(max_restarts),
                 # else torchrun advertises the machine's hostname, unknown inside a namespace
                 *(["--local-addr", Network.address(node)] if network else []), *script] for node in range(nnodes)]
    return run_on_hosts(commands, network, workdir, [f"{name}-node{node}" for node in range(nnodes)], timeout,
                        {**RESTARTABLE_ENV, **(env or {})})


def run_group(module: str, world_size: int, settings, timeout: float, *, rate_bps: int | None = None,
              namespaces: bool = False, prefix: str = "gx", ranks_per_host: int = 1, **config):
    """Runs ``python -m <module> --worker <file>`` per rank, on loopback or (``rate_bps`` or ``namespaces``) each
    host of ``ranks_per_host`` ranks in a namespace behind a ``rate_bps`` link (None: unshaped). The file holds
    ``config``, ``args`` (``settings``), the rank, the group's address and ``ifname`` (the interface whose bytes a
    rank may count; None on loopback). Returns rank 0's result."""
    namespaces = namespaces or rate_bps is not None
    if namespaces:
        cleanup_stale(prefix)
    name = module.rsplit(".", 1)[-1]
    with (Network(prefix, world_size // ranks_per_host, rate_bps) if namespaces else nullcontext()) as network, \
            tempfile.TemporaryDirectory(prefix=f"{name}_") as tmp:
        out, commands = Path(tmp) / "out.json", []
        config = {**config, "args": jsonable(settings), "out": str(out), "tty": sys.stdout.isatty(),
                  "world_size": world_size, "master_addr": Network.address(0) if network else "127.0.0.1",
                  "port": GLOO_PORT if network else free_port(), "ifname": RANK_IFNAME if network else None}
        for rank in range(world_size):
            path = Path(tmp) / f"config-{name}-r{rank}.json"
            path.write_text(json.dumps({**config, "rank": rank}))
            commands.append([sys.executable, "-m", module, "--worker", str(path)])
        run_on_hosts(commands, network, Path(tmp), [f"{name}-r{rank}" for rank in range(world_size)], timeout,
                     ranks_per_host=ranks_per_host)
        return json.loads(out.read_text())


def as_rank(config: dict, work, timeout_arg: str | None = None) -> None:
    """In a worker of ``run_group``: one intra-op thread (the ranks share the cores), the Gloo group (timeout:
    ``args.<timeout_arg>`` s, or torch's), then ``work(args, rank, world_size, config)``, whose result rank 0 writes."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gtopk_ext.utils import destroy_process_group

    torch.set_num_threads(1)
    args, rank, world_size = argparse.Namespace(**config["args"]), config["rank"], config["world_size"]
    timeout = {} if timeout_arg is None else {"timeout": timedelta(seconds=getattr(args, timeout_arg))}
    dist.init_process_group("gloo", init_method=f"tcp://{config['master_addr']}:{config['port']}", rank=rank,
                            world_size=world_size, **timeout)
    try:
        result = work(args, rank, world_size, config)
        if rank == 0 and result is not None:
            Path(config["out"]).write_text(json.dumps(result))
    finally:
        destroy_process_group()
