"""Leave-one-out as MoD removes a token (``amod.analysis.skip_importance``): at an MoD block, one patch token skips
that block alone while the block processes every other one. Checked against a brute-force loop that runs the model's
own forward once per token, the block made to keep every token but that one by its own routing code (its capacity
and its router's scores overridden for that block), on consecutive MoD blocks (so the scores a block hands on are
the ones the next block reads) and under each output rule; and the study's reading of it
(``finetune_study.loo``): per-image rank correlations, bootstrap intervals, and a resumed run that measures
nothing again."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import images, make_model, one_torch_thread

import amod
import amod.mod.block as block_module
from amod.analysis import skip_importance
from amod.errors import UserError

LAYERS = [1, 2]
CAPACITY = 0.5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors; a busy 2-core machine: one intra-op thread."""
    with one_torch_thread():
        yield


def brute_force(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, layer: int,
                monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """(B, n) loss rises, one full forward per (image, token): block ``layer`` keeps every token but that one (or, for
    the base, every token) through ``MoDBlock._route`` itself; the other MoD blocks route as the model does."""
    blk = model.blocks[layer]
    p = blk.amod.num_prefix
    n = x.shape[-1] // model.patch_embed.patch_size[0] * x.shape[-2] // model.patch_embed.patch_size[1]
    real_num_kept, real_score = block_module.num_kept, blk.router.score
    state = {"keep": n, "drop": None}

    def num_kept(capacity, num_patches):
        # block `layer` keeps state["keep"]; every other block keeps what its capacity gives
        return state["keep"] if state.get("in_layer") else real_num_kept(capacity, num_patches)

    def score(x_patch, attention_scores):
        s = real_score(x_patch, attention_scores)
        if state["drop"] is not None:  # the skipped token ranks last; the kept ones keep their own scores (and gates)
            s = s.clone()
            s[:, state["drop"]] = s.min() - 1e3
        return s

    route = type(blk)._route

    def routed(self, *args, **kwargs):
        state["in_layer"] = self is blk
        try:
            return route(self, *args, **kwargs)
        finally:
            state["in_layer"] = False

    monkeypatch.setattr(block_module, "num_kept", num_kept)
    monkeypatch.setattr(type(blk), "_route", routed)
    blk.router.score = score
    try:
        out = np.zeros((len(x), n))
        with torch.no_grad():
            for b in range(len(x)):
                state.update(keep=n, drop=None)
                base = F.cross_entropy(model(x[b:b + 1]), y[b:b + 1]).item()
                for i in range(n):
                    state.update(keep=n - 1, drop=i)
                    out[b, i] = F.cross_entropy(model(x[b:b + 1]), y[b:b + 1]).item() - base
        return out
    finally:
        del blk.router.score
        monkeypatch.undo()


@pytest.mark.parametrize("router,scale_output", [("attention", False), ("attention", True), ("standard", True),
                                                 ("hybrid", True), ("hybrid", False), ("random", False)])
def test_matches_a_forward_per_token(router, scale_output, monkeypatch):
    model = amod.convert(make_model("vit", seed=3), router=router, capacity=CAPACITY, layers=LAYERS,
                         scale_output=scale_output).eval()
    if router == "hybrid":  # a trained correction: the hybrid's scores differ from attention's
        for _, blk in amod.mod_blocks(model):
            torch.nn.init.normal_(blk.router.proj.weight, std=0.5)
    x = images(model, batch=2, seed=4)
    y = torch.tensor([1, 3])
    got = skip_importance(model, x, y, batch=5)  # (batches that do not divide the tokens)
    assert sorted(got) == LAYERS
    for layer in LAYERS:
        frozen = [blk.router for _, blk in amod.mod_blocks(model) if hasattr(blk.router, "freeze_draws")]
        for r in frozen:
            r.freeze_draws(1)
        expected = brute_force(model, x, y, layer, monkeypatch)
        for r in frozen:
            r.unfreeze_draws()
        assert got[layer]["importance"].shape == expected.shape == (2, 16)
        np.testing.assert_allclose(got[layer]["importance"], expected, atol=2e-5, rtol=1e-4)
        assert np.abs(expected).max() > 1e-3  # the check can fail: removing a token moves the loss
        assert got[layer]["router"].shape == (2, 16)
        reads_attention = router != "standard" and router != "random"
        assert (got[layer]["attention"] is not None) == reads_attention


def test_capacity_one_is_the_dense_models(monkeypatch):
    """At capacity 1.0 the converted model is the dense one, and its importances are the dense model's, measured by
    the brute force on a dense copy with the token masked out of that block's attention and copied through."""
    dense = make_model("vit", seed=5).eval()
    model = amod.convert(copy.deepcopy(dense), router="attention", capacity=1.0, layers=LAYERS, scale_output=False)
    x, y = images(model, batch=1, seed=6), torch.tensor([2])
    got = skip_importance(model, x, y)
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), rtol=0, atol=1e-5)  # (its attention also scores)
        base = F.cross_entropy(dense(x), y).item()
        for layer in LAYERS:
            blk = dense.blocks[layer]
            for i in range(16):
                keep = [t for t in range(17) if t != 1 + i]  # (token 0 is the class token)

                def without_token(h, keep=keep, blk=blk):  # the block on the other tokens; token i copied through
                    out = h.clone()
                    out[:, keep] = type(blk).forward(blk, h[:, keep])
                    return out

                blk.forward = without_token
                try:
                    rise = F.cross_entropy(dense(x), y).item() - base
                finally:
                    del blk.forward
                assert got[layer]["importance"][0, i] == pytest.approx(rise, abs=2e-5)


def test_refuses_a_model_it_cannot_judge():
    model = amod.convert(make_model("vit"), router="attention", capacity=CAPACITY, layers=LAYERS, skipped="merge")
    with pytest.raises(UserError, match="bypass"):
        skip_importance(model, images(model, batch=1), torch.tensor([0]))


def test_the_study_judges_its_finetuned_models_and_resumes(backbone_path, tmp_path, monkeypatch):
    """`amod study --leave-one-out` on a small backbone: the dense model and each LOO arm's finetuned model (seed 0)
    judged at every MoD block with CIs; a kept model that is gone is trained again to the same rows; a second run
    measures nothing again."""
    from amod.cli import main as amod_main

    out = tmp_path / "study"
    # four of LOO_ARMS, in its order (standard MoD comes as the hybrid's counterpart), and dense
    judged = ["A-MoD (paper)", "standard MoD", "hybrid unscaled (STE)", "random"]
    argv = ["study", "--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.4", "--seeds", "1",
            "--steps", "2", "--val-limit", "32", "--probe-train", "100", "--out", str(out),
            "--methods", *judged[2:]]
    assert amod_main(argv) == 0  # the study alone keeps the seed-0 models of the LOO arms
    kept = sorted(out.glob("models/seed0/cost0.4/*.safetensors"))
    assert len(kept) == len(judged)
    rows = (out / "evals.jsonl").read_text().splitlines()
    kept[0].unlink()
    assert amod_main([*argv, "--leave-one-out", "--loo-images", "3"]) == 0
    assert kept[0].is_file()
    again = (out / "evals.jsonl").read_text().splitlines()
    as_set = lambda lines: {json.dumps({k: v for k, v in json.loads(line).items() if k != "train_images_per_s"},
                                       sort_keys=True) for line in lines}
    assert as_set(again) == as_set(rows)  # trained again: the same rows, every image's correctness included
    report = json.loads((out / "leave_one_out.json").read_text())
    assert [m["name"] for m in report["models"]] == ["dense (zero training)", *judged]
    for m in report["models"]:
        every = m["blocks"].pop("every block")  # each image's correlation averaged over the blocks
        assert sorted(map(int, m["blocks"])) == [1, 2, 3]  # MoD on blocks 1-3 at 0.4 (4 blocks)
        for block in [*m["blocks"].values(), every]:
            rho, low, high = block["router"]
            assert low <= rho <= high and -1 <= low and high <= 1
            assert "random" in block
        assert all("top_token_share" in block for block in m["blocks"].values())
    text = (out / "leave_one_out.md").read_text()
    assert "## Cost 0.4" in text and "| block | dense (zero training) | A-MoD (paper) | standard MoD |" in text
    assert (out / "leave_one_out.png").stat().st_size > 1000

    def measured_again(*args, **kwargs):
        raise AssertionError("a kept measurement was made again")

    monkeypatch.setattr("amod.experiments.finetune_study.loo.skip_importance", measured_again)
    monkeypatch.setattr("amod.experiments.finetune_study.loo.attention_stats", measured_again)
    (out / "leave_one_out.md").unlink()
    assert amod_main([*argv, "--leave-one-out", "--loo-images", "3"]) == 0
    assert (out / "leave_one_out.md").read_text() == text
