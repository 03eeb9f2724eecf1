"""A dense task on real images: semantic segmentation of Fashion-MNIST canvases, read by a linear probe on patch
features.

- ``SegmentationCanvases``: the canvases `amod detect` draws (``amod.detect.canvases``), drawn at the model's input
  size (items scaled with it), normalised as amod's Fashion-MNIST images are, with each pixel's label (its item's
  class, or ``BACKGROUND``).
- ``PatchProbe``: a linear map from a patch feature to the 11 classes, fitted once on the dense model's patch features
  (each patch's target: the share of its pixels in each class), applied unchanged to every reduced model's unmerged
  patch features (``amod.patch_features``), as the classification probe is.
- ``segmentation_scores``: the probe's logits upsampled (bilinear) to the pixels; mIoU (over the classes present in
  the images or predicted) and pixel accuracy, on all images and on each half (even and odd positions: the error bar).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..detect.canvases import BACKGROUND, CanvasSpec, DetectionCanvases
from ..patch_grid import patch_features
from ..train.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from ..train.engine import progress_bar

log = logging.getLogger("amod")

NUM_SEGMENT_CLASSES = BACKGROUND + 1  # the 10 Fashion-MNIST classes and the background
BASE_SPEC = CanvasSpec()  # `amod detect`'s canvases: 128 px, items of 20-48 px; scaled to the input size


def spec_at(img_size: int) -> CanvasSpec:
    """`amod detect`'s canvas spec scaled to ``img_size`` px (items keep their share of the canvas)."""
    scale = img_size / BASE_SPEC.size
    return CanvasSpec(size=img_size, min_items=BASE_SPEC.min_items, max_items=BASE_SPEC.max_items,
                      min_scale=round(BASE_SPEC.min_scale * scale), max_scale=round(BASE_SPEC.max_scale * scale),
                      max_overlap=BASE_SPEC.max_overlap)


class SegmentationCanvases(Dataset):
    """``count`` canvases at ``img_size`` px: ``dataset[i]`` is (image (3, S, S) normalised, mask (S, S) int64).
    ``split`` "train" takes its items from Fashion-MNIST's training images, "val" from its test images."""

    def __init__(self, split: str, count: int, img_size: int, seed: int = 0) -> None:
        self.canvases = DetectionCanvases(split, count, spec_at(img_size), seed)

    def __len__(self) -> int:
        return len(self.canvases)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.canvases.image_and_mask(i)
        return (image - FASHION_MNIST_MEAN) / FASHION_MNIST_STD, mask

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, masks) in order, ``batch_size`` at a time."""
        for start in range(0, len(self), batch_size):
            items = [self[i] for i in range(start, min(start + batch_size, len(self)))]
            yield torch.stack([x for x, _ in items]), torch.stack([m for _, m in items])


def patch_targets(masks: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, S, S) pixel labels -> (B, n, classes): each patch's share of pixels in each class, patches in grid
    order."""
    one_hot = F.one_hot(masks, NUM_SEGMENT_CLASSES).permute(0, 3, 1, 2).float()
    shares = F.avg_pool2d(one_hot, patch)  # (B, classes, S/patch, S/patch)
    return shares.flatten(2).transpose(1, 2)


@torch.inference_mode()
def grid_features(model: torch.nn.Module, data: SegmentationCanvases, batch_size: int,
                  device: torch.device, desc: Optional[str] = None) -> torch.Tensor:
    """Every canvas's patch features on the dense grid (``amod.patch_features``, the final norm applied):
    (images, n, D) float32 on the CPU. ``desc``: a progress bar of that name on a terminal."""
    batches = progress_bar(data.batches(batch_size), math.ceil(len(data) / batch_size), desc or "", desc is not None)
    out = [patch_features(model, x.to(device), output_fmt="NLC").float().cpu() for x, _ in batches]
    return torch.cat(out)


@dataclass
class PatchProbe:
    """A linear map from a patch feature to the segmentation classes (weight (classes, D), bias (classes,)),
    fitted on standardised features (``mean``, ``std``)."""

    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., classes)."""
        return ((feats - self.mean) / self.std) @ self.weight.T + self.bias

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias, "mean": self.mean, "std": self.std}


def fit_patch_probe(feats: torch.Tensor, targets: torch.Tensor, l2: float = 1e-4, steps: int = 200) -> PatchProbe:
    """The linear probe minimising the cross-entropy to each patch's class shares (soft targets) plus ``l2`` times
    the squared weights, by full-batch L-BFGS on standardised features; deterministic.

    Args:
        feats: (images, n, D) dense patch features.
        targets: (images, n, classes) class shares (``patch_targets``).
    """
    x = feats.reshape(-1, feats.shape[-1]).double()
    y = targets.reshape(-1, targets.shape[-1]).double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    x = (x - mean) / std
    w = torch.zeros(y.shape[1], x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(y.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=steps, history_size=20, tolerance_grad=1e-9,
                            line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = -(y * torch.log_softmax(x @ w.T + b, dim=1)).sum(1).mean() + l2 * w.pow(2).sum()
        value.backward()
        return value

    opt.step(loss)
    return PatchProbe(w.detach().float(), b.detach().float(), mean.float(), std.float())


def confusion(probe: PatchProbe, feats: torch.Tensor, masks: torch.Tensor, patch: int,
              batch_size: int = 8) -> torch.Tensor:
    """(images, classes, classes) per-image confusion counts [truth, predicted] of the probe's pixel predictions:
    each patch's logits laid on its grid and upsampled (bilinear) to the pixels."""
    k = NUM_SEGMENT_CLASSES
    side = masks.shape[-1] // patch
    out = []
    for start in range(0, len(feats), batch_size):
        f, m = feats[start:start + batch_size], masks[start:start + batch_size]
        logits = probe.logits(f).transpose(1, 2).reshape(len(f), k, side, side)
        pred = F.interpolate(logits, size=m.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
        pairs = (m * k + pred).flatten(1)
        out.append(torch.stack([torch.bincount(p, minlength=k * k).reshape(k, k) for p in pairs]))
    return torch.cat(out)


def miou_and_accuracy(counts: torch.Tensor) -> tuple[float, float]:
    """(mean IoU over the classes that are present or predicted, pixel accuracy) of summed confusion counts."""
    counts = counts.double()
    tp = counts.diagonal()
    union = counts.sum(0) + counts.sum(1) - tp
    seen = union > 0
    return (tp[seen] / union[seen]).mean().item(), (tp.sum() / counts.sum()).item()


def segmentation_scores(per_image: torch.Tensor) -> dict[str, Any]:
    """mIoU and pixel accuracy of per-image confusion counts (``confusion``), on all images and on each half (even
    and odd positions), the frontier's keys: ``miou``, ``pixel_acc``, ``halves`` (the two halves' mIoU)."""
    miou, acc = miou_and_accuracy(per_image.sum(0))
    halves = [miou_and_accuracy(per_image[h::2].sum(0))[0] for h in (0, 1)]
    return {"miou": miou, "pixel_acc": acc, "halves": halves}
