"""The fast path: fused attention stays on, and `amod bench` reports what it promises."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_in_process, images, make_model
from timm.layers import Attention

import amod


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "dinov2_reg", "qk_norm"])
@pytest.mark.parametrize("layers", ["alternate", [1, 2, 3]])
def test_fused_and_explicit_attention_give_the_same_model(family, layers):
    model = amod.convert(make_model(family), router="attention", capacity=0.3, layers=layers)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert attns and all(a.fused_attn for a in attns), "converting must not switch fused attention off"
    x = images(model, 3)
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


def test_bench_json_has_the_promised_keys(capsys):
    res = cli_in_process(["bench", "--model", "vit_tiny_patch16_224", "--img-size", "64", "--batch-size", "4",
                          "--repeats", "2", "--warmup", "1", "--capacity", "0.5", "--json"], capsys)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for part in ("dense", "mod"):
        assert out[part]["images_per_s"] > 0 and out[part]["peak_mem_mb"] > 0 and out[part]["macs"] > 0
    assert out["flop_speedup"] == pytest.approx(out["dense"]["macs"] / out["mod"]["macs"])
    assert out["speedup"] == pytest.approx(out["mod"]["images_per_s"] / out["dense"]["images_per_s"])
    assert out["efficiency"] == pytest.approx(out["speedup"] / out["flop_speedup"])
    assert out["flop_speedup"] > 1.1


# a reducing block's operations beyond a dense block's (amod.experiments.opcount; batch 1): the matching, one gather
# and one scatter-add of features and sizes, the bias, and 2 per decision for its key (amod.tokens.decision_key);
# PiToMe adds its energy (43; 52 in its first half of blocks, which also rank every A token's best match and put set A
# in that order), fold's protection the class row
EXTRA_OPS = {"tome": 33, "fold, nothing protected": 33, "pitome": 52, "fold": 58}


@pytest.mark.parametrize("family", ["vit", "dinov2_reg"])
def test_a_reducing_block_dispatches_a_handful_of_operations_more_than_a_dense_one(family):
    from amod.experiments.opcount import count_ops

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
