"""The finetune study's ``evals.jsonl``: one row per evaluation of a run, with each test image's correctness
packed in, appended as it happens; what makes the study resumable and its CIs paired."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ...cost import COST_DIGITS
from ...train.resume import Journal

log = logging.getLogger("amod")


def pack(correct: torch.Tensor) -> str:
    """Per-image correctness as hex of packed bits (2,000 images: 500 characters)."""
    return np.packbits(correct.numpy().astype(np.uint8)).tobytes().hex()


def unpack(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:n].astype(bool)


class EvalRows(Journal):
    """The study's ``evals.jsonl``: a ``train.resume.Journal`` of one row per evaluation, keyed by (seed, cost, arm,
    amp, step) and bound to the study's fingerprint; a torn last line, rows of other settings and repeated rows
    (the last one wins) are handled on reading."""

    def __init__(self, path: Path, fingerprint: str, distillation: Optional[str] = None) -> None:
        """``distillation``: the study's distillation settings and teacher in words; a distilled run's rows of
        other settings are not reused. The settings alone (no teacher, as a report reads them) take every teacher's
        rows of those settings; None: every row."""
        self.distillation = distillation

        def use(r: dict[str, Any]) -> bool:
            return distillation is None or r.get("distillation", distillation).startswith(distillation)

        super().__init__(path, lambda r: self.key(r["seed"], r["cost_target"], r["method"], r["amp"], r["step"]),
                         fingerprint, "an evaluation row", use)
        if self.unused:
            log.info("%s: %d rows of distilled runs with other distillation settings or another teacher, not "
                     "used (these settings: %s)", path, self.unused, distillation)

    @staticmethod
    def key(seed: Optional[int], cost: float, method: str, amp: str, step: int) -> tuple:
        return (seed, round(float(cost), COST_DIGITS), method, amp, step)  # (one key per cost point: same_cost)

    def get(self, seed: Optional[int], cost: float, method: str, amp: str,  # type: ignore[override]
            step: int) -> Optional[dict[str, Any]]:
        return self.rows.get(self.key(seed, cost, method, amp, step))
