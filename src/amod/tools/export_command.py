"""`amod export`: an amod checkpoint file to one ONNX file (``amod.export``), checked on real images
where they are at hand.

The check runs on the first Fashion-MNIST validation images for a Fashion-MNIST model (one channel,
ten classes, square input) when the data is on disk and holds the images the check needs (a fixed ``--batch`` of
more than its 10,000 validation images does not), and on ``amod.export``'s seeded images with flat regions otherwise
(``amod.deploy.flat_region_images``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from ..arch import pair
from ..checkpoint import load
from ..deploy import CHECK_IMAGES, DEFAULT_EXPORTER, EXPORTERS, _sigterm_cleans_up, export
from ..files import check_output_file, dumps
from ..train.data import TensorImages, load_fashion_mnist
from ..train.rundir import output_file_lock
from ..errors import UserError
from ..flags import flag, positive_int

log = logging.getLogger("amod")

PathLike = Union[str, os.PathLike]


def parse_batch(text: str) -> Union[str, int]:
    """``dynamic`` or a positive batch size."""
    return text if text == "dynamic" else positive_int(text)


@dataclass
class ExportConfig:
    """``amod export``: ``export_checkpoint``'s arguments (each field's comment is its flag's help: amod.flags)."""

    checkpoint: str  # any amod.save file (model.safetensors of a run)
    out: str  # the .onnx file to write
    force: bool = False  # replace --out if it exists
    img_size: Optional[int] = flag(None, type=positive_int)  # input size (default the model's own)
    batch: Union[str, int] = flag("dynamic", type=parse_batch)  # dynamic or a fixed batch size
    opset: Optional[int] = flag(None, type=positive_int)  # ONNX opset (default the exporter's)
    exporter: str = flag(DEFAULT_EXPORTER, choices=EXPORTERS)  # dynamo: torch.onnx.export(dynamo=True) (exports every
                                                               # amod model); torchscript: the legacy tracer


def fashion_mnist_images(model: nn.Module, n: int, img_size: Optional[int] = None) -> Optional[torch.Tensor]:
    """The first ``n`` Fashion-MNIST validation images at ``img_size`` (default the model's input size),
    for a one-channel, ten-class model with a square input when the data is at hand and holds ``n`` images;
    ``None`` otherwise."""
    h, w = pair(img_size if img_size is not None else model.patch_embed.img_size)
    if model.patch_embed.proj.in_channels != 1 or getattr(model, "num_classes", None) != 10 or h != w:
        return None
    try:
        images, labels = load_fashion_mnist("val")
        if len(images) < n:
            log.info("a batch of %d is more than the %d Fashion-MNIST validation images; checking on images with flat regions",
                     n, len(images))
            return None
        ds = TensorImages(images[:n], labels[:n], False, h)
        return torch.stack([ds[i][0] for i in range(len(ds))])
    except (ValueError, OSError) as e:
        log.info("Fashion-MNIST not at hand (%s); checking on images with flat regions", e)
        return None


def export_checkpoint(checkpoint: PathLike, out: PathLike, img_size: Optional[int] = None,
                      batch: Union[str, int] = "dynamic", opset: Optional[int] = None,
                      exporter: str = DEFAULT_EXPORTER, force: bool = False) -> dict[str, Any]:
    """``amod export``: load any amod checkpoint and ``amod.export`` it to ``out``.

    ``out`` is checked before the checkpoint is read: it must not be the checkpoint itself, and an
    existing file is replaced only with ``force``; it is held (``output_file_lock``) until written, so that a second
    command writing it meanwhile is refused. The check's images are Fashion-MNIST's for a
    Fashion-MNIST model (``fashion_mnist_images``; the report's ``check.inputs`` says
    ``"fashion-mnist"``), ``amod.export``'s images with flat regions otherwise.
    """
    out = Path(out)
    if out.resolve() == Path(checkpoint).resolve() or (out.exists() and Path(checkpoint).exists()
                                                         and os.path.samefile(out, checkpoint)):
        raise UserError(f"--out {out} is the checkpoint being exported; write the ONNX file elsewhere")
    check_output_file(out, "the .onnx file", force)
    with _sigterm_cleans_up(), output_file_lock(out):  # (SIGTERM too lets the file go, leaving no lock file)
        check_output_file(out, "the .onnx file", force)  # (again, held: a command just ended may have written it)
        model = load(checkpoint)
        n = CHECK_IMAGES if batch == "dynamic" else batch
        images = fashion_mnist_images(model, n, img_size) if isinstance(n, int) and n >= 1 else None
        result = export(model, out, img_size=img_size, batch=batch, opset=opset, exporter=exporter,
                        check_images=CHECK_IMAGES if images is None else images)
    if images is not None:
        result["check"]["inputs"] = "fashion-mnist"
    return result


def format_export(r: dict[str, Any]) -> str:
    """``amod export``'s lines: an ``export_checkpoint`` report in words."""
    c = r["check"]
    return "\n".join([
        f"wrote {r['path']} ({r['bytes'] / 2**20:.1f} MiB): {r['method']}, {r['img_size'][0]}x{r['img_size'][1]} "
        f"input, batch {r['batch']}, opset {r['opset']}, {r['exporter']} exporter",
        "  routing ops in the graph: " + ", ".join(f"{op} {n}" for op, n in r["ops"].items()),
        f"  checked in ONNX Runtime on {' + '.join(map(str, c['batches']))} {c['inputs']} images: max abs logit "
        f"difference {c['max_abs_diff']:.2g} (allowed {c['tolerance']:g}); {c['flipped']} of {c['images']} images "
        f"({c['flip_rate']:.1%}) beyond it, each a discrete choice flipped within rounding noise (docs/export.md); "
        "same top-1 on the others"])


def export_command(cfg: ExportConfig, json: bool = False) -> str:
    """``amod export``: the file written and checked, in words (``json``: one JSON object)."""
    r = export_checkpoint(**vars(cfg))
    return dumps(r) if json else format_export(r)
