"""The import graph of amod, read from the source with ``ast`` (nothing is imported): no import cycle, counting the
imports inside functions and those for type hints only, between modules or between packages (a strict layering: the
bottom, ``errors``, ``files``, ``arch``, ``kernels``, ``hf.common`` and the families' registry ``family``, imports
nothing of amod but ``errors``; nothing below the model families imports ``amod.families``), and the library (every module but the application and
``amod.__main__``, read from the source tree: the root package, routing, token merging, PPT, ops, costs, checkpoints,
weights, kernels, methods, files, export, the model families, analyses...) never imports the application
(``amod.cli`` and what docs/architecture.md's package layout lists below it: ``amod.train``, ``amod.tools``,
``amod.experiments``, ``amod.detect``, ``amod.dense``, ...), not even lazily inside a function. No family's name
appears outside its adapter module and the registry."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "amod"
# docs/architecture.md's package layout: every module and sub-package of amod, one entry each, the library first
LAYOUT = (SRC.parents[1] / "docs" / "architecture.md").read_text().split("## Package layout")[1].split("```")[1]


def _application() -> tuple[str, ...]:
    """The application: the entries of the package layout from ``cli.py``, the one it marks "(the application from
    here)", down (``train/``, ``detect/``, ...): one list, the page's, that a new application package joins."""
    entries = [(m.start(), m.group(1)) for m in re.finditer(r"^  ([\w]+)(?:\.py|/)", LAYOUT, re.M)]
    marker = LAYOUT.index("(the application from here)")
    first = max(i for i, (start, _) in enumerate(entries) if start < marker)
    return tuple(f"amod.{name}" for _, name in entries[first:])


APPLICATION = _application()
ENTRY = ("amod.__main__",)  # ``python -m amod``: runs the command line
# the bottom of the package: imports nothing of amod but amod.errors, so every module may use it
BOTTOM = ("amod.errors", "amod.flags", "amod.files", "amod.arch", "amod.kernels", "amod.hf.common", "amod.family",
          "amod.provenance")


def module_name(path: Path) -> str:
    parts = ("amod", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
# the library: every module and package under amod that is not the application or the entry point, read from the
# tree (a new module is covered without a list to edit)
LIBRARY = tuple(sorted({".".join(m.split(".")[:2]) for m in MODULES if m != "amod"} - set(APPLICATION) - set(ENTRY)))


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _known(name: str) -> str:
    """The amod module ``name`` is, or the module it lies in (``amod.x.f`` -> ``amod.x``)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.AST, module: str) -> list[str]:
    """The amod modules one import statement of ``module`` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        # ``from pkg import name``: name may be a submodule of pkg
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return sorted({_known(n) for n in names if n == "amod" or n.startswith("amod.")})


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(module: str) -> tuple[set[str], set[str], set[str]]:
    """(amod modules imported when ``module`` is imported, those it imports when it runs, functions included, and
    those named anywhere in it, type-checking imports included)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    top: set[str] = set()
    runtime: set[str] = set()
    anywhere: set[str] = set()

    def walk(node: ast.AST, at_import_time: bool, at_run_time: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = set(_targets(child, module))
                anywhere.update(targets)
                if at_run_time:
                    runtime.update(targets)
                if at_import_time:
                    top.update(targets)
            function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            typing_only = _is_type_checking(child)
            walk(child, at_import_time and not (function or typing_only), at_run_time and not typing_only)

    walk(tree, True, True)
    for found in (top, runtime, anywhere):
        found.discard(module)
    return top, runtime, anywhere


GRAPH = {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_source():
    """A guard against a reader that finds nothing: edges we know are there, relative ones resolved."""
    assert {"amod.mod", "amod.train", "amod.experiments", "amod.checkpoint", "amod.weights"} <= set(MODULES)
    assert "amod.methods" in GRAPH["amod.mod.convert"][0]  # from ..methods import ...
    assert "amod.files" in GRAPH["amod.checkpoint"][0]  # from . import files
    assert "amod.tome" in GRAPH["amod"][0]  # from . import ... tome (a package)
    assert "amod.kernels.triton_scores" in GRAPH["amod.ops"][1] - GRAPH["amod.ops"][0]  # inside a function


def test_the_application_is_read_from_the_architecture_page():
    """A guard against a reader that finds nothing: the application's packages, each a module of the tree, and the
    library's bottom not among them."""
    assert APPLICATION[0] == "amod.cli"
    assert {"amod.train", "amod.tools", "amod.experiments", "amod.detect", "amod.dense"} <= set(APPLICATION)
    assert all(a in MODULES for a in APPLICATION), APPLICATION
    assert not set(APPLICATION) & {"amod.methods", "amod.mod", "amod.families", *BOTTOM}


def test_imports_have_no_cycle_counting_those_inside_functions():
    assert cycles({m: top for m, (top, _, _) in GRAPH.items()}) == []
    assert cycles({m: runtime for m, (_, runtime, _) in GRAPH.items()}) == []
    assert cycles({m: anywhere for m, (_, _, anywhere) in GRAPH.items()}) == []  # type hints too


def package(module: str) -> str:
    """The top-level module or subpackage of amod ``module`` lies in (``amod.mod.block`` -> ``amod.mod``)."""
    return ".".join(module.split(".")[:2])


def test_packages_are_layered():
    """Between amod's top-level modules and subpackages, no cycle, counting every import (inside functions, for type
    hints): each lies above the ones it imports, with no arrow back up. The root package, the public API that imports
    them all, is left aside."""
    graph: dict[str, set[str]] = {}
    for module, (_, _, anywhere) in GRAPH.items():
        graph.setdefault(package(module), set()).update(package(t) for t in anywhere)
    graph = {p: targets - {p, "amod"} for p, targets in graph.items() if p != "amod"}
    assert {"amod.cost", "amod.mod"} <= graph["amod.families"]  # (edges are read: the families build on these)
    assert cycles(graph) == []


@pytest.mark.parametrize("bottom", BOTTOM)
def test_the_bottom_imports_nothing_of_amod(bottom):
    found = sorted(f"{m} imports {t}" for m, (_, _, anywhere) in GRAPH.items() if _in(m, (bottom,))
                   for t in anywhere if not _in(t, (bottom, "amod.errors")))  # (the error type: everyone's)
    assert [m for m in MODULES if _in(m, (bottom,))], f"no module {bottom}"
    assert found == []


def test_nothing_below_the_families_imports_them():
    """The library's modules ask the registry (``amod.family``), never ``amod.families``: only the root package (which
    imports the family modules so that they register), the families themselves and the application import it."""
    below = [m for m in MODULES if _in(m, LIBRARY) and not _in(m, ("amod.families",))]
    found = sorted(f"{m} imports {t}" for m in below for t in GRAPH[m][2] if _in(t, ("amod.families",)))
    assert "amod.cost" in below and found == []


def test_the_root_package_is_library():
    """``import amod`` brings the library only: the root package imports no application module, not even lazily."""
    _, _, anywhere = GRAPH["amod"]
    assert [t for t in anywhere if _in(t, APPLICATION)] == []


# what names a model family: its classes, and the helpers that used to tell families apart
FAMILY_NAMES = ("is_hf_model", "is_detr_model", "VisionTransformer", "PreTrainedModel", "ViTModel", "DeiTModel",
                "Dinov2Model", "DetrModel", "DetrForObjectDetection", "DetrEncoderLayer", "CLIPVisionModel",
                "SiglipVisionModel", "ViTLayer", "Dinov2Layer", "CLIPEncoderLayer", "SiglipEncoderLayer")
# where they may appear: the adapters (what the Hugging Face families share included), Hugging Face loading and weights
# (amod.hf), and the application modules built around one family (amod.detect trains DETRs)
FAMILY_HOMES = ("amod.families", "amod.hf", "amod.detect")


def test_no_family_is_named_outside_its_adapter_and_the_registry():
    """In code (not in docstrings or comments): a family's class names and the old family checks."""
    found = []
    for module, path in MODULES.items():
        if _in(module, FAMILY_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if isinstance(node, ast.alias):
                name = node.name.rpartition(".")[2]
            if name in FAMILY_NAMES:
                found.append(f"{module}: {name}")
    assert found == []


def test_cycles_are_found_where_there_are_some():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", LIBRARY)
def test_the_library_does_not_import_training_or_experiments(layer):
    wrong = sorted(f"{m} imports {t}" for m, (_, _, anywhere) in GRAPH.items() if _in(m, (layer,))
                   for t in anywhere if _in(t, APPLICATION))
    assert [m for m in MODULES if _in(m, (layer,))], f"no module {layer}"
    assert wrong == []


@pytest.mark.parametrize("name", ["amod.merge", "amod.pretrained", "amod.train.checkpoint", "amod.detr",
                                  "amod.hf.adapter", "amod.hf.base", "amod.experiments.analysis",
                                  "amod.experiments.stats", "amod.experiments.finetune", "amod.experiments.study",
                                  "amod.hf.weights", "amod.detect.segmentation", "amod.detect.dense_frontier",
                                  "amod.experiments.finetune_study_plan", "amod.experiments.finetune_study_rows",
                                  "amod.experiments.finetune_study_report", "amod.experiments.finetune_study_loo",
                                  "amod.experiments.bench", "amod.experiments.evaluate",
                                  "amod.experiments.export_command", "amod.experiments.flops_command",
                                  "amod.experiments.opcount"])
def test_removed_modules_are_gone(name):
    """0.1.0 has no release: the deprecated alias and the old module paths were removed, not kept (a module moved to
    the room its name says, ``amod.detect.segmentation`` to ``amod.dense.segmentation``, leaves no alias behind)."""
    assert name not in MODULES
    with pytest.raises(ImportError):
        importlib.import_module(name)


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's package layout names every module: a top-level one as ``name.py`` at the start of its
    line, one in a sub-package by its name within that package's entry (``mod/ ... calibrate ...``)."""
    layout = LAYOUT + "\n  END"
    unnamed = []
    for path in MODULES.values():
        rel = path.relative_to(SRC)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if len(rel.parts) == 1:
            named = re.search(rf"^  {re.escape(path.name)}\b", layout, re.M) is not None
        else:
            entry = re.search(rf"^  {re.escape(rel.parts[0])}/(.*?)(?=^  \S)", layout, re.M | re.S)
            named = entry is not None and re.search(rf"\b{re.escape(path.stem)}\b", entry.group(1)) is not None
        if not named:
            unnamed.append(str(rel))
    assert unnamed == [], f"docs/architecture.md's package layout does not name {unnamed}"


def test_a_built_in_method_is_its_own_module_which_nothing_else_needs(tmp_path):
    """Each built-in method's class lives in the module of its mechanism, found by the registry in the source (no list
    names it): the modules that register a method are those of the registered built-ins, ``amod.methods`` holds
    none but the fallback ``Dense``, no module imports PPT's, and a fresh interpreter on the source tree, with no
    installed package's metadata to read, opens a PPT file."""
    import os
    import subprocess
    import sys

    import amod
    from amod.methods import Dense, builtin_method_modules, method_classes

    builtins = {cls.__module__ for cls in method_classes() if cls.__module__.startswith("amod.") and cls is not Dense}
    assert sorted(builtin_method_modules()) == sorted(builtins) and "amod.methods" not in builtins
    assert "amod.ppt" in builtins and not [m for m, (_, _, anywhere) in GRAPH.items() if "amod.ppt" in anywhere]
    path = tmp_path / "ppt.safetensors"
    model = amod.ppt.apply(__import__("timm").create_model("vit_tiny_patch16_224", pretrained=False, depth=4,
                                                           img_size=32, patch_size=8, num_classes=3), r=2)
    amod.save(model, path)
    code = ("import importlib.metadata as m, sys; m.distributions = lambda *a, **k: iter(()); import amod; "
            "print(amod.method_of(amod.load(sys.argv[1])).spec())")
    opened = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert opened.returncode == 0, opened.stderr[-2000:]
    assert opened.stdout.strip() == amod.method_of(model).spec()
