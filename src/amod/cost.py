"""Analytic cost of (MoD) ViTs, a FLOP counter for checking it, and the isoFLOP dense baseline.

MACs are multiply-accumulates per image, counted the way timm's published figures are: the matrix
products (patch embedding, qkv, attention QK^T and AV, projection, MLP, head). Norms, softmax and
activations are left out. FLOPs = 2 x MACs.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .block import MoDBlock
from .fold import FoldBlock, fold_count
from .config import MoDConfig, validate_cost
from .routers import StandardRouter
from .routing import num_kept


@dataclass
class BlockCost:
    index: int
    tokens: int  # tokens the block runs on: N dense, p + k in an MoD block
    macs: int


@dataclass
class CostReport:
    """Per-image cost of a model at one input size."""

    img_size: tuple[int, int]
    num_tokens: int  # N = prefix + patch tokens
    macs: int
    dense_macs: int  # the same model with every block dense and no scoring overhead
    embed_macs: int
    head_macs: int
    blocks: list[BlockCost] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return 2 * self.macs

    @property
    def gmacs(self) -> float:
        return self.macs / 1e9

    @property
    def ratio(self) -> float:
        """Cost relative to dense; 1 / ratio is the ideal (FLOP-bound) speed-up."""
        return self.macs / self.dense_macs


def _img_size(model: nn.Module, img_size: Optional[Union[int, Sequence[int]]]) -> tuple[int, int]:
    if img_size is None:
        img_size = model.patch_embed.img_size
    if isinstance(img_size, int):
        img_size = (img_size, img_size)
    h, w = int(img_size[0]), int(img_size[1])
    if h < 1 or w < 1:
        raise ValueError(f"img_size must be positive, got {h}x{w}")
    return h, w


def _linear_macs_per_token(module: nn.Module) -> int:
    """in x out of every Linear inside ``module`` except routers (priced separately)."""
    total = 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and not name.startswith("router"):
            total += m.in_features * m.out_features
    return total


def _attention_macs(tokens: int, attn: nn.Module) -> int:
    # QK^T and AV: each tokens x tokens x attn_dim
    return 2 * tokens * tokens * attn.num_heads * attn.head_dim


def _mod_block_macs(blk: MoDBlock, kept: int, num_tokens: int, num_patches: int) -> int:
    """An MoD block running on ``kept`` = p + k of ``num_tokens`` tokens, with its skipped-token mode.

    A-MoD's scores come from the attention's own softmax tiles at inference (amod.ops): no extra
    products. (In training, and in the CUDA kernel, QK^T is recomputed: not counted here.)
    """
    attn = blk.attn
    lin = _linear_macs_per_token(blk)
    if blk.amod_skipped == "kv" and kept < num_tokens:
        kv = 2 * attn.attn_dim * attn.qkv.in_features  # K and V projections per token
        macs = kept * (lin - kv) + num_tokens * kv + 2 * kept * num_tokens * attn.num_heads * attn.head_dim
    else:
        macs = kept * lin + _attention_macs(kept, attn)
    if blk.amod_skipped == "merge" and kept < num_tokens:
        k = kept - (num_tokens - num_patches)
        macs += (num_patches - k) * k * blk.norm1.normalized_shape[0]  # skipped x kept cosine similarities
    if isinstance(blk.router, StandardRouter):
        macs += num_patches * blk.router.proj.in_features  # every patch token is scored
    return macs


def _merge_block_macs(blk: nn.Module, tokens: int, r: int, num_prefix: int) -> tuple[int, int]:
    """(MACs, tokens after the merge) of a ToMe block: attention on ``tokens``, bipartite matching of
    the patch tokens on the keys' mean over heads, MLP on ``tokens - r``."""
    n = tokens - num_prefix
    r = min(r, n // 2)
    macs = tokens * _linear_macs_per_token(blk.attn) + _attention_macs(tokens, blk.attn)
    if r > 0:
        macs += ((n + 1) // 2) * (n // 2) * blk.attn.head_dim  # |A| x |B| cosine similarities
    return macs + (tokens - r) * _linear_macs_per_token(blk.mlp), tokens - r


def _fold_block_macs(blk: nn.Module, tokens: int, num_prefix: int) -> tuple[int, int]:
    """(MACs, tokens after the fold) of a FoldBlock: attention on ``tokens``; when it folds, the class
    tokens' attention rows again (the importance), the |A| x |B| key similarities, then the MLP on the
    tokens left."""
    n = tokens - num_prefix
    r = fold_count(blk.amod_capacity, n, blk.amod_protect) if blk.amod_fold else 0
    attn = blk.attn
    macs = tokens * _linear_macs_per_token(attn) + _attention_macs(tokens, attn)
    if r > 0:
        macs += max(1, attn.amod_num_prefix) * tokens * attn.attn_dim  # class-token rows of Q K^T
        macs += ((n + 1) // 2) * (n // 2) * attn.head_dim  # |A| x |B| cosine similarities
    return macs + (tokens - r) * _linear_macs_per_token(blk.mlp), tokens - r


def _sizes(model: nn.Module, img_size) -> tuple[tuple[int, int], int, int]:
    """((H, W), patch tokens, prefix tokens) at ``img_size``."""
    h, w = _img_size(model, img_size)
    ph, pw = model.patch_embed.patch_size
    if h % ph or w % pw:
        raise ValueError(f"img_size {(h, w)} is not a multiple of the patch size {(ph, pw)}")
    return (h, w), (h // ph) * (w // pw), model.num_prefix_tokens


def _embed_head_macs(model: nn.Module, num_patches: int) -> tuple[int, int]:
    heads = (getattr(model, "head", None), getattr(model, "head_dist", None))
    return (num_patches * model.patch_embed.proj.weight.numel(),
            sum(m.in_features * m.out_features for m in heads if isinstance(m, nn.Linear)))


def flops(model: nn.Module, img_size: Optional[Union[int, Sequence[int]]] = None) -> CostReport:
    """Analytic cost of one image through ``model`` (dense, MoD-converted or token-merging).

    Args:
        model: a timm ViT, converted or not.
        img_size: input size (int or (H, W)); defaults to the model's own.

    Returns:
        A ``CostReport``: ``.macs``, ``.flops``, ``.gmacs``, ``.ratio`` to dense, per-block costs
        (``tokens``: the tokens a block's attention runs on).
    """
    if not hasattr(model, "patch_embed") or not hasattr(model, "blocks"):
        raise TypeError(f"amod.flops expects a timm VisionTransformer, got {type(model).__name__}")
    from .merge import MergeBlock  # late import: merge imports cost's helpers through schedule_for_cost

    (h, w), n, p = _sizes(model, img_size)
    N = n + p
    embed, head = _embed_head_macs(model, n)
    blocks, dense = [], embed + head
    tokens = N  # falls in token-merging models
    for i, blk in enumerate(model.blocks):
        if isinstance(blk, MergeBlock):
            macs, after = _merge_block_macs(blk, tokens, blk.amod_merge_r, p)
            blocks.append(BlockCost(i, tokens, macs))
            tokens = after
        elif isinstance(blk, FoldBlock):
            macs, after = _fold_block_macs(blk, tokens, p)
            blocks.append(BlockCost(i, tokens, macs))
            tokens = after
        elif isinstance(blk, MoDBlock):
            kept = p + num_kept(blk.amod_capacity, n)
            blocks.append(BlockCost(i, kept, _mod_block_macs(blk, kept, N, n)))
        else:
            blocks.append(BlockCost(i, tokens, tokens * _linear_macs_per_token(blk) + _attention_macs(tokens, blk.attn)))
        dense += N * _linear_macs_per_token(blk) + _attention_macs(N, blk.attn)
    macs = embed + head + sum(b.macs for b in blocks)
    return CostReport((h, w), N, macs, dense, embed, head, blocks)


def merge_macs(model: nn.Module, schedule: Sequence[int], img_size=None) -> int:
    """Analytic MACs per image of the dense ``model`` if it merged ``schedule[i]`` tokens in block i."""
    _, n, p = _sizes(model, img_size)
    tokens = n + p
    total = sum(_embed_head_macs(model, n))
    for blk, r in zip(model.blocks, schedule):
        macs, tokens = _merge_block_macs(blk, tokens, r, p)
        total += macs
    return total


def capacity_for_cost(model: nn.Module, cost: float, img_size=None) -> float:
    """The capacity k / n at which the converted ``model`` costs closest to ``cost`` x dense.

    Tries every k from 1 to n (costs need shapes only); the model's own capacity is left unchanged.
    """
    from .convert import get_config, set_capacity

    cost = validate_cost(cost)
    config = get_config(model)
    _, n, _ = _sizes(model, img_size)
    # every capacity that gives a distinct k; a fold model's k changes block by block, so a fine grid
    candidates = [i / 1000 for i in range(1, 1001)] if config.skipped == "fold" else [k / n for k in range(1, n + 1)]
    original = config.capacity
    try:
        ratios = {}
        for c in candidates:
            set_capacity(model, c)
            ratios[c] = flops(model, img_size).ratio
    finally:
        set_capacity(model, original)
    return min(ratios, key=lambda c: (abs(ratios[c] - cost), -c))


def _cpu_sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def count_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of ``model(x)`` measured by ``torch.utils.flop_counter.FlopCounterMode``.

    Also counts PyTorch's fused CPU attention kernel, which the stock counter leaves out.
    """
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    with FlopCounterMode(display=False, custom_mapping={cpu_sdpa: _cpu_sdpa_flops}) as counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()


def isoflop_depth(model: nn.Module, mod_macs: int, img_size=None) -> int:
    """The number of dense blocks whose cost is closest to ``mod_macs``."""
    report = flops(model, img_size)
    per_block = (report.dense_macs - report.embed_macs - report.head_macs) / len(model.blocks)
    return max(1, round((mod_macs - report.embed_macs - report.head_macs) / per_block))


def kept_block_indices(depth: int, new_depth: int) -> list[int]:
    """Evenly spaced blocks from 0 to depth - 1 (first and last always kept)."""
    if new_depth == 1:
        return [0]
    return [int(i) for i in np.round(np.linspace(0, depth - 1, new_depth)).astype(int)]


def isoflop_baseline(
    name_or_model: Union[str, nn.Module],
    capacity: float,
    layers="alternate",
    router: str = "attention",
    pretrained: bool = False,
    img_size=None,
    **create_kwargs,
) -> nn.Module:
    """A dense timm ViT with fewer blocks that costs what the MoD model would.

    Depth: the number of dense blocks whose cost is closest to the MoD model's (same embedding and
    head). Weights: the kept blocks are evenly spaced over the original depth, the first and last
    always among them, so a pretrained model keeps its input and output stages. Warns when integer
    depth cannot match the cost within 5 % (small models).

    Args:
        name_or_model: a timm model name (created with ``pretrained`` and ``create_kwargs``) or a
            dense timm ViT (copied, not changed).
        capacity, layers, router: the MoD setup to match (as in ``amod.convert``).
        img_size: the input size at which costs are matched; defaults to the model's.
    """
    from .convert import convert  # late import: convert imports nothing from here, keep it that way

    if isinstance(name_or_model, str):
        dense = timm.create_model(name_or_model, pretrained=pretrained, **create_kwargs)
    else:
        if getattr(name_or_model, "amod_config", None) is not None:
            raise ValueError("isoflop_baseline needs the dense model, not a converted one")
        dense = copy.deepcopy(name_or_model)
    mod = convert(copy.deepcopy(dense), router=router, capacity=capacity, layers=layers)
    target = flops(mod, img_size).macs
    depth = len(dense.blocks)
    new_depth = min(depth, isoflop_depth(dense, target, img_size))
    keep = kept_block_indices(depth, new_depth)
    dense.blocks = nn.Sequential(*[dense.blocks[i] for i in keep])
    got = flops(dense, img_size).macs
    if abs(got - target) / target > 0.05:
        warnings.warn(
            f"isoFLOP baseline: {new_depth} dense blocks cost {got / target:.3f}x the MoD model; "
            "integer depth cannot match closer at this size", stacklevel=2)
    dense.amod_isoflop = {"kept_blocks": keep, "mod_macs": target, "macs": got}
    return dense
