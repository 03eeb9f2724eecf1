"""The finetune study's ``evals.jsonl``: one row per evaluation of a run, with each test image's correctness
packed in, appended as it happens; what makes the study resumable and its CIs paired."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..files import dumps, read_json_lines

log = logging.getLogger("amod")


def pack(correct: torch.Tensor) -> str:
    """Per-image correctness as hex of packed bits (2,000 images: 500 characters)."""
    return np.packbits(correct.numpy().astype(np.uint8)).tobytes().hex()


def unpack(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:n].astype(bool)


class EvalRows:
    """The study's ``evals.jsonl``: one row per evaluation, appended as it happens; a torn last line,
    rows of other settings and repeated rows (the last one wins) are handled on reading."""

    def __init__(self, path: Path, fingerprint: str, distillation: Optional[str] = None) -> None:
        """``distillation``: the study's distillation settings and teacher in words; a distilled run's rows of
        other settings are not reused. The settings alone (no teacher, as a report reads them) take every teacher's
        rows of those settings; None: every row."""
        self.path, self.fingerprint, self.distillation = path, fingerprint, distillation
        self.rows: dict[tuple, dict[str, Any]] = {}
        other_teacher = 0

        def mine(r: dict[str, Any]) -> Optional[tuple[tuple, dict[str, Any]]]:
            nonlocal other_teacher
            if r["fingerprint"] != fingerprint:
                return None
            if distillation is not None and not r.get("distillation", distillation).startswith(distillation):
                other_teacher += 1
                return None
            return self.key(r["seed"], r["cost_target"], r["method"], r["amp"], r["step"]), r

        # a torn last line after a kill, or an edit: said, then left out (the runs redo them)
        self.rows.update(read_json_lines(path, mine, "an evaluation row"))
        if other_teacher:
            log.info("%s: %d rows of distilled runs with other distillation settings or another teacher, not "
                     "used (these settings: %s)", path, other_teacher, distillation)

    @staticmethod
    def key(seed: Optional[int], cost: float, method: str, amp: str, step: int) -> tuple:
        return (seed, round(float(cost), 6), method, amp, step)

    def get(self, seed: Optional[int], cost: float, method: str, amp: str, step: int) -> Optional[dict[str, Any]]:
        return self.rows.get(self.key(seed, cost, method, amp, step))

    def add(self, row: dict[str, Any]) -> None:
        row = {"fingerprint": self.fingerprint, **row}
        with open(self.path, "a") as f:
            f.write(dumps(row) + "\n")
            f.flush()
        self.rows[self.key(row["seed"], row["cost_target"], row["method"], row["amp"], row["step"])] = row
