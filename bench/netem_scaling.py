"""Scaling on an emulated network: dense allreduce, TopK-SGD's sparse allgather and gTop-k over links limited with
``tc tbf``, with the bytes each rank actually put on its link.

Every rank runs in its own network namespace with one veth link to a bridge in a namespace of its own, all of
them created by this script (names ``<prefix><pid>-...``, addresses 10.77.0.0/24 that exist only inside them).
Both ends of every link are limited with ``tc tbf`` to the rate under test, so a link behaves as a full-duplex
Ethernet port of that rate. Gloo binds to the namespace's interface; bytes sent per rank come from the
interface's ``tx_bytes`` counter (TCP/IP headers and ACKs included), next to the model's payload bytes.

For each world size P, rate, gradient size n and density: time per exchange (the slowest rank's, median over
repetitions), bytes sent per rank, and each rank's Gaussian-k selection time (ranks select one at a time, so the
2-core machine's contention does not inflate it). Exchanges whose predicted wire time exceeds
``--max-wire-seconds`` are skipped and listed (by default: dense 100M and 25M on 100 Mbit/s).
Needs root, ``ip`` and ``tc`` with tbf; without them it says so and exits with status 2. Everything it creates
is removed on exit, on failure and on SIGINT/SIGTERM; ``--cleanup`` removes what a killed run left behind.

    python -m bench.netem_scaling --json bench_netem.json          # full run, ~10 minutes on 2 cores
    python -m bench.netem_scaling --loopback --sizes 100000 --world-sizes 2   # no namespaces, no shaping
    python -m bench.netem_scaling --cleanup
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("dense", "allgather", "gtopk")
SUBNET = "10.77.0"  # private, and only ever assigned inside this script's own namespaces
RANK_IFNAME = "eth0"
GLOO_PORT = 29500  # each run has its own namespaces, hence its own port space
BARRIER_PROBES = 20  # barriers timed to subtract their bytes from each measurement


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


def density_k(density: float, numel: int) -> int:
    from gtopk_ext.compressors import k_for_density  # the compressor's own k
    return k_for_density(density, numel)


def payload_bytes_per_rank(method: str, numel: int, k: int, world_size: int) -> int:
    """Bytes a rank sends in one exchange under the standard models (ring allreduce and allgather, butterfly)."""
    if method == "dense":
        return 2 * (world_size - 1) * numel * 4 // world_size
    packed = 4 + 8 * k  # the collectives' payload: count, k int32 indices, k fp32 values
    if method == "allgather":
        return (world_size - 1) * packed
    rounds = int(math.log2(world_size))
    return rounds * packed


@dataclass(frozen=True)
class Plan:
    """What one exchange configuration does: skipped (with why) or repeated ``repeats`` times."""

    predicted_s: float | None
    repeats: int
    skip: str | None


def plan_exchange(method: str, numel: int, k: int, world_size: int, rate_bps: int | None,
                  args: argparse.Namespace) -> Plan:
    """The same on every rank: a pure function of the configuration. Repetitions fill ``--seconds-per-config``
    of predicted wire time, between 1 and ``--repeats``."""
    if rate_bps is None:
        return Plan(None, args.repeats, None)
    predicted = payload_bytes_per_rank(method, numel, k, world_size) * 8 / rate_bps
    if predicted > args.max_wire_seconds:
        return Plan(predicted, 0, f"predicted {predicted:.0f} s per exchange > --max-wire-seconds "
                                  f"{args.max_wire_seconds:g}")
    return Plan(predicted, max(1, min(args.repeats, int(args.seconds_per_config / max(predicted, 1e-9)))), None)


# ----------------------------------------------------------------------------------------------- worker side

class TxCounter:
    """Bytes sent on one interface of this process's network namespace (``None`` interface: not counted)."""

    def __init__(self, ifname: str | None):
        self.path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes") if ifname else None

    def read(self) -> int:
        return int(self.path.read_text()) if self.path else 0


def run_worker(config: dict) -> None:
    """One rank: joins the Gloo group, measures every configuration, rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    import gtopk_ext as gx
    from bench.processes import destroy_process_group

    torch.set_num_threads(1)
    args = argparse.Namespace(**config["args"])
    rank, world_size, rate_bps = config["rank"], config["world_size"], config["rate_bps"]
    dist.init_process_group("gloo", init_method=f"tcp://{config['master_addr']}:{config['port']}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.group_timeout))
    counter = TxCounter(config["ifname"])

    def all_max(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def per_rank(value: float) -> list[float]:
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(gathered, torch.tensor([value], dtype=torch.float64))
        return [g.item() for g in gathered]

    # Bytes of one barrier (each measurement is bracketed by barriers whose traffic is not the exchange's).
    dist.barrier()
    start = counter.read()
    for _ in range(BARRIER_PROBES):
        dist.barrier()
    barrier_bytes = (counter.read() - start) / BARRIER_PROBES

    def measure(exchange, repeats: int) -> dict:
        times = []
        dist.barrier()
        start_bytes = counter.read()
        for _ in range(repeats):
            dist.barrier()
            start_time = time.perf_counter()
            exchange()
            times.append(time.perf_counter() - start_time)
        dist.barrier()
        sent = (counter.read() - start_bytes - (repeats + 1) * barrier_bytes) / repeats
        slowest = all_max(times)
        sent_per_rank = per_rank(sent)
        return {"time_s": statistics.median(slowest), "times_s": slowest,
                "tx_bytes": statistics.mean(sent_per_rank) if config["ifname"] else None,
                "tx_bytes_per_rank": sent_per_rank if config["ifname"] else None}

    # Warm-up: every collective once on a small message, with the collectives' header checks on.
    warm = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    warm_msg = gx.make_compressor("gaussiank", density=0.01).compress(warm)
    dist.all_reduce(warm.clone())
    gx.collectives.sparse_allgather(warm_msg)
    gx.collectives.gtopk_allreduce(warm_msg)

    rows = []
    for numel in args.sizes:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + 1))
        messages, select_s = {}, {}
        for density in args.densities:
            compressor = gx.make_compressor("gaussiank", density=density)
            for turn in range(world_size):  # one rank at a time: the selection time of an idle machine
                dist.barrier()
                if turn == rank:
                    start_time = time.perf_counter()
                    messages[density] = compressor.compress(grad)
                    elapsed = time.perf_counter() - start_time
            select_s[density] = per_rank(elapsed)
        for method in args.methods:
            for density in ([None] if method == "dense" else args.densities):
                k = numel if density is None else messages[density].k
                plan = plan_exchange(method, numel, k, world_size, rate_bps, args)
                row = {"method": method, "numel": numel, "density": density, "k": k, "world_size": world_size,
                       "rate_bps": rate_bps, "rate": rate_name(rate_bps), "repeats": plan.repeats,
                       "model_bytes": payload_bytes_per_rank(method, numel, k, world_size),
                       "predicted_wire_s": plan.predicted_s,
                       "select_s": None if density is None else statistics.median(select_s[density]),
                       "cores": os.cpu_count(), "skipped": plan.skip}
                if plan.skip is None:
                    row.update(measure(exchange_for(method, grad, messages.get(density)), plan.repeats))
                rows.append(row)
                if rank == 0:
                    print(format_row(row), flush=True)
        del grad, messages
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(rows))
    dist.barrier()
    destroy_process_group()


def exchange_for(method: str, grad, msg):
    """The exchange to time: one call of the collective, with the header agreement off (as the DDP hook runs
    it after the warm-up has checked the headers)."""
    import torch.distributed as dist

    from gtopk_ext import collectives

    if method == "dense":
        return lambda: dist.all_reduce(grad)
    if method == "allgather":
        return lambda: collectives.sparse_allgather(msg, check=False)
    return lambda: collectives.gtopk_allreduce(msg, check=False)


# ------------------------------------------------------------------------------------------ namespaces (root)

def run_ip(*argv: str) -> None:
    result = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(argv)}` failed: {result.stderr.strip()}")


class Network:
    """One bridge namespace and ``world_size`` rank namespaces, each rank linked to the bridge by a veth pair.
    ``close()`` deletes the namespaces, which deletes every link and qdisc in them."""

    def __init__(self, prefix: str, world_size: int):
        self.bridge_ns = f"{prefix}{os.getpid()}-br"
        self.rank_ns = [f"{prefix}{os.getpid()}-r{rank}" for rank in range(world_size)]
        self.created: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

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


# ------------------------------------------------------------------------------------------------- the driver

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(world_size: int, rate_bps: int | None, network: Network | None, args: argparse.Namespace,
              workdir: Path) -> list[dict]:
    """Starts one process per rank (inside its namespace when there is a network) and returns rank 0's rows."""
    out = workdir / f"rows-p{world_size}-{rate_name(rate_bps)}.json"
    master = Network.address(0) if network else "127.0.0.1"
    port = GLOO_PORT if network else free_port()
    worker_args = {key: value for key, value in vars(args).items() if key not in ("json", "worker")}
    procs, logs = [], []
    try:
        for rank in range(world_size):
            config = {"args": worker_args, "rank": rank, "world_size": world_size, "rate_bps": rate_bps,
                      "master_addr": master, "port": port, "ifname": RANK_IFNAME if network else None,
                      "out": str(out)}
            config_path = workdir / f"config-{world_size}-{rank}.json"
            config_path.write_text(json.dumps(config))
            command = [sys.executable, "-m", "bench.netem_scaling", "--worker", str(config_path)]
            if network:
                command = ["ip", "netns", "exec", network.rank_ns[rank], *command]
            env = dict(os.environ, GLOO_SOCKET_IFNAME=RANK_IFNAME if network else "lo", OMP_NUM_THREADS="1")
            log = open(workdir / f"log-p{world_size}-{rate_name(rate_bps)}-r{rank}.txt", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        wait_all(procs, logs, args.group_timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    return json.loads(out.read_text())


def wait_all(procs: list[subprocess.Popen], logs: list, timeout: float) -> None:
    """Waits for every rank, streaming rank 0's table; raises with the failing rank's log if one fails."""
    deadline = time.monotonic() + timeout
    shown = 0
    while True:
        logs[0].flush()
        text = Path(logs[0].name).read_text()
        print(text[shown:], end="", flush=True)
        shown = len(text)
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            tail = Path(logs[failed[0]].name).read_text()[-3000:]
            raise RuntimeError(f"rank {failed[0]} exited with status {codes[failed[0]]}:\n{tail}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the group did not finish within --group-timeout {timeout:g} s")
        time.sleep(0.5)


HEADER = (f"{'P':>2} {'rate':>8} {'method':>9} {'n':>10} {'density':>7} {'k':>9} {'reps':>4} {'ms/exch':>9} "
          f"{'MB sent':>9} {'MB model':>9} {'sent/model':>10} {'select ms':>9}")


def format_row(row: dict) -> str:
    density = "-" if row["density"] is None else f"{row['density']:g}"
    select = "-" if row["select_s"] is None else f"{row['select_s'] * 1e3:.1f}"
    start = (f"{row['world_size']:>2} {row['rate']:>8} {row['method']:>9} {row['numel']:>10} {density:>7} "
             f"{row['k']:>9} {row['repeats']:>4} ")
    if row["skipped"]:
        return start + f"skipped: {row['skipped']}"
    sent = row["tx_bytes"]
    sent_text = "-" if sent is None else f"{sent / 1e6:.3f}"
    ratio = "-" if sent is None else f"{sent / row['model_bytes']:.3f}"
    return (start + f"{row['time_s'] * 1e3:>9.1f} {sent_text:>9} {row['model_bytes'] / 1e6:>9.3f} {ratio:>10} "
            f"{select:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: int(float(s)), nargs="+", default=[1_000_000, 25_000_000,
                                                                                     100_000_000])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rates", type=parse_rate, nargs="+", default=[parse_rate("1gbit"), parse_rate("100mbit")],
                        help="link rates (tbf), e.g. 1gbit 100mbit")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=5, help="most repetitions of one exchange")
    parser.add_argument("--seconds-per-config", type=float, default=2.0,
                        help="repetitions fill this much predicted wire time (at least 1, at most --repeats)")
    parser.add_argument("--max-wire-seconds", type=float, default=6.0,
                        help="skip exchanges whose predicted wire time is longer")
    parser.add_argument("--group-timeout", type=float, default=900.0, help="seconds one process group may take")
    parser.add_argument("--loopback", action="store_true",
                        help="no namespaces and no shaping: plain processes on 127.0.0.1 (bytes not counted)")
    parser.add_argument("--prefix", default="gxnet", help="name prefix of the namespaces this run creates")
    parser.add_argument("--cleanup", action="store_true",
                        help="only delete namespaces left by killed runs (this prefix, process gone), then exit")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(json.loads(args.worker.read_text()))
        return 0
    problems = [f"--world-sizes must be powers of two >= 2 (the models assume full butterflies), got {p}"
                for p in args.world_sizes if p < 2 or p & (p - 1)]
    problems += [f"--densities must be in (0, 1], got {d}" for d in args.densities if not 0 < d <= 1]
    problems += [f"--sizes must be in [1, 2^31 - 1], got {n}" for n in args.sizes if not 0 < n < 2**31]
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    if problems:
        parser.error("; ".join(problems))
    if not args.loopback or args.cleanup:
        reason = check_can_emulate()
        if reason:
            print(f"netem_scaling cannot run: {reason}", file=sys.stderr)
            return 2
    if args.cleanup:
        removed = cleanup_stale(args.prefix)
        print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
        return 0

    networks: list[Network] = []

    def close_networks() -> None:
        while networks:
            networks.pop().close()

    atexit.register(close_networks)
    # SIGTERM unwinds like SIGINT (KeyboardInterrupt), so the finally blocks remove the namespaces.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rates = [None] if args.loopback else args.rates
    rows: list[dict] = []
    started = time.perf_counter()
    print(HEADER, flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="netem_scaling_") as tmp:
            for world_size in args.world_sizes:
                network = None
                if not args.loopback:
                    try:
                        network = Network(args.prefix, world_size)
                    except RuntimeError as error:
                        print(f"netem_scaling cannot run: could not create the namespaces: {error}", file=sys.stderr)
                        return 2
                    networks.append(network)
                for rate_bps in rates:
                    if network:
                        try:
                            network.limit(rate_bps)
                        except RuntimeError as error:
                            print(f"netem_scaling cannot run: tc tbf failed (is the sch_tbf module available?): "
                                  f"{error}", file=sys.stderr)
                            return 2
                    rows += run_group(world_size, rate_bps, network, args, Path(tmp))
                close_networks()
    finally:
        close_networks()
    elapsed = time.perf_counter() - started
    skipped = [row for row in rows if row["skipped"]]
    print(f"\n{len(rows) - len(skipped)} exchanges measured, {len(skipped)} skipped, in {elapsed:.0f} s")
    for row in skipped:
        print(f"  skipped: P={row['world_size']} {row['rate']} {row['method']} n={row['numel']}: {row['skipped']}")
    if args.json:
        report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                              "python": platform.python_version()},
                  "config": {key: value for key, value in vars(args).items() if key not in ("worker", "json")},
                  "network": "loopback (no shaping)" if args.loopback else
                  "one namespace per rank, veth to a bridge, tbf on both ends of every link",
                  "elapsed_s": elapsed, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
