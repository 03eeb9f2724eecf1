"""amod.methods: each method says which run-configuration fields select it and which checkpoint
metadata entry names it; the run configuration and the checkpoint module ask the classes."""
from __future__ import annotations

import pytest

from amod.methods import (METADATA_KEYS, METHODS, Dense, IsoFLOP, MoD, PiToMe, TokenMerging, method_from_metadata,
                          method_from_run_fields)
from amod.train.config import RunConfig


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
    assert METADATA_KEYS == ("amod.mod", "amod.merge", "amod.pitome")  # "amod.merge": the key predates amod.tome
    assert [cls.metadata_key for cls in METHODS if cls.metadata_key] == list(METADATA_KEYS)
    assert set(MoD(layers=(1, 3)).metadata()) == {"amod.mod"}
    assert TokenMerging(r=(1, 2)).metadata() == {"amod.merge": '{"schedule": [1, 2]}'}
    assert method_from_metadata(TokenMerging(r=(1, 2)).metadata()) == TokenMerging(r=(1, 2))
    assert PiToMe(keep=0.9).metadata() == {"amod.pitome": '{"keep": 0.9}'}
    assert method_from_metadata(PiToMe(keep=0.9).metadata()) == PiToMe(keep=0.9)
    resolved = MoD(layers=(1, 3), scale_output=False)  # as a converted model holds it
    assert method_from_metadata(resolved.metadata()) == resolved
    assert method_from_metadata({}) == Dense() and Dense().metadata() == {}
