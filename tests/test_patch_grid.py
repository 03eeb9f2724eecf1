"""Every patch keeps its feature (``amod.patch_grid``): timm's ``forward_intermediates`` and ``amod.patch_features``
give a reduced model's outputs on the dense model's patch grid, in the original patch order; nothing reduced, they
are the dense model's exactly. The same for Hugging Face DINOv2 (with registers too), CLIP, ViT and SigLIP through
``amod.patch_features``; and the grid path under bf16 autocast, ``torch.compile`` and ONNX export."""
from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch

import amod
from amod import pitome, tome
from amod import ppt
from amod.errors import UserError
from amod.patch_grid import shared_sizes, tracking
from amod.tokens import lay_back
from conftest import images, make_model

try:
    import transformers
except ImportError:  # (amod's Hugging Face support is an optional extra)
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None,
                              reason="Hugging Face models need transformers: pip install 'amod[hf]'")

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
# a class token; DINOv2's class token (LayerScale); a class token and 4 registers (DINOv2 with registers)
VARIANTS = ["vit", "dinov2", "dinov2_reg"]
DINOV2 = ("vit_small_patch14_dinov2", dict(img_size=28, patch_size=7, depth=4, embed_dim=96, num_heads=3))
# Hugging Face models: name -> (model class, config class, config beyond HF_SMALL); 4 layers, 16 patches of 7 px
HF_SMALL = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=28,
                patch_size=7)
HF_MODELS = {
    "hf-dinov2": ("Dinov2Model", "Dinov2Config", {}),
    "hf-dinov2-reg": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", {"num_register_tokens": 2}),
    "hf-clip": ("CLIPVisionModel", "CLIPVisionConfig", {}),
    "hf-vit": ("ViTModel", "ViTConfig", {}),
    "hf-siglip": ("SiglipVisionModel", "SiglipVisionConfig", {}),  # no class token
}


def _flat(out):
    """Every tensor of a forward_intermediates result, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for key in sorted(out) for t in _flat(out[key])]
    return [t for item in out for t in _flat(item)]


def _make(variant: str) -> torch.nn.Module:
    """A small timm model of ``variant`` (conftest's, or DINOv2 without registers), or a Hugging Face one."""
    if variant in HF_MODELS:
        model_cls, config_cls, extra = HF_MODELS[variant]
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**HF_SMALL, **extra)).eval()
    if variant == "dinov2":
        torch.manual_seed(0)
        return timm.create_model(DINOV2[0], pretrained=False, num_classes=10, **DINOV2[1]).eval()
    return make_model(variant)


def _images(model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    if hasattr(model, "patch_embed"):
        return images(model, batch=batch)
    size = model.config.image_size
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _pair(variant: str, convert):
    dense = _make(variant)
    model = copy.deepcopy(dense)
    convert(model)
    return dense, model


def _convert(method: str):
    return REDUCTIONS[method][0] if method in REDUCTIONS else ROUTED[method]


def _alone(source: torch.Tensor, p: int) -> torch.Tensor:
    """(B, n) whether each patch is the only original token its token holds (``source``: (B, N0))."""
    patches = source[:, p:]
    return torch.stack([(row.unsqueeze(0) == row.unsqueeze(1)).sum(0) == 1 for row in patches])


def _first_reducing(model: torch.nn.Module) -> int:
    return next(i for i, blk in enumerate(model.blocks) if blk._removed(blk.amod.num_prefix + 16) > 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", sorted(REDUCTIONS))
def test_nothing_reduced_the_grid_is_the_dense_model_s_exactly_with_every_option(variant, method):
    dense, model = _pair(variant, REDUCTIONS[method][1])
    x = _images(dense)
    with torch.no_grad():
        for options in OPTIONS:
            want, got = _flat(dense.forward_intermediates(x, **options)), _flat(model.forward_intermediates(x, **options))
            assert [t.shape for t in got] == [t.shape for t in want], options
            for a, b in zip(got, want):
                assert torch.equal(a, b), options


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", sorted(REDUCTIONS) + sorted(ROUTED))
def test_every_method_gives_the_dense_shapes_with_every_option(variant, method):
    dense, model = _pair(variant, _convert(method))
    x = _images(dense)
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
    x = _images(dense, batch=3)
    first = _first_reducing(model)
    with torch.no_grad():
        want = dense.forward_intermediates(x, indices=[first], output_fmt="NLC", intermediates_only=True)[0]
        with tracking(model) as sizes:
            tokens = model.forward_features(x)
            source = model.blocks[first].amod_source
            final_source = sizes.source
            size = sizes.size
        got = model.forward_intermediates(x, indices=[first], output_fmt="NLC", intermediates_only=True)[0]
        p = model.num_prefix_tokens
        alone = _alone(source, p)
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
    x = _images(dense)
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
    dense, model = _pair("dinov2_reg", _convert(method))
    x = _images(dense)
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
    x = _images(dense)
    with torch.no_grad():
        want = amod.patch_features(model, x)
        path = amod.save(model, tmp_path / "ppt.safetensors")
        for other in (amod.load(path), pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            torch.testing.assert_close(amod.patch_features(other.eval(), x), want)


# ---------------------------------------------------------------- Hugging Face models: amod.patch_features


@needs_hf
@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("method", sorted(REDUCTIONS))
def test_hf_nothing_reduced_the_grid_is_the_dense_model_s_hidden_states_exactly(name, method):
    """Every layer is the dense model's hidden state, patch for patch; the last, normed, its last_hidden_state."""
    dense, model = _pair(name, REDUCTIONS[method][1])
    x = _images(dense)
    with torch.no_grad():
        out = dense(pixel_values=x, output_hidden_states=True)
        for m in (dense, model):
            grids = amod.patch_features(m, x, layers=[0, 1, 2, 3], norm=False, output_fmt="NLC")
            p = m.num_prefix_tokens
            for grid, state in zip(grids, out.hidden_states[1:]):
                assert torch.equal(grid, state[:, p:])
            assert torch.equal(amod.patch_features(m, x, output_fmt="NLC"), out.last_hidden_state[:, p:])


@needs_hf
@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("method", sorted(REDUCTIONS) + sorted(ROUTED))
def test_hf_every_method_gives_the_dense_shapes_and_the_last_layer_is_its_own_output_laid_back(name, method):
    dense, model = _pair(name, _convert(method))
    x = _images(dense)
    with torch.no_grad():
        want = amod.patch_features(dense, x, layers=[0, -1])
        got = amod.patch_features(model, x, layers=[0, -1])
        assert [t.shape for t in got] == [t.shape for t in want] == [(2, 32, 4, 4)] * 2
        with tracking(model) as sizes:
            own = model(pixel_values=x).last_hidden_state  # the reduced sequence, as the model hands it on
            final_source = None if sizes is None else sizes.source
        laid = lay_back(own, final_source)[:, model.num_prefix_tokens:]
        assert torch.equal(amod.patch_features(model, x, output_fmt="NLC"), laid)
    assert shared_sizes(model) is None or shared_sizes(model).source is None  # nothing kept between forwards
    assert not any("amod_source" in blk.__dict__ for blk in model.blocks)


@needs_hf
@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("method", sorted(REDUCTIONS))
def test_hf_a_kept_token_stays_at_its_grid_position(name, method):
    """At the first layer that reduces, a patch whose token holds it alone is the dense model's at its position."""
    dense, model = _pair(name, REDUCTIONS[method][0])
    x = _images(dense, batch=3)
    first = _first_reducing(model)
    with torch.no_grad():
        want = amod.patch_features(dense, x, layers=first, norm=False, output_fmt="NLC")
        with tracking(model):
            model(pixel_values=x)
            source = model.blocks[first].amod_source
        got = amod.patch_features(model, x, layers=first, norm=False, output_fmt="NLC")
    alone = _alone(source, model.num_prefix_tokens)
    assert alone.any() and (~alone).any()
    torch.testing.assert_close(got[alone], want[alone], rtol=1e-5, atol=1e-5)


@needs_hf
def test_refusals_are_one_line():
    from amod.detect.models import small_detr

    hf = _make("hf-clip")
    x = _images(hf)
    torch.manual_seed(0)
    detr = small_detr(d_model=32, ffn=64, heads=2, encoder_layers=1, decoder_layers=1, num_queries=4).eval()
    refused = [
        (lambda: amod.patch_features(hf, x, layers=[0, 4]), r"layers must be block indices in \[-4, 3\], got 4"),
        (lambda: amod.patch_features(hf, x, output_fmt="NHWC"), "output_fmt must be 'NCHW' or 'NLC'"),
        (lambda: amod.patch_features(torch.nn.Linear(2, 2), x), "amod.patch_features takes a timm ViT"),
        (lambda: amod.patch_features(detr, torch.rand(1, 3, 64, 64)), "detr models give no per-patch features"),
    ]
    for call, message in refused:
        with pytest.raises(UserError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


# ---------------------------------------------------------------- the grid path under autocast, compile, export


@pytest.mark.parametrize("variant", ["dinov2_reg", pytest.param("hf-dinov2-reg", marks=needs_hf)])
def test_the_grid_under_bf16_autocast(variant):
    dense, model = _pair(variant, REDUCTIONS["tome"][0])
    x = _images(dense)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = amod.patch_features(dense, x, layers=[0, -1])
        got = amod.patch_features(model, x, layers=[0, -1])
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(t.isfinite().all() for t in got)
    assert shared_sizes(model).source is None and not shared_sizes(model).track


def test_the_grid_compiles_in_one_graph():
    """Dynamo captures the tracked forward and the gathers in one graph (``fullgraph``; the eager backend: inductor's
    CPU compile takes over half a minute here)."""
    dense, model = _pair("dinov2_reg", REDUCTIONS["tome"][0])
    x = _images(dense)
    with torch.no_grad():
        want = amod.patch_features(model, x, layers=[1, -1])
        torch._dynamo.reset()
        compiled = torch.compile(lambda im: amod.patch_features(model, im, layers=[1, -1]), backend="eager",
                                 fullgraph=True)
        got = compiled(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class PatchFeatures(torch.nn.Module):
    """``amod.patch_features`` as a module's forward, for export."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return amod.patch_features(self.model, x)


@pytest.mark.slow
def test_onnx_export_of_the_classifier_and_of_the_grid(tmp_path):
    """A reduced model with the grid mixin still exports its plain forward (amod.export, checked in ONNX Runtime);
    the grid path exports too (torch.onnx's dynamo exporter, at the batch it was traced with)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from amod.deploy import onnx_session, run_session

    dense, model = _pair("dinov2_reg", REDUCTIONS["tome"][0])
    x = _images(dense)
    report = amod.export(model, tmp_path / "m.onnx", batch=2, check_images=x)
    assert report["check"]["max_abs_diff"] <= 1e-4 and report["check"]["same_top1"]
    with torch.no_grad():
        want = amod.patch_features(model, x)
    torch.onnx.export(PatchFeatures(model).eval(), (x,), tmp_path / "grid.onnx", dynamo=True, verbose=False)
    torch.testing.assert_close(run_session(onnx_session(tmp_path / "grid.onnx"), x), want, rtol=1e-4, atol=1e-4)
