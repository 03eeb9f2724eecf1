"""The reference pages are the code's: every command has its section in docs/cli.md, every signature in
docs/api.md is the function's."""
from __future__ import annotations

import re
from pathlib import Path

import amod
from amod.train.run import train


def test_docs_cli_lists_every_command_and_each_has_its_section():
    from amod.cli import COMMANDS

    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    listed = text.split("newcomer meets them:")[1].split(".")[0]
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for command in COMMANDS:
        assert f"`{command.name}`" in listed, f"docs/cli.md's list of commands lacks {command.name}"
        assert any(f"`amod {command.name}`" in h for h in headings), f"docs/cli.md has no section on {command.name}"


def _documented_object(dotted: str):
    """``amod.a.b.c`` as imported: each part an attribute, or else a submodule, of the one before."""
    import importlib

    obj = importlib.import_module("amod")
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def test_docs_api_signatures_are_the_code_s():
    # every `amod.name(parameters)` in docs/api.md's table of functions is the real signature: the same parameters in
    # the same order, the same keyword-only `*` and **kwargs, the same defaults (a call with `...` is not one; a bare
    # `Name(...)` is looked up in the module of its row's first name)
    import ast
    import inspect

    text = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    rows = [line.split(" | ")[0] for line in text.split("## Functions")[1].split("## Routers")[0].splitlines()
            if line.startswith("| `")]
    checked = []
    for row in rows:
        module = None
        for name, params in re.findall(r"`((?:amod\.)?[\w.]+)\(([^`]*)\)`", row):
            if name.startswith("amod."):
                module = module or name.rsplit(".", 1)[0]
            else:
                name = f"{module}.{name}"
            if "..." in params:
                continue
            doc = ast.parse(f"def f({params}): pass").body[0].args
            signature = inspect.signature(_documented_object(name))
            real = list(signature.parameters.values())
            shown = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in doc.args]
            shown += [(a.arg, inspect.Parameter.KEYWORD_ONLY) for a in doc.kwonlyargs]
            shown += [(doc.kwarg.arg, inspect.Parameter.VAR_KEYWORD)] if doc.kwarg else []
            assert shown == [(p.name, p.kind) for p in real], f"docs/api.md: {name}({params}) is {name}{signature}"
            defaults = dict(zip([a.arg for a in doc.args][len(doc.args) - len(doc.defaults):], doc.defaults))
            defaults.update({a.arg: d for a, d in zip(doc.kwonlyargs, doc.kw_defaults) if d is not None})
            for p in real:
                if p.kind == p.VAR_KEYWORD:
                    continue
                assert (p.name in defaults) == (p.default is not p.empty), f"docs/api.md: {name}'s {p.name} default"
                if p.name in defaults:
                    assert ast.literal_eval(defaults[p.name]) == p.default, f"docs/api.md: {name}'s {p.name} default"
            checked.append(name)
    assert {"amod.convert", "amod.export", "amod.compile", "amod.tome.apply", "amod.isoflop_baseline",
            "amod.train.distill.Teacher"} <= set(checked)
