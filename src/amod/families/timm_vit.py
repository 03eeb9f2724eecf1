"""timm's ``VisionTransformer`` (vit_*, deit_* incl. distilled, deit3_*, *_reg*, *_dinov2): amod's own names.

amod's blocks are written against timm's, so a timm model needs no views: a role is a class swap of the very
``Block`` and ``Attention`` modules (parameters and state_dict keys stay). A checkpoint describes the model by its
timm architecture name and ``create_model`` arguments (``amod.arch``).
"""
from __future__ import annotations

from typing import Any, Optional

import timm
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import nn

from ..arch import (architecture_name, infer_model_args, set_input_channels, set_input_size,
                    weightless_timm_copy)
from ..family import class_names, register_family
from ..mod.block import MoDBlock, ScoringAttention
from ..patch_grid import grid_class
from ..reduce import make_sized
from .vit import ViTFamily
from ..errors import UnsupportedModelError


class TimmViTFamily(ViTFamily):
    name = "timm"
    models = "timm's VisionTransformer (vit_*, deit_* incl. distilled, deit3_*, *_reg*, *_dinov2 models)"
    trainable = True

    def claims(self, model: Any) -> bool:
        return "VisionTransformer" in class_names(model, "timm.")

    def claims_description(self, info: dict[str, Any]) -> bool:
        return "arch" in info and "hf" not in info

    def check_block(self, block: nn.Module, index: int) -> None:
        if type(block) not in (Block, MoDBlock):
            raise UnsupportedModelError(
                f"block {index} is a {type(block).__name__}; amod converts timm's pre-norm "
                "timm.models.vision_transformer.Block only")
        if type(block.attn) not in (Attention, ScoringAttention):
            raise UnsupportedModelError(
                f"block {index} uses {type(block.attn).__name__}; amod supports timm.layers.Attention only")

    def make_mod(self, block: nn.Module) -> nn.Module:
        block.__class__ = MoDBlock
        return block

    def make_scoring(self, block: nn.Module) -> nn.Module:
        block.attn.__class__ = ScoringAttention
        return block.attn

    def make_sized(self, block: nn.Module, block_cls: type, settings: Any, class_rows: int = 0) -> None:
        make_sized(block, block_cls, settings, class_rows)

    def lay_out_patch_grid(self, model: nn.Module) -> None:
        model.__class__ = grid_class(type(model))  # forward_intermediates laid back on the grid (amod.patch_grid)

    def router_dim(self, block: nn.Module) -> int:
        norm = block.norm1
        return norm.normalized_shape[0] if hasattr(norm, "normalized_shape") else block.attn.qkv.in_features

    def describe(self, model: nn.Module, arch: Optional[str] = None,
                 model_args: Optional[dict[str, Any]] = None, **hints: Any) -> dict[str, Any]:
        return {"arch": arch or architecture_name(model), "args": model_args or infer_model_args(model)}

    def rebuild(self, info: dict[str, Any], metadata: Optional[dict[str, str]] = None) -> nn.Module:
        return timm.create_model(info["arch"], pretrained=False, **info["args"])

    def weightless_copy(self, model: nn.Module) -> nn.Module:
        return weightless_timm_copy(model)

    def keep_blocks(self, model: nn.Module, keep: list[int]) -> nn.Module:
        model.blocks = nn.Sequential(*[model.blocks[i] for i in keep])
        return model

    def set_input_size(self, model: nn.Module, img_size: Any) -> nn.Module:
        return set_input_size(model, img_size)

    def set_input_channels(self, model: nn.Module, in_chans: int) -> nn.Module:
        return set_input_channels(model, in_chans)


FAMILY = register_family(TimmViTFamily())
