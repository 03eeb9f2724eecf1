"""amod.methods: each method says which run-configuration fields select it and which checkpoint
metadata entry names it; the run configuration and the checkpoint module ask the classes."""
from __future__ import annotations

import pytest

from amod.methods import (METHOD_CLASSES, Calibrated, Dense, IsoFLOP, MoD, PiToMe, TokenMerging, metadata_keys,
                          method_classes, method_from_metadata, method_from_run_fields, parse_method, setting_text_of)
from amod.train.config import RunConfig, resolve_run_config


@pytest.mark.parametrize("method", [
    Dense(), MoD(), MoD(router="standard", capacity=0.25, layers=(1, 3), scale_output=False, skipped="kv"),
    MoD(skipped="fold", layers="all", protect=0.1), IsoFLOP(capacity=0.25), TokenMerging(cost=0.6),
    TokenMerging(r=(2, 2)), PiToMe(cost=0.6), PiToMe(keep=0.8),
], ids=lambda m: m.label())
def test_the_run_fields_of_a_method_select_it_again(method):
    assert RunConfig(**method.run_fields()).method() == method
    assert method_from_run_fields(RunConfig(**method.run_fields())) == method


def test_settings_that_select_two_methods_are_refused():
    both = RunConfig(router="attention", tome_cost=0.6)
    with pytest.raises(ValueError, match="token merging .* replaces MoD"):
        both.validate()  # what a run says first
    with pytest.raises(ValueError, match=r"the settings select 2 methods \(attention@0.5, tome@0.6\)"):
        both.method()
    for fields, message in [(dict(router="attention", pitome_cost=0.6), r"PiToMe \(--pitome-cost\) replaces MoD"),
                            (dict(tome_r=2, pitome_keep=0.8), "give one of token merging .* and PiToMe .*, not both"),
                            (dict(pitome_cost=0.6, pitome_keep=0.8), "give either --pitome-cost or pitome_keep")]:
        with pytest.raises(ValueError, match=message):
            RunConfig(**fields).validate()


def test_each_method_names_its_checkpoint_metadata():
    assert metadata_keys() == ("amod.mod", "amod.merge", "amod.pitome")  # "amod.merge": the key predates amod.tome
    assert [cls.metadata_key for cls in method_classes() if cls.metadata_key] == list(metadata_keys())
    assert method_classes() == (MoD, TokenMerging, PiToMe, IsoFLOP, Calibrated, Dense)  # the lookup order; Dense last
    assert set(MoD(layers=(1, 3)).metadata()) == {"amod.mod"}
    assert TokenMerging(r=(1, 2)).metadata() == {"amod.merge": '{"schedule": [1, 2]}'}
    assert method_from_metadata(TokenMerging(r=(1, 2)).metadata()) == TokenMerging(r=(1, 2))
    assert PiToMe(keep=0.9).metadata() == {"amod.pitome": '{"keep": 0.9}'}
    assert method_from_metadata(PiToMe(keep=0.9).metadata()) == PiToMe(keep=0.9)
    resolved = MoD(layers=(1, 3), scale_output=False)  # as a converted model holds it
    assert method_from_metadata(resolved.metadata()) == resolved
    assert method_from_metadata({}) == Dense() and Dense().metadata() == {}


# One example of every registered method (a new method: one line here; Calibrated runs once set to a cost).
EXAMPLES = [Dense(), MoD(), MoD(router="standard", capacity=0.25, layers=(1, 3), scale_output=False, skipped="kv"),
            MoD(skipped="fold", layers="all", protect=0.1, shape=(1.5, 1.0, 0.5)), IsoFLOP(capacity=0.25),
            TokenMerging(cost=0.6), TokenMerging(r=(2, 2)), TokenMerging(r=3), PiToMe(cost=0.6), PiToMe(keep=0.8),
            Calibrated(router="random", protects=(0.0,))]


def test_every_registered_method_has_an_example():
    assert {m.kind for m in EXAMPLES} == set(METHOD_CLASSES)


@pytest.mark.parametrize("method", EXAMPLES, ids=lambda m: m.spec())
def test_the_spec_of_a_method_selects_it_again(method):
    assert parse_method(method.spec()) == method
    assert method_from_run_fields({"method_spec": method.spec()}) == method


@pytest.mark.parametrize("spec, method", [
    ("tome:cost=0.5", TokenMerging(cost=0.5)), ("pitome:keep=0.7", PiToMe(keep=0.7)),
    ("mod:router=attention,capacity=0.5,skipped=fold", MoD(capacity=0.5, skipped="fold")),
    ("mod: layers = [1, 3], scale_output=false", MoD(layers=(1, 3), scale_output=False)),
    ("mod:layers=alternate,shape=none", MoD(layers="alternate")), ("tome:r=[2,1]", TokenMerging(r=(2, 1))),
    ("isoflop", IsoFLOP()), ("calibrated:protects=[0]", Calibrated(protects=(0.0,)))])
def test_a_spec_is_read_by_the_types_of_the_method_fields(spec, method):
    assert parse_method(spec) == method


@pytest.mark.parametrize("spec, message", [
    ("evit:r=2", r"unknown method 'evit' in 'evit:r=2'; registered methods: dense, mod, tome, pitome, isoflop"),
    ("mod:rooter=attention", "mod has no field 'rooter'; its fields: router, capacity, layers"),
    ("mod:capacity=half", "mod: capacity must be a number, got 'half'"),
    ("tome:r=[2,x]", r"tome: r must be an integer or a list \[an integer, ...\] or none, got '\[2,x\]'"),
    ("mod:scale_output=maybe", "mod: scale_output must be true or false or none, got 'maybe'"),
    ("pitome:keep", "pitome: expected FIELD=VALUE, got 'keep'"),
    ("tome:cost=0.5,cost=0.6", "tome: cost is given twice")])
def test_a_bad_spec_is_refused_naming_the_kind_or_field_and_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_a_run_selects_a_method_by_its_spec_and_a_built_in_one_writes_its_own_fields():
    cfg = RunConfig(method_spec="tome:cost=0.5").validate()
    assert (cfg.tome_cost, cfg.method()) == (0.5, TokenMerging(cost=0.5))
    cfg = RunConfig(method_spec="mod:capacity=0.25,skipped=fold").validate()
    assert (cfg.router, cfg.capacity, cfg.skipped, cfg.layers) == ("attention", 0.25, "fold", "all")
    assert cfg.method() == MoD(capacity=0.25, skipped="fold", layers="all")
    assert RunConfig(method_spec="pitome:cost=0.5").validate().method() == PiToMe(cost=0.5)
    with pytest.raises(ValueError, match="select two methods"):
        RunConfig(method_spec="tome:cost=0.5", router="attention").validate()
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
    assert resolve_run_config({"method_spec": "tome:r=[1,1,1,1]"}).validate().tome_r == [1, 1, 1, 1]
    before = {k: v for k, v in RunConfig(tome_cost=0.5).to_dict().items() if k != "method_spec"}  # a run of before
    assert RunConfig.from_dict(before).validate().method() == TokenMerging(cost=0.5)
