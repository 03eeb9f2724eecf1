"""Hugging Face ``transformers`` ViT, DeiT and DINOv2: ``ViTModel``/``ViTForImageClassification``,
``DeiTModel``/``DeiTForImageClassification`` (``...WithTeacher``), ``Dinov2Model``/``Dinov2ForImageClassification``
(and ``Dinov2WithRegisters*``), as they are: same forward signature, same output classes, same state_dict keys.

Their layers take amod's roles through ``amod.families.hf_base`` (class swaps with views of the HF names under
timm's); this module says where the layers are and which names map to which. Prefix tokens: CLS, DeiT's distillation
token, DINOv2's registers.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..family import register_family
from .hf_base import IDENTITY, AttentionViews, HFFamily, PatchEmbedView, alias


class ViTAttentionViews(AttentionViews):
    """``ViTAttention``, ``DeiTAttention``, ``Dinov2Attention``: ``num_attention_heads``, ``scaling``, ``o_proj``."""

    num_heads = alias("num_attention_heads")
    scale = alias("scaling")


class ViTLayerViews:
    """timm ``Block``'s names on ``ViTLayer``/``DeiTLayer`` (its hidden dropout sits where timm's drop path does:
    x + dropout(attention(...)), as HF computes it)."""

    ls1 = ls2 = IDENTITY
    norm1 = alias("layernorm_before")
    norm2 = alias("layernorm_after")
    attn = alias("attention")
    drop_path1 = drop_path2 = alias("dropout")


class Dinov2LayerViews:
    """timm ``Block``'s names on ``Dinov2Layer`` (``norm1``, ``norm2`` and ``mlp`` already match)."""

    attn = alias("attention")
    ls1 = alias("layer_scale1")
    ls2 = alias("layer_scale2")
    drop_path1 = drop_path2 = alias("drop_path")


class HFViTFamily(HFFamily):
    name = "hf-vit"
    models = "Hugging Face ViT, DeiT and DINOv2 (ViTModel, ViTForImageClassification, DeiT*, Dinov2*)"
    classes = ("ViTModel", "ViTForImageClassification", "DeiTModel", "DeiTForImageClassification",
               "DeiTForImageClassificationWithTeacher", "Dinov2Model", "Dinov2ForImageClassification",
               "Dinov2WithRegistersModel", "Dinov2WithRegistersForImageClassification")
    layer_views = {"ViTLayer": ViTLayerViews, "DeiTLayer": ViTLayerViews, "Dinov2Layer": Dinov2LayerViews,
                   "Dinov2WithRegistersLayer": Dinov2LayerViews}
    attention_views = {name: ViTAttentionViews for name in ("ViTAttention", "DeiTAttention", "Dinov2Attention",
                                                         "Dinov2WithRegistersAttention")}

    def layers(self, model: nn.Module) -> nn.ModuleList:
        base = model.base_model
        return base.layers if "layers" in base._modules else base.encoder.layer  # ViT/DeiT; DINOv2

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention

    def patch_embed(self, model: nn.Module) -> PatchEmbedView:
        pe = model.base_model.embeddings.patch_embeddings
        return PatchEmbedView(pe.projection, pe.image_size, pe.patch_size)

    def prefix_tokens(self, model: nn.Module) -> tuple[int, int]:
        base = model.base_model
        regs = int(getattr(base.config, "num_register_tokens", 0) or 0)
        distilled = "distillation_token" in base.embeddings._parameters
        return 1 + int(distilled) + regs, regs

    def heads(self, model: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
        if "cls_classifier" in model._modules:  # DeiTForImageClassificationWithTeacher
            return model.cls_classifier, model.distillation_classifier
        if "classifier" in model._modules:
            return model.classifier, None
        pooler = model.base_model._modules.get("pooler")  # ViTModel/DeiTModel with their pooler (a Linear + tanh)
        return (pooler.dense if pooler is not None else None), None

    def constructor_kwargs(self, model: nn.Module) -> dict[str, Any]:
        if self.hf_class(model) in ("ViTModel", "DeiTModel"):
            return {"add_pooling_layer": model.pooler is not None}
        return {}


FAMILY = register_family(HFViTFamily())
