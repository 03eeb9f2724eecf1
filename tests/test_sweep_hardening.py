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

