"""Settings that a compiled forward reads as constants.

A converted model's forward reads a few numbers off its settings: the capacity (``amod.set_capacity``, the dial),
fold's protected share and schedule, PiToMe's kept share. Under ``torch.compile`` a Python float that changes
between calls becomes a symbol at the first recompile (``torch._dynamo.config.specialize_float`` is off), and a
symbolic capacity turns every token count after it into a nested ceiling expression: the recompile of a 12-block fold
model spent more than 10 minutes in sympy. An integer is specialised instead (a changed one recompiles the graph
with the new constant), so ``StaticNumbers`` keeps each float setting also as its exact integer ratio, and the
forward reads it back with ``static(name)``: the same float, a constant to the compiler.
"""
from __future__ import annotations

from typing import Any


def _as_integers(value: Any) -> tuple:
    """``value`` tagged for ``static``: a float as its exact ``(numerator, denominator)``, a list or tuple of floats
    as one such pair each, anything else as it is."""
    if isinstance(value, float):
        return "float", value.as_integer_ratio()
    if isinstance(value, (list, tuple)) and any(isinstance(v, float) for v in value) \
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return "floats", tuple(float(v).as_integer_ratio() for v in value)
    return "other", value


class StaticNumbers:
    """Mixin for a settings dataclass whose float fields a forward reads: each assignment also keeps the value as
    integers, which ``static(name)`` turns back into the same float (``n / d`` of ``float.as_integer_ratio`` is exact)
    without reading the float itself.

    Assign a new list to change a list field (an element changed in place is not seen). The copies are plain
    attributes outside the dataclass fields: ``asdict``, ``==`` and checkpoints see the fields only.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_"):
            super().__setattr__(f"_static_{name}", _as_integers(value))

    def static(self, name: str) -> Any:
        """The field ``name`` as the forward should read it: floats rebuilt from their integers (a list of floats
        comes back as a list)."""
        kind, value = getattr(self, f"_static_{name}")
        if kind == "float":
            return value[0] / value[1]
        if kind == "floats":
            return [n / d for n, d in value]
        return value
