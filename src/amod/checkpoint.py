"""Save and load (converted) timm ViTs: safetensors weights with the architecture and MoD config inside.

The file's metadata holds ``amod.model`` (timm architecture name and creation kwargs) and, for a
converted model, ``amod.mod`` (its ``MoDConfig``) or, for a token-merging model, ``amod.merge`` (its
schedule), so ``amod.load(path)`` needs nothing else.
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
from timm.layers import LayerScale
from torch import nn

from . import files
from .config import MoDConfig

PathLike = Union[str, os.PathLike]
FORMAT_VERSION = "1"


def infer_model_args(model: nn.Module) -> dict[str, Any]:
    """The timm ``create_model`` kwargs that rebuild ``model``'s architecture (checked on load)."""
    blk = model.blocks[0]
    embed_dim = model.embed_dim
    args: dict[str, Any] = {
        "img_size": list(model.patch_embed.img_size),
        "patch_size": list(model.patch_embed.patch_size),
        "in_chans": model.patch_embed.proj.in_channels,
        "num_classes": model.num_classes,
        "embed_dim": embed_dim,
        "depth": len(model.blocks),
        "num_heads": blk.attn.num_heads,
        "mlp_ratio": blk.mlp.fc1.out_features / embed_dim,
        "qkv_bias": blk.attn.qkv.bias is not None,
        "qk_norm": not isinstance(blk.attn.q_norm, nn.Identity),
        "class_token": model.cls_token is not None,
        "reg_tokens": getattr(model, "num_reg_tokens", 0),
        "no_embed_class": model.no_embed_class,
        "global_pool": model.global_pool,
        "dynamic_img_size": getattr(model, "dynamic_img_size", False),
    }
    if isinstance(blk.ls1, LayerScale):
        args["init_values"] = 1e-5  # only the presence matters: the values are loaded
    return args


def architecture_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    name = cfg.get("architecture")
    if not name:
        raise ValueError("cannot tell which timm architecture this model is; pass arch= to amod.save")
    return name


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
    meta = {"amod.format": FORMAT_VERSION, "amod.model": json.dumps(info)}
    config = getattr(model, "amod_config", None)
    if config is not None:
        meta["amod.mod"] = config.to_json()
    merging = getattr(model, "amod_merge", None)
    if merging is not None:
        meta["amod.merge"] = json.dumps({"schedule": merging.schedule})
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
    """Rebuild a model saved with ``amod.save``: architecture, MoD conversion and weights."""
    from .convert import convert
    from .merge import apply as apply_merging

    meta = read_metadata(path)
    try:
        info = json.loads(meta["amod.model"])
        model = timm.create_model(info["arch"], pretrained=False, **info["args"])
        if "amod.mod" in meta:
            config = MoDConfig.from_dict(json.loads(meta["amod.mod"]))
            convert(model, router=config.router, capacity=config.capacity, layers=config.layers,
                    scale_output=config.scale_output, seed=config.seed, skipped=config.skipped,
                    protect=config.protect)
        if "amod.merge" in meta:
            apply_merging(model, r=json.loads(meta["amod.merge"])["schedule"])
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
