"""A run's configuration: ``RunConfig`` (every field, with a comment each), its checks (types and
values, each error naming the option and what is allowed), and how it is put together for a command:
defaults (or, when resuming, the run's own) <- a YAML file <- the flags.

A run holds its method as its spec alone (``method_spec``; ``RunConfig.method()`` is the ``amod.methods`` object);
the shorthand options that build one (``--router``, ``--tome-cost``, ...) are ``amod.shorthand.SHORTHANDS``, read here
when a run is put together, and when a ``config.yaml`` or checkpoint written before reads back. ``config.yaml`` and
each training checkpoint hold ``RunConfig.to_dict()``. The loop that runs it is ``amod.train.run``.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import yaml

from ..methods import Dense, HoldsMethod, Method
from ..mod.convert import MoD
from ..shorthand import SHORTHANDS, SHORTHAND_NAMES, method_from_shorthand, with_shorthand
from . import engine
from ..flags import by_field_name, flag, load_yaml_config
from .any_cost import NEEDS_MOD
from .distill import Distillation
from .models import checkpoint_architecture, saved_method
from ..errors import UserError

# Fields that only mean something for a distilled run (--distill or --teacher given).
DISTILL_ONLY = ("distill_logits", "distill_temperature", "distill_features")


@dataclass
class RunConfig(HoldsMethod):
    """Everything that defines a run; written to ``config.yaml`` and into each checkpoint. Its method is
    ``method_spec``, parsed once and kept (``declared_method``: ``amod.methods.HoldsMethod``)."""

    spec_field: ClassVar[str] = "method_spec"
    no_method: ClassVar[Method] = Dense()

    # model
    model: str = "vit_tiny_patch16_224"  # timm model name
    pretrained: bool = False  # start from timm's pretrained weights (model hub)
    checkpoint: Optional[str] = None  # start from a file: an amod .safetensors, or a timm/DeiT .pth
    img_size: Optional[int] = None  # input side (default: the data's)
    patch_size: Optional[int] = None  # the architecture's patch size (default: the timm model's own)
    depth: Optional[int] = None  # its number of blocks (default: the timm model's own)
    embed_dim: Optional[int] = None  # its width (default: the timm model's own)
    num_heads: Optional[int] = None  # its attention heads (default: the timm model's own)
    num_classes: Optional[int] = None  # classifier outputs (default: the data's)
    drop_path: float = 0.0  # stochastic depth rate
    method_spec: Optional[str] = flag(None, flag="method", metavar="SPEC")  # a registered method by its spec,
                                                                            # KIND[:FIELD=VALUE,...], e.g.
                                                                            # tome:cost=0.5 or
                                                                            # mod:capacity=0.5,skipped=fold
                                                                            # (default: dense)
    # distillation from a dense teacher (amod.train.distill): off unless --distill or --teacher
    distill: bool = False  # learn from a dense teacher's outputs too (default teacher: the starting weights, frozen)
    teacher: Optional[str] = flag(None, metavar="FILE")  # the teacher: a dense model file with the data's classes
                                                         # (implies --distill)
    distill_logits: float = flag(Distillation.logits, metavar="W")  # weight of the soft-logit term (KL to the teacher
                                                                    # at the temperature); the labels' cross-entropy
                                                                    # gets 1 - W
    distill_temperature: float = flag(Distillation.temperature, metavar="T")  # softmax temperature of the soft-logit
                                                                              # term
    distill_features: float = flag(Distillation.features, metavar="W")  # weight of the feature term: 1 - cosine of
                                                                        # the model's and the teacher's features
    # one model for every cost: trained at a share of the dense MACs drawn per step from [LOW, HIGH] (12 evenly
    # spaced), so it serves the whole capacity dial (amod.set_capacity); evaluated and saved at its method's capacity
    any_cost: Optional[list[float]] = flag(None, nargs=2, metavar=("LOW", "HIGH"))  # an MoD model trained at a
                                                                                    # cost drawn per step from [LOW,
                                                                                    # HIGH], so one model serves
                                                                                    # every cost
    # data
    data: str = "fashion-mnist"  # fashion-mnist | imagefolder:PATH | flowers102 | oxford-pets | stanford-cars |
                                 # imagenet
    train_limit: Optional[int] = None  # train on a fixed random subset of N images
    val_limit: Optional[int] = None  # evaluate on a fixed random subset of N images
    workers: int = 0  # DataLoader worker processes
    skip_bad_images: bool = False  # skip unreadable image files (and count them) instead of stopping at the first
    # optimisation
    epochs: int = 10  # training epochs
    batch_size: int = 128  # images per process and batch
    grad_accum: int = flag(1, metavar="K")  # batches per optimizer step (gradient accumulation): a step sees K x
                                            # --batch-size
    eval_batch_size: int = 256
    lr: float = 1e-3  # peak AdamW learning rate
    router_lr: Optional[float] = flag(None, metavar="LR")  # peak AdamW learning rate of the parameters of a
                                                           # learned router (standard, hybrid) (default: --lr)
    min_lr_ratio: float = 0.01  # the cosine ends at lr * min_lr_ratio
    warmup_epochs: float = 1.0  # linear warm-up of the learning rate, in epochs
    weight_decay: float = 0.05  # AdamW's
    label_smoothing: float = 0.1  # of the cross-entropy
    clip_grad: float = 1.0  # max gradient norm (0: off)
    seed: int = 0  # seeds the data order, the weights a run draws, and a router that draws
    amp: str = flag("off", choices=engine.AMP_MODES)  # mixed precision
    eval_before_training: bool = False  # log epoch 0 (zero-training accuracy)
    out: str = "runs/run"  # run directory

    def validate(self) -> "RunConfig":
        """Check every field; raises ValueError naming the option and what is allowed. Returns self."""
        check_types(self, "options")
        if self.method_spec is not None:
            method = self.declared_method()
            if method.needs_images:
                raise UserError(f"--method {self.method_spec}: {method.kind} chooses its setting on unlabeled images; "
                                "make the model with amod calibrate and start from it (--checkpoint)")
            self.keep_method(method)  # (one spelling per method)
        if self.amp not in ("off", "bf16"):
            raise UserError(f"--amp must be off or bf16, got {self.amp!r}")
        for name in ("epochs", "batch_size", "grad_accum", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("img_size", "patch_size", "depth", "embed_dim", "num_heads", "num_classes", "train_limit",
                     "val_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{_flag(name)} must be a positive integer, got {value}")
        if self.embed_dim is not None and self.num_heads is not None and self.embed_dim % self.num_heads:
            raise UserError(f"--embed-dim {self.embed_dim} must be divisible by --num-heads {self.num_heads}")
        if self.img_size is not None and self.patch_size is not None and self.img_size % self.patch_size:
            raise UserError(f"--img-size {self.img_size} must be a multiple of --patch-size {self.patch_size}")
        if self.workers < 0:
            raise UserError(f"--workers must be >= 0, got {self.workers}")
        if not 0.0 <= self.drop_path < 1.0:
            raise UserError(f"--drop-path must be in [0, 1) (a stochastic-depth rate), got {self.drop_path}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be a positive number, got {self.lr}")
        if self.router_lr is not None and not (self.router_lr > 0 and math.isfinite(self.router_lr)):
            raise UserError(f"--router-lr must be a positive number, got {self.router_lr}")
        if not (0.0 <= self.clip_grad < math.inf):
            raise UserError(f"--clip-grad must be >= 0 (0 turns clipping off), got {self.clip_grad}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.warmup_epochs < math.inf and 0 <= self.weight_decay < math.inf) \
                or not 0 <= self.label_smoothing < 1:
            raise UserError("--warmup-epochs and --weight-decay must be >= 0 and --label-smoothing in [0, 1)")
        if self.pretrained and self.checkpoint:
            raise UserError("give either --pretrained or --checkpoint, not both")
        if self.teacher is not None:
            self.distill = True
        if self.distill:
            self.distillation().validate()
        if self.any_cost is not None:
            if len(self.any_cost) != 2 or not 0 < self.any_cost[0] < self.any_cost[1] <= 1:
                raise UserError(f"--any-cost takes LOW HIGH, shares of the dense MACs with 0 < LOW < HIGH <= 1, got "
                                f"{self.any_cost}")
            method = self.method()  # Dense with a --checkpoint: the file decides (``AnyCost`` checks the model)
            if not isinstance(method, MoD) and not (isinstance(method, Dense) and self.checkpoint):
                raise UserError(NEEDS_MOD)
        return self

    def without_method(self) -> "RunConfig":
        """These settings with no method (``method_spec`` and ``any_cost`` at their defaults): a distilled run's
        teacher from the starting weights, as a dense model."""
        return self.replace(method_spec=None, any_cost=None)

    def distillation(self) -> Distillation:
        """The distillation loss these settings select (used when ``distill``)."""
        return Distillation(self.distill_logits, self.distill_temperature, self.distill_features)

    def method(self) -> Method:
        """The method ``method_spec`` selects (``Dense`` without one), a router that draws seeded by the run's
        ``seed`` where the spec leaves its own seed unset (``Method.seeded``)."""
        return self.declared_method().seeded(self.seed)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "RunConfig":
        """The settings a ``config.yaml`` or a training checkpoint holds (``to_dict``). One written before a run's
        method was its spec alone holds the shorthand options instead (router, capacity, tome_cost, ...), every one
        at its default where not given: they are read as the method they selected."""
        data = with_method_spec(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"{source}: unknown keys {unknown}; known keys: {sorted(known)}")
        check_types(data, source)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    if tp in names:
        return names[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('an ').removeprefix('a ')}s"
    return str(tp)


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return any(_matches(value, a) for a in args)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def check_types(values: Any, source: str) -> None:
    """Raise a ValueError when a RunConfig field (of a RunConfig or a dict of fields) has the wrong type."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}  # (not the ClassVars of HoldsMethod)
    hints = {name: hint for name, hint in typing.get_type_hints(RunConfig).items() if name in fields}
    items = values.items() if isinstance(values, dict) else ((f, getattr(values, f)) for f in hints)
    for name, value in items:
        if name in hints and not _matches(value, hints[name]):
            raise UserError(f"{source}: {name} must be {_type_name(hints[name])}, got {value!r}")


def _refuse_ignored(given: dict[str, Any], names: tuple[str, ...], needs: str) -> None:
    """Refuse the options among ``names`` that ``given`` (by field name) holds, which the run would ignore without a
    word; ``needs``: what they apply to and what to do, in words."""
    ignored = [f"--{_flag(k)}" for k in names if k in given]
    if ignored:
        raise UserError(f"{', '.join(ignored)} only {'applies' if len(ignored) == 1 else 'apply'} to {needs}")


def with_method_spec(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config.yaml's or a training checkpoint's settings) with the shorthand options that files written
    before a run's method was its spec alone hold read as that method, into ``method_spec``."""
    old = {k: data[k] for k in SHORTHAND_NAMES if k in data}
    if not old:
        return data
    data = {k: v for k, v in data.items() if k not in old}
    if data.get("method_spec") is None:  # (where it is set, those files wrote the options from it)
        method = method_from_shorthand(old, lenient=True)
        data["method_spec"] = None if method is None else method.spec()
    return data


def _method_of_options(options: dict[str, Any], cfg: RunConfig, resume: bool) -> Method:
    """The method shorthand options given for a run select: by themselves (``--router``, ``--tome-cost``, ...), or,
    where they only adjust one (``--capacity``, ``--layers``, ...), the method of the run being resumed, or the
    capacity at which ``--checkpoint``'s MoD model runs (its dial, as ``amod eval --capacity`` turns it); anything
    else is refused in one line."""
    method = method_from_shorthand(options)
    if method is not None:
        return method
    flags = ", ".join(f"--{_flag(k)}" for k in options)
    alone = "applies" if len(options) == 1 else "apply"
    if resume:  # (its spec as given: a router seeded by the run's seed keeps that seed unset)
        own = cfg.declared_method()
    else:
        own = saved_method(cfg.checkpoint) if cfg.checkpoint else None
    if own is None or isinstance(own, Dense):
        raise UserError(f"{flags} only {alone} to an MoD model; add --router (attention, standard, ...) or leave "
                        f"{'it' if len(options) == 1 else 'them'} out")
    if any(s.kind != own.kind for s in SHORTHANDS if s.name in options):
        raise UserError(f"{flags} only {alone} to an MoD model; {cfg.checkpoint if not resume else 'the run'} runs "
                        f"{own.label()}: drop {flags}")
    fixed = [f"--{_flag(k)}" for k in options if k != "capacity"]
    if fixed and not resume:
        raise UserError(f"{cfg.checkpoint} already runs {own.label()}, which {', '.join(fixed)} cannot change (only "
                        f"--capacity turns its dial): drop {', '.join(fixed)}")
    return with_shorthand(own, options)


def distill_options_without_distill(given: dict[str, Any], distill: bool, teacher: Optional[str]) -> None:
    """Refuse distillation's weights given for a run that does not distil, where they would be ignored without a
    word (``--teacher`` turns distillation on, ``--distill-logits`` and the others do not)."""
    if not distill and teacher is None:
        _refuse_ignored(given, DISTILL_ONLY, "a distilled run; add --distill (or --teacher FILE) or leave it out")


def resolve_run_config(flags: dict[str, Any], config: Optional[str] = None, resume: bool = False,
                       finetune: bool = False) -> RunConfig:
    """A run's configuration from: defaults (or, with ``resume``, the run's own) <- the YAML file <- flags.

    ``flags``: the options given on the command line, by field name, and the shorthand options of a method
    (``amod.shorthand.SHORTHANDS``: router, capacity, tome_cost, ...), which a YAML file may hold too; they become the
    run's ``method_spec``. When resuming, anything given again must agree with the run (checked in ``train``).
    """
    yaml_values = by_field_name(RunConfig, load_yaml_config(config)) if config else {}  # (method: method_spec)
    given = {**yaml_values, **flags}
    options = {k: given.pop(k) for k in SHORTHAND_NAMES if k in given}
    source = config or "options"
    RunConfig.from_dict({**RunConfig().to_dict(), **given}, source)  # its names and types
    base = RunConfig(eval_before_training=finetune).to_dict()
    if resume:
        out = given.get("out", base["out"])
        base = RunConfig.from_dict(engine.load_training_checkpoint(Path(out) / "checkpoint.pt")["config"],
                                   str(Path(out) / "checkpoint.pt")).to_dict()
    cfg = RunConfig.from_dict({**base, **given}, source)
    if finetune and not resume and not (cfg.pretrained or cfg.checkpoint):
        raise UserError("finetune starts from a trained model: give --pretrained or --checkpoint FILE")
    if options:
        if given.get("method_spec") is not None:
            raise UserError(f"{', '.join(f'--{_flag(k)}' for k in options)} only "
                            f"{'applies' if len(options) == 1 else 'apply'} to a run without --method: --method SPEC "
                            "gives the whole method (e.g. mod:router=attention,capacity=0.5); give one or the other")
        cfg = cfg.with_method(_method_of_options(options, cfg, resume))
    distill_options_without_distill(given, cfg.distill, cfg.teacher)
    if not resume and "model" in given and cfg.checkpoint:
        # (RunConfig.model has a default, so only here can a given --model be told from it)
        arch = checkpoint_architecture(cfg.checkpoint)
        if arch is not None and arch[0] != cfg.model:
            raise UserError(f"--model {cfg.model} does not match {cfg.checkpoint}, which is a {arch[0]}: a model "
                            "saved by amod keeps its architecture; drop --model")
    return cfg.validate()
