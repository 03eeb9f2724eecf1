"""amod's one error type for a user's mistake, and the errors the ``amod`` command reports in one line.

``UserError`` is what amod raises when the user can fix the cause: a bad argument or flag, a refused combination,
a missing or malformed file, bad data, an optional package that is not installed. It is a ``ValueError``, so code
that catches ``ValueError`` keeps working; its subclasses that were other built-in errors before keep those bases
too (``UnsupportedModelError`` is a ``TypeError``, ``MissingDependencyError`` an ``ImportError``).

The ``amod`` command prints an error in ``USER_ERRORS`` as one line and exits with status 2; anything else is a bug
in amod: it shows the traceback and exits with status 1.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from safetensors import SafetensorError
from yaml import YAMLError


class UserError(ValueError):
    """An error the user caused and can fix (an argument, a flag, a file, the data, a refused combination); the
    message says what was wrong and what is allowed."""


class MissingDependencyError(UserError, ImportError):
    """An optional package that is not installed; the message says how to install it."""


class UnsupportedModelError(UserError, TypeError):
    """A model, block or use of a model that amod does not take (a ``TypeError`` as before this type existed)."""


# what the amod command reports in one line with exit status 2: amod's own error and the file/format errors of
# what it reads with (the OS; safetensors, YAML and JSON files; text that is not UTF-8)
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, OSError, SafetensorError, YAMLError,
                                                json.JSONDecodeError, UnicodeDecodeError)


def one_line(e: BaseException) -> str:
    """An exception as one line for the user: the OS error's own words and file, or the message."""
    if isinstance(e, OSError) and e.strerror:
        named = e.filename is None or str(e.filename) in e.strerror
        text = e.strerror if named else f"{e.strerror}: {e.filename}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


@contextmanager
def warnings_as_lines(command: str) -> Iterator[None]:
    """amod's own warnings (e.g. a fold capacity below its floor) as one line, ``amod COMMAND: warning: ...``;
    other packages' warnings as Python shows them."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if os.path.abspath(filename).startswith(package):
            print(f"amod {command}: warning: {' '.join(str(message).split())}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def setup_logging() -> None:
    """amod's log as plain lines on stderr (rank 0 only under torchrun). A run directory adds its own log file
    (``amod.train.rundir.RunDirectory``) once the run's settings have been checked."""
    log = logging.getLogger("amod")
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)


def _refused_on_every_process(e: BaseException) -> bool:
    """Whether ``e`` is ``train.engine.RefusedOnEveryProcess`` (only a command that imported the engine raises one)."""
    engine = sys.modules.get("amod.train.engine")
    return engine is not None and isinstance(e, engine.RefusedOnEveryProcess)


def _method_package_at_fault(e: BaseException) -> Optional[str]:
    """The method of another package whose code raised ``e`` (``amod.methods.package_at_fault``; only a command that
    consulted the method registry can have run one)."""
    methods = sys.modules.get("amod.methods")
    return None if methods is None else methods.package_at_fault(e.__traceback__)


def run_reporting_errors(command: str, run: Callable[[], int], debug: bool = False) -> int:
    """``run()``'s exit status as the ``amod`` command ``command`` reports it: an error in ``USER_ERRORS`` as one line
    and status 2; any other error, a bug in amod, as its traceback and status 1 (``debug``: the traceback of
    either, raised); Ctrl-C as status 130. amod's own warnings print as one line each (``warnings_as_lines``)."""
    try:
        with warnings_as_lines(command):
            return run() or 0
    except KeyboardInterrupt:
        print("amod: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _refused_on_every_process(e):  # under torchrun: see RefusedOnEveryProcess's docstring for the exit status
            if debug:
                raise e.cause from None
            if os.environ.get("RANK", "0") == "0":
                print(f"amod {command}: error: {one_line(e.cause)} (every torchrun process stopped before "
                      "training)", file=sys.stderr)
            return 0
        if debug:  # the traceback of either kind, from Python (exit status 1)
            raise
        if not isinstance(e, USER_ERRORS):  # a bug in amod, or in a method another package registered
            traceback.print_exc()
            plugin = _method_package_at_fault(e)
            if plugin is not None:
                print(f"amod {command}: internal error ({type(e).__name__}) in {plugin}: this is a bug in that "
                      "package, not in amod or in what it was given; please report it to its authors with the "
                      "traceback above", file=sys.stderr)
                return 1
            print(f"amod {command}: internal error ({type(e).__name__}): this is a bug in amod, not in what it was "
                  "given; please report it with the traceback above", file=sys.stderr)
            return 1
        print(f"amod {command}: error: {one_line(e)}", file=sys.stderr)
        return 2
