"""The method a model runs: dense, Mixture-of-Depths, the isoFLOP dense baseline of an MoD setup, or
token merging.

One class per method knows how to turn a dense timm ViT into itself (``apply``), its label, the
run-configuration fields that select it (``run_fields``, ``from_run_fields``), its checkpoint
metadata (``metadata_key``, ``metadata``, ``from_metadata``), and how to set itself to a share of
the dense model's MACs (``at_cost``). Run configurations, model building, checkpoints, ``amod flops``,
``amod compare`` and ``amod study`` all go through these classes. A new method is one class plus its
entry in ``METHODS``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

from torch import nn

from .family import skeleton
from .cost import flops
from .mod.config import DEFAULT_PROTECT, MoDConfig
from .mod.convert import capacity_for_cost, convert
from .mod.isoflop import isoflop_baseline
from . import tome
from .tome import pitome

Layers = Optional[Union[str, list[int], tuple[int, ...]]]


def _as_list(value: Any) -> Any:
    """A tuple as a list (what configurations and ``amod.convert`` take); anything else as it is."""
    return list(value) if isinstance(value, tuple) else value


def _as_tuple(value: Any) -> Any:
    """A list as a tuple (what the frozen method dataclasses hold, hashable); anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


class Method:
    """Base class of the methods; subclasses are frozen dataclasses."""

    kind: ClassVar[str]
    # the checkpoint metadata entry this method writes and is found by (None: it writes none)
    metadata_key: ClassVar[Optional[str]] = None

    def apply(self, model: nn.Module) -> nn.Module:
        """Turn the dense timm ViT ``model`` into this method (in place where possible); returns the model."""
        raise NotImplementedError

    def label(self) -> str:
        """Short description, as in run summaries: ``dense``, ``attention@0.5``, ``tome@0.56``."""
        raise NotImplementedError

    def run_fields(self) -> dict[str, Any]:
        """The ``RunConfig`` fields that select this method."""
        raise NotImplementedError

    def metadata(self) -> dict[str, str]:
        """Entries of a checkpoint's metadata that rebuild this method (none for a dense model)."""
        return {}

    @classmethod
    def from_run_fields(cls, fields: Any) -> Optional["Method"]:
        """This method, if the run configuration ``fields`` (an object with ``RunConfig``'s fields) selects it."""
        return None

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["Method"]:
        """This method, if the checkpoint metadata ``meta`` names it."""
        return None

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["Method"]:
        """This method as ``model`` runs it, if it does."""
        return None

    def at_cost(self, dense: nn.Module, cost: float) -> "Method":
        """A copy set to the cost closest to ``cost`` x the dense model's MACs (priced on a weightless copy)."""
        return self


@dataclass(frozen=True)
class Dense(Method):
    kind: ClassVar[str] = "dense"

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def label(self) -> str:
        return "dense"

    def run_fields(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class MoD(Method):
    """Mixture-of-Depths: ``amod.convert`` with these arguments."""

    kind: ClassVar[str] = "mod"
    metadata_key: ClassVar[Optional[str]] = "amod.mod"
    router: str = "attention"
    capacity: float = 0.5
    layers: Layers = None  # None: the skipped mode's default_layers ("all" for fold, "alternate" otherwise)
    scale_output: Optional[bool] = None
    seed: int = 0
    skipped: str = "bypass"
    protect: float = DEFAULT_PROTECT
    shape: Optional[tuple[float, ...]] = None  # fold: one capacity exponent per block (``amod.calibrate``)

    def __repr__(self) -> str:
        # shape is named only when set: a plain MoD keeps the repr that finished measurements are keyed by
        shown = [f for f in dataclasses.fields(self) if f.name != "shape" or self.shape is not None]
        return f"MoD({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def apply(self, model: nn.Module) -> nn.Module:
        layers = _as_list(self.layers)
        return convert(model, router=self.router, capacity=self.capacity, layers=layers, scale_output=self.scale_output,
                       seed=self.seed, skipped=self.skipped, protect=self.protect, shape=_as_list(self.shape))

    def label(self) -> str:
        return (f"{self.router}@{self.capacity:g}" + ("" if self.skipped == "bypass" else f" skipped={self.skipped}")
                + (" shaped" if self.shape is not None else ""))

    def run_fields(self) -> dict[str, Any]:
        layers = _as_list(self.layers)
        fields = {"router": self.router, "capacity": self.capacity, "layers": layers, "skipped": self.skipped}
        if self.scale_output is not None:
            fields["scale_output"] = self.scale_output
        if self.skipped == "fold":
            fields["protect"] = self.protect
        if self.shape is not None:
            fields["shape"] = _as_list(self.shape)
        return fields

    def metadata(self) -> dict[str, str]:
        return {self.metadata_key: self.config().to_json()}

    def config(self) -> MoDConfig:
        """The ``MoDConfig`` of this method (layers must be resolved: take it from ``of_model``)."""
        return MoDConfig(router=self.router, capacity=self.capacity, layers=list(self.layers or []),
                         scale_output=bool(self.scale_output), seed=self.seed, skipped=self.skipped,
                         protect=self.protect, shape=_as_list(self.shape))

    @classmethod
    def from_run_fields(cls, fields: Any) -> Optional["MoD"]:
        if fields.router is None or fields.isoflop:
            return None
        layers = _as_tuple(fields.layers)
        return cls(router=fields.router, capacity=fields.capacity, layers=layers, scale_output=fields.scale_output,
                   seed=fields.seed, skipped=fields.skipped, protect=fields.protect, shape=_as_tuple(fields.shape))

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["MoD"]:
        if cls.metadata_key not in meta:
            return None
        return cls._of_config(MoDConfig.from_dict(json.loads(meta[cls.metadata_key])))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["MoD"]:
        config = getattr(model, "amod_config", None)
        return None if config is None else cls._of_config(config)

    @classmethod
    def _of_config(cls, config: MoDConfig) -> "MoD":
        return cls(**{**dataclasses.asdict(config), "layers": tuple(config.layers), "shape": _as_tuple(config.shape)})

    def at_cost(self, dense: nn.Module, cost: float) -> "MoD":
        # converted at full capacity (below a fold model's floor it would warn): the capacity is searched for
        model = dataclasses.replace(self, capacity=1.0).apply(skeleton(dense))
        return dataclasses.replace(MoD.of_model(model), capacity=capacity_for_cost(model, cost))


@dataclass(frozen=True)
class IsoFLOP(Method):
    """The dense baseline of an MoD setup: fewer blocks, the MoD model's cost (``amod.isoflop_baseline``)."""

    kind: ClassVar[str] = "isoflop"
    router: str = "attention"
    capacity: float = 0.5
    layers: Layers = "alternate"

    def apply(self, model: nn.Module) -> nn.Module:
        layers = _as_list(self.layers)
        return isoflop_baseline(model, self.capacity, layers=layers or "alternate", router=self.router)

    def label(self) -> str:
        return f"isoflop@{self.capacity:g}"

    def run_fields(self) -> dict[str, Any]:
        layers = _as_list(self.layers)
        return {"router": self.router, "capacity": self.capacity, "layers": layers, "isoflop": True}

    @classmethod
    def from_run_fields(cls, fields: Any) -> Optional["IsoFLOP"]:
        if fields.router is None or not fields.isoflop:
            return None
        layers = _as_tuple(fields.layers)
        return cls(router=fields.router, capacity=fields.capacity, layers=layers or "alternate")


@dataclass(frozen=True)
class TokenMerging(Method):
    """Token merging (ToMe): ``r`` tokens merged per block (an int or one per block), or ``cost``."""

    kind: ClassVar[str] = "tome"
    metadata_key: ClassVar[Optional[str]] = "amod.merge"  # the key predates amod.tome; files keep it
    r: Optional[Union[int, tuple[int, ...]]] = None
    cost: Optional[float] = None

    def apply(self, model: nn.Module) -> nn.Module:
        r = _as_list(self.r)
        return tome.apply(model, r=r, cost=self.cost)

    def label(self) -> str:
        if self.cost is not None:
            return f"tome@{self.cost:g}"
        return f"tome r={_as_list(self.r)}"

    def run_fields(self) -> dict[str, Any]:
        if self.cost is not None:
            return {"tome_cost": self.cost}
        return {"tome_r": _as_list(self.r)}

    def metadata(self) -> dict[str, str]:
        return {self.metadata_key: json.dumps({"schedule": list(self.r)})}

    @classmethod
    def from_run_fields(cls, fields: Any) -> Optional["TokenMerging"]:
        if fields.tome_cost is None and fields.tome_r is None:
            return None
        r = _as_tuple(fields.tome_r)
        return cls(r=r, cost=fields.tome_cost)

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["TokenMerging"]:
        if cls.metadata_key not in meta:
            return None
        return cls(r=tuple(json.loads(meta[cls.metadata_key])["schedule"]))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["TokenMerging"]:
        merging = getattr(model, "amod_tome", None)
        return None if merging is None else cls(r=tuple(merging.schedule))

    def at_cost(self, dense: nn.Module, cost: float) -> "TokenMerging":
        return TokenMerging(r=tuple(tome.schedule_for_cost(dense, cost, tolerance=1.0)))  # closest; a miss is flagged


@dataclass(frozen=True)
class PiToMe(Method):
    """PiToMe (``amod.pitome``): every block keeps the share ``keep`` of its patch tokens, or ``cost``."""

    kind: ClassVar[str] = "pitome"
    metadata_key: ClassVar[Optional[str]] = "amod.pitome"
    keep: Optional[float] = None
    cost: Optional[float] = None

    def apply(self, model: nn.Module) -> nn.Module:
        return pitome.apply(model, keep=self.keep, cost=self.cost)

    def label(self) -> str:
        return f"pitome@{self.cost:g}" if self.cost is not None else f"pitome keep={self.keep:g}"

    def run_fields(self) -> dict[str, Any]:
        return {"pitome_keep": self.keep} if self.cost is None else {"pitome_cost": self.cost}

    def metadata(self) -> dict[str, str]:
        return {self.metadata_key: json.dumps({"keep": self.keep})}

    @classmethod
    def from_run_fields(cls, fields: Any) -> Optional["PiToMe"]:
        if fields.pitome_cost is None and fields.pitome_keep is None:
            return None
        return cls(keep=fields.pitome_keep, cost=fields.pitome_cost)

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["PiToMe"]:
        if cls.metadata_key not in meta:
            return None
        return cls(keep=float(json.loads(meta[cls.metadata_key])["keep"]))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["PiToMe"]:
        config = getattr(model, "amod_pitome", None)
        return None if config is None else cls(keep=config.keep)

    def at_cost(self, dense: nn.Module, cost: float) -> "PiToMe":
        model = PiToMe(keep=1.0).apply(skeleton(dense))
        return PiToMe(keep=pitome.keep_for_cost(model, cost, tolerance=1.0))  # closest; a miss is flagged


def cost_of(method: Method, dense: nn.Module, img_size=None) -> float:
    """``method``'s cost as a share of the dense model's MACs (priced on a weightless copy)."""
    return flops(method.apply(skeleton(dense)), img_size).ratio


# Every method amod knows; the first whose metadata or model matches is the one.
METHODS: tuple[type[Method], ...] = (MoD, TokenMerging, PiToMe, IsoFLOP, Dense)
# The checkpoint metadata entries that name a method (a file names one at most; none: a dense model).
METADATA_KEYS: tuple[str, ...] = tuple(cls.metadata_key for cls in METHODS if cls.metadata_key)


def method_of(model: nn.Module) -> Method:
    """The method ``model`` runs (``Dense`` for a dense or isoFLOP model)."""
    for cls in METHODS:
        method = cls.of_model(model)
        if method is not None:
            return method
    return Dense()


def method_from_metadata(meta: dict[str, str]) -> Method:
    """The method a checkpoint's metadata names (``Dense`` when it names none)."""
    for cls in METHODS:
        method = cls.from_metadata(meta)
        if method is not None:
            return method
    return Dense()


def method_from_run_fields(fields: Any) -> Method:
    """The method a run configuration selects (an object with ``RunConfig``'s fields): the one whose
    ``from_run_fields`` accepts the fields, ``Dense`` when none does. Settings that select two methods
    (``RunConfig.validate`` refuses them first, with its own message) raise a ValueError."""
    chosen = [m for m in (cls.from_run_fields(fields) for cls in METHODS) if m is not None]
    if len(chosen) > 1:
        raise ValueError(f"the settings select {len(chosen)} methods ({', '.join(m.label() for m in chosen)}); "
                         "give the settings of one")
    return chosen[0] if chosen else Dense()
