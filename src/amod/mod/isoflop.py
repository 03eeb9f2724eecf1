"""The isoFLOP baseline of an MoD setup: a dense ViT with fewer blocks that costs what the MoD model would."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import numpy as np
import timm
from torch import nn

from ..cost import flops
from ..family import family_of
from .config import Layers, MoDConfig
from ..methods import Method, as_list, as_tuple, register_method
from .convert import DEFAULT_LAYERS, convert
from ..errors import UserError


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
    layers=DEFAULT_LAYERS,
    router: str = MoDConfig.router,
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

    Returns:
        the baseline, whose ``amod_isoflop`` holds ``kept_blocks``, the MoD model's MACs (``mod_macs``), its own
        (``macs``) and the dense model's it was cut from (``dense_macs``: ``flops(baseline).ratio`` is 1, a share of
        its own dense MACs; ``macs / dense_macs`` is its share of the model it replaces).
    """
    if isinstance(name_or_model, str):
        dense = timm.create_model(name_or_model, pretrained=pretrained, **create_kwargs)
    else:
        if getattr(name_or_model, "amod_config", None) is not None:
            raise UserError("isoflop_baseline needs the dense model, not a converted one")
        dense = copy.deepcopy(name_or_model)
    mod = convert(copy.deepcopy(dense), router=router, capacity=capacity, layers=layers)
    target = flops(mod, img_size).macs
    dense_macs = flops(dense, img_size).macs  # what the baseline is the baseline of (the model it is cut from)
    depth = len(dense.blocks)
    new_depth = min(depth, isoflop_depth(dense, target, img_size))
    keep = kept_block_indices(depth, new_depth)
    family_of(dense).keep_blocks(dense, keep)
    got = flops(dense, img_size).macs
    if abs(got - target) / target > 0.05:
        warnings.warn(
            f"isoFLOP baseline: {new_depth} dense blocks cost {got / target:.3f}x the MoD model; "
            "integer depth cannot match closer at this size", stacklevel=2)
    # the MoD setup it matches (``IsoFLOP.of_model``, below, reads it; a loaded file has only these) and the match
    dense.amod_isoflop = {"router": router, "capacity": capacity, "layers": layers if isinstance(layers, str) else
                          list(layers), "kept_blocks": keep, "mod_macs": target, "macs": got, "dense_macs": dense_macs}
    return dense

# ---------------------------------------------------------------- the method

@register_method
@dataclass(frozen=True)
class IsoFLOP(Method):
    """The dense baseline of an MoD setup: fewer blocks, the MoD model's cost (``amod.isoflop_baseline``). A file of
    one is a dense model of the fewer blocks (its description) with this method's metadata, which marks it."""

    kind: ClassVar[str] = "isoflop"
    metadata_key: ClassVar[Optional[str]] = "amod.isoflop"
    router: str = MoDConfig.router
    capacity: float = MoDConfig.capacity
    layers: Layers = DEFAULT_LAYERS  # the default MoD setup's ("alternate")

    def apply(self, model: nn.Module) -> nn.Module:
        layers = as_list(self.layers)
        return isoflop_baseline(model, self.capacity, layers=layers or DEFAULT_LAYERS, router=self.router)

    def restore(self, model: nn.Module) -> nn.Module:
        # the file's description is of the fewer blocks already: marked, not cut again
        model.amod_isoflop = {"router": self.router, "capacity": self.capacity, "layers": as_list(self.layers)}
        return model

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["IsoFLOP"]:
        setup = getattr(model, "amod_isoflop", None)
        if setup is None or "router" not in setup:
            return None
        return cls(router=setup["router"], capacity=setup["capacity"], layers=as_tuple(setup["layers"]))

    def label(self) -> str:
        return f"isoflop@{self.capacity:g}"

    def setting_text(self) -> str:
        return f"isoFLOP of C = {self.capacity:.3f}, blocks {as_list(self.layers)}"
