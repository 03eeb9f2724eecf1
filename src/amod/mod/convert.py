"""Turn a timm Vision Transformer into a Mixture-of-Depths model, in place.

A policy registry maps supported model classes to a converter, so a new family is one function; the
converter hands the blocks to the skipped mode (``amod.mod.modes``), which says what they become.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence, Union

from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..cost import flops, token_sizes, validate_cost
from ..hf import is_detr_model, policy as hf_policy
from .block import MoDBlock
from .config import (DEFAULT_PROTECT, MoDConfig, resolve_layers, validate_capacity, validate_protect, validate_router,
                     validate_skipped)
from .fold import FoldBlock
from .modes import skipped_mode
from .routers import router_class

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
    """Whether ``router`` scales block outputs by its gate unless told (the standard router: that is how it
    learns): its class's ``default_scale_output``."""
    return router_class(router).default_scale_output


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
        model: a timm ``VisionTransformer`` (vit_*, deit_* incl. distilled, deit3_*, *_reg*, *_dinov2), a Hugging
            Face ViT/DeiT/DINOv2 (``amod.hf``) or DETR (its encoder; ``amod.detr.convert``, bypass only, routers
            attention, standard, random and feature-norm).
        router: ``"attention"`` (A-MoD, parameter-free), ``"standard"`` (learned linear), or one of the
            controls: ``"random"`` (a random subset), ``"shuffled-attention"`` (A-MoD's scores permuted
            among the patch tokens), ``"inverse-attention"`` (the tokens A-MoD would skip).
        capacity: share C in (0, 1] of patch tokens each MoD block processes; k = ceil(C * N_patches)
            (``"fold"``: of the patch tokens the block gets, which fall from block to block).
        layers: ``"alternate"`` (blocks 1, 3, 5, ...), ``"later"`` (alternate blocks in the second
            half), ``"all"`` or a list of block indices; default: the skipped mode's ``default_layers``
            (``"all"`` for ``skipped="fold"``, ``"alternate"`` for the others).
        scale_output: multiply processed tokens' block updates by their router gate; default True for
            the standard router, False for the others.
        seed: seed of the routers that draw random numbers (random, shuffled-attention).
        skipped: what the tokens an MoD block skips do there. ``"bypass"``: copied through unchanged
            (the paper's MoD). ``"merge"``: each is averaged into its most similar kept token
            (cosine after the block's first norm; proportional attention on the group sizes) and takes that
            token's block update, so no token's information leaves the block. ``"kv"``: they serve as
            keys and values for the processed tokens (K/V projections for every token) and are not
            updated. ``"fold"``: they fold for good into the kept tokens, which carry them through every
            later block (``amod.mod.fold``); the router protects its top ``protect`` share of tokens and the
            most redundant of the rest fold.
        protect: ``"fold"`` only: share in [0, 1) of a fold block's patch tokens the router protects.
    """
    if is_detr_model(model):  # MoD on a DETR's encoder positions (amod.detr.convert)
        from ..detr.convert import convert_detr
        return convert_detr(model, router=router, capacity=capacity, layers=layers, scale_output=scale_output,
                            seed=seed, skipped=skipped)
    router = validate_router(router)
    mode = skipped_mode(validate_skipped(skipped))
    capacity = validate_capacity(capacity)
    protect = validate_protect(protect)
    if scale_output is None:
        scale_output = default_scale_output(router)
    if not isinstance(scale_output, bool):
        raise ValueError(f"scale_output must be True, False or None, got {scale_output!r}")
    if getattr(model, "amod_config", None) is not None:
        raise ValueError("model is already converted; use amod.set_capacity to change its capacity")
    # a Hugging Face ViT/DeiT/DINOv2: amod.hf's converter (which gives the model timm's names first); others: None
    policy = hf_policy(model) or _find_policy(model)
    depth = len(getattr(model, "blocks", ()))
    if layers is None:
        layers = mode.default_layers
    config = MoDConfig(router=router, capacity=capacity,
                       layers=resolve_layers(layers, depth, router, own_attention=mode.own_attention),
                       scale_output=scale_output, seed=int(seed), skipped=skipped, protect=protect)
    mode.validate(config, model)
    policy(model, config)
    model.amod_config = config
    _warn_below_lowest(model, capacity)
    return model


@register_policy(VisionTransformer)
def _convert_vision_transformer(model: nn.Module, config: MoDConfig) -> None:
    """timm's ViT: its ``blocks`` become what the skipped mode makes of them (MoD blocks, fold blocks)."""
    skipped_mode(config.skipped).convert(model, config)


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


def lowest_capacity(model: nn.Module, img_size=None) -> float:
    """The lowest capacity that still changes the converted ``model`` at ``img_size`` (default its own):
    every capacity below it gives the same tokens and cost as it does.

    An MoD block keeps at least one patch token: 1 / n for n patch tokens. A fold block removes at most
    the tokens the bipartite matching can pair (about half its patch tokens, less the protected share;
    ``fold.fold_count``), so a fold model's floor is about 0.5 + protect: the largest capacity, on a
    grid of 0.001 steps, whose tokens block by block are those of the lowest capacity. (The skipped
    mode's ``lowest_capacity``.)
    """
    config = get_config(model)
    _, n, _ = token_sizes(model, img_size)
    return skipped_mode(config.skipped).lowest_capacity(model, n)


def _warn_below_lowest(model: nn.Module, capacity: float) -> None:
    """Warn when the model is set below its lowest capacity, where that would otherwise be silently raised
    (a fold model; the skipped mode's ``below_floor_warning`` says it)."""
    message = skipped_mode(get_config(model).skipped).below_floor_warning(model, capacity)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)


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
    candidates = skipped_mode(config.skipped).capacity_candidates(model, n)
    ratios = {c: flops(model, img_size, capacity=c).ratio for c in candidates}
    return min(ratios, key=lambda c: (abs(ratios[c] - cost), -c))
