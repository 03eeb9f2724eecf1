"""A training run: its configuration, its directory, and the loop from start (or resume) to the end.

Run directory layout:
    config.yaml        the full resolved configuration
    metrics.jsonl/.csv one row per epoch (epoch 0 = before training, for finetuning)
    checkpoint.pt      resumable state: model, optimiser, scheduler, epoch, RNG states, config
    model.safetensors  weights + architecture + MoD config: all `amod eval` needs
    summary.json       final metrics, cost, and what was run
"""
from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

from .. import files
from ..cost import flops, validate_cost
from ..methods import Method, method_from_run_fields
from ..mod.config import DEFAULT_PROTECT, validate_capacity, validate_protect, validate_skipped
from . import engine
from .checkpoint import to_bytes as model_bytes
from .data import DataInfo, build_datasets
from .models import build_model, checkpoint_architecture, checkpoint_settings
from .rundir import RunDirectory, check_output_dir

log = logging.getLogger("amod")
CHECKPOINT_FORMAT = 1
# Fields that may differ between a run and its resumption (not epochs: the learning-rate schedule is made for them).
RESUMABLE_CHANGES = {"out", "workers", "eval_batch_size", "skip_bad_images"}
# Fields that only mean something for an MoD model (a router given).
MOD_ONLY = ("capacity", "layers", "scale_output", "skipped", "protect")


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
    # Mixture-of-Depths (router None = dense)
    router: Optional[str] = None
    capacity: float = 0.5
    layers: Optional[Union[str, list[int]]] = None  # None: "all" for skipped=fold, "alternate" otherwise
    scale_output: Optional[bool] = None
    isoflop: bool = False  # train the isoFLOP dense baseline of (router, capacity, layers) instead
    skipped: str = "bypass"  # what MoD blocks do with skipped tokens: bypass | merge | kv | fold
    protect: float = DEFAULT_PROTECT  # fold: share of a fold block's patch tokens the router protects
    # token merging (ToMe) instead of MoD: a share of dense MACs to match, or tokens merged per block
    tome_cost: Optional[float] = None
    tome_r: Optional[Union[int, list[int]]] = None
    # data
    data: str = "fashion-mnist"
    train_limit: Optional[int] = None  # a fixed random subset of the training set
    val_limit: Optional[int] = None
    workers: int = 0  # DataLoader worker processes
    skip_bad_images: bool = False  # skip (and count) unreadable image files instead of stopping
    # optimisation
    epochs: int = 10
    batch_size: int = 128  # per process
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
        if self.layers is None:  # the default the method itself would take, written out in config.yaml
            self.layers = "all" if self.skipped == "fold" else "alternate"
        if self.router is not None:
            self.capacity = validate_capacity(self.capacity)
        validate_skipped(self.skipped)
        validate_protect(self.protect)
        if self.amp not in ("off", "bf16"):
            raise ValueError(f"--amp must be off or bf16, got {self.amp!r}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("img_size", "patch_size", "depth", "embed_dim", "num_heads", "num_classes", "train_limit",
                     "val_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)} must be a positive integer, got {value}")
        if self.embed_dim is not None and self.num_heads is not None and self.embed_dim % self.num_heads:
            raise ValueError(f"--embed-dim {self.embed_dim} must be divisible by --num-heads {self.num_heads}")
        if self.img_size is not None and self.patch_size is not None and self.img_size % self.patch_size:
            raise ValueError(f"--img-size {self.img_size} must be a multiple of --patch-size {self.patch_size}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if not 0.0 <= self.drop_path < 1.0:
            raise ValueError(f"--drop-path must be in [0, 1) (a stochastic-depth rate), got {self.drop_path}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if not (0.0 <= self.clip_grad < math.inf):
            raise ValueError(f"--clip-grad must be >= 0 (0 turns clipping off), got {self.clip_grad}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.warmup_epochs < math.inf and 0 <= self.weight_decay < math.inf) \
                or not 0 <= self.label_smoothing < 1:
            raise ValueError("--warmup-epochs and --weight-decay must be >= 0 and --label-smoothing in [0, 1)")
        if (self.tome_cost is not None or self.tome_r is not None) and (self.router is not None or self.isoflop):
            raise ValueError("token merging (--tome-cost/--tome-r) replaces MoD: drop --router/--isoflop")
        if self.tome_cost is not None and self.tome_r is not None:
            raise ValueError("give either --tome-cost or --tome-r, not both")
        if self.tome_cost is not None:
            validate_cost(self.tome_cost, "--tome-cost")
        if self.isoflop and self.router is None:
            raise ValueError("--isoflop needs the MoD setup to match: give --router, --capacity and --layers")
        if self.pretrained and self.checkpoint:
            raise ValueError("give either --pretrained or --checkpoint, not both")
        return self

    def method(self) -> Method:
        """The method these settings select (``amod.methods``)."""
        return method_from_run_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "RunConfig":
        data = renamed_keys(data, source)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}; known keys: {sorted(known)}")
        check_types(data, source)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys renamed in a release, mapped for one more: old name -> new name (a warning says so).
RENAMED = {"merge_cost": "tome_cost", "merge_r": "tome_r"}


def renamed_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` with deprecated keys under their new names (a config file or checkpoint written before)."""
    old = [k for k in data if k in RENAMED]
    if not old:
        return data
    for k in old:
        if RENAMED[k] in data and data[RENAMED[k]] is not None and data[k] is not None:
            raise ValueError(f"{source}: give {RENAMED[k]} or its old name {k}, not both")
        if data[k] is not None:
            log.warning("%s: %s is deprecated, use %s", source, k, RENAMED[k])
    out = {k: v for k, v in data.items() if k not in RENAMED}
    for k in old:
        if data[k] is not None or RENAMED[k] not in out:
            out[RENAMED[k]] = data[k]
    return out


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
            raise ValueError(f"{source}: {name} must be {_type_name(hints[name])}, got {value!r}")


def mod_options_without_router(given: dict[str, Any], router: Optional[str], isoflop: bool) -> None:
    """Refuse MoD options given for a dense run, where they would be ignored without a word."""
    if router is None and not isoflop:
        ignored = [f"--{_flag(k)}" for k in MOD_ONLY if k in given]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} only {'applies' if len(ignored) == 1 else 'apply'} to an "
                             "MoD model; add --router (attention, standard, ...) or leave it out")


def resolve_run_config(flags: dict[str, Any], config: Optional[str] = None, resume: bool = False,
                       finetune: bool = False) -> RunConfig:
    """A run's configuration from: defaults (or, with ``resume``, the run's own) <- the YAML file <- flags.

    ``flags``: the options given on the command line, by field name. When resuming, anything given
    again must agree with the run (checked in ``train``).
    """
    base = RunConfig(eval_before_training=finetune).to_dict()
    yaml_values = renamed_keys(load_yaml_config(config), config) if config else {}
    RunConfig.from_dict({**RunConfig().to_dict(), **yaml_values}, config or "options")  # its names and types
    if resume:
        out = flags.get("out", yaml_values.get("out", base["out"]))
        base = engine.load_training_checkpoint(Path(out) / "checkpoint.pt")["config"]
    base = {**renamed_keys(base, "checkpoint"), **yaml_values, **flags}
    cfg = RunConfig.from_dict(base, config or "options")
    if finetune and not resume and not (cfg.pretrained or cfg.checkpoint):
        raise ValueError("finetune starts from a trained model: give --pretrained or --checkpoint FILE")
    mod_options_without_router({**yaml_values, **flags}, cfg.router, cfg.isoflop)
    if not resume and "model" in {**yaml_values, **flags} and cfg.checkpoint:
        # (RunConfig.model has a default, so only here can a given --model be told from it)
        arch = checkpoint_architecture(cfg.checkpoint)
        if arch is not None and arch[0] != cfg.model:
            raise ValueError(f"--model {cfg.model} does not match {cfg.checkpoint}, which is a {arch[0]}: a model "
                             "saved by amod keeps its architecture; drop --model")
    return cfg


def run_dir_name(text: str) -> str:
    """A directory or file name for a variant's label: lower case, anything not alphanumeric as ``_``."""
    return "".join(c if c.isalnum() else "_" for c in text.lower()).strip("_")


def load_yaml_config(path: Union[str, Path]) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def train(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) training as ``cfg`` says; returns the final summary.

    Everything a user can get wrong (settings, data, model, the output directory) is checked before
    anything is written. The run directory is locked for the duration of the run. Under
    ``torchrun`` every process calls this; rank 0 alone writes files.
    """
    cfg = _from_checkpoint_file(cfg.validate())
    out = check_output_dir(cfg.out)
    ckpt_path = out / "checkpoint.pt"
    state = None
    if resume:
        state = engine.load_training_checkpoint(ckpt_path)
        _check_resumable(_from_checkpoint_file(RunConfig.from_dict(state["config"], str(ckpt_path))), cfg)
    elif ckpt_path.exists():
        raise ValueError(f"{out} already holds a run (checkpoint.pt); pass --resume to continue it or choose another --out")
    train_ds, val_ds, info = build_datasets(cfg.data, cfg.img_size, cfg.train_limit, cfg.val_limit)
    num_classes = _num_classes(cfg, info)
    dist_info = engine.setup_distributed()
    try:
        if len(train_ds) < dist_info.world:
            raise ValueError(f"{len(train_ds)} training image{'' if len(train_ds) == 1 else 's'} for "
                             f"{dist_info.world} processes: each process needs at least one; give more images "
                             "(--train-limit) or start fewer processes")
        engine.seed_everything(cfg.seed)
        model = build_model(cfg, num_classes, info.in_chans, cfg.img_size or info.img_size).to(dist_info.device)
        with RunDirectory(out, lock=dist_info.main):
            if state is None and ckpt_path.exists():  # another run finished here while we were getting ready
                raise ValueError(f"{out} already holds a run (checkpoint.pt); pass --resume to continue it")
            return _train(cfg, model, state, train_ds, val_ds, info, dist_info)
    finally:
        engine.teardown_distributed()


def _from_checkpoint_file(cfg: RunConfig) -> RunConfig:
    """``cfg`` with what a model saved by amod decides written in: its architecture and, when no method is
    given, its method (so config.yaml, train.log and summary.json say what runs). Raises ValueError for
    settings the file cannot honour."""
    settings = checkpoint_settings(cfg)
    return dataclasses.replace(cfg, **settings).validate() if settings else cfg


def _num_classes(cfg: RunConfig, info: DataInfo) -> int:
    """The classifier's size: the data's classes unless --num-classes says more."""
    if cfg.num_classes is None:
        return info.num_classes
    if cfg.num_classes < info.num_classes:
        raise ValueError(f"--num-classes {cfg.num_classes} is smaller than the {info.num_classes} classes of "
                         f"{info.name} (labels 0..{info.num_classes - 1}); drop it to use the data's")
    return cfg.num_classes


def _train(cfg: RunConfig, model: torch.nn.Module, state: Optional[dict[str, Any]], train_ds, val_ds,
           info: DataInfo, dist_info: engine.Dist) -> dict[str, Any]:
    """The loop, once the run directory is held."""
    out = Path(cfg.out)
    ckpt_path = out / "checkpoint.pt"
    start_epoch = 1 if state is None else state["epoch"] + 1
    cost = flops(model)
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    steps_per_epoch = len(engine.make_loader(train_ds, cfg.batch_size, True, cfg.seed, 0, dist_info))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, engine.warmup_cosine(
        cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch), cfg.min_lr_ratio))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        engine.set_rng_state(state["rng"])
        engine.set_router_state(model, state.get("routers", {}))
        log.info("resumed %s after epoch %d", out, state["epoch"])
    train_model = DistributedDataParallel(model) if dist_info.world > 1 else model

    writer = engine.MetricsWriter(out, dist_info.main)
    if dist_info.main:
        files.write_text(out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if state is None:
            writer.clear()  # rows of an earlier attempt killed before its first checkpoint
        else:
            writer.truncate_after(state["epoch"])
    log.info("%s: %s on %s (%d train / %d val images), %.4f GMACs per image (%.3f of dense)", out,
             cfg.method().label(), info.name, len(train_ds), len(val_ds), cost.gmacs, cost.ratio)

    bad_images = engine.BadImages(skip=cfg.skip_bad_images)
    val_loader = engine.make_loader(val_ds, cfg.eval_batch_size, False, cfg.seed, 0, dist_info, cfg.workers)
    last_saved = None if state is None else state["epoch"]
    if start_epoch == 1 and cfg.eval_before_training:
        metrics = engine.evaluate(model, val_loader, dist_info.device, cfg.amp, dist_info, bad_images=bad_images)
        writer.write({"epoch": 0, **{f"val_{k}": v for k, v in metrics.items()}})
        log.info("epoch 0 (before training): val top1 %.4f loss %.4f", metrics["top1"], metrics["loss"])
    for epoch in range(start_epoch, cfg.epochs + 1):
        loader = engine.make_loader(train_ds, cfg.batch_size, True, cfg.seed, epoch, dist_info, cfg.workers)
        try:
            row = engine.train_one_epoch(train_model, loader, optimizer, scheduler, cfg, dist_info, epoch,
                                         bad_images=bad_images)
            metrics = engine.evaluate(model, val_loader, dist_info.device, cfg.amp, dist_info, bad_images=bad_images)
            _check_finite(model, metrics, epoch)
        except engine.NonFiniteError as e:
            kept = (f"{out} keeps the checkpoint of epoch {last_saved}, the last finite one"
                    if last_saved else "no checkpoint was written")
            raise engine.NonFiniteError(f"training stopped: {e}; {kept}") from None
        row = {"epoch": epoch, **row, **{f"val_{k}": v for k, v in metrics.items()}}
        log.info("epoch %d/%d: train loss %.4f acc %.4f | val top1 %.4f top5 %.4f loss %.4f | %.0fs",
                 epoch, cfg.epochs, row["train_loss"], row["train_acc"], metrics["top1"], metrics["top5"],
                 metrics["loss"], row["epoch_time_s"])
        if dist_info.main:
            # One change of the run directory: a failure (a full disk) leaves every file at the previous
            # epoch. The renames go row, weights, then checkpoint, so a process killed among them leaves
            # the row (and weights) ahead of the checkpoint, never behind: a resume drops the row and
            # trains the epoch again.
            resumable = {"format": CHECKPOINT_FORMAT, "epoch": epoch, "config": cfg.to_dict(),
                         "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "rng": engine.rng_state(),
                         "routers": engine.router_state(model)}
            weights = model_bytes(model)
            files.write_together([*writer.updates(row), (out / "model.safetensors", lambda f: f.write(weights)),
                                  (ckpt_path, lambda f: torch.save(resumable, f))])
            writer.log_scalars(row)
        last_saved = epoch
    if bad_images.paths:
        log.warning("skipped %d unreadable images (first: %s)", len(bad_images.paths), next(iter(bad_images.paths)))
    return _summary(cfg, out, cost, dist_info, _rank_checksums(model, dist_info), len(bad_images.paths))


def _check_finite(model: torch.nn.Module, metrics: dict[str, float], epoch: int) -> None:
    """A run whose validation loss or weights are no longer finite has diverged: nothing of it is saved."""
    if not math.isfinite(metrics["loss"]):
        raise engine.NonFiniteError(f"the validation loss is {metrics['loss']} after epoch {epoch}; lower --lr")
    bad = next((name for name, p in model.state_dict().items()
                if p.is_floating_point() and not torch.isfinite(p).all()), None)
    if bad is not None:
        raise engine.NonFiniteError(f"weight {bad} is not finite after epoch {epoch}; lower --lr")


def _rank_checksums(model: torch.nn.Module, dist_info: engine.Dist) -> list[float]:
    """A checksum of the weights on every rank; DDP must leave them identical."""
    total = sum(p.double().sum().item() + p.double().abs().sum().item() for p in model.state_dict().values()
                if p.is_floating_point())
    if dist_info.world == 1:
        return [total]
    gathered = [None] * dist_info.world
    torch.distributed.all_gather_object(gathered, total)
    if len(set(gathered)) != 1:
        raise RuntimeError(f"weights differ across ranks after training: checksums {gathered}")
    return gathered


def _summary(cfg: RunConfig, out: Path, cost: Any, dist_info: engine.Dist, checksums: list[float],
             skipped_images: int) -> dict[str, Any]:
    rows = engine.read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    last = rows[-1] if rows else {}
    summary = {"variant": cfg.method().label(), "epochs": cfg.epochs, "macs": cost.macs, "flop_ratio": cost.ratio,
               "val_top1": last.get("val_top1"), "val_top5": last.get("val_top5"), "val_loss": last.get("val_loss"),
               "val_images": last.get("val_images"), "skipped_images": skipped_images,
               "out": str(out), "world_size": dist_info.world, "rank_weight_checksums": checksums}
    if dist_info.main:
        files.write_json(out / "summary.json", summary)
    return summary


def _check_resumable(saved: RunConfig, now: RunConfig) -> None:
    if now.epochs != saved.epochs:
        raise ValueError(f"cannot resume with --epochs {now.epochs}: the learning-rate schedule of this run was made "
                         f"for {saved.epochs} epoch{'' if saved.epochs == 1 else 's'} (it ends at lr x "
                         f"{saved.min_lr_ratio:g}); resume it without --epochs, or finetune its model.safetensors "
                         "with --checkpoint into another --out for more")
    diffs = [k for k, v in saved.to_dict().items() if k not in RESUMABLE_CHANGES and now.to_dict()[k] != v]
    if diffs:
        detail = ", ".join(f"{k}: {saved.to_dict()[k]!r} -> {now.to_dict()[k]!r}" for k in diffs)
        raise ValueError(f"cannot resume: the checkpoint was made with other settings ({detail})")


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases, norms, embeddings and tokens (the usual ViT recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "dist_token", "reg_token"))
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
