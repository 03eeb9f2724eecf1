"""Analytic cost against FlopCounterMode and timm's published figures; the isoFLOP baseline."""
from __future__ import annotations

import pytest
import timm
import torch
from conftest import cli_in_process, images, make_model, run_in_process

import amod
from amod.cost import count_flops


@pytest.mark.parametrize(
    "family, convert_kwargs",
    [
        ("vit", None),
        ("vit", dict(router="attention", capacity=0.5)),
        ("deit_distilled", dict(router="standard", capacity=0.125, layers="later")),
        ("registers", dict(router="attention", capacity=0.3, layers=[1, 2, 3])),
        ("dinov2_reg", dict(router="random", capacity=0.7, layers=[0, 2])),
    ],
)
def test_analytic_cost_matches_flop_counter(family, convert_kwargs):
    model = make_model(family)
    if convert_kwargs:
        amod.convert(model, **convert_kwargs)
    measured = count_flops(model, images(model, 2)) / 2  # per image
    analytic = amod.flops(model).flops
    assert abs(analytic - measured) / measured < 0.02, (analytic, measured)


@pytest.mark.parametrize(
    "name, gmacs",
    [("deit_tiny_patch16_224", 1.3), ("deit_small_patch16_224", 4.6),
     ("vit_base_patch16_224", 17.6), ("vit_large_patch16_224", 61.6)],
)
def test_dense_costs_match_timm_published_gmacs(name, gmacs):
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    assert round(amod.flops(model).gmacs, 1) == gmacs


def test_flop_ratio_of_alternate_layers_follows_the_bound():
    with torch.device("meta"):
        model = amod.convert(timm.create_model("deit_small_patch16_224"), capacity=0.5)
    report = amod.flops(model)
    # (1 + C) / 2 of dense, up to the N^2 attention term, the score pass and the embedding/head
    assert 0.74 < report.ratio < 0.78
    assert report.blocks[1].tokens == 1 + 98 and report.blocks[0].tokens == 197
    amod.set_capacity(model, 0.125)
    assert amod.flops(model).blocks[1].tokens == 1 + 25
    assert amod.flops(model, img_size=448).num_tokens == 1 + 28 * 28


@pytest.mark.parametrize("capacity", [0.5, 0.125])
def test_isoflop_baseline_matches_cost_and_keeps_pretrained_blocks(capacity):
    torch.manual_seed(0)
    dense = timm.create_model("deit_small_patch16_224", pretrained=False, img_size=64)
    base = amod.isoflop_baseline(dense, capacity, layers="alternate")
    mod = amod.convert(timm.create_model("deit_small_patch16_224", pretrained=False, img_size=64), capacity=capacity)
    target, got = amod.flops(mod).macs, amod.flops(base).macs
    assert abs(got - target) / target < 0.05
    kept = base.amod_isoflop["kept_blocks"]
    assert kept[0] == 0 and kept[-1] == 11 and len(kept) == len(base.blocks) < 12
    for j, i in enumerate(kept):
        assert torch.equal(base.blocks[j].attn.qkv.weight, dense.blocks[i].attn.qkv.weight)
    assert len(dense.blocks) == 12  # the original is not changed
    assert base(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_cli_flops_prints_the_table_and_fails_cleanly(capsys):
    from amod.cli import main as amod_main

    run = cli_in_process(["flops", "deit_tiny_patch16_224", "--capacity", "1", "0.125"], capsys)
    assert run.returncode == 0, run.stderr
    assert "deit_tiny_patch16_224" in run.stdout and "1.254" in run.stdout and "0.568" in run.stdout
    code, err = run_in_process(["flops", "no_such_model"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("amod flops: error: unknown timm model 'no_such_model' (a Hugging Face model: ")
    code, err = run_in_process(["flops", "deit_tiny_patch16_224", "--capacity", "2"], capsys)
    assert code == 2 and "capacity must be in (0, 1]" in err
    assert amod_main(["flops", "deit_tiny_patch16_224", "--capacity", "0.5", "--skipped", "merge",
                      "--tome-cost", "0.56"]) == 0
    stdout = capsys.readouterr().out
    ratios = [float(line.split()[-2]) for line in stdout.splitlines() if line.startswith("deit_tiny")]
    assert "ToMe@0.56" in stdout and abs(ratios[1] - 0.56) <= 0.02 * 0.56
    assert ratios[0] > 0.739  # the merge mode's similarities cost more than bypass at C = 0.5 (0.739)


def test_cli_flops_table_columns_line_up_with_a_long_spec_label(capsys):
    from amod.cli import main

    long = "mod:router=attention,capacity=0.5,skipped=fold,protect=0.3"
    assert main(["flops", "vit_tiny_patch16_224", "--capacity", "1", "--method", long, "--method",
                 "tome:cost=0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model "))
    table = lines[header:header + 4]
    assert [line.split()[2] for line in table[1:]] == ["1.000", long, "tome:cost=0.5"]  # (both --method flags)
    # the header's column ends: the model column is left-aligned (it ends where the next one's padding starts), the
    # others right-aligned; every row has a cell ending at each and a separator after it
    ends = [table[0].index(c) + len(c) for c in ("img", "capacity", "GMACs", "GFLOPs", "vs dense", "ideal x")]
    assert len({len(line) for line in table}) == 1
    for line in table[1:]:
        assert all(line[e - 1] != " " and (e == len(line) or line[e:e + 2] == "  ") for e in ends), (table, ends)
        assert line.index(" ") < table[0].index("img") - 1  # the model name fits its column


def test_a_fold_capacity_below_what_the_matching_can_reach_is_named_and_priced_as_the_floor():
    import warnings

    with pytest.warns(UserWarning, match=r"skipped='fold' cannot go below capacity 0\.714 .* at 32x32 px"):
        fold = amod.convert(make_model("vit"), capacity=0.2, skipped="fold")
    lowest = amod.lowest_capacity(fold)
    assert lowest == 0.714
    floor = amod.flops(fold, capacity=lowest).macs
    assert [amod.flops(fold, capacity=c).macs for c in (0.1, 0.2, 0.5, 0.7)] == [floor] * 4  # all run as the floor
    assert amod.flops(fold, capacity=lowest + 0.001).macs > floor  # above it every step counts
    assert amod.capacity_for_cost(fold, 0.2) == lowest  # a cost below reach gets the floor, its cost shows the miss
    with pytest.warns(UserWarning, match="cannot go below capacity 0.714"):
        amod.set_capacity(fold, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reachable capacities and the other modes say nothing
        amod.set_capacity(fold, lowest)
        amod.convert(make_model("vit"), capacity=0.9, skipped="fold")
        amod.convert(make_model("vit"), capacity=0.1, skipped="kv")
    assert amod.lowest_capacity(amod.convert(make_model("vit"), capacity=0.5)) == 1 / 16  # one token of 16


def test_cli_flops_and_train_say_where_fold_capacity_stops(tmp_path, capsys):
    from amod.cli import main

    assert main(["flops", "vit_tiny_patch16_224", "--skipped", "fold", "--capacity", "0.2", "0.5", "0.9"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == ["note: vit_tiny_patch16_224 at 224x224: skipped=fold reaches no capacity below 0.727 (a fold block "
                     "removes at most about half of its patch tokens, less the share its router protects); capacity "
                     "0.200, 0.500 cost what 0.727 costs"]
    fold = amod.convert(timm.create_model("vit_tiny_patch16_224", pretrained=False), capacity=0.727, skipped="fold")
    ratios = [line.split()[-2] for line in out.splitlines() if line.startswith("vit_tiny")]
    assert ratios[:2] == [f"{amod.flops(fold).ratio:.3f}"] * 2
    argv = ["train", "--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "2", "--embed-dim", "32",
            "--num-heads", "2", "--router", "attention", "--skipped", "fold", "--capacity", "0.2", "--train-limit",
            "64", "--val-limit", "64", "--epochs", "1", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith("amod train: warning: skipped='fold' cannot go below capacity")


def test_the_one_search_stops_early_without_missing_the_closest_schedule():
    """``amod.cost.closest_setting`` over ``stepped_counts``, which stops once a constant schedule costs less than the
    target, finds what the whole candidate list finds (ToMe's MACs on a DeiT-Ti at 224 px), and of equally close
    candidates keeps the first."""
    from amod.cost import closest_setting, stepped_counts
    from amod.tome.merging import tome_macs

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    depth, dense = len(model.blocks), tome_macs(model, [0] * 12)
    seen: list[list[int]] = []

    def ratio(schedule: list[int]) -> float:
        seen.append(schedule)
        return tome_macs(model, schedule) / dense

    every = [[r + 1] * j + [r] * (depth - j) for r in range(98 + 1) for j in range(depth)]
    for cost in (0.31, 0.5, 0.77, 0.99):
        seen.clear()
        found = closest_setting(cost, stepped_counts(depth, 98, ratio, cost), ratio)
        assert len(seen) < len(every) and found == closest_setting(cost, every, ratio)
    assert closest_setting(0.5, ["a", "b", "c"], {"a": 0.4, "b": 0.6, "c": 0.5}.get) == ("c", 0.5)
    assert closest_setting(0.5, ["a", "b"], {"a": 0.4, "b": 0.6}.get)[0] == "a"  # equally close: the first
