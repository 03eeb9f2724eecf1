"""Turn a Vision Transformer (or a DETR encoder) into a Mixture-of-Depths model, in place.

The model's family (``amod.families``) gives it amod's names, says what it refuses and converts it; for the ViT
pattern it hands the blocks to the skipped mode (``amod.mod.modes``), which says what they become.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Union

from torch import nn

from ..cost import closest_setting, flops, token_sizes, validate_cost
from ..family import family_of
from .block import RoutedForward
from .config import (MoDConfig, resolve_layers, validate_capacity, validate_protect, validate_router, validate_shape,
                     validate_skipped)
from .fold import FoldBlock
from .modes import skipped_mode
from .routers import router_class
from ..errors import UserError

LayersSpec = Union[str, Sequence[int]]
# the layers of a conversion in the default skipped mode (``"alternate"``), which an isoFLOP baseline matches by default
DEFAULT_LAYERS = skipped_mode(MoDConfig.skipped).default_layers


def default_scale_output(router: str) -> bool:
    """Whether ``router`` scales block outputs by its gate unless told (the standard router: that is how it
    learns): its class's ``default_scale_output``."""
    return router_class(router).default_scale_output


def convert(
    model: nn.Module,
    router: str = MoDConfig.router,
    capacity: float = MoDConfig.capacity,
    layers: Optional[LayersSpec] = None,
    scale_output: Optional[bool] = None,
    seed: int = MoDConfig.seed,
    skipped: str = MoDConfig.skipped,
    protect: float = MoDConfig.protect,
    shape: Optional[Sequence[float]] = None,
) -> nn.Module:
    """Convert a timm ViT into a Mixture-of-Depths model, in place; returns the same model.

    Weights and state_dict keys stay as they were (the learned routers add ``blocks.i.router.*``). The defaults are
    ``MoDConfig``'s.

    Args:
        model: a model of a registered family (``amod.families``): a timm ``VisionTransformer`` (vit_*, deit_*
            incl. distilled, deit3_*, *_reg*, *_dinov2), a Hugging Face ViT/DeiT/DINOv2, CLIP or SigLIP vision model,
            or a DETR (its encoder; bypass only, routers attention, standard, random and feature-norm).
        router: ``"attention"`` (A-MoD, parameter-free), ``"standard"`` (learned linear), ``"hybrid"`` (A-MoD's
            scores times exp of a learned linear correction that starts at zero: A-MoD exactly until trained), or one
            of the controls: ``"random"`` (a random subset), ``"shuffled-attention"`` (A-MoD's scores permuted
            among the patch tokens), ``"inverse-attention"`` (the tokens A-MoD would skip).
        capacity: share C in (0, 1] of patch tokens each MoD block processes; k = ceil(C * N_patches)
            (``"fold"``: of the patch tokens the block gets, which fall from block to block).
        layers: ``"alternate"`` (blocks 1, 3, 5, ...), ``"later"`` (alternate blocks in the second
            half), ``"last-two-thirds"`` (every block from depth // 3 on), ``"all"`` or a list of block indices; default: the skipped mode's ``default_layers``
            (``"all"`` for ``skipped="fold"``, ``"alternate"`` for the others).
        scale_output: multiply processed tokens' block updates by their router gate; default True for
            the standard router, False for the others (the hybrid router included: A-MoD's default).
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
        shape: ``"fold"`` only: one exponent w_i >= 0 per block; block i keeps the share ``capacity ** w_i`` of
            its patch tokens (default: every w_i = 1). ``amod.calibrate`` chooses one on unlabeled images.
    """
    family = family_of(model)  # (a model no family claims: a TypeError naming what amod takes)
    router = validate_router(router)
    mode = skipped_mode(validate_skipped(skipped))
    capacity = validate_capacity(capacity)
    protect = validate_protect(protect)
    if scale_output is None:
        scale_output = default_scale_output(router)
    if not isinstance(scale_output, bool):
        raise UserError(f"scale_output must be True, False or None, got {scale_output!r}")
    if getattr(model, "amod_config", None) is not None:
        raise UserError("model is already converted; use amod.set_capacity to change its capacity")
    allowed = router_class(router).families
    if allowed is not None and family.name not in allowed:
        raise UserError(f"router={router!r} routes {' and '.join(allowed)} models only "
                        f"({router_class(router).families_why}); this is a {family.name} model")
    if shape is not None and skipped != "fold":
        raise UserError(f"shape bends the token schedule of skipped='fold'; skipped={skipped!r} has none")
    family.prepare(model)  # (views only: ``blocks`` for a Hugging Face model)
    shape = validate_shape(shape, family.layers_count(model))
    if layers is None:
        layers = mode.default_layers
    config = MoDConfig(router=router, capacity=capacity,
                       layers=resolve_layers(layers, family.layers_count(model), router,
                                             own_attention=mode.own_attention),
                       scale_output=scale_output, seed=int(seed), skipped=skipped, protect=protect, shape=shape)
    family.validate(config, model)
    mode.validate(config, model)
    family.convert(model, config)
    model.amod_config = config
    _warn_below_lowest(model, capacity)
    return model


def get_config(model: nn.Module) -> MoDConfig:
    """The ``MoDConfig`` of a converted model; raises if the model was not converted."""
    config = getattr(model, "amod_config", None)
    if config is None:
        raise UserError("model is not an amod MoD model; convert it with amod.convert first")
    return config


def mod_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, block) for every MoD block of a converted model (the folding blocks of a fold model)."""
    return [(i, b) for i, b in enumerate(model.blocks)
            if isinstance(b, RoutedForward) or (isinstance(b, FoldBlock) and b.amod.fold)]


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
        if not isinstance(blk, RoutedForward):
            raise UserError("recording kept indices is for MoD blocks; a fold model's tokens change identity as "
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
    # the largest first: of two capacities equally close, the larger
    return closest_setting(cost, sorted(set(candidates), reverse=True),
                           lambda c: flops(model, img_size, capacity=c).ratio)[0]
