"""Save and load (converted) timm ViTs: safetensors weights with the architecture and MoD config inside.

The file's metadata holds ``amod.model`` (timm architecture name and creation kwargs) and what the
model's method (``amod.methods``) writes: ``amod.mod`` (an MoD model's ``MoDConfig``) or
``amod.merge`` (a token-merging model's schedule), so ``amod.load(path)`` needs nothing else.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import timm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from .. import files
from ..arch import architecture_name, infer_model_args
from ..methods import method_from_metadata, method_of

PathLike = Union[str, os.PathLike]
FORMAT_VERSION = "1"


def save(
    model: nn.Module,
    path: PathLike,
    arch: Optional[str] = None,
    model_args: Optional[dict[str, Any]] = None,
    metadata: Optional[dict[str, str]] = None,
) -> Path:
    """Write ``model`` (dense or converted) to a safetensors file that ``amod.load`` rebuilds alone.

    Args:
        model: a timm ViT, converted or not.
        path: destination file; written to a temporary name first, then renamed.
        arch: timm architecture name; defaults to ``model.pretrained_cfg['architecture']``.
        model_args: kwargs for ``timm.create_model``; defaults to ones read off the model.
        metadata: extra string entries for the file's metadata.
    """
    path = Path(path)
    info = {"arch": arch or architecture_name(model), "args": model_args or infer_model_args(model)}
    meta = {"amod.format": FORMAT_VERSION, "amod.model": json.dumps(info), **method_of(model).metadata()}
    meta.update(metadata or {})
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    return files.write_bytes(path, safetensors_bytes(tensors, metadata=meta))


def read_metadata(path: PathLike) -> dict[str, str]:
    """The string metadata of an amod safetensors file; clear errors for missing or foreign files."""
    path = Path(path)
    if path.is_dir():
        inside = path / "model.safetensors"
        hint = f"; did you mean {inside}?" if inside.is_file() else "; give the .safetensors file"
        raise ValueError(f"checkpoint {path} is a directory{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors checkpoint ({e})") from None
    if "amod.model" not in meta:
        raise ValueError(f"{path} was not written by amod.save (no 'amod.model' metadata)")
    return meta


def check_dense_file(path: PathLike) -> None:
    """Refuse a file that is not a readable amod checkpoint of a dense model (the start of a comparison)."""
    meta = read_metadata(path)
    if "amod.mod" in meta or "amod.merge" in meta:
        raise ValueError(f"{path} is an MoD or token-merging model; give a dense one")


def load(path: PathLike, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Rebuild a model saved with ``amod.save``: architecture, method (MoD, token merging) and weights."""
    meta = read_metadata(path)
    try:
        info = json.loads(meta["amod.model"])
        model = method_from_metadata(meta).apply(timm.create_model(info["arch"], pretrained=False, **info["args"]))
    except (ValueError, TypeError, KeyError, RuntimeError, AssertionError) as e:
        raise ValueError(f"{path}: its amod metadata cannot be rebuilt into a model "
                         f"({type(e).__name__}: {e})") from None
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is corrupt: {e}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit the architecture it names ({info['arch']}): "
            f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    return model.to(device)
