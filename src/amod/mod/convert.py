"""Turn a Vision Transformer (or a DETR encoder) into a Mixture-of-Depths model, in place.

The model's family (``amod.families``) gives it amod's names, says what it refuses and converts it; for the ViT
pattern it hands the blocks to the skipped mode (``amod.mod.modes``), which says what they become.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Union

import torch
from torch import nn

from ..cost import closest_setting, flops, token_sizes, validate_cost
from ..family import family_of, weightless_copy
from ..methods import NEAR_TIE_GRID, Method, as_list, as_tuple, register_method, spec_value
from .block import RoutedForward
from .config import (LAYER_PRESETS, Layers, MoDConfig, resolve_layers, validate_capacity, validate_protect,
                     validate_router, validate_shape, validate_skipped)
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

# ---------------------------------------------------------------- the method

@register_method
@dataclass(frozen=True)
class MoD(Method):
    """Mixture-of-Depths: ``amod.convert`` with these arguments (and its defaults, ``MoDConfig``'s)."""

    kind: ClassVar[str] = "mod"
    setting_fields: ClassVar[tuple[str, ...]] = ("capacity",)
    metadata_key: ClassVar[Optional[str]] = "amod.mod"
    behaviour: ClassVar[int] = 2
    behaviour_changes: ClassVar[dict[int, str]] = {2: NEAR_TIE_GRID}
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (2, None)
    router: str = MoDConfig.router
    capacity: float = MoDConfig.capacity
    layers: Layers = None  # None: the skipped mode's default_layers ("all" for fold, "alternate" otherwise)
    scale_output: Optional[bool] = None  # None: the router's default_scale_output
    seed: int = MoDConfig.seed  # the router's seed (in a run: 0 leaves it to the run's --seed)
    skipped: str = MoDConfig.skipped
    protect: float = MoDConfig.protect  # fold only
    shape: Optional[tuple[float, ...]] = None  # fold only: one capacity exponent per block (``amod.calibrate``)

    def check(self) -> None:
        validate_router(self.router)
        validate_capacity(self.capacity)
        validate_skipped(self.skipped)
        validate_protect(self.protect)
        validate_shape(self.shape)  # (its length: when it converts a model)
        if isinstance(self.layers, str) and self.layers not in LAYER_PRESETS:
            raise UserError(f"mod: layers must be one of {', '.join(LAYER_PRESETS)} or a list of block indices, got "
                            f"{self.layers!r}")
        if self.skipped != "fold":  # fold's settings would be dropped without a word by another mode
            given = [f"{name}={spec_value(getattr(self, name))}" for name, default in
                     (("protect", MoDConfig.protect), ("shape", None)) if getattr(self, name) != default]
            if given:
                raise UserError(f"mod: {' and '.join(given)} set{'s' if len(given) == 1 else ''} what "
                                f"skipped=fold protects and folds; skipped={self.skipped} has neither: give "
                                "skipped=fold or drop it")

    def __repr__(self) -> str:
        # shape is named only when set: a plain MoD keeps the repr that finished measurements are keyed by
        shown = [f for f in dataclasses.fields(self) if f.name != "shape" or self.shape is not None]
        return f"MoD({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def seeded(self, seed: int) -> "MoD":
        return self if self.seed else dataclasses.replace(self, seed=seed)  # (0: the run's seed)

    def apply(self, model: nn.Module) -> nn.Module:
        layers = as_list(self.layers)
        return convert(model, router=self.router, capacity=self.capacity, layers=layers, scale_output=self.scale_output,
                       seed=self.seed, skipped=self.skipped, protect=self.protect, shape=as_list(self.shape))

    def label(self) -> str:
        return (f"{self.router}@{self.capacity:g}" + ("" if self.skipped == "bypass" else f" skipped={self.skipped}")
                + (" shaped" if self.shape is not None else ""))

    def setting_text(self) -> str:
        layers = blocks = as_list(self.layers)
        if isinstance(layers, list) and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
            layers = f"{layers[0]}–{layers[-1]}"
        text = f"C = {self.capacity:.3f}, blocks {layers}"
        if self.skipped != "bypass":
            text += f", skipped={self.skipped}"
        if self.skipped == "fold":
            text += f", protect {self.protect:g}" + ("" if self.router == "attention" else f" ({self.router})")
        shape = list(self.shape or [])
        if shape and 0 in shape and isinstance(blocks, list):  # a stage schedule: the blocks that reduce
            stages = [(block, w) for block, w in zip(blocks, shape) if w != 0]
            text += f", reduces in blocks {', '.join(str(block) for block, _ in stages)}"
            if any(w != 1 for _, w in stages):
                text += f", shape {stages[0][1]:.2f}…{stages[-1][1]:.2f}"
        elif shape:  # a calibrated schedule: the first and last blocks' exponents
            text += f", shape {shape[0]:.2f}…{shape[-1]:.2f}"
        return text

    def metadata(self) -> dict[str, str]:
        # the MoDConfig's JSON for a model's (resolved) method; None, a preset name where they are given
        return {self.metadata_key: json.dumps({f.name: as_list(getattr(self, f.name))
                                               for f in dataclasses.fields(self)}, sort_keys=True)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["MoD"]:
        data = cls.stored_settings(meta)
        if data is None:
            return None
        config = MoDConfig.from_dict(data)  # (refuses keys it does not know)
        if isinstance(config.layers, list) and isinstance(config.scale_output, bool):
            return cls._of_config(config)  # a model's: what every file holds
        return cls(**{k: as_tuple(v) for k, v in data.items()})  # a method's, as given (resolved when applied)

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["MoD"]:
        config = getattr(model, "amod_config", None)
        return None if config is None else cls._of_config(config)

    @classmethod
    def _of_config(cls, config: MoDConfig) -> "MoD":
        fields = {**dataclasses.asdict(config), "layers": tuple(config.layers), "shape": as_tuple(config.shape)}
        if fields["skipped"] != "fold":  # (amod.convert takes a protect for any mode; only fold reads it)
            fields["protect"] = MoDConfig.protect
        return cls(**fields)

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "MoD":
        # converted at full capacity (below a fold model's floor it would warn): the capacity is searched for
        model = dataclasses.replace(self, capacity=1.0).apply(weightless_copy(dense))
        return dataclasses.replace(MoD.of_model(model), capacity=capacity_for_cost(model, cost))
