"""The settings of one detection run (``amod detect``); importing it needs no ``transformers``."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from ..checkpoint import read_metadata
from ..families.detr import DetrFamily
from ..methods import HoldsMethod
from ..mod.convert import MoD
from ..shorthand import with_shorthand
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
class DetectConfig(HoldsMethod):
    """One detection run. ``init`` None: a new ``small_detr`` trained from scratch. Its ``method`` spec is parsed
    once and kept (``declared_method``)."""

    spec_field: ClassVar[str] = "method"

    # (the comments of the fields `amod detect` takes are their flags' help: amod.flags)
    out: str = "runs/detect/dense"
    seed: int = 0
    init: Optional[str] = None  # an amod.save file of a DETR to finetune (default: a new small DETR)
    method: Optional[str] = None  # convert --init's encoder with this MoD method, by its spec (e.g.
                                  # mod:router=attention,layers=[1,2,3,4,5]; default layers: alternate); its
                                  # capacity is set by --encoder-cost
    encoder_cost: float = 0.5  # share of the dense encoder's MACs the converted encoder costs (the closest capacity)
    canvas_size: int = 128
    train_canvases: int = flag(20000, type=positive_int)
    val_canvases: int = flag(1000, type=positive_int, flag="val-limit", aliases=("val-canvases",))  # canvases
                                                                                                    # scored (AP)
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

    def encoder_method(self) -> Optional[MoD]:
        """The MoD method ``init``'s encoder is converted with (a router that draws seeded by the run's ``seed``
        unless its spec gives one), or None: the run converts nothing. Raises a UserError for another method, a
        router DETR's encoder does not take, or a capacity (``encoder_cost`` sets it)."""
        if self.method is None:
            return None
        method = self.declared_method()
        if type(method) is not MoD:
            raise UserError(f"amod detect converts the encoder with MoD; {self.method!r} is not an MoD spec "
                            "(mod:router=...,layers=...)")
        if method.router not in router_names("detr"):
            raise UserError(f"unknown router {method.router!r} for a DETR encoder; use one of "
                            f"{', '.join(router_names('detr'))}")
        if method.capacity != MoD.capacity:
            raise UserError(f"{self.method!r} sets a capacity; the encoder's capacity is the one --encoder-cost "
                            "asks for: drop capacity= from the spec")
        return method.seeded(self.seed)

    def with_shorthand(self, options: dict[str, Any]) -> "DetectConfig":
        """This run with its conversion adjusted by the shorthand options (``--router``, ``--layers``: None, not
        given); ``--router`` alone makes one, ``--layers`` adjusts one that ``--router`` or ``--method`` makes."""
        options = {k: v for k, v in options.items() if v is not None}
        if isinstance(options.get("layers"), list):  # --layers 1 2 3: each word read as train's --layers reads it
            words = options["layers"]
            options["layers"] = words[0] if len(words) == 1 else tuple(i for w in words for i in
                                                                       (w if isinstance(w, tuple) else (w,)))
        if not options:
            return self
        if self.method is None and "router" not in options:
            raise UserError("--layers sets the MoD conversion's layers: give --router (or --method) too")
        base = self.declared_method() if self.method is not None else MoD()
        return self.with_method(with_shorthand(base, options))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DetectConfig":
        """The configuration a run saved (``to_dict``); one saved before a run held its conversion as a spec
        (``router`` and ``layers``, amod up to f875d91) reads as the same spec."""
        values = dict(values)
        router, layers = values.pop("router", None), values.pop("layers", None)
        if router is not None:
            values["method"] = with_shorthand(MoD(), {"router": router, "layers": layers}).spec()
        return cls(**values)

    def validate(self) -> "DetectConfig":
        """Check every setting before any work; returns the configuration with its method in one spelling (the
        spec's), as a run saves it."""
        for name in ("canvas_size", "train_canvases", "val_canvases", "steps", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:  # (NaN too)
            raise UserError(f"lr must be positive, got {self.lr}")
        if self.amp not in ("off", "bf16"):
            raise UserError(f"amp must be 'off' or 'bf16', got {self.amp!r}")
        method = self.encoder_method()
        if method is not None and self.init is None:
            raise UserError("method converts a trained DETR: give init (an amod.save file of the dense detector)")
        if not 0 < self.encoder_cost <= 1:
            raise UserError(f"encoder_cost must be in (0, 1] (a share of the dense encoder's MACs), got "
                            f"{self.encoder_cost:g}")
        if self.init is not None:
            check_detector_file(self.init, "init")
        check_output_dir(self.out)
        return self if method is None else self.with_method(self.declared_method())  # (its spec in one spelling)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class DetectStudyConfig(HoldsMethod):
    """The detection study (``amod detect study``): ``dense`` converted at each encoder cost with each router,
    every (cost, router) finetuned ``seeds`` times, and the dense detector finetuned the same way."""

    spec_field: ClassVar[str] = "method"

    dense: str  # the dense detector (a train run's model.safetensors)
    out: str = "runs/detect/study"
    costs: tuple[float, ...] = flag((0.5, 0.25), flag="cost")  # encoder costs, shares of the dense encoder's MACs
    routers: tuple[str, ...] = ("attention", "standard", "random", "feature-norm")
    # every router's conversion: this MoD spec with the router set (layers 1-5: alternate layers cannot bring the
    # encoder below about half its cost)
    method: str = flag("mod:layers=[1,2,3,4,5]", flag=None)
    seeds: int = flag(3, type=positive_int)
    steps: int = 300
    lr: float = 5e-5
    batch_size: int = 16
    train_canvases: int = 20000  # the dense run's data (the same canvases: data_seed 0)
    val_canvases: int = flag(1000, flag="val-limit")  # (amod detect's --val-limit, as train's)
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
        if "router=" in self.method:
            raise UserError(f"the study's method {self.method!r} sets a router; the study sets each of --routers")
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
            if router is not None:
                run.encoder_method()  # its conversion (the file: above)
            dataclasses.replace(run, init=None, method=None).validate()  # its other settings
        return self

    def run_config(self, cost: Optional[float], router: Optional[str], seed: int) -> DetectConfig:
        name = "dense" if router is None else f"cost{cost:g}/{router}"
        method = None if router is None else with_shorthand(self.declared_method(), {"router": router})
        return DetectConfig(out=str(Path(self.out) / name / f"seed{seed}"), seed=seed, init=self.dense,
                            encoder_cost=cost if cost is not None else 1.0, steps=self.steps,
                            batch_size=self.batch_size, lr=self.lr, warmup=max(1, self.steps // 10),
                            eval_every=self.steps, train_canvases=self.train_canvases,
                            val_canvases=self.val_canvases, canvas_size=self.canvas_size).with_method(method)


def router_help() -> str:
    """``amod detect train --router``'s help: the routers a DETR encoder takes."""
    return f"shorthand for --method mod:router=ROUTER, one of {', '.join(router_names('detr'))}"


# the fields that only one action of `amod detect` takes, and their flags (given to the other, they are refused)
DETECT_FIELDS = {"train": ("init", "method", "encoder_cost", "eval_every", "seed", "amp"),
                 "study": ("dense", "costs", "routers", "seeds", "report_only")}
DETECT_SHORTHAND = ("router", "layers")  # amod detect train's shorthand options for its method
DETECT_FLAGS = {"train": DETECT_FIELDS["train"] + DETECT_SHORTHAND, "study": ("dense", "cost", "routers", "seeds", "report_only")}
