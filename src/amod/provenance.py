"""Which amod produced a result: its version and a digest of its source, written into every row a command keeps
(``train.resume.Journal``), so that a number can be traced to the code that measured it, and two rows of one setting
from different code are told apart. Imports nothing of amod."""
from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """The first 12 hex digits of the SHA-256 of amod's Python source (each module's path and bytes, in path order):
    the same for the same code whatever the version number says."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def provenance() -> dict[str, str]:
    """``{"version": amod's version, "source": source_digest()}``: what a kept row records of the code that wrote
    it."""
    return {"version": getattr(sys.modules.get(__package__), "__version__", "unknown"), "source": source_digest()}
