"""A training run: its directory and the loop from start (or resume) to the end. Its configuration
(``RunConfig``, how a command's flags and YAML file become one) is ``amod.train.config``.

Run directory layout:
    config.yaml        the full resolved configuration
    metrics.jsonl/.csv one row per epoch (epoch 0 = before training, for finetuning)
    checkpoint.pt      resumable state (``train.resume``'s one format): model, optimiser, scheduler, RNG states, epoch, config
    model.safetensors  weights + architecture + MoD config: all `amod eval` needs
    summary.json       final metrics, cost, and what was run
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

from .. import files
from ..checkpoint import to_bytes as model_bytes
from ..cost import flops
from . import engine
from .config import RunConfig, with_method_spec
from .data import DataInfo, build_datasets
from .any_cost import AnyCost
from .distill import Teacher
from .models import build_model, build_teacher, checkpoint_settings
from .resume import load_training_checkpoint, restore_training_state, state_write, training_state
from .rundir import RunDirectory, check_output_dir
from ..errors import UserError

log = logging.getLogger("amod")
CHECKPOINT_FORMAT = 1
# Fields that may differ between a run and its resumption (not epochs: the learning-rate schedule is made for them).
RESUMABLE_CHANGES = {"out", "workers", "eval_batch_size", "skip_bad_images"}


def train(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) training as ``cfg`` says; returns the final summary.

    Everything a user can get wrong (settings, data, model, the output directory) is checked before
    anything is written. The run directory is locked for the duration of the run. Under
    ``torchrun`` every process calls this; rank 0 alone writes files.
    """
    world = engine.world_size()
    with engine.refused_alike(world):  # every torchrun process checks the same things before they meet
        cfg = _from_checkpoint_file(cfg.validate())
        out = check_output_dir(cfg.out)
        ckpt_path = out / "checkpoint.pt"
        state = None
        if resume:
            state = load_training_checkpoint(ckpt_path)
            _check_same_run(out, state["config"])
            _check_resumable(_from_checkpoint_file(RunConfig.from_dict(state["config"], str(ckpt_path))), cfg)
        elif ckpt_path.exists():
            raise UserError(f"{out} already holds a run (checkpoint.pt); pass --resume to continue it or choose "
                            "another --out")
        train_ds, val_ds, info = build_datasets(cfg.data, cfg.img_size, cfg.train_limit, cfg.val_limit)
        num_classes = _num_classes(cfg, info)
        if len(train_ds) < world:
            raise UserError(f"{len(train_ds)} training image{'' if len(train_ds) == 1 else 's'} for "
                            f"{world} processes: each process needs at least one; give more images "
                            "(--train-limit) or start fewer processes")
        batches = len(engine.make_loader(train_ds, cfg.batch_size, True, cfg.seed, 0, engine.Dist(0, world)))
        if batches < cfg.grad_accum:
            raise UserError(f"--grad-accum {cfg.grad_accum} needs {cfg.grad_accum} batches per epoch and process; "
                            f"this run has {batches} (--batch-size {cfg.batch_size}): lower --grad-accum or "
                            "--batch-size")
        engine.seed_everything(cfg.seed)
        img_size = cfg.img_size or info.img_size
        model = build_model(cfg, num_classes, info.in_chans, img_size)
        any_cost = AnyCost(model, *cfg.any_cost).check_reachable() if cfg.any_cost else None
        teacher = Teacher(build_teacher(cfg, num_classes, info.in_chans, img_size)) if cfg.distill else None
        if teacher is not None:
            teacher.check_student(model, train_ds[0][0][None], cfg.distill_features > 0)
    dist_info = engine.setup_distributed()
    try:
        model = model.to(dist_info.device)
        if teacher is not None:
            teacher.model.to(dist_info.device)
        with RunDirectory(out, lock=dist_info.main):
            if state is None and ckpt_path.exists():  # another run finished here while we were getting ready
                raise UserError(f"{out} already holds a run (checkpoint.pt); pass --resume to continue it")
            return _train(cfg, model, state, train_ds, val_ds, info, dist_info, teacher, any_cost)
    finally:
        engine.teardown_distributed()


def _from_checkpoint_file(cfg: RunConfig) -> RunConfig:
    """``cfg`` with what a model saved by amod decides written in: its architecture and, when no method is
    given, its method (so config.yaml, train.log and summary.json say what runs). Raises ValueError for
    settings the file cannot honour."""
    settings = checkpoint_settings(cfg)
    return cfg.replace(**settings).validate() if settings else cfg


def _num_classes(cfg: RunConfig, info: DataInfo) -> int:
    """The classifier's size: the data's classes unless --num-classes says more."""
    if cfg.num_classes is None:
        return info.num_classes
    if cfg.num_classes < info.num_classes:
        raise UserError(f"--num-classes {cfg.num_classes} is smaller than the {info.num_classes} classes of "
                        f"{info.name} (labels 0..{info.num_classes - 1}); drop it to use the data's")
    return cfg.num_classes


def _train(cfg: RunConfig, model: torch.nn.Module, state: Optional[dict[str, Any]], train_ds, val_ds,
           info: DataInfo, dist_info: engine.Dist, teacher: Optional[Teacher] = None,
           any_cost: Optional[AnyCost] = None) -> dict[str, Any]:
    """The loop, once the run directory is held; ``any_cost``: the dial of an ``--any-cost`` run."""
    out = Path(cfg.out)
    ckpt_path = out / "checkpoint.pt"
    start_epoch = 1 if state is None else state["epoch"] + 1
    cost = flops(model)
    ratio = _share_of_dense(model, cost)
    optimizer = torch.optim.AdamW(engine.param_groups(model, cfg.weight_decay, cfg.router_lr), lr=cfg.lr)
    steps_per_epoch = engine.steps_per_epoch(len(engine.make_loader(train_ds, cfg.batch_size, True, cfg.seed, 0,
                                                                    dist_info)), cfg.grad_accum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, engine.warmup_cosine(
        cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch), cfg.min_lr_ratio))
    if state is not None:
        restore_training_state(state, model, optimizer, scheduler)
        log.info("resumed %s after epoch %d", out, state["epoch"])
    train_model = DistributedDataParallel(model) if dist_info.world > 1 else model
    dial = any_cost.before_step(model, cfg.seed) if any_cost is not None else None

    writer = engine.MetricsWriter(out, dist_info.main)
    if dist_info.main:
        files.write_text(out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if state is None:
            writer.clear()  # rows of an earlier attempt killed before its first checkpoint
        else:
            writer.truncate_after(state["epoch"])
    log.info("%s: %s on %s (%d train / %d val images), %.4f GMACs per image (%.3f of dense)", out,
             cfg.method().label(), info.name, len(train_ds), len(val_ds), cost.gmacs, ratio)

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
                                         bad_images=bad_images, teacher=teacher, dial=dial)
            if any_cost is not None:
                any_cost.restore(model)
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
            resumable = training_state(model, optimizer, scheduler, format=CHECKPOINT_FORMAT, epoch=epoch,
                                       config=cfg.to_dict())
            weights = model_bytes(model)
            files.write_together([*writer.updates(row), (out / "model.safetensors", lambda f: f.write(weights)),
                                  state_write(ckpt_path, resumable)])
            writer.log_scalars(row)
        last_saved = epoch
    if bad_images.paths:
        log.warning("skipped %d unreadable images (first: %s)", len(bad_images.paths), next(iter(bad_images.paths)))
    return _summary(cfg, out, cost.macs, ratio, dist_info, _rank_checksums(model, dist_info), len(bad_images.paths))


def _share_of_dense(model: torch.nn.Module, cost: Any) -> float:
    """The run's MACs as a share of the dense model it started from: an isoFLOP baseline's over the deeper model it
    was cut from (``amod_isoflop``; its own ``cost.ratio`` is 1), any other model's ``cost.ratio``."""
    cut = getattr(model, "amod_isoflop", None)
    return cost.macs / cut["dense_macs"] if cut else cost.ratio


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


def _summary(cfg: RunConfig, out: Path, macs: int, ratio: float, dist_info: engine.Dist, checksums: list[float],
             skipped_images: int) -> dict[str, Any]:
    rows = engine.read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    last = rows[-1] if rows else {}
    summary = {"variant": cfg.method().label(), "epochs": cfg.epochs, "macs": macs, "flop_ratio": ratio,
               "val_top1": last.get("val_top1"), "val_top5": last.get("val_top5"), "val_loss": last.get("val_loss"),
               "val_images": last.get("val_images"), "skipped_images": skipped_images,
               "out": str(out), "world_size": dist_info.world, "rank_weight_checksums": checksums}
    if dist_info.main:
        files.write_json(out / "summary.json", summary)
    return summary


def _check_same_run(out: Path, saved: dict[str, Any]) -> None:
    """Refuse a ``checkpoint.pt`` that is not the run of ``out``: one whose settings differ from the directory's own
    ``config.yaml`` (another run's checkpoint copied in) would continue that run here, over this run's files.
    Moving or copying a whole run directory keeps the two together; a directory without ``config.yaml`` has
    nothing to compare with."""
    path = out / "config.yaml"
    if not path.is_file():
        return
    try:
        own = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"cannot resume: {path} cannot be read ({type(e).__name__}), so {out / 'checkpoint.pt'} "
                        "cannot be told to be this run's") from None
    if not isinstance(own, dict):
        raise UserError(f"cannot resume: {path} does not hold a run's settings")
    defaults = RunConfig().to_dict()  # (fields added since either file was written: their defaults)
    # (the method as one spec, whichever way either file holds it: with_method_spec)
    own, saved = (with_method_spec({**defaults, **yaml.safe_load(yaml.safe_dump(d))}) for d in (own, saved))
    diffs = [k for k in sorted(set(own) | set(saved)) if k not in RESUMABLE_CHANGES and own.get(k) != saved.get(k)]
    if diffs:
        more = ", ..." if len(diffs) > 3 else ""
        ckpt, yml = (", ".join(f"{k}={d.get(k)!r}" for k in diffs[:3]) + more for d in (saved, own))
        raise UserError(f"cannot resume: {out / 'checkpoint.pt'} is not the checkpoint of the run in {out} (it has "
                        f"{ckpt}; config.yaml has {yml}); nothing was changed: resume a run in its own directory, "
                        "or start a new one with another --out")


def _check_resumable(saved: RunConfig, now: RunConfig) -> None:
    if now.epochs != saved.epochs:
        raise UserError(f"cannot resume with --epochs {now.epochs}: the learning-rate schedule of this run was made "
                        f"for {saved.epochs} epoch{'' if saved.epochs == 1 else 's'} (it ends at lr x "
                        f"{saved.min_lr_ratio:g}); resume it without --epochs, or finetune its model.safetensors "
                        "with --checkpoint into another --out for more")
    diffs = [k for k, v in saved.to_dict().items() if k not in RESUMABLE_CHANGES and now.to_dict()[k] != v]
    if diffs:
        detail = ", ".join(f"{k}: {saved.to_dict()[k]!r} -> {now.to_dict()[k]!r}" for k in diffs)
        raise UserError(f"cannot resume: the checkpoint was made with other settings ({detail})")
