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
               r"calibrated, isoflop, mod, pitome, ppt, tome")
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

def toy_package(root: Path, name: str = "amod_toy_method", target: str = "amod_toy_method:SkipLast",
                source: str = "raise ImportError('this toy plugin needs a package that is not here')\n") -> Path:
    """``root``, holding what installing the toy method as a package leaves on the path: its module (this directory's
    ``amod_toy_method.py``, or ``name``.py with ``source`` where ``name`` is not the toy's) and a dist-info with its
    ``amod.methods`` entry point."""
    root.mkdir()
    if name == "amod_toy_method":
        shutil.copy(Path(__file__).with_name("amod_toy_method.py"), root)
    else:
        (root / f"{name}.py").write_text(source)
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
    assert refused.stderr.strip().splitlines() == [  # (PPT registers on import, as every built-in does)
        f"amod eval: error: {saved} was saved by method 'toy-skip', which is not registered in this amod: install (or "
        "import) the package that registers it (entry-point group amod.methods); registered methods: dense, "
        "calibrated, isoflop, mod, pitome, ppt, tome"]


# ---------------------------------------------------------------- what a plugin may not do: the matrix

@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Install toy packages on the path (``install(name, source, target)``): the registry looks for entry points
    again, and everything they registered and imported is let go of afterwards."""
    methods.load_method_plugins()
    before = dict(METHOD_CLASSES)
    modules = []

    def install(name: str, source: str, target: str) -> None:
        monkeypatch.setitem(methods._plugins, "loaded", False)
        monkeypatch.syspath_prepend(str(toy_package(tmp_path / name, name, target, source)))
        modules.append(name)

    yield install
    METHOD_CLASSES.clear()
    METHOD_CLASSES.update(before)
    for name in modules:
        sys.modules.pop(name, None)
    methods._plugins["loaded"] = False


def twin(kind: str, name: str = "Twin", body: str = "") -> str:
    """The source of a module that registers a copy of the toy method under ``kind`` on import."""
    return (f"from dataclasses import dataclass\nfrom typing import ClassVar\nfrom amod.methods import register_method\n"
            f"from amod_toy_method import SkipLast\n\n@register_method\n@dataclass(frozen=True)\nclass {name}(SkipLast):"
            f"\n    kind: ClassVar[str] = {kind!r}\n    metadata_key: ClassVar[str] = 'amod.{name.lower()}'\n{body}")


def one_line_of(res) -> str:
    """The one line a refused command printed (exit status 2, nothing else on stderr)."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def test_a_package_may_not_take_a_kind_that_a_built_in_or_another_package_has(plugins, tmp_path, capsys):
    """A kind names one method: a package's class that takes a built-in's kind, or the kind of another installed
    package's, is refused in one line naming both, and the built-in stays; a class registered in this process may
    not take one either (registering the same class again is nothing)."""
    plugins("amod_toy_fake", twin("tome", "FakeToMe"), "amod_toy_fake")
    refused = (r"^the amod\.methods entry point toy = amod_toy_fake of amod-toy-fake 0\.1: amod_toy_fake\.FakeToMe "
               r"\(package amod-toy-fake 0\.1\) registers the method kind 'tome', which is amod's built-in "
               r"TokenMerging's already: a kind names one method, so that a spec and a file mean one model; give "
               r"FakeToMe another kind$")
    with pytest.raises(ValueError, match=refused):
        methods.method_kinds()
    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--method", "tome:cost=0.5"], capsys)
    assert "registers the method kind 'tome', which is amod's built-in TokenMerging's" in one_line_of(res)
    assert METHOD_CLASSES["tome"] is amod.TokenMerging

    @dataclass(frozen=True)
    class NotDense(SkipLast):
        kind: ClassVar[str] = "dense"
        metadata_key: ClassVar[str] = "amod.not-dense"

    with pytest.raises(ValueError, match=r"registers the method kind 'dense', which is amod's built-in Dense's already"):
        register_method(NotDense)
    assert METHOD_CLASSES["dense"] is amod.Dense
    register_method(SkipLast)
    assert register_method(SkipLast) is SkipLast  # (the same class again)
    del METHOD_CLASSES["toy-skip"]


def test_two_packages_with_one_kind_are_refused_and_a_file_opens_only_under_the_package_that_wrote_it(plugins,
                                                                                                       tmp_path):
    plugins("amod_toy_a", twin("toy-twin"), "amod_toy_a")
    methods.load_method_plugins()
    model = parse_method("toy-twin:blocks=1").apply(make_model("vit"))
    path = amod.save(model, tmp_path / "twin.safetensors")
    meta = amod.checkpoint.read_metadata(path)
    assert (meta["amod.method"], meta["amod.method.provider"], meta["amod.method.behaviour"]) == \
        ("toy-twin", "amod-toy-a 0.1", "1")
    plugins("amod_toy_b", twin("toy-twin"), "amod_toy_b")  # another package, the same kind
    with pytest.raises(ValueError, match=r"^the amod\.methods entry point toy = amod_toy_b of amod-toy-b 0\.1: "
                                         r"amod_toy_b\.Twin \(package amod-toy-b 0\.1\) registers the method kind "
                                         r"'toy-twin', which is amod_toy_a\.Twin \(package amod-toy-a 0\.1\)'s already"):
        methods.method_kinds()
    # package B alone (A uninstalled): A's file is refused, never opened as B's model
    del METHOD_CLASSES["toy-twin"]
    sys.modules.pop("amod_toy_a")
    sys.path.remove(str(tmp_path / "amod_toy_a"))
    methods._plugins["loaded"] = False
    methods.load_method_plugins()
    assert METHOD_CLASSES["toy-twin"].__module__ == "amod_toy_b"
    with pytest.raises(ValueError, match=r"twin\.safetensors was saved by the toy-twin method of amod-toy-a 0\.1; here "
                                         r"'toy-twin' is amod_toy_b\.Twin \(package amod-toy-b 0\.1\), another method: "
                                         r"open it where amod-toy-a is installed instead$"):
        amod.load(path)


def test_a_method_must_find_itself_in_a_model_and_read_every_field_from_a_spec(tmp_path, capsys):
    """Without ``of_model``, ``amod.save`` would write a model of the method as the dense one: refused where the
    class registers, and a run refuses one whose ``of_model`` misses the model its ``apply`` made (a file of it would
    name the dense model) before it writes anything. A field's type hint must be one a spec sets; a bare tuple reads
    items of any plain type."""

    @dataclass(frozen=True)
    class NoOf(Method):
        kind: ClassVar[str] = "toy-noof"
        metadata_key: ClassVar[str] = "amod.toy-noof"

        def apply(self, model):
            return SkipLast(1).apply(model)

    with pytest.raises(ValueError, match=r"^NoOf \(kind 'toy-noof'\): a method must define of_model\(model\), how "
                                         r"amod\.method_of finds it in a model its apply made: without it amod\.save "
                                         r"would write that model as the dense one$"):
        register_method(NoOf)

    @dataclass(frozen=True)
    class Misses(SkipLast):
        kind: ClassVar[str] = "toy-miss"
        metadata_key: ClassVar[str] = "amod.toy-miss"

        @classmethod
        def of_model(cls, model):
            return None

    register_method(Misses)
    try:
        run = tmp_path / "run"
        res = cli_in_process(["train", "--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "3",
                              "--embed-dim", "32", "--num-heads", "2", "--train-limit", "32", "--val-limit", "32",
                              "--epochs", "1", "--method", "toy-miss", "--out", str(run)], capsys)
        assert one_line_of(res) == (
            "amod train: error: toy-miss: amod.method_of finds dense in the model its apply made, so a file of it would "
            "be saved as dense: its class Misses's of_model must find it")
        assert not run.exists()
    finally:
        del METHOD_CLASSES["toy-miss"]

    @dataclass(frozen=True)
    class Mapping(SkipLast):
        kind: ClassVar[str] = "toy-map"
        metadata_key: ClassVar[str] = "amod.toy-map"
        weights: dict = None

    with pytest.raises(ValueError, match=r"field weights's type <class 'dict'> is not one a spec can set"):
        register_method(Mapping)

    @dataclass(frozen=True)
    class Bare(SkipLast):
        kind: ClassVar[str] = "toy-bare"
        metadata_key: ClassVar[str] = "amod.toy-bare"
        weights: tuple = (1, 2)

    register_method(Bare)
    try:
        assert parse_method("toy-bare:weights=[1,2.5,true,a]").weights == (1, 2.5, True, "a")
        assert parse_method(Bare(weights=(3, 0.5)).spec()) == Bare(weights=(3, 0.5))
        with pytest.raises(ValueError, match=r"toy-bare: weights must be a list \[\.\.\.\], got '3'"):
            parse_method("toy-bare:weights=3")
    finally:
        del METHOD_CLASSES["toy-bare"]
    assert "toy-noof" not in METHOD_CLASSES and "toy-map" not in METHOD_CLASSES


class DroppingBlock(Block):
    """A plugin's block that hands on only its first two patch tokens (and its prefix), pricing itself or not."""

    def forward(self, x, *args, **kwargs):
        return super().forward(x)[:, :3]


class PricedDroppingBlock(DroppingBlock):
    def amod_price(self, tokens, num_prefix, capacity=None):
        from amod.cost import BlockPrice, dense_block_macs

        return BlockPrice(dense_block_macs(self, tokens), tokens, min(tokens, 3))


class Wrapper(nn.Module):
    """A plugin's block that wraps a timm block (no ``attn`` of its own)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@dataclass(frozen=True)
class DropLast(Method):
    """A toy plugin method: its last block drops all but two patch tokens (``priced``: with ``amod_price``), or
    (``wrapped``) its blocks are wrapped."""

    kind: ClassVar[str] = "toy-drop"
    metadata_key: ClassVar[str] = "amod.toy-drop"
    priced: bool = False
    wrapped: bool = False

    def apply(self, model):
        if self.wrapped:
            model.blocks = nn.Sequential(*(Wrapper(b) for b in model.blocks))
        else:
            model.blocks[-1].__class__ = PricedDroppingBlock if self.priced else DroppingBlock
        return model

    @classmethod
    def of_model(cls, model):
        last = model.blocks[-1]
        if isinstance(last, Wrapper):
            return cls(wrapped=True)
        return cls(priced=isinstance(last, PricedDroppingBlock)) if isinstance(last, DroppingBlock) else None


def test_a_block_that_does_not_price_itself_is_refused_and_a_patch_grid_it_cannot_lay_back_too(tmp_path, capsys):
    """A plugin block without ``amod_price`` would be priced as dense (1.000 for a block that drops most tokens): the
    cost and every command that prices are refused in one line, as is a wrapped block (no ``attn``); priced, it is
    priced by its own price. ``amod.patch_features`` of a model that dropped tokens without saying where refuses
    in one line instead of a reshape error."""
    register_method(DropLast)
    try:
        dropping = DropLast().apply(make_model("vit"))
        with pytest.raises(ValueError, match=r"^block 3 is a DroppingBlock \(test_method_seam\) whose forward is not "
                                             r"timm's or transformers' and which does not price itself: a method's "
                                             r"blocks define amod_price\(tokens, num_prefix, capacity\) -> "
                                             r"amod\.cost\.BlockPrice"):
            amod.flops(dropping)
        for spec in ("toy-drop", "toy-drop:wrapped=true"):
            res = cli_in_process(["flops", "vit_tiny_patch16_224", "--method", spec], capsys)
            assert "does not price itself" in one_line_of(res), spec
        priced = DropLast(priced=True).apply(make_model("vit"))
        assert amod.flops(priced).blocks[-1].tokens == 17 and amod.flops(priced).ratio == 1.0  # (its own price)
        x = images(dropping, 2)
        with pytest.raises(ValueError, match=r"^block 3 hands on 2 patch tokens where the grid has 4 x 4 = 16, and the "
                                             r"model does not say where the others went"):
            amod.patch_features(dropping, x)
        assert amod.patch_features(dropping, x, layers=2).shape == (2, 192, 4, 4)  # (before the drop: whole)
    finally:
        del METHOD_CLASSES["toy-drop"]


def test_a_bug_in_a_package_s_method_is_named_as_that_package_s_and_an_entry_point_must_name_a_method(plugins,
                                                                                                      capsys):
    body = "\n    def apply(self, model):\n        return 1 / 0\n"
    plugins("amod_toy_raise", twin("toy-raise", "Raises", body), "amod_toy_raise")
    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--method", "toy-raise"], capsys)
    assert res.returncode == 1 and "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "amod flops: internal error (ZeroDivisionError) in the toy-raise method of package amod-toy-raise 0.1 "
        "(amod_toy_raise.py, line 13): this is a bug in that package, not in amod or in what it was given; please "
        "report it to its authors with the traceback above")
    plugins("amod_toy_number", "VALUE = 3\n", "amod_toy_number:VALUE")
    with pytest.raises(ValueError, match=r"^the amod\.methods entry point toy = amod_toy_number:VALUE of "
                                         r"amod-toy-number 0\.1: it names 3, which is neither an amod Method class nor "
                                         r"a module that registers one$"):
        methods.method_kinds()
