"""Token merging (ToMe) and the MoD modes that keep skipped tokens' information: equivalences,
invariants, matched cost (analytic and FlopCounterMode), checkpoints and `amod compare --quick`."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import TIMM_VARIANTS, cli_in_process, images, make_model
from timm.models.vision_transformer import Block

import amod
from amod import tome as merge
from amod.mod.block import ScoreHandoff
from amod.mod.routers import vit_routers
from amod.cost import count_flops


@pytest.mark.parametrize("family", sorted(TIMM_VARIANTS))
def test_merging_nothing_is_the_dense_model(family):
    model = make_model(family)
    x = images(model, 3)
    with torch.no_grad():
        ref = model(x)
        merged = merge.apply(copy.deepcopy(model), r=0)
        assert torch.equal(merged(x), ref)


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "registers"])
def test_token_counts_follow_the_schedule_and_sizes_sum_to_the_patches(family):
    model = make_model(family)
    n, p = model.patch_embed.num_patches, model.num_prefix_tokens
    schedule = [3, 0, 5, 8]  # 8: more than half the patches left, capped at n // 2
    merge.apply(model, r=schedule)
    with torch.no_grad():
        model(images(model, 2))
    expected = merge.token_counts(schedule, n, p)
    assert [blk.amod_last_tokens for blk in model.blocks] == [mlp for _, mlp in expected]
    assert expected[-1][1] == p + (n - 3 - 5) - (n - 8) // 2
    size = model.blocks[0].amod.sizes.size  # (B, tokens, 1) after the last merge
    assert size.shape[1] == expected[-1][1]
    assert torch.equal(size[:, :p], torch.ones_like(size[:, :p]))  # prefix tokens are never merged
    assert torch.equal(size[:, p:].sum(dim=(1, 2)), torch.full((2,), float(n)))


@pytest.mark.parametrize("family", ["vit", "qk_norm", "deit3_layerscale"])
@pytest.mark.parametrize("method", ["tome", *(f"merge mode, {r}" for r in vit_routers())])
def test_fused_and_explicit_attention_agree_with_proportional_attention(family, method):
    """ToMe's blocks and MoD's merge mode (its block on the merged groups, with timm's attention or amod's scoring
    one) add log(size) to the logits on either attention path."""
    if method == "tome":
        model = merge.apply(make_model(family), r=[2, 3, 3, 2])
    else:
        model = amod.convert(make_model(family), router=method.rpartition(", ")[2], skipped="merge", capacity=0.5)
    x = images(model, 2)
    unfused = copy.deepcopy(model)  # (before any forward: a random router draws the same tokens in both)
    for blk in unfused.blocks:
        blk.attn.fused_attn = False
    with torch.no_grad():
        fused, explicit = model(x), unfused(x)
    assert torch.allclose(fused, explicit, atol=1e-5), (fused - explicit).abs().max()


def _paired_duplicate_model(family: str):
    """A model without position embeddings and an image whose horizontally adjacent patch pairs are equal:
    every patch token then has an exact twin next to it (ToMe's sets A and B)."""
    model = make_model(family)
    with torch.no_grad():
        model.pos_embed.zero_()
    ph, pw = model.patch_embed.patch_size
    x = images(model, 2)
    gh, gw = model.patch_embed.grid_size
    for j in range(0, gw, 2):  # copy patch column j onto column j + 1
        x[..., (j + 1) * pw:(j + 2) * pw] = x[..., j * pw:(j + 1) * pw]
    return model, x


@pytest.mark.parametrize("family", ["vit", "registers"])
def test_merging_exact_twins_changes_nothing(family):
    """Size-weighted averages and proportional attention are exact when merged tokens are equal: a token
    of size 2 with log 2 added to its logits is the same as the two copies it replaces."""
    model, x = _paired_duplicate_model(family)
    n = model.patch_embed.num_patches
    with torch.no_grad():
        ref = model(x)
        merged = merge.apply(copy.deepcopy(model), r=[n // 2, 0, 0, 0])(x)
    assert torch.allclose(merged, ref, atol=1e-4), (merged - ref).abs().max()
    # the same merging on images without twins does change the output: the comparison can fail
    plain = images(model, 2, seed=5)
    with torch.no_grad():
        assert not torch.allclose(merge.apply(copy.deepcopy(model), r=[n // 2, 0, 0, 0])(plain), model(plain), atol=1e-3)


@pytest.mark.parametrize("family, cost", [("vit", 0.56), ("vit", 0.75), ("deit_distilled", 0.56),
                                          ("dinov2_reg", 0.75)])
def test_matched_cost_schedule_within_two_percent_analytic_and_measured(family, cost):
    model = make_model(family, img_size=64 if family != "dinov2_reg" else 56)
    x = images(model, 2)
    dense_measured = count_flops(model, x)
    merge.apply(model, cost=cost)
    analytic = amod.flops(model)
    assert abs(analytic.ratio - cost) / cost <= 0.02, (analytic.ratio, model.amod_tome.schedule)
    measured = count_flops(model, x)
    assert abs(measured / dense_measured - cost) / cost <= 0.02, (measured / dense_measured, cost)
    assert abs(analytic.flops - measured / 2) / (measured / 2) < 0.02, (analytic.flops, measured / 2)
    assert analytic.blocks[-1].tokens < analytic.blocks[0].tokens


@pytest.mark.parametrize("skipped, family, layers", [
    ("merge", "vit", "alternate"), ("kv", "vit", "alternate"),
    ("merge", "deit_distilled", [1, 2, 3]),  # consecutive: scoring attention with proportional attention
    ("kv", "deit_distilled", "later"),
])
def test_skipped_modes_cost_matches_flop_counter(skipped, family, layers):
    model = amod.convert(make_model(family), capacity=0.3, layers=layers, skipped=skipped)
    measured = count_flops(model, images(model, 2)) / 2
    assert abs(amod.flops(model).flops - measured) / measured < 0.02
    bypass = amod.flops(amod.convert(make_model(family), capacity=0.3, layers=layers))
    assert amod.flops(model).macs > bypass.macs  # similarities / K,V of every token are priced


def _routed_block(skipped: str, scores: torch.Tensor, capacity: float):
    """Block 1 of a tiny ViT as an A-MoD block fed the given (B, N) scores, and the dense block."""
    model = make_model("vit")
    dense_block = copy.deepcopy(model.blocks[1])
    amod.convert(model, capacity=capacity, layers=[1], skipped=skipped)
    blk = model.blocks[1]
    blk.amod.in_handoff = ScoreHandoff()
    blk.amod.in_handoff.scores = scores
    return blk, dense_block


def test_kv_mode_gives_kept_tokens_their_dense_output():
    """Kept tokens attend to every token's keys and values: their output is the dense block's."""
    torch.manual_seed(0)
    x = torch.randn(2, 17, 192)
    scores = torch.rand(2, 17)
    blk, dense_block = _routed_block("kv", scores, capacity=0.25)
    with torch.no_grad():
        out, ref = blk(x), dense_block(x)
    kept = scores[:, 1:].topk(4, dim=1).indices + 1
    for b in range(2):
        idx = torch.cat([torch.tensor([0]), kept[b]])
        assert torch.allclose(out[b, idx], ref[b, idx], atol=1e-5)
        skipped = [i for i in range(17) if i not in idx.tolist()]
        assert torch.equal(out[b, skipped], x[b, skipped])


def test_merge_mode_is_exact_when_skipped_tokens_twin_kept_ones():
    """Each skipped token equal to a kept one: the merged block is the dense block on all tokens."""
    torch.manual_seed(0)
    distinct = torch.randn(2, 4, 192)
    x = torch.cat([torch.randn(2, 1, 192), distinct, distinct, distinct[:, :2], distinct[:, 1:2]], dim=1)  # 11 patches
    scores = torch.zeros(2, x.shape[1])
    scores[:, 1:5] = 1.0  # keep the first occurrence of each distinct token
    blk, dense_block = _routed_block("merge", scores, capacity=4 / 11)
    with torch.no_grad():
        out, ref = blk(x), dense_block(x)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    bypass, _ = _routed_block("bypass", scores, capacity=4 / 11)
    with torch.no_grad():
        assert not torch.allclose(bypass(x), ref, atol=1e-3)  # the same routing without merging differs


def test_merged_and_skipped_mode_models_round_trip_through_checkpoints(tmp_path):
    x = images(make_model("vit"), 2)
    for name, model in (("tome", merge.apply(make_model("vit"), r=[3, 2, 2, 1])),
                        ("merge", amod.convert(make_model("vit"), capacity=0.3, skipped="merge")),
                        ("kv", amod.convert(make_model("vit"), capacity=0.3, skipped="kv"))):
        path = amod.save(model, tmp_path / f"{name}.safetensors")
        loaded = amod.load(path).eval()
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x)), name
        assert amod.flops(loaded).macs == amod.flops(model).macs


def test_merge_and_mode_errors_are_clear():
    model = make_model("vit")
    with pytest.raises(ValueError, match="exactly one of r="):
        merge.apply(copy.deepcopy(model))
    with pytest.raises(ValueError, match="4 blocks"):
        merge.apply(copy.deepcopy(model), r=[1, 2])
    with pytest.raises(ValueError, match="cannot reach 0.100"):
        merge.apply(copy.deepcopy(model), cost=0.1)
    with pytest.raises(ValueError, match="MoD model"):
        merge.apply(amod.convert(copy.deepcopy(model)), r=2)
    with pytest.raises(ValueError, match="unknown skipped-token mode"):
        amod.convert(copy.deepcopy(model), skipped="drop")
    with pytest.raises(ValueError, match="skipped='kv' cannot score attention"):
        amod.convert(copy.deepcopy(model), skipped="kv", layers=[1, 2])
    assert type(model.blocks[1]) is Block  # a refused conversion leaves the model as it was


def test_compare_quick_writes_table_plot_and_json(tmp_path, capsys):
    out = tmp_path / "compare"
    proc = cli_in_process(["compare", "--quick", "--out", str(out), "--cost", "0.6"], capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "compare.md").read_text()
    assert (out / "compare.png").stat().st_size > 10_000
    data = json.loads((out / "compare.json").read_text())
    methods = {r["method"] for r in data["rows"]}
    assert {"ToMe", "A-MoD", "standard MoD", "A-MoD merge", "A-MoD kv"} <= methods
    for r in data["rows"]:
        assert 0.0 <= r["zero_top1"] <= 1.0 and r["images_per_s"] > 0
        assert f"| {r['method']} |" in report
        if r["method"] in ("ToMe", "A-MoD", "A-MoD merge"):
            assert abs(r["cost"] - 0.6) / 0.6 <= 0.02, r

