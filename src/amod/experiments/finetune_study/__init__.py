"""The matched-cost finetune study on a backbone (`amod study --checkpoint BACKBONE`), one module a part: ``study``
runs it (every method set to a share of the dense MACs, finetuned with seeds, evaluated along the way), ``plan`` holds
its arms, settings and plan (``ARMS``, ``FinetuneConfig``, ``plan``), ``rows`` its ``evals.jsonl`` (``EvalRows``),
``report`` its report and curves, ``loo`` its leave-one-out of the finetuned models (``--leave-one-out``).

The study's own names (``finetune_run``, ``prepare``, ``run_finetune_study``, ...) are importable from this package as
from ``study``; ``study`` is imported when one of them is first asked for, so that importing ``plan`` (what `amod
study`'s flags are made of) does not import the study's runs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

# the names of ``study`` this package gives
STUDY_NAMES = ("CALIBRATION_NAME", "STUDY_CALIBRATED", "Distilled", "Prepared", "calibrations", "check_backbone",
               "check_study_inputs", "check_teacher", "correctness", "finetune_run", "kept_model_path", "prepare",
               "run_finetune_study", "saved_speeds", "speeds_of", "study_teacher", "weights_digest", "with_probe_head",
               "zero_training")

if TYPE_CHECKING:
    from .study import (CALIBRATION_NAME, STUDY_CALIBRATED, Distilled, Prepared, calibrations, check_backbone,
                        check_study_inputs, check_teacher, correctness, finetune_run, kept_model_path, prepare,
                        run_finetune_study, saved_speeds, speeds_of, study_teacher, weights_digest, with_probe_head,
                        zero_training)


def __getattr__(name: str) -> Any:
    if name in STUDY_NAMES:
        from . import study

        return getattr(study, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *STUDY_NAMES})
