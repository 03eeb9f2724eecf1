"""Distillation from a dense teacher: the loss, the teacher, and a per-image store of its outputs.

A reduced model (MoD, fold, ToMe, PiToMe) is finetuned against its labels and against a dense teacher's outputs
on the same images:

    loss = (1 − logits) · CE(student, labels)
           + logits · T² · KL(softmax(teacher / T) ‖ softmax(student / T))
           + features · (1 − cos(student features, teacher features))

where the features are what the classifier reads (timm's pre-logits: the class token after the final norm; for a
distilled DeiT, whose two heads read its class and distillation tokens and whose logits are the mean of theirs, the
mean of the two tokens). The teacher runs without gradients in eval mode; it is the dense model a user finetuned
(``--teacher FILE``) or the dense starting weights, frozen.

On data without random augmentation the teacher's outputs for an image never change, so ``TeacherOutputs`` keeps
them per image index on disk: every later run (of any method, any seed) that reads the image pays nothing for the
teacher.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from ..errors import UserError
from ..flags import flag

log = logging.getLogger("amod")


@dataclass(frozen=True)
class Distillation:
    """The weights of the distillation terms (see the module docstring)."""

    # (each field's comment is its --distill-* flag's help: amod.flags)
    logits: float = flag(0.5, metavar="W")  # weight of the soft-logit term (KL to the teacher at the temperature); the
                                            # labels' cross-entropy gets 1 - W
    temperature: float = flag(1.0, metavar="T")  # softmax temperature of the soft-logit term
    features: float = flag(0.0, metavar="W")  # weight of the feature term: 1 - cosine of the model's and the teacher's
                                              # features

    def validate(self) -> "Distillation":
        if not 0.0 <= self.logits <= 1.0:
            raise UserError(f"--distill-logits is the soft-logit term's weight in [0, 1] (the labels get the rest), "
                            f"got {self.logits}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise UserError(f"--distill-temperature must be a positive number, got {self.temperature}")
        if not (0.0 <= self.features < math.inf):
            raise UserError(f"--distill-features must be >= 0, got {self.features}")
        if self.logits == 0 and self.features == 0:
            raise UserError("distillation with both weights 0 is plain finetuning: give --distill-logits or "
                            "--distill-features above 0, or leave distillation off")
        return self

    def text(self) -> str:
        """The settings in words, as the reports and evaluation rows name them."""
        return f"logits {self.logits:g}, T {self.temperature:g}, features {self.features:g}"

    def loss(self, logits: torch.Tensor, features: Optional[torch.Tensor], teacher_logits: torch.Tensor,
             teacher_features: Optional[torch.Tensor], labels: torch.Tensor,
             label_smoothing: float = 0.0) -> torch.Tensor:
        """The training loss of one batch (float32)."""
        logits = logits.float()
        loss = (1.0 - self.logits) * F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        if self.logits:
            t = self.temperature
            soft = F.kl_div(F.log_softmax(logits / t, dim=-1), F.log_softmax(teacher_logits.float() / t, dim=-1),
                            reduction="batchmean", log_target=True)
            loss = loss + self.logits * t * t * soft
        if self.features:
            cosine = F.cosine_similarity(features.float(), teacher_features.float(), dim=-1)
            loss = loss + self.features * (1.0 - cosine).mean()
        return loss


def classifiers_of(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules that turn features into logits (timm's ``get_classifier()``): one, or a distilled DeiT's two (on
    its class and distillation tokens; the model averages their logits)."""
    inner = getattr(model, "module", model)  # DistributedDataParallel
    get = getattr(inner, "get_classifier", None)
    heads = get() if callable(get) else None
    heads = tuple(heads) if isinstance(heads, (tuple, list)) else (heads,)
    if not all(isinstance(head, nn.Module) and not isinstance(head, nn.Identity) for head in heads):
        raise UserError(f"{type(inner).__name__} has no classifier (timm's get_classifier) to distill into: "
                        "distillation trains a model with a classification head")
    return heads


@contextlib.contextmanager
def head_inputs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside, every forward of ``model`` appends what each of its classifiers read to the yielded list."""
    seen: list[torch.Tensor] = []
    handles = [head.register_forward_hook(lambda module, args, output: seen.append(args[0]))
               for head in classifiers_of(model)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def training_loss(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, distillation: Optional[Distillation],
                  teacher: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
                  label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's training loss and the model's logits: the labels' cross-entropy, or, with ``distillation``, its
    loss against ``teacher(x)`` (a ``Teacher``, or kept outputs of the same images)."""
    if distillation is None:
        logits = model(x)
        return F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing), logits
    logits, features = forward_with_features(model, x, distillation.features > 0)
    return distillation.loss(logits, features, *teacher(x), labels, label_smoothing=label_smoothing), logits


def forward_with_features(model: nn.Module, x: torch.Tensor, want_features: bool
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``model(x)`` and, when asked, the features its classifier read in that forward (a distilled DeiT's: the mean
    of what its two heads read, timm's pre-logits)."""
    if not want_features:
        return model(x), None
    heads = len(classifiers_of(model))
    with head_inputs(model) as seen:
        logits = model(x)
    if len(seen) != heads:
        raise RuntimeError(f"the model's {heads} classifier{'s' if heads > 1 else ''} ran {len(seen)} times in one "
                           f"forward; distilling features needs each to run once")
    return logits, sum(seen) / heads


class Teacher:
    """A frozen copy of a dense model whose logits and features the student learns from."""

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        classifiers_of(self.model)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = forward_with_features(self.model, x, True)
        return logits.float(), features.float()

    def check_student(self, student: nn.Module, sample: torch.Tensor, features: bool = True) -> None:
        """Refuse a student whose classes (or, with ``features``, feature width) differ from the teacher's, in one
        line."""
        with torch.no_grad():
            was = student.training
            student.eval()
            logits, student_features = forward_with_features(student, sample[:1], True)
            student.train(was)
            t_logits, t_features = self(sample[:1])
        if logits.shape[-1] != t_logits.shape[-1]:
            raise UserError(f"the teacher has {t_logits.shape[-1]} classes and the model {logits.shape[-1]}: "
                            "distill from a teacher trained on the same classes")
        if features and student_features.shape[-1] != t_features.shape[-1]:
            raise UserError(f"the teacher's features have {t_features.shape[-1]} channels and the model's "
                            f"{student_features.shape[-1]}: feature distillation needs the same width (or --distill-features 0)")


class TeacherOutputs:
    """The teacher's logits and features per image index of a dataset without random augmentation, kept in
    ``folder`` (three .npy files) as they are computed; safe to kill at any time (a row counts once its flag is
    written, after its values)."""

    def __init__(self, folder: Path, size: int, classes: int, width: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.logits = self._array("logits", (size, classes), np.float32)
        self.features = self._array("features", (size, width), np.float32)
        self.have = self._array("have", (size,), np.bool_)

    def _array(self, name: str, shape: tuple[int, ...], dtype) -> np.memmap:
        path = self.folder / f"{name}.npy"
        if path.exists():
            array = np.load(path, mmap_mode="r+")
            if array.shape == shape and array.dtype == dtype:
                return array
            log.warning("%s holds another shape %s (not %s): computed again", path, array.shape, shape)
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    def __call__(self, teacher: Teacher, x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's (logits, features) for the images ``x`` at dataset ``indices``, computing the missing."""
        idx = indices.cpu().numpy()
        missing = ~self.have[idx]
        if missing.any():
            logits, features = teacher(x[torch.from_numpy(missing)])
            rows = idx[missing]
            self.logits[rows] = logits.cpu().numpy()
            self.features[rows] = features.cpu().numpy()
            self.have[rows] = True
        return (torch.from_numpy(np.asarray(self.logits[idx])).to(x.device),
                torch.from_numpy(np.asarray(self.features[idx])).to(x.device))

    def flush(self) -> None:
        for array in (self.logits, self.features, self.have):
            array.flush()
