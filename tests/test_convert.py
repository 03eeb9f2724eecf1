"""Conversion: equivalence with timm, token bookkeeping, routers, errors."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import DEVICES, TIMM_VARIANTS, images, make_model
from hypothesis import given, settings, strategies as st

import amod
from amod.mod.block import MoDBlock
from amod.mod.routers import vit_routers
from amod.mod.routing import num_kept
from amod.ops import received_attention


@pytest.mark.parametrize("family", sorted(TIMM_VARIANTS))
@pytest.mark.parametrize("router", vit_routers())
def test_capacity_one_unscaled_equals_timm(family, router):
    dense = make_model(family)
    x = images(dense)
    with torch.no_grad():
        ref = dense(x)
        mod = amod.convert(copy.deepcopy(dense), router=router, capacity=1.0, layers=[1, 2, 3], scale_output=False)
        out = mod(x)
        assert (out - ref).abs().max().item() < 1e-5
    # also in training mode with grad on (the standard router's straight-through path multiplies by 1)
    mod.train(), dense.train()
    assert (mod(x) - dense(x)).abs().max().item() < 1e-5


def _block_io(model, x):
    """Input and output of every MoD block in one forward."""
    seen = {}
    hooks = [blk.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0], o)))
             for i, blk in amod.mod_blocks(model)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    grid=st.integers(2, 6),  # patches per side: 4 .. 36 patch tokens
    capacity=st.floats(0.01, 1.0),
    layers=st.sampled_from([[1, 3], [1, 2], [2, 3], [1, 2, 3], [3]]),
    router=st.sampled_from(vit_routers()),
    family=st.sampled_from(["vit", "deit_distilled", "registers"]),
)
def test_only_k_patch_tokens_change(batch, grid, capacity, layers, router, family):
    model = make_model(family, img_size=grid * 8)
    amod.convert(model, router=router, capacity=capacity, layers=layers)
    x = images(model, batch)
    p = model.num_prefix_tokens
    n = grid * grid
    k = num_kept(capacity, n)
    assert k == max(1, math.ceil(capacity * n - 1e-9))
    for i, (inp, out) in _block_io(model, x).items():
        changed = (out != inp).any(dim=-1)  # (B, N)
        assert changed[:, :p].all(), "prefix tokens are always processed"
        assert (changed[:, p:].sum(dim=1) == k).all(), f"block {i}: expected {k} processed patch tokens"
        skipped = ~changed
        assert torch.equal(out[skipped], inp[skipped])  # bit-identical copies


def test_attention_scores_match_naive_computation():
    model = make_model("deit_distilled")
    amod.convert(model, router="attention", capacity=0.25, layers=[2])
    x = images(model, 3)
    captured = {}
    prev = model.blocks[1]
    prev.register_forward_hook(lambda m, a, o: captured.__setitem__("x", a[0]))
    with torch.no_grad():
        model(x)
        # independent computation from the explicit attention matrix of block 1
        attn_mod = prev.attn
        h = prev.norm1(captured["x"])
        B, N, C = h.shape
        qkv = attn_mod.qkv(h).reshape(B, N, 3, attn_mod.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, _ = qkv.unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * attn_mod.scale).softmax(-1)  # (B, H, N, N)
        naive = torch.stack([attn[b].sum(dim=(0, 1)) / (attn.shape[1] * N) for b in range(B)])
        assert torch.allclose(received_attention(attn), naive, atol=1e-7)
        # scores the MoD block ranks by: record which tokens it kept and compare with top-k of naive
        amod.set_recording(model)
        model(x)
        kept = model.blocks[2].amod_last_index
        p = model.num_prefix_tokens
        expected = naive[:, p:].topk(kept.shape[1], dim=1).indices.sort(dim=1).values
        assert torch.equal(kept, expected)


def test_consecutive_mod_blocks_carry_scores_of_skipped_tokens():
    model = make_model("vit")
    amod.convert(model, router="attention", capacity=0.5, layers=[1, 2])
    x = images(model, 2)
    b1, b2 = model.blocks[1], model.blocks[2]
    got = {}
    # what block 2 receives is the handoff between blocks 1 and 2
    orig_take = b2.amod.in_handoff.take
    b2.amod.in_handoff.take = lambda: got.setdefault("s2", orig_take())
    orig_take1 = b1.amod.in_handoff.take
    b1.amod.in_handoff.take = lambda: got.setdefault("s1", orig_take1())
    amod.set_recording(model)
    with torch.no_grad():
        model(x)
    s1, s2 = got["s1"], got["s2"]
    kept = b1.amod_last_index + model.num_prefix_tokens
    skipped = torch.ones_like(s1, dtype=torch.bool).scatter(1, kept, False)
    skipped[:, : model.num_prefix_tokens] = False
    assert torch.equal(s2[skipped], s1[skipped]), "skipped tokens keep their previous score"
    # processed tokens' rescaled scores plus the carried ones are on the full-sequence scale
    N = s1.shape[1]
    M = kept.shape[1] + model.num_prefix_tokens
    processed_mass = s2.gather(1, torch.cat([torch.zeros_like(kept[:, :1]), kept], 1)).sum(1)
    assert torch.allclose(processed_mass, torch.full_like(processed_mass, M / N), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_standard_router_learns_and_attention_adds_no_parameters(device):
    dense = make_model("vit").to(device)
    n_params = sum(p.numel() for p in dense.parameters())
    keys = set(dense.state_dict())
    att = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5)
    assert sum(p.numel() for p in att.parameters()) == n_params
    assert set(att.state_dict()) == keys
    x = images(dense, 4).to(device)
    for scale in (True, False):  # scaled: gate in the graph; unscaled: straight-through estimator
        std = amod.convert(copy.deepcopy(dense), router="standard", capacity=0.5, scale_output=scale).train()
        new_keys = set(std.state_dict()) - keys
        assert new_keys == {f"blocks.{i}.router.proj.{w}" for i in (1, 3) for w in ("weight", "bias")}
        std.forward_features(x).pow(2).mean().backward()
        for i, blk in amod.mod_blocks(std):
            assert blk.router.proj.weight.grad is not None and blk.router.proj.weight.grad.abs().sum() > 0
    # attention router with scaled output: gradient flows into the previous block's q/k through scores
    att_scaled = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5, scale_output=True).train()
    att_scaled.forward_features(x).pow(2).mean().backward()
    assert att_scaled.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_random_router_is_seeded_and_set_capacity_turns_the_dial():
    a = amod.convert(make_model("vit"), router="random", capacity=0.25, seed=3)
    b = amod.convert(make_model("vit"), router="random", capacity=0.25, seed=3)
    c = amod.convert(make_model("vit"), router="random", capacity=0.25, seed=4)
    x = images(a)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        assert not torch.equal(a(x), c(x))
    amod.set_recording(a)
    for capacity, k in ((0.25, 4), (0.5, 8), (1.0, 16)):
        amod.set_capacity(a, capacity)
        with torch.no_grad():
            a(x)
        assert all(blk.amod_last_index.shape[1] == k for _, blk in amod.mod_blocks(a))
        assert amod.get_config(a).capacity == capacity


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(capacity=0.0), "capacity must be in (0, 1]"),
        (dict(capacity=1.5), "capacity must be in (0, 1]"),
        (dict(capacity=float("nan")), "capacity must be in (0, 1]"),
        (dict(capacity="0.5"), "capacity must be a number"),
        (dict(router="learned"), "unknown router 'learned'; supported routers: attention, standard, random"),
        (dict(layers=[1, 9]), "layer index 9 is out of range: the model has blocks 0..3"),
        (dict(layers=[1, 1]), "layer indices must be unique"),
        (dict(layers="every"), "unknown layers preset 'every'"),
        (dict(layers=[0]), "the attention router cannot route block 0"),
        (dict(scale_output="yes"), "scale_output must be True, False or None"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError) as err:
        amod.convert(make_model("vit"), **kwargs)
    assert message in str(err.value)


def test_unsupported_models_and_misuse_are_refused():
    import timm

    with pytest.raises(TypeError, match="amod cannot take a ResNet: it takes timm.s VisionTransformer .*Hugging Face"):
        amod.convert(timm.create_model("resnet10t", pretrained=False))
    with pytest.raises(TypeError, match="block 1 is a ParallelThingsBlock; amod converts timm.s pre-norm"):
        amod.convert(timm.create_model("vit_small_patch16_18x2_224", pretrained=False, depth=2, img_size=32))
    model = amod.convert(make_model("vit"), capacity=0.5)
    with pytest.raises(ValueError, match="already converted; use amod.set_capacity"):
        amod.convert(model)
    with pytest.raises(ValueError, match="capacity must be in"):
        amod.set_capacity(model, -1)
    with pytest.raises(ValueError, match="not an amod MoD model"):
        amod.set_capacity(make_model("vit"), 0.5)
    # the random router is allowed at block 0 (it needs no previous attention)
    amod.convert(make_model("vit"), router="random", layers=[0])
    assert [i for i, _ in amod.mod_blocks(model)] == [1, 3]
    assert isinstance(model.blocks[1], MoDBlock)
    assert amod.get_config(amod.convert(make_model("vit"), layers="later")).layers == [3]
    deep = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=12)
    assert amod.get_config(amod.convert(deep, layers="last-two-thirds")).layers == list(range(4, 12))


def test_control_routers_shuffle_and_invert_the_attention_scores():
    from amod.mod.routers import InverseAttentionRouter, ShuffledAttentionRouter

    scores = torch.rand(3, 20)
    x = torch.zeros(3, 20, 8)
    shuffled = ShuffledAttentionRouter(seed=1)
    a, b = shuffled.score(x, scores), shuffled.score(x, scores)
    assert torch.equal(a.sort(dim=1).values, scores.sort(dim=1).values)  # exactly the same multiset per image
    assert not torch.equal(a, scores) and not torch.equal(a, b)  # permuted, afresh each call
    assert torch.equal(ShuffledAttentionRouter(seed=1).score(x, scores), a)  # seeded
    inverse = InverseAttentionRouter().score(x, scores)
    assert torch.equal(inverse.topk(5, dim=1).indices.sort(1).values, (-scores).topk(5, dim=1).indices.sort(1).values)
    # in a model: the inverse router keeps exactly the tokens A-MoD skips, at capacity 0.5
    model = make_model("vit")
    att = amod.convert(copy.deepcopy(model), router="attention", capacity=0.5, layers=[1])
    inv = amod.convert(copy.deepcopy(model), router="inverse-attention", capacity=0.5, layers=[1])
    amod.set_recording(att), amod.set_recording(inv)
    x = images(model, 2)
    with torch.no_grad():
        att(x), inv(x)
    kept_a, kept_i = att.blocks[1].amod_last_index, inv.blocks[1].amod_last_index
    for row_a, row_i in zip(kept_a.tolist(), kept_i.tolist()):
        assert sorted(row_a + row_i) == list(range(16))
    with pytest.raises(ValueError, match="the shuffled-attention router cannot route block 0"):
        amod.convert(make_model("vit"), router="shuffled-attention", layers=[0, 1])


def test_the_standard_router_starts_as_a_gate_of_about_one():
    """Small router weights and a zero bias: 2 sigmoid(r) is about 1, so a converted pretrained model keeps
    its function (at capacity 1.0 the output stays close to the dense model's)."""
    dense = make_model("vit")
    model = amod.convert(make_model("vit"), router="standard", capacity=1.0)
    for _, blk in amod.mod_blocks(model):
        assert torch.equal(blk.router.proj.bias, torch.zeros(1))
        assert 0 < blk.router.proj.weight.std() < 0.03
    x = images(model, 2)
    with torch.no_grad():
        assert torch.allclose(model(x), dense(x), rtol=0, atol=0.05 * dense(x).abs().max().item())
