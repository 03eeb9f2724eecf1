"""What every resumable command keeps so that a killed one goes on where it stopped, in one format of each kind.

- **The journal of finished work** (``Journal``): an append-only JSON-lines file, one JSON object a line for each
  piece of work as it finishes (an evaluation, a measurement, a calibration, a timing round), each with the
  ``fingerprint`` of the settings it was made with. Reading it: a line that is not a row (torn by a kill mid-write,
  or edited) is left out with one warning naming it, and that work is done again; rows of another fingerprint stay in
  the file but are not used; of two rows with the same key, the one written last is used. A journal whose file name
  already names its settings (the frontier's ``frontier_rows_KEY_L2.jsonl``) is made without a fingerprint.
  Rows of an older format are read through the caller's ``older`` (they never make finished work run again).
- **The state of training in progress** (``training_state``, ``restore_training_state``, ``state_write``,
  ``load_training_checkpoint``): one ``torch.save`` dict of the model, optimizer, scheduler, random number generators
  and the routers' draws, with the command's own fields (its epoch or step, its settings), written atomically
  (``files.write_together``: after the files it completes) and read back with weights only. `amod train`/`finetune`
  (``checkpoint.pt``), the finetune study and the demo (each run's ``state.pt``) and `amod detect train` keep theirs so.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, BinaryIO, Callable, Hashable, Iterator, Optional

import numpy as np
import torch
from torch import nn

from .. import files
from ..errors import UserError
from ..mod.routers import SeededDraws
from ..provenance import provenance

log = logging.getLogger("amod")

Row = dict[str, Any]


class Journal:
    """The record of a command's finished work: ``path``, a JSON-lines file appended to one row at a time.

    Args:
        path: the file (none yet: nothing is finished).
        key: what identifies a row's work (``key(row)``); None: the rows are a sequence, keyed by their order.
        fingerprint: the settings the rows are bound to; ``add`` writes it into each row, and reading keeps the rows
            of this fingerprint alone. None: the file's name names the settings, and every row is used.
        what: one row's kind in words, for the warning about unreadable lines ("an evaluation row").
        use: of the rows of this fingerprint, those the caller takes (the others are counted in ``unused``).
        older: reads a row of an older format (one without ``fingerprint``) into this one.
    """

    def __init__(self, path: files.PathLike, key: Optional[Callable[[Row], Hashable]] = None,
                 fingerprint: Optional[str] = None, what: str = "a row", use: Optional[Callable[[Row], bool]] = None,
                 older: Optional[Callable[[Row], Row]] = None) -> None:
        self.path, self.fingerprint, self._key = Path(path), fingerprint, key
        self.unused = 0  # rows of this fingerprint that ``use`` did not take

        def parse(row: Any) -> Optional[tuple[Hashable, Row]]:
            if not isinstance(row, dict):
                raise TypeError("not a JSON object")
            if older is not None and "fingerprint" not in row:
                row = older(row)
            if fingerprint is not None and row["fingerprint"] != fingerprint:
                return None  # another setting's: kept in the file, not used
            if use is not None and not use(row):
                self.unused += 1
                return None
            return (key(row) if key is not None else None), row

        self.rows: dict[Hashable, Row] = {}
        for k, row in files.read_json_lines(self.path, parse, what):  # a torn line: said, then left out
            self.rows[len(self.rows) if key is None else k] = row  # a repeated key: the last row written wins
        # a torn last line has no newline: the next row starts on a line of its own
        self._torn_tail = self.path.is_file() and self.path.stat().st_size > 0 and not _ends_with_newline(self.path)

    def key_of(self, row: Row) -> Hashable:
        """The key ``row`` is kept under."""
        return len(self.rows) if self._key is None else self._key(row)

    def get(self, key: Hashable) -> Optional[Row]:
        """The row of ``key``'s finished work, or None: that work is still to do."""
        return self.rows.get(key)

    def add(self, row: Row) -> Row:
        """Append ``row`` (with the journal's fingerprint, and the amod that wrote it: ``amod.provenance``) and keep
        it; returns the row as kept. The line is flushed before this returns, so that work finished before a kill is
        not done again."""
        row = {"fingerprint": self.fingerprint, **row} if self.fingerprint is not None else dict(row)
        row.setdefault("amod", provenance())
        with files.naming_a_full_disk(self.path), open(self.path, "a") as f:
            f.write(("\n" if self._torn_tail else "") + files.dumps(row) + "\n")
            f.flush()
        self._torn_tail = False
        self.rows[self.key_of(row)] = row
        return row

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rows

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def values(self) -> list[Row]:
        """The rows used, in the order their keys were first written."""
        return list(self.rows.values())


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


# ---------------------------------------------------------------- the state of training in progress

TRAINING_CHECKPOINT_KEYS = frozenset({"model", "optimizer", "scheduler", "epoch", "rng", "config", "format"})


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's and torch's (CPU) random number generators, as tensors and plain containers."""
    np_state = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]]}


def set_rng_state(state: dict[str, Any]) -> None:
    """Set the generators to ``rng_state()``'s ``state``."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def router_state(model: nn.Module) -> dict[str, int]:
    """Call counters of routers that draw random numbers: part of the run state, not of the weights."""
    return {name: m.calls for name, m in model.named_modules() if isinstance(m, SeededDraws)}


def set_router_state(model: nn.Module, state: dict[str, int]) -> None:
    modules = dict(model.named_modules())
    for name, calls in state.items():
        modules[name].calls = calls


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, **fields: Any) -> dict[str, Any]:
    """What a run needs to go on from here as an unbroken one: the model, optimizer and scheduler, the random number
    generators (``rng``) and the routers' draws (``routers``), with the command's own ``fields`` (its ``epoch`` or
    ``step``, its settings)."""
    return {**fields, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "rng": rng_state(), "routers": router_state(model)}


def restore_training_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler: Any) -> None:
    """Put ``training_state``'s ``state`` back into ``model``, ``optimizer``, ``scheduler`` and the generators. (The
    finetune study's states written before this format name the routers' draws ``router``.)"""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    set_router_state(model, state.get("routers", state.get("router", {})))


def state_write(path: files.PathLike, state: dict[str, Any]) -> tuple[Path, Callable[[BinaryIO], Any]]:
    """``state`` as one write of ``files.write_together``: put it last, after the files it says are complete."""
    return Path(path), lambda f: torch.save(state, f)


def save_training_state(path: files.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (the previous state stays until the new one is whole)."""
    return files.write_together([state_write(path, state)])[0]


def load_training_checkpoint(path: Path, needed: frozenset[str] = TRAINING_CHECKPOINT_KEYS) -> dict[str, Any]:
    """Read a training state (a run's ``checkpoint.pt``; ``files.load_torch``: never unpickled beyond tensors and
    plain containers); refuse a missing, corrupt, crafted or foreign file with one clear message naming it.
    ``needed``: the entries the command's states hold (``amod train``'s by default)."""
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from at {path}")
    try:
        ckpt = files.load_torch(path)
    except files.UnreadableFileError as e:
        raise UserError(f"{e}; start a new run in another --out directory, the files there were left as they "
                        "are") from None
    if not isinstance(ckpt, dict) or not needed <= set(ckpt):
        raise UserError(f"checkpoint {path} is not an amod training checkpoint")
    return ckpt
