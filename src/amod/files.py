"""Writing files that a killed or failed process cannot leave half-written, and strict JSON.

Every file amod writes goes through ``atomic_write``: the bytes go to ``<name>.tmp`` beside the
target, are flushed to disk, and the temporary file is renamed over the target only when it is
complete. On any failure the temporary file is removed and the previous file is left as it was;
a full disk is reported as ``DiskFullError`` naming the file. Files get the usual permissions
(0666 minus the process umask).

``dumps`` is ``json.dumps`` that never writes ``NaN``/``Infinity`` (not JSON): non-finite floats
become ``null``.
"""
from __future__ import annotations

import errno
import io
import json
import math
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Union

import numpy as np
import torch

PathLike = Union[str, os.PathLike]
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """The device ran out of space while amod wrote a file; the previous file was kept."""


class _RecordingWriter(io.RawIOBase):
    """A file wrapper that remembers the first ``OSError`` of a write.

    ``torch.save`` turns a failed write into a ``RuntimeError`` that no longer says why; the
    recorded error does.
    """

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self.f = f
        self.error: Union[OSError, None] = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def atomic_write(path: PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Write ``path`` by calling ``write(file)`` on a temporary file, then renaming it into place.

    Args:
        path: the destination; its directory must exist.
        write: writes the whole content to the binary file object it is given.

    Raises:
        DiskFullError: the device is full (the temporary file is removed, the old file kept).
        OSError: any other failure to write, with the same guarantees.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            f = _RecordingWriter(raw)
            try:
                write(f)
                raw.flush()
                os.fsync(raw.fileno())
            except BaseException as e:
                cause = f.error if f.error is not None else e
                if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
                    raise DiskFullError(cause.errno, f"no space left on device while writing {path}; "
                                                     f"the previous {path.name} (if any) was kept") from None
                raise
        os.replace(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp)
        if isinstance(e, OSError) and not isinstance(e, DiskFullError) and e.errno in _DISK_FULL:
            raise DiskFullError(e.errno, f"no space left on device while writing {path}; "
                                         f"the previous {path.name} (if any) was kept") from None
        raise
    return path


def write_bytes(path: PathLike, data: bytes) -> Path:
    """``atomic_write`` of a bytes object."""
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: PathLike, text: str) -> Path:
    """``atomic_write`` of a UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


def torch_save(obj: Any, path: PathLike) -> Path:
    """``torch.save`` through ``atomic_write``."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (numpy scalars and arrays included)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _finite(obj.tolist())
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON: like ``json.dumps``, but NaN and infinities are written as ``null``.

    Objects json cannot encode are passed through ``kwargs['default']`` (``str`` if not given).
    """
    kwargs.setdefault("default", str)
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def write_json(path: PathLike, obj: Any, indent: int = 2) -> Path:
    """Write ``obj`` as strict JSON, atomically."""
    return write_text(path, dumps(obj, indent=indent) + "\n")
