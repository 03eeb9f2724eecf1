"""`amod calibrate`: a dense checkpoint made A-MoD calibrated (``amod.calibrate``) at a cost, on unlabeled images of
the data, and saved: the file runs, finetunes (``amod finetune --checkpoint FILE``) and exports as it is."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import check_dense_file, load, save
from ..cost import validate_cost
from ..mod.calibrate import calibrate
from ..mod.routers import router_class
from ..train.data import build_datasets
from ..train.models import fit_to_data

log = logging.getLogger("amod")


@dataclass
class CalibrateConfig:
    checkpoint: str  # the dense model: an amod .safetensors file
    out: str  # where the calibrated model is written (.safetensors)
    data: str = "fashion-mnist"  # where the unlabeled images come from (its training split; labels unread)
    img_size: Optional[int] = None  # input size; default the model's own
    cost: float = 0.5  # share of the dense MACs
    images: int = 256  # calibration images
    router: str = "attention"  # A-MoD; "random" for the control

    def validate(self) -> "CalibrateConfig":
        validate_cost(self.cost, "--cost")
        if self.images < 1:
            raise ValueError(f"--images must be a positive integer, got {self.images}")
        if not str(self.out).endswith(".safetensors"):
            raise ValueError(f"--out must name a .safetensors file, got {self.out!r}")
        if Path(self.out).resolve() == Path(self.checkpoint).resolve():
            raise ValueError("--out must not be the dense --checkpoint it starts from")
        if router_class(self.router).learnable:
            raise ValueError(f"--router {self.router} learns its scores; calibration uses no training: give "
                             "attention (A-MoD) or a control such as random")
        check_dense_file(self.checkpoint)
        return self


def run_calibrate(cfg: CalibrateConfig) -> Path:
    """Calibrate the dense checkpoint on the first ``images`` training images of the data and save it; returns the
    file. Prints every candidate's fidelity and the one chosen."""
    cfg.validate()
    dense = load(cfg.checkpoint).eval()
    img_size = cfg.img_size or dense.patch_embed.img_size[0]
    train, _, info = build_datasets(cfg.data, img_size, cfg.images, 1)
    fit_to_data(dense, info.in_chans, img_size)
    images = torch.stack([train[i][0] for i in range(min(cfg.images, len(train)))])
    model = calibrate(dense, images, cfg.cost, router=cfg.router)
    report = model.amod_calibration
    print(f"calibrated {cfg.checkpoint} at {img_size} px, cost {cfg.cost:g}, on {len(images)} {info.name} images "
          f"in {report.seconds:.1f} s:")
    print("| tilt | protect | capacity | cost | fidelity | |\n|---|---|---|---|---|---|")
    for i, c in enumerate(report.candidates):
        print(f"| {c.tilt:+g} | {c.protect:g} | {c.capacity:.3f} | {c.cost:.3f} | {c.fidelity:.5f} | "
              f"{'chosen' if i == report.chosen else ''} |")
    path = save(model, cfg.out)
    best = report.best
    shape = ",".join(f"{w:g}" for w in model.amod_config.shape)
    print(f"saved {path}: fold, tilt {best.tilt:+g}, protect {best.protect:g}, capacity {best.capacity:.3f} "
          f"(--skipped fold --protect {best.protect:g} --capacity {best.capacity:.3f} --shape {shape})")
    return path
