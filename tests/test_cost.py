"""Analytic cost against FlopCounterMode and timm's published figures; the isoFLOP baseline."""
from __future__ import annotations

import subprocess
import sys

import pytest
import timm
import torch
from conftest import images, make_model

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


def test_cli_flops_prints_the_table_and_fails_cleanly():
    run = subprocess.run([sys.executable, "-m", "amod", "flops", "deit_tiny_patch16_224", "--capacity", "1", "0.125"],
                         capture_output=True, text=True, check=True)
    assert "deit_tiny_patch16_224" in run.stdout and "1.254" in run.stdout and "0.568" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "amod", "flops", "no_such_model"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "amod flops: error: unknown timm model 'no_such_model'"
    bad = subprocess.run([sys.executable, "-m", "amod", "flops", "deit_tiny_patch16_224", "--capacity", "2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "capacity must be in (0, 1]" in bad.stderr and "Traceback" not in bad.stderr
    run = subprocess.run([sys.executable, "-m", "amod", "flops", "deit_tiny_patch16_224", "--capacity", "0.5",
                          "--skipped", "merge", "--merge-cost", "0.56"], capture_output=True, text=True, check=True)
    ratios = [float(line.split()[-2]) for line in run.stdout.splitlines() if line.startswith("deit_tiny")]
    assert "ToMe@0.56" in run.stdout and abs(ratios[1] - 0.56) <= 0.02 * 0.56
    assert ratios[0] > 0.739  # the merge mode's similarities cost more than bypass at C = 0.5 (0.739)
