"""The AdamW recipe: AdamW's momentum decoupled in the hook (gx.DecoupledMomentum, DeMo's form), gx.SparseAdamW as
the optimizer, on real Gloo groups.

1. The reduction against a plain-PyTorch replay, one rank's view, P = 2, 3, 4 (allgather): the gradients clipped by
   one factor over the ranks, c = the DCT of each 16 consecutive elements of each parameter (written out here from
   its formula), m = beta m + c, the top of each 64-chunk of |m| sent and taken out of m (the first two, dense
   steps: all of m), the output the inverse DCT of the average. Conserved at every step, gTop-k and the 2-bit wire
   too: the ranks' beta m + c = P x the average + their new m.
2. Real DDP (P = 2) with the recipe: m conserved through DDP's bucket rebuild after the first (sparse) step,
   replicas bitwise equal after every step, the loss falls, a resume bitwise
   equal to the uninterrupted run, clip_grad_norm_ after the hook undone with a warning, bfloat16 parameters, the
   pairing checks; FSDP2 with 2 nodes x 2 ranks and one node of 4 (in the P = 4 spawn).
3. Bad arguments, and examples/train_transformer.py with Hugging Face's GPT-2.
"""

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from tests.distributed import run_distributed

PARTS, CHUNK, SELECT, DENSITY, BETA, CLIP, START_ITER, STEPS = [200, 100], 16, 64, 0.05, 0.9, 8.0, 2, 7
NUMEL = sum(PARTS)


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank)) * (1 + rank)


def dct(x: torch.Tensor, inverse: bool = False, parts: list[int] = PARTS, chunk: int = CHUNK) -> torch.Tensor:
    """The orthonormal DCT-II (or its inverse, the DCT-III) of each ``chunk`` consecutive elements of each part, a
    part's shorter tail by its own size, from the formula X_k = s_k sum_n x_n cos(pi (n + 1/2) k / N)."""
    out = []
    for part in x.double().split(parts):
        for start in range(0, part.numel(), chunk):
            piece = part[start:start + chunk]
            n = piece.numel()
            position = torch.arange(n, dtype=torch.float64)
            grid = torch.cos(math.pi / n * (position[None, :] + 0.5) * position[:, None])
            grid[0] *= math.sqrt(1 / n)
            grid[1:] *= math.sqrt(2 / n)
            out.append(grid.T @ piece if inverse else grid @ piece)
    return torch.cat(out).float()


def new_state(group, collective: str, wire: str = "plain") -> gx.SparseGradState:
    return gx.SparseGradState(group, density=DENSITY, compressor=gx.make_compressor("chunktopk", DENSITY, chunk=SELECT),
                              collective=collective, wire=wire, start_iter=START_ITER,
                              path=gx.PathPolicy("sparse", min_compress_numel=1),
                              stats_logging_frequency=0,
                              momentum=gx.DecoupledMomentum(beta=BETA, chunk=CHUNK, clip_norm=CLIP))


def clipped(step: int, rank: int, group, size: int) -> torch.Tensor:
    g = gradient(step, rank)
    square = g.norm().square().reshape(1)
    dist.all_reduce(square, group=group)
    return g * min(1.0, CLIP / (float((square / size).sqrt()) + 1e-6))


def check_reduction(group, rank: int, size: int) -> list[str]:
    failures = []
    params = [torch.zeros(n) for n in PARTS]
    k = math.ceil(DENSITY * NUMEL)
    per_chunk = k // -(-NUMEL // SELECT)
    # the 2- and 4-bit wires (the recipe's options for small byte budgets): their rounding stays in m
    for collective, wire in (("allgather", "plain"), ("gtopk", "plain"), ("allgather", "2bit"), ("allgather", "4bit")):
        where = f"P={size} {collective} {wire}"
        state = new_state(group, collective, wire)
        m = torch.zeros(NUMEL)
        for step in range(STEPS):
            c = dct(clipped(step, rank, group, size))
            before = state.store.residuals.get(0, torch.zeros(NUMEL)).clone()
            got = reduce_buffer(state, gradient(step, rank), 0, parameters=params).wait().clone()
            after = state.store.residuals.get(0, torch.zeros(NUMEL))
            # Conserved: the ranks' beta m + c = P x the average (in coefficients) + their new m.
            total = torch.stack([(BETA * before + c).double(), after.double()])
            dist.all_reduce(total, group=group)
            lost = float((total[0] - size * dct(got).double() - total[1]).abs().max())
            if not lost <= 1e-4:
                failures.append(f"{where}, step {step}: beta m + c != P x average + new m by {lost:.3g}")
                break
            if (collective, wire) != ("allgather", "plain"):
                continue
            # The replay: the top per_chunk of each SELECT-chunk of |m| sent and taken out of m.
            m = BETA * m + c
            sent = m.clone() if step < START_ITER else torch.zeros(NUMEL)
            for start in range(0, NUMEL if step >= START_ITER else 0, SELECT):
                chunk = m[start:start + SELECT]
                top = chunk.abs().topk(min(per_chunk, chunk.numel())).indices + start
                sent[top] = m[top]
            m = m - sent
            average = sent.clone()
            dist.all_reduce(average, group=group)
            want = dct(average / size, inverse=True)
            if not (torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.allclose(after, m, atol=1e-5)):
                failures.append(f"{where}, step {step}: output off by {float((got - want).abs().max()):.3g}, m by "
                                f"{float((after - m).abs().max()):.3g}")
                break
    return failures


def reduction_worker(rank: int, world_size: int) -> list[str]:
    failures = []
    for size in (2, 3, 4):
        group = dist.new_group(list(range(size)))
        if rank < size:
            failures += check_reduction(group, rank, size)
    return failures + fsdp_checks(rank, world_size)


def fsdp_checks(rank: int, world_size: int) -> list[str]:
    """2 nodes x 2 ranks (FSDP2 inside a node, the decoupled momentum between nodes; the plain and the 4-bit wire),
    and one node of 4."""
    from tests.test_fsdp import SPARSE, batch, full_parameters, make_model, shard

    failures = []
    for node_size, wire in ((2, "plain"), (2, "4bit"), (4, "plain")):
        where = f"FSDP2, node size {node_size}, {wire} wire"
        state = gx.SparseFSDPState(gx.fsdp.node_mesh(node_size), density=0.1, compressor="chunktopk",
                                   collective="allgather", wire=wire, path=SPARSE,
                                   momentum=gx.DecoupledMomentum(chunk=CHUNK))
        model = shard(make_model(), state.shard_mesh)
        gx.register_sparse_all_reduce(model, state)
        optimizer = gx.SparseAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, state=state)
        losses = []
        for step in range(10):
            loss = model(batch(step % 2, rank)).square().mean()
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
    return failures


def test_the_reduction_matches_the_algorithm_and_conserves_and_fsdp2_trains():
    results = run_distributed(reduction_worker, 4, timeout=400)
    assert results == [[]] * 4, "\n".join(f for r in results for f in r)


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


def train(steps: int, restore=None, save_at=None, clip_after=None):
    """Parameters, loss and gradients of each step of the recipe (and the state saved at ``save_at``);
    ``restore``: a saved state to start from; ``clip_after``: clip_grad_norm_ after the hook."""
    model = Model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gx.SparseGradState.recipe(density=0.05, optimizer="adamw", stats_logging_frequency=0)
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    optimizer = gx.SparseAdamW(ddp.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, state=state)
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
        tokens, targets = batch(step % 4, dist.get_rank())
        loss = nn.functional.cross_entropy(ddp(tokens), targets)
        loss.backward()
        if clip_after is not None:
            nn.utils.clip_grad_norm_(ddp.parameters(), clip_after)
        optimizer.step()
        schedule.step()
        history.append(([p.detach().clone() for p in model.parameters()], float(loss.detach()),
                        [p.grad.clone() for p in model.parameters()]))  # the gradients as the step used them
        if save_at == step + 1:  # the optimizer's state_dict holds its live tensors
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "step": step + 1,
                     "hook": state.state_dict(), "optimizer": copy.deepcopy(optimizer.state_dict()),
                     "schedule": schedule.state_dict()}
    return history, saved


class Scrambled(Model):
    """Modules registered in another order than the forward uses them, so that DDP's first buckets (reverse order of
    registration) differ from those it rebuilds after the first iteration (the order the gradients were ready)."""

    def __init__(self):
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 50)
        self.embed = nn.Embedding(50, 16)


def momenta(state: gx.SparseGradState, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's part of the hook's m (DCT coefficients), wherever the store holds it: in a bucket's residual
    (that bucket's layout) or as a part a changed bucket left."""
    store, parts = state.store, {}
    for index, residual in store.residuals.items():
        for (ordinal, numel), piece in zip(store.layouts[index], residual.split([n for _, n in store.layouts[index]])):
            parts[ordinal] = piece
    parts.update(store.unclaimed["residual"])
    return [parts[store._ordinals[p]].clone() if p in store._ordinals else torch.zeros(p.numel()) for p in params]


def conserves_through_the_rebuild(rank: int, size: int) -> list[str]:
    """The recipe sparse from the first step under DDP with small buckets that DDP rebuilds after it: at every step,
    for every parameter, the ranks' beta m + DCT(their gradient) = P x the average (in coefficients) + their new m,
    m followed from the first buckets into the rebuilt ones."""
    failures, beta, chunk = [], gx.DecoupledMomentum().beta, gx.DecoupledMomentum().chunk
    model = Scrambled()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    state = gx.SparseGradState.recipe(density=0.05, optimizer="adamw", clip_norm=None, stats_logging_frequency=0)
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    optimizer = gx.SparseAdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, state=state)
    params = list(model.parameters())
    layouts = []
    for step in range(5):
        tokens, targets = batch(step, rank)
        local = copy.deepcopy(model)  # this rank's own gradient, as the hook receives it
        nn.functional.cross_entropy(local(tokens), targets).backward()
        before = momenta(state, params)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(tokens), targets).backward()
        after = momenta(state, params)
        layouts.append(dict(state.store.layouts))
        for p, q, old, new in zip(params, local.parameters(), before, after):
            c = dct(q.grad.reshape(-1), parts=[p.numel()], chunk=chunk)
            total = torch.stack([(beta * old + c).double(), new.double()])
            dist.all_reduce(total)
            average = dct(p.grad.reshape(-1), parts=[p.numel()], chunk=chunk).double()
            lost = float((total[0] - size * average - total[1]).abs().max())
            if not lost <= 1e-5 * max(1.0, float(total[0].abs().max())):
                failures.append(f"rebuild, step {step}, a parameter of {p.numel()}: beta m + c != P x average + "
                                f"new m by {lost:.3g}")
        optimizer.step()
    if layouts[0] == layouts[1]:
        failures.append(f"rebuild: DDP kept its first buckets {layouts[0]}: the test did not follow m through a change")
    if state.totals.compressed_steps != 5 or not any(bool(m.any()) for m in momenta(state, params)):
        failures.append(f"rebuild: {state.totals.compressed_steps} of 5 steps sparse (expected all, from the first)")
    return failures


def ddp_worker(rank: int, world_size: int) -> list[str]:
    failures = conserves_through_the_rebuild(rank, world_size)
    history, saved = train(24, save_at=7)
    for step, (params, *_) in enumerate(history):
        flat = torch.cat([p.reshape(-1) for p in params])
        other = flat.clone()
        dist.broadcast(other, 0)
        if not torch.equal(flat, other):
            failures.append(f"step {step}: replicas differ by {float((flat - other).abs().max()):.3g}")
            break
    first, last = sum(loss for _, loss, _ in history[:4]), sum(loss for _, loss, _ in history[-4:])
    if not last < 0.85 * first:
        failures.append(f"the loss did not fall: {first / 4:.4f} -> {last / 4:.4f}")
    resumed, _ = train(24, restore=saved)
    for step, ((a, *_), (b, *_)) in enumerate(zip(resumed, history[7:])):
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            failures.append(f"resumed step {7 + step}: differs from the uninterrupted run")
            break
    # clip_grad_norm_ after the hook: undone, with a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clipped_run, _ = train(8, clip_after=1e-3)
    if not any("rescaled after the hook" in str(w.message) for w in caught):
        failures.append("clip_grad_norm_ after the hook: no warning")
    # Compared on the gradients the first two steps used: Adam's normalisation would hide a rescaling in the
    # parameters, and it makes the DCT's rounding in elements without gradient (unused embedding rows) differ later.
    if not all(torch.allclose(x, y, rtol=1e-4, atol=1e-8)
               for ours, theirs in zip(clipped_run[:2], history[:2]) for x, y in zip(ours[2], theirs[2])):
        failures.append("clip_grad_norm_ after the hook: not undone")
    # bfloat16 parameters: the step sees the hook's output as it was (no false alarm from a 16-bit norm).
    model = Model().to(torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gx.SparseGradState.recipe(density=0.05, optimizer="adamw", stats_logging_frequency=0)
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
    return failures


def test_the_recipe_under_ddp():
    results = run_distributed(ddp_worker, 2, timeout=400)
    assert results == [[]] * 2, "\n".join(f for r in results for f in r)


@pytest.mark.parametrize("make, pattern", [
    (lambda: gx.DecoupledMomentum(beta=1.0), "beta"),
    (lambda: gx.DecoupledMomentum(chunk=0), "chunk"),
    (lambda: gx.DecoupledMomentum(clip_norm=-1.0), "clip_norm"),
    (lambda: gx.SparseGradState(momentum=gx.DecoupledMomentum()), "path='sparse'"),
    (lambda: gx.SparseGradState(momentum=gx.DecoupledMomentum(), path="sparse", error_feedback=False),
     "error_feedback"),
    (lambda: gx.SparseGradState.recipe(optimizer="adamw", scaler=torch.amp.GradScaler("cpu")), "scaler"),
    (lambda: gx.SparseGradState.recipe(optimizer="adamw", warmup_steps=24), "no warm-up"),
    (lambda: gx.SparseGradState.recipe(optimizer="adam"), "optimizer must be one of"),
    (lambda: gx.SparseGradState.recipe(density=1e-4, optimizer="adamw"), "density x chunk"),
    (lambda: gx.SparseAdamW([nn.Parameter(torch.zeros(2))], state=gx.SparseGradState()), "state must be"),
    (lambda: gx.SparseAdamW([nn.Parameter(torch.zeros(2))], betas=0.9,
                            state=gx.SparseGradState.recipe(optimizer="adamw")), "betas must be"),
])
def test_bad_adamw_arguments(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_the_dct_is_orthonormal_and_its_own_inverse():
    """gtopk_ext.dct against the formula above, and back."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    gx.dct.forward_(y, CHUNK, PARTS)
    assert torch.allclose(y, dct(x), atol=1e-5)
    assert torch.allclose(y.norm(), x.norm(), rtol=1e-5)
    gx.dct.inverse_(y, CHUNK, PARTS)
    assert torch.allclose(y, x, atol=1e-5)


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


@pytest.mark.parametrize("options", [(), ("--density", "0.004", "--wire", "4bit")])
def test_the_transformer_example_runs_the_recipe(tmp_path, options):
    """The recipe's paths (sparse from the first step), and a validation loss below the untrained model's
    (ln 256 = 5.55); with the defaults and with the 4-bit wire."""
    log, loss = run_transformer_example(tmp_path, "adamw-recipe", "--steps", "30", *options)
    assert loss < 4.5, log[-3000:]
    assert "paths taken (bucket steps): sparse 30;" in log, log[-3000:]
    assert ("4bit wire" in log) == ("4bit" in options), log[-3000:]


def test_sparse_adamw_leaves_the_first_moment_to_the_hook_in_every_group():
    """A group's own betas keep their second beta; the first is 0 everywhere (else momentum would apply twice)."""
    state = gx.SparseGradState.recipe(optimizer="adamw")
    optimizer = gx.SparseAdamW([{"params": [nn.Parameter(torch.zeros(2))]},
                                {"params": [nn.Parameter(torch.zeros(2))], "betas": (0.8, 0.9)}],
                               betas=(0.9, 0.95), state=state)
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "betas": (0.7, 0.99)})
    assert [group["betas"] for group in optimizer.param_groups] == [(0.0, 0.95), (0.0, 0.9), (0.0, 0.99)]
