"""The linear-probe protocol: a probe fitted on dense features, applied unchanged to reduced models."""
from __future__ import annotations

import json

import pytest
import timm
import torch

import amod
from amod.cli import main as amod_main
from amod.experiments.probe import fit_probe, mean_cosine


def test_the_probe_separates_separable_classes_and_picks_its_penalty_on_held_out_data():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=g) * 3
    labels = torch.arange(400) % 4
    feats = centers[labels] + torch.randn(400, 16, generator=g)
    probe = fit_probe(feats[:300], labels[:300])
    assert probe.accuracy(feats[300:], labels[300:]) > 0.95 and probe.held_out_accuracy > 0.95
    assert torch.equal(probe.weight, fit_probe(feats[:300], labels[:300]).weight)  # deterministic
    # few samples, one informative feature among 300: a weak penalty fits the noise, the held-out part says so
    y = torch.arange(60) % 2
    x = torch.randn(60, 300, generator=g)
    x[:, 0] += 3 * (2 * y - 1)
    chosen = fit_probe(x[:40], y[:40], l2_grid=(1e-6, 1.0))
    weak = fit_probe(x[:40], y[:40], l2_grid=(1e-6,))
    assert chosen.l2 == 1.0 and chosen.held_out_accuracy > weak.held_out_accuracy
    noise = torch.randn(400, 16, generator=g)
    assert fit_probe(noise[:300], labels[:300]).accuracy(noise[300:], labels[300:]) < 0.45  # chance is 0.25
    assert mean_cosine(feats, feats) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs"):
        fit_probe(feats[:5], labels[:5])


def test_compare_on_a_backbone_uses_the_probe_and_caches_thedense_features(tmp_path, capsys):
    torch.manual_seed(0)
    backbone = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=42, patch_size=7, depth=4,
                                 embed_dim=64, num_heads=2, num_classes=0)
    path = amod.save(backbone, tmp_path / "backbone.safetensors")
    argv = ["compare", "--checkpoint", str(path), "--img-size", "28", "--cost", "0.75", "--probe-train", "200",
            "--val-limit", "100", "--speed-batch", "4", "--speed-repeats", "1", "--out", str(tmp_path / "cmp")]
    assert amod_main(argv) == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["protocol"] == "probe" and report["img_size"] == 28
    names = {r["method"] for r in report["rows"]}
    assert {"ToMe", "A-MoD fold", "fold, nothing protected", "fold, random protected"} <= names
    for r in report["rows"]:
        assert 0 <= r["zero_top1"] <= 1 and -1 <= r["cosine"] <= 1 and r["top1"] is None
    fold = next(r for r in report["rows"] if r["method"] == "A-MoD fold")
    assert abs(fold["cost"] - 0.75) / 0.75 < 0.02 and fold["cosine"] > 0.5
    cache = list((tmp_path / "cmp").glob("dense_features_*.pt"))
    assert len(cache) == 1
    # a comparison killed after its first measurement (the last line torn) resumes from there, and a
    # rerun restricted with --methods reports those methods only, with the same numbers
    done = list((tmp_path / "cmp").glob("probe_rows_*.jsonl"))
    assert len(done) == 1 and len(done[0].read_text().splitlines()) == len(report["rows"])
    first = done[0].read_text().splitlines()[0]
    done[0].write_text(first + "\n" + '{"method": "A-MoD f')
    capsys.readouterr()
    assert amod_main(argv + ["--methods", "A-MoD fold", "ToMe"]) == 0
    rerun = json.loads((tmp_path / "cmp" / "compare.json").read_text())["rows"]
    assert [r["method"] for r in rerun] == ["ToMe", "A-MoD fold"]  # in the report's usual order
    before = {r["method"]: r for r in report["rows"]}
    for r in rerun:
        assert (r["zero_top1"], r["cosine"], r["cost"]) == pytest.approx(
            (before[r["method"]]["zero_top1"], before[r["method"]]["cosine"], before[r["method"]]["cost"]))
    assert "probe top-1" in (tmp_path / "cmp" / "compare.md").read_text()
    capsys.readouterr()
    assert amod_main(argv + ["--methods", "ToMe", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'nonsense'" in err and err.count("\n") == 1


def test_a_corrupt_or_foreign_dense_features_file_is_computed_again_with_a_warning_naming_it(tmp_path, caplog):
    import logging

    from amod.experiments.features import dense_features
    from amod.train.data import TensorImages

    torch.manual_seed(0)
    backbone = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=28, patch_size=7, depth=1,
                                 embed_dim=32, num_heads=2, num_classes=0, in_chans=1).eval()
    images = (torch.rand(18, 28, 28) * 255).to(torch.uint8)
    train = TensorImages(images[:12], torch.arange(12) % 3, False, 28)
    val = TensorImages(images[12:], torch.arange(6) % 3, False, 28)
    cpu = torch.device("cpu")
    fresh = dense_features(tmp_path, "k", backbone, train, val, cpu)
    path = tmp_path / "dense_features_k.pt"
    good = path.read_bytes()
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    torch.save({**fresh, "test": fresh["test"][:2], "test_labels": fresh["test_labels"][:2]}, tmp_path / "other.pt")
    bad_files = {"garbage": b"not a torch file", "torn": good[: len(good) // 2],
                 "foreign": (tmp_path / "foreign.pt").read_bytes(), "other sizes": (tmp_path / "other.pt").read_bytes()}
    log = logging.getLogger("amod")  # amod's CLI stops it propagating to the root logger
    log.addHandler(caplog.handler)
    try:
        for what, data in bad_files.items():
            path.write_bytes(data)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="amod"):
                again = dense_features(tmp_path, "k", backbone, train, val, cpu)
            assert all(torch.equal(again[k], fresh[k]) for k in fresh), what
            assert f"{path} cannot be reused" in caplog.text and "computing the dense features again" in caplog.text
            assert all(torch.equal(v, fresh[k]) for k, v in torch.load(path, weights_only=True).items()), what
    finally:
        log.removeHandler(caplog.handler)


def test_the_fitted_probe_is_kept_and_fitted_again_only_for_other_features_or_a_bad_file(tmp_path, caplog):
    import logging

    from amod.experiments.probe import LinearProbe, fit_probe_cached

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(90) % 3
    feats = torch.randn(3, 8, generator=g)[labels] * 2 + torch.randn(90, 8, generator=g)
    path = tmp_path / "probe.pt"

    def probe_of(f: torch.Tensor) -> tuple[LinearProbe, str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="amod"):
            probe = fit_probe_cached(path, f, labels)
        return probe, caplog.text

    def same(a: LinearProbe, b: LinearProbe) -> bool:
        return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("mean", "std", "weight", "bias")) and \
            (a.l2, a.held_out_accuracy) == (b.l2, b.held_out_accuracy)

    log = logging.getLogger("amod")  # amod's CLI stops it propagating to the root logger
    log.addHandler(caplog.handler)
    try:
        first, text = probe_of(feats)
        assert "chosen" in text and same(first, fit_probe(feats, labels))
        again, text = probe_of(feats)
        assert f"linear probe reused from {path}" in text and "chosen" not in text and same(again, first)
        other, text = probe_of(feats + 0.5)  # other features (a changed backbone): fitted again, and kept
        assert "chosen" in text and not same(other, first)
        assert "reused" in probe_of(feats + 0.5)[1]
        for bad in (b"not a torch file", path.read_bytes()[:100]):
            path.write_bytes(bad)
            refit, text = probe_of(feats)
            assert f"{path} cannot be reused" in text and "chosen" in text and same(refit, first)
    finally:
        log.removeHandler(caplog.handler)
