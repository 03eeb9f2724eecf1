"""A toy amod method in one file, as a package outside amod ships one: the last blocks of a timm ViT skipped.

``tests/test_method_seam.py`` registers it in the test process, and packages it for the shipped ``amod`` command
through the entry-point group ``amod.methods`` (``toy = amod_toy_method:SkipLast``). Importing this file registers
nothing (the entry point names the class, which amod registers): the test suite imports it beside the other tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from timm.models.vision_transformer import Block
from torch import nn

from amod.cost import BlockPrice
from amod.methods import Method


class SkippedBlock(Block):
    """A timm block that passes its tokens on untouched (its weights kept, unused): it costs nothing."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        return BlockPrice(0, tokens, tokens)


@dataclass(frozen=True)
class SkipLast(Method):
    """The last ``blocks`` blocks of a timm ViT skipped."""

    kind: ClassVar[str] = "toy-skip"
    metadata_key: ClassVar[str] = "amod.toy-skip"  # its fields as JSON, the default metadata
    blocks: int = 1

    def apply(self, model: nn.Module) -> nn.Module:
        for blk in model.blocks[len(model.blocks) - self.blocks:]:
            blk.__class__ = SkippedBlock
        return model

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["SkipLast"]:
        skipped = sum(isinstance(b, SkippedBlock) for b in model.blocks)
        return cls(blocks=skipped) if skipped else None

    def at_cost(self, dense: nn.Module, cost: float, images=None) -> "SkipLast":
        return min((SkipLast(k) for k in range(1, len(dense.blocks))), key=lambda m: abs(m.cost_of(dense) - cost))
