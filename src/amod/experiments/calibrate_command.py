"""`amod calibrate`: a dense checkpoint made A-MoD calibrated (``amod.calibrate``) at a cost, on unlabeled images of
the data, and saved: the file runs, finetunes (``amod finetune --checkpoint FILE``) and exports as it is.

``CalibrationCache`` keeps the calibrations a sweep makes (`amod frontier`, the finetune study) so that a resumed one
reuses them.

The saved model takes the images the checkpoint took: the data's images are given to it (gray images to an RGB
model as gray RGB), not the model to the data, and only its position grid follows ``--img-size``."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..checkpoint import check_dense_file, load, load_weightless, save
from ..cost import validate_cost
from ..files import check_output_file
from ..methods import parse_method
from ..mod.calibrate import Calibrated, calibrate
from ..mod.convert import MoD
from ..train.data import DataInfo, build_datasets
from ..train.models import fit_to_data
from ..train.resume import Journal
from ..train.rundir import output_file_lock
from .presets import check_not_hugging_face
from ..errors import UserError
from ..flags import flag, positive_int

log = logging.getLogger("amod")


@dataclass
class CalibrateConfig:
    # (each field's comment is its flag's help: amod.flags)
    checkpoint: str  # the dense model: an amod .safetensors file
    out: str  # the calibrated model's file (.safetensors)
    data: str = "fashion-mnist"  # where the unlabeled images come from (its training split; labels unread)
    img_size: Optional[int] = flag(None, type=positive_int)  # input size; default the model's own
    cost: float = 0.5  # share of the dense MACs
    images: int = flag(256, type=positive_int)  # calibration images (the schedules are compared on the same images)
    method: str = flag("calibrated", metavar="SPEC")  # the calibration by its spec: its router (--router) decides
                                                      # whose scores are protected, attention (A-MoD) or a control
    force: bool = False  # replace --out if it exists

    def validate(self) -> "CalibrateConfig":
        """Check every setting, the checkpoint, the output file and the data's channels before any work; raises
        naming the flag."""
        validate_cost(self.cost, "--cost")
        if self.images < 1:
            raise UserError(f"--images must be a positive integer, got {self.images}")
        if not str(self.out).endswith(".safetensors"):
            raise UserError(f"--out must name a .safetensors file, got {self.out!r}")
        if Path(self.out).resolve() == Path(self.checkpoint).resolve():
            raise UserError("--out must not be the dense --checkpoint it starts from")
        check_output_file(self.out, "the .safetensors file", self.force)
        method = parse_method(self.method)
        if not isinstance(method, Calibrated):
            raise UserError(f"--method {self.method}: amod calibrate makes a calibrated model; give calibrated, "
                            "calibrated:router=random, ...")
        check_not_hugging_face(self.checkpoint, "--checkpoint", "calibrate", "a dense amod .safetensors file")
        check_dense_file(self.checkpoint)
        _, _, info = build_datasets(self.data, None, None, None)
        model_channels(load_weightless(self.checkpoint), info)
        return self


def model_channels(model: torch.nn.Module, info: DataInfo) -> int:
    """The input channels of ``model``, which the data's images are given in: as they are, or gray images repeated
    (an RGB model sees a gray image as gray RGB, which is what summing its filters to one channel computes). Raises
    ValueError where neither fits."""
    chans = model.patch_embed.proj.in_channels
    if info.in_chans not in (chans, 1):
        raise UserError(f"the model takes {chans}-channel images and {info.name} has {info.in_chans} channels: "
                        f"calibrate it on {chans}-channel (or gray) images")
    return chans


def run_calibrate(cfg: CalibrateConfig) -> Path:
    """Calibrate the dense checkpoint on the first ``images`` training images of the data and save it; returns the
    file. Prints every candidate's fidelity and the one chosen. ``out`` is held (``output_file_lock``) from the checks
    to the save: a second command writing the same file meanwhile is refused."""
    cfg.validate()
    with output_file_lock(cfg.out):
        check_output_file(cfg.out, "the .safetensors file", cfg.force)  # (again, held: one just ended may have)
        return _calibrate_and_save(cfg)


def calibrate_command(cfg: CalibrateConfig) -> None:
    """``amod calibrate``: ``run_calibrate``, which prints what it tried, chose and saved."""
    run_calibrate(cfg)


def _calibrate_and_save(cfg: CalibrateConfig) -> Path:
    dense = load(cfg.checkpoint).eval()
    img_size = cfg.img_size or dense.patch_embed.img_size[0]
    train, _, info = build_datasets(cfg.data, img_size, cfg.images, 1)
    chans = model_channels(dense, info)
    fit_to_data(dense, chans, img_size)  # the position grid only: the model keeps its channels
    images = torch.stack([train[i][0] for i in range(min(cfg.images, len(train)))])
    images = images.expand(-1, chans, -1, -1).contiguous()  # gray images as gray RGB for an RGB model
    method = parse_method(cfg.method)
    model = calibrate(dense, images, cfg.cost, router=method.router, tilts=method.tilts, protects=method.protects,
                      stages=method.stages)
    report = model.amod_calibration
    print(f"calibrated {cfg.checkpoint} at {img_size} px, cost {cfg.cost:g}, on {len(images)} {info.name} images "
          f"in {report.seconds:.1f} s:")
    if chans != info.in_chans:
        print(f"{info.name} is gray: each image was given to the {chans}-channel model in all {chans} channels (gray "
              f"RGB); the saved model keeps its {chans} input channels")
    print("\n".join(report.table()))
    path = save(model, cfg.out)
    print(f"saved {path}: fold, tilt {report.best.tilt:+g}, capacity {report.best.capacity:.3f} (--method "
          f"{MoD.of_model(model).spec()})")
    return path


# ---------------------------------------------------------------- the calibrations a sweep keeps

def calibration_grid(method: Calibrated) -> str:
    """The candidates ``method`` chooses among (its router, protects and tilts, and its stages where set), as a cache
    row names them (a grid of every block: as rows were named before stages)."""
    grid = (method.router, tuple(method.protects), tuple(method.tilts))
    return repr(grid if method.stages is None else (*grid, method.stages))


class CalibrationCache:
    """``amod.calibrate``'s choice at each (name, cost, grid), appended to a JSON-lines file as it is made, so that a
    resumed sweep reuses it (a calibration is deterministic, and takes up to a few minutes): a ``train.resume.Journal``
    without a fingerprint, the file named by what its calibrations depend on (the model, the images). `amod frontier`
    and the finetune study keep theirs in one of these.

    A row: ``method`` (the name), ``cost_target``, ``grid`` (``calibration_grid``), ``setting`` (the chosen ``MoD``'s
    fields) and ``report`` (``Calibration.report``, or what ``older`` rows kept). A torn line (a killed run) is
    skipped with a warning, and calibrated again.

    Args:
        path: the JSON-lines file.
        images: gives the calibration images (called once, when the first calibration is made).
        older: rows of an older file, by (name, cost, grid), taken (and appended to ``path``) where ``path`` has none.
    """

    def __init__(self, path: Path, images: Optional[Callable[[], torch.Tensor]],
                 older: Optional[dict[tuple[str, float, str], dict[str, Any]]] = None) -> None:
        self.path, self._images, self.older = path, images, older or {}
        self.images: Optional[torch.Tensor] = None
        self.journal = Journal(path, lambda row: (row["method"], row["cost_target"], row["grid"]),
                               what="a calibration")
        self.done: dict[tuple, dict[str, Any]] = self.journal.rows

    def get(self, name: str, cost: float, grid: str,
            make: Callable[[torch.Tensor], tuple[MoD, dict[str, Any]]]) -> tuple[MoD, dict[str, Any]]:
        """The method kept for (``name``, ``cost``, ``grid``) and its report; where there is none, ``make(images)``
        calibrates (returning the method and its ``Calibration.report``), and the row is appended."""
        key = (name, cost, grid)
        row = self.done.get(key)
        if row is None:
            row = self.older.get(key)
            if row is None:
                log.info("calibrating %s at cost %g on unlabeled images", name, cost)
                if self.images is None:
                    self.images = self._images()
                method, report = make(self.images)
                row = {"method": name, "cost_target": cost, "grid": grid, "setting": dataclasses.asdict(method),
                       "report": report}
            row = self.journal.add(row)
        setting = row["setting"]
        method = MoD(**{**setting, "layers": tuple(setting["layers"]),
                        "shape": None if setting["shape"] is None else tuple(setting["shape"])})
        return method, row["report"]
