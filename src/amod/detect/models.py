"""The DETRs ``amod detect`` trains and the tests use: Hugging Face ``DetrForObjectDetection`` built from a config (no hub).

``small_detr`` is sized for a CPU: a two-stage ResNet (``transformers``' own, random weights) to stride 8, so a
128 x 128 canvas gives the encoder 16 x 16 = 256 positions, enough for routing to matter; a 6-layer encoder
(MoD on layers 1, 3, 5 by default) and a 3-layer decoder of width 128. A user with a network loads a
pretrained one instead (``DetrForObjectDetection.from_pretrained("facebook/detr-resnet-50")``): amod's
calls take it as they are.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import MissingDependencyError

try:
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig
except ImportError:  # pragma: no cover - the optional extra is missing
    raise MissingDependencyError(
        "DETR models need transformers, the optional extra: pip install 'amod[detr]'") from None


def small_detr_config(num_labels: int = 10, d_model: int = 128, encoder_layers: int = 6, decoder_layers: int = 3,
                      heads: int = 8, ffn: int = 512, num_queries: int = 20, backbone_width: int = 32,
                      **overrides: Any) -> DetrConfig:
    """A ``DetrConfig`` with a small random-weight ResNet backbone of stride 8 (``overrides``: any other
    ``DetrConfig`` field)."""
    # two stages, the second's output (stride 8) feeding the encoder: a stage after it would run, and train
    # nothing, on every forward (and leave DDP parameters without a gradient)
    backbone = ResNetConfig(num_channels=3, embedding_size=backbone_width,
                            hidden_sizes=[backbone_width, 2 * backbone_width], depths=[1, 1],
                            layer_type="basic", out_features=["stage2"])
    return DetrConfig(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
                      d_model=d_model, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
                      encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                      decoder_ffn_dim=ffn, num_queries=num_queries, num_labels=num_labels,
                      **{"auxiliary_loss": True, **overrides})  # a loss on every decoder layer: faster convergence


def small_detr(**kwargs: Any) -> nn.Module:
    """A randomly initialised ``DetrForObjectDetection`` of ``small_detr_config(**kwargs)``, set up to train from
    scratch: every backbone layer trains (transformers freezes a ResNet's stem and first stage, made for a
    pretrained one), and the object queries start as N(0, 1), as in the original DETR (transformers draws them with
    std 0.02: near-identical queries that all predict the same box for thousands of steps)."""
    model = DetrForObjectDetection(small_detr_config(**kwargs))
    model.model.unfreeze_backbone()
    nn.init.normal_(model.model.query_position_embeddings.weight)
    return model
