"""Train, finetune and evaluate a DETR on the Fashion-MNIST canvases, resumable, scored with COCO AP.

A run directory holds what a classification run's does: ``config.yaml``, ``checkpoint.pt`` (model, optimizer,
schedule, step, RNG and router states, written atomically at every evaluation: a killed run resumes there),
``metrics.jsonl`` (one row per evaluation: step, images seen, training loss, COCO AP/AP50/AP75, training
images/s), ``model.safetensors`` (``amod.save``: ``amod.load`` rebuilds the converted DETR) and ``train.log``.

The loss is ``transformers``' DETR loss (Hungarian matching; cross-entropy, L1 and GIoU terms); AP is
``pycocotools``' (``amod.detect.evaluate``). A new model is ``small_detr``; a finetune starts from an
``amod.save`` file (``init``) and, given ``method`` (an MoD spec), converts it at the capacity whose encoder cost is
``encoder_cost`` of the dense encoder's.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import yaml
from torch import nn

from .. import files
from ..checkpoint import load, to_bytes
from ..mod.convert import set_capacity
from ..train import engine, resume
from ..train.rundir import RunDirectory
from .config import DetectConfig, check_detector_file
from .canvases import CanvasSpec, DetectionCanvases, coco_ground_truth, collate
from ..families.detr import capacity_for_encoder_cost, use_content_queries
from .evaluate import coco_ap, detections_from_outputs
from .models import small_detr
from ..errors import UserError

log = logging.getLogger("amod")
# ImageNet statistics, as Hugging Face's DetrImageProcessor normalises (canvases arrive in [0, 1])
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FORMAT = 1
# what every checkpoint.pt of a detection run holds (tensors, numbers, strings and lists: read with weights_only)
CHECKPOINT_KEYS = frozenset({"format", "config", "model", "optimizer", "scheduler", "step", "rng", "routers", "rows"})


def normalise(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std


def datasets(cfg: DetectConfig) -> tuple[DetectionCanvases, DetectionCanvases]:
    spec = CanvasSpec(size=cfg.canvas_size).validate()
    return (DetectionCanvases("train", cfg.train_canvases, spec, seed=cfg.data_seed),
            DetectionCanvases("val", cfg.val_canvases, spec, seed=cfg.data_seed))


def build_model(cfg: DetectConfig) -> nn.Module:
    """The run's starting model: a new small DETR, or ``init`` (converted when ``method`` is given)."""
    if cfg.init is None:
        return use_content_queries(small_detr(d_model=cfg.d_model, ffn=4 * cfg.d_model))
    model = load_detector(cfg.init, option="init")
    method = cfg.encoder_method()
    if method is not None:
        if getattr(model, "amod_config", None) is not None:
            raise UserError(f"init {cfg.init} is already converted; give the dense detector")
        dataclasses.replace(method, capacity=1.0).apply(model)
        set_capacity(model, capacity_for_encoder_cost(model, cfg.encoder_cost, cfg.canvas_size))
    return model


def load_detector(path: str | Path, device: str | torch.device = "cpu", option: str = "detector") -> nn.Module:
    """``amod.load`` of a DETR (``check_detector_file`` first: another model is refused in one line)."""
    path = Path(path).expanduser()
    check_detector_file(path, option)
    return load(path, device)


@torch.no_grad()
def predict(model: nn.Module, val: DetectionCanvases, batch_size: int = 32, amp: str = "off") -> list[dict[str, Any]]:
    """COCO-format detections of ``model`` on every validation canvas, ready for ``coco_ap``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    detections = []
    try:
        for start in range(0, len(val), batch_size):
            batch = [val[i] for i in range(start, min(len(val), start + batch_size))]
            images, targets = collate(batch)
            with engine.autocast(amp, device):
                out = model(pixel_values=normalise(images.to(device)))
            detections += detections_from_outputs(out.logits.float(), out.pred_boxes.float(),
                                                  [t["image_id"] for t in targets], val.spec.size)
    finally:
        model.train(was_training)
    return detections


def evaluate(model: nn.Module, val: DetectionCanvases, ground_truth: dict[str, Any], batch_size: int = 32,
             amp: str = "off") -> dict[str, float]:
    """COCO AP of ``model`` on the validation canvases (every one of them)."""
    return coco_ap(ground_truth, predict(model, val, batch_size, amp))


def _batches(cfg: DetectConfig, train: DetectionCanvases, start_step: int) -> Iterator[list[int]]:
    """The canvas indices of every step from ``start_step`` on: a fresh seeded permutation per pass."""
    per_pass = len(train) // cfg.batch_size
    step = start_step
    while True:
        epoch, offset = divmod(step, per_pass)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
        for b in range(offset, per_pass):
            yield order[b * cfg.batch_size:(b + 1) * cfg.batch_size].tolist()
        step = (epoch + 1) * per_pass


def train_detector(cfg: DetectConfig) -> dict[str, Any]:
    """Run (or resume) ``cfg``; returns the last evaluation row. Every check (settings, data, the starting model,
    a checkpoint to resume) comes before the run directory is created or locked: a refused run writes nothing."""
    cfg = cfg.validate()
    out = Path(cfg.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, val = datasets(cfg)
    if len(train) < cfg.batch_size:
        raise UserError(f"train_canvases ({len(train)}) is smaller than one batch ({cfg.batch_size})")
    engine.seed_everything(cfg.seed)  # a new run's router init and dropout (a resumed run restores its RNG)
    model = build_model(cfg).to(device)
    state = _resumable_state(cfg, out)
    with RunDirectory(out):
        return _train(cfg, out, model, state, train, val, device)


def _resumable_state(cfg: DetectConfig, out: Path) -> Optional[dict[str, Any]]:
    """The run's ``checkpoint.pt`` (``resume.load_training_checkpoint``: never unpickled beyond tensors and plain
    containers), or None for a new run; a run of other settings is refused."""
    ckpt_path = out / "checkpoint.pt"
    if not ckpt_path.exists():
        return None
    state = resume.load_training_checkpoint(ckpt_path, CHECKPOINT_KEYS)
    saved = DetectConfig.from_dict(state["config"]).to_dict() if state["format"] == FORMAT else None
    if saved is None or saved != {**cfg.to_dict(), "out": saved["out"]}:
        raise UserError(f"{out} holds a run of other settings; choose another out directory")
    return state


def _train(cfg: DetectConfig, out: Path, model: nn.Module, state: Optional[dict[str, Any]], train: DetectionCanvases,
           val: DetectionCanvases, device: torch.device) -> dict[str, Any]:
    ground_truth = coco_ground_truth(val)
    optimizer = torch.optim.AdamW(engine.param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, engine.warmup_cosine(cfg.steps, cfg.warmup))
    ckpt_path, metrics_path = out / "checkpoint.pt", out / "metrics.jsonl"
    step, rows = 0, []
    if state is not None:
        resume.restore_training_state(state, model, optimizer, scheduler)
        step, rows = state["step"], state["rows"]
        log.info("resumed %s at step %d", out, step)
    else:
        files.write_text(out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if cfg.method is not None:
            log.info("converted %s: %s at capacity %.3f", cfg.init, cfg.method, model.amod_config.capacity)
        rows = [{"step": 0, "images_seen": 0, **evaluate(model, val, ground_truth, amp=cfg.amp)}]
        log.info("step 0: AP %.4f AP50 %.4f", rows[0]["AP"], rows[0]["AP50"])
        files.write_text(metrics_path, "".join(files.dumps(r) + "\n" for r in rows))
    losses, images, started = [], 0, time.perf_counter()

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, list[dict[str, Any]]], done: int) -> engine.StepLoss:
        """DETR's set loss (``transformers``': Hungarian matching; cross-entropy, L1 and GIoU terms)."""
        images_cpu, targets = batch
        labels = [{"class_labels": t["class_labels"].to(device), "boxes": t["boxes"].to(device)} for t in targets]
        return engine.StepLoss(model(pixel_values=normalise(images_cpu.to(device)), labels=labels).loss, len(targets))

    def on_report(done: int, report: engine.Report) -> None:
        """Every ``eval_every`` steps and at the last: a row, then checkpoint, metrics and weights together."""
        nonlocal losses, images, started
        losses += report.losses
        images += sum(report.images)
        if done % cfg.eval_every and done != cfg.steps:
            return
        speed = images / (time.perf_counter() - started)
        row = {"step": done, "images_seen": done * cfg.batch_size, "train_loss": sum(losses) / len(losses),
               "train_images_per_s": speed, **evaluate(model, val, ground_truth, amp=cfg.amp)}
        rows.append(row)
        log.info("step %d/%d: loss %.3f, AP %.4f AP50 %.4f (%.1f training images/s)", done, cfg.steps,
                 row["train_loss"], row["AP"], row["AP50"], speed)
        state = resume.training_state(model, optimizer, scheduler, format=FORMAT, config=cfg.to_dict(), step=done,
                                      rows=rows)
        weights = to_bytes(model, metadata={"amod.detect.step": str(done)})
        files.write_together([
            resume.state_write(ckpt_path, state),
            (metrics_path, lambda f: f.write("".join(files.dumps(r) + "\n" for r in rows).encode())),
            (out / "model.safetensors", lambda f: f.write(weights))])
        losses, images, started = [], 0, time.perf_counter()

    canvases = (collate([train[i] for i in indices]) for indices in _batches(cfg, train, step))
    engine.train_steps(model, canvases, optimizer, scheduler, loss_fn, device=device, amp=cfg.amp,
                       clip_grad=cfg.clip, step=step, steps=cfg.steps, report_every=cfg.eval_every, on_report=on_report,
                       non_finite_message=lambda value, n: f"the loss is {value} at step {n}; lower lr (now {cfg.lr:g})")
    return rows[-1]
