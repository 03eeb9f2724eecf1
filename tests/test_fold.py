"""skipped="fold": tokens folded for good, the router protecting the most attended ones."""
from __future__ import annotations

import pytest
import torch
from conftest import images, make_model
from timm.layers import Attention

import amod
from amod.mod.fold import FoldBlock, fold_count, protected_count
from amod.tokens import bipartite_matching


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "registers", "dinov2_reg", "qk_norm", "deit3_layerscale"])
def test_capacity_one_is_the_dense_model_and_the_fused_path_stays_on(family):
    dense = make_model(family)
    model = amod.convert(make_model(family), capacity=1.0, skipped="fold")
    assert all(isinstance(b, FoldBlock) for b in model.blocks)
    assert all(m.fused_attn for m in model.modules() if isinstance(m, Attention))
    x = images(model, 3)
    with torch.no_grad():
        assert torch.allclose(model(x), dense(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "registers"])
@pytest.mark.parametrize("capacity, protect", [(0.8, 0.25), (0.6, 0.0), (0.7, 0.4)])
def test_token_counts_follow_the_capacity_and_sizes_sum_to_the_patches(family, capacity, protect):
    model = amod.convert(make_model(family, img_size=64), capacity=capacity, skipped="fold", protect=protect)
    p, n = model.num_prefix_tokens, model.patch_embed.num_patches
    with torch.no_grad():
        model(images(model, 2))
    t, expected = n, []
    for _ in model.blocks:
        t -= fold_count(capacity, t, protect)
        expected.append(p + t)
    assert [b.amod_last_tokens for b in model.blocks] == expected and expected[-1] < p + n
    size = model.blocks[0].amod.sizes.size
    assert torch.equal(size[:, :p], torch.ones_like(size[:, :p]))  # prefix tokens never fold
    assert torch.equal(size[:, p:].sum(dim=(1, 2)), torch.full((2,), float(n)))


def test_fold_count_never_asks_the_matching_for_more_than_it_can_give():
    for t in range(0, 80):
        for protect in (0.0, 0.1, 0.25, 0.45, 0.6):
            for capacity in (0.01, 0.3, 0.5, 0.8, 1.0):
                r = fold_count(capacity, t, protect)
                q = protected_count(protect, t)
                assert 0 <= r <= max(0, t - 1)
                if r:
                    assert q < t // 2 and r <= (t + 1) // 2 - q  # enough unprotected A tokens and B partners


def test_protected_tokens_are_neither_folded_away_nor_folded_into():
    g = torch.Generator().manual_seed(0)
    metric = torch.randn(4, 20, 8, generator=g)
    protected = torch.zeros(4, 20, dtype=torch.bool)
    protected[:, [0, 1, 2, 7, 12]] = True
    r = (20 + 1) // 2 - 5
    metric = torch.nn.functional.normalize(metric, dim=-1)

    def merged(protected=None):  # (A tokens merged away, B tokens merged into), as patch positions
        order, partner = bipartite_matching(metric, 0, protected)
        return 2 * order[:, :r], 2 * partner.gather(1, order[:, :r]) + 1

    a_tokens, b_tokens = merged(protected)
    assert not protected.gather(1, a_tokens).any() and not protected.gather(1, b_tokens).any()
    # without protection the same metric does pick protected tokens (the test can fail)
    a_tokens, b_tokens = merged()
    assert protected.gather(1, a_tokens).any() or protected.gather(1, b_tokens).any()


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "registers", "dinov2_reg"])
@pytest.mark.parametrize("capacity", [0.9, 0.75])
def test_analytic_cost_matches_the_flop_counter(family, capacity):
    model = amod.convert(make_model(family, img_size=64 if family != "dinov2_reg" else 56), capacity=capacity,
                         skipped="fold")
    x = images(model, 2)
    assert amod.count_flops(model, x) == 2 * 2 * amod.flops(model).macs  # FLOPs = 2 x MACs, 2 images


@pytest.mark.parametrize("cost", [0.4, 0.56, 0.75])
def test_capacity_for_cost_reaches_the_cost_and_set_capacity_turns_the_dial(cost):
    model = amod.convert(make_model("vit", img_size=112, patch_size=8, depth=12), skipped="fold")
    amod.set_capacity(model, amod.capacity_for_cost(model, cost))
    assert abs(amod.flops(model).ratio - cost) / cost < 0.02
    x = images(model, 2)
    with torch.no_grad():
        model(x)
        fewer = model.blocks[-1].amod_last_tokens
        amod.set_capacity(model, 1.0)
        model(x)
    assert model.blocks[-1].amod_last_tokens == model.num_prefix_tokens + model.patch_embed.num_patches > fewer


def test_save_load_and_controls(tmp_path):
    model = amod.convert(make_model("deit_distilled", img_size=64), capacity=0.8, skipped="fold", protect=0.3)
    path = amod.save(model, tmp_path / "fold.safetensors")
    again = amod.load(path)
    x = images(model, 2)
    with torch.no_grad():
        assert torch.equal(model(x), again(x))
    assert again.amod_config == model.amod_config and amod.flops(again).macs == amod.flops(model).macs
    # the random control protects other tokens, so it folds differently
    random = amod.convert(make_model("deit_distilled", img_size=64), router="random", capacity=0.8, skipped="fold",
                          protect=0.3)
    with torch.no_grad():
        assert not torch.allclose(random(x), model(x), atol=1e-4)
    with pytest.raises(ValueError, match="parameter-free router"):
        amod.convert(make_model("vit"), router="standard", skipped="fold")
    with pytest.raises(ValueError, match=r"protect must be a number in \[0, 1\)"):
        amod.convert(make_model("vit"), skipped="fold", protect=1.0)


def test_a_fold_model_trains():
    model = amod.convert(make_model("vit", img_size=64), capacity=0.8, skipped="fold").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = images(model, 8), torch.arange(8) % 10
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert all(p.grad is not None for n, p in model.named_parameters() if "blocks" in n)
