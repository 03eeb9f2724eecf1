"""The outputs amod writes into, directories and single files: checked before any work starts, and held by one
process at a time.

``check_output_dir`` refuses, with one message, a path that is a file, lies under a file, or cannot
be written, without creating anything. ``Lock`` is how an output is held: an exclusive ``flock`` on a lock file,
which the operating system releases when the process ends, however it ends, so that a lock file left by a killed
process blocks nobody. ``RunDirectory`` creates a directory, holds it (``.amod.lock`` inside) and copies the
``amod`` log into a file there while it is held; ``output_file_lock`` holds a command's single output file
(``.<name>.amod.lock`` beside it) while the command runs. A second process that asks for the same directory or file
is refused, and told which process holds it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import Optional, Union

from ..files import naming_a_full_disk
from ..errors import UserError

log = logging.getLogger("amod")
LOCK_NAME = ".amod.lock"


def check_output_dir(path: Union[str, os.PathLike], option: str = "--out") -> Path:
    """Return ``path`` if it is, or can be created as, a directory this process can write; else raise.

    Nothing is created. Raises ValueError naming the option and what is wrong.
    """
    if not str(path).strip():  # Path("") is ".": an empty option would write into the current directory
        raise UserError(f"{option} is empty; give a directory")
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{option} {path} is a file; give a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"{option} {path} is not writable")
        check_not_busy(path)
        return path
    parent = path.parent
    while not parent.exists():  # the nearest existing ancestor decides
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{option} {path} lies under {parent}, which is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path} cannot be created: {parent} is not writable")
    return path


def check_not_busy(path: Path) -> None:
    """Refuse a directory whose lock another process holds (creates nothing, takes nothing)."""
    lock_path = path / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody has held it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise UserError(_busy_message(path, lock_path)) from None
    finally:
        os.close(fd)  # closing releases a lock we may have taken


def _busy_message(path: Path, lock_path: Path, what: str = "run") -> str:
    return (f"{path} is in use by another amod {what} ({_holder(lock_path)}); "
            "wait for it to finish or choose another --out")


def _holder(lock_path: Path) -> str:
    try:
        pid = lock_path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid else "another process"


class Lock:
    """Hold ``lock_path``'s exclusive ``flock`` (creating the file, writing this process's id into it for the
    message of a refused process), for ``path``; the file is removed when released. Use as a context manager.

    Raises (on entering):
        ValueError: another process holds it, naming that process and ``what`` holds it ("run", "command").
        DiskFullError: no room for the lock file.
    """

    def __init__(self, path: Path, lock_path: Path, what: str = "run") -> None:
        self.path, self.lock_path, self.what = path, lock_path, what
        self._fd: Optional[int] = None

    def __enter__(self) -> "Lock":
        while True:
            with naming_a_full_disk(self.lock_path):
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UserError(_busy_message(self.path, self.lock_path, self.what)) from None
                raise
            try:  # a holder that was releasing may have removed the file we opened: lock the one at the path
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        try:
            # the pid is only for the message above: the lock itself is the flock, which dies with us
            with naming_a_full_disk(self.lock_path):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._fd is not None:
            try:
                try:  # removed while held, so that a process that opens it next finds no file or a new one
                    self.lock_path.unlink()
                except OSError:
                    pass
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None


class RunDirectory:
    """Create ``path``, hold its exclusive lock (``Lock``), and log into ``path / log_name`` while held.

    Use as a context manager. ``lock=False`` (ranks other than 0 under torchrun) only creates nothing
    and locks nothing, so that one process per run holds the directory.
    """

    def __init__(self, path: Union[str, os.PathLike], log_name: Optional[str] = "train.log", lock: bool = True) -> None:
        self.path = Path(path)
        self.log_name = log_name
        self.lock = lock
        self._lock: Optional[Lock] = None
        self._handler: Optional[logging.Handler] = None

    def __enter__(self) -> "RunDirectory":
        if not self.lock:
            return self
        with naming_a_full_disk(self.path):
            self.path.mkdir(parents=True, exist_ok=True)
        self._lock = Lock(self.path, self.path / LOCK_NAME).__enter__()
        try:
            if self.log_name:
                with naming_a_full_disk(self.path / self.log_name):
                    self._handler = logging.FileHandler(self.path / self.log_name)
                self._handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
                log.addHandler(self._handler)
        except BaseException:
            self.__exit__(None, None, None)  # a full disk: let the directory go again
            raise
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._handler is not None:
            log.removeHandler(self._handler)
            self._handler.close()
            self._handler = None
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None


def output_file_lock(path: Union[str, os.PathLike]) -> Lock:
    """The lock a command holds on its single output file ``path`` (``amod export --out``, ``amod calibrate --out``)
    from its checks to its last write: ``.<name>.amod.lock`` beside it, so that a second command writing the same file
    is refused instead of both reporting success and the last one's file winning. The directory must exist
    (``files.check_output_file`` first)."""
    path = Path(path)
    return Lock(path, path.with_name(f".{path.name}.amod.lock"), "command")


def run_dir_name(text: str) -> str:
    """A directory or file name for a variant's label: lower case, anything not alphanumeric as ``_``."""
    return "".join(c if c.isalnum() else "_" for c in text.lower()).strip("_")
