"""The command line on Hugging Face models (issue 20): `amod flops`, `bench`, `eval` and `compare` take a
``save_pretrained`` directory, or a hub id written ``hf:ID`` (refused with one line while the hub is offline or
unreachable). The models are tiny random ViTs built from a config; the data is Fashion-MNIST at 28 px."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import one_torch_thread

transformers = pytest.importorskip("transformers")

import amod  # noqa: E402
from amod.cli import main  # noqa: E402

HUB_ID = "hf:google/vit-base-patch16-224"
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=28,
             patch_size=7, num_channels=1)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    """A ViTForImageClassification (10 classes, 1 channel, 28 px) written by save_pretrained."""
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(**SMALL, num_labels=10))
    path = tmp_path_factory.mktemp("hf") / "vit"
    model.save_pretrained(path)
    return path


def _table(out: str) -> dict[tuple[str, str], float]:
    """(model, capacity label) -> the 'vs dense' ratio of `amod flops`'s table."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 7 and "x" in parts[1] and parts[1][0].isdigit():
            rows[(parts[0], parts[2])] = float(parts[5])
    return rows


def test_flops_prices_a_save_pretrained_directory_as_the_library_does(vit_dir, capsys):
    assert main(["flops", str(vit_dir), "vit_tiny_patch16_224", "--capacity", "1", "0.5",
                 "--tome-cost", "0.75"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[(str(vit_dir), "1.000")] == pytest.approx(1.0)
    assert rows[(str(vit_dir), "0.500")] < 0.9 and rows[(str(vit_dir), "ToMe@0.75")] < 0.8
    assert rows[("vit_tiny_patch16_224", "0.500")] < 0.9  # a timm name next to it, as before
    model = amod.convert(amod.hf.load_hf_model(vit_dir), router="attention", capacity=0.5)
    assert rows[(str(vit_dir), "0.500")] == pytest.approx(amod.flops(model).ratio, abs=1e-3)
    # the hf: prefix names the same directory
    assert main(["flops", f"hf:{vit_dir}", "--capacity", "0.5"]) == 0
    assert _table(capsys.readouterr().out)[(f"hf:{vit_dir}", "0.500")] == rows[(str(vit_dir), "0.500")]


def test_bench_times_the_model_and_its_conversion(vit_dir, capsys):
    assert main(["bench", "--model", str(vit_dir), "--capacity", "0.5", "--batch-size", "2", "--repeats", "1",
                 "--warmup", "0", "--device", "cpu", "--no-memory", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["hf"] and r["img_size"] == [28, 28] and r["mod"]["macs"] < r["dense"]["macs"]
    assert r["dense"]["images_per_s"] > 0 and r["flop_speedup"] > 1
    assert main(["bench", "--model", str(vit_dir), "--img-size", "56", "--repeats", "1", "--no-memory"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("amod bench: error:") and "image_size" in err


def test_eval_directory_and_amod_save_file_of_a_hf_model(vit_dir, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(vit_dir), "--val-limit", "64", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("top1 ") and "(64 images)" in out
    assert main(["eval", "--checkpoint", str(vit_dir), "--val-limit", "64", "--batch-size", "64", "--json"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert 0 <= dense["top1"] <= dense["top5"] <= 1 and dense["images"] == 64
    # a converted HF model saved with amod.save loads with amod.load, and evaluates
    converted = amod.convert(amod.hf.load_hf_model(vit_dir), router="attention", capacity=0.5)
    path = amod.save(converted, tmp_path / "mod.safetensors")
    assert type(amod.load(path)).__name__ != "VisionTransformer"
    assert main(["eval", "--checkpoint", str(path), "--val-limit", "64", "--batch-size", "64", "--json"]) == 0
    mod = json.loads(capsys.readouterr().out)
    assert mod["macs"] < dense["macs"] and mod["images"] == 64
    # a backbone (no classifier) is refused with one line
    base = tmp_path / "base"
    transformers.ViTModel(transformers.ViTConfig(**SMALL)).save_pretrained(base)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(base), "--val-limit", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no classifier" in err


def test_compare_runs_the_probe_protocol_on_a_hf_model(vit_dir, one_thread, tmp_path, capsys):
    argv = ["compare", "--checkpoint", str(vit_dir), "--cost", "0.75", "--methods", "ToMe", "A-MoD",
            "--probe-train", "100", "--val-limit", "50", "--speed-batch", "4", "--speed-repeats", "1",
            "--out", str(tmp_path / "cmp")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["protocol"] == "probe" and report["img_size"] == 28
    assert {r["method"] for r in report["rows"]} == {"ToMe", "A-MoD"}
    for r in report["rows"]:
        assert abs(r["cost"] - 0.75) / 0.75 < 0.05 and 0 <= r["zero_top1"] <= 1 and 0.5 < r["cosine"] <= 1 + 1e-6
        assert r["images_per_s"] > 0
    assert main(argv[:-1] + [str(tmp_path / "cmp2"), "--img-size", "56"]) == 2
    assert "image_size" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["flops", HUB_ID], ["bench", "--model", HUB_ID, "--no-memory"],
                                  ["eval", "--checkpoint", HUB_ID], ["compare", "--checkpoint", HUB_ID]])
def test_a_hub_id_offline_is_one_line(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if argv[0] == "compare":
        argv = argv + ["--out", str(tmp_path / "cmp")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"amod {argv[0]}: error:") and "hub" in err
    assert captured.out == ""


def test_an_unreachable_hub_fails_fast_with_one_line(monkeypatch, capsys):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    assert main(["flops", HUB_ID]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hub" in err and "unreachable" in err


def test_a_directory_without_config_json_is_not_a_hf_model(tmp_path, capsys):
    assert main(["flops", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2  # amod.load's own words, as before
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory" in err


def test_a_converted_models_save_pretrained_folder_evaluates_as_the_converted_model(vit_dir, tmp_path, capsys):
    model = amod.convert(amod.hf.load_hf_model(vit_dir), router="standard", capacity=0.5)
    model.save_pretrained(tmp_path / "converted")
    assert main(["eval", "--checkpoint", str(tmp_path / "converted"), "--val-limit", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["macs"] == amod.flops(model).macs < amod.flops(
        amod.hf.load_hf_model(vit_dir)).macs
    # router weights without amod's record of the conversion (transformers' own save_pretrained): refused, not dense
    type(model).save_pretrained(model, tmp_path / "raw")
    capsys.readouterr()  # (its progress bar)
    for argv in (["eval", "--checkpoint", str(tmp_path / "raw")], ["flops", str(tmp_path / "raw")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "router weights" in err and "amod.safetensors" in err


FOLDER_FAULTS = {
    "bad config.json": (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "holds no weights"),
    "unsupported model": (lambda d: (d / "config.json").write_text('{"model_type": "swin"}'),
                          "config.json names no architecture (model_type 'swin')"),
    "corrupt weights": (lambda d: (d / "model.safetensors").write_bytes(b"\x08" + bytes(40)),
                        "cannot read the weights in {d} (model.safetensors)"),
    "pickled weights": (lambda d: ((d / "model.safetensors").unlink(), torch.save({}, d / "pytorch_model.bin")),
                        "{d}/pytorch_model.bin holds pickled weights"),
}


@pytest.mark.parametrize("fault", FOLDER_FAULTS)
def test_a_broken_local_folder_is_named_in_one_line_not_taken_for_the_hub(fault, vit_dir, tmp_path, capsys):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(vit_dir, folder)
    damage, words = FOLDER_FAULTS[fault]
    damage(folder)
    assert main(["flops", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words.format(d=folder) in err and "hub" not in err, err


def test_a_converted_folder_is_priced_and_timed_as_saved_against_its_dense_architecture(vit_dir, tmp_path, capsys):
    """`amod flops` and `amod bench` on the save_pretrained folder of a converted model (issue 48): the model as
    saved, next to its dense architecture, not library advice ("use amod.set_capacity")."""
    model = amod.convert(amod.hf.load_hf_model(vit_dir), skipped="fold", capacity=0.8)
    model.save_pretrained(tmp_path / "fold")
    capsys.readouterr()  # (its progress bar)
    assert main(["flops", str(tmp_path / "fold"), "--capacity", "1", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert rows[(str(tmp_path / "fold"), "saved")] == pytest.approx(amod.flops(model).ratio, abs=1e-3)
    assert amod.flops(model).ratio < 0.95
    assert rows[(str(tmp_path / "fold"), "1.000")] == pytest.approx(1.0)  # its dense architecture
    assert f"note: {tmp_path / 'fold'} is a converted model" in out
    assert main(["bench", "--model", str(tmp_path / "fold"), "--batch-size", "2", "--repeats", "1", "--warmup", "0",
                 "--device", "cpu", "--no-memory", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["label"] == "attention@0.8 skipped=fold (saved)" and r["capacity"] is None
    assert r["mod"]["macs"] == amod.flops(model).macs and r["dense"]["macs"] == amod.flops(
        amod.hf.load_hf_model(vit_dir)).macs


def test_commands_that_take_timm_models_refuse_a_hf_folder_in_one_line(vit_dir, backbone_path, tmp_path, capsys):
    """finetune (--checkpoint, --teacher), calibrate, study --teacher and demo take timm models (amod files): a Hugging
    Face folder is named as such, not "does not exist" or "did you mean .../model.safetensors"."""
    cases = [
        (["finetune", "--checkpoint", str(vit_dir), "--out", str(tmp_path / "r")], "--checkpoint", "finetune"),
        (["finetune", "--model", "vit_tiny_patch16_224", "--pretrained", "--teacher", str(vit_dir), "--out",
          str(tmp_path / "r")], "--teacher", "finetune"),
        (["calibrate", "--checkpoint", str(vit_dir), "--out", str(tmp_path / "c.safetensors")], "--checkpoint",
         "calibrate"),
        (["study", "--checkpoint", str(backbone_path), "--img-size", "28", "--teacher", str(vit_dir), "--out",
          str(tmp_path / "s")], "--teacher", "study"),
        (["demo", "--checkpoint", str(vit_dir), "--out", str(tmp_path / "d")], "--checkpoint", "demo"),
    ]
    for argv, option, command in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{option} {vit_dir} is a Hugging Face model; amod {command} takes" \
            in err, err
    assert list(tmp_path.iterdir()) == []


def test_eval_of_a_hf_backbone_points_to_the_commands_that_take_it(tmp_path, capsys):
    transformers.ViTModel(transformers.ViTConfig(**SMALL)).save_pretrained(tmp_path / "backbone")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "backbone"), "--val-limit", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "has no classifier (a backbone)" in err and "amod compare or amod frontier" in err
    assert "amod finetune" not in err  # (it takes timm models)


# ---------------------------------------------------------------- amod.save files of Hugging Face models (issue 55)

@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """``amod.save`` files of Hugging Face models: a ViT classifier (dense, and A-MoD at 0.5) and a DINOv2 backbone
    without a head (dense, and A-MoD at 0.5); 1 channel, 28 px."""
    import copy

    root = tmp_path_factory.mktemp("hf_files")
    torch.manual_seed(0)
    classifier = transformers.ViTForImageClassification(transformers.ViTConfig(**SMALL, num_labels=10)).eval()
    backbone = transformers.Dinov2Model(transformers.Dinov2Config(**SMALL)).eval()
    files = {"classifier": amod.save(classifier, root / "classifier.safetensors"),
             "backbone": amod.save(backbone, root / "backbone.safetensors")}
    for name, model in (("classifier", classifier), ("backbone", backbone)):
        files[f"{name}_mod"] = amod.save(amod.convert(copy.deepcopy(model), router="attention", capacity=0.5),
                                         root / f"{name}_mod.safetensors")
    return files


@pytest.fixture
def one_thread():
    """One torch thread while a linear probe is fitted on a few dozen features: on the 2 shared cores of the test
    machine a second thread makes each L-BFGS step many times slower, and the probe's answer is the same."""
    with one_torch_thread():
        yield


@pytest.mark.parametrize("command, model", [("compare", "classifier"), ("frontier", "backbone")])
def test_compare_and_frontier_measure_an_amod_file_of_a_hf_model_by_the_probe_protocol(command, model, hf_files,
                                                                                        one_thread, tmp_path, capsys):
    """An ``amod.save`` file of a Hugging Face model is what its folder is to these commands (they crashed on
    ``model.num_classes``): the probe protocol at its own input size, a classifier included (amod does not train it)."""
    out = tmp_path / command
    argv = [command, "--checkpoint", str(hf_files[model]), "--cost", "0.75", "--methods", "ToMe", "--probe-train",
            "40", "--val-limit", "8", "--speed-batch", "2", "--speed-repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / f"{command}.json").read_text())
    assert [r["method"] for r in report["rows"]] == ["ToMe"]
    if command == "compare":
        assert report["protocol"] == "probe" and report["img_size"] == 28
    assert abs(report["rows"][0]["cost"] - 0.75) / 0.75 < 0.05
    capsys.readouterr()
    assert main(argv[:-1] + [str(tmp_path / "again"), "--img-size", "56"]) == 2  # it runs at its own size
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "image_size" in err and "drop --img-size" in err, err


@pytest.mark.parametrize("argv, option", [
    (["finetune", "--checkpoint", "{classifier}"], "--checkpoint"),
    (["finetune", "--checkpoint", "{classifier_mod}", "--capacity", "0.25"], "--checkpoint"),
    (["finetune", "--checkpoint", "{timm}", "--teacher", "{classifier}"], "--teacher"),
    (["study", "--checkpoint", "{backbone}", "--img-size", "28"], "--checkpoint"),  # the finetune study
    (["study", "--checkpoint", "{classifier}", "--quick"], "--checkpoint"),  # the routers' study
    (["demo", "--checkpoint", "{backbone}", "--quick"], "--checkpoint"),
])
def test_the_training_commands_refuse_an_amod_file_of_a_hf_model_in_one_line(argv, option, hf_files, tmp_path, capsys):
    """finetune, study and demo train timm models: an amod file of a Hugging Face model is refused in one line that
    names what it holds and which commands take it (they crashed on ``num_classes``; a teacher was said to have
    "None classes"), and nothing is created."""
    timm_model = pytest.importorskip("timm").create_model("vit_tiny_patch16_224", img_size=28, patch_size=7, in_chans=1,
                                                          depth=2, embed_dim=32, num_heads=2, num_classes=10)
    names = {**hf_files, "timm": amod.save(timm_model, tmp_path / "timm.safetensors")}
    argv = [a.format(**names) for a in argv] + ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    path = argv[argv.index(option) + 1]
    assert len(err.splitlines()) == 1 and err.startswith(f"amod {argv[0]}: error: {option} {path} holds a Hugging "
                                                         f"Face ViT, DeiT and DINOv2"), err
    assert f"amod {argv[0]} takes timm models only" in err and "compare and frontier take Hugging Face models" in err
    assert not (tmp_path / "out").exists()


def test_analyze_loo_on_an_amod_file_of_a_hf_mod_model(hf_files, tmp_path, capsys):
    """Leave-one-out runs the model's own forward (it called timm's patch_embed, a view on a Hugging Face model); a
    backbone, which has no loss to measure, is refused in one line."""
    out = tmp_path / "loo"
    assert main(["analyze", "loo", "--checkpoint", str(hf_files["classifier_mod"]), "--images", "2", "--tokens", "3",
                 "--out", str(out)]) == 0
    data = json.loads((out / "loo.json").read_text())
    assert set(data["layers"]) == {"1"} and [len(i) for i in data["importance"]["1"]] == [3, 3]
    capsys.readouterr()
    assert main(["analyze", "loo", "--checkpoint", str(hf_files["backbone_mod"]), "--images", "2", "--out",
                 str(tmp_path / "bb")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no classifier (a backbone)" in err, err
    assert not (tmp_path / "bb").exists()
