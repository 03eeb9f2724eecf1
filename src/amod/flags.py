"""A command's flags made from its configuration dataclass, and the dataclass made back from the parsed flags.

Each field is written once: its name, type hint and default become the flag, its trailing ``# comment`` the help
line (``(default X)`` added). What a field's flag needs beyond that is in its ``metadata`` (``flag(...)``): another
flag name (``--cost`` fills ``costs``; None: the field is no flag), a parse function (``positive_int``), choices
(a callable is read when the flags are built: a registry), a metavar, nargs, a positional argument, a negated switch
(``--no-fp32-check`` clears ``fp32_check``; its help: "skip" and the comment), or a flag required although the field
has a default.

A small builder on argparse rather than jsonargparse or tyro: the flags are a public promise whose names often differ
from the fields', amod's errors are one line with status 2 (``Parser``), and neither library is a dependency. Nothing
of amod but its error type is imported here.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import os
import sys
import textwrap
import tokenize
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional, Union

import yaml

from .errors import UserError

MISSING = dataclasses.MISSING
META_KEYS = ("flag", "type", "choices", "metavar", "nargs", "positional", "negate", "required", "aliases")


class Parser(argparse.ArgumentParser):
    """argparse with amod's error format: one line, ``amod COMMAND: error: ...``, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def flag(default: Any = MISSING, **meta: Any) -> Any:
    """A dataclass field with its flag's settings (``META_KEYS``): ``costs: tuple[float, ...] = flag((0.5,),
    flag="cost")``; ``aliases``: the flag's former names, still taken, each with a warning line naming the flag
    (``deprecated_alias``). A list or dict default becomes a factory."""
    unknown = set(meta) - set(META_KEYS)
    if unknown:
        raise TypeError(f"unknown flag settings {sorted(unknown)}; known: {', '.join(META_KEYS)}")
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---------------------------------------------------------------- flag types

def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")  # an argparse type
nonnegative_int = _int_at_least(0, "an integer >= 0")


def parse_bool(text: str) -> bool:
    """``true``/``yes``/``1``/``on`` or ``false``/``no``/``0``/``off``."""
    if text.lower() in ("true", "yes", "1", "on"):
        return True
    if text.lower() in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_parsed_flag(parser: Union[argparse.ArgumentParser, argparse._ArgumentGroup], name: str,
                    parse: Optional[Callable[[str], Any]], help: str, choices: Optional[Callable[[], Any]] = None,
                    **kwargs: Any) -> None:
    """A flag ``--name`` (underscores as dashes) whose text ``parse`` reads, a ``UserError`` (or ValueError) it raises
    becoming argparse's one-line error; ``parse`` None: a switch. ``choices``: a function giving the allowed values."""
    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    flag_name = "--" + name.replace("_", "-")
    if parse is None:
        parser.add_argument(flag_name, action="store_true", help=help, **kwargs)
    else:
        shown = {"choices": tuple(choices())} if choices else {"metavar": name.upper()}
        parser.add_argument(flag_name, type=read, help=help, **shown, **kwargs)


def deprecated_alias(action: Optional[str], flag_name: str) -> type:
    """The argparse action of a flag's former name: ``action``'s (None: store), after a warning line that names the
    flag to use (``amod bench: warning: --batch-size is deprecated: use --speed-batch, the same setting``). A public
    flag renamed keeps working under its old name, so that no script breaks."""
    base = {None: argparse._StoreAction, "store": argparse._StoreAction,
            "store_true": argparse._StoreTrueAction}[action]

    class DeprecatedAlias(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: Optional[str] = None) -> None:
            print(f"{parser.prog}: warning: {option_string} is deprecated: use {flag_name}, the same setting",
                  file=sys.stderr)
            super().__call__(parser, namespace, values, option_string)

    return DeprecatedAlias


# ---------------------------------------------------------------- reading a dataclass

@lru_cache(maxsize=None)
def field_comments(config: type) -> dict[str, str]:
    """Each field's trailing ``# comment`` in ``config``'s source (fields without one left out; {} where the source
    cannot be read, e.g. a class made at run time). A comment alone on the next line, in the same column, goes on."""
    try:
        source = textwrap.dedent(inspect.getsource(config))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return {}
    names = {f.name for f in dataclasses.fields(config)}
    comments: dict[str, str] = {}
    depth, line = 0, []  # the indentation depth, the tokens of the logical line so far
    last = None  # (field, its comment's column, its last line): where a comment alone on the next line goes on
    for tok in tokens:
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.NEWLINE:  # a logical line ends: a field is ``NAME :`` at the class body's depth
            significant = [t for t in line if t.type not in (tokenize.COMMENT, tokenize.NL)]
            trailing = [t for t in line if t.type == tokenize.COMMENT]
            if (depth == 1 and trailing and len(significant) > 1 and significant[0].string in names
                    and significant[1].string == ":" and trailing[-1].start[0] >= significant[0].start[0]):
                comments[significant[0].string] = trailing[-1].string.lstrip("#").strip()
                last = (significant[0].string, trailing[-1].start[1], trailing[-1].start[0])
            else:
                last = None
            line = []
        elif tok.type == tokenize.COMMENT and not [t for t in line if t.type != tokenize.NL]:
            if last and tok.start == (last[2] + 1, last[1]):  # the field's comment goes on
                comments[last[0]] += " " + tok.string.lstrip("#").strip()
                last = (last[0], last[1], tok.start[0])
            else:
                last = None  # a comment on a line of its own: not a field's
        else:
            line.append(tok)
    return comments


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _selected(config: type, only: Optional[Iterable[str]]) -> list[dataclasses.Field]:
    every = {f.name: f for f in dataclasses.fields(config)}
    if only is None:
        return [f for f in every.values() if f.metadata.get("flag", f.name) is not None]
    missing = [n for n in only if n not in every]
    if missing:
        raise TypeError(f"{config.__name__} has no field {', '.join(missing)}")
    return [every[n] for n in only]


def dest_of(f: dataclasses.Field, prefix: str = "") -> str:
    """The namespace attribute of field ``f``'s flag: its flag name (``no_`` before a negated one), ``_`` for ``-``."""
    name = prefix + f.metadata.get("flag", f.name)
    return ("no_" + name if f.metadata.get("negate") else name).replace("-", "_")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


# ---------------------------------------------------------------- the two directions

def add_flags(parser: Union[argparse.ArgumentParser, argparse._ArgumentGroup], config: type,
              only: Optional[Iterable[str]] = None, suppress: bool = False, prefix: str = "") -> None:
    """Add ``config``'s fields (``only`` these, in this order; default all) to ``parser`` as flags.

    ``suppress``: a flag not given is left out of the namespace (``hasattr`` tells what was given; ``build`` fills the
    field's default). ``prefix``: put before every flag's name (``distill-``). A field without default is a required
    flag, but with ``suppress`` (the command says what a mode needs).
    """
    hints = typing.get_type_hints(config)
    comments = field_comments(config)
    for f in _selected(config, only):
        meta, default = f.metadata, _default_of(f)
        hint = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {}
        origin = typing.get_origin(hint)
        if origin in (tuple, list):
            kwargs["nargs"] = "+"
            hint = typing.get_args(hint)[0] if typing.get_args(hint) else str
        if typing.get_origin(hint) is Literal:
            kwargs["choices"] = typing.get_args(hint)
        elif hint is bool and "type" not in meta:
            if meta.get("negate"):
                if default is not True:
                    raise TypeError(f"{config.__name__}.{f.name}: a negated flag needs the default True")
                kwargs["action"] = "store_true"
            elif default is False:
                kwargs["action"] = "store_true"
            else:
                kwargs["type"] = parse_bool
        elif hint in (int, float, str):
            kwargs["type"] = hint
        elif "type" not in meta:
            raise TypeError(f"{config.__name__}.{f.name}: no flag type for {hint!r}; give one with flag(type=...)")
        if "type" in meta:
            kwargs["type"] = meta["type"]
        for key in ("metavar", "nargs"):
            if key in meta:
                kwargs[key] = meta[key]
        if "choices" in meta:
            choices = meta["choices"]
            kwargs["choices"] = tuple(choices() if callable(choices) else choices)
        if kwargs.get("action") == "store_true":
            kwargs.pop("type", None)
        help_text = comments.get(f.name, "")
        if meta.get("negate") and help_text:  # (the comment says what the field keeps; the flag leaves it out)
            help_text = f"skip {help_text}"
        if not any(default is v for v in (MISSING, None, False)) and not meta.get("negate"):  # (0 is shown)
            help_text = f"{help_text} (default {_shown(default)})".strip()
        kwargs["help"] = help_text.replace("%", "%%") or None  # (argparse formats help with %)
        if meta.get("positional"):
            parser.add_argument(f.name, **kwargs) if default is MISSING else \
                parser.add_argument(f.name, nargs="?", default=default, **kwargs)
            continue
        if (default is MISSING and not suppress) or meta.get("required"):  # (suppress: the command checks)
            kwargs["required"] = True
        elif suppress:
            kwargs["default"] = argparse.SUPPRESS
        else:
            kwargs["default"] = False if meta.get("negate") else default
        name = "--" + dest_of(f, prefix).replace("_", "-")
        parser.add_argument(name, dest=dest_of(f, prefix), **kwargs)
        for old in meta.get("aliases", ()):  # (hidden, and never a default: the flag itself sets that)
            parser.add_argument("--" + prefix + old, dest=dest_of(f, prefix), help=argparse.SUPPRESS,
                                default=argparse.SUPPRESS, action=deprecated_alias(kwargs.get("action"), name),
                                **{k: v for k, v in kwargs.items() if k in ("type", "nargs", "choices", "metavar")})


def flag_of(config: type, name: str) -> str:
    """The flag of ``config``'s field ``name`` (``--val-limit`` for the finetune study's ``eval_images``): what a
    message about the field names."""
    return "--" + dest_of(next(f for f in dataclasses.fields(config) if f.name == name)).replace("_", "-")


def given(args: argparse.Namespace, config: type, only: Optional[Iterable[str]] = None,
          prefix: str = "") -> dict[str, Any]:
    """The fields of ``config`` (``only`` these) whose flags are in ``args``, by field name, as the field takes them:
    a negated switch inverted, a list as a tuple where the field is one."""
    hints = typing.get_type_hints(config)
    values = {}
    for f in _selected(config, only):
        dest = dest_of(f, prefix)
        if f.metadata.get("positional"):
            dest = f.name
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if f.metadata.get("negate"):
            value = not value
        elif isinstance(value, list) and typing.get_origin(_unwrap_optional(hints[f.name])) is tuple:
            value = tuple(value)
        values[f.name] = value
    return values


def by_field_name(config: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` (a YAML file's options) with each key that is a flag's name of ``config`` read as its field's
    (``method`` for ``method_spec``; a negated switch's ``no_x: true`` as ``x: false``); other keys as they are."""
    by_flag = {dest_of(f, prefix): f for f in dataclasses.fields(config) if f.metadata.get("flag", "") is not None}
    by_flag.update({(prefix + old).replace("-", "_"): f for f in dataclasses.fields(config)
                    for old in f.metadata.get("aliases", ())})  # (a flag's former names, as the command line takes)
    return {by_flag[k].name if k in by_flag else k: (not v) if k in by_flag and by_flag[k].metadata.get("negate")
            else v for k, v in values.items()}


def build(config: type, args: argparse.Namespace, only: Optional[Iterable[str]] = None, prefix: str = "",
          under: Optional[dict[str, Any]] = None, **values: Any) -> Any:
    """``config`` from the parsed flags of ``add_flags`` (a flag left out: the field's default), laid over ``under``
    (a ``--config`` YAML file's options, by field name: ``load_yaml_config``), ``values`` over them. Refuses, in one
    line, a key of ``under`` that is no field and a required field given nowhere."""
    names = [f.name for f in dataclasses.fields(config)]
    under = by_field_name(config, under or {}, prefix)
    unknown = sorted(set(under) - set(names))
    if unknown:
        raise UserError(f"config file: unknown keys {unknown}; known keys: {names}")
    hints = typing.get_type_hints(config)
    under = {k: tuple(v) if isinstance(v, list) and typing.get_origin(_unwrap_optional(hints[k])) is tuple else v
             for k, v in under.items()}
    fields = {**under, **given(args, config, only, prefix), **values}
    missing = [f.name for f in dataclasses.fields(config) if _default_of(f) is MISSING and f.name not in fields]
    if missing:
        flags = [f.name if f.metadata.get("flag", "") is None else f"--{dest_of(f, prefix).replace('_', '-')}"
                 for f in dataclasses.fields(config) if f.name in missing]
        raise UserError(f"{', '.join(flags)} must be given (as a flag, or in --config)")
    return config(**fields)


def load_yaml_config(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """A YAML file of a command's options (``--config``): a mapping of option names (dashes read as underscores) to
    values; anything else is refused in one line naming the file."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; give the YAML file")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError:  # (a binary file: the decoder's words name no file)
        raise UserError(f"config file {path} is not a text file; give a YAML file of option: value lines") from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    odd = [k for k in data if not isinstance(k, str)]  # YAML reads `1:` as an int and `~:` as None
    if odd:
        raise UserError(f"config file {path}: option names are words (epochs, lr, ...), got the key {odd[0]!r}")
    return {k.replace("-", "_"): v for k, v in data.items()}


def refuse_other_mode(args: argparse.Namespace, mode: str, flags: dict[str, tuple[str, ...]], names: dict[str, str],
                      why: str = "") -> None:
    """Refuse, in one line naming them and the mode, the flags that only another mode of a command uses, which the
    run would drop without a word. ``flags``: each mode's own flags by dest (SUPPRESS defaults: in ``args`` only when
    given); ``names``: each mode in words; ``why``: which mode runs, and why, in words."""
    for other, dests in flags.items():
        given = [f"--{d.replace('_', '-')}" for d in dests if other != mode and hasattr(args, d)]
        if given:
            raise UserError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to {names[other]}, "
                            f"not to {names[mode]}{'; ' + why if why else ''}")
