"""An emulated network, and a CLI that runs a training script under torchrun on emulated nodes: each rank (or node)
in its own network namespace, joined to a bridge by a veth pair that ``tc tbf`` limits on both ends (a full-duplex
port of that rate). Needs root, ``ip`` and ``tc``; what it makes is removed on close, failure, SIGINT and SIGTERM.

    python -m bench.emulated_network torchrun --nnodes 2 --nproc-per-node 2 --rate 1gbit -- \
        examples/train_ddp.py --collective hierarchical
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

SUBNET = "10.77.0"  # private, and only ever assigned inside this module's own namespaces
RANK_IFNAME = "eth0"


def rate_name(bps: int | None) -> str:
    if bps is None:
        return "loopback"
    unit, scale = next(((u, s) for u, s in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)) if bps >= s), ("bit", 1))
    return f"{bps / scale:g}{unit}"


def network_name(rate_bps: int | None) -> str:
    """What a run's ranks talk over: ``rate_bps`` links, or loopback (None)."""
    return "loopback (no shaping)" if rate_bps is None else f"{rate_name(rate_bps)} links (namespaces, tbf)"


def run_ip(*argv: str) -> None:
    result = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(argv)}` failed: {result.stderr.strip()}")


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds like SIGINT, so the callers' finally blocks (and atexit) remove what they made."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class Network(AbstractContextManager):
    """A bridge namespace and ``world_size`` host namespaces (a rank or a node each) linked to it at ``rate_bps``
    (None: unshaped). Closing deletes them with their links: on leaving its ``with`` block, at exit and on SIGTERM."""

    def __init__(self, prefix: str, world_size: int, rate_bps: int | None = None):
        self.bridge_ns = f"{prefix}{os.getpid()}-br"
        self.rank_ns = [f"{prefix}{os.getpid()}-r{rank}" for rank in range(world_size)]
        self.created: list[str] = []
        atexit.register(self.close)
        unwind_on_sigterm()
        try:
            for ns in [self.bridge_ns, *self.rank_ns]:
                run_ip("netns", "add", ns)
                self.created.append(ns)
            run_ip("-n", self.bridge_ns, "link", "add", "br0", "up", "type", "bridge")
            # tbf's bucket holds 1 ms of traffic (at least a few frames): a message passes at most 1 ms early.
            tbf = ["root", "tbf", "rate", str(rate_bps), "burst", str(max(4096, (rate_bps or 0) // 8000)),
                   "latency", "50ms"]
            for rank, ns in enumerate(self.rank_ns):
                run_ip("-n", ns, "link", "add", RANK_IFNAME, "up", "type", "veth", "peer", "name", f"p{rank}",
                       "netns", self.bridge_ns)
                run_ip("-n", self.bridge_ns, "link", "set", f"p{rank}", "master", "br0", "up")
                run_ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", RANK_IFNAME)
                run_ip("-n", ns, "link", "set", "lo", "up")
                if rate_bps is not None:  # both directions: rank -> bridge and bridge -> rank
                    run_ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", RANK_IFNAME, *tbf)
                    run_ip("netns", "exec", self.bridge_ns, "tc", "qdisc", "replace", "dev", f"p{rank}", *tbf)
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def close(self) -> None:
        while self.created:
            subprocess.run(["ip", "netns", "del", self.created.pop()], capture_output=True)

    def tx_bytes(self) -> list[int]:
        """Bytes each host has sent on its link so far."""
        return [int(subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{RANK_IFNAME}/statistics/"
                                    "tx_bytes"], capture_output=True, text=True, check=True).stdout)
                for ns in self.rank_ns]


def cleanup_stale(prefix: str) -> list[str]:
    """Deletes the namespaces of earlier runs with this prefix whose process is gone; returns their names."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)-(br|r\d+)")
    stale = [name for name in (line.split()[0] for line in listing.splitlines() if line.strip())
             if (match := pattern.fullmatch(name)) and not Path(f"/proc/{match[1]}").exists()]
    for name in stale:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return stale


def check_can_emulate() -> str | None:
    """Why the emulated network cannot run here, or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces and tc); run it as root, or use --loopback (no shaping)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"`{missing[0]}` (iproute2) is not installed; install iproute2, or use --loopback" if missing else None


class TxCounter:
    """Bytes sent on one interface of this process's network namespace (``None`` interface: not counted)."""

    def __init__(self, ifname: str | None):
        self.path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes") if ifname else None

    def read(self) -> int:
        return int(self.path.read_text()) if self.path else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.harness import cli  # here: the harness imports this module

    parser = cli.parser(__doc__)
    torchrun = parser.add_subparsers(dest="command", required=True).add_parser(
        "torchrun", help="python -m bench.emulated_network torchrun [options] -- script.py [script arguments]")
    torchrun.add_argument("--nnodes", type=int, default=2)
    torchrun.add_argument("--nproc-per-node", type=int, default=2)
    torchrun.add_argument("--max-restarts", type=int, default=0)
    cli.add_network_args(torchrun, prefix="gxtr")
    torchrun.add_argument("script", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = parser.parse_args(argv)
    args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.script:
        parser.error("name the training script after --")
    return args


def main(argv: list[str] | None = None) -> None:
    from bench.harness import cli
    from bench.harness.launch import run_torchrun

    args = parse_args(argv)
    rate = cli.link_rate("bench.emulated_network", args)
    with (nullcontext() if rate is None else Network(args.prefix, args.nnodes, rate)) as network, \
            tempfile.TemporaryDirectory() as workdir:
        print(f"{args.nnodes} nodes x {args.nproc_per_node} ranks over {network_name(rate)}", flush=True)
        before = network.tx_bytes() if network else []
        run_torchrun(args.script, args.nnodes, args.nproc_per_node, network, Path(workdir), f"run{os.getpid()}",
                     args.timeout, args.max_restarts)
        if network:
            sent = [after - b for after, b in zip(network.tx_bytes(), before)]
            print(f"bytes sent on the inter-node links: {sum(sent)} ({', '.join(map(str, sent))} per node)")


if __name__ == "__main__":
    main()
