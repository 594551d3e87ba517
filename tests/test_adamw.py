"""The AdamW recipe (gx.AdamCorrection in the hook, gx.SparseAdamW as the optimizer) on real Gloo groups.

1. The reduction against a plain-PyTorch replay of the algorithm, one rank's view, P = 2, 3, 4: the gradients
   clipped by one factor over the ranks, m = b1 m + (1 - b1) g; before the freeze the gradient averaged densely;
   after it ``v += m / (1 - b1^t) / s``, the top-k of v sent, applied slots cleared in v and m, dropped ones back in
   v. Conserved at every step: what entered the ranks' v = what was applied + what their v keep; with the 8-bit
   warm-up, g + residual = average + new residual summed over the ranks, and the residual moves into m at the freeze.
2. Real DDP with SparseAdamW (P = 2): the warm-up is AdamW's, replicas bitwise equal after every step, a resume
   bitwise equal to an uninterrupted run, clip_grad_norm_ undone with a warning, the pairing checks, bad input.
3. FSDP2: 2 nodes x 2 ranks and one node of 4 (replicas equal, the loss falls, 16-bit reductions refused); nodes
   of one rank give DDP's hook's parameters.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from tests.distributed import run_distributed
from tests.replay import differs, exchange_topk, imbalance

NUMEL, DENSITY, START_ITER, FREEZE, STEPS, K = 300, 0.05, 2, 4, 9, 15
SHAPES = [(200,), (100,)]
BETAS, CLIP = (0.9, 0.95), 8.0


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank)) * (1 + rank)


def scales() -> torch.Tensor:
    return torch.rand(NUMEL, generator=torch.Generator().manual_seed(3)) + 0.5


def correction(warmup_path: str = "dense") -> gx.AdamCorrection:
    return gx.AdamCorrection(betas=BETAS, freeze_step=FREEZE, clip_norm=CLIP, warmup_path=warmup_path)


def clipped(step: int, rank: int, group, size: int) -> torch.Tensor:
    g = gradient(step, rank)
    square = g.norm().square().reshape(1)
    dist.all_reduce(square, group=group)
    return g * min(1.0, CLIP / (float((square / size).sqrt()) + 1e-6))


def replay(group, rank: int, size: int, collective: str):
    """One rank's view in plain PyTorch: per step (output, m, v, what entered v so far)."""
    s, b1 = scales(), BETAS[0]
    m, v, entered = torch.zeros(NUMEL), torch.zeros(NUMEL), torch.zeros(NUMEL, dtype=torch.float64)
    steps = []
    for step in range(STEPS):
        g = clipped(step, rank, group, size)
        m = b1 * m + (1 - b1) * g
        if step < FREEZE:
            output = g / size
            dist.all_reduce(output, group=group)
        else:
            increment = m / (1 - b1 ** (step + 1)) / s
            entered += increment.double()
            v = v + increment
            output, indices, applied = exchange_topk(v, K, group, size, collective)
            m[indices[applied]] = 0
        steps.append((output, m.clone(), v.clone(), entered.clone()))
    return steps


def new_state(group, collective: str = "gtopk", warmup_path: str = "dense") -> gx.SparseGradState:
    return gx.SparseGradState(group, density=DENSITY, compressor="topk", collective=collective, start_iter=START_ITER,
                              path=gx.PathPolicy("sparse", min_compress_numel=1), stats_logging_frequency=0,
                              momentum=correction(warmup_path))


def check_reduction(group, rank: int, size: int) -> list[str]:
    failures = []
    params = [torch.zeros(shape) for shape in SHAPES]
    for collective in ("gtopk", "allgather"):
        where = f"P={size} {collective}"
        state = new_state(group, collective)
        state.adam.publish({id(p): piece.reshape(p.shape) for p, piece in zip(params, scales().split([200, 100]))})
        applied = torch.zeros(NUMEL, dtype=torch.float64)
        for step, (output, m, v, entered) in enumerate(replay(group, rank, size, collective)):
            got = reduce_buffer(state, gradient(step, rank), 0, parameters=params).wait()
            off = differs(state, got, output, m, v, "m", 1e-6)
            if off:
                failures.append(f"{where}, step {step}: {off}")
                break
            if step < FREEZE:
                continue
            # Conserved at every step: what entered the ranks' v = what was applied + what their v keep.
            applied += size * got.double()
            lost = imbalance(entered, applied, state, group)
            if not lost <= 1e-4:  # a NaN fails too
                failures.append(f"{where}, step {step}: entered != applied + kept by {lost:.3g}")
                break
    # The 8-bit warm-up: per step, the ranks' g + residual = P x average + their new residuals; at the freeze the
    # residual (the roundings still owed) enters m.
    state = new_state(group, warmup_path="dense8")
    state.adam.publish({id(p): piece.reshape(p.shape) for p, piece in zip(params, scales().split([200, 100]))})
    m = torch.zeros(NUMEL)
    for step in range(FREEZE + 1):
        g = clipped(step, rank, group, size)
        before = state.store.residuals.get(0, torch.zeros(NUMEL)).clone()
        got = reduce_buffer(state, gradient(step, rank), 0, parameters=params).wait()
        m = BETAS[0] * m + (1 - BETAS[0]) * (g + (before if step == FREEZE else 0))
        after = state.store.residuals.get(0, torch.zeros(NUMEL))
        path = state.stats()["buckets"][0]["path"]
        if step < FREEZE:
            want = "dense" if step < START_ITER else "dense8"
            total = torch.stack([(g + before).double(), after.double()])
            dist.all_reduce(total, group=group)
            lost = float((total[0] - size * got.double() - total[1]).abs().max())
            if path != want or not lost <= 1e-5:
                failures.append(f"P={size} dense8 warm-up, step {step}: path {path} (expected {want}), "
                                f"imbalance {lost:.3g}")
        else:  # the freeze's step is sparse: m is cleared where a slot was applied (at most K of them)
            velocity = state.store.tensors["velocity"][0]
            kept = velocity != 0
            if int((~kept).sum()) > K or not torch.allclose(velocity[kept], m[kept], atol=1e-6):
                failures.append(f"P={size} at the freeze: the warm-up's residual did not enter m")
        if step == START_ITER and not float(after.abs().max()) > 0:
            failures.append(f"P={size} dense8: no rounding kept in the residual (the test cannot see a loss)")
    # Past the freeze without an optimizer's scales: the same error on every rank, naming the fix.
    state = new_state(group)
    try:
        for step in range(FREEZE + 1):
            reduce_buffer(state, gradient(step, rank), 0, parameters=params).wait()
        failures.append(f"P={size}: no error past the freeze without scales")
    except (ValueError, RuntimeError) as error:
        if "SparseAdamW" not in str(error):
            failures.append(f"P={size}: the error does not name SparseAdamW: {error}")
    return failures


def reduction_worker(rank: int, world_size: int) -> list[str]:
    failures = []
    for size in (2, 3, 4):
        group = dist.new_group(list(range(size)))
        if rank < size:
            failures += check_reduction(group, rank, size)
    return failures + fsdp_checks(rank, world_size)


def test_adamw_reduction_matches_the_algorithm_and_conserves_and_fsdp2_trains():
    """The reduction on P = 2, 3, 4, then the FSDP2 hook on 4 ranks (one spawn: starting processes costs)."""
    results = run_distributed(reduction_worker, 4, timeout=400)
    assert results == [[]] * 4, "\n".join(f for r in results for f in r)


# 2. Real DDP.
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)  # rows a batch does not use get no gradient
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 50)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(self.embed(tokens))))


def batch(step: int, rank: int):
    tokens = torch.randint(0, 30, (16, 2), generator=torch.Generator().manual_seed(100 * step + rank))
    return tokens[:, 0], tokens[:, 1]


def train(steps: int, *, freeze: int = FREEZE, clip_norm=1.0, warmup_path="dense8", plain=False, restore=None,
          save_at=None, clip_after=None):
    """Parameters after each step (and the state saved at ``save_at``) of the AdamW recipe, or (``plain``) DDP with
    torch.optim.AdamW; ``restore``: a saved state to start from."""
    model = Model()
    ddp = nn.parallel.DistributedDataParallel(model)
    if plain:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.1)
    else:
        state = gx.SparseGradState(density=0.05, momentum=gx.AdamCorrection(
            freeze_step=freeze, clip_norm=clip_norm, warmup_path=warmup_path), path="sparse",
            stats_logging_frequency=0)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        optimizer = gx.SparseAdamW(ddp.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.1, state=state)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    start, saved, history = 0, None, []
    if restore is not None:
        model.load_state_dict(restore["model"])
        state.load_state_dict(restore["hook"])
        optimizer.load_state_dict(restore["optimizer"])
        schedule.load_state_dict(restore["schedule"])
        start = restore["step"]
    for step in range(start, steps):
        optimizer.zero_grad()
        tokens, targets = batch(step, dist.get_rank())
        nn.functional.cross_entropy(ddp(tokens), targets).backward()
        if clip_after is not None:
            nn.utils.clip_grad_norm_(ddp.parameters(), clip_after)
        optimizer.step()
        schedule.step()
        history.append([p.detach().clone() for p in model.parameters()])
        if save_at == step + 1:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "step": step + 1,
                     "hook": state.state_dict(), "optimizer": optimizer.state_dict(),
                     "schedule": schedule.state_dict()}
    return history, saved


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def ddp_worker(rank: int, world_size: int) -> list[str]:
    failures = []
    # The warm-up is AdamW's: with the float32 warm-up and no clipping, the first FREEZE steps are DDP + AdamW's.
    ours, _ = train(FREEZE, clip_norm=None, warmup_path="dense")
    theirs, _ = train(FREEZE, plain=True)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if not all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b)):
            failures.append(f"warm-up step {step}: not AdamW's")
            break
    # Replicas bitwise equal after every step; training moves the loss down.
    history, saved = train(12, save_at=7)
    for step, params in enumerate(history):
        flat = torch.cat([p.reshape(-1) for p in params])
        other = flat.clone()
        dist.broadcast(other, 0)
        if not torch.equal(flat, other):
            failures.append(f"step {step}: replicas differ by {float((flat - other).abs().max()):.3g}")
            break
    if not any(not torch.equal(a, b) for a, b in zip(history[FREEZE], history[-1])):
        failures.append("nothing moved after the freeze")
    # A resume after the freeze: bitwise the uninterrupted run.
    resumed, _ = train(12, restore=saved)
    for step, (a, b) in enumerate(zip(resumed, history[7:])):
        if not same(a, b):
            failures.append(f"resumed step {7 + step}: differs from the uninterrupted run")
            break
    # clip_grad_norm_ after the hook: undone, with a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clipped_run, _ = train(8, clip_after=1e-3)
    if not any("rescaled after the hook" in str(w.message) for w in caught):
        failures.append("clip_grad_norm_ after the hook: no warning")
    if not all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(clipped_run[-1], history[7])):
        failures.append("clip_grad_norm_ after the hook: not undone")
    # bfloat16 parameters: the step sees the hook's output as it was (no false alarm from a 16-bit norm).
    model = Model().to(torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gx.SparseGradState.recipe(density=0.05, optimizer="adamw", warmup_steps=3, path="sparse",
                                      stats_logging_frequency=0)
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    optimizer = gx.SparseAdamW(model.parameters(), lr=1e-2, state=state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            tokens, targets = batch(step, rank)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(tokens).float(), targets).backward()
            optimizer.step()
    if any("rescaled after the hook" in str(w.message) for w in caught):
        failures.append("bfloat16: the step took the hook's output for a rescaled one")
    # The pairing: a plain AdamW beside the AdamW recipe, and AdamW beside the SGD recipe, refused naming the fix.
    for recipe, message in ((gx.SparseGradState.recipe(optimizer="adamw", stats_logging_frequency=0), "SparseAdamW"),
                            (gx.SparseGradState.recipe(stats_logging_frequency=0), "optimizer='adamw'")):
        model = Model()
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(recipe, gx.sparse_grad_hook)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        tokens, targets = batch(0, rank)
        nn.functional.cross_entropy(ddp(tokens), targets).backward()
        try:
            optimizer.step()
            failures.append(f"{message}: a plain AdamW was not refused")
        except ValueError as error:
            if message not in str(error):
                failures.append(f"the refusal does not name {message}: {error}")
    return failures + same_as_ddp_checks(rank, world_size)


def test_sparse_adamw_under_ddp_and_fsdp2_nodes_of_one_rank():
    results = run_distributed(ddp_worker, 2, timeout=400)
    assert results == [[]] * 2, "\n".join(f for r in results for f in r)


@pytest.mark.parametrize("make, pattern", [
    (lambda: gx.AdamCorrection(betas=(1.0, 0.9)), r"betas\[0\]"),
    (lambda: gx.AdamCorrection(betas=(0.0, 0.9)), "the first > 0"),
    (lambda: gx.AdamCorrection(freeze_step=0), "freeze_step"),
    (lambda: gx.AdamCorrection(warmup_path="sparse"), "warmup_path"),
    (lambda: gx.AdamCorrection(variance_floor=2.0), "variance_floor"),
    (lambda: gx.AdamCorrection(clip_norm=0.0), "clip_norm"),
    (lambda: gx.SparseGradState.recipe(optimizer="adam"), "optimizer must be one of"),
    (lambda: gx.SparseGradState(momentum=gx.AdamCorrection(), error_feedback=False), "error_feedback"),
    (lambda: gx.SparseGradState.recipe(optimizer="adamw", scaler=torch.amp.GradScaler("cpu")), "scaler"),
    (lambda: gx.SparseAdamW([nn.Parameter(torch.zeros(2))], state=gx.SparseGradState()), "state must be"),
    (lambda: gx.SparseAdamW([{"params": [nn.Parameter(torch.zeros(2))]},
                             {"params": [nn.Parameter(torch.zeros(2))], "betas": (0.8, 0.9)}],
                            state=gx.SparseGradState.recipe(optimizer="adamw")), "the same in every parameter group"),
])
def test_bad_adamw_arguments(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_sparse_adamw_gives_its_betas_to_the_hook():
    state = gx.SparseGradState.recipe(optimizer="adamw")
    gx.SparseAdamW([nn.Parameter(torch.zeros(2))], betas=(0.8, 0.9), eps=1e-6, state=state)
    assert (state.config.momentum.betas, state.config.momentum.eps) == ((0.8, 0.9), 1e-6)
    state.iter = 3
    with pytest.raises(ValueError, match="has run 3 iterations"):
        gx.SparseAdamW([nn.Parameter(torch.zeros(2))], betas=(0.5, 0.9), state=state)


def run_transformer_example(tmp_path, method: str, *args: str) -> tuple[str, float]:
    """examples/train_transformer.py as its docstring launches it, 2 ranks, Hugging Face's GPT-2 of a small shape:
    (its log, the validation loss it printed)."""
    from bench.harness.launch import run_torchrun

    log = "".join(run_torchrun(["examples/train_transformer.py", "--method", method, "--hf", "--warmup", "8",
                                "--width", "64", "--layers", "2", "--log-every", "0", *args],
                               1, 2, None, tmp_path, method, timeout=300))
    found = [line for line in log.splitlines() if f"{method}: validation loss" in line]
    assert found, log[-3000:]
    return log, float(found[0].split("validation loss ")[1].split()[0])


def test_the_transformer_example_runs_the_recipe(tmp_path):
    """The recipe's paths, and a validation loss below the untrained model's (ln 256 = 5.55)."""
    log, loss = run_transformer_example(tmp_path, "adamw-recipe", "--steps", "30", "--freeze", "8")
    assert loss < 4.5, log[-3000:]
    assert "paths taken (bucket steps): sparse 22, dense8 6, dense 2" in log, log[-3000:]


def fsdp_checks(rank: int, world_size: int) -> list[str]:
    """2 nodes x 2 ranks (FSDP2 inside a node, the AdamW recipe between nodes), and one node of 4."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tests.test_fsdp import SPARSE, batch as fsdp_batch, full_parameters, make_model, shard

    failures = []
    for node_size in (2, 4):
        where = f"FSDP2, node size {node_size}"
        state = gx.SparseFSDPState.recipe(gx.fsdp.node_mesh(node_size), density=0.1, optimizer="adamw",
                                          warmup_steps=3, path=SPARSE)
        model = shard(make_model(), state.shard_mesh)
        gx.register_sparse_all_reduce(model, state)
        optimizer = gx.SparseAdamW(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.1, state=state)
        losses = []
        for step in range(10):
            loss = model(fsdp_batch(step % 2, rank)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            full = full_parameters(model)
            replicas = [torch.empty_like(full) for _ in range(world_size)]
            dist.all_gather(replicas, full)
            if not all(torch.equal(replicas[0], r) for r in replicas):
                failures.append(f"{where}, step {step}: the full parameters differ between ranks")
                break
        paths = {group.slot.stats.path for group in state.groups if group.layout.numel}
        expected = {"sparse"} if node_size == 2 else {"none"}
        if paths != expected or not losses[-1] < 0.7 * losses[1]:
            failures.append(f"{where}: paths {paths} (expected {expected}), loss {losses[1]:.4f} -> {losses[-1]:.4f}")
    # 16-bit reduction is refused on every rank.
    state = gx.SparseFSDPState.recipe(gx.fsdp.node_mesh(2), optimizer="adamw", path=SPARSE)
    model = shard(make_model(), state.shard_mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    try:
        gx.register_sparse_all_reduce(model, state)
        failures.append("FSDP2: a bfloat16 reduction was not refused")
    except ValueError as error:
        if "float32" not in str(error):
            failures.append(f"FSDP2: the refusal does not name float32: {error}")
    return failures


def same_as_ddp_checks(rank: int, world_size: int) -> list[str]:
    """Nodes of one rank, the model one FSDP group: the FSDP2 hook reduces the same elements as DDP's one bucket
    (in another order), so with top-k selection both runs give the same parameters, to float rounding."""
    from torch.distributed.fsdp import fully_shard

    from tests.test_fsdp import SPARSE, batch as fsdp_batch, make_model

    def correction():
        return gx.AdamCorrection(betas=BETAS, freeze_step=3, warmup_path="dense", clip_norm=0.05)  # active

    runs = []
    for front in ("ddp", "fsdp"):
        model = make_model()
        if front == "ddp":
            state = gx.SparseGradState(density=0.1, compressor="topk", path=SPARSE, momentum=correction(),
                                       stats_logging_frequency=0)
            trained = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
            trained.register_comm_hook(state, gx.sparse_grad_hook)
        else:
            state = gx.SparseFSDPState(gx.fsdp.node_mesh(1), density=0.1, compressor="topk", start_iter=2,
                                       path=SPARSE, momentum=correction())
            trained = fully_shard(model, mesh=state.shard_mesh)
            gx.register_sparse_all_reduce(trained, state)
        optimizer = gx.SparseAdamW(trained.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.1, state=state)
        for step in range(8):
            trained(fsdp_batch(step, rank)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                               for p in model.parameters()]))
    ddp, fsdp = runs
    moved = float((ddp - torch.cat([p.reshape(-1) for p in make_model().parameters()])).abs().max())
    if not (moved > 1e-3 and torch.allclose(ddp, fsdp, rtol=1e-4, atol=1e-6)):
        failures = [f"FSDP2 vs DDP: moved {moved:.3g}, differ by {float((ddp - fsdp).abs().max()):.3g}"]
    else:
        failures = []
    return failures
