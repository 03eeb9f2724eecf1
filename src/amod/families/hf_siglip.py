"""Hugging Face ``transformers`` SigLIP vision encoders (``SiglipVisionModel``): the image towers of SigLIP and of the
vision-language models built on it (PaliGemma, Idefics, SmolVLM and others).

A SigLIP vision layer is a pre-norm ViT block (``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``). There is
no class token: the pooled output is a multi-head attention pooling (MAP) head whose one learned query reads every
token of ``post_layernorm``'s output. So every token is routable (no prefix tokens), and:

- MoD: A-MoD's score is the mean attention a token received, as for any ViT; every token can be skipped.
- fold: with no class token to ask, a fold block's importance (what it protects) is the attention each token
  receives from every token, A-MoD's own score (``amod.reduce.ALL_ROWS``: one more Q K^T, priced in ``amod.flops``).
- fold and ToMe: the tokens that reach the head carry sizes; the head's attention adds log(size) to its logits
  (``SizedPoolingHead``), so that a merged token counts as the patches it holds, as in every block.

The head's cost: its query, key, value and output projections, its attention over the tokens the last block hands
on, and its MLP on the one pooled token.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..family import register_family
from ..ops import KeyBias
from ..reduce import SizedTokensBlock
from ..tokens import TokenSizes
from .hf_base import HFFamily, PatchEmbedView, set_view
from .hf_clip import CLIPAttentionViews, CLIPLayerViews


class SizedPoolingHead:
    """Mixin of ``SiglipMultiheadAttentionPoolingHead``: its attention adds log(size) of the tokens it reads (the
    proportional bias of the model's ``TokenSizes``, ``amod_sizes``) to the logits (proportional attention, as fold and ToMe blocks do)."""

    amod_sizes: TokenSizes

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        bias = self.amod_sizes.bias  # log(size) (B, 1, 1, N) from the last reduction; None while every size is 1
        probe = self.probe.repeat(hidden_state.shape[0], 1, 1)
        if bias is None:
            out = self.attention(probe, hidden_state, hidden_state, need_weights=False)[0]
        else:
            out = _biased_multihead(self.attention, probe, hidden_state, bias)
        out = out + self.mlp(self.layernorm(out))
        return out[:, 0]


def _biased_multihead(mha: nn.MultiheadAttention, query: torch.Tensor, tokens: torch.Tensor, bias: KeyBias
                      ) -> torch.Tensor:
    """``mha(query, tokens, tokens)`` (batch first, its own projections) with the per-key ``bias`` added to the
    logits, maskless (``KeyBias.attention``): nn.MultiheadAttention would pass it to the fused kernel as a mask."""
    (B, Lq, E), N, H = query.shape, tokens.shape[1], mha.num_heads
    weights = mha.in_proj_weight.chunk(3)
    biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
    q, k, v = (F.linear(t, w, b).view(B, t.shape[1], H, E // H).transpose(1, 2)  # (B, H, L, E / H)
               for t, w, b in zip((query, tokens, tokens), weights, biases))
    o = bias.attention(q, k, v, (E // H) ** -0.5, mha.dropout if mha.training else 0.0)
    return mha.out_proj(o.transpose(1, 2).reshape(B, Lq, E))


class HFSiglipFamily(HFFamily):
    name = "hf-siglip"
    models = "Hugging Face SigLIP vision encoders (SiglipVisionModel)"
    classes = ("SiglipVisionModel",)
    layer_views = {"SiglipEncoderLayer": CLIPLayerViews}  # the same names as CLIP's
    attention_views = {"SiglipAttention": CLIPAttentionViews}

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.encoder.layers

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def patch_embed(self, model: nn.Module) -> PatchEmbedView:
        emb = model.embeddings
        return PatchEmbedView(emb.patch_embedding, emb.image_size, emb.patch_size)

    def prefix_tokens(self, model: nn.Module) -> tuple[int, int]:
        return 0, 0

    def class_rows(self, model: nn.Module) -> int:
        return 0  # no class token: fold reads the attention every token receives

    def final_tokens(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(pixel_values=x).last_hidden_state

    def pool(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model.head(tokens) if getattr(model, "use_head", False) else tokens.mean(1)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.post_layernorm  # last_hidden_state: the last layer's output after post_layernorm

    def outside_blocks_macs(self, model: nn.Module, num_patches: int, tokens_out: int) -> tuple[int, int]:
        embed = num_patches * model.embeddings.patch_embedding.weight.numel()
        head = model._modules.get("head")
        if head is None:
            return embed, 0
        attn = head.attention
        d = attn.embed_dim
        mlp = sum(m.in_features * m.out_features for m in head.mlp.modules() if isinstance(m, nn.Linear))
        # the query and output projections and the MLP on the one query; keys and values of every token; the
        # query's scores and weighted sum over them
        return embed, 2 * d * d + 2 * tokens_out * d * d + 2 * tokens_out * d + mlp

    def _size_the_head(self, model: nn.Module) -> None:
        """Give the MAP head the token sizes of a model whose blocks reduce tokens (fold, ToMe)."""
        head = model._modules.get("head")
        first = model.blocks[0]
        if head is None or not isinstance(first, SizedTokensBlock) or isinstance(head, SizedPoolingHead):
            return
        base = type(head)
        head.__class__ = type(f"Sized{base.__name__}", (SizedPoolingHead, base), {"__module__": __name__})
        set_view(head, "amod_sizes", first.amod.sizes)

    def convert(self, model: nn.Module, config: Any) -> None:
        super().convert(model, config)
        self._size_the_head(model)

    def merge_apply(self, model: nn.Module, merge: Any) -> nn.Module:
        super().merge_apply(model, merge)
        self._size_the_head(model)
        return model


FAMILY = register_family(HFSiglipFamily())
