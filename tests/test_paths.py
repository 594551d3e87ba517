"""The path policy (gtopk_ext.paths): the dense bfloat16 and 8-bit collectives conserve every rounding, every
forced path conserves per step through the hook, and ``auto`` takes the same path on every rank from the ranks'
measured costs, as the cost model predicts it, with no header in a steady step."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from gtopk_ext.collectives import Dense8, Dense16, Traffic, dense
from gtopk_ext.ddp import reduce_buffer
from gtopk_ext.paths import (AUTO_CHOICES, MAX_FLUSH_STEPS, PATHS, PathPlan, PathPolicy, agreed_costs, choose,
                             own_seconds, predicted)
from tests.distributed import run_distributed
from tests.test_collectives import Members, equal_on_every_rank

WORLD_SIZES = (2, 3, 4)
NUMEL = 5003  # not a multiple of any group size: the rounded dense collectives pad their chunks


def gradient(rank: int, step: int, numel: int = NUMEL) -> torch.Tensor:
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(7000 + step))
    own = torch.randn(numel, generator=torch.Generator().manual_seed(8000 + 100 * step + rank))
    return (shared + own) * torch.logspace(-3, 2, numel)  # magnitudes bfloat16 rounds differently


# ----------------------------------------------------------------------------------------- no process group

def test_policy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="path mode must be one of"):
        PathPolicy("fast")
    with pytest.raises(ValueError, match="min_compress_numel must be an int >= 0"):
        PathPolicy("auto", min_compress_numel=-1)
    with pytest.raises(ValueError, match="recalibrate_every must be an int >= 1"):
        PathPolicy("auto", recalibrate_every=0)
    for choices in ((), "sparse", ("sparse", "fp8"), ("dense", "dense")):
        with pytest.raises(ValueError, match="choices must be distinct paths of"):
            PathPolicy("auto", choices=choices)
    assert PathPolicy().choices == AUTO_CHOICES and "dense8" not in AUTO_CHOICES
    assert len({PathPolicy(mode, choices=choices).code for mode in ("auto", "sparse")
                for choices in (AUTO_CHOICES, PATHS, ("dense16",))}) == 6  # the header tells them apart
    with pytest.raises(TypeError, match="path must be one of"):
        gx.SparseGradState(path=3.5)
    with pytest.raises(ValueError, match="path mode must be one of"):
        gx.SparseGradState(path="fp8")
    state = gx.SparseGradState(path=gx.PathPolicy("auto", min_compress_numel=10))
    assert state.config.path == PathPolicy("auto", 10)


def test_recipe_is_one_call():
    state = gx.SparseGradState.recipe(density=0.001, warmup_steps=20, collective="allgather")
    assert state.config.path.mode == "auto" and state.config.collective == "allgather" and state.config.start_iter == 2
    assert [round(state.config.density_at(i), 6) for i in (0, 4, 5, 19, 20, 1000)] == [0.25, 0.25, 0.062872, 0.003976,
                                                                                  0.001, 0.001]
    correction = state.config.momentum
    assert (correction.momentum, correction.nesterov, correction.masking_start_iter) == (0.9, True, 20)
    assert gx.SparseGradState.recipe(density=0.5).config.density_at(0) == 0.5  # above the warm-up's start: none
    # Errors name the recipe's arguments, not those of the warm-up it builds.
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        gx.SparseGradState.recipe(density=0.01, warmup_steps=-5)
    with pytest.raises(ValueError, match=r"^density must be a number in \(0, 1\]"):
        gx.SparseGradState.recipe(density=0)


def test_cost_model_predictions():
    gtopk, plain = gx.collectives.GTopK(), gx.wire.wire_named("plain")
    numel, size = 1_000_000, 4
    # Only the dense allreduce timed (the warm-up): 40 ns an element. dense16, dense8 and sparse are predicted
    # from its time per byte, sparse at 4 times its bytes' time (its merges); at density 0.25 that is far above
    # dense16's, and dense8's a quarter of float32's bytes (and a header byte a message) are the cheapest.
    costs = {"select": None, "slot": None, "dense16": None, "dense": 40_000, "dense8": None}
    times = predicted(costs, numel=numel, k=250_000, size=size, dtype=torch.float32, collective=gtopk, wire=plain)
    dense, dense_bytes = 40_000 * numel, 2 * 3 * numel * 4 // 4
    assert times["dense"] == dense
    assert times["dense16"] == dense * (3 * (2 * 250_000 + 2 * 250_001)) // dense_bytes  # and a flag word
    assert times["dense8"] == dense * (3 * (1 + 250_000 + 1 + 250_001)) // dense_bytes  # a header byte a message
    assert times["sparse"] == 4 * dense * 2 * (8 + 8 * 250_000) // dense_bytes
    assert choose(times) == "dense8"
    # Tried once 4 x its bytes are below dense8's: gTop-k's 2 x 8 bytes a slot against 1.5 x 1 byte an element,
    # below 3 / 128 of the elements; below dense16's (3 / 64) with dense8 measured dearer than dense16's bytes.
    for k, path in ((23_500, "dense8"), (23_000, "sparse")):
        assert choose(predicted(costs, numel=numel, k=k, size=size, dtype=torch.float32, collective=gtopk,
                                wire=plain)) == path
    for k, path in ((47_000, "dense16"), (46_000, "sparse")):
        assert choose(predicted({**costs, "dense8": 30_000}, numel=numel, k=k, size=size, dtype=torch.float32,
                                collective=gtopk, wire=plain)) == path
    # Measured: selection 2 ns an element, a slot 400 ns, dense16 15 ns and dense8 18 ns an element (its rounding
    # costs the CPU more than its bytes save). The sparse path pays below (15 - 2) / 400 = 3.25% of the elements.
    costs = {"select": 2_000, "slot": 400_000, "dense16": 15_000, "dense": 40_000, "dense8": 18_000}
    for k, path in ((100_000, "dense16"), (40_000, "dense16"), (30_000, "sparse"), (1000, "sparse")):
        times = predicted(costs, numel=numel, k=k, size=size, dtype=torch.float32, collective=gtopk, wire=plain)
        assert choose(times) == path, (k, times)
    # On a slower link dense8 measured 9 ns: it is taken, down to (9 - 2) / 400 = 1.75% of the elements.
    for k, path in ((100_000, "dense8"), (18_000, "dense8"), (17_000, "sparse")):
        times = predicted({**costs, "dense8": 9_000}, numel=numel, k=k, size=size, dtype=torch.float32,
                          collective=gtopk, wire=plain)
        assert choose(times) == path, (k, times)
    # A tie goes to the more precise path.
    assert choose({"sparse": 5, "dense16": 3, "dense": 4, "dense8": 3}) == "dense16"
    # 16-bit tensors have no rounded dense paths (their dense path is 16-bit already).
    times = predicted(costs, numel=numel, k=100_000, size=size, dtype=torch.bfloat16, collective=gtopk,
                      wire=plain)
    assert "dense16" not in times and "dense8" not in times and choose(times) == "dense"
    # Nothing timed: the sparse path, which is what was asked for (and then it is timed).
    assert choose(predicted(dict.fromkeys(costs), numel=numel, k=10, size=size, dtype=torch.float32,
                            collective=gtopk, wire=plain)) == "sparse"


def test_a_long_sparse_run_stays_sparse():
    """A dense step sends the whole residual: auto leaves the sparse path for a cheaper dense one only after at
    most MAX_FLUSH_STEPS sparse steps (a first, timed try) or at a density of at least 1 / MAX_FLUSH_STEPS."""
    times = {"sparse": 10, "dense16": 1, "dense": 2}
    costs = {"select": 1, "slot": 1, "dense16": 1, "dense": 1}
    numel = 1000
    quarter = numel // MAX_FLUSH_STEPS
    for sparse_steps, k, path in ((MAX_FLUSH_STEPS + 1, 10, "sparse"), (100, quarter - 1, "sparse"),
                                  (MAX_FLUSH_STEPS, 10, "dense16"), (0, 10, "dense16"), (100, quarter, "dense16")):
        plan = PathPlan()
        plan.path, plan.sparse_steps = "sparse", sparse_steps
        plan.decide(PathPolicy(), times, costs, 0, k=k, numel=numel)
        assert plan.path == path, (sparse_steps, k)


def test_auto_takes_only_its_choices():
    """dense8 is predicted cheapest here, but ``auto`` takes it only when the policy's choices hold it; a policy
    with no choice this tensor has (dense8 for a bfloat16 tensor) goes dense."""
    times = {"sparse": 10, "dense16": 5, "dense": 7, "dense8": 1}
    costs = {"select": 1, "slot": 1, "dense16": 1, "dense": 1, "dense8": 1}
    for policy, path in ((PathPolicy(), "dense16"), (PathPolicy(choices=PATHS), "dense8"),
                         (PathPolicy(choices=("sparse", "dense")), "dense"),
                         (PathPolicy(choices=("sparse",)), "sparse")):
        plan = PathPlan()
        plan.decide(policy, times, costs, 0, k=10, numel=1000)
        assert plan.path == path, policy
    plan = PathPlan()
    plan.decide(PathPolicy(choices=("dense8",)), {"sparse": 10, "dense": 7}, costs, 0, k=10, numel=1000)
    assert plan.path == "dense"
    assert choose({"dense16": None, "dense": None}) == "dense16"  # nothing timed, no sparse: the first


def test_agreed_costs_are_the_mean_of_the_ranks():
    headers = [{"cost_select": 10, "cost_slot": 5, "cost_dense16": -1, "cost_dense": 7, "cost_dense8": 4},
               {"cost_select": 20, "cost_slot": 6, "cost_dense16": 3, "cost_dense": 8, "cost_dense8": 5}]
    assert agreed_costs(headers) == {"select": 15, "slot": 5, "dense16": None, "dense": 7, "dense8": 4}
    queue, plan = SimpleNamespace(busy_until=0.0), PathPlan()
    plan.costs.observe_dense(1000, own_seconds(queue, start=1.0, end=1.5))
    plan.costs.observe_dense(1000, own_seconds(queue, start=1.1, end=1.7))  # queued behind the first: 0.2 s its own
    assert plan.costs.dense == pytest.approx(0.5 * 0.5e-3 + 0.5 * 0.2e-3)
    assert plan.costs.report()["cost_dense16"] == -1
    plan.costs.observe_dense(1000, 0.25, "dense8")
    assert plan.costs.dense8 == pytest.approx(0.25e-3) and plan.costs.report()["cost_dense8"] == 250_000_000


def test_each_tensor_is_predicted_from_its_own_measurements():
    """A small tensor's exchange is mostly latency: its seconds per slot must not price a large tensor's (an FSDP
    group of 20k elements once made a 8.4M-element group's sparse exchange look 1.7 s long, so it stayed dense)."""
    gtopk, plain = gx.collectives.GTopK(), gx.wire.wire_named("plain")
    small, large = PathPlan(), PathPlan()
    for plan, numel in ((small, 20_000), (large, 8_400_000)):
        plan.costs.observe_dense(numel, 8e-9 * numel + 2e-3)  # 1 Gbit/s and 2 ms of latency
    small.costs.observe_sparse(20_000, 205, 0.0, 4e-3)  # 19.5 us a slot: latency
    size, k = 2, 84_000
    [costs] = [agreed_costs([plan.costs.report()]) for plan in (large,)]
    assert costs["slot"] is None  # untimed: predicted from its bytes on its own link
    assert choose(predicted(costs, numel=8_400_000, k=k, size=size, dtype=torch.float32, collective=gtopk,
                            wire=plain)) == "sparse"
    # The small tensor's figure, had it priced the large one, would have kept it dense (19.5 us x 84k = 1.6 s).
    mixed = {**costs, "slot": agreed_costs([small.costs.report()])["slot"]}
    assert choose(predicted(mixed, numel=8_400_000, k=k, size=size, dtype=torch.float32, collective=gtopk,
                            wire=plain)) != "sparse"


# --------------------------------------------------------------------------------------------- real groups

def check_rounded(members: Members) -> list[str]:
    """The collectives alone: the average bitwise equal on every rank, close to float32's, and
    sum_r x_r = P x average + sum_r lost_r to float32 rounding. Close: the ring rounds P - 1 partial sums, each
    at most P x mean |x|, and the average, to the wire's format (unit roundoff 2**-8 for bfloat16, 2**-3 for
    float8 e5m2 scaled into its normal range): at most P x that x mean |x| from the mean (a rank left out would
    be mean |x| / P off)."""
    failures = []
    # 5003 is not a multiple of any group size (padded chunks); 1 and 2 elements leave ranks an empty chunk; steps
    # 1 and 2 send the ring's chunks in segments of 97 elements (the last one shorter); step 5 is all zeros, and
    # dense8's step 6 tiny: its scale at its bound, 2**120.
    steps = [(0, NUMEL), (1, NUMEL), (2, NUMEL), (3, 1), (4, 2), (5, NUMEL)]
    cases = [(Dense16(), 2**-8, step, numel) for step, numel in steps] + [
        (Dense8(), 2**-3, step, numel) for step, numel in [*steps, (6, NUMEL)]]
    for collective, roundoff, step, numel in cases:
        x = gradient(members.me, step, numel) * (step != 5)
        if step == 6:  # magnitudes in [1e-33, 2e-33): 2e-33 x 2**120 is far inside e5m2's range, and no subnormal
            x = torch.sign(x) * (1 + torch.rand(numel, generator=torch.Generator().manual_seed(members.me))) * 1e-33
        if members.me == 0 and step == 2:
            x[7] = float("inf")  # a non-finite element reaches the average and loses nothing
        traffic = Traffic()
        average, lost = x.clone(), torch.full_like(x, float("nan"))  # every element of lost is written
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dense, "SEGMENT", 97 if step in (1, 2) else dense.SEGMENT)
            collective.reduce_dense(average, members.group, members.size, traffic, lost=lost)
            nbytes = collective.wire_bytes(numel, numel, members.size, torch.float32)  # a header a segment
        exact = torch.stack([x.double(), x.double().abs()]) / members.size
        dist.all_reduce(exact, group=members.group)
        exact, magnitude = exact  # the mean, and the mean |x| that bfloat16's roundings are relative to
        balance = x.double() - lost.double()
        dist.all_reduce(balance, group=members.group)
        finite = torch.isfinite(exact)
        where = f"{members.name}, {collective.name} step {step} ({numel} elements)"
        if not equal_on_every_rank(members, average):
            failures.append(f"{where}: the average differs across ranks")
        scale = float(exact[finite].abs().max())
        if not float((balance - members.size * average.double())[finite].abs().max()) <= 1e-6 * scale:  # NaN too
            failures.append(f"{where}: sum of x != P x average + sum of lost")
        if bool(((average.double() - exact)[finite].abs() > members.size * roundoff * magnitude[finite]).any()):
            failures.append(f"{where}: the average is not the mean")
        if step == 2 and not (torch.isinf(average[7]) and torch.isfinite(lost).all()):
            failures.append(f"{where}: the inf did not reach the average, or the lost values are not finite")
        if traffic.sent != nbytes:
            failures.append(f"{where}: counted {traffic.sent} bytes")
    return failures


def conserved_step(members: Members, state: gx.SparseGradState, step: int, where: str) -> list[str]:
    """One bucket through the hook: the output equal on every rank, and
    sum_r (gradient_r + old residual_r) = P x output + sum_r new residual_r."""
    grad = gradient(members.me, step)
    old = state.store.residuals.get(0, torch.zeros(NUMEL)).clone()
    output = reduce_buffer(state, grad.clone(), 0).wait()
    new = state.store.residuals.get(0, torch.zeros(NUMEL))
    total = torch.cat([grad.double() + old.double() - new.double(), grad.double().abs() + old.double().abs()])
    dist.all_reduce(total, group=members.group)
    imbalance = float((total[:NUMEL] - members.size * output.double()).abs().max())
    failures = []
    if not equal_on_every_rank(members, output):
        failures.append(f"{where}: the output differs across ranks")
    if not imbalance <= 1e-6 * float(total[NUMEL:].max()):  # a NaN fails too
        failures.append(f"{where}: conservation broken by {imbalance:.3g}")
    return failures


def check_forced_paths(members: Members) -> list[str]:
    """Each forced path, after two dense steps and between two sparse ones, conserves every step."""
    failures = []
    for mode in ("dense16", "dense8", "dense", "sparse"):
        for collective in ("gtopk", "oktopk"):
            state = gx.SparseGradState(members.group, density=0.05, collective=collective, path="sparse")
            state.stats_logging_frequency = 0
            for step in range(7):
                state.config = state.config.replace(path=PathPolicy(mode if step in (3, 4) else "sparse"))
                where = f"{members.name}, {mode} via {collective}, step {step}"
                failures += conserved_step(members, state, step, where)
                expected = "dense" if step < 2 else mode if step in (3, 4) else "sparse"
                if state.stats()["buckets"][0]["path"] != expected:
                    failures.append(f"{where}: took {state.stats()['buckets'][0]['path']}, not {expected}")
    return failures


def check_auto(members: Members) -> list[str]:
    """``auto`` with costs that differ across ranks: one path everywhere, the one the mean costs predict; a
    cheaper sparse path is taken once measured; no header in a steady step."""
    failures, me = [], members.me
    state = gx.SparseGradState(members.group, density=0.05, path=PathPolicy("auto", recalibrate_every=3))
    state.stats_logging_frequency = 0
    paths, sent = [], []
    for step in range(18):
        costs = state.buckets[0].plan.costs if step else None  # the bucket's, once it has been reduced
        if step == 2:  # the dense steps timed a slow link on some ranks; a sparse slot is dear on every rank
            costs.dense = 1e-6 * (me + 1)
            # rank 0 alone would go sparse; the mean of the ranks says dense16 (dense8 was timed dear)
            costs.select, costs.slot, costs.dense16, costs.dense8 = 1e-9, 1e-9 if me == 0 else 1e-3, None, 1.0
        if step == 6:  # the link got slower than a slot, from now on
            costs.dense, costs.dense16, costs.slot = 1.0, 1.0, 1e-9
        if step == 13:  # the dense paths look cheaper again, but the residual holds 5 or more sparse steps' worth
            costs.dense, costs.dense16, costs.dense8, costs.slot = 1e-12, 1e-12, 1e-12, 1.0
        failures += conserved_step(members, state, step, f"{members.name}, auto step {step}")
        paths.append(state.stats()["buckets"][0]["path"])
        sent.append(state.stats()["buckets"][0]["bytes_sent"])
        if step == 6:  # measured again (each path's figure is the mean of what it timed)
            costs.dense, costs.dense16, costs.slot = 1.0, 1.0, 1e-9
    gathered = [None] * members.size
    dist.all_gather_object(gathered, paths, group=members.group)
    if any(p != paths for p in gathered):
        failures.append(f"{members.name}: the ranks took different paths: {gathered}")
    # Steps 0-1 dense (the warm-up); step 2 agrees: dense16 not timed and predicted cheaper than a dear sparse
    # exchange, so dense16, agreed again at step 3 once timed; from step 6 on sparse is cheap, chosen at the next
    # agreement (every 3 iterations) and kept, also when the dense paths look cheaper again at the agreement of
    # step 15: a dense step would send more than MAX_FLUSH_STEPS steps' worth of residual at once.
    if paths[:3] != ["dense", "dense", "dense16"] or paths[9:] != ["sparse"] * 9 or "sparse" in paths[:6]:
        failures.append(f"{members.name}: auto took {paths}")
    if not 0 < sent[10] == sent[11] < sent[9]:  # step 9 agreed again (a header), 10 and 11 did not
        failures.append(f"{members.name}: bytes sent per step {sent}")
    return failures


def check_auto_takes_dense8(members: Members) -> list[str]:
    """Untimed, dense8 is predicted from its bytes (a quarter of float32's): ``auto`` with dense8 among its
    choices takes it at a warm-up's density, keeps it once timed cheaper than the others, and conserves every
    step."""
    failures = []
    state = gx.SparseGradState(members.group, density=0.25,
                               path=PathPolicy("auto", recalibrate_every=2, choices=PATHS))
    state.stats_logging_frequency = 0
    paths = []
    for step in range(6):
        if step == 2:  # the dense steps timed a slow link; dense16 and sparse slots were timed dear
            costs = state.buckets[0].plan.costs
            costs.dense, costs.dense16, costs.select, costs.slot = 1e-4, 1e-4, 1e-9, 1e-3
        failures += conserved_step(members, state, step, f"{members.name}, auto (dense8) step {step}")
        paths.append(state.stats()["buckets"][0]["path"])
    if paths != ["dense", "dense"] + ["dense8"] * 4:
        failures.append(f"{members.name}: auto took {paths}")
    return failures


# A calibration under which the 4,420-element bucket of calibrated_run takes dense16 in the warm-up's first two
# stages (density 0.25, 0.112: sparse 4000 ps x 1105 or 495 slots + 10 ps x 4420 = 4.46 or 2.02 us, dense16 400 ps
# x 4420 = 1.77 us) and sparse from its third on (density 0.05: 0.93 us).
CALIBRATION = {0: {"numel": 4420, "select": 10, "slot": 4000, "dense16": 400, "dense": 800, "dense8": None}}


def calibrated_run(members: Members, policy: PathPolicy, slot_seconds: float, steps: int = 12,
                   resume_at: int | None = None) -> tuple[list[torch.Tensor], list[str], gx.SparseGradState]:
    """DDP with ``policy`` on ``members.group`` (one bucket), the measured sparse cost overwritten at step 3 with
    ``slot_seconds`` (as if the link had been that slow): the parameters after ``steps`` steps, each step's path,
    the state. ``resume_at``: stop there, save every state, and go on in a new model, optimizer and hook state."""
    def start(saved=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        ddp = DDP(model, process_group=members.group)
        state = gx.SparseGradState(members.group, density=gx.exponential_warmup(0.01, 8, start_iter=2), path=policy,
                                   stats_logging_frequency=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if saved is not None:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        return model, ddp, optimizer, state

    model, ddp, optimizer, state = start()
    paths = []
    for step in range(steps):
        if step == resume_at:
            model, ddp, optimizer, state = start((copy.deepcopy(model.state_dict()),
                                                  copy.deepcopy(optimizer.state_dict()), state.state_dict()))
        if step == 3:
            state.buckets[0].plan.costs.slot = slot_seconds
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + members.me))
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
        paths.append(state.stats()["buckets"][0]["path"])
    return [p.detach().clone() for p in model.parameters()], paths, state


def check_calibration_repeats_auto(members: Members) -> list[str]:
    """Given the same calibration, two runs of ``auto`` take the same paths and end bitwise equal, whatever they
    measure (here: a sparse exchange measured cheap in one run and dear in the other, which without a calibration
    makes them take different paths), also when one of them stops and resumes from its checkpoints; a run without
    one says in its summary that its paths came from its timings, and its state_dict holds the calibration that
    repeats them."""
    failures, name = [], members.name
    policy = PathPolicy("auto", recalibrate_every=3, calibration=CALIBRATION)
    cheap, cheap_paths, cheap_state = calibrated_run(members, policy, 1e-12)
    dear, dear_paths, _ = calibrated_run(members, policy, 1.0)
    resumed, resumed_paths, _ = calibrated_run(members, policy, 1.0, resume_at=5)
    if cheap_paths != ["dense", "dense"] + ["dense16"] * 4 + ["sparse"] * 6:
        failures.append(f"{name}: calibrated auto took {cheap_paths}")
    for what, params, paths in (("a dear sparse exchange", dear, dear_paths),
                                ("a resumed run", resumed, resumed_paths)):
        if paths != cheap_paths or not all(torch.equal(a, b) for a, b in zip(params, cheap)):
            failures.append(f"{name}: calibrated, {what} took {paths} against {cheap_paths}, or other parameters")
    if "from the policy's calibration (repeatable)" not in cheap_state.summary():
        failures.append(f"{name}: the calibrated run's summary: {cheap_state.summary()}")
    measured_cheap = calibrated_run(members, PathPolicy("auto", recalibrate_every=3), 1e-12)
    measured_dear = calibrated_run(members, PathPolicy("auto", recalibrate_every=3), 1.0)
    if measured_cheap[1] == measured_dear[1]:  # the measurement decides: the two runs differ
        failures.append(f"{name}: without a calibration both runs took {measured_cheap[1]}")
    summary = measured_dear[2].summary()
    if not re.search(r"paths taken \(bucket steps\): .*dense.*'auto' chose \d+ time\(s\) from this run's measured\s+"
                     r"timings.*calibration=state.state_dict\(\)\['calibration'\]", summary, re.S):
        failures.append(f"{name}: the measured run's summary: {summary}")
    repeated = calibrated_run(members, PathPolicy("auto", recalibrate_every=3,
                                                  calibration=measured_dear[2].state_dict()["calibration"]), 1e-12)
    if repeated[1][-2:] != measured_dear[1][-2:]:  # its latest decision (step 10's new k), from its calibration
        failures.append(f"{name}: the saved calibration took {repeated[1]}, the run it came from {measured_dear[1]}")
    return failures


def paths_worker(rank: int, world_size: int) -> list[str]:
    failures = []
    for size in WORLD_SIZES:
        group = dist.new_group(list(range(size)))
        if rank < size:
            members = Members(group, list(range(size)), dist.get_rank(group), f"{size} ranks")
            failures += (check_rounded(members) + check_forced_paths(members) + check_auto(members)
                         + check_auto_takes_dense8(members))
            if size < 4:
                failures += check_calibration_repeats_auto(members)
    return failures


def test_paths_on_real_groups():
    results = run_distributed(paths_worker, max(WORLD_SIZES), timeout=420)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures)
