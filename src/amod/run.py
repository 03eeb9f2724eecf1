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
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

from . import engine
from .checkpoint import save as save_model
from .config import validate_capacity
from .cost import flops
from .data import build_datasets
from .models import build_model

log = logging.getLogger("amod")
CHECKPOINT_FORMAT = 1
# Fields that may differ between a run and its resumption.
RESUMABLE_CHANGES = {"epochs", "out", "workers", "eval_batch_size"}


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
    layers: Union[str, list[int]] = "alternate"
    scale_output: Optional[bool] = None
    isoflop: bool = False  # train the isoFLOP dense baseline of (router, capacity, layers) instead
    skipped: str = "bypass"  # what MoD blocks do with skipped tokens: bypass | merge | kv
    # token merging (ToMe) instead of MoD: a share of dense MACs to match, or tokens merged per block
    merge_cost: Optional[float] = None
    merge_r: Optional[Union[int, list[int]]] = None
    # data
    data: str = "fashion-mnist"
    train_limit: Optional[int] = None  # a fixed random subset of the training set
    val_limit: Optional[int] = None
    workers: int = 0  # DataLoader worker processes
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
        if self.router is not None:
            self.capacity = validate_capacity(self.capacity)
        if self.amp not in ("off", "bf16"):
            raise ValueError(f"--amp must be off or bf16, got {self.amp!r}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.warmup_epochs < 0 or self.weight_decay < 0 or not 0 <= self.label_smoothing < 1:
            raise ValueError("--warmup-epochs and --weight-decay must be >= 0 and --label-smoothing in [0, 1)")
        if (self.merge_cost is not None or self.merge_r is not None) and (self.router is not None or self.isoflop):
            raise ValueError("token merging (--merge-cost/--merge-r) replaces MoD: drop --router/--isoflop")
        if self.merge_cost is not None and self.merge_r is not None:
            raise ValueError("give either --merge-cost or --merge-r, not both")
        if self.pretrained and self.checkpoint:
            raise ValueError("give either --pretrained or --checkpoint, not both")
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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

    Under ``torchrun`` every process calls this; rank 0 alone writes files.
    """
    cfg.validate()
    dist_info = engine.setup_distributed()
    out = Path(cfg.out)
    ckpt_path = out / "checkpoint.pt"
    start_epoch, state = 1, None
    if resume:
        state = engine.load_training_checkpoint(ckpt_path)
        _check_resumable(RunConfig.from_dict(state["config"], str(ckpt_path)), cfg)
        start_epoch = state["epoch"] + 1
    elif ckpt_path.exists():
        raise ValueError(f"{out} already holds a run (checkpoint.pt); pass --resume to continue it or choose another --out")

    train_ds, val_ds, info = build_datasets(cfg.data, cfg.img_size, cfg.train_limit, cfg.val_limit)
    num_classes = cfg.num_classes or info.num_classes
    engine.seed_everything(cfg.seed)
    model = build_model(cfg, num_classes, info.in_chans, cfg.img_size or info.img_size).to(dist_info.device)
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
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if state is not None:
            writer.truncate_after(state["epoch"])
    log.info("%s: %s on %s (%d train / %d val images), %.4f GMACs per image (%.3f of dense)", out,
             _describe(cfg), info.name, len(train_ds), len(val_ds), cost.gmacs, cost.ratio)

    val_loader = engine.make_loader(val_ds, cfg.eval_batch_size, False, cfg.seed, 0, dist_info, cfg.workers)
    if start_epoch == 1 and cfg.eval_before_training:
        metrics = engine.evaluate(model, val_loader, dist_info.device, cfg.amp, dist_info)
        writer.write({"epoch": 0, **{f"val_{k}": v for k, v in metrics.items()}})
        log.info("epoch 0 (before training): val top1 %.4f loss %.4f", metrics["top1"], metrics["loss"])
    for epoch in range(start_epoch, cfg.epochs + 1):
        loader = engine.make_loader(train_ds, cfg.batch_size, True, cfg.seed, epoch, dist_info, cfg.workers)
        row = engine.train_one_epoch(train_model, loader, optimizer, scheduler, cfg, dist_info, epoch)
        metrics = engine.evaluate(model, val_loader, dist_info.device, cfg.amp, dist_info)
        row = {"epoch": epoch, **row, **{f"val_{k}": v for k, v in metrics.items()}}
        log.info("epoch %d/%d: train loss %.4f acc %.4f | val top1 %.4f top5 %.4f loss %.4f | %.0fs",
                 epoch, cfg.epochs, row["train_loss"], row["train_acc"], metrics["top1"], metrics["top5"],
                 metrics["loss"], row["epoch_time_s"])
        if dist_info.main:
            # weights first, then the resumable state: a kill between the two resumes from the older state
            save_model(model, out / "model.safetensors")
            engine.atomic_torch_save({
                "format": CHECKPOINT_FORMAT, "epoch": epoch, "config": cfg.to_dict(),
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": engine.rng_state(),
                "routers": engine.router_state(model),
            }, ckpt_path)
            writer.write(row)
    summary = _summary(cfg, out, cost, dist_info, _rank_checksums(model, dist_info))
    return summary


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


def _summary(cfg: RunConfig, out: Path, cost: Any, dist_info: engine.Dist, checksums: list[float]) -> dict[str, Any]:
    rows = engine.read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    last = rows[-1] if rows else {}
    summary = {"variant": _describe(cfg), "epochs": cfg.epochs, "macs": cost.macs, "flop_ratio": cost.ratio,
               "val_top1": last.get("val_top1"), "val_top5": last.get("val_top5"), "val_loss": last.get("val_loss"),
               "out": str(out), "world_size": dist_info.world, "rank_weight_checksums": checksums}
    if dist_info.main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _describe(cfg: RunConfig) -> str:
    if cfg.merge_cost is not None or cfg.merge_r is not None:
        return f"tome@{cfg.merge_cost:g}" if cfg.merge_cost is not None else f"tome r={cfg.merge_r}"
    if cfg.router is None:
        return "dense"
    kind = "isoflop" if cfg.isoflop else cfg.router
    return f"{kind}@{cfg.capacity:g}" + ("" if cfg.skipped == "bypass" or cfg.isoflop else f" skipped={cfg.skipped}")


def _check_resumable(saved: RunConfig, now: RunConfig) -> None:
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
