"""The planner (gtopk_ext.plan): its step times from the byte formulas and the link, worked out by hand here, its
time to the target from the races' step counts, its refusals of bad input, and its command line."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from gtopk_ext.plan import ADAMW_WORK, METHODS, Cluster, cluster_of, parse_args, plan

ROOT = Path(__file__).resolve().parents[1]
FRAMES = (1448 + 66) / 1448  # link bytes per payload byte in full Ethernet frames


def by_name(name: str):
    return next(m for m in METHODS if m.name == name)


def test_dense_steps_overlap_the_backward_and_local_ones_amortise_their_sync():
    # 1e9 parameters, 4 nodes, 10 Gbit/s, a 0.3 s compute: DDP's ring sends 2 * 3 / 4 * 4e9 bytes a node
    c = Cluster(params=1e9, compute_s=0.3, link_bps=10e9, nodes=4, latency_s=1e-4, overlap=2 / 3)
    ddp_exchange = 8 * FRAMES * 6e9 / 10e9 + 6 * 1e-4
    assert c.ratio == pytest.approx(8 * FRAMES * 6e9 / 10e9 / 0.3)
    assert by_name("ddp").step_seconds(c) == pytest.approx(0.3 + ddp_exchange - 0.2)
    assert by_name("bf16").step_seconds(c) == pytest.approx(0.3 + 8 * FRAMES * 3e9 / 10e9 + 6e-4 - 0.2)
    # DiLoCo: the whole exchange every 32 steps, nothing hidden
    assert by_name("diloco-32").step_seconds(c) == pytest.approx(0.3 + ddp_exchange / 32)
    # a fast link: the backward hides all of DDP's exchange
    fast = Cluster(params=1e6, compute_s=0.3, link_bps=100e9, nodes=4)
    assert by_name("ddp").step_seconds(fast) == 0.3


def test_the_adamw_recipe_sends_every_nodes_pairs_on_the_compact_wire_and_the_selection_is_per_gpu():
    c = Cluster(params=1e8, compute_s=0.1, link_bps=1e9, nodes=8, gpus_per_node=8, latency_s=0.0, overlap=0.0,
                select_s=2e-11)
    k = 0.01 * 1e8
    # to each of the 7 other nodes: a 1-word head, the shift, the page table (one int32 per 65,536 elements, and
    # one), then 2 bytes of value and 2 of index a pair
    payload = 4 * (1 + 1 + math.ceil(1e8 / 65536) + 1) + 4 * k
    exchange = 8 * FRAMES * 7 * payload / 1e9
    step = by_name("adamw-0.01").step_seconds(c)
    assert step == pytest.approx(0.1 + exchange + ADAMW_WORK * 2e-11 * 1e8 / 8, rel=1e-3)


def test_the_adamw_recipe_on_the_4bit_wire_sends_two_bytes_a_pair_and_six_a_page():
    c = Cluster(params=1e8, compute_s=0.1, link_bps=1e9, nodes=8, gpus_per_node=8, latency_s=0.0, overlap=0.0,
                select_s=2e-11)
    k = round(0.004 * 1e8)
    # to each of the 7 other nodes: a 1-word head, a count and two bfloat16 bounds per 4,096 elements, 2 bytes a pair
    payload = 4 + 6 * math.ceil(1e8 / 4096) + 2 * k
    exchange = 8 * FRAMES * 7 * payload / 1e9
    step = by_name("adamw-0.004-4bit").step_seconds(c)
    assert step == pytest.approx(0.1 + exchange + ADAMW_WORK * 2e-11 * 1e8 / 8, rel=1e-3)


def test_sparseloco_sends_every_nodes_pairs_on_the_2bit_wire_every_8_steps():
    c = Cluster(params=1e8, compute_s=0.1, link_bps=1e9, nodes=8, gpus_per_node=8, latency_s=1e-4, overlap=0.5,
                select_s=2e-11)
    k = 1e8 / 64
    # to each of the 7 other nodes: a 1-word head, the page table (one int32 per 65,536 elements, and one), two
    # float32 levels, then 2 bytes of index and 2 bits of value a pair; nothing hidden by the backward
    payload = 4 * (1 + math.ceil(1e8 / 65536) + 1 + 2) + 2 * k + k / 4
    exchange = 8 * FRAMES * 7 * payload / 1e9 + 7 * 1e-4
    step = by_name("sparseloco-0.015625-8").step_seconds(c)
    assert step == pytest.approx(0.1 + exchange / 8 + 2e-11 * 1e8 / 8 / 8, rel=1e-3)


def test_time_to_target_counts_the_dense_steps_first_and_the_measured_steps():
    c = Cluster(params=1e9, compute_s=0.3, link_bps=10e9, nodes=4, overlap=0.0, latency_s=0.0)
    ddp = by_name("ddp")
    assert ddp.seconds_to(c, 1000) == pytest.approx(1000 * ddp.step_seconds(c))
    powersgd, recipe = by_name("powersgd-4"), by_name("adamw-0.01")
    if powersgd.steps_vs_ddp is None or recipe.steps_vs_ddp is None:
        pytest.fail("PowerSGD's and the AdamW recipe's steps to the target are measured (docs/race.md)")
    # PowerSGD: 2 float32 steps, then its own; the AdamW recipe: sparse from the first step
    dense32 = 0.3 + 8 * FRAMES * 6e9 / 10e9
    steps = powersgd.steps_vs_ddp * 1000
    assert powersgd.seconds_to(c, 1000) == pytest.approx(2 * dense32 + (steps - 2) * powersgd.step_seconds(c))
    assert recipe.seconds_to(c, 1000) == pytest.approx(recipe.steps_vs_ddp * 1000 * recipe.step_seconds(c))
    rows = {row["method"]: row for row in plan(c, 1000)}
    assert rows["ddp"]["peer"] and not rows["adamw-0.01"]["peer"]


def test_compute_from_flops_and_the_width_from_the_parameters():
    args = parse_args(["--params", "1.3e9", "--tokens-per-gpu", "16384", "--gpu-tflops", "400", "--link", "10gbit",
                       "--nodes", "8"])
    c = cluster_of(args)
    assert c.compute_s == pytest.approx(6 * 1.3e9 * 16384 / 400e12)
    assert c.link_bps == 10e9 and c.nodes == 8 and 1536 <= c.d_model <= 2560 and c.d_model % 128 == 0


@pytest.mark.parametrize("flags,named", [(["--nodes", "1"], "--nodes"), (["--link", "fast"], "--link"),
                                         (["--overlap", "2"], "--overlap"), (["--params", "-5"], "--params")])
def test_bad_input_is_refused_naming_the_flag(flags, named, capsys):
    base = {"--params": "1e9", "--link": "10gbit", "--nodes": "4"}
    argv = [part for key, value in base.items() if key not in flags for part in (key, value)] + flags
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert named in capsys.readouterr().err


def test_command_line_names_the_fastest():
    result = subprocess.run([sys.executable, "-m", "gtopk_ext.plan", "--params", "1.3e9", "--link", "1gbit",
                             "--nodes", "8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "R = " in result.stdout and result.stdout.count("<- fastest") == 1


def test_link_rates_parse_as_their_message_says():
    import argparse

    from gtopk_ext.costs import parse_rate

    assert [parse_rate(text) for text in ("1gbit", "100mbit", "250kbit", "5e8", "1.5gbit", "12345")] == [
        10**9, 10**8, 250_000, 5 * 10**8, 1_500_000_000, 12345]
    with pytest.raises(argparse.ArgumentTypeError, match="rate must look like 1gbit, 100mbit or 5e8, got 'fast'"):
        parse_rate("fast")
