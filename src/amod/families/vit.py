"""The Vision Transformer pattern every ViT-like family shares: after ``prepare`` the model shows amod timm's names
(``blocks``, ``patch_embed``, ``num_prefix_tokens``, ``num_reg_tokens``, ``head``, ``head_dist``), its blocks take
amod's roles through the family's ``make_*`` methods, and conversion, token merging and cost are amod's generic
ones. A family of this pattern says only how its model and blocks show those names and what it costs outside its
blocks (``outside_blocks_macs``); timm (``timm_vit``) and the Hugging Face families subclass it."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..cost import CostReport, embed_head_macs, vit_flops
from ..family import Family
from ..mod.config import MoDConfig
from ..mod.modes import skipped_mode
from ..errors import UnsupportedModelError, UserError


class ViTFamily(Family):
    """A family of the ViT pattern: the generic conversion, token merging and cost, on the family's views."""

    def class_rows(self, model: nn.Module) -> int:
        return model.num_prefix_tokens - getattr(model, "num_reg_tokens", 0)  # CLS and distillation tokens

    def router_dim(self, block: nn.Module) -> int:
        return block.attn.qkv.in_features

    def convert(self, model: nn.Module, config: MoDConfig) -> None:
        skipped_mode(config.skipped).convert(model, config, self)

    def merge_apply(self, model: nn.Module, merge: Any) -> nn.Module:
        merged = merge(self.prepare(model), self)
        self.lay_out_patch_grid(merged)
        return merged

    def outside_blocks_macs(self, model: nn.Module, num_patches: int, tokens_out: int) -> tuple[int, int]:
        """(patch embedding, head) MACs of one image whose last block hands on ``tokens_out`` tokens."""
        return embed_head_macs(model, num_patches)

    def flops(self, model: nn.Module, img_size: Any, capacity: Optional[float]) -> CostReport:
        return vit_flops(self.prepare(model), img_size, capacity, self.outside_blocks_macs)

    def keep_blocks(self, model: nn.Module, keep: list[int]) -> nn.Module:
        """Keep only the blocks ``keep`` (the isoFLOP baseline's fewer blocks), in place; returns the model."""
        raise UnsupportedModelError(f"{self.name} models cannot drop blocks")

    def set_input_size(self, model: nn.Module, img_size: Any) -> nn.Module:
        """Make ``model`` take ``img_size`` images (resampling its position embedding), in place."""
        raise UserError(f"a {self.name} model takes its config's image_size {tuple(model.patch_embed.img_size)}; "
                        "it cannot be changed here")

    def set_input_channels(self, model: nn.Module, in_chans: int) -> nn.Module:
        """Make ``model`` take ``in_chans``-channel images (its patch embedding's filters adapted), in place."""
        raise UserError(f"a {self.name} model takes {model.patch_embed.proj.in_channels}-channel images (its "
                        f"config's num_channels); it cannot be changed to {in_chans} here")
