"""Statistics and analyses used to answer the review: bootstrap CIs, in-model leave-one-out."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import images, make_model

import amod
from amod.analysis import attention_stats, kept_positions, leave_one_out
from amod.experiments.plots import routing_figure
from amod.stats import paired_bootstrap_ci, spearman


def test_bootstrap_ci_covers_the_true_difference_and_narrows_with_seeds():
    rng = np.random.default_rng(0)
    true = 0.01
    covered, widths = 0, {}
    for seeds in (3, 12):
        ws = []
        for trial in range(40):
            b = 0.80 + rng.normal(0, 0.01, seeds)
            a = b + true + rng.normal(0, 0.004, seeds)  # paired: same seed noise plus the method's effect
            ci = paired_bootstrap_ci(a, b, n_boot=2000, seed=trial)
            covered += ci.low <= true <= ci.high
            ws.append(ci.high - ci.low)
        widths[seeds] = np.mean(ws)
    assert covered >= 0.8 * 80  # percentile bootstrap with 3 seeds undercovers somewhat; not badly
    assert widths[12] < 0.7 * widths[3]  # ~sqrt(3/12) = 0.5 in theory; 3-seed percentile CIs run narrow
    # two-level: per-image correctness of (seeds, images)
    a = (rng.random((3, 500)) < 0.85).astype(float)
    b = (rng.random((3, 500)) < 0.80).astype(float)
    ci = paired_bootstrap_ci(a, b, n_boot=500)
    assert ci.low < ci.mean < ci.high and ci.low < 0.05 < ci.high
    with pytest.raises(ValueError, match="paired arrays"):
        paired_bootstrap_ci(np.zeros(3), np.zeros(4))


def test_spearman_matches_its_definition():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(np.array([1.0, 1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0])) == pytest.approx(0.9486832980505138)


def test_leave_one_out_matches_a_brute_force_loop_over_tokens():
    model = amod.convert(make_model("deit_distilled"), router="attention", capacity=0.5, layers=[1, 2])
    x, y = images(model, 2), torch.tensor([3, 7])
    res = leave_one_out(model, x, y, tokens=None, batch=5)
    p = model.num_prefix_tokens
    for layer, blk in amod.mod_blocks(model):
        for b in range(2):
            brute = []
            with torch.no_grad():
                base = F.cross_entropy(model(x[b:b + 1]), y[b:b + 1]).item()
                for t in range(16):
                    def drop(module, args, t=t):  # remove token t at the input of this block
                        keep = [i for i in range(args[0].shape[1]) if i != p + t]
                        if module.amod.in_handoff.scores is not None:
                            module.amod.in_handoff.scores = module.amod.in_handoff.scores[:, keep]
                        return (args[0][:, keep],)
                    h = blk.register_forward_pre_hook(drop)
                    brute.append(F.cross_entropy(model(x[b:b + 1]), y[b:b + 1]).item() - base)
                    h.remove()
            assert np.allclose(res["importance"][layer][b], brute, atol=1e-5)
        assert -1 <= res["layers"][layer]["router"] <= 1 and -1 <= res["layers"][layer]["random"] <= 1


def test_leave_one_out_of_a_hugging_face_model_is_the_timm_models():
    """Leave-one-out runs each family's own forward (it called timm's patch_embed and forward_head, which a Hugging
    Face model shows as views only): on the same weights, a Hugging Face DeiT with its distillation head measures
    what the timm model measures."""
    pytest.importorskip("transformers")
    timm_model = make_model("deit_distilled")
    hf_model = amod.hf.from_timm(timm_model, "DeiTForImageClassificationWithTeacher")
    x, y = images(timm_model, 1), torch.tensor([3])
    ours, theirs = (leave_one_out(amod.convert(m, router="attention", capacity=0.5, layers=[1, 3]), x, y, tokens=4)
                    for m in (timm_model, hf_model))
    assert theirs["tokens"] == ours["tokens"]
    for layer in (1, 3):
        assert np.allclose(theirs["importance"][layer], ours["importance"][layer], atol=1e-4)
        assert np.allclose(theirs["scores"][layer], ours["scores"][layer], atol=1e-5)
    backbone = make_model("vit")
    backbone.reset_classifier(0)
    backbone = amod.convert(backbone, router="attention", capacity=0.5)
    with pytest.raises(ValueError, match="has no classifier"):
        leave_one_out(backbone, images(backbone, 1), torch.tensor([3]))


def test_attention_stats_and_routing_pictures(tmp_path):
    model = amod.convert(make_model("registers"), router="attention", capacity=0.25)
    x = images(model, 3)
    stats = attention_stats(model, x)
    assert set(stats) == {0, 1, 2, 3}
    for s in stats.values():
        assert 0 < s["entropy"] <= s["max_entropy"] + 1e-6 and 1 / s["tokens"] <= s["top_token_share"] <= 1
    masks = kept_positions(model, x)
    assert set(masks) == {1, 3} and all(m.sum(dim=1).eq(4).all() for m in masks.values())
    path = routing_figure(model, x, tmp_path / "routing.png")
    assert path.stat().st_size > 1000


def test_study_quick_writes_every_section(tmp_path):
    from amod.cli import main

    assert main(["study", "--quick", "--out", str(tmp_path / "study")]) == 0
    text = (tmp_path / "study" / "study.md").read_text()
    for needle in ("| A-MoD |", "| MoD |", "| MoD unscaled (STE) |", "| A-MoD scaled |", "| shuffled attention |",
                   "| random |", "| inverse attention |", "| isoFLOP dense |", "routing source x output scaling",
                   "Leave-one-out importance inside the trained MoD model", "A-MoD − variant [95 % CI]", "epochs to"):
        assert needle in text, needle
    assert (tmp_path / "study" / "convergence_c0.5.png").exists()
    assert (tmp_path / "study" / "routing_a_mod_c0.5.png").exists()


@pytest.mark.parametrize("analysis", ["loo", "routing", "attention"])
def test_cli_analyze_writes_json_and_pictures(tmp_path, analysis):
    import json

    import timm

    from amod.cli import main

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                              num_classes=10, depth=3, embed_dim=32, num_heads=2)
    path = amod.save(amod.convert(model, router="attention", capacity=0.5), tmp_path / "m.safetensors")
    out = tmp_path / "analysis"
    assert main(["analyze", analysis, "--checkpoint", str(path), "--images", "4", "--tokens", "5", "--out", str(out)]) == 0
    data = json.loads((out / f"{analysis}.json").read_text())
    if analysis == "routing":
        assert (out / "routing.png").exists() and (out / "keep_frequency.png").exists()
        assert len(data["1"]) == 16 and abs(sum(data["1"]) - 8) < 1e-6  # 8 of 16 patches kept per image
    elif analysis == "loo":
        assert set(data["layers"]) == {"1"} and len(data["importance"]["1"][0]) == 5
    else:
        assert set(data) == {"0", "1", "2"}


@pytest.mark.parametrize("analysis, words", [("loo", "leave-one-out needs an MoD model with skipped bypass, merge or kv"),
                                             ("routing", "analyze routing needs an MoD model with skipped bypass")])
def test_cli_analyze_says_plainly_why_a_fold_model_cannot_be_analysed(tmp_path, capsys, analysis, words):
    import timm

    from amod.cli import main

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                              num_classes=10, depth=2, embed_dim=32, num_heads=2)
    path = amod.save(amod.convert(model, capacity=0.8, skipped="fold"), tmp_path / "fold.safetensors")
    out = tmp_path / "analysis"
    assert main(["analyze", analysis, "--checkpoint", str(path), "--images", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "is a fold model" in err, err
    assert not out.exists()
    if analysis == "loo":  # the library says the same
        with pytest.raises(ValueError, match="is a fold model"):
            leave_one_out(amod.load(path), torch.zeros(1, 1, 28, 28), torch.zeros(1, dtype=torch.long))
