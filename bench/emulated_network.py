"""An emulated network for multi-process benchmarks: every rank in its own network namespace, linked to a bridge
through a veth pair whose both ends ``tc tbf`` limits to a rate, so a link behaves as a full-duplex Ethernet port
of that rate. Needs root, ``ip`` and ``tc`` (iproute2) with tbf; everything it creates is removed on close, on
failure and on SIGINT/SIGTERM. The addresses (10.77.0.0/24) exist only inside these namespaces.

bench/harness/launch.py starts the ranks inside them: a benchmark's workers (``run_group``), or one torchrun agent
per emulated node (``run_torchrun``: a namespace holds a node's ranks, which talk to each other over its loopback,
unshaped); ``python -m bench.emulated_network torchrun ...`` runs a training script that way:

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
from contextlib import nullcontext
from pathlib import Path

SUBNET = "10.77.0"  # private, and only ever assigned inside this module's own namespaces
RANK_IFNAME = "eth0"
def parse_rate(text: str) -> int:
    """'1gbit', '100mbit', '250kbit' or a plain number of bits per second -> bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"rate must look like 1gbit, 100mbit or 5e8, got {text!r}")
    return int(float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]])


def rate_name(bps: int | None) -> str:
    if bps is None:
        return "loopback"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps}bit"


def run_ip(*argv: str) -> None:
    result = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(argv)}` failed: {result.stderr.strip()}")


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds like SIGINT, so the callers' finally blocks (and atexit) remove what they made."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class Network:
    """One bridge namespace and ``world_size`` host namespaces (a rank each, or a node's ranks under torchrun),
    each linked to the bridge by a veth pair, limited to ``rate_bps`` (None: unshaped). ``close()`` deletes the
    namespaces, which deletes every link and qdisc in them: on leaving its ``with`` block, at exit and on SIGTERM."""

    def __init__(self, prefix: str, world_size: int, rate_bps: int | None = None):
        self.bridge_ns = f"{prefix}{os.getpid()}-br"
        self.rank_ns = [f"{prefix}{os.getpid()}-r{rank}" for rank in range(world_size)]
        self.created: list[str] = []
        atexit.register(self.close)
        unwind_on_sigterm()
        try:
            self._build()
            if rate_bps is not None:
                self.limit(rate_bps)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        run_ip("netns", "add", name)
        self.created.append(name)

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        run_ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        run_ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for rank, ns in enumerate(self.rank_ns):
            self._add_ns(ns)
            run_ip("-n", ns, "link", "add", RANK_IFNAME, "type", "veth", "peer", "name", f"p{rank}", "netns",
                   self.bridge_ns)
            run_ip("-n", self.bridge_ns, "link", "set", f"p{rank}", "master", "br0")
            run_ip("-n", self.bridge_ns, "link", "set", f"p{rank}", "up")
            run_ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", RANK_IFNAME)
            run_ip("-n", ns, "link", "set", RANK_IFNAME, "up")
            run_ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def limit(self, rate_bps: int) -> None:
        """tbf on both ends of every link: rank -> bridge and bridge -> rank, each at ``rate_bps``."""
        # The bucket holds 1 ms of traffic (at least a few full frames): a message passes at most 1 ms early.
        # tbf splits larger GSO segments into frames, so a small bucket does not drop them.
        burst = max(4096, rate_bps // 8 // 1000)
        tbf = ["root", "tbf", "rate", str(rate_bps), "burst", str(burst), "latency", "50ms"]
        for rank, ns in enumerate(self.rank_ns):
            run_ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", RANK_IFNAME, *tbf)
            run_ip("netns", "exec", self.bridge_ns, "tc", "qdisc", "replace", "dev", f"p{rank}", *tbf)

    def close(self) -> None:
        while self.created:
            name = self.created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def cleanup_stale(prefix: str) -> list[str]:
    """Deletes the namespaces of earlier runs with this prefix whose process is gone; returns their names."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{re.escape(prefix)}(\d+)-(br|r\d+)", name)
        if match and not Path(f"/proc/{match[1]}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def check_can_emulate() -> str | None:
    """Why the emulated network cannot run here, or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces and tc); run it as root, or use --loopback (no shaping)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2, or use --loopback"
    return None


def runs_on_loopback(program: str, loopback: bool) -> bool:
    """Whether ``program`` runs on loopback: asked for, or the emulated network cannot run here (said on stderr)."""
    if loopback:
        return True
    reason = check_can_emulate()
    if reason:
        print(f"{program}: no emulated network ({reason}); running on loopback", file=sys.stderr)
    return reason is not None


def network_name(rate_bps: int | None) -> str:
    """What a run's ranks talk over: ``rate_bps`` links, or loopback (None)."""
    return "loopback (no shaping)" if rate_bps is None else f"{rate_name(rate_bps)} links (namespaces, tbf)"


class TxCounter:
    """Bytes sent on one interface of this process's network namespace (``None`` interface: not counted)."""

    def __init__(self, ifname: str | None):
        self.path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes") if ifname else None

    def read(self) -> int:
        return int(self.path.read_text()) if self.path else 0


def node_tx_bytes(network: Network) -> list[int]:
    """Bytes each node has sent on its link so far."""
    return [int(subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{RANK_IFNAME}/statistics/tx_bytes"],
                               capture_output=True, text=True, check=True).stdout) for ns in network.rank_ns]


def main(argv: list[str] | None = None) -> None:
    from bench.harness import cli  # here: the harness imports this module
    from bench.harness.launch import run_torchrun

    parser = argparse.ArgumentParser(description="Run a training script under torchrun on emulated nodes: one "
                                                 "network namespace and one torchrun agent per node, the node's "
                                                 "ranks inside it, a tbf-limited link from each node to a switch.")
    commands = parser.add_subparsers(dest="command", required=True)
    torchrun = commands.add_parser("torchrun", help="python -m bench.emulated_network torchrun [options] -- "
                                                    "script.py [script arguments]")
    torchrun.add_argument("--nnodes", type=int, default=2)
    torchrun.add_argument("--nproc-per-node", type=int, default=2)
    torchrun.add_argument("--max-restarts", type=int, default=0)
    cli.add_network_args(torchrun, prefix="gxtr")
    torchrun.add_argument("script", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the training script after --")
    rate = cli.link_rate("bench.emulated_network", args)
    with (nullcontext() if rate is None else Network(args.prefix, args.nnodes, rate)) as network, \
            tempfile.TemporaryDirectory() as workdir:
        print(f"{args.nnodes} nodes x {args.nproc_per_node} ranks over {network_name(rate)}", flush=True)
        before = node_tx_bytes(network) if network else []
        run_torchrun(script, args.nnodes, args.nproc_per_node, network, Path(workdir), f"run{os.getpid()}",
                     args.timeout, args.max_restarts)
        if network:
            sent = [after - b for after, b in zip(node_tx_bytes(network), before)]
            print(f"bytes sent on the inter-node links: {sum(sent)} ({', '.join(map(str, sent))} per node)")

if __name__ == "__main__":
    main()
