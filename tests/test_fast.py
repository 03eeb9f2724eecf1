"""The fast path: fused attention stays on, `amod bench` reports what it promises, and on CUDA (`pytest -m cuda`) a
converted model gives the CPU's output, eager, as a CUDA graph and compiled."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import DEVICES, cli_in_process, images, make_model
from timm.layers import Attention

import amod


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["vit", "deit_distilled", "dinov2_reg", "qk_norm"])
@pytest.mark.parametrize("layers", ["alternate", [1, 2, 3]])
def test_fused_and_explicit_attention_give_the_same_model(family, layers, device):
    model = amod.convert(make_model(family), router="attention", capacity=0.3, layers=layers).to(device)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert attns and all(a.fused_attn for a in attns), "converting must not switch fused attention off"
    x = images(model, 3).to(device)
    amod.set_recording(model)
    with torch.no_grad():
        fused = model(x)
        kept_fused = [b.amod_last_index.clone() for _, b in amod.mod_blocks(model)]
        for a in attns:
            a.fused_attn = False
        explicit = model(x)
        kept_explicit = [b.amod_last_index for _, b in amod.mod_blocks(model)]
    assert (fused - explicit).abs().max() < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(kept_fused, kept_explicit))


@pytest.mark.parametrize("device", DEVICES)
def test_bench_json_has_the_promised_keys(capsys, device):
    res = cli_in_process(["bench", "--model", "vit_tiny_patch16_224", "--img-size", "64", "--batch-size", "4",
                          "--repeats", "2", "--warmup", "1", "--capacity", "0.5", "--device", device, "--json"], capsys)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["device"].startswith(device)
    for part in ("dense", "mod"):
        assert out[part]["images_per_s"] > 0 and out[part]["peak_mem_mb"] > 0 and out[part]["macs"] > 0
    assert out["flop_speedup"] == pytest.approx(out["dense"]["macs"] / out["mod"]["macs"])
    assert out["speedup"] == pytest.approx(out["mod"]["images_per_s"] / out["dense"]["images_per_s"])
    assert out["efficiency"] == pytest.approx(out["speedup"] / out["flop_speedup"])
    assert out["flop_speedup"] > 1.1
    assert (out["method"], out["capacity"]) == ("mod", 0.5)  # (--capacity 0.5 on mod:capacity=0.125: MoD's default)
    refused = cli_in_process(["bench", "--method", "tome:cost=0.5", "--capacity", "0.5"], capsys)
    assert refused.returncode == 2 and "--capacity does not apply to tome:cost=0.5" in refused.stderr


# a reducing block's operations beyond a dense block's (amod.tools.opcount; batch 1): the matching, one gather
# and one scatter-add of features and sizes, the bias, and 2 per decision for its key (amod.tokens.decision_key);
# PiToMe adds its energy (43; 52 in its first half of blocks, which also rank every A token's best match and put set A
# in that order), fold's protection the class row
EXTRA_OPS = {"tome": 31, "fold, nothing protected": 31, "pitome": 43, "fold": 55}


@pytest.mark.parametrize("family", ["vit", "dinov2_reg"])
def test_a_reducing_block_dispatches_a_handful_of_operations_more_than_a_dense_one(family):
    from amod.tools.opcount import count_ops

    def make():
        return make_model(family, depth=4, img_size=64 if family == "vit" else 56)

    x = images(make(), 1)
    dense = count_ops(make(), x)
    assert len(dense.per_block) == 4 and sum(dense.per_block) < dense.total and 0 < dense.views < dense.total
    models = {"tome": amod.tome.apply(make(), r=4), "pitome": amod.pitome.apply(make(), keep=0.9),
              "fold, nothing protected": amod.convert(make(), skipped="fold", capacity=0.9, protect=0.0),
              "fold": amod.convert(make(), skipped="fold", capacity=0.9)}
    for name, model in models.items():
        ops = count_ops(model, x)
        extra = [m - d for m, d in zip(ops.per_block, dense.per_block)]
        assert all(0 < e <= EXTRA_OPS[name] for e in extra), (name, extra)
        assert ops.total - dense.total == sum(extra)  # all of it inside the blocks: nothing per forward outside


@pytest.mark.parametrize("torch_takes_recompile_limit", [True, False], ids=["recompile_limit", "patched config"])
def test_a_compiled_model_keeps_every_graph_past_torchs_limit_of_eight(torch_takes_recompile_limit, monkeypatch):
    """Issue 55: amod.compile's 9th graph (a 9th capacity turned with set_capacity, or batch size) failed with
    FailOnRecompileLimitHit, torch's limit of 8 graphs per function under fullgraph=True. amod's compiled models keep
    up to amod.fast.GRAPHS, every one reused when its shape comes back; the global setting and the user's other
    compiled functions keep torch's limit. (Batch sizes of a Linear recompile as a dial does, in milliseconds; on a
    torch whose torch.compile takes no recompile_limit, the setting is patched around each call.)"""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if not torch_takes_recompile_limit:
        real = torch.compile

        def older_compile(model, *, fullgraph=False, dynamic=None, backend="inductor", mode=None):
            return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode)

        monkeypatch.setattr(torch, "compile", older_compile)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    model = torch.nn.Linear(4, 2).eval()
    compiled = amod.compile(model, backend=backend)
    sizes = range(1, 11)
    with torch.inference_mode():
        for _ in range(2):  # 10 graphs, then each one again
            for b in sizes:
                x = torch.randn(b, 4)
                assert torch.allclose(compiled(x), model(x))
    assert len(graphs) == 10
    assert torch._dynamo.config.recompile_limit == 8
    other = torch.compile(lambda x: x + 1, fullgraph=True, dynamic=False, backend=backend)
    with pytest.raises(FailOnRecompileLimitHit):
        for b in sizes:
            other(torch.zeros(b))
    assert len(graphs) == 10 + 8
    torch._dynamo.reset()


# ---------------------------------------------------------------- CUDA against the CPU (`pytest -m cuda`)

# Logits on CUDA against the CPU's fp32, error over the largest logit. fp32 (TF32 off): the same numbers up to rounding
# and the same kept tokens. bf16 autocast: dense within its rounding; a routed model's token choices flip where two
# scores lie within bf16 rounding, each flip moving the logits, so its bound is loose (yet far below a wrong input's,
# about 1) and most kept tokens must agree. fold's matching is discrete: near-ties flip in fp32 too.
FP32_TOL, DENSE_BF16_TOL, ROUTED_TOL, BF16_KEPT_OVERLAP = 1e-4, 5e-2, 0.3, 0.9
CUDA_VARIANTS = {"dense": None, "A-MoD": dict(router="attention", capacity=0.5),
                 "standard MoD": dict(router="standard", capacity=0.5),
                 "fold": dict(router="attention", skipped="fold", capacity=0.75)}


def sharpened(variant: str) -> torch.nn.Module:
    """A 64-patch ViT with qkv weights ~ N(0, 1/dim): timm's random init gives near-uniform attention, where the kept
    tokens would be decided by ties; this gives logits of order one, as trained models have."""
    model = make_model("vit", img_size=64)
    for blk in model.blocks:
        torch.nn.init.normal_(blk.attn.qkv.weight, std=blk.attn.qkv.in_features ** -0.5)
    kwargs = CUDA_VARIANTS[variant]
    return model if kwargs is None else amod.convert(model, **kwargs)


def forward_on(model: torch.nn.Module, x: torch.Tensor, device: str, amp: bool) -> tuple[torch.Tensor, list]:
    """fp32 logits on the CPU and each MoD block's kept patch indices (none for fold) of one forward on ``device``."""
    model = model.to(device)
    routed = variant_routes(model)
    if routed:
        amod.set_recording(model)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
        logits = model(x.to(device)).float().cpu()
    kept = [b.amod_last_index.cpu() for _, b in amod.mod_blocks(model)] if routed else []
    return logits, kept


def variant_routes(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an MoD model that records its kept tokens (fold's tokens change identity as they fold)."""
    try:
        return amod.get_config(model).skipped != "fold"
    except ValueError:  # dense
        return False


@pytest.mark.cuda
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_a_converted_model_on_cuda_gives_the_cpus_output(variant, amp, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # (on by default: the patch embedding's conv)
    model = sharpened(variant)
    x = images(model, 4)
    ref, ref_kept = forward_on(model, x, "cpu", False)
    got, kept = forward_on(model, x, "cuda", amp)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if not amp and variant != "fold":
        assert err <= FP32_TOL and all(torch.equal(a, b) for a, b in zip(kept, ref_kept)), err
    else:
        assert err <= (DENSE_BF16_TOL if variant == "dense" else ROUTED_TOL), err
        for a, b in zip(kept, ref_kept):  # (B, K) each: the share of kept tokens the CPU kept too
            assert (a[:, :, None] == b[:, None, :]).any(-1).float().mean() >= BF16_KEPT_OVERLAP


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_a_cuda_graph_of_a_converted_model_replays_its_eager_forward(variant):
    """amod.compile's mode="cuda-graphs" (eager kernels recorded once, replayed), fp32 and under bf16 autocast; and
    torch.compile's inductor with CUDA graphs (amod.compile's default on a GPU) on the fold model."""
    model = sharpened(variant).cuda()
    x = images(model, 4).cuda()
    with torch.inference_mode():
        for dtype in (None, torch.bfloat16):
            graph = amod.compile(model, x, mode="cuda-graphs", dtype=dtype)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is not None):
                eager = model(x).float()
            assert graph.amod_compile_seconds > 0
            assert (graph(x).float() - eager).abs().max() <= 1e-3 * eager.abs().max()
    if variant != "fold":
        return
    torch._dynamo.reset()
    compiled = amod.compile(model, x)
    with torch.inference_mode():
        eager = model(x)
        assert (compiled(x) - eager).abs().max() <= 1e-3 * eager.abs().max()
    torch._dynamo.reset()
