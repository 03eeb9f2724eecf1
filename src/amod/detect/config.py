"""The settings of one detection run (``amod detect``); importing it needs no ``transformers``."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..checkpoint import read_metadata
from ..families.detr import DetrFamily
from ..mod.routers import router_names
from ..train.rundir import check_output_dir
from ..errors import UserError
from ..flags import flag, positive_int


def check_detector_file(path: str | Path, option: str) -> None:
    """Refuse, before any work, a file that is not an ``amod.save`` file of a DETR (a ViT classifier, a foreign
    file), naming the option."""
    meta = read_metadata(Path(path).expanduser())  # (its own one-line errors name the file)
    try:
        info = json.loads(meta["amod.model"])
        name = info.get("hf") or info.get("arch")
    except (ValueError, AttributeError):
        name = None
    if name not in DetrFamily.classes:
        raise UserError(f"{option} {path} holds {'a ' + str(name) if name else 'no model amod can name'}, not a DETR; "
                        "give a detector `amod detect train` saved (its model.safetensors)")


@dataclass
class DetectConfig:
    """One detection run. ``init`` None: a new ``small_detr`` trained from scratch."""

    # (the comments of the fields `amod detect` takes are their flags' help: amod.flags)
    out: str = "runs/detect/dense"
    seed: int = 0
    init: Optional[str] = None  # an amod.save file of a DETR to finetune (default: a new small DETR)
    router: Optional[str] = None  # convert --init with this router (A-MoD: attention)
    encoder_cost: float = 0.5  # share of the dense encoder's MACs the converted encoder costs (the closest capacity)
    layers: Optional[list[int]] = None  # MoD encoder layers (default: alternate)
    canvas_size: int = 128
    train_canvases: int = flag(20000, type=positive_int)
    val_canvases: int = flag(1000, type=positive_int)
    data_seed: int = 0  # which canvases (the same for every run that compares)
    steps: int = 6000
    batch_size: int = flag(16, type=positive_int)
    lr: float = 2e-4
    weight_decay: float = 1e-4
    warmup: int = 200
    clip: float = 0.1  # DETR's gradient clipping
    eval_every: int = flag(500, type=positive_int)
    amp: str = flag("off", choices=("off", "bf16"))
    d_model: int = 128  # the new model's width (init None only)

    def validate(self) -> "DetectConfig":
        for name in ("canvas_size", "train_canvases", "val_canvases", "steps", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:  # (NaN too)
            raise UserError(f"lr must be positive, got {self.lr}")
        if self.amp not in ("off", "bf16"):
            raise UserError(f"amp must be 'off' or 'bf16', got {self.amp!r}")
        if self.router is not None and self.init is None:
            raise UserError("router converts a trained DETR: give init (an amod.save file of the dense detector)")
        if self.router is not None and self.router not in router_names("detr"):
            raise UserError(f"unknown router {self.router!r} for a DETR encoder; use one of "
                            f"{', '.join(router_names('detr'))}")
        if not 0 < self.encoder_cost <= 1:
            raise UserError(f"encoder_cost must be in (0, 1] (a share of the dense encoder's MACs), got "
                            f"{self.encoder_cost:g}")
        if self.init is not None:
            check_detector_file(self.init, "init")
        check_output_dir(self.out)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class DetectStudyConfig:
    """The detection study (``amod detect study``): ``dense`` converted at each encoder cost with each router,
    every (cost, router) finetuned ``seeds`` times, and the dense detector finetuned the same way."""

    dense: str  # the dense detector (a train run's model.safetensors)
    out: str = "runs/detect/study"
    costs: tuple[float, ...] = flag((0.5, 0.25), flag="cost")  # encoder costs, shares of the dense encoder's MACs
    routers: tuple[str, ...] = ("attention", "standard", "random", "feature-norm")
    layers: tuple[int, ...] = (1, 2, 3, 4, 5)
    seeds: int = flag(3, type=positive_int)
    steps: int = 300
    lr: float = 5e-5
    batch_size: int = 16
    train_canvases: int = 20000  # the dense run's data (the same canvases: data_seed 0)
    val_canvases: int = 1000
    canvas_size: int = 128
    speed_batch: int = 32
    speed_repeats: int = 10
    report_only: bool = False  # write the report from the finished runs; train nothing

    def validate(self) -> "DetectStudyConfig":
        """Refuse, before the first run trains, any setting that one of the study's runs would refuse."""
        check_detector_file(self.dense, "dense")
        if not self.costs:
            raise UserError("give at least one encoder cost")
        for cost in self.costs:
            if not 0 < cost < 1:
                raise UserError(f"each encoder cost must be in (0, 1) (a share of the dense encoder's MACs; the "
                                f"dense reference is always run), got {cost:g}")
        unknown = [r for r in self.routers if r not in router_names("detr")]
        if unknown or not self.routers:
            raise UserError(f"unknown router {unknown[0]!r} for a DETR encoder; use any of "
                            f"{', '.join(router_names('detr'))}" if unknown else "give at least one router")
        for name in ("seeds", "steps", "batch_size", "speed_batch", "speed_repeats"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        check_output_dir(self.out)
        for cost, router in [(None, None)] + [(c, r) for c in self.costs for r in self.routers]:
            run = self.run_config(cost, router, 0)
            dataclasses.replace(run, init=None, router=None).validate()  # its other settings (the file: above)
        return self

    def run_config(self, cost: Optional[float], router: Optional[str], seed: int) -> DetectConfig:
        name = "dense" if router is None else f"cost{cost:g}/{router}"
        return DetectConfig(out=str(Path(self.out) / name / f"seed{seed}"), seed=seed, init=self.dense, router=router,
                            encoder_cost=cost if cost is not None else 1.0,
                            layers=list(self.layers) if router is not None else None, steps=self.steps,
                            batch_size=self.batch_size, lr=self.lr, warmup=max(1, self.steps // 10),
                            eval_every=self.steps, train_canvases=self.train_canvases,
                            val_canvases=self.val_canvases, canvas_size=self.canvas_size)


# the fields that only one action of `amod detect` takes, and their flags (given to the other, they are refused)
DETECT_FIELDS = {"train": ("init", "router", "encoder_cost", "layers", "eval_every", "seed", "amp"),
                 "study": ("dense", "costs", "routers", "seeds", "report_only")}
DETECT_FLAGS = {"train": DETECT_FIELDS["train"], "study": ("dense", "cost", "routers", "seeds", "report_only")}
