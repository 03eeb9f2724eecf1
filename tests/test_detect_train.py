"""Detection runs: a DETR trained on the canvases resumes after a kill exactly, and the study writes its report."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pycocotools")

import amod  # noqa: E402
from amod.detect import train as detect_train  # noqa: E402
from amod.detect.config import DetectConfig, DetectStudyConfig  # noqa: E402
from amod.detect.study import run_detect_study  # noqa: E402
from amod.detect.models import small_detr
from amod.families.detr import ContentQueries  # noqa: E402
from conftest import counted_parses, run_in_process  # noqa: E402
from amod.train.engine import read_metrics  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TINY = dict(canvas_size=64, train_canvases=24, val_canvases=6, batch_size=4, d_model=32, warmup=1)


def test_a_killed_run_resumes_at_its_last_evaluation_and_ends_as_an_unbroken_one(tmp_path, monkeypatch):
    whole = DetectConfig(out=str(tmp_path / "whole"), steps=4, eval_every=2, **TINY)
    detect_train.train_detector(whole)

    broken = DetectConfig(out=str(tmp_path / "broken"), steps=4, eval_every=2, **TINY)
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def dies_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed between two evaluations
        return clip(*args, **kwargs)

    monkeypatch.setattr(detect_train.torch.nn.utils, "clip_grad_norm_", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        detect_train.train_detector(broken)
    assert [r["step"] for r in read_metrics(tmp_path / "broken" / "metrics.jsonl")] == [0, 2]
    monkeypatch.setattr(detect_train.torch.nn.utils, "clip_grad_norm_", clip)
    detect_train.train_detector(broken)

    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "broken" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_a = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    rows_b = read_metrics(tmp_path / "broken" / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [0, 2, 4]
    assert [r["AP50"] for r in rows_a] == [r["AP50"] for r in rows_b]
    with pytest.raises(ValueError, match="other settings"):
        detect_train.train_detector(DetectConfig(out=str(tmp_path / "whole"), steps=5, eval_every=2, **TINY))


def test_the_study_finetunes_each_router_at_a_matched_encoder_cost_and_reports(tmp_path):
    dense = DetectConfig(out=str(tmp_path / "dense"), steps=2, eval_every=2, **TINY)
    detect_train.train_detector(dense)
    cfg = DetectStudyConfig(dense=str(tmp_path / "dense" / "model.safetensors"), out=str(tmp_path / "study"),
                            costs=(0.5,), routers=("attention", "feature-norm"), seeds=2, steps=2, batch_size=4,
                            train_canvases=24, val_canvases=6, canvas_size=64, speed_batch=4, speed_repeats=2)
    report = run_detect_study(cfg)
    text = report.read_text()
    assert "| 0.5 | attention |" in text and "| 0.5 | feature-norm |" in text and "| 1 | dense |" in text
    assert (tmp_path / "study" / "detr_kept_positions.png").stat().st_size > 0
    data = json.loads((tmp_path / "study" / "detr.json").read_text())
    costs = data["costs"]
    assert abs(costs["0.5|attention"]["encoder"] - 0.5) < 0.05 and costs["None|None"]["encoder"] == 1.0
    rows = {(r["cost"], r["router"]): r for r in data["table"]}
    assert rows[(0.5, "feature-norm")]["seeds"] == [0, 1]
    assert rows[(0.5, "feature-norm")]["vs_a_mod_AP50"]["n_seeds"] == 2
    assert set(data["speeds"]) == {"dense", "attention @ 0.5", "feature-norm @ 0.5"}
    # a detector trained here starts its decoder from the query embeddings, and says so in its file
    finetuned = detect_train.load_detector(tmp_path / "study" / "cost0.5" / "attention" / "seed0" / "model.safetensors")
    assert any(isinstance(h, ContentQueries) for h in finetuned.model._forward_pre_hooks.values())
    assert finetuned.amod_config.router == "attention" and finetuned.amod_config.layers == [1, 2, 3, 4, 5]


def test_what_amod_detect_train_saves_amod_load_rebuilds(tmp_path):
    cfg = DetectConfig(out=str(tmp_path / "run"), steps=1, eval_every=1, **TINY)
    detect_train.train_detector(cfg)
    path = tmp_path / "run" / "model.safetensors"
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = amod.load(path)(pixel_values=images).logits
        b = detect_train.load_detector(path)(pixel_values=images).logits
        c = detect_train.build_model(cfg)(pixel_values=images).logits  # a new model: other weights
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_conversion_is_one_spec_and_a_run_saved_with_router_and_layers_fields_still_resumes(
        tmp_path, monkeypatch, detector_files):
    cfg = DetectConfig(out=str(tmp_path / "run"), init=str(detector_files[0]), steps=2, eval_every=1, **TINY)
    cfg = cfg.with_shorthand({"router": "feature-norm", "layers": [1, 2]})
    assert cfg.encoder_method() == amod.MoD(router="feature-norm", layers=(1, 2))
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def dies_at_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(detect_train.torch.nn.utils, "clip_grad_norm_", dies_at_step_2)
    parsed = counted_parses(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        detect_train.train_detector(cfg)
    assert parsed == []  # the run's settings hold the method --router built: never written out and parsed back
    monkeypatch.setattr(detect_train.torch.nn.utils, "clip_grad_norm_", clip)
    # as amod up to f875d91 saved it: the conversion as router and layers fields
    path = tmp_path / "run" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    saved = state["config"]
    assert saved["method"] == "mod:router=feature-norm,layers=[1,2]"
    state["config"] = {**{k: v for k, v in saved.items() if k != "method"}, "router": "feature-norm", "layers": [1, 2]}
    torch.save(state, path)
    assert DetectConfig.from_dict(state["config"]) == DetectConfig(**saved)
    row = detect_train.train_detector(cfg)
    assert row["step"] == 2 and [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
    model = detect_train.load_detector(tmp_path / "run" / "model.safetensors")
    assert (model.amod_config.router, model.amod_config.layers) == ("feature-norm", [1, 2])
    with pytest.raises(ValueError, match="other settings"):  # another conversion is another run
        detect_train.train_detector(cfg.with_shorthand({"router": "attention"}))


@pytest.fixture(scope="module")
def detector_files(tmp_path_factory):
    """(a dense small DETR, a ViT classifier) saved with amod.save: neither trained."""
    import timm

    root = tmp_path_factory.mktemp("detectors")
    detr = amod.save(small_detr(d_model=32, ffn=64), root / "detr.safetensors")
    vit = amod.save(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                                      num_classes=10), root / "vit.safetensors")
    return detr, vit


TINY_FLAGS = ["--steps", "1", "--batch-size", "4", "--train-canvases", "8", "--val-limit", "2"]
REFUSED = [
    (["train", "--init", "{vit}"], "init {vit} holds a vit_tiny_patch16_224, not a DETR"),
    (["train", "--init", "{detr}", "--router", "bogus"], "unknown router 'bogus'; supported routers: "),
    (["train", "--init", "{detr}", "--router", "attention", "--encoder-cost", "1.5"], "encoder_cost must be in (0, 1]"),
    (["train", "--init", "{detr}", "--layers", "1,2"], "--layers sets the MoD conversion's layers: give --router"),
    (["train", "--init", "{detr}", "--method", "tome:cost=0.5"], "converts the encoder with MoD; 'tome:cost=0.5' is"),
    (["train", "--init", "{detr}", "--method", "mod:capacity=0.25"], "sets a capacity; the encoder's capacity is the"),
    (["train", "--train-canvases", "2"], "train_canvases (2) is smaller than one batch (4)"),
    (["study", "--dense", "{vit}"], "dense {vit} holds a vit_tiny_patch16_224, not a DETR"),
    (["study", "--dense", "{detr}", "--cost", "0"], "each encoder cost must be in (0, 1)"),
    (["study", "--dense", "{detr}", "--cost", "0.5", "1.5"], "each encoder cost must be in (0, 1)"),
    (["study", "--dense", "{detr}", "--routers", "attention", "bogus"], "unknown router 'bogus' for a DETR encoder"),
    (["study", "--dense", "{detr}", "--report-only"], "holds no evaluated run of this study"),
]


@pytest.mark.parametrize("argv, words", REFUSED, ids=[" ".join(a[:2] + a[3:4]) for a, _ in REFUSED])
def test_a_refused_detection_command_says_why_in_one_line_before_any_work_and_writes_nothing(
        argv, words, detector_files, tmp_path, capsys):
    detr, vit = detector_files
    out = tmp_path / "out"
    argv = [a.format(detr=detr, vit=vit) for a in argv]
    if "--train-canvases" in argv:
        argv = argv + TINY_FLAGS[:4]
    code, err = run_in_process(["detect", *argv, "--out", str(out), *([] if "--train-canvases" in argv else TINY_FLAGS)],
                               capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words.format(detr=detr, vit=vit) in err, err
    assert not out.exists()  # no lock, log or config.yaml: nothing
