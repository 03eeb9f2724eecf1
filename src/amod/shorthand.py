"""The built-in methods' older options, shorthand for a spec: ``--router attention --capacity 0.5`` is
``mod:router=attention,capacity=0.5``, ``--tome-cost 0.56`` is ``tome:cost=0.56``. Stated once in ``SHORTHANDS``:
the commands' method flags are these, and run configurations, report rows and checkpoints written with them read back
through the same table (``method_from_shorthand``). A method of its own needs none (a spec selects it)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

from .errors import UserError
from .methods import Dense, Method, as_tuple, parse_method, parse_value, registered_method, type_name
from .mod.config import MoDConfig
from .mod.convert import MoD
from .mod.modes import skipped_mode, skipped_mode_names
from .mod.routers import vit_routers


@dataclass(frozen=True)
class Shorthand:
    """An option that sets one field of a built-in method: ``--capacity 0.5`` is ``mod:capacity=0.5``. The command
    line's method flags are these (``amod train --router attention --capacity 0.5``), and so are the fields that run
    configurations, report rows and checkpoints held before a run's method was its spec alone."""

    name: str  # the option: its flag is --name with dashes, and older files hold it under this name
    kind: str  # the method it sets a field of
    field: Optional[str]  # that field (None: the option is a switch that makes the MoD setup this method, --isoflop)
    selects: bool  # giving it selects its method (--router, --tome-cost); the others adjust a selected one
    help: str
    choices: Optional[Any] = None  # a function giving the allowed values, where the registry limits them


SHORTHANDS: tuple[Shorthand, ...] = (
    Shorthand("router", "mod", "router", True, "Mixture-of-Depths, its tokens ranked by this router",
              vit_routers),
    Shorthand("capacity", "mod", "capacity", False, f"share of patch tokens an MoD block processes (default "
              f"{MoDConfig.capacity})"),
    Shorthand("layers", "mod", "layers", False, "alternate | later | last-two-thirds | all | 1,3,5 (default: all for --skipped fold, "
              "alternate otherwise)"),
    Shorthand("scale_output", "mod", "scale_output", False, "true | false: scale a processed token's block output by "
              "its router gate (default: per router)"),
    Shorthand("router_seed", "mod", "seed", False, "seed of a router that draws (default: --seed)"),
    Shorthand("skipped", "mod", "skipped", False, f"what MoD blocks do with skipped tokens (default "
              f"{MoDConfig.skipped})", lambda: tuple(skipped_mode_names())),
    Shorthand("protect", "mod", "protect", False, f"--skipped fold: share of a fold block's patch tokens the router "
              f"protects (default {MoDConfig.protect})"),
    Shorthand("shape", "mod", "shape", False, "--skipped fold: one capacity exponent per block, 1.6,1.4,...; block i "
              "keeps capacity ** w_i of its patch tokens (amod calibrate prints one; default: all 1)"),
    Shorthand("isoflop", "isoflop", None, False, "the dense isoFLOP baseline of --router/--capacity/--layers instead"),
    Shorthand("tome_cost", "tome", "cost", True, "token merging (ToMe): the share of the dense MACs to match, e.g. "
              "0.56"),
    Shorthand("tome_r", "tome", "r", True, "token merging (ToMe): tokens merged per block, 8 or 8,8,6,..."),
    Shorthand("pitome_cost", "pitome", "cost", True, "PiToMe: the share of the dense MACs to match, e.g. 0.56"),
    Shorthand("pitome_keep", "pitome", "keep", True, "PiToMe: the share of its patch tokens every block keeps"),
)
SHORTHAND_NAMES = tuple(s.name for s in SHORTHANDS)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def shorthand_type(shorthand: Shorthand) -> Any:
    """The type hint of the method field ``shorthand`` sets (bool for a switch)."""
    if shorthand.field is None:
        return bool
    return typing.get_type_hints(registered_method(shorthand.kind))[shorthand.field]


def parse_shorthand(shorthand: Shorthand, text: str) -> Any:
    """A flag's text as the value of the field it sets: as in a spec (``parse_method``), and lists also without
    brackets (``--layers 1,3,5``, ``--tome-r 8,8,6``; numbers are never a name: ``--layers 5`` is block 5). Raises a
    UserError saying what is allowed."""
    tp = shorthand_type(shorthand)
    text = text.strip()
    numbers = bool(text) and all(t.strip().lstrip("-").replace(".", "", 1).isdigit() for t in text.split(",")
                                 if t.strip())
    if text.startswith("[") or not numbers:
        candidates = [text]
    else:
        candidates = [f"[{text}]"] if "," in text else [text, f"[{text}]"]
    for candidate in candidates:
        try:
            value = parse_value(candidate, tp)
        except ValueError:
            continue
        if not (numbers and isinstance(value, str)):
            return value
    raise UserError(f"{_flag(shorthand.name)} must be {type_name(tp)}, got {text!r}")


def method_from_shorthand(values: dict[str, Any], lenient: bool = False) -> Optional[Method]:
    """The method that shorthand options select (``SHORTHANDS``, by name; None values count as not given), or None
    where none selects one. Refuses, in one line naming the options, two methods, an option of another method than
    the one selected, and --isoflop without --router; the method's own ``check`` refuses bad values.

    ``lenient``: read the fields an older run configuration or report row holds, where every option is present at
    its default: options of a method not selected are dropped, as that code dropped them, and so are fold's options
    of another skipped mode and the skipped mode's default layers (written out by that code)."""
    given = {s.name: values[s.name] for s in SHORTHANDS  # (a switch given as false is not given)
             if values.get(s.name) is not None and not (s.field is None and values[s.name] is False)}
    kinds = list(dict.fromkeys(s.kind for s in SHORTHANDS if s.selects and s.name in given))
    if "isoflop" in given:
        if "mod" not in kinds:
            raise UserError("--isoflop needs the MoD setup to match: give --router, --capacity and --layers")
        kinds[kinds.index("mod")] = "isoflop"
    if len(kinds) > 1:
        raise UserError(" and ".join(", ".join(_flag(s.name) for s in SHORTHANDS if s.name in given and s.selects
                                               and (s.kind == k or (k == "isoflop" and s.kind == "mod")))
                                     for k in kinds) + " select two methods; give the options of one")
    if not kinds:
        return None
    cls = registered_method(kinds[0])
    names = {f.name for f in dataclasses.fields(cls)}
    fields, foreign = {}, []
    for s in SHORTHANDS:
        if s.name not in given or s.field is None:
            continue
        if s.field in names and (s.kind == cls.kind or cls.kind == "isoflop"):
            fields[s.field] = as_tuple(given[s.name])
        else:
            foreign.append(_flag(s.name))
    if foreign and not lenient:
        raise UserError(f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to "
                        f"{cls.kind} ({', '.join(_flag(s.name) for s in SHORTHANDS if s.selects and s.name in given)})")
    if lenient and cls is MoD:
        skipped = fields.get("skipped", MoDConfig.skipped)
        if skipped != "fold":
            fields.pop("protect", None)
            fields.pop("shape", None)
        if fields.get("layers") == skipped_mode(skipped).default_layers:
            fields.pop("layers")
    return cls(**fields)


def with_shorthand(method: Method, options: dict[str, Any]) -> Method:
    """``method`` with the fields that the shorthand ``options`` (by name; None: not given) set: each sets the field
    of its name (``--capacity 0.25`` on ``mod:capacity=0.125``, ``--router random`` on ``calibrated``); an option
    that names no field of ``method`` is refused in one line."""
    given = [s for s in SHORTHANDS if options.get(s.name) is not None]
    names = {f.name for f in dataclasses.fields(method)}
    foreign = [_flag(s.name) for s in given if s.field not in names]
    if foreign:
        raise UserError(f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to {method.spec()}")
    return dataclasses.replace(method, **{s.field: as_tuple(options[s.name]) for s in given})


def setting_text_of(setting: Union[str, dict[str, Any]]) -> str:
    """A report's setting column for a row's ``setting``: the spec of the method it measured, or (a row written before
    rows held specs) the shorthand options of it; the method is rebuilt and asked for its ``setting_text``."""
    if isinstance(setting, str):
        return parse_method(setting).setting_text()
    if setting.get("method_spec"):
        return parse_method(setting["method_spec"]).setting_text()
    return (method_from_shorthand(setting, lenient=True) or Dense()).setting_text()
