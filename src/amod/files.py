"""Writing files that a killed or failed process cannot leave half-written, and strict JSON.

Every file amod writes goes through ``atomic_write``: the bytes go to a temporary file beside the
target (``temporary_beside``: ``<name>.<random>.tmp``, created where no file of that name exists, so that it is never
a file of the user's), are flushed to disk, and the temporary file is renamed over the target only when it is
complete. On any failure the temporary file is removed and the previous file is left as it was;
a full disk is reported as ``DiskFullError`` naming the file. Files get the usual permissions
(0666 minus the process umask). ``write_together`` does the same for several files that must agree
(a run's metrics, weights and checkpoint): a failure changes none of them.

``dumps`` is ``json.dumps`` that never writes ``NaN``/``Infinity`` (not JSON): non-finite floats
become ``null``.

``load_torch`` is the one place amod reads a ``torch.save`` file (training checkpoints, caches, a user's
``.pth``): with ``weights_only=True``, so a crafted pickle cannot run code, and with errors that name the file.

``check_output_file`` refuses, before any work, a single output file that cannot be written or, without ``force``,
would replace one; ``read_json_lines`` reads the JSON-lines files amod appends to, naming the lines it skips (the
line reader of ``amod.train.resume.Journal``, the record of finished work every resumable command keeps);
``made_directory`` creates a command's output directory and removes it again, still empty, when the command fails.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import secrets
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np
import torch
from .errors import UserError

PathLike = Union[str, os.PathLike]
T = TypeVar("T")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
log = logging.getLogger("amod")


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


def _disk_full(code: int, path: Path) -> DiskFullError:
    return DiskFullError(code, f"no space left on device while writing {path}; "
                               f"the previous {path.name} (if any) was kept")


def temporary_beside(path: PathLike) -> Path:
    """A new, empty file in ``path``'s directory for writing ``path`` and renaming it into place: named
    ``<name>.<random>.tmp`` and created only where no file has that name (``O_EXCL``), so that neither another
    writer's temporary file nor a file of the user's (``m.onnx.tmp`` given as the input of the command that writes
    ``m.onnx``) is ever written over or removed. It gets the usual permissions (0666 minus the umask). Every
    temporary file amod writes is made here; the caller removes it on failure.

    Raises:
        DiskFullError: the device has no room for another file.
        OSError: the directory cannot be written.
    """
    path = Path(path)
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue  # (1 in 4 billion: draw another name)
        except OSError as e:
            if e.errno in _DISK_FULL:
                raise _disk_full(e.errno, path) from None
            raise


def _write_temporary(path: Path, write: Callable[[BinaryIO], Any]) -> Path:
    """Write the whole of a new ``temporary_beside(path)`` and flush it to disk; on any failure remove it and
    raise."""
    tmp = temporary_beside(path)
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
                    raise _disk_full(cause.errno, path) from None
                raise
    except BaseException as e:
        _remove_quietly(tmp)
        if isinstance(e, OSError) and not isinstance(e, DiskFullError) and e.errno in _DISK_FULL:
            raise _disk_full(e.errno, path) from None
        raise
    return tmp


def atomic_write(path: PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Write ``path`` by calling ``write(file)`` on a temporary file, then renaming it into place.

    Args:
        path: the destination; its directory must exist.
        write: writes the whole content to the binary file object it is given.

    Raises:
        DiskFullError: the device is full (the temporary file is removed, the old file kept).
        OSError: any other failure to write, with the same guarantees.
    """
    return write_together([(path, write)])[0]


def write_together(writes: Sequence[tuple[PathLike, Callable[[BinaryIO], Any]]]) -> list[Path]:
    """Write several files as one change: ``atomic_write`` of each, with every temporary file complete
    before the first rename.

    A failure while writing (a full disk) changes none of the files. The renames follow the order of
    ``writes``, so a process killed between two of them leaves the first files new and the rest old:
    put last the file that says the others are complete (a run's checkpoint).

    Args:
        writes: (destination, function writing its whole content to a binary file) pairs.

    Raises:
        DiskFullError: the device is full; names the file (temporary files are removed, old files kept).
        OSError: any other failure to write, with the same guarantees.
    """
    paths = [Path(p) for p, _ in writes]
    temporary: list[Path] = []
    try:
        for path, (_, write) in zip(paths, writes):
            temporary.append(_write_temporary(path, write))
        for tmp, path in zip(temporary, paths):
            try:
                os.replace(tmp, path)
            except OSError as e:
                if e.errno in _DISK_FULL:
                    raise _disk_full(e.errno, path) from None
                raise
    except BaseException:
        for tmp in temporary:  # those already renamed are gone: nothing to remove
            _remove_quietly(tmp)
        raise
    return paths


@contextmanager
def naming_a_full_disk(path: PathLike) -> Iterator[None]:
    """Report a full disk met inside the block as ``DiskFullError`` naming ``path`` (a plain ``OSError``
    from ``os.write`` names no file)."""
    try:
        yield
    except OSError as e:
        if e.errno in _DISK_FULL and not isinstance(e, DiskFullError):
            raise DiskFullError(e.errno, f"no space left on device while writing {path}") from None
        raise


def disk_full_error(e: BaseException, path: PathLike) -> Optional[DiskFullError]:
    """A ``DiskFullError`` naming ``path`` if a full disk is what ``e`` (or an exception it came from: a library
    that wraps the ``OSError`` of its failed write in an error of its own) reports; else None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return e
        if (isinstance(e, OSError) and e.errno in _DISK_FULL) or "No space left on device" in str(e):
            return DiskFullError(errno.ENOSPC, f"no space left on device while writing {path}")
        e = e.__cause__ or e.__context__
    return None


def check_output_file(path: PathLike, what: str = "the file", force: bool = True, option: str = "--out") -> Path:
    """Return ``path`` if ``what`` (e.g. "the .onnx file") can be written there: it is not a directory, its directory
    exists and this process can write in it (the file is written beside it, then renamed), and, unless ``force``, no
    file is there yet (a command's ``--out`` replaces one only with ``--force``). Creates nothing.

    Raises:
        ValueError: ``path`` is a directory.
        FileNotFoundError: its directory does not exist.
        PermissionError: its directory cannot be written.
        FileExistsError: a file is there and ``force`` is False.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory; give {what} to write")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"the directory of {path} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {path.parent} is not writable")
    if not force and (path.exists() or path.is_symlink()):
        raise FileExistsError(f"{option} {path} already exists; add --force to replace it")
    return path


def read_json_lines(path: PathLike, parse: Callable[[Any], Optional[T]], what: str) -> list[T]:
    """What ``parse`` makes of each line of the JSON-lines file ``path`` (none if there is no file), in order; a
    ``None`` from ``parse`` leaves a line out silently (a row of other settings).

    A line that is not JSON, or that ``parse`` refuses (ValueError, KeyError, TypeError: a torn last line after a
    kill, an edit), is left out too, and one warning names every such line: ``what`` is one line's kind in words
    ("an evaluation row")."""
    path = Path(path)
    if not path.exists():
        return []
    parsed: list[T] = []
    unreadable: list[int] = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            value = parse(json.loads(line))
        except (ValueError, KeyError, TypeError):
            if line.strip():
                unreadable.append(number)
            continue
        if value is not None:
            parsed.append(value)
    if unreadable:
        shown = ", ".join(map(str, unreadable[:10])) + (", ..." if len(unreadable) > 10 else "")
        log.warning("%s: %d line%s that %s not %s, skipped (line %s)", path, len(unreadable),
                    "s" if len(unreadable) > 1 else "", "are" if len(unreadable) > 1 else "is", what, shown)
    return parsed


def write_bytes(path: PathLike, data: bytes) -> Path:
    """``atomic_write`` of a bytes object."""
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: PathLike, text: str) -> Path:
    """``atomic_write`` of a UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


def torch_save(obj: Any, path: PathLike) -> Path:
    """``torch.save`` through ``atomic_write``."""
    return atomic_write(path, lambda f: torch.save(obj, f))


class UnreadableFileError(UserError):
    """A file amod was asked to read is missing its content: torn, corrupt, of another format, or a pickle
    that holds more than tensors and plain containers (which amod never unpickles)."""


def load_torch(path: PathLike) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: tensors, numbers, strings and their containers only.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        UnreadableFileError: the file is torn, corrupt, not a ``torch.save`` file, or a pickle of other objects
            (refused unread: it could run code); the message names the file and says which.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file at {path}")
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol it was not written with
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and storage errors of a torn, foreign or crafted file alike
        first = " ".join(str(e).split())
        if "GLOBAL" in first or "Unsupported global" in first:  # torch's refusal to unpickle an object
            raise UnreadableFileError(f"cannot read {path}: it is a pickle of objects other than tensors (amod does "
                                      "not unpickle those: they could run code)") from None
        detail = first.split("WeightsUnpickler error: ")[-1][:160] if "WeightsUnpickler" in first else first[:160]
        raise UnreadableFileError(f"{path} is corrupt or unreadable: torn, or not a torch.save file of tensors "
                                  f"({type(e).__name__}: {detail})") from None


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


@contextmanager
def made_directory(path: PathLike) -> Iterator[Path]:
    """Create the directory ``path`` (and its missing parents) for what the block writes there; if the block fails,
    remove again the directories this created that are still empty, so that a failed command leaves no empty folder
    behind (what the block did write is kept)."""
    path = Path(path)
    created = []  # the deepest first
    missing = path
    while not missing.exists() and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    with naming_a_full_disk(path):
        path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        for directory in created:
            try:
                directory.rmdir()
            except OSError:  # not empty (or not ours to remove): it and its parents stay
                break
        raise
