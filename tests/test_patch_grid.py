"""Every patch keeps its feature (``amod.patch_grid``): timm's ``forward_intermediates`` and ``amod.patch_features``
give a reduced model's outputs on the dense model's patch grid, in the original patch order; nothing reduced, they
are the dense model's exactly."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import amod
from amod import pitome, tome
from amod import ppt
from amod.errors import UserError
from amod.patch_grid import shared_sizes, tracking
from conftest import images, make_model

# every way amod reduces or routes tokens, as a function of the dense model; (name, apply at a cost that reduces,
# apply with nothing reduced)
REDUCTIONS = {
    "tome": (lambda m: tome.apply(m, r=2), lambda m: tome.apply(m, r=0)),
    "pitome": (lambda m: pitome.apply(m, keep=0.8), lambda m: pitome.apply(m, keep=1.0)),
    "ppt": (lambda m: ppt.apply(m, r=3, blocks=[1, 2]), lambda m: ppt.apply(m, r=0, blocks=[1, 2])),
    "fold": (lambda m: amod.convert(m, skipped="fold", capacity=0.8),
             lambda m: amod.convert(m, skipped="fold", capacity=1.0)),
    "calibrated": (lambda m: amod.convert(m, skipped="fold", capacity=0.7, protect=0.0, shape=[0.5, 1.0, 1.5, 1.0]),
                   lambda m: amod.convert(m, skipped="fold", capacity=1.0, protect=0.0, shape=[0.5, 1.0, 1.5, 1.0])),
}
ROUTED = {  # MoD keeps every token in place: its grid is whole without laying back
    "mod-bypass": lambda m: amod.convert(m, capacity=0.5),
    "mod-merge": lambda m: amod.convert(m, capacity=0.5, skipped="merge"),
    "mod-kv": lambda m: amod.convert(m, capacity=0.5, skipped="kv"),
}
# timm forward_intermediates options a user passes, each checked against the dense model
OPTIONS = [
    dict(indices=None, output_fmt="NCHW"),
    dict(indices=[0, 3], output_fmt="NLC", norm=True),
    dict(indices=2, return_prefix_tokens=True, stop_early=True),
    dict(indices=[1, 2], intermediates_only=True, norm=True, return_prefix_tokens=True, output_fmt="NLC"),
    dict(indices=[3], output_dict=True, return_prefix_tokens=True),
]
VARIANTS = ["vit", "dinov2_reg"]  # a class token; a class token and 4 registers (DINOv2 with registers)


def _flat(out):
    """Every tensor of a forward_intermediates result, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for key in sorted(out) for t in _flat(out[key])]
    return [t for item in out for t in _flat(item)]


def _pair(variant: str, convert):
    dense = make_model(variant)
    model = copy.deepcopy(dense)
    convert(model)
    return dense, model


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", sorted(REDUCTIONS))
def test_nothing_reduced_the_grid_is_the_dense_model_s_exactly_with_every_option(variant, method):
    dense, model = _pair(variant, REDUCTIONS[method][1])
    x = images(dense)
    with torch.no_grad():
        for options in OPTIONS:
            want, got = _flat(dense.forward_intermediates(x, **options)), _flat(model.forward_intermediates(x, **options))
            assert [t.shape for t in got] == [t.shape for t in want], options
            for a, b in zip(got, want):
                assert torch.equal(a, b), options


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", sorted(REDUCTIONS) + sorted(ROUTED))
def test_every_method_gives_the_dense_shapes_with_every_option(variant, method):
    dense = make_model(variant)
    model = copy.deepcopy(dense)
    (REDUCTIONS[method][0] if method in REDUCTIONS else ROUTED[method])(model)
    x = images(dense)
    with torch.no_grad():
        for options in OPTIONS:
            want, got = _flat(dense.forward_intermediates(x, **options)), _flat(model.forward_intermediates(x, **options))
            assert [t.shape for t in got] == [t.shape for t in want], options
    assert shared_sizes(model) is None or shared_sizes(model).source is None  # nothing kept between forwards


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", sorted(REDUCTIONS))
def test_a_kept_token_stays_at_its_grid_position_and_a_merged_one_is_the_size_weighted_token(variant, method):
    """At the first block that reduces, a patch whose token holds it alone is the dense model's output at the same
    position (attention saw every token; the MLP is per token), and the patches sharing a token are as many as its
    size (ToMe, PiToMe, fold, calibrated; PPT's pruned patches take a kept token's place, so fewer there)."""
    dense, model = _pair(variant, REDUCTIONS[method][0])
    x = images(dense, batch=3)
    first = next(i for i, blk in enumerate(model.blocks) if blk._removed(blk.amod.num_prefix + 16) > 0)
    with torch.no_grad():
        want = dense.forward_intermediates(x, indices=[first], output_fmt="NLC", intermediates_only=True)[0]
        with tracking(model) as sizes:
            tokens = model.forward_features(x)
            source = model.blocks[first].amod_source
            final_source = sizes.source
            size = sizes.size
        got = model.forward_intermediates(x, indices=[first], output_fmt="NLC", intermediates_only=True)[0]
        p = model.num_prefix_tokens
        patch_source = source[:, p:]
        alone = torch.stack([(patch_source[b].unsqueeze(0) == patch_source[b].unsqueeze(1)).sum(0) == 1
                             for b in range(x.shape[0])])
        assert alone.any() and (~alone).any()  # both kinds of patch are there to check
        torch.testing.assert_close(got[alone], want[alone], rtol=1e-5, atol=1e-5)
        # the last grid is the final tokens laid back: one gather of the tokens the model ends with
        grid = model.forward_intermediates(x, indices=[len(model.blocks) - 1], norm=True, output_fmt="NLC",
                                           intermediates_only=True)[0]
        torch.testing.assert_close(grid, torch.stack([tokens[b, final_source[b, p:]] for b in range(x.shape[0])]))
        counts = torch.stack([torch.bincount(final_source[b], minlength=tokens.shape[1]) for b in range(x.shape[0])])
        if method == "ppt":
            assert (counts >= 1).all()
        else:
            assert torch.equal(counts, size[..., 0].round().long())


def test_classification_keeps_its_fast_path_and_the_grid_leaves_nothing_behind():
    dense, model = _pair("vit", REDUCTIONS["tome"][0])
    x = images(dense)
    with torch.no_grad():
        before = model(x)
        model.forward_intermediates(x)
        amod.patch_features(model, x, layers=[0, -1])
        assert torch.equal(model(x), before)
    assert not any("amod_source" in blk.__dict__ for blk in model.blocks)
    sizes = shared_sizes(model)
    assert not sizes.track and sizes.source is None
    assert type(model).__name__ == type(dense).__name__  # prints and describes as the timm class it was


@pytest.mark.parametrize("method", ["tome", "fold", "mod-bypass"])
def test_patch_features_one_call_for_a_grid_of_any_layers(method):
    dense = make_model("dinov2_reg")
    model = copy.deepcopy(dense)
    (REDUCTIONS[method][0] if method in REDUCTIONS else ROUTED[method])(model)
    x = images(dense)
    with torch.no_grad():
        last = amod.patch_features(model, x)
        assert last.shape == (2, dense.embed_dim, 4, 4)
        first, again = amod.patch_features(model, x, layers=[0, -1], output_fmt="NLC")
        assert first.shape == again.shape == (2, 16, dense.embed_dim)
        torch.testing.assert_close(again, last.flatten(2).transpose(1, 2))
        dense_last = amod.patch_features(dense, x)
        assert dense_last.shape == last.shape
    with pytest.raises(UserError, match=r"layers must be block indices in \[-4, 3\], got 4"):
        amod.patch_features(model, x, layers=4)
    with pytest.raises(UserError, match="amod.patch_features takes a timm ViT"):
        amod.patch_features(torch.nn.Linear(2, 2), x)


def test_the_grid_survives_save_load_pickle_and_deepcopy(tmp_path):
    dense, model = _pair("vit", REDUCTIONS["ppt"][0])
    x = images(dense)
    with torch.no_grad():
        want = amod.patch_features(model, x)
        path = amod.save(model, tmp_path / "ppt.safetensors")
        for other in (amod.load(path), pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            torch.testing.assert_close(amod.patch_features(other.eval(), x), want)
