"""Turn a timm Vision Transformer into a Mixture-of-Depths model, in place.

A policy registry maps supported model classes to a converter, so a new family is one function.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence, Union

from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..cost import flops, token_sizes, validate_cost
from ..tokens import MergeState
from .block import MoDBlock, MoDSettings, ScoreHandoff, ScoringAttention
from .config import (DEFAULT_PROTECT, MoDConfig, resolve_layers, validate_capacity, validate_protect, validate_router,
                     validate_skipped)
from .fold import FoldAttention, FoldBlock, FoldSettings, fold_count
from .routers import ROUTER_CLASSES, build_router

LayersSpec = Union[str, Sequence[int]]

# model class -> function(model, config) that converts it in place
POLICIES: dict[type, Callable[[nn.Module, MoDConfig], None]] = {}


def register_policy(cls: type) -> Callable:
    """Decorator: register a converter for ``cls`` (and its subclasses)."""

    def wrap(fn: Callable[[nn.Module, MoDConfig], None]) -> Callable[[nn.Module, MoDConfig], None]:
        POLICIES[cls] = fn
        return fn

    return wrap


def _find_policy(model: nn.Module) -> Callable[[nn.Module, MoDConfig], None]:
    for cls in type(model).__mro__:
        if cls in POLICIES:
            return POLICIES[cls]
    supported = ", ".join(sorted(c.__name__ for c in POLICIES))
    raise TypeError(
        f"amod cannot convert {type(model).__name__}: supported model classes are {supported} "
        "(timm's vit_*, deit_*, deit3_*, *_reg*, *_dinov2 models)"
    )


def default_scale_output(router: str) -> bool:
    """The standard router scales block outputs by its gate (that is how it learns); the others do not."""
    return router == "standard"


def convert(
    model: nn.Module,
    router: str = "attention",
    capacity: float = 0.5,
    layers: Optional[LayersSpec] = None,
    scale_output: Optional[bool] = None,
    seed: int = 0,
    skipped: str = "bypass",
    protect: float = DEFAULT_PROTECT,
) -> nn.Module:
    """Convert a timm ViT into a Mixture-of-Depths model, in place; returns the same model.

    Weights and state_dict keys stay as they were (the standard router adds ``blocks.i.router.*``).

    Args:
        model: a timm ``VisionTransformer`` (vit_*, deit_* incl. distilled, deit3_*, *_reg*, *_dinov2).
        router: ``"attention"`` (A-MoD, parameter-free), ``"standard"`` (learned linear) or ``"random"``.
        capacity: share C in (0, 1] of patch tokens each MoD block processes; k = ceil(C * N_patches)
            (``"fold"``: of the patch tokens the block gets, which fall from block to block).
        layers: ``"alternate"`` (blocks 1, 3, 5, ...), ``"later"`` (alternate blocks in the second
            half), ``"all"`` or a list of block indices; default ``"all"`` for ``skipped="fold"``,
            ``"alternate"`` otherwise.
        scale_output: multiply processed tokens' block updates by their router gate; default True for
            the standard router, False for the others.
        seed: seed of the random router.
        skipped: what the tokens an MoD block skips do there. ``"bypass"``: copied through unchanged
            (the paper's MoD). ``"merge"``: each is averaged into its most similar kept token
            (cosine after the block's first norm; proportional attention on the group sizes) and takes that
            token's block update, so no token's information leaves the block. ``"kv"``: they serve as
            keys and values for the processed tokens (K/V projections for every token) and are not
            updated. ``"fold"``: they fold for good into the kept tokens, which carry them through every
            later block (``amod.fold``); the router protects its top ``protect`` share of tokens and the
            most redundant of the rest fold.
        protect: ``"fold"`` only: share in [0, 1) of a fold block's patch tokens the router protects.
    """
    router = validate_router(router)
    skipped = validate_skipped(skipped)
    capacity = validate_capacity(capacity)
    protect = validate_protect(protect)
    if scale_output is None:
        scale_output = default_scale_output(router)
    if not isinstance(scale_output, bool):
        raise ValueError(f"scale_output must be True, False or None, got {scale_output!r}")
    if skipped == "fold" and (ROUTER_CLASSES[router].learnable or scale_output):
        raise ValueError("skipped='fold' routes with a parameter-free router and no output scaling; use "
                         "router='attention' (or a control router) and scale_output=False")
    if getattr(model, "amod_config", None) is not None:
        raise ValueError("model is already converted; use amod.set_capacity to change its capacity")
    policy = _find_policy(model)
    depth = len(getattr(model, "blocks", ()))
    if layers is None:
        layers = "all" if skipped == "fold" else "alternate"
    config = MoDConfig(router=router, capacity=capacity,
                       layers=resolve_layers(layers, depth, router, own_attention=skipped == "fold"),
                       scale_output=scale_output, seed=int(seed), skipped=skipped, protect=protect)
    policy(model, config)
    model.amod_config = config
    _warn_below_lowest(model, capacity)
    return model


@register_policy(VisionTransformer)
def _convert_vision_transformer(model: nn.Module, config: MoDConfig) -> None:
    blocks = model.blocks
    if config.skipped == "fold":
        return _convert_fold(model, config)
    for i in config.layers:
        _check_block(blocks[i], i)
    router_needs_attention = ROUTER_CLASSES[config.router].needs_attention
    consecutive = [i for i in config.layers if i - 1 in config.layers]
    if config.skipped == "kv" and router_needs_attention and consecutive:
        raise ValueError(
            f"skipped='kv' cannot score attention for the next block (blocks {consecutive[0] - 1} and {consecutive[0]} "
            "are both MoD blocks); use layers with a dense block before each MoD block, e.g. 'alternate'")
    for i in config.layers:
        blk = blocks[i]
        blk.__class__ = MoDBlock
        dim = blk.norm1.normalized_shape[0] if hasattr(blk.norm1, "normalized_shape") else blk.attn.qkv.in_features
        blk.router = build_router(config.router, dim, seed=config.seed + i)
        blk.router.to(device=blk.attn.qkv.weight.device, dtype=blk.attn.qkv.weight.dtype)
        blk.amod = MoDSettings(config=config, num_prefix=model.num_prefix_tokens)
    if router_needs_attention:
        for i in config.layers:
            _check_block(blocks[i - 1], i - 1)
            handoff = ScoreHandoff()
            prev = blocks[i - 1]
            prev.attn.__class__ = ScoringAttention
            prev.attn.amod_handoff = handoff
            # Gradients through the scores are only needed when they scale the output.
            prev.attn.amod_scores_need_grad = config.scale_output
            if isinstance(prev, MoDBlock):
                prev.amod.out_handoff = handoff
                prev.attn.amod_relayed = True
            blocks[i].amod.in_handoff = handoff


def _convert_fold(model: nn.Module, config: MoDConfig) -> None:
    """Every block becomes a FoldBlock (all of them apply the proportional-attention bias once tokens have
    folded); the blocks in ``config.layers`` fold."""
    for i, blk in enumerate(model.blocks):
        _check_block(blk, i)
    state = MergeState()
    class_tokens = model.num_prefix_tokens - getattr(model, "num_reg_tokens", 0)  # CLS (and distillation)
    for i, blk in enumerate(model.blocks):
        blk.__class__ = FoldBlock
        blk.attn.__class__ = FoldAttention
        blk.attn.amod_want = False
        blk.attn.amod_metric = blk.attn.amod_importance = None
        blk.attn.amod_num_prefix = class_tokens
        blk.router = build_router(config.router, blk.attn.qkv.in_features, seed=config.seed + i)
        blk.amod = FoldSettings(config=config, num_prefix=model.num_prefix_tokens, fold=i in config.layers,
                                state=state, first=i == 0)


def _check_block(blk: nn.Module, index: int) -> None:
    if type(blk) not in (Block, MoDBlock):
        raise TypeError(
            f"block {index} is a {type(blk).__name__}; amod converts timm's pre-norm "
            "timm.models.vision_transformer.Block only"
        )
    if type(blk.attn) not in (Attention, ScoringAttention):
        raise TypeError(
            f"block {index} uses {type(blk.attn).__name__}; amod supports timm.layers.Attention only"
        )


def get_config(model: nn.Module) -> MoDConfig:
    """The ``MoDConfig`` of a converted model; raises if the model was not converted."""
    config = getattr(model, "amod_config", None)
    if config is None:
        raise ValueError("model is not an amod MoD model; convert it with amod.convert first")
    return config


def mod_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, block) for every MoD block of a converted model (the folding blocks of a fold model)."""
    return [(i, b) for i, b in enumerate(model.blocks)
            if isinstance(b, MoDBlock) or (isinstance(b, FoldBlock) and b.amod.fold)]


def set_capacity(model: nn.Module, capacity: float) -> nn.Module:
    """Change the capacity of every MoD block of a converted model, in place (inference or training).

    The blocks read the model's ``MoDConfig``, so this is one assignment.
    """
    get_config(model).capacity = validate_capacity(capacity)
    _warn_below_lowest(model, capacity)
    return model


def set_recording(model: nn.Module, enabled: bool = True) -> None:
    """Keep each MoD block's kept patch indices of the last forward in ``block.amod_last_index``."""
    for _, blk in mod_blocks(model):
        if not isinstance(blk, MoDBlock):
            raise ValueError("recording kept indices is for MoD blocks; a fold model's tokens change identity as "
                             "they fold (see amod_last_tokens)")
        blk.amod.record = enabled
        if not enabled:
            blk.__dict__.pop("amod_last_index", None)


def _fold_schedule(model: nn.Module, num_patches: int, capacity: float) -> tuple[int, ...]:
    """Patch tokens left after each block of a fold model at ``capacity`` (what ``FoldBlock`` removes)."""
    protect, t, left = get_config(model).protect, num_patches, []
    for blk in model.blocks:
        if isinstance(blk, FoldBlock) and blk.amod.fold:
            t -= fold_count(capacity, t, protect)
        left.append(t)
    return tuple(left)


def lowest_capacity(model: nn.Module, img_size=None) -> float:
    """The lowest capacity that still changes the converted ``model`` at ``img_size`` (default its own):
    every capacity below it gives the same tokens and cost as it does.

    An MoD block keeps at least one patch token: 1 / n for n patch tokens. A fold block removes at most
    the tokens the bipartite matching can pair (about half its patch tokens, less the protected share;
    ``fold.fold_count``), so a fold model's floor is about 0.5 + protect: the largest capacity, on a
    grid of 0.001 steps, whose tokens block by block are those of the lowest capacity.
    """
    config = get_config(model)
    _, n, _ = token_sizes(model, img_size)
    if config.skipped != "fold":
        return 1 / n
    floor = _fold_schedule(model, n, 0.001)
    lowest = 0.001
    for i in range(2, 1001):  # the schedule only grows with the capacity: the first change ends the floor
        if _fold_schedule(model, n, i / 1000) != floor:
            break
        lowest = i / 1000
    return lowest


def _warn_below_lowest(model: nn.Module, capacity: float) -> None:
    """Warn when a fold model is set below its lowest capacity, which would otherwise be silently raised."""
    config = get_config(model)
    if config.skipped != "fold" or capacity >= 1.0:
        return
    lowest = lowest_capacity(model)
    if capacity < lowest:
        h, w = model.patch_embed.img_size
        warnings.warn(
            f"skipped='fold' cannot go below capacity {lowest:g} on this model at {h}x{w} px "
            f"({flops(model, capacity=lowest).ratio:.3f} of the dense MACs): a fold block removes at most the tokens "
            f"the bipartite matching can pair, about half of its patch tokens less the {config.protect:.0%} it "
            f"protects, so capacity {capacity:g} runs as {lowest:g} does"
            + (" (a lower protect goes further)" if config.protect > 0 else ""), UserWarning, stacklevel=3)


def capacity_for_cost(model: nn.Module, cost: float, img_size=None) -> float:
    """The capacity at which the converted ``model`` costs closest to ``cost`` x dense (the model is not changed).

    Tries every capacity that gives a distinct k (k / n for k = 1..n); a fold model's k changes block
    by block, so a grid of 0.001 steps from its floor (``lowest_capacity``) up. Ties go to the larger
    capacity. A cost below what the lowest capacity costs gets that capacity: its cost shows the miss
    (a fold model's floor is about 0.5 + protect, a kv model's is the K/V projections of every token).
    """
    cost = validate_cost(cost)
    config = get_config(model)
    _, n, _ = token_sizes(model, img_size)
    if config.skipped == "fold":
        lowest = round(lowest_capacity(model, img_size) * 1000)
        candidates = [i / 1000 for i in range(lowest, 1001)]
    else:
        candidates = [k / n for k in range(1, n + 1)]
    ratios = {c: flops(model, img_size, capacity=c).ratio for c in candidates}
    return min(ratios, key=lambda c: (abs(ratios[c] - cost), -c))
