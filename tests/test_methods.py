"""amod.methods: each method says which checkpoint metadata entry names it and how its spec reads; a run holds its
method as its spec alone, and the shorthand options (--router, --tome-cost, ...) build one; the run configuration
and the checkpoint module ask the classes."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from conftest import images, make_model

import amod
from amod.methods import (METHOD_CLASSES, Dense, file_metadata, metadata_keys, method_classes, method_from_metadata,
                          method_of, parse_method)
from amod.mod.calibrate import Calibrated
from amod.mod.convert import MoD
from amod.mod.isoflop import IsoFLOP
from amod.shorthand import SHORTHAND_NAMES, method_from_shorthand, setting_text_of
from amod.tome.merging import TokenMerging
from amod.tome.pitome import PiToMe
from amod.ppt import PPT
from amod.train.config import RunConfig, resolve_run_config


@pytest.mark.parametrize("options, method", [
    ({"router": "attention"}, MoD()),
    ({"router": "standard", "capacity": 0.25, "layers": [1, 3], "scale_output": False, "skipped": "kv"},
     MoD(router="standard", capacity=0.25, layers=(1, 3), scale_output=False, skipped="kv")),
    ({"router": "random", "router_seed": 4, "skipped": "fold", "layers": "all", "protect": 0.1, "shape": [1.2, 0.8]},
     MoD(router="random", seed=4, skipped="fold", layers="all", protect=0.1, shape=(1.2, 0.8))),
    ({"router": "attention", "isoflop": True, "capacity": 0.25}, IsoFLOP(capacity=0.25)),
    ({"tome_cost": 0.6}, TokenMerging(cost=0.6)), ({"tome_r": [2, 2]}, TokenMerging(r=(2, 2))),
    ({"pitome_cost": 0.6}, PiToMe(cost=0.6)), ({"pitome_keep": 0.8}, PiToMe(keep=0.8)),
], ids=lambda x: x.label() if hasattr(x, "label") else None)
def test_the_shorthand_options_build_the_method_the_same_way_from_flags_yaml_and_the_library(options, method,
                                                                                              tmp_path):
    """The shorthand table is the one place --router, --capacity, ... are read: as library options, as a YAML
    file's keys, and as the flags of amod train, each gives the same method, held by the run as its spec alone."""
    from amod.cli import build_parser, run_config_from_args

    assert method_from_shorthand(options) == method
    assert resolve_run_config(options).method() == method
    (tmp_path / "run.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in options.items()))
    assert resolve_run_config({}, str(tmp_path / "run.yaml")).method_spec == method.spec()
    flags = [x for k, v in options.items() for x in ([f"--{k.replace('_', '-')}"] if v is True else
             [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, list) else str(v).lower()
              if isinstance(v, bool) else str(v)])]
    cfg = run_config_from_args(build_parser(only="train").parse_args(["train", *flags]))
    assert (cfg.method(), cfg.method_spec) == (method, method.spec())
    assert not set(SHORTHAND_NAMES) & set(cfg.to_dict())  # the run holds the method as its spec alone


def test_settings_that_select_two_methods_are_refused():
    for options, message in [({"router": "attention", "tome_cost": 0.6}, "--router and --tome-cost select two methods"),
                             ({"router": "attention", "pitome_cost": 0.6}, "--router and --pitome-cost select two"),
                             ({"tome_r": 2, "pitome_keep": 0.8}, "--tome-r and --pitome-keep select two methods"),
                             ({"pitome_cost": 0.6, "pitome_keep": 0.8}, "pitome: give keep .* or cost .*, not both"),
                             ({"tome_cost": 0.6, "skipped": "fold"}, "--skipped does not apply to tome"),
                             ({"isoflop": True}, "--isoflop needs the MoD setup to match")]:
        with pytest.raises(ValueError, match=message) as refused:
            resolve_run_config(options)
        assert len(str(refused.value).splitlines()) == 1


def test_each_method_names_its_checkpoint_metadata():
    # "amod.merge": ToMe's key in older files (read, never written), also the name of a skipped mode
    assert metadata_keys() == ("amod.calibrated", "amod.isoflop", "amod.mod", "amod.pitome", "amod.ppt", "amod.tome",
                               "amod.merge")
    assert [cls.metadata_key for cls in method_classes() if cls.metadata_key] == [k for k in metadata_keys()
                                                                                   if k != "amod.merge"]
    # lookup order: amod's own by kind (whichever module was imported first), Dense last
    assert method_classes() == (Calibrated, IsoFLOP, MoD, PiToMe, PPT, TokenMerging, Dense)
    assert set(MoD(layers=(1, 3)).metadata()) == {"amod.mod"}
    assert TokenMerging(r=(1, 2)).metadata() == {"amod.tome": '{"schedule": [1, 2]}'}
    assert method_from_metadata(file_metadata(TokenMerging(r=(1, 2)))) == TokenMerging(r=(1, 2))
    # an older file's key (read, never written): a file that names its method reads as it
    assert method_from_metadata({"amod.method": "tome", "amod.merge": '{"schedule": [1, 2]}'}) == TokenMerging(r=(1, 2))
    assert TokenMerging.from_metadata({"amod.merge": '{"schedule": [1, 2]}'}) == TokenMerging(r=(1, 2))
    assert PiToMe(keep=0.9).metadata() == {"amod.pitome": '{"keep": 0.9}'}
    assert method_from_metadata(file_metadata(PiToMe(keep=0.9))) == PiToMe(keep=0.9)
    resolved = MoD(layers=(1, 3), scale_output=False)  # as a converted model holds it
    assert method_from_metadata(file_metadata(resolved)) == resolved
    assert method_from_metadata({}) == Dense() and Dense().metadata() == {} and file_metadata(Dense()) == {
        "amod.method": "dense"}


# One example of every registered method (a new method: one line here; Calibrated runs once set to a cost), each
# set by its own setting, by a cost, and with each option; ROUND_TRIPPED adds every registered class's defaults.
EXAMPLES = [Dense(), MoD(), MoD(router="standard", capacity=0.25, layers=(1, 3), scale_output=False, skipped="kv"),
            MoD(router="standard"), MoD(router="random", seed=5, layers="later"),
            MoD(skipped="fold", layers="all", protect=0.1, shape=(1.5, 1.0, 0.5, 0.25)), IsoFLOP(capacity=0.25),
            IsoFLOP(router="standard", layers=(1, 2, 3)), TokenMerging(cost=0.7), TokenMerging(r=(2, 2, 1, 1)),
            TokenMerging(r=3), PiToMe(cost=0.6), PiToMe(keep=0.8), Calibrated(router="random", protects=(0.0,),
                                                                              tilts=(0.0,)),
            Calibrated(protects=(0.0,), tilts=(0.0,), stages=2),
            PPT(cost=0.7), PPT(r=(3, 2), blocks=(1, 2), threshold=1e-5)]
ROUND_TRIPPED = EXAMPLES + [cls() for cls in method_classes() if cls() not in EXAMPLES]


def test_every_registered_method_has_an_example():
    assert {m.kind for m in EXAMPLES} == set(METHOD_CLASSES)


@pytest.mark.parametrize("method", ROUND_TRIPPED, ids=lambda m: m.spec())
def test_every_method_reads_back_as_itself_from_its_metadata_a_run_and_its_spec(method):
    meta = method.metadata()  # set by a cost or not yet resolved: its fields as given, never an error
    assert set(meta) == ({method.metadata_key} if method.metadata_key else set())
    assert type(method).from_metadata(meta) in (method, None if isinstance(method, Dense) else method)
    in_file = file_metadata(method)  # what a file holds: the kind, the settings, the behaviour and amod's version
    assert set(in_file) == {"amod.method", *meta} | (set() if isinstance(method, Dense) else {
        "amod.method.behaviour", "amod.method.provider"})
    assert method_from_metadata(in_file) == method  # (never Dense for another method)
    assert method_from_metadata(json.loads(json.dumps(in_file))) == method
    assert RunConfig(method_spec=method.spec()).method() == method  # no field dropped on the way into a run
    assert setting_text_of(method.spec()) == method.setting_text()  # a report row's setting
    assert parse_method(method.spec()) == method


def _model_of(method, dense):
    """The model ``method`` makes of ``dense``: a method that chooses its setting on images is set to a cost first."""
    if method.needs_images:
        method = method.at_cost(dense, 0.7, images(dense, 4))
    return method.apply(dense)


@pytest.fixture(scope="module")
def dense():
    return make_model("vit")  # (4 blocks, 16 patch tokens)


@pytest.mark.parametrize("method", EXAMPLES, ids=lambda m: m.spec())
def test_a_model_of_every_method_saves_loads_and_its_run_builds_it_again(method, dense, tmp_path):
    model = _model_of(method, copy.deepcopy(dense))
    running = method_of(model)
    assert running.kind == ("mod" if isinstance(method, Calibrated) else method.kind)
    if not isinstance(method, (TokenMerging, PiToMe, Calibrated)):  # (those resolve a cost to their setting)
        assert method_from_metadata(file_metadata(running)) == running
    loaded = amod.load(amod.save(model, tmp_path / "m.safetensors"))
    assert method_of(loaded) == running and amod.flops(loaded).macs == amod.flops(model).macs
    x = images(model, 2)
    with torch.no_grad():  # (each model's first forward: a router that draws seeds each call by its number)
        out = model(x)
        assert torch.equal(loaded(x), out)
        if not method.needs_images:  # a run of its spec builds the same model (no spec field dropped)
            again = RunConfig(method_spec=method.spec(), seed=3).validate().method().apply(copy.deepcopy(dense))
            again.load_state_dict(model.state_dict())  # (a learned router starts random)
            assert torch.equal(again(x), out)


def test_files_written_before_read_as_they_did(tmp_path):
    """Files of 644c1f3: an MoD model's metadata is its MoDConfig's JSON, a ToMe model's {"schedule": [...]}, a
    PiToMe model's {"keep": k} (still written so), and an isoFLOP model's none (a dense model of fewer blocks)."""
    mod = amod.convert(make_model("vit"), router="standard", capacity=0.25, layers=[1, 3], seed=2)
    merged = TokenMerging(r=(2, 2, 1, 1)).apply(make_model("vit"))
    pitome = PiToMe(keep=0.8).apply(make_model("vit"))
    assert method_of(mod).metadata() == {"amod.mod": mod.amod_config.to_json()}
    assert method_of(merged).metadata() == {"amod.tome": '{"schedule": [2, 2, 1, 1]}'}
    assert method_of(pitome).metadata() == {"amod.pitome": '{"keep": 0.8}'}
    iso = IsoFLOP(capacity=0.25).apply(make_model("vit"))
    del iso.amod_isoflop  # what 644c1f3 saved: no method
    old = amod.load(amod.save(iso, tmp_path / "iso.safetensors"))
    assert method_of(old) == Dense() and len(old.blocks) == len(iso.blocks) == 3
    for old_mod in ({**json.loads(mod.amod_config.to_json()), "protect": 0.1},  # a protect that bypass ignored
                    {k: v for k, v in json.loads(mod.amod_config.to_json()).items() if k not in ("protect", "shape")}):
        assert MoD.from_metadata({"amod.mod": json.dumps(old_mod)}) == method_of(mod)  # (its settings read as they did)
        # but a file of it is refused: its MoD ran before or after the near-tie grid, which cannot be told
        with pytest.raises(ValueError, match=r"^the file holds a mod model from before files recorded a method's "
                                             r"behaviour \(no amod\.method entry\), when mod ran more than one rule "
                                             r"\(version 2: every choice made on scores rounded to a grid"):
            method_from_metadata({"amod.mod": json.dumps(old_mod)})


def test_a_run_from_an_isoflop_file_keeps_and_records_its_method(dense, tmp_path):
    from amod.train.models import build_model
    from amod.train.run import _from_checkpoint_file

    path = amod.save(IsoFLOP(capacity=0.25).apply(copy.deepcopy(dense)), tmp_path / "iso.safetensors")
    cfg = _from_checkpoint_file(RunConfig(checkpoint=str(path)).validate())  # no method given: the file's
    assert (cfg.method(), cfg.depth) == (IsoFLOP(capacity=0.25), 3)
    model = build_model(cfg, 10, 3, 32)
    assert method_of(model) == IsoFLOP(capacity=0.25) and len(model.blocks) == 3  # (not cut again)


@pytest.mark.parametrize("spec, fields, message", [
    ("tome:r=8,cost=0.5", dict(r=8, cost=0.5),
     r"tome: give r \(tokens merged per block\) or cost \(a share of the dense MACs\), not both; got r=8, cost=0.5"),
    ("tome:r=[1,1],cost=0.9", dict(r=(1, 1), cost=0.9), r"tome: give r .* or cost .*, not both; got r=\[1,1\], cost=0.9"),
    ("pitome:keep=0.7,cost=0.5", dict(keep=0.7, cost=0.5), "pitome: give keep .* or cost .*, not both; got keep=0.7, "
                                                           "cost=0.5"),
    ("mod:protect=0.1", dict(protect=0.1),
     "mod: protect=0.1 sets what skipped=fold protects and folds; skipped=bypass has neither"),
    ("mod:skipped=kv,shape=[1,1],protect=0", dict(skipped="kv", shape=(1.0, 1.0), protect=0.0),
     r"mod: protect=0.0 and shape=\[1.0,1.0\] set what skipped=fold protects and folds; skipped=kv has neither"),
])
def test_conflicting_fields_are_refused_in_one_line_when_the_method_is_made(spec, fields, message):
    kind = spec.partition(":")[0]
    for make in (lambda: parse_method(spec), lambda: METHOD_CLASSES[kind](**fields),
                 lambda: RunConfig(method_spec=spec).validate()):  # the spec, the library, a run before any work
        with pytest.raises(ValueError, match=message) as refused:
            make()
        assert len(str(refused.value).splitlines()) == 1


def test_a_spec_s_seed_seeds_the_router_and_the_run_s_seed_the_training(tmp_path):
    cfg = RunConfig(method_spec="mod:router=random,seed=5", seed=3).validate()
    assert (cfg.method().seed, cfg.seed) == (5, 3)
    # without one (or with seed 0, the default), the router takes the run's --seed, as --router alone does
    assert RunConfig(method_spec="mod:router=random", seed=3).validate().method().seed == 3
    assert resolve_run_config({"router": "random", "seed": 3}).method().seed == 3
    assert resolve_run_config({"router": "random", "router_seed": 7, "seed": 3}).method().seed == 7
    with pytest.raises(ValueError, match="--router-seed only applies to a run without --method"):
        resolve_run_config({"method_spec": "mod:seed=5", "router_seed": 5})
    # a saved router keeps its seed when a run of another --seed gives its method again
    from amod.train.models import build_model

    path = amod.save(amod.convert(make_model("vit"), router="random", capacity=0.5, seed=2), tmp_path / "m.safetensors")
    again = resolve_run_config({"checkpoint": str(path), "router": "random", "capacity": 0.5, "layers": [1, 3],
                                "scale_output": False, "seed": 1})
    assert method_of(build_model(again, 10, 3, 32)).seed == 2
    with pytest.raises(ValueError, match="already runs random@0.5"):  # another router seed is another method
        build_model(dataclasses.replace(again, method_spec=again.method_spec + ",seed=4"), 10, 3, 32)


@pytest.mark.parametrize("method", EXAMPLES, ids=lambda m: m.spec())
def test_the_spec_of_a_method_selects_it_again(method):
    assert parse_method(method.spec()) == method
    assert setting_text_of(method.spec()) == method.setting_text()


@pytest.mark.parametrize("spec, method", [
    ("tome:cost=0.5", TokenMerging(cost=0.5)), ("pitome:keep=0.7", PiToMe(keep=0.7)),
    ("mod:router=attention,capacity=0.5,skipped=fold", MoD(capacity=0.5, skipped="fold")),
    ("mod: layers = [1, 3], scale_output=false", MoD(layers=(1, 3), scale_output=False)),
    ("mod:layers=alternate,shape=none", MoD(layers="alternate")), ("tome:r=[2,1]", TokenMerging(r=(2, 1))),
    ("isoflop", IsoFLOP()), ("calibrated:protects=[0]", Calibrated(protects=(0.0,)))])
def test_a_spec_is_read_by_the_types_of_the_method_fields(spec, method):
    assert parse_method(spec) == method


@pytest.mark.parametrize("spec, message", [
    ("evit:r=2", r"unknown method 'evit' in 'evit:r=2'; registered methods: dense, calibrated, isoflop, mod, pitome, ppt, tome"),
    ("mod:rooter=attention", "mod has no field 'rooter'; its fields: router, capacity, layers"),
    ("mod:capacity=half", "mod: capacity must be a number, got 'half'"),
    ("tome:r=[2,x]", r"tome: r must be an integer or a list \[an integer, ...\] or none, got '\[2,x\]'"),
    ("mod:scale_output=maybe", "mod: scale_output must be true or false or none, got 'maybe'"),
    ("pitome:keep", "pitome: expected FIELD=VALUE, got 'keep'"),
    ("tome:cost=0.5,cost=0.6", "tome: cost is given twice")])
def test_a_bad_spec_is_refused_naming_the_kind_or_field_and_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_a_run_holds_its_method_as_one_spelling_of_its_spec():
    cfg = RunConfig(method_spec="tome:cost=0.5").validate()
    assert cfg.method() == TokenMerging(cost=0.5)
    cfg = RunConfig(method_spec="mod: skipped=fold, capacity=0.25").validate()
    assert (cfg.method_spec, cfg.method()) == ("mod:capacity=0.25,skipped=fold", MoD(capacity=0.25, skipped="fold"))
    assert RunConfig(method_spec="dense").validate().method_spec is None
    with pytest.raises(ValueError, match="--router only applies to a run without --method"):
        resolve_run_config({"method_spec": "tome:cost=0.5", "router": "attention"})
    with pytest.raises(ValueError, match="chooses its setting on unlabeled images"):
        RunConfig(method_spec="calibrated").validate()


def _old_setting_text(s):
    """``amod.experiments.compare._setting_text`` as it was: the reports' setting column of saved rows."""
    if "tome_r" in s:
        return f"r = {s['tome_r']}"
    if "pitome_keep" in s:
        return f"keep {s['pitome_keep']:g} a block"
    layers = s["layers"]
    if isinstance(layers, list) and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        layers = f"{layers[0]}–{layers[-1]}"
    text = f"C = {s['capacity']:.3f}, blocks {layers}"
    if s["skipped"] != "bypass":
        text += f", skipped={s['skipped']}"
    if s["skipped"] == "fold":
        text += f", protect {s['protect']:g}" + ("" if s["router"] == "attention" else f" ({s['router']})")
    if s.get("shape"):
        text += f", shape {s['shape'][0]:.2f}…{s['shape'][-1]:.2f}"
    return text


@pytest.mark.parametrize("setting", [
    {"tome_r": [3, 3, 2, 2]}, {"tome_r": 2}, {"pitome_keep": 0.8125},
    {"router": "attention", "capacity": 0.53125, "layers": [1, 3], "skipped": "bypass", "scale_output": False},
    {"router": "standard", "capacity": 0.5, "layers": [1, 2, 3, 4, 5], "skipped": "merge"},
    {"router": "attention", "capacity": 0.2, "layers": [0, 1, 2, 3], "skipped": "fold", "protect": 0.0,
     "shape": [1.5, 1.0, 0.5, 0.25]},
    {"router": "random", "capacity": 0.7, "layers": [0, 1], "skipped": "fold", "protect": 0.25},
    {"router": "attention", "capacity": 0.5, "layers": [1, 3, 5], "skipped": "kv"}])
def test_a_saved_report_row_renders_its_setting_as_before(setting):
    assert setting_text_of(setting) == _old_setting_text(setting)


def test_method_and_the_options_of_a_method_are_refused_together_and_old_configs_load():
    with pytest.raises(ValueError, match="--router, --capacity only apply to a run without --method"):
        resolve_run_config({"method_spec": "mod:capacity=0.25", "router": "attention", "capacity": 0.5})
    assert resolve_run_config({"method_spec": "tome:r=[1,1,1,1]"}).method() == TokenMerging(r=(1, 1, 1, 1))


def test_every_mod_default_is_mod_configs():
    """MoD's defaults are stated once, in MoDConfig: amod.convert, MoD, IsoFLOP, a run's configuration and the CLI's
    MoD flags take them, so a default changed there changes everywhere (and one restated elsewhere disagrees here)."""
    import inspect

    from amod.cli import build_parser, run_config_from_args
    from amod.mod.config import MoDConfig
    from amod.mod.isoflop import isoflop_baseline
    from amod.mod.modes import skipped_mode

    plain = {f.name: f.default for f in dataclasses.fields(MoDConfig) if f.default is not dataclasses.MISSING
             and f.default is not None}
    assert set(plain) == {"router", "capacity", "scale_output", "seed", "skipped", "protect"}
    for name, default in plain.items():
        if name == "scale_output":  # None everywhere else: the router's default_scale_output, resolved by convert
            continue
        assert inspect.signature(amod.convert).parameters[name].default == default, name
        assert {f.name: f.default for f in dataclasses.fields(MoD)}[name] == default, name
    default_layers = skipped_mode(MoDConfig.skipped).default_layers
    assert IsoFLOP() == IsoFLOP(router=MoDConfig.router, capacity=MoDConfig.capacity, layers=default_layers)
    isoflop = inspect.signature(isoflop_baseline).parameters
    assert (isoflop["router"].default, isoflop["layers"].default) == (MoDConfig.router, default_layers)
    # the same model, whichever way the defaults are taken: the library, the method, a run's --router alone
    converted = [amod.convert(make_model()), MoD().apply(make_model()),
                 run_config_from_args(build_parser().parse_args(["train", "--router", MoDConfig.router]))
                 .method().apply(make_model())]
    assert converted[0].amod_config == converted[1].amod_config == converted[2].amod_config
    assert converted[0].amod_config.capacity == MoDConfig.capacity
    flops = build_parser().parse_args(["flops", "vit_tiny_patch16_224"])  # (its rows: the shorthand's method)
    assert (flops.router, flops.skipped) == (None, None) and method_from_shorthand({"router": MoDConfig.router}) == MoD()
    from amod.tools.bench import BenchConfig
    from amod.flags import build

    bench = build(BenchConfig, build_parser().parse_args(["bench"]))  # (an MoD spec: MoD's own defaults but capacity)
    assert parse_method(bench.method) == MoD(capacity=0.125)


def test_run_config_without_method_drops_every_method():
    """``RunConfig.without_method`` (a distilled run's dense teacher) drops any method, and its any-cost range."""
    for method in EXAMPLES:
        if method.needs_images:  # (not a run's method until set to a cost)
            continue
        cfg = RunConfig(method_spec=method.spec(), any_cost=[0.3, 0.9])
        assert cfg.without_method().method() == Dense() and cfg.without_method().any_cost is None


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_a_run_parses_its_method_once(command, checkpoints, tmp_path, capsys, monkeypatch):
    """``amod train`` and ``amod finetune`` parse ``--method`` once: the run's settings hold the parsed method
    (``RunConfig.declared_method``) through every copy, its checks, the model it builds and the files it writes."""
    from conftest import SHORT, TINY, cli_in_process, counted_parses

    import amod.cli
    import amod.train.run  # noqa: F401 (the command's modules, imported before their parse_method is counted)

    calls = counted_parses(monkeypatch)
    start = ["--checkpoint", str(checkpoints / "dense.safetensors")] if command == "finetune" else TINY
    res = cli_in_process([command, *start, *SHORT, "--method", "mod:router=attention,capacity=0.50",
                          "--out", str(tmp_path / "run")], capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert calls == ["mod:router=attention,capacity=0.50"]
    assert amod.method_of(amod.load(tmp_path / "run" / "model.safetensors")) == MoD(router="attention", capacity=0.5,
                                                                                      layers=(1,), scale_output=False)
