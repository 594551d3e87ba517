"""The hook through PyTorch Lightning: DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook) on 2 Gloo processes.
Optional: skipped unless `lightning` is installed (it is slow to import, hence its own module).

Lightning (2.6) registers a DDPStrategy's comm hook only when its root device is CUDA and silently ignores it on
CPU, so on CPU a callback registers the same state and hook on the DDP model the strategy built.

The processes are launched the way a job scheduler launches them (LOCAL_RANK set, the group already initialised),
by `run_distributed`, so that each ends with `gtopk_ext.destroy_process_group()`. Under Lightning's own spawn
launcher a process exits right after the last all_gather and, in 4 of 80 runs here, the Gloo worker thread
released that all_gather's tensors during interpreter finalization, which aborts the process.
"""

import os

import pytest
import torch
import torch.nn as nn

import gtopk_ext as gx
from tests.distributed import run_distributed
from tests.test_hook import batch, make_model, make_state, same_on_every_rank

L = pytest.importorskip("lightning", reason="optional: pip install lightning")
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402


class TinyRegression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def training_step(self, data, _):
        x, y = data
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        # Runs on every rank: the hook ran compressed steps and the replicas stayed identical.
        state = self.trainer.strategy._ddp_comm_state
        if state.iter != 6 or "sparse" not in {b["path"] for b in state.stats()["buckets"].values()}:
            raise AssertionError(f"the hook did not compress: {state.stats()}")
        if not same_on_every_rank(self.parameters()):
            raise AssertionError("the replicas differ")


class RegisterCommHookOnCPU(L.Callback):
    """What DDPStrategy does with ddp_comm_hook on CUDA, for CPU (Gloo) runs."""

    def on_fit_start(self, trainer, pl_module):
        strategy = trainer.strategy
        if strategy.root_device.type != "cuda":
            strategy.model.register_comm_hook(strategy._ddp_comm_state, strategy._ddp_comm_hook)


def fit_with_the_hook(rank: int, world_size: int, root_dir: str) -> int:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    data = [batch(step, 0) for step in range(12)]
    loader = torch.utils.data.DataLoader([(x[i], y[i]) for x, y in data for i in range(16)], batch_size=16)
    state = make_state("gaussiank", "gtopk", {})
    strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=gx.sparse_grad_hook,
                           bucket_cap_mb=0.012)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root_dir, callbacks=[RegisterCommHookOnCPU()])
    trainer.fit(TinyRegression(), loader)
    return trainer.global_step


def test_lightning_ddp_strategy_with_the_hook(tmp_path):
    assert run_distributed(fit_with_the_hook, 2, str(tmp_path)) == [6, 6]
