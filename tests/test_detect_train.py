"""Detection runs: a DETR trained on the canvases resumes after a kill exactly, and the study writes its report."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pycocotools")

from amod.detect import train as detect_train  # noqa: E402
from amod.detect.config import DetectConfig, DetectStudyConfig  # noqa: E402
from amod.detect.study import run_detect_study  # noqa: E402
from amod.detr.models import ContentQueries  # noqa: E402
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
