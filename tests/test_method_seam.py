"""A method is one class: a toy in one file (``amod_toy_method.py``: it skips the last blocks), registered here, is
priced, saved, loaded, found in a model, set to a cost, and taken by name by every command (train, eval, export,
compare, frontier) with nothing else of amod changed; packaged with an ``amod.methods`` entry point, the shipped
``amod`` command runs it in a process of its own, and refuses its files in one line where it is not installed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import ClassVar

import pytest
import timm
import torch
from amod_toy_method import SkipLast, SkippedBlock
from conftest import cli_in_process, images, make_model
from timm.models.vision_transformer import Block
from torch import nn

import amod
from amod import methods
from amod.cost import count_flops
from amod.methods import METHOD_CLASSES, Method, method_of, parse_method, register_method
from amod.train.config import RunConfig


@pytest.fixture
def toy_method():
    register_method(SkipLast)
    yield SkipLast.kind
    del METHOD_CLASSES[SkipLast.kind]


def test_a_method_class_is_registered_priced_found_saved_and_set_to_a_cost(toy_method, tmp_path):
    assert parse_method("toy-skip:blocks=2") == SkipLast(2) and SkipLast(2).spec() == "toy-skip:blocks=2"
    model = SkipLast(1).apply(make_model("vit"))  # (4 blocks)
    assert amod.method_of(model) == SkipLast(1)
    report = amod.flops(model)
    assert report.ratio < 0.85 and report.macs == pytest.approx(count_flops(model, images(model, 1)) / 2, rel=0.02)
    again = amod.load(amod.save(model, tmp_path / "toy.safetensors"))
    assert amod.method_of(again) == SkipLast(1) and amod.flops(again).macs == report.macs
    x = images(model, 2)
    with torch.no_grad():
        assert torch.equal(model(x), again(x))
    assert SkipLast().at_cost(make_model("vit"), 0.5) == SkipLast(2)
    assert RunConfig(method_spec="toy-skip:blocks=1").validate().method() == SkipLast(1)


def test_train_and_flops_take_a_registered_method_by_name(toy_method, tmp_path, capsys):
    """(finetune, eval, export, compare and frontier run it through the shipped command, below)"""
    run = tmp_path / "run"
    res = cli_in_process(["train", "--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "3",
                          "--embed-dim", "32", "--num-heads", "2", "--train-limit", "64", "--val-limit", "64",
                          "--batch-size", "32", "--epochs", "1", "--method", "toy-skip:blocks=1", "--out", str(run)],
                         capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["variant"] == "toy-skip"  # (its spec: blocks=1 is the default)
    model = amod.load(run / "model.safetensors")
    assert amod.method_of(model) == SkipLast(1) and isinstance(model.blocks[2], SkippedBlock)
    assert "method_spec: toy-skip" in (run / "config.yaml").read_text()
    assert amod.flops(model).macs < amod.flops(make_dense(model)).macs

    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--capacity", "1.0", "--method", "toy-skip:blocks=6"],
                         capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "toy-skip:blocks=6" in res.stdout  # (half of vit_tiny's 12 blocks skipped)


def make_dense(model: nn.Module) -> nn.Module:
    """The dense model of ``model``'s architecture (its skipped blocks made timm blocks again)."""
    import copy

    dense = copy.deepcopy(model)
    for blk in dense.blocks:
        blk.__class__ = Block
    assert isinstance(method_of(dense), amod.Dense)
    return dense


# ---------------------------------------------------------------- a method without a key; a file of an unknown one

def test_a_method_class_must_name_the_metadata_entry_it_writes():
    """Without a ``metadata_key`` a method's files would read back as dense models: registering one is refused, as
    is a key another method writes."""

    @dataclass(frozen=True)
    class RandomDrop(Method):
        kind: ClassVar[str] = "toy-drop"
        keep: float = 0.5

    with pytest.raises(ValueError, match=r"RandomDrop \(kind 'toy-drop'\): a method must set metadata_key, .*"
                                         r"metadata_key: ClassVar\[str\] = 'amod\.toy-drop'\), got None"):
        register_method(RandomDrop)

    @dataclass(frozen=True)
    class Clash(Method):
        kind: ClassVar[str] = "toy-clash"
        metadata_key: ClassVar[str] = "amod.merge"

    with pytest.raises(ValueError, match=r"metadata_key 'amod\.merge' is the tome method's already"):
        register_method(Clash)
    assert "toy-drop" not in METHOD_CLASSES and "toy-clash" not in METHOD_CLASSES


def test_a_file_of_a_method_not_registered_is_refused_naming_it(tmp_path):
    """A file names the method that wrote it (``amod.method``); where that method is not registered, loading refuses
    it in one line naming the method and the entry-point group, never opening it as a dense model. A file from before
    the ``amod.method`` entry is refused by its unknown ``amod.NAME`` entry."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    register_method(SkipLast)
    try:
        path = amod.save(SkipLast(1).apply(make_model("vit")), tmp_path / "toy.safetensors")
    finally:
        del METHOD_CLASSES[SkipLast.kind]
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["amod.method"] == "toy-skip" and json.loads(meta["amod.toy-skip"]) == {"blocks": 1}
    refused = (r"toy\.safetensors was saved by method 'toy-skip', which is not registered in this amod: install \(or "
               r"import\) the package that registers it \(entry-point group amod\.methods\); registered methods: dense, "
               r"mod, tome")
    for read in (amod.load, amod.checkpoint.skeleton, amod.checkpoint.check_dense_file):
        with pytest.raises(ValueError, match=refused):
            read(path)
    older = {k: v for k, v in meta.items() if k != "amod.method"}
    save_file(tensors, str(tmp_path / "older.safetensors"), metadata=older)
    with pytest.raises(ValueError, match=r"older\.safetensors was saved by method entry 'amod\.toy-skip', which is "
                                         r"not registered"):
        amod.load(tmp_path / "older.safetensors")
    with pytest.raises(ValueError, match=r"saved by method 'toy-skip'"):
        methods.method_from_metadata(meta)
    # files of the built-in methods from before the entry load as they did (amod.merge: token merging)
    merged = amod.save(amod.tome.apply(make_model("vit"), r=2), tmp_path / "tome.safetensors")
    with safe_open(str(merged), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["amod.method"] == "tome"
    save_file(tensors, str(tmp_path / "old_tome.safetensors"), metadata={k: v for k, v in meta.items()
                                                                        if k != "amod.method"})
    assert amod.load(tmp_path / "old_tome.safetensors").amod_tome.schedule == [2, 2, 2, 2]


# ---------------------------------------------------------------- packaged: the amod.methods entry-point group

def toy_package(root: Path, name: str = "amod_toy_method", target: str = "amod_toy_method:SkipLast") -> Path:
    """``root``, holding what installing the toy method as a package leaves on the path: its module (this directory's
    ``amod_toy_method.py``, or ``name``.py raising where ``name`` is not the toy's) and a dist-info with its
    ``amod.methods`` entry point."""
    root.mkdir()
    if name == "amod_toy_method":
        shutil.copy(Path(__file__).with_name("amod_toy_method.py"), root)
    else:
        (root / f"{name}.py").write_text("raise ImportError('this toy plugin needs a package that is not here')\n")
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[amod.methods]\ntoy = {target}\n")
    return root


def test_an_installed_package_s_entry_point_registers_its_method_and_a_broken_one_is_named(tmp_path, monkeypatch,
                                                                                          capsys):
    methods.load_method_plugins()  # (the installed amod's own entry points first, PPT's: the toy's is the one added)
    monkeypatch.setitem(methods._plugins, "loaded", False)  # (the registry looks for entry points again)
    monkeypatch.syspath_prepend(str(toy_package(tmp_path / "good")))
    try:
        assert parse_method("toy-skip:blocks=2") == SkipLast(2)  # (the class this suite imported: one module)
        assert methods.method_classes()[-2:] == (SkipLast, amod.Dense)
    finally:
        METHOD_CLASSES.pop(SkipLast.kind, None)
    monkeypatch.setitem(methods._plugins, "loaded", False)
    monkeypatch.syspath_prepend(str(toy_package(tmp_path / "broken", "amod_broken_method", "amod_broken_method")))
    with pytest.raises(ValueError, match=r"^the amod\.methods entry point toy = amod_broken_method of "
                                         r"amod-broken-method 0\.1 failed to load \(ImportError: this toy plugin needs "
                                         r"a package that is not here\)$"):
        methods.method_kinds()
    with pytest.raises(ValueError, match="amod_broken_method"):  # (tried again, not forgotten)
        parse_method("tome")
    # a command stops in one line (its --method help line, built first, lists the methods that did load)
    res = cli_in_process(["train", "--method", "tome:cost=0.5", "--epochs", "1", "--out", str(tmp_path / "run")],
                         capsys)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "amod train: error: the amod.methods entry point toy = amod_broken_method of amod-broken-method 0.1 failed to "
        "load (ImportError: this toy plugin needs a package that is not here)"]
    assert not (tmp_path / "run").exists()
    assert "toy-skip" not in METHOD_CLASSES


def amod_command() -> list[str]:
    """The shipped ``amod`` console script beside this Python (``python -m amod`` where none was installed)."""
    script = Path(sys.executable).with_name("amod")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "amod"]


def start_amod(argv: list[str], *path: Path) -> subprocess.Popen:
    """``amod argv`` in a process of its own, with ``path`` and the amod under test (nothing else) on its
    PYTHONPATH. One thread each: these runs go two or three at a time, and a tiny probe's fit on oversubscribed
    threads takes minutes instead of seconds."""
    src = Path(amod.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, src])), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*amod_command(), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_the_shipped_amod_command_runs_a_method_that_an_installed_package_registers(backbone_path, tmp_path):
    """The toy method packaged with an ``amod.methods`` entry point (no amod file edited, nothing registered by hand):
    the ``amod`` console script finetunes a model with it, compares and sweeps it, evaluates and exports its file;
    without the package, ``amod eval`` of that file exits 2 in one line naming the method."""
    plugin = toy_package(tmp_path / "site")
    torch.manual_seed(0)
    dense = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, in_chans=1, img_size=28,
                              patch_size=7, depth=3, embed_dim=32, num_heads=2)
    start = amod.save(dense, tmp_path / "dense.safetensors")
    run, sweeps = tmp_path / "run", tmp_path / "sweeps"
    probe = ["--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.5", "--probe-train", "20",
             "--val-limit", "8", "--methods", "ToMe", "toy-skip", "--speed-batch", "2", "--speed-repeats", "1"]
    first = [start_amod(["finetune", "--checkpoint", str(start), "--method", "toy-skip:blocks=1", "--train-limit", "64",
                         "--val-limit", "32", "--batch-size", "32", "--epochs", "1", "--out", str(run)], plugin),
             *(start_amod([command, *probe, "--out", str(sweeps / command)], plugin)
               for command in ("compare", "frontier"))]
    finetune, compare, frontier = map(finished, first)
    assert finetune.returncode == 0, finetune.stderr[-2000:]
    assert json.loads(finetune.stdout)["variant"] == "toy-skip"
    saved = run / "model.safetensors"
    second = [start_amod(["eval", "--checkpoint", str(saved), "--val-limit", "32", "--json"], plugin),
              start_amod(["export", "--checkpoint", str(saved), "--out", str(tmp_path / "toy.onnx"), "--exporter",
                          "torchscript", "--json"], plugin),
              start_amod(["eval", "--checkpoint", str(saved), "--val-limit", "32", "--json"])]  # not installed
    evaluated, exported, refused = map(finished, second)

    for res, command in ((compare, "compare"), (frontier, "frontier")):
        assert res.returncode == 0, res.stderr[-2000:]
        rows = json.loads((sweeps / command / f"{command}.json").read_text())["rows"]
        assert [(r["method"], r["setting"]) for r in rows] == \
            [("ToMe", rows[0]["setting"]), ("toy-skip", "toy-skip:blocks=2")]  # 2 of the 4 blocks
    assert "| 0.5 | toy-skip | toy-skip:blocks=2 |" in (sweeps / "compare" / "compare.md").read_text()
    assert "| toy-skip | 0.5 | toy-skip:blocks=2 |" in (sweeps / "frontier" / "frontier.md").read_text()

    register_method(SkipLast)  # this process reads the file with the toy as the package's
    try:
        model = amod.load(saved)
        assert amod.method_of(model) == SkipLast(1) and isinstance(model.blocks[2], SkippedBlock)
        assert evaluated.returncode == 0, evaluated.stderr[-2000:]
        assert json.loads(evaluated.stdout)["macs"] == amod.flops(model).macs < amod.flops(dense).macs
    finally:
        del METHOD_CLASSES[SkipLast.kind]
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert json.loads(exported.stdout)["method"] == "toy-skip"
    assert refused.returncode == 2 and refused.stdout == ""
    # PPT (amod.ppt) registers through amod's own entry point: listed where amod was installed from a pyproject.toml
    # that names it
    ppt = ", ppt" if any(e.value == "amod.ppt" for e in entry_points(group=methods.ENTRY_POINT_GROUP)) else ""
    assert refused.stderr.strip().splitlines() == [
        f"amod eval: error: {saved} was saved by method 'toy-skip', which is not registered in this amod: install (or "
        "import) the package that registers it (entry-point group amod.methods); registered methods: dense, mod, "
        f"tome, pitome, isoflop, calibrated{ppt}"]
