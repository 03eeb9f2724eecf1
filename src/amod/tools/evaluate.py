"""`amod eval`: accuracy, loss, cost and speed of a saved model on a validation set."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..files import dumps
from ..cost import flops
from ..methods import method_of
from ..mod.convert import MoD, set_capacity
from ..checkpoint import open_model
from ..families import family_of
from ..hf.loading import hf_source
from ..train.data import build_datasets
from ..train.engine import BadImages, Dist, evaluate, make_loader
from ..errors import UserError
from ..flags import flag, positive_int
from ..train.engine import AMP_MODES


@dataclass
class EvalConfig:
    # (each field's comment is its flag's help: amod.flags)
    checkpoint: str  # a run's model.safetensors (or any amod.save file), or a Hugging Face model (directory or hf:ID)
    data: str = "fashion-mnist"
    img_size: Optional[int] = flag(None, type=positive_int)  # must be the model's own input size
    val_limit: Optional[int] = flag(None, type=positive_int)
    batch_size: int = flag(256, type=positive_int)
    capacity: Optional[float] = None  # evaluate an MoD model at another capacity
    amp: str = flag("off", choices=AMP_MODES)
    skip_bad_images: bool = False  # skip unreadable image files (and count them)


def evaluate_checkpoint(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    """Top-1/top-5, loss, images/s, MACs per image and unreadable images skipped, for ``cfg.checkpoint``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    source = hf_source(cfg.checkpoint)
    model = open_model(cfg.checkpoint, device)
    if cfg.capacity is not None:
        running = method_of(model)
        if not isinstance(running, MoD):
            raise UserError(f"--capacity turns the dial of an MoD model (a router, or fold); {cfg.checkpoint} runs "
                            f"{running.label()}, which has none: drop --capacity")
        set_capacity(model, cfg.capacity)
    counted = model  # what amod.flops prices
    family = family_of(model)
    num_classes = family.num_classes(family.prepare(model))
    model = family.tensor_module(model)  # the loop needs one tensor out: the logits
    native = model.patch_embed.img_size[0]
    if cfg.img_size is not None and cfg.img_size != native:
        raise UserError(f"{cfg.checkpoint} takes {native}-px images, not {cfg.img_size}: drop --img-size, "
                        "or finetune the model at that size first")
    if num_classes == 0:  # (amod finetune takes timm models; compare and frontier take Hugging Face ones too)
        finetune = "finetune it with amod finetune, or " if source is None else ""
        raise UserError(f"{cfg.checkpoint} has no classifier (a backbone): {finetune}compare reduced versions of it "
                        "with the linear probe of amod compare or amod frontier")
    _, val, info = build_datasets(cfg.data, native, None, cfg.val_limit)
    if info.num_classes > num_classes or info.in_chans != model.patch_embed.proj.in_channels:
        raise UserError(f"the model ({num_classes} classes, {model.patch_embed.proj.in_channels} channels) "
                        f"does not fit {info.name} ({info.num_classes} classes, {info.in_chans} channels)")
    dist_info = Dist(device=device)
    bad_images = BadImages(skip=cfg.skip_bad_images)
    metrics = evaluate(model, make_loader(val, cfg.batch_size, False, 0, 0, dist_info), device, cfg.amp, dist_info,
                       progress=progress, bad_images=bad_images)
    return {**metrics, "macs": flops(counted).macs, "skipped_images": len(bad_images.paths)}


def format_eval(m: dict[str, Any]) -> str:
    """``amod eval``'s line: an ``evaluate_checkpoint`` result in words."""
    skipped = f", {m['skipped_images']} unreadable images skipped" if m["skipped_images"] else ""
    return (f"top1 {m['top1']:.4f}  top5 {m['top5']:.4f}  loss {m['loss']:.4f}  {m['macs'] / 1e6:.2f} MMACs/image  "
            f"{m['images_per_s']:.0f} images/s  ({m['images']} images{skipped})")


def eval_command(cfg: EvalConfig, json: bool = False) -> str:
    """``amod eval``: the model evaluated, in words (``json``: one JSON object)."""
    m = evaluate_checkpoint(cfg, progress=not json)
    return dumps(m) if json else format_eval(m)
