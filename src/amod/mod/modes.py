"""Skipped modes: what the tokens an MoD block does not process do there. One object per mode, one registry.

A mode is a ``SkippedMode`` subclass registered under its name with ``@register_skipped_mode(name)``;
``amod.convert(skipped=name)``, ``MoDConfig``'s check, the CLI's ``--skipped`` choices and checkpoints
find it there. The MoD block's modes (``bypass``, ``merge``, ``kv``: ``MoDMode`` in ``amod.mod.block``)
run inside ``MoDBlock``; ``fold`` (``amod.mod.fold``) converts to blocks of its own. This module imports
nothing of amod, so ``config`` and the blocks can all read it; the package ``amod.mod`` imports the modules that
register the built-in modes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, TypeVar
from ..errors import UserError

if TYPE_CHECKING:
    from torch import nn

M = TypeVar("M", bound=type)


class SkippedMode:
    """One skipped-token mode: how a model is converted to it, what it refuses, its capacities.

    Class attributes: ``name`` (set by ``register_skipped_mode``), ``default_layers`` (the layer preset
    ``amod.convert`` takes when none is given), ``own_attention`` (its blocks route on the attention
    they compute themselves, so an attention router may sit on block 0) and ``records_kept_indices``
    (a block's kept patch positions are meaningful: recording, routing pictures, leave-one-out).
    """

    name: ClassVar[str] = ""
    default_layers: ClassVar[str] = "alternate"
    own_attention: ClassVar[bool] = False
    records_kept_indices: ClassVar[bool] = True

    # ``config`` below: the model's ``amod.mod.config.MoDConfig``, typed ``Any`` because ``config`` imports this
    # module (a type-hint import back would close a circle); ``family``: its ``amod.family.Family``

    def validate(self, config: Any, model: "nn.Module") -> None:
        """Raise a ValueError if this mode cannot run ``config`` (layers resolved) on ``model``."""

    def convert(self, model: "nn.Module", config: Any, family: Any) -> None:
        """Convert ``model``'s blocks in place; ``family`` (``amod.family``) makes each block take its role."""
        raise NotImplementedError

    def lowest_capacity(self, model: "nn.Module", num_patches: int) -> float:
        """The lowest capacity that still changes ``model`` (``num_patches`` patch tokens): an MoD block keeps
        at least one patch token."""
        return 1 / num_patches

    def capacity_candidates(self, model: "nn.Module", num_patches: int) -> list[float]:
        """Every capacity that gives a distinct cost, for ``amod.capacity_for_cost``: k / n for k = 1..n."""
        return [k / num_patches for k in range(1, num_patches + 1)]

    def below_floor_warning(self, model: "nn.Module", capacity: float) -> Optional[str]:
        """What to warn when ``capacity`` runs as a higher one on ``model``; None: nothing to say."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


MODES: dict[str, SkippedMode] = {}  # name -> mode, in the order they were registered


def register_skipped_mode(name: str) -> Callable[[M], M]:
    """Class decorator: register an instance of a ``SkippedMode`` subclass under ``name``."""

    def wrap(cls: M) -> M:
        old = MODES.get(name)
        if old is not None and (type(old).__module__, type(old).__qualname__) != (cls.__module__, cls.__qualname__):
            raise UserError(f"skipped mode {name!r} is already registered ({type(old).__qualname__})")
        cls.name = name
        MODES[name] = cls()
        return cls

    return wrap


def skipped_mode_names() -> tuple[str, ...]:
    """The registered modes' names (the ``--skipped`` choices)."""
    return tuple(MODES)


def skipped_mode(name: str) -> SkippedMode:
    """The mode registered under ``name``; a ValueError naming the supported ones otherwise."""
    if not isinstance(name, str) or name not in MODES:
        raise UserError(f"unknown skipped-token mode {name!r}; supported: {', '.join(MODES)}")
    return MODES[name]


def mode_list(where: Callable[[SkippedMode], bool]) -> str:
    """The names of the registered modes for which ``where`` holds, as text: ``"bypass, merge or kv"``."""
    names = [name for name, mode in MODES.items() if where(mode)]
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)
