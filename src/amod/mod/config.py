"""The Mixture-of-Depths configuration that travels with a converted model and its checkpoints."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..static import StaticNumbers
from .modes import skipped_mode, skipped_mode_names
from .routers import ROUTER_CLASSES, router_class
from ..errors import UserError

# a method's layers: a preset's name or block indices (None: the skipped mode's default)
Layers = Optional[Union[str, list[int], tuple[int, ...]]]

LAYER_PRESETS = ("alternate", "later", "last-two-thirds", "all")


@dataclass
class MoDConfig(StaticNumbers):
    """How a ViT was converted to Mixture-of-Depths.

    Stored on the converted model (``model.amod_config``) and inside every checkpoint. A forward reads its numbers
    with ``static(name)`` (``amod.static``: a changed capacity recompiles a compiled model quickly).

    Its defaults are amod's MoD defaults, stated here alone: ``amod.convert``'s arguments, the ``MoD`` and ``IsoFLOP``
    methods' fields, ``RunConfig``'s fields and the CLI's flags read them from this class (``MoDConfig.capacity``).
    """

    router: str = "attention"  # which router ranks tokens: one of ROUTERS
    capacity: float = 0.5  # share C of patch tokens each MoD block processes: k = ceil(C * N_patches)
    layers: list[int] = field(default_factory=list)  # resolved indices of the MoD blocks
    scale_output: bool = False  # multiply a processed token's block output by its router gate
    seed: int = 0  # seed of the random router (ignored by the others)
    skipped: str = "bypass"  # what skipped tokens do: one of SKIPPED_MODES
    protect: float = 0.25  # fold only: share of patch tokens the router protects in a fold block
    # fold only: one exponent per block; block i keeps the share capacity ** shape[i] of its patch tokens
    # (None: every exponent 1, the same share in every block). ``amod.calibrate`` chooses it.
    shape: Optional[list[float]] = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MoDConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"unknown MoD config keys {sorted(unknown)}; known keys: {sorted(known)}")
        return cls(**data)


def __getattr__(name: str) -> tuple[str, ...]:
    """``ROUTERS`` and ``SKIPPED_MODES``: the names in the registries (``amod.mod.routers``, ``amod.mod.modes``),
    read when asked, so a router or mode registered later is among them."""
    if name == "ROUTERS":
        return tuple(ROUTER_CLASSES)
    if name == "SKIPPED_MODES":
        return skipped_mode_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def validate_capacity(capacity: Any) -> float:
    """Return ``capacity`` as a float, or raise a ValueError that says what is allowed."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)):
        raise UserError(f"capacity must be a number in (0, 1], got {capacity!r}")
    capacity = float(capacity)
    if math.isnan(capacity) or not 0.0 < capacity <= 1.0:
        raise UserError(f"capacity must be in (0, 1] (the share of patch tokens processed), got {capacity}")
    return capacity


def validate_router(router: Any) -> str:
    router_class(router)  # raises for a name not registered
    return router


def validate_skipped(skipped: Any) -> str:
    skipped_mode(skipped)  # raises for a name not registered
    return skipped


def validate_protect(protect: Any) -> float:
    """Return ``protect`` (a share of patch tokens) as a float in [0, 1), or raise a ValueError."""
    if isinstance(protect, bool) or not isinstance(protect, (int, float)) or math.isnan(protect) \
            or not 0.0 <= protect < 1.0:
        raise UserError(f"protect must be a number in [0, 1) (the share of patch tokens a fold block's router "
                        f"protects), got {protect!r}")
    return float(protect)


# The largest capacity exponent of a fold block that changes anything. amod sets capacities on a grid of 0.001 steps
# (``capacity_for_cost``), the largest below 1 being 0.999, and a fold block of t patch tokens removes at most
# (t + 1) // 2 of them (``fold.fold_count``), all it can once it keeps a share of at most 1/3 (t = 3 needs the most):
# 0.999 ** 1100 = 0.333, so from this exponent on a block folds all it can at every capacity of the grid below 1 (and
# nothing at 1), and a larger one changes nothing. (``amod.calibrate``'s exponents average 1.)
MAX_SHAPE_EXPONENT = 1100


def validate_shape(shape: Any, depth: Optional[int] = None) -> Optional[list[float]]:
    """Return ``shape`` (one capacity exponent per block, or None) as a list of floats, or raise a ValueError saying
    what is allowed: numbers in [0, ``MAX_SHAPE_EXPONENT``], ``depth`` of them (None: the model is not known yet, as
    when a method is made; its length is checked when it converts one)."""
    if shape is None:
        return None
    blocks = "" if depth is None else f"{depth} "
    try:
        values = list(shape)
    except TypeError:
        raise UserError(f"shape must be a list of {blocks}numbers (one capacity exponent per block), "
                        f"got {shape!r}") from None
    if (depth is not None and len(values) != depth) or not values or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not 0 <= v <= MAX_SHAPE_EXPONENT for v in values):
        raise UserError(f"shape must be {blocks}finite numbers >= 0 and at most {MAX_SHAPE_EXPONENT} (one capacity "
                        f"exponent per block{'' if depth is None else ' of this model'}: block i keeps capacity ** "
                        f"shape[i] of its patch tokens, and beyond {MAX_SHAPE_EXPONENT} nothing changes), got "
                        f"{shape!r}")
    return [float(v) for v in values]


def resolve_layers(layers: Any, depth: int, router: str, own_attention: bool = False) -> list[int]:
    """Turn a layer spec into a sorted list of block indices.

    Args:
        layers: ``"alternate"`` (blocks 1, 3, 5, ...), ``"later"`` (the alternate blocks in the second
            half of the network), ``"last-two-thirds"`` (every block from depth // 3 on), ``"all"`` or an explicit sequence of block indices.
        depth: number of blocks in the model.
        router: the router; an attention router cannot sit on block 0, which has no previous attention,
            unless ``own_attention`` (fold blocks route on the attention they have just computed).
    """
    if isinstance(layers, str):
        if layers == "alternate":
            indices = list(range(1, depth, 2))
        elif layers == "later":
            indices = [i for i in range(1, depth, 2) if i >= depth // 2]
        elif layers == "last-two-thirds":  # every block from depth // 3 on (block 0 never)
            indices = list(range(max(1, depth // 3), depth))
        elif layers == "all":
            indices = list(range(depth))
        else:
            raise UserError(
                f"unknown layers preset {layers!r}; use one of {', '.join(LAYER_PRESETS)} or a list of block indices"
            )
    else:
        try:
            indices = list(layers)
        except TypeError:
            raise UserError(
                f"layers must be one of {', '.join(LAYER_PRESETS)} or a list of block indices, got {layers!r}"
            ) from None
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int):
                raise UserError(f"layer indices must be integers, got {i!r}")
            if not 0 <= i < depth:
                raise UserError(f"layer index {i} is out of range: the model has blocks 0..{depth - 1}")
        if len(set(indices)) != len(indices):
            raise UserError(f"layer indices must be unique, got {indices}")
        indices = sorted(indices)
    if not indices:
        raise UserError(f"layers {layers!r} selects no block in a model of depth {depth}")
    if router_class(router).needs_attention and indices[0] == 0 and not own_attention:
        raise UserError(
            f"the {router} router cannot route block 0: it reads the attention of the previous block, "
            "and block 0 has none; start at block 1 or later"
        )
    return indices
