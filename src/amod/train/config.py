"""A run's configuration: ``RunConfig`` (every field, with a comment each), its checks (types and
values, each error naming the option and what is allowed), and how it is put together for a command:
defaults (or, when resuming, the run's own) <- a YAML file <- the flags.

``RunConfig.method()`` is the ``amod.methods`` object its fields select; ``config.yaml`` and each
training checkpoint hold ``RunConfig.to_dict()``. The loop that runs it is ``amod.train.run``.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from ..cost import validate_cost
from ..methods import Dense, Method, MoD, method_from_run_fields, parse_method
from ..mod.config import MoDConfig, validate_capacity, validate_protect, validate_skipped
from ..mod.modes import skipped_mode
from . import engine
from .any_cost import NEEDS_MOD
from .distill import Distillation
from .models import checkpoint_architecture, saved_method
from ..errors import UserError

# Fields that only mean something for an MoD model (a router given).
MOD_ONLY = ("capacity", "layers", "scale_output", "router_seed", "skipped", "protect", "shape")
# Fields that select a method by themselves (``method_spec`` replaces them all, with MOD_ONLY).
METHOD_FIELDS = ("router", "isoflop", "tome_cost", "tome_r", "pitome_cost", "pitome_keep")
# Fields that only mean something for a distilled run (--distill or --teacher given).
DISTILL_ONLY = ("distill_logits", "distill_temperature", "distill_features")


@dataclass
class RunConfig:
    """Everything that defines a run; written to ``config.yaml`` and into each checkpoint."""

    # model
    model: str = "vit_tiny_patch16_224"  # timm architecture name
    pretrained: bool = False  # start from timm's pretrained weights (model hub)
    checkpoint: Optional[str] = None  # start from this file (amod safetensors, timm/DeiT .pth)
    img_size: Optional[int] = None  # input side; default: the data's
    patch_size: Optional[int] = None  # architecture overrides (None: the timm model's own)
    depth: Optional[int] = None
    embed_dim: Optional[int] = None
    num_heads: Optional[int] = None
    num_classes: Optional[int] = None  # default: the data's
    drop_path: float = 0.0  # stochastic depth rate
    # Mixture-of-Depths (router None = dense); the defaults are MoDConfig's
    router: Optional[str] = None
    capacity: float = MoDConfig.capacity
    layers: Optional[Union[str, list[int]]] = None  # None: the skipped mode's default_layers ("all" for fold)
    scale_output: Optional[bool] = None
    router_seed: Optional[int] = None  # seed of a router that draws (random, ...); None: --seed (mod:seed=S gives S)
    isoflop: bool = False  # train the isoFLOP dense baseline of (router, capacity, layers) instead
    skipped: str = MoDConfig.skipped  # what MoD blocks do with skipped tokens: bypass | merge | kv | fold
    protect: float = MoDConfig.protect  # fold: share of a fold block's patch tokens the router protects
    shape: Optional[list[float]] = None  # fold: one capacity exponent per block (from amod.calibrate)
    # token merging (ToMe) instead of MoD: a share of dense MACs to match, or tokens merged per block
    tome_cost: Optional[float] = None
    tome_r: Optional[Union[int, list[int]]] = None
    # PiToMe instead of MoD: a share of dense MACs to match, or the share of its patch tokens every block keeps
    pitome_cost: Optional[float] = None
    pitome_keep: Optional[float] = None  # (no flag: a PiToMe checkpoint's own, or a YAML file's)
    # any registered method by its spec, KIND:FIELD=VALUE,... (``amod.methods.parse_method``), instead of the fields
    # above: e.g. "tome:cost=0.5"; a built-in method's own fields are written from it (``validate``)
    method_spec: Optional[str] = None
    # distillation from a dense teacher (amod.train.distill): off unless --distill or --teacher
    distill: bool = False
    teacher: Optional[str] = None  # a dense model file with the data's classes (default: the starting weights)
    distill_logits: float = Distillation.logits  # soft-logit weight; the labels get 1 - it
    distill_temperature: float = Distillation.temperature
    distill_features: float = Distillation.features  # weight of 1 - cosine to the teacher's features
    # one finetune for every cost: an MoD model trained at a share of dense MACs drawn per step from [low, high]
    any_cost: Optional[list[float]] = None
    # data
    data: str = "fashion-mnist"
    train_limit: Optional[int] = None  # a fixed random subset of the training set
    val_limit: Optional[int] = None
    workers: int = 0  # DataLoader worker processes
    skip_bad_images: bool = False  # skip (and count) unreadable image files instead of stopping
    # optimisation
    epochs: int = 10
    batch_size: int = 128  # per process
    grad_accum: int = 1  # batches per optimizer step (gradient accumulation): batch_size * grad_accum per step
    eval_batch_size: int = 256
    lr: float = 1e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.01  # the cosine ends at lr * min_lr_ratio
    warmup_epochs: float = 1.0
    weight_decay: float = 0.05
    label_smoothing: float = 0.1
    clip_grad: float = 1.0  # max gradient norm; 0 = off
    seed: int = 0
    amp: str = "off"  # off | bf16
    eval_before_training: bool = False  # log epoch 0 (zero-training accuracy)
    out: str = "runs/run"

    def validate(self) -> "RunConfig":
        """Check every field; raises ValueError naming the option and what is allowed. Returns self."""
        check_types(self, "options")
        if self.method_spec is not None:
            self._expand_method_spec()
        if self.layers is None:  # the default the method itself would take, written out in config.yaml
            self.layers = skipped_mode(self.skipped).default_layers
        if self.router is not None:
            self.capacity = validate_capacity(self.capacity)
        validate_skipped(self.skipped)
        validate_protect(self.protect)
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
        if not (0.0 <= self.clip_grad < math.inf):
            raise UserError(f"--clip-grad must be >= 0 (0 turns clipping off), got {self.clip_grad}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.warmup_epochs < math.inf and 0 <= self.weight_decay < math.inf) \
                or not 0 <= self.label_smoothing < 1:
            raise UserError("--warmup-epochs and --weight-decay must be >= 0 and --label-smoothing in [0, 1)")
        merging = [name for name, given in (("token merging (--tome-cost/--tome-r)", (self.tome_cost, self.tome_r)),
                                            ("PiToMe (--pitome-cost)", (self.pitome_cost, self.pitome_keep)))
                   if given != (None, None)]
        if len(merging) > 1:
            raise UserError(f"give one of {' and '.join(merging)}, not both")
        if merging and (self.router is not None or self.isoflop):
            raise UserError(f"{merging[0]} replaces MoD: drop --router/--isoflop")
        if self.tome_cost is not None and self.tome_r is not None:
            raise UserError("give either --tome-cost or --tome-r, not both")
        if self.pitome_cost is not None and self.pitome_keep is not None:
            raise UserError("give either --pitome-cost or pitome_keep, not both")
        for name in ("tome_cost", "pitome_cost"):
            if getattr(self, name) is not None:
                validate_cost(getattr(self, name), f"--{_flag(name)}")
        if self.isoflop and self.router is None:
            raise UserError("--isoflop needs the MoD setup to match: give --router, --capacity and --layers")
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

    def _expand_method_spec(self) -> None:
        """Write the fields of the method ``method_spec`` selects where the method has fields of its own (the
        built-in methods: router, capacity, tome_cost, ...), so that the rest of the run reads them as if they had
        been given; refuses fields that select another method, and a method set to a cost on images."""
        spec = parse_method(self.method_spec)
        if spec.needs_images:
            raise UserError(f"--method {self.method_spec}: {spec.kind} chooses its setting on unlabeled images; "
                            "make the model with amod calibrate and start from it (--checkpoint)")
        own = method_from_run_fields(dataclasses.replace(self, method_spec=None))
        if not isinstance(own, Dense) and type(own) is not type(spec):  # (the same kind: a resumed run's own fields)
            raise UserError(f"--method {self.method_spec} and the options of {own.label()} select two methods; give "
                            "one of them")
        for name, value in spec.run_fields().items():
            if name != "method_spec":
                setattr(self, name, value)
        check_types(self, f"--method {self.method_spec}")

    def without_method(self) -> "RunConfig":
        """These settings with no method: the fields that select one (``METHOD_FIELDS``, ``method_spec``) and
        ``any_cost`` at their defaults (a distilled run's teacher from the starting weights, as a dense model)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{name: defaults[name] for name in (*METHOD_FIELDS, "method_spec",
                                                                               "any_cost")})

    def distillation(self) -> Distillation:
        """The distillation loss these settings select (used when ``distill``)."""
        return Distillation(self.distill_logits, self.distill_temperature, self.distill_features)

    def method(self) -> Method:
        """The method these settings select (``amod.methods``)."""
        return method_from_run_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "RunConfig":
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
    hints = typing.get_type_hints(RunConfig)
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


def mod_options_without_router(given: dict[str, Any], router: Optional[str], isoflop: bool) -> None:
    """Refuse MoD options given for a dense run, where they would be ignored without a word."""
    if router is None and not isoflop:
        _refuse_ignored(given, MOD_ONLY, "an MoD model; add --router (attention, standard, ...) or leave it out")


def mod_options_of_a_saved_method(cfg: RunConfig, given: dict[str, Any]) -> RunConfig:
    """``cfg`` with the method of its ``--checkpoint`` written in where MoD options are given without a method (no
    --router) and the file runs MoD or fold: ``--capacity`` is then the capacity it runs at (as ``amod eval
    --capacity`` turns the dial). The options that would rebuild its blocks (``--layers``, ``--skipped``, ...) are
    refused, and so is any MoD option for a file that runs another method (ToMe, PiToMe); a dense file, or any other,
    is left to ``mod_options_without_router``."""
    asked = [k for k in MOD_ONLY if k in given]
    if not asked or cfg.router is not None or cfg.isoflop or cfg.method_spec is not None or not cfg.checkpoint:
        return cfg
    saved = saved_method(cfg.checkpoint)
    if saved is None or isinstance(saved, Dense):
        return cfg
    flags = ", ".join(f"--{_flag(k)}" for k in asked)
    if not isinstance(saved, MoD):
        raise UserError(f"{flags} only {'applies' if len(asked) == 1 else 'apply'} to an MoD model; {cfg.checkpoint} "
                        f"runs {saved.label()}: drop {flags}")
    fixed = [f"--{_flag(k)}" for k in asked if k != "capacity"]
    if fixed:
        raise UserError(f"{cfg.checkpoint} already runs {saved.label()}, which {', '.join(fixed)} cannot change (only "
                        f"--capacity turns its dial): drop {', '.join(fixed)}")
    return dataclasses.replace(cfg, **{**saved.run_fields(), "capacity": cfg.capacity}).validate()


def method_spec_alone(given: dict[str, Any]) -> None:
    """Refuse ``--method`` given with the options of a method (``--router``, ``--tome-cost``, ...): one names it."""
    if given.get("method_spec") is not None:
        _refuse_ignored(given, METHOD_FIELDS + MOD_ONLY, "a run without --method: --method SPEC gives the whole "
                        "method (e.g. mod:router=attention,capacity=0.5); give one or the other")


def distill_options_without_distill(given: dict[str, Any], distill: bool, teacher: Optional[str]) -> None:
    """Refuse distillation's weights given for a run that does not distil, where they would be ignored without a
    word (``--teacher`` turns distillation on, ``--distill-logits`` and the others do not)."""
    if not distill and teacher is None:
        _refuse_ignored(given, DISTILL_ONLY, "a distilled run; add --distill (or --teacher FILE) or leave it out")


def resolve_run_config(flags: dict[str, Any], config: Optional[str] = None, resume: bool = False,
                       finetune: bool = False) -> RunConfig:
    """A run's configuration from: defaults (or, with ``resume``, the run's own) <- the YAML file <- flags.

    ``flags``: the options given on the command line, by field name. When resuming, anything given
    again must agree with the run (checked in ``train``).
    """
    base = RunConfig(eval_before_training=finetune).to_dict()
    yaml_values = load_yaml_config(config) if config else {}
    RunConfig.from_dict({**RunConfig().to_dict(), **yaml_values}, config or "options")  # its names and types
    if resume:
        out = flags.get("out", yaml_values.get("out", base["out"]))
        base = engine.load_training_checkpoint(Path(out) / "checkpoint.pt")["config"]
    base = {**base, **yaml_values, **flags}
    cfg = RunConfig.from_dict(base, config or "options")
    if finetune and not resume and not (cfg.pretrained or cfg.checkpoint):
        raise UserError("finetune starts from a trained model: give --pretrained or --checkpoint FILE")
    method_spec_alone({**yaml_values, **flags})
    if not resume:
        cfg = mod_options_of_a_saved_method(cfg, {**yaml_values, **flags})
    mod_options_without_router({**yaml_values, **flags}, cfg.router, cfg.isoflop)
    distill_options_without_distill({**yaml_values, **flags}, cfg.distill, cfg.teacher)
    if not resume and "model" in {**yaml_values, **flags} and cfg.checkpoint:
        # (RunConfig.model has a default, so only here can a given --model be told from it)
        arch = checkpoint_architecture(cfg.checkpoint)
        if arch is not None and arch[0] != cfg.model:
            raise UserError(f"--model {cfg.model} does not match {cfg.checkpoint}, which is a {arch[0]}: a model "
                            "saved by amod keeps its architecture; drop --model")
    return cfg


def load_yaml_config(path: Union[str, Path]) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; give the YAML file")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    odd = [k for k in data if not isinstance(k, str)]  # YAML reads `1:` as an int and `~:` as None
    if odd:
        raise UserError(f"config file {path}: option names are words (epochs, lr, ...), got the key {odd[0]!r}")
    return {k.replace("-", "_"): v for k, v in data.items()}
