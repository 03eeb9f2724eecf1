"""PPT (``amod.ppt``): the choice between pooling and pruning and the tokens each keeps, recomputed by hand from the
weights; r = 0 and cost 1 are the dense model; a cost lands within the tolerance; a file, an export, a compiled
model and a batch give the eager model's output; and the spec reaches the commands. (The contract every family keeps,
bf16 autocast and gradient checkpointing included: tests/test_families.py; row i of a batch is the image alone:
tests/test_ties.py.)"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import cli_in_process, images, make_model

import amod
from amod.cost import COST_TOLERANCE
from amod.deploy import flat_region_images
from amod.methods import method_of, parse_method
from amod.ppt import PPT, PPTBlock
from amod.tokens import reduce_weighted


def by_hand(blk: torch.nn.Module, x: torch.Tensor, size: torch.Tensor | None):
    """A timm block's attention on ``x`` (B, N, D), written out: its output added to x, the keys averaged over heads
    (unit vectors) and the patch tokens' significance (class-token attention summed over heads times the value norm
    over all heads, over their sum), with proportional attention on ``size``."""
    attn = blk.attn
    B, N, D = x.shape
    H = attn.num_heads
    qkv = F.linear(blk.norm1(x), attn.qkv.weight, attn.qkv.bias).view(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, N, hd)
    logits = q @ k.transpose(-2, -1) * attn.scale
    if size is not None:
        logits = logits + size.log().view(B, 1, 1, N)
    probs = logits.softmax(-1)  # (B, H, N, N)
    after = x + attn.proj((probs @ v).transpose(1, 2).reshape(B, N, D))
    value_norm = v.transpose(1, 2).reshape(B, N, D).norm(dim=-1)
    s = (probs[:, :, 0].sum(1) * value_norm)[:, 1:]
    metric = k.mean(1)
    return after, metric / metric.norm(dim=-1, keepdim=True), s / s.sum(-1, keepdim=True)


def test_pooling_or_pruning_and_the_tokens_kept_are_the_method_s_by_hand():
    """Blocks 1 and 2 of 4 remove 3 of the 16 patch tokens. The significances' variance of each image, computed by hand
    from the weights (block 2 on block 1's sizes: proportional attention), decides: below the threshold it pools (the
    pooled tokens are ToMe's), above it prunes (the 13 most significant stay, the most significant first)."""
    model = make_model("vit")
    x = torch.cat([images(model, 4, seed=3), torch.zeros(2, 3, 32, 32)])  # two blank images: their tokens alike
    x[4:, :, :16] = 1.0  # (one half bright, one blank)
    dense = copy.deepcopy(model)
    seen = {}
    for i in (1, 2):
        dense.blocks[i].register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0]))
    with torch.no_grad():
        dense(x)
        variances = by_hand(dense.blocks[1], seen[1], None)[2].var(dim=1)  # (unbiased, as torch.var)
    ranked = variances.sort().values
    threshold = float(ranked[3] + ranked[4]) / 2  # four of the six images pool at block 1
    assert (ranked[4] - ranked[3]) / threshold > 1e-2  # (far from the decision grid's step)

    amod.ppt.apply(model, r=3, threshold=threshold, blocks=[1, 2])
    inputs, mlp_inputs = {}, {}
    for i in (1, 2):
        model.blocks[i].register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, (a[0], m.amod.sizes.size)))
        model.blocks[i].norm2.register_forward_pre_hook(lambda m, a, i=i: mlp_inputs.__setitem__(i, a[0]))
    with torch.no_grad():
        model(x)
        assert [b.amod_last_tokens for b in model.blocks] == [17, 14, 11, 11]
        for i in (1, 2):
            tokens, size = inputs[i]
            after, metric, s = by_hand(model.blocks[i], tokens, size)
            pooled = s.var(dim=1) < threshold
            assert torch.equal(model.blocks[i].amod_last_pooled, pooled), i
            if i == 1:
                assert pooled.sum() == 4 and torch.equal(pooled, variances < threshold)
            pool_x, _ = reduce_weighted(after, size, metric, 3, 1)
            for b in range(len(x)):
                if pooled[b]:
                    expected = pool_x[b]
                else:
                    # the most significant first, near-ties (within 2^-11 of the mean share 1/n) by position
                    n = s.shape[1]
                    kept = torch.sort(torch.round(s[b] * n * 2 ** 11), descending=True, stable=True).indices[:n - 3]
                    expected = torch.cat([after[b, :1], after[b, 1:][kept]])
                assert torch.allclose(mlp_inputs[i][b], expected, atol=1e-5), (i, b)
        assert 0 < int(model.blocks[2].amod_last_pooled.sum()) < len(x)  # block 2 both pools and prunes too


def test_threshold_zero_prunes_every_image_and_a_huge_one_pools_every_image():
    x = images(make_model("vit"), 3)
    with torch.no_grad():
        for threshold, pooled in ((0.0, False), (1.0, True)):
            model = amod.ppt.apply(make_model("vit"), r=2, threshold=threshold)
            model(x)
            assert all(bool((b.amod_last_pooled == pooled).all()) for b in model.blocks if b.amod.r)


def test_no_tokens_removed_is_the_dense_model():
    x = images(make_model("vit"), 3)
    with torch.no_grad():
        dense = make_model("vit")(x)
        for model in (amod.ppt.apply(make_model("vit"), r=0), amod.ppt.apply(make_model("vit"), cost=1.0)):
            assert torch.equal(model(x), dense)
            assert model.amod_ppt.r == [0, 0, 0] and amod.flops(model).ratio == 1.0


def test_the_paper_s_defaults_and_a_cost_within_the_tolerance():
    """Without r or cost: r = 50 at blocks 3, 6 and 9 of 12 (capped at half a block's patch tokens); a cost lands
    within amod's tolerance, priced as FlopCounterMode counts; one PPT cannot reach is refused in one line, the model
    left dense."""
    deit = make_model("vit", img_size=64, depth=12)  # 64 patch tokens
    amod.ppt.apply(deit)
    assert deit.amod_ppt.blocks == [3, 6, 9] and deit.amod_ppt.r == [50, 50, 50]
    with torch.no_grad():
        deit(images(deit, 1))
    assert [b.amod_last_tokens for b in deit.blocks] == [65] * 3 + [33] * 3 + [17] * 3 + [9] * 3
    for cost in (0.6, 0.8):
        model = amod.ppt.apply(make_model("vit", img_size=64, depth=8), cost=cost)
        assert abs(amod.flops(model).ratio - cost) / cost <= COST_TOLERANCE
        measured = amod.count_flops(model, images(model, 1)) // 2
        assert abs(amod.flops(model).macs - measured) / measured < 0.01
    dense = make_model("vit", img_size=64, depth=8)
    with pytest.raises(ValueError, match=r"^PPT cannot reach 0.100 of dense on this model: the closest r, \[\d+, \d+, "
                                         r"\d+\], costs 0\.\d+ \(each PPT block removes at most half of its tokens\)$"):
        amod.ppt.apply(dense, cost=0.1)
    assert type(dense.blocks[0]).__name__ == "Block" and not hasattr(dense, "amod_ppt")


@pytest.mark.parametrize("kwargs, message", [
    (dict(r=2, cost=0.6), "give r= .* or cost= .*, not both"),
    (dict(r=2, threshold=-1.0), "threshold must be a number >= 0"),
    (dict(r=2, blocks=[1, 4]), "PPT block 4 is not a block of this model: it has blocks 0 to 3"),
    (dict(r=2, blocks=[1, 1]), "blocks names a block twice"),
    (dict(r=[2, 2]), r"r has 2 entries; the model has 3 PPT blocks \[1, 2, 3\]"),
    (dict(r=17), "r = 17 is more than the 16 patch tokens of the model"),
])
def test_refusals_name_the_problem_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as refused:
        amod.ppt.apply(make_model("vit"), **kwargs)
    assert "\n" not in str(refused.value)
    ppt = amod.ppt.apply(make_model("vit"), r=2)
    for apply in (lambda m: amod.ppt.apply(m, r=2), lambda m: amod.tome.apply(m, r=2)):  # its own dial, named
        with pytest.raises(ValueError, match=r"model already merges tokens \(PPT\); change its setting with "
                                             r"amod\.ppt\.set_r, or apply (PPT|token merging) to a dense model"):
            apply(ppt)


def test_a_batch_mixing_pooled_and_pruned_images_gives_each_image_its_own_output():
    model = make_model("vit")
    x = torch.cat([images(model, 3, seed=3), torch.zeros(3, 3, 32, 32)])
    amod.ppt.apply(model, r=3, threshold=1.3e-5)
    with torch.no_grad():
        together = model(x)
        pooled = model.blocks[1].amod_last_pooled
        alone = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
    assert 0 < int(pooled.sum()) < len(x), pooled  # (the threshold splits this batch)
    assert (together - alone).abs().max() < 1e-5


def test_the_method_by_its_spec_saved_loaded_and_set_to_a_cost(tmp_path):
    method = parse_method("ppt:cost=0.6")
    assert method == PPT(cost=0.6) and method.spec() == "ppt:cost=0.6" and method.label() == "ppt@0.6"
    assert parse_method("ppt:r=[4,3],blocks=[1,2],threshold=1e-4") == PPT(r=(4, 3), blocks=(1, 2), threshold=1e-4)
    with pytest.raises(ValueError, match="ppt: give r .* or cost .*, not both"):
        parse_method("ppt:r=4,cost=0.6")
    model = method.apply(make_model("vit", img_size=64, depth=8))
    ran = method_of(model)
    assert isinstance(ran, PPT) and ran.blocks == (2, 4, 6) and ran.threshold == amod.ppt.PAPER_THRESHOLD
    assert ran == PPT(cost=0.6).at_cost(make_model("vit", img_size=64, depth=8), 0.6)
    assert ran.setting_text() == f"r = {list(ran.r)} at blocks [2, 4, 6], threshold 7e-05"
    x = images(model, 3)
    path = amod.save(model, tmp_path / "ppt.safetensors")
    loaded = amod.load(path)
    assert method_of(loaded) == ran and isinstance(loaded.blocks[2], PPTBlock)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_onnx_export_matches_onnx_runtime(tmp_path):
    pytest.importorskip("onnxruntime")
    model = amod.ppt.apply(make_model("vit", depth=2), r=3, threshold=1e-5)  # blocks 0 and 1
    x = flat_region_images(6, 3, 32, 32, seed=0)
    with torch.no_grad():
        model(x)
    assert all(0 < int(b.amod_last_pooled.sum()) < 6 for b in model.blocks)  # both ways in each block
    report = amod.export(model, tmp_path / "ppt.onnx", check_images=x)
    assert report["check"]["max_abs_diff"] <= 1e-4 and report["check"]["same_top1"]


def test_amod_compile_matches_eager_in_one_static_graph():
    model = amod.ppt.apply(make_model("vit", depth=2), r=3, threshold=1e-5)  # (block 0 pools 2 of the 4 images)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([type(v).__name__ for v in example_inputs if not isinstance(v, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    x = torch.cat([images(model, 2), torch.zeros(2, 3, 32, 32)])
    compiled = amod.compile(model, x, backend=backend)
    with torch.inference_mode():
        assert (compiled(x) - model(x)).abs().max() < 1e-5 and graphs == [[]]
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_frontier_takes_the_method_by_its_kind(backbone_path, tmp_path, capsys):
    """``amod frontier --methods ppt`` on a small backbone: PPT set to the ``--cost`` (``PPT.at_cost``), measured,
    and its row keeps its spec. (About a minute on 2 cores, most of it the dense probe's fit.)"""
    out = tmp_path / "frontier"
    res = cli_in_process(["frontier", "--checkpoint", str(backbone_path), "--img-size", "28", "--probe-train", "20",
                          "--val-limit", "8", "--speed-batch", "2", "--speed-repeats", "1", "--cost", "0.6",
                          "--methods", "ppt", "--out", str(out)], capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((out / "frontier.json").read_text())["rows"]
    assert [(r["method"], r["cost_target"]) for r in rows] == [("ppt", 0.6)]
    method = parse_method(rows[0]["setting"])  # (a row keeps its method's spec)
    assert isinstance(method, PPT) and method.blocks == (1, 2, 3) and method.r == (7, 6, 6)
    assert abs(rows[0]["cost"] - 0.6) < 0.02  # (16 patch tokens: 0.616 is the closest to 0.6 on 1-channel images)


@pytest.mark.slow
def test_compare_and_the_finetune_study_take_the_method_by_its_kind(backbone_path, tmp_path, capsys):
    """``--methods ppt`` in ``amod compare`` (zero-training probe) and as an arm of the finetune study: set to the
    cost, finetuned, evaluated, and its rows keep its spec."""
    common = ["--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.6", "--probe-train", "40",
              "--methods", "ppt"]
    res = cli_in_process(["compare", *common, "--val-limit", "8", "--out", str(tmp_path / "compare")], capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "compare" / "compare.json").read_text())["rows"]
    ppt_rows = [r for r in rows if r["method"] == "ppt"]
    assert len(ppt_rows) == 1 and isinstance(parse_method(ppt_rows[0]["setting"]), PPT)
    assert abs(ppt_rows[0]["cost"] - 0.6) < 0.03

    out = tmp_path / "study"
    res = cli_in_process(["study", *common, "--seeds", "1", "--steps", "4", "--val-limit", "32", "--out", str(out)],
                         capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in evals if r["method"] == "ppt"})
    assert steps[0] == 0 and steps[-1] == 4  # zero-training and finetuned
    assert "| 0.6 | ppt | r = [7, 6, 6] at blocks [1, 2, 3], threshold 7e-05 |" in (out / "finetune.md").read_text()


def test_ppt_registers_when_amod_is_imported_without_any_installed_metadata(tmp_path, monkeypatch):
    """A built-in registers on import, as every built-in does: from a source tree (no installed distribution, so no
    entry point) a PPT file amod saved opens and ``ppt:`` specs parse; amod declares no entry point of its own."""
    import importlib.metadata
    from pathlib import Path

    from amod import methods

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert "entry-points" not in pyproject  # (the amod.methods group is for other packages)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kwargs: iter(()))
    monkeypatch.setitem(methods._plugins, "loaded", False)
    assert "ppt" in methods.method_kinds() and parse_method("ppt:r=2") == PPT(r=2)
    model = amod.ppt.apply(make_model("vit"), r=2)
    loaded = amod.load(amod.save(model, tmp_path / "ppt.safetensors"))
    assert method_of(loaded) == method_of(model) and isinstance(loaded.blocks[1], PPTBlock)
