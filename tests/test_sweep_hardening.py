"""The sweep commands (`amod compare`, `frontier`, `dense-frontier`, the finetune study) hardened: their checks on a
saved Hugging Face model, one run per output directory, a method given with a cost of its own, the first lines they
log; and what their flags and messages say (one name per thing, old names as deprecated aliases)."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from conftest import cli_in_process

import amod
from amod.errors import UserError


# ---------------------------------------------------------------- a saved Hugging Face ViT in the sweeps

@pytest.fixture(scope="module")
def hf_file(tmp_path_factory):
    """A 4-layer transformers ViTForImageClassification (10 classes, 1 channel, 28 px) built from a config and saved
    with amod.save: the file `amod compare --quick` failed on."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                                    image_size=28, patch_size=7, num_channels=1, num_labels=10)
    return amod.save(transformers.ViTForImageClassification(config),
                     tmp_path_factory.mktemp("hf") / "hf_vit.safetensors")


def test_consecutive_mod_layers_convert_on_a_hugging_face_model(hf_file):
    """An attention router on consecutive Hugging Face layers (merge on the last two thirds: 1, 2, 3): each block before
    an MoD block is checked before any block changes, so layer 1, an MoD layer now, may score for layer 2. At capacity 1
    every token is kept: the logits are the dense model's."""
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    dense = amod.load(hf_file).eval()
    with torch.no_grad():
        expected = dense(x).logits
        model = amod.convert(dense, router="attention", capacity=1.0, skipped="merge", layers="last-two-thirds")
        assert model.amod_config.layers == [1, 2, 3]
        torch.testing.assert_close(model(x).logits, expected, rtol=1e-4, atol=1e-5)


def _layer_classes(model):
    return [type(b).__name__ for b in model.blocks]


def test_compare_and_frontier_check_and_set_up_their_default_methods_on_a_saved_hf_model(hf_file):
    """`amod compare --quick` and `amod frontier` on an amod.save'd Hugging Face ViT, with their default methods: the
    checks before any work pass (every method comes near every default cost) and leave the model they check as it
    was, and every method is set to each cost on the loaded model (compare's grid; frontier's sweep of the methods
    that need no images: the calibrated ones run amod.calibrate, which the frontier tests cover)."""
    from amod.checkpoint import load_weightless
    from amod.experiments import compare, frontier

    cmp = compare.CompareConfig(checkpoint=str(hf_file), out="unused", quick=True).as_quick().validate()
    checked = load_weightless(hf_file)
    before = _layer_classes(checked)
    compare.check_costs_reachable(cmp, checked)
    assert _layer_classes(checked) == before == ["ViTLayer"] * 4
    compare.check_inputs(cmp)
    dense = amod.load(hf_file).eval()
    grid = list(compare._grid(cmp, dense))
    assert len(grid) == len(cmp.costs) * len(compare.COMPARED)
    assert {entry.name for _, _, _, entry, _ in grid} >= {"A-MoD merge, last 2/3", "A-MoD fold"}
    for _, _, cost, _, method in grid:
        model = method.apply(amod.load(hf_file))
        assert abs(amod.flops(model).ratio - cost) < 0.15  # (the closest setting: a 16-patch model is coarse)

    fr = frontier.FrontierConfig(checkpoint=str(hf_file), out="unused").validate()
    compare.check_inputs(fr)
    plain = [a for a in fr.methods if not a.needs_images]
    points = list(frontier.sweep_points(plain, fr.costs, dense, None, {}))
    assert {p.entry.name for p in points} == {a.name for a in plain}
    assert _layer_classes(dense) == ["ViTLayer"] * 4  # (every setting was made on a copy)


# ---------------------------------------------------------------- one command per output directory

# every command that writes an output directory, with the flags that bring it to its --out (a backbone's file: BACKBONE)
DIRECTORY_COMMANDS = {
    "compare": ["compare", "--checkpoint", "BACKBONE"],
    "frontier": ["frontier", "--checkpoint", "BACKBONE"],
    "dense-frontier": ["dense-frontier", "--checkpoint", "BACKBONE"],
    "analyze": ["analyze", "attention", "--checkpoint", "BACKBONE"],
    "study (finetune)": ["study", "--checkpoint", "BACKBONE"],
    "study (routers)": ["study", "--quick"],
    "demo --toy": ["demo", "--toy", "--quick"],
    "detect train": ["detect", "train"],
    "train": ["train", "--epochs", "1"],
}


@pytest.mark.parametrize("name", list(DIRECTORY_COMMANDS))
def test_a_second_command_into_a_held_directory_is_refused_in_one_line_writing_nothing(name, backbone_path, tmp_path,
                                                                                       capsys):
    """While one command holds --out (its lock: RunDirectory, as every such command takes it), another is refused in
    one line naming the holder, exit status 2, and writes nothing there."""
    from amod.train.rundir import RunDirectory

    if name == "detect train":
        pytest.importorskip("transformers")
    out = tmp_path / "out"
    argv = [str(backbone_path) if a == "BACKBONE" else a for a in DIRECTORY_COMMANDS[name]] + ["--out", str(out)]
    with RunDirectory(out, log_name=None):
        res = cli_in_process(argv, capsys)
        assert sorted(p.name for p in out.iterdir()) == [".amod.lock"]
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"{out} is in use by another amod run (pid " in res.stderr


@pytest.fixture(scope="module")
def classifier_file(tmp_path_factory):
    """A tiny 28-px, 1-channel Fashion-MNIST classifier saved by amod (what `amod analyze` takes)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, depth=2,
                              embed_dim=32, num_heads=2, in_chans=1, num_classes=10)
    return amod.save(model, tmp_path_factory.mktemp("classifier") / "model.safetensors")


# the sweep commands, each with what it runs once it holds --out (module, function): the test stops it there
HOLDING = {
    "compare": (["compare", "--checkpoint", "BACKBONE", "--cost", "0.75", "--methods", "ToMe"],
                "amod.experiments.compare", "_run_compare"),
    "frontier": (["frontier", "--checkpoint", "BACKBONE", "--cost", "0.75", "--methods", "ToMe"],
                 "amod.experiments.frontier", "_run"),
    "dense-frontier": (["dense-frontier", "--checkpoint", "BACKBONE", "--img-size", "42", "--cost", "0.75",
                        "--methods", "ToMe"], "amod.dense.frontier", "_run"),
    "analyze": (["analyze", "attention", "--checkpoint", "CLASSIFIER", "--images", "2"],
                "amod.experiments.analyze_command", "attention_stats"),
    "study (routers)": (["study", "--quick"], "amod.experiments.router_study", "_run_study"),
}


@pytest.mark.parametrize("name", list(HOLDING))
def test_every_sweep_holds_its_directory_while_it_works(name, backbone_path, classifier_file, tmp_path, capsys,
                                                        monkeypatch):
    """Each command takes --out's lock before its work: stopped in the middle of it, the directory is held (another
    process asking for it is refused, told who holds it), and let go when the command ends."""
    import importlib

    from amod.train.rundir import LOCK_NAME, Lock

    argv, module, function = HOLDING[name]
    out = tmp_path / "out"
    files = {"BACKBONE": str(backbone_path), "CLASSIFIER": str(classifier_file)}
    seen = []

    def working(*args, **kwargs):
        with pytest.raises(UserError, match="is in use by another amod run"):
            Lock(out, out / LOCK_NAME).__enter__()
        seen.append(name)
        raise UserError("stopped by the test")

    monkeypatch.setattr(importlib.import_module(module), function, working)
    res = cli_in_process([files.get(a, a) for a in argv] + ["--out", str(out)], capsys)
    assert seen == [name] and res.returncode == 2 and "stopped by the test" in res.stderr, res.stderr[-2000:]
    assert not (out / LOCK_NAME).exists()


# ---------------------------------------------------------------- a file's amod.model that is not an object

@pytest.mark.parametrize("entry", ["[1, 2]", "7", '"vit"', "null"])
def test_a_model_description_that_is_valid_json_but_no_object_is_refused_in_one_line_by_every_reader(
        entry, backbone_path, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from amod.checkpoint import family_of_file, load_weightless

    with safe_open(str(backbone_path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    path = tmp_path / "odd.safetensors"
    save_file(tensors, str(path), metadata={**meta, "amod.model": entry})
    said = f"{path}: its amod metadata cannot be rebuilt into a model (UserError: amod.model is a "
    for read in (amod.load, load_weightless, family_of_file):
        with pytest.raises(UserError, match="^" + said.replace("(", r"\(")):
            read(path)
    res = cli_in_process(["eval", "--checkpoint", str(path)], capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and said in res.stderr, res.stderr[-2000:]


# ---------------------------------------------------------------- a calibration's tilts, a fold model's shape

def test_tilts_and_shape_exponents_are_refused_beyond_their_bounds_where_the_method_is_made(backbone_path, tmp_path,
                                                                                             capsys):
    """A tilt's schedule is exp(±tilt / 2) over the blocks: beyond MAX_TILT it overflows (at 1e300 an OverflowError
    traceback), so the method refuses it when it is made, in one line with the range; at the bound the schedule is
    finite at any depth. A fold block's exponent beyond MAX_SHAPE_EXPONENT changes nothing: at every capacity of amod's
    0.001 grid below 1 the block already folds all it can (two below it, a 3-token block folds less)."""
    from amod.methods import parse_method
    from amod.mod.calibrate import MAX_TILT, tilt_shape
    from amod.mod.config import MAX_SHAPE_EXPONENT
    from amod.mod.fold import fold_count

    for depth in (2, 4, 12, 40, 1000):
        for tilt in (-MAX_TILT, MAX_TILT):
            assert all(math.isfinite(w) for w in tilt_shape(tilt, depth))
    with pytest.raises(OverflowError):
        tilt_shape(MAX_TILT + 20, 12)
    for spec in ("calibrated:tilts=[1e300]", f"calibrated:tilts=[0,{-MAX_TILT - 1:g}]"):
        with pytest.raises(UserError, match=r"^a tilt must be a finite number in \[-1400, 1400\]"):
            parse_method(spec)
    assert parse_method(f"calibrated:tilts=[{-MAX_TILT:g},{MAX_TILT:g}]").tilts == (-MAX_TILT, MAX_TILT)

    saturated = [fold_count(0.999 ** MAX_SHAPE_EXPONENT, t, p) == fold_count(1e-12, t, p)
                 for t in range(2, 4000) for p in (0.0, 0.25)]
    assert all(saturated) and fold_count(0.999 ** (MAX_SHAPE_EXPONENT - 2), 3, 0.0) < fold_count(1e-12, 3, 0.0)
    with pytest.raises(UserError, match=r"^shape must be finite numbers >= 0 and at most 1100"):
        parse_method("mod:skipped=fold,shape=[1e300,1,1,1]")
    with pytest.raises(UserError, match=r"^shape must be 4 finite numbers >= 0 and at most 1100"):
        amod.convert(amod.load(backbone_path), skipped="fold", shape=[1101.0, 1.0, 1.0, 1.0])
    assert parse_method(f"mod:skipped=fold,shape=[{MAX_SHAPE_EXPONENT},0,1,1]").shape[0] == MAX_SHAPE_EXPONENT

    # on the command line: one line, exit status 2, before any work
    for argv in (["frontier", "--checkpoint", str(backbone_path), "--methods", "calibrated:tilts=[1e300]", "--out",
                  str(tmp_path / "f")],
                 ["flops", "vit_tiny_patch16_224", "--method", "mod:skipped=fold,shape=[1e300,1,1,1,1,1,1,1,1,1,1,1]"]):
        res = cli_in_process(argv, capsys)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
        assert "must be a finite number in [-1400, 1400]" in res.stderr or "at most 1100" in res.stderr
    assert not (tmp_path / "f").exists()


def test_a_calibration_at_the_largest_tilt_runs(backbone_path):
    """At MAX_TILT (the bound, not past it) the calibration is set to a cost as at any other tilt: every fold in the
    last block."""
    from amod.methods import parse_method
    from amod.mod.calibrate import MAX_TILT

    dense = amod.load(backbone_path).eval()
    images = torch.randn(4, 3, 42, 42, generator=torch.Generator().manual_seed(0))
    method = parse_method(f"calibrated:tilts=[{MAX_TILT:g}],protects=[0]").at_cost(dense, 0.8, images)
    assert method.shape == (0.0, 0.0, 0.0, 4.0)


# ---------------------------------------------------------------- a method given with a cost of its own

@pytest.mark.parametrize("command, spec, given", [
    ("compare", "ppt:cost=0.3", "cost=0.3"), ("frontier", "tome:r=2", "r=2"),
    ("dense-frontier", "mod:capacity=0.25,skipped=fold", "capacity=0.25"), ("study", "pitome:keep=0.8", "keep=0.8")])
def test_a_method_with_its_own_cost_is_refused_where_every_method_is_set_to_each_cost(command, spec, given,
                                                                                       backbone_path, tmp_path, capsys):
    """`amod compare --cost 0.5 --methods ppt:cost=0.3` ran PPT at 0.5 in a row that showed ppt:cost=0.3: each command
    that sets its methods to its --cost values refuses such a method in one line (one shared check), before any work;
    so it does any field a method's at_cost sets (its setting_fields: ToMe's r, PiToMe's keep, MoD's capacity)."""
    out = tmp_path / "out"
    res = cli_in_process([command, "--checkpoint", str(backbone_path), "--cost", "0.5", "0.6", "--methods", "ToMe",
                          spec, "--out", str(out)], capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    name = given.partition("=")[0]
    assert (f"--methods {spec!r} gives the method its own setting ({given}), and amod {command} sets every method "
            f"to each --cost (0.5 0.6): drop {name}= from the spec") in res.stderr
    assert not out.exists()


def test_the_libraries_configurations_refuse_a_method_with_its_own_cost_too():
    from amod.dense.frontier import DenseFrontierConfig
    from amod.experiments.arms import Arm
    from amod.experiments.compare import CompareConfig
    from amod.experiments.finetune_study.plan import FinetuneConfig
    from amod.experiments.frontier import FrontierConfig
    from amod.tome.merging import TokenMerging
    from amod.tome.pitome import PiToMe

    own = (Arm("ToMe at 0.3", TokenMerging(cost=0.3)),)
    for config in (CompareConfig(methods=own), FrontierConfig(checkpoint="unused", methods=own),
                   DenseFrontierConfig(checkpoint="unused", methods=own),
                   FinetuneConfig(checkpoint="unused", arms=(Arm("p", PiToMe()), *own))):
        with pytest.raises(UserError, match=r"'ToMe at 0\.3' gives the method its own setting \(cost=0\.3\)"):
            config.validate()


# ---------------------------------------------------------------- messages that name what the user gave

@pytest.mark.parametrize("command", [["train"], ["finetune"], ["eval", "--checkpoint", "x.safetensors"],
                                     ["compare"], ["frontier", "--checkpoint", "x.safetensors"],
                                     ["dense-frontier", "--checkpoint", "x.safetensors"],
                                     ["bench"], ["calibrate", "--checkpoint", "x", "--out", "y.safetensors"]])
def test_a_binary_config_file_is_named_in_one_line(command, tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    res = cli_in_process([*command, "--config", str(binary)], capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert f"config file {binary} is not a text file; give a YAML file" in res.stderr


def test_dense_frontier_names_its_flag_for_an_input_too_small_for_its_canvases(backbone_path, tmp_path, capsys):
    for size, said in (("28", "--img-size must be at least 32 px (the segmentation canvases are drawn at the input "
                               "size), got 28"),
                       ("45", "--img-size 45 is not a multiple of the model's patch size 7")):
        res = cli_in_process(["dense-frontier", "--checkpoint", str(backbone_path), "--img-size", size, "--out",
                              str(tmp_path / "df")], capsys)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and said in res.stderr, res.stderr[-2000:]
        assert "CanvasSpec" not in res.stderr and not (tmp_path / "df").exists()


# ---------------------------------------------------------------- help that says what a run does; one name per thing

def _parser(command: str):
    from amod.cli import build_parser

    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices[command]


def _help(command: str, flag: str) -> str:
    action = next(a for a in _parser(command)[1]._actions if flag in a.option_strings)
    return " ".join((action.help or "").split())


def test_a_shorthand_flag_states_the_default_a_run_without_it_runs():
    """bench's --capacity said 0.5 (MoD's own default) while a run without it ran its --method, capacity 0.125; its
    --layers named a --skipped flag bench does not have. Each shorthand flag of bench and calibrate now states the
    value of the method a run without it runs."""
    from amod.cli import COMMANDS, _config
    from amod.flags import build
    from amod.methods import parse_method

    for command in ("bench", "calibrate"):
        parser, _ = _parser(command)
        entry = next(c for c in COMMANDS if c.name == command)
        args = parser.parse_args([command] + (["--checkpoint", "c", "--out", "o.safetensors"]
                                              if command == "calibrate" else []))
        ran = parse_method(build(_config(entry.flags), args).method)  # (no shorthand flag given)
        for name in entry.shorthand:
            said = _help(command, "--" + name.replace("_", "-"))
            value = getattr(ran, name)
            shown = "alternate" if name == "layers" and value is None else value  # (MoD's bypass default)
            assert f"(default {shown}: --method {ran.spec()})" in said, said
            assert "--skipped" not in said
    assert "(default 0.125: --method mod:capacity=0.125)" in _help("bench", "--capacity")


def test_calibrate_offers_the_routers_it_takes_and_no_other():
    from amod.mod.calibrate import Calibrated
    from amod.mod.routers import vit_routers

    action = next(a for a in _parser("calibrate")[1]._actions if "--router" in a.option_strings)
    taken = []
    for router in vit_routers():
        try:
            Calibrated(router=router)
            taken.append(router)
        except UserError as e:
            assert "learns its scores; a calibration trains nothing" in str(e)
    assert list(action.choices) == taken and "attention" in taken and "random" in taken
    assert "standard" not in taken and "hybrid" not in taken


# (command, former flag, flag, a value, the configuration field both set)
RENAMED = [("bench", "--batch-size", "--speed-batch", "4", "batch_size"),
           ("dense-frontier", "--batch", "--speed-batch", "4", "batch"),
           ("dense-frontier", "--test-canvases", "--val-limit", "6", "test_canvases"),
           ("study", "--eval-images", "--val-limit", "64", "eval_images"),
           ("detect", "--val-canvases", "--val-limit", "2", "val_canvases")]


@pytest.mark.parametrize("command, old, new, value, field", RENAMED, ids=[f"{r[0]} {r[1]}" for r in RENAMED])
def test_a_former_flag_name_still_works_with_a_warning_line_naming_the_new_one(command, old, new, value, field, capsys,
                                                                            tmp_path):
    """One name per thing (--speed-batch: the batch size timed; --val-limit: the test images measured); each former
    name is a hidden alias that sets the same field after one warning line, so no script breaks. A --config file may
    hold either name."""
    from amod.cli import _config
    from amod.detect.config import DetectConfig, DetectStudyConfig
    from amod.experiments.finetune_study.plan import FinetuneConfig
    from amod.flags import build, load_yaml_config

    parser, sub = _parser(command)
    lead = {"dense-frontier": ["--checkpoint", "c"], "study": ["--checkpoint", "c"], "detect": ["train"]}.get(command, [])
    config = {"bench": _config("tools.bench:BenchConfig"),
              "dense-frontier": _config("dense.frontier:DenseFrontierConfig"), "study": FinetuneConfig,
              "detect": DetectConfig}[command]
    capsys.readouterr()
    built = {}
    for spelling in (new, old):
        args = parser.parse_args([command, *lead, spelling, value])
        built[spelling] = getattr(build(config, args), field)
        err = capsys.readouterr().err
        if spelling == old:
            assert err == f"amod {command}: warning: {old} is deprecated: use {new}, the same setting\n"
        else:
            assert err == ""
    assert built[old] == built[new] == int(value)
    if command == "detect":  # (its study takes the flag too)
        args = parser.parse_args([command, "study", "--dense", "d", old, value])
        assert build(DetectStudyConfig, args).val_canvases == int(value)
    text = " ".join(sub.format_help().split())
    assert new in text and f"{old} " not in text.replace(f"{old}-", "")
    if command in ("bench", "dense-frontier"):  # a --config file by either name
        for key in (old, new):
            path = tmp_path / "options.yaml"
            path.write_text(f"{key.lstrip('-')}: {value}\n")
            cfg = build(config, parser.parse_args([command, *lead]), under=load_yaml_config(path))
            assert getattr(cfg, field) == int(value)


def test_one_flag_name_for_the_timed_batch_and_for_the_test_images_across_commands():
    """Every command that times a batch calls its size --speed-batch, and every command that measures on a test set
    calls its size --val-limit; the former names are in no command's help."""
    from amod.cli import COMMANDS

    shown = {}
    for command in COMMANDS:
        shown[command.name] = " ".join(_parser(command.name)[1].format_help().split())
    for name in ("bench", "compare", "frontier", "dense-frontier"):
        assert "--speed-batch" in shown[name], name
    for name in ("train", "finetune", "eval", "compare", "frontier", "dense-frontier", "study", "detect"):
        assert "--val-limit" in shown[name], name
    for name, text in shown.items():
        for former in ("--test-canvases", "--eval-images", "--val-canvases"):
            assert former not in text, (name, former)
    assert "--batch-size" not in shown["bench"] and "--batch " not in shown["dense-frontier"]


# ---------------------------------------------------------------- a line before every slow step

# each sweep's slow steps (module, function) and the line a user sees before each; its checks, which say nothing
# unless they refuse (in one line), show a progress bar on a terminal
SLOW_STEPS = {
    "frontier": [("amod.experiments.frontier", "open_model", "loading the dense model"),
                 ("amod.experiments.features", "features", "dense features of"),
                 ("amod.experiments.probe", "fit_probe", "fitting the linear probe"),
                 ("amod.mod.calibrate", "calibrate", "calibrating calibrated:tilts=[0] at cost"),
                 ("amod.experiments.frontier", "time_models", "timing ")],
    "compare": [("amod.experiments.compare", "open_model", "loading the dense model"),
                ("amod.experiments.features", "features", "dense features of"),
                ("amod.experiments.probe", "fit_probe", "fitting the linear probe"),
                ("amod.experiments.compare", "time_models", "timing ")],
    "dense-frontier": [("amod.dense.frontier", "open_model", "loading the dense model"),
                       ("amod.dense.frontier", "SegmentationCanvases", "drawing 12 training and 6 test canvases"),
                       ("amod.dense.frontier", "grid_features", "dense patch features of 12 training"),
                       ("amod.dense.frontier", "fit_patch_probe", "fitting the patch probe"),
                       ("amod.mod.calibrate", "calibrate", "calibrating calibrated:tilts=[0] at cost"),
                       ("amod.dense.frontier", "time_callables", "timing ")],
}
SWEEPS = {
    "frontier": ["--img-size", "28", "--probe-train", "20", "--val-limit", "8", "--speed-batch", "2",
                 "--calibration-images", "4", "--methods", "ToMe", "calibrated:tilts=[0]"],
    "compare": ["--img-size", "28", "--probe-train", "20", "--val-limit", "8", "--speed-batch", "2",
                "--methods", "ToMe"],
    "dense-frontier": ["--img-size", "42", "--train-canvases", "12", "--val-limit", "6", "--speed-batch", "3",
                       "--calibration-images", "4", "--methods", "ToMe", "calibrated:tilts=[0]"],
}
BARS = {"frontier": {"checking every method at each cost", "dense training features", "dense test features"},
        "compare": {"checking every method at each cost", "dense training features", "dense test features"},
        "dense-frontier": {"dense training features", "dense test features"}}


@pytest.mark.parametrize("command", list(SWEEPS))
def test_each_slow_set_up_step_is_announced_by_a_log_line_before_it_starts(command, backbone_path, tmp_path, capsys,
                                                                           monkeypatch):
    """`amod frontier` printed nothing for over a minute at its start (the dense model, the dense features, the
    probe, each calibration): every slow step of the sweeps' set-up now comes after a log line that says what it does,
    its batches (and the checks before any work) under a progress bar on a terminal. The log lines, the bars and the
    steps are recorded in the order they happen; the run is stopped at its timing."""
    import importlib

    events = []

    class Recorder(logging.Handler):
        def emit(self, record):
            events.append(("log", record.getMessage()))

    for module, name, _ in SLOW_STEPS[command]:
        target = importlib.import_module(module)
        original = getattr(target, name)

        def step(*args, _original=original, _name=name, **kwargs):
            events.append(("step", _name))
            if _name in ("time_models", "time_callables"):  # the last step: the test stops there (no report)
                raise UserError("stopped by the test")
            if _name in ("fit_probe", "fit_patch_probe"):
                kwargs["steps"] = 5  # (L-BFGS's full fit: seconds the test does not need)
            return _original(*args, **kwargs)

        monkeypatch.setattr(target, name, step)
    for module in ("amod.train.engine", "amod.dense.segmentation"):
        monkeypatch.setattr(f"{module}.progress_bar",
                            lambda iterable, total, desc, enabled=True: events.append(("bar", desc)) or iterable)
    recorder = Recorder()
    try:
        with monkeypatch.context() as m:
            m.setattr("amod.cli.setup_logging", lambda: None)  # (the test's handler stays: main would clear it)
            amod_log = logging.getLogger("amod")
            amod_log.addHandler(recorder)
            m.setattr(amod_log, "level", logging.INFO)
            res = cli_in_process([command, "--checkpoint", str(backbone_path), "--cost", "0.6", "--speed-repeats", "1",
                                  *SWEEPS[command], "--out", str(tmp_path / "out")], capsys)
    finally:
        logging.getLogger("amod").removeHandler(recorder)
    assert res.returncode == 2 and "stopped by the test" in res.stderr, res.stderr[-3000:]
    first_line = next(i for i, e in enumerate(events) if e[0] == "log")
    assert all(kind == "bar" for kind, _ in events[:first_line])  # (before it, only the checks' bar)
    assert BARS[command] <= {desc for kind, desc in events if kind == "bar"}
    for _, name, said in SLOW_STEPS[command]:
        first = next(i for i, e in enumerate(events) if e == ("step", name))
        before = [msg for kind, msg in events[:first] if kind == "log"]
        assert before and before[-1].startswith(said), (name, before[-1:])
