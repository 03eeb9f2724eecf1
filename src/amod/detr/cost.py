"""What a DETR costs, dense or with an MoD encoder: the encoder analytically, the rest measured.

The encoder's MACs follow from the positions each layer processes (``amod.detr.convert``), the routers' own
products and, for a layer that scores attention for A-MoD, the column sums of its attention (k x k per head,
what ``amod.ops.attention_with_scores`` adds on the CPU); the backbone, the
input projection, the decoder and the heads do not change with routing and are measured once per image
size with ``torch.utils.flop_counter.FlopCounterMode`` (convolutions included), on one blank image.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ..cost import BlockCost, MacsRatios, flop_counter, validate_cost
from ..mod.routing import num_kept
from .convert import DetrMoDEncoderLayer, DetrScoringSelfAttention, detr_base, encoder_layers

ImgSize = Union[int, tuple[int, int]]


@dataclass
class DetrCostReport(MacsRatios):
    """MACs of one image through a DETR. ``layers``: each encoder layer's MACs and the positions it runs on."""

    img_size: tuple[int, int]
    tokens: int  # encoder positions (the backbone's feature map)
    encoder_macs: int
    encoder_dense_macs: int
    other_macs: int  # backbone, input projection, decoder, heads: the same dense or converted
    layers: list[BlockCost]

    @property
    def macs(self) -> int:
        return self.encoder_macs + self.other_macs

    @property
    def dense_macs(self) -> int:
        return self.encoder_dense_macs + self.other_macs

    @property
    def encoder_ratio(self) -> float:
        return self.encoder_macs / self.encoder_dense_macs


def layer_macs(layer: nn.Module, tokens: int) -> int:
    """A DETR encoder layer run densely on ``tokens`` positions: q/k/v/o projections and MLP per position, then
    QK^T and AV (each tokens x tokens x d_model)."""
    linears = [m for part in (layer.self_attn, layer.mlp) for m in part.modules() if isinstance(m, nn.Linear)]
    per_token = sum(m.in_features * m.out_features for m in linears)
    return tokens * per_token + 2 * tokens * tokens * layer.self_attn.q_proj.out_features


def _img_size(img_size: Optional[ImgSize]) -> tuple[int, int]:
    if img_size is None:
        raise ValueError("a DETR takes images of any size: give img_size (an int or (H, W))")
    h, w = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
    if h < 1 or w < 1:
        raise ValueError(f"img_size must be positive, got {h}x{w}")
    return h, w


def measured(model: nn.Module, img_size: ImgSize) -> tuple[int, int, int]:
    """(all MACs, encoder MACs, encoder positions) of ``model`` on one blank image, by ``FlopCounterMode``."""
    h, w = _img_size(img_size)
    param = next(model.parameters())
    x = torch.zeros(1, 3, h, w, device=param.device, dtype=param.dtype)
    encoder = detr_base(model).encoder
    seen: list[int] = []
    hook = encoder.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("inputs_embeds", args[0] if args else None).shape[1]),
        with_kwargs=True)
    was_training = model.training
    try:
        model.eval()
        with flop_counter() as counter, torch.no_grad():
            model(pixel_values=x)
    finally:
        hook.remove()
        model.train(was_training)
    counts = counter.get_flop_counts()
    total = counter.get_total_flops()
    name = next(k for k in counts if k.endswith(".encoder") and k.count(".") <= 2)
    return total // 2, sum(counts[name].values()) // 2, seen[0]


def _positions_and_rest(model: nn.Module, img_size: tuple[int, int]) -> tuple[int, int]:
    """(encoder positions, MACs of everything but the encoder) at ``img_size``, measured."""
    total, encoder_counted, n = measured(model, img_size)
    return n, total - encoder_counted


def detr_flops(model: nn.Module, img_size: ImgSize = None, capacity: Optional[float] = None) -> DetrCostReport:
    """Cost of one ``img_size`` image through the DETR ``model`` (dense or converted), priced at ``capacity``
    if given (the model is not changed). The encoder is analytic; the rest is measured (``measured``)."""
    h, w = _img_size(img_size)
    return _report(model, (h, w), *_positions_and_rest(model, (h, w)), capacity)


def _report(model: nn.Module, img_size: tuple[int, int], n: int, other: int,
            capacity: Optional[float]) -> DetrCostReport:
    layers, macs, dense = [], 0, 0
    for i, layer in enumerate(encoder_layers(model)):
        dense += layer_macs(layer, n)
        if isinstance(layer, DetrMoDEncoderLayer):
            k = num_kept(layer.amod.config.capacity if capacity is None else capacity, n)
            cost = layer_macs(layer, k) + layer.router.macs(n)
        else:
            k, cost = n, layer_macs(layer, n)
        if isinstance(layer.self_attn, DetrScoringSelfAttention):  # A-MoD's column sums: k x k per head
            cost += k * k * (layer.self_attn.q_proj.out_features // layer.self_attn.head_dim)
        layers.append(BlockCost(i, k, cost))
        macs += cost
    return DetrCostReport(img_size, n, macs, dense, other, layers)


def capacity_for_encoder_cost(model: nn.Module, cost: float, img_size: ImgSize) -> float:
    """The capacity at which the converted DETR's encoder costs closest to ``cost`` x the dense encoder's MACs
    (ties to the larger capacity; the model is not changed). Tries every k / N."""
    cost = validate_cost(cost)
    if getattr(model, "amod_config", None) is None:
        raise ValueError("model is not an amod MoD model; convert it with amod.convert first")
    h, w = _img_size(img_size)
    n, other = _positions_and_rest(model, (h, w))
    ratios = {k / n: _report(model, (h, w), n, other, k / n).encoder_ratio for k in range(1, n + 1)}
    return min(ratios, key=lambda c: (abs(ratios[c] - cost), -c))
