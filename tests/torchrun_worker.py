"""The training script of tests/test_torchrun.py, run by torchrun: examples/train_ddp.py's training with the sparse
hook wrapped by tests/test_hook.py's recorder, checking on every rank that every step's reduced gradients are
bitwise the same everywhere and that each bucket conserves what went in; the failures and the final parameters
go to files in ``--out``. ``--kill-rank R --kill-step S`` kills rank R (SIGKILL) after step S in the first
attempt only, so that torchrun restarts the workers.

No `from __future__ import annotations` here: DDP checks a hook's annotations against dist.GradBucket.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file by its path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gtopk_ext as gx  # noqa: E402
from examples.train_ddp import parse_args, train  # noqa: E402
from tests.test_hook import Recorder, conservation_failures, recording_hook, same_on_every_rank  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--out")
    out, kill_rank, kill_step = Path(argv[split + 1]), int(argv[split + 3]), int(argv[split + 5])
    args = parse_args(argv[:split])
    dist.init_process_group("gloo")
    rank, failures, recorders = dist.get_rank(), [], []
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def wrap_state(state):
        recorders.append(Recorder(state))
        return recorders[-1]

    def after_step(step, ddp):
        if not same_on_every_rank([p.grad for p in ddp.parameters()]):
            failures.append(f"step {step}: the reduced gradients differ across ranks")
        if first_attempt and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    model = train(args, recording_hook, wrap_state, after_step)
    # A process's first iteration runs in DDP's one initial bucket (which a resumed hook reduces in the
    # checkpoint's buckets, so the recorder's per-bucket residuals do not apply to it).
    first = min(step for step, _ in recorders[0].calls)
    recorders[0].calls = {key: call for key, call in recorders[0].calls.items() if key[0] > first}
    failures += conservation_failures(recorders[0], "torchrun")
    if not same_on_every_rank(model.parameters()):
        failures.append("the parameters differ across ranks at the end")
    paths = {b["path"] for b in recorders[0].state.stats()["buckets"].values()}
    if "sparse" not in paths:
        failures.append(f"no bucket went sparse: {paths}")
    (out / f"failures-rank{rank}.json").write_text(json.dumps(failures))
    torch.save([p.detach() for p in model.parameters()], out / f"params-rank{rank}.pt")
    gx.destroy_process_group()


if __name__ == "__main__":
    main()
