"""The script of tests/test_fsdp.py's torchrun test, run by torchrun agents as nodes: per hook call, the nodes
conserve what went in and agree on the average, and every rank's full parameters are bitwise equal after every
step (tests/test_fsdp.py's checks, each rank's records gathered to rank 0), for two configurations; rank 0 writes
the failures to ``--out``."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file by its path

import torch.distributed as dist  # noqa: E402

import gtopk_ext as gx  # noqa: E402
from tests.test_fsdp import as_bytes, check_conservation, conservation_case, from_bytes  # noqa: E402

CONFIGS = [("gtopk", "plain", "float32", 1, "sparse"), ("oktopk", "compact", "bfloat16", 0, "dense16")]


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    dist.init_process_group("gloo")
    rank, world, node_size = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        mine = {"conservation": {config: conservation_case(rank, node_size, config) for config in CONFIGS}}
        gathered = [None] * world
        dist.all_gather_object(gathered, as_bytes(mine))
        if rank == 0:
            results = [from_bytes(data) for data in gathered]
            failures = [f for config in CONFIGS for f in check_conservation(results, node_size, config)]
            calls = sum(len(r["conservation"][config]["calls"]) for r in results for config in CONFIGS)
            out.write_text(json.dumps({"failures": failures, "calls": calls, "world": world}))
    finally:
        gx.destroy_process_group()


if __name__ == "__main__":
    main()
