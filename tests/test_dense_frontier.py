"""The dense task and `amod dense-frontier`: canvas masks that agree with the pixels drawn, the patch probe and its
scores on known cases, and the sweep on a small random backbone (every point measured, timed, read; a finished sweep
reused)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_in_process

from amod.detect.canvases import BACKGROUND, DetectionCanvases
from amod.dense.segmentation import (NUM_SEGMENT_CLASSES, SegmentationCanvases, confusion, fit_patch_probe,
                                          miou_and_accuracy, patch_targets, segmentation_scores, spec_at)


def test_a_canvas_mask_labels_exactly_the_pixels_drawn_with_the_classes_placed():
    canvases = DetectionCanvases("val", 12, spec_at(224))
    for i in range(len(canvases)):
        image, target = canvases[i]
        mask = canvases.mask(i)
        assert mask.shape == image.shape[1:] and mask.dtype == torch.int64
        assert torch.equal(mask != BACKGROUND, image[0] > 0)  # every drawn pixel is an item's, no other
        assert set(mask.unique().tolist()) - {BACKGROUND} <= set(target["class_labels"].tolist())
        for p in canvases.placements(i):  # an item's labels lie inside its box
            outside = torch.ones_like(mask, dtype=torch.bool)
            x0, y0, x1, y1 = p.box
            outside[y0:y1, x0:x1] = False
            others = {q.label for q in canvases.placements(i) if q is not p}
            if p.label not in others:
                assert not (mask[outside] == p.label).any()


def test_the_data_set_scales_the_canvases_to_the_input_and_normalises_them():
    data = SegmentationCanvases("train", 2, 112)
    image, mask = data[0]
    assert image.shape == (3, 112, 112) and mask.shape == (112, 112)
    assert image.min() < -0.5  # (the black canvas, normalised)
    assert spec_at(448).max_scale == 168 and spec_at(448).min_scale == 70


def test_patch_targets_are_each_patchs_class_shares():
    masks = torch.full((1, 4, 4), BACKGROUND)
    masks[0, :2, :2] = 3  # the top-left 2x2 patch is all class 3
    masks[0, 2, 3] = 7  # one pixel of the bottom-right patch is class 7
    t = patch_targets(masks, 2)
    assert t.shape == (1, 4, NUM_SEGMENT_CLASSES) and torch.allclose(t.sum(-1), torch.ones(1, 4))
    assert t[0, 0, 3] == 1 and t[0, 1, BACKGROUND] == 1 and t[0, 3, 7] == 0.25 and t[0, 3, BACKGROUND] == 0.75


def test_miou_and_pixel_accuracy_on_a_known_confusion():
    counts = torch.zeros(NUM_SEGMENT_CLASSES, NUM_SEGMENT_CLASSES)
    counts[0, 0], counts[0, 1], counts[1, 1], counts[BACKGROUND, BACKGROUND] = 6, 2, 4, 8
    miou, acc = miou_and_accuracy(counts)
    # class 0: 6 / (8 + 6 - 6); class 1: 4 / (6 + 4 - 4); background 1; the 8 classes never seen are left out
    assert miou == pytest.approx((6 / 8 + 4 / 6 + 1) / 3) and acc == pytest.approx(18 / 20)


def test_the_probe_reads_separable_patch_features_and_scores_them_perfectly():
    g = torch.Generator().manual_seed(0)
    # one class per image (the background in the last), so that upsampling the logits blurs no boundary
    masks = torch.tensor([0, 1, 2, 3, 4, BACKGROUND])[:, None, None].expand(6, 8, 8).clone()
    targets = patch_targets(masks, 4)  # (6, 4 patches, classes): pure patches
    centres = torch.randn(NUM_SEGMENT_CLASSES, 16, generator=g) * 4
    feats = targets @ centres + 0.1 * torch.randn(6, 4, 16, generator=g)
    probe = fit_patch_probe(feats, targets)
    scores = segmentation_scores(confusion(probe, feats, masks, 4))
    assert scores["miou"] == pytest.approx(1.0) and scores["pixel_acc"] == pytest.approx(1.0)
    assert scores["halves"] == pytest.approx([1.0, 1.0])


def test_the_sweep_scores_times_and_reads_every_method_and_reuses_what_it_measured(backbone_path, tmp_path, capsys):
    out = tmp_path / "dense"
    argv = ["dense-frontier", "--checkpoint", str(backbone_path), "--img-size", "42", "--cost", "0.5", "0.8",
            "--train-canvases", "12", "--val-limit", "6", "--speed-batch", "3", "--speed-repeats", "1",
            "--speedups", "1.01", "50", "--calibration-images", "4", "--methods", "ToMe", "A-MoD (paper)",
            "calibrated, nothing protected", "--device", "cpu", "--out", str(out)]
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "dense_frontier.json").read_text())
    assert data["dense"]["speed"]["3"]["speedup"] == 1.0 and data["dense"]["cosine"] == 1.0
    methods = ("ToMe", "A-MoD (paper)", "calibrated, nothing protected")
    assert {r["method"] for r in data["rows"]} == set(methods)
    for r in data["rows"]:
        assert 0 <= r["miou"] <= 1 and 0 <= r["pixel_acc"] <= 1 and len(r["halves"]) == 2
        assert r["cost"] < 0.95 and r["speed"]["3"]["images_per_s"] > 0 and -1 <= r["cosine"] <= 1 + 1e-6
    assert all(v is None for v in data["readings"]["50"].values())
    assert set(data["readings"]["1.01"]) == set(methods)
    report = (out / "dense_frontier.md").read_text()
    assert "| 50x | – | – | – | – |" in report and "fidelity of the class token" in report
    assert (out / "dense_frontier.png").stat().st_size > 10_000
    # a second sweep measures nothing again: the rows, the calibrations and the timing rounds are reused
    kept = {p.name: p.read_text() for p in out.glob("*.jsonl")}
    assert len(kept) == 3
    assert cli_in_process(argv, capsys).returncode == 0
    assert {p.name: p.read_text() for p in out.glob("*.jsonl")} == kept
    again = json.loads((out / "dense_frontier.json").read_text())
    assert [r["miou"] for r in again["rows"]] == [r["miou"] for r in data["rows"]]
    assert [r["speed"] for r in again["rows"]] == [r["speed"] for r in data["rows"]]


def test_bad_settings_are_refused_in_one_line(backbone_path, tmp_path, capsys):
    base = ["dense-frontier", "--checkpoint", str(backbone_path), "--out", str(tmp_path / "o")]
    for extra, words in ((["--val-limit", "1"], "--val-limit must be at least 2"),
                         (["--train-canvases", "8", "--calibration-images", "9"], "--calibration-images (9)"),
                         (["--img-size", "45"], "not a multiple of the model's patch size 7")):
        res = cli_in_process(base + extra, capsys)
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
