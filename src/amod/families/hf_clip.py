"""Hugging Face ``transformers`` CLIP vision encoders: ``CLIPVisionModel`` and ``CLIPVisionModelWithProjection``,
the image towers of CLIP and of the vision-language models built on it.

A CLIP vision layer is a pre-norm ViT block (``layer_norm1``, ``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/
``out_proj``, ``layer_norm2``, ``mlp``); the embeddings add a class token, then ``pre_layrnorm`` (no MACs) runs
before the first layer; the pooled output is the class token after ``post_layernorm``. Prefix: the class token
(never routed, merged or folded; fold reads its attention as importance). ``...WithProjection``'s
``visual_projection`` is its head.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..family import register_family
from .hf_base import IDENTITY, AttentionViews, HFFamily, PatchEmbedView, alias


class CLIPAttentionViews(AttentionViews):
    """``CLIPAttention`` (and SigLIP's): ``num_heads``, ``scale`` and ``head_dim`` as timm names them, ``out_proj``."""

    proj = alias("out_proj")
    _dropout = "dropout"


class CLIPLayerViews:
    """timm ``Block``'s names on ``CLIPEncoderLayer`` (no LayerScale, no drop path)."""

    ls1 = ls2 = drop_path1 = drop_path2 = IDENTITY
    norm1 = alias("layer_norm1")
    norm2 = alias("layer_norm2")
    attn = alias("self_attn")


class HFCLIPFamily(HFFamily):
    name = "hf-clip"
    models = "Hugging Face CLIP vision encoders (CLIPVisionModel, CLIPVisionModelWithProjection)"
    classes = ("CLIPVisionModel", "CLIPVisionModelWithProjection")
    layer_views = {"CLIPEncoderLayer": CLIPLayerViews}
    attention_views = {"CLIPAttention": CLIPAttentionViews}

    def _vision(self, model: nn.Module) -> nn.Module:
        return model.vision_model if "vision_model" in model._modules else model  # (older layouts wrap it)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self._vision(model).encoder.layers

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def patch_embed(self, model: nn.Module) -> PatchEmbedView:
        emb = self._vision(model).embeddings
        return PatchEmbedView(emb.patch_embedding, emb.image_size, emb.patch_size)

    def prefix_tokens(self, model: nn.Module) -> tuple[int, int]:
        return 1, 0

    def heads(self, model: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
        return model._modules.get("visual_projection"), None

    def final_tokens(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(pixel_values=x).last_hidden_state  # (before post_layernorm, which CLIP applies to the pool)

    def pool(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return self._vision(model).post_layernorm(tokens[:, 0])  # CLIP's pooler_output

    def final_norm(self, model: nn.Module) -> nn.Module:
        return IDENTITY  # last_hidden_state is the last layer's output (post_layernorm norms the pool only)


FAMILY = register_family(HFCLIPFamily())
