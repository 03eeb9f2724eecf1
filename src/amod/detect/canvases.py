"""A detection data set made of real images: Fashion-MNIST items pasted onto larger black canvases.

Canvas ``i`` of a ``DetectionCanvases(split, count, spec, seed)`` is a pure function of
``(seed, split, i)``: it is drawn with its own ``torch.Generator``, so it does not depend on the
order of access, on DataLoader workers or on anything stored. Train canvases take their items from
Fashion-MNIST's training split, validation canvases from its 10,000 test images. Each item is a
28x28 image resized to a random square side, placed at a random position; its box is the tight box
of its visible pixels and its label is its Fashion-MNIST class.

Targets carry the boxes twice: normalised (cx, cy, w, h), as Hugging Face's
``DetrForObjectDetection(labels=...)`` expects, and absolute COCO [x, y, w, h] pixels, which
``coco_ground_truth`` / ``write_coco`` turn into a COCO annotation file for ``amod.detect.evaluate``.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..files import PathLike, write_bytes, write_text
from ..train.data import load_fashion_mnist
from ..errors import UserError

CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")  # Fashion-MNIST label order
SPLITS = ("train", "val")
BACKGROUND = len(CLASS_NAMES)  # the pixel label of the canvas where no item shows (``DetectionCanvases.mask``)

# A resized pixel belongs to an item when its intensity is above this (in [0, 1], i.e. ~25/255).
# Fashion-MNIST's backgrounds carry faint scanning noise of a few /255, and bilinear resizing smears
# every edge into a faint halo; 0.1 drops both while keeping every visibly drawn part of a garment.
# Pixels at or below it are set to black before pasting, so an item's box is exactly the extent of
# what the canvas shows of it.
PIXEL_THRESHOLD = 0.1
PLACEMENT_TRIES = 20  # draws (image, scale, position) per item before it is dropped for overlapping
MIN_CANVAS_SIZE = 32  # the smallest side of a canvas, pixels (CanvasSpec.size)


@dataclass(frozen=True)
class CanvasSpec:
    """How canvases are drawn."""

    size: int = 128  # side of the square canvas, pixels
    min_items: int = 1  # items per canvas, drawn uniformly in [min_items, max_items]
    max_items: int = 4
    min_scale: int = 20  # side (pixels) a 28x28 item is resized to, drawn uniformly in [min_scale, max_scale]
    max_scale: int = 48
    max_overlap: float = 0.2  # an item whose box has IoU above this with a placed item's box is redrawn

    def validate(self) -> "CanvasSpec":
        """Return the spec unchanged, or raise ValueError naming the field that makes no sense."""
        if self.size < MIN_CANVAS_SIZE:
            raise UserError(f"CanvasSpec.size must be at least {MIN_CANVAS_SIZE} pixels, got {self.size}")
        if self.min_items < 1:
            raise UserError(f"CanvasSpec.min_items must be at least 1, got {self.min_items}")
        if self.min_items > self.max_items:
            raise UserError(f"CanvasSpec.min_items ({self.min_items}) must not exceed max_items ({self.max_items})")
        if self.min_scale < 1:
            raise UserError(f"CanvasSpec.min_scale must be at least 1 pixel, got {self.min_scale}")
        if self.min_scale > self.max_scale:
            raise UserError(f"CanvasSpec.min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})")
        if self.max_scale > self.size:
            raise UserError(f"CanvasSpec.max_scale ({self.max_scale}) must not exceed size ({self.size})")
        if not 0.0 <= self.max_overlap < 1.0:
            raise UserError(f"CanvasSpec.max_overlap must be in [0, 1), got {self.max_overlap}")
        return self


class Placement(NamedTuple):
    """One item on a canvas: where it came from and where it went."""

    source: int  # index of the image in the Fashion-MNIST split
    label: int  # its class, 0..9
    scale: int  # side it was resized to
    x: int  # top-left corner of the resized image on the canvas
    y: int
    box: tuple[int, int, int, int]  # tight box of its visible pixels: x0, y0, x1, y1 (x1, y1 exclusive)


def category_id(label: int) -> int:
    """COCO category id of a class index (COCO ids start at 1)."""
    return int(label) + 1


def label_of(category: int) -> int:
    """Class index of a COCO category id (the inverse of ``category_id``)."""
    return int(category) - 1


def canvas_seed(seed: int, split: str, index: int) -> int:
    """The generator seed of one canvas: a hash of (seed, split, index), so nearby ones are unrelated."""
    digest = hashlib.blake2b(f"amod.detect.canvas/{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@functools.lru_cache(maxsize=len(SPLITS))
def _fashion_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    # Shared, read-only, between the data set objects of one process (tests, train + eval views).
    return load_fashion_mnist(split)


def _iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


class DetectionCanvases(Dataset):
    """``count`` canvases of Fashion-MNIST items with their boxes and classes.

    ``dataset[i]`` is ``(image, target)``: ``image`` float32 (3, size, size) in [0, 1], the gray
    canvas repeated on three channels and not normalised; ``target`` a dict with ``image_id`` (i),
    ``class_labels`` int64 (M,), ``boxes`` float32 (M, 4) normalised (cx, cy, w, h) and
    ``boxes_xywh`` float32 (M, 4) absolute COCO [x, y, w, h].
    """

    def __init__(self, split: str, count: int, spec: CanvasSpec = CanvasSpec(), seed: int = 0) -> None:
        if split not in SPLITS:
            raise UserError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if count < 0:
            raise UserError(f"count must be >= 0, got {count}")
        self.split, self.count, self.spec, self.seed = split, int(count), spec.validate(), int(seed)
        self.images, self.labels = _fashion_mnist(split)  # (N, 28, 28) uint8, (N,) int64

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, Any]]:
        canvas, placed = self._draw(i)
        size = self.spec.size
        xyxy = torch.tensor([p.box for p in placed], dtype=torch.float32).reshape(-1, 4)
        xywh = torch.cat([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], dim=1)  # (M, 4) COCO pixels
        cxcywh = torch.cat([xywh[:, :2] + xywh[:, 2:] / 2, xywh[:, 2:]], dim=1) / size  # (M, 4) in [0, 1]
        target = {
            "image_id": int(i),
            "class_labels": torch.tensor([p.label for p in placed], dtype=torch.int64),
            "boxes": cxcywh,
            "boxes_xywh": xywh,
        }
        return canvas.unsqueeze(0).repeat(3, 1, 1), target  # (3, size, size)

    def placements(self, i: int) -> list[Placement]:
        """The items of canvas ``i``: source image, label, scale, position and box of each."""
        return self._draw(i)[1]

    def _check_index(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(f"canvas index {i} out of range for {self.count} canvases")
        return int(i)

    def _draw(self, i: int) -> tuple[torch.Tensor, list[Placement]]:
        """Canvas ``i`` (size, size) in [0, 1] and its placements, from its own generator."""
        i = self._check_index(i)
        spec = self.spec
        g = torch.Generator().manual_seed(canvas_seed(self.seed, self.split, i))
        canvas = torch.zeros(spec.size, spec.size)
        placed: list[Placement] = []
        wanted = self._randint(g, spec.min_items, spec.max_items)
        for _ in range(wanted):
            for _ in range(PLACEMENT_TRIES):
                item = self._draw_item(g)
                if item is None:  # no pixel above the threshold: nothing to detect, draw another
                    continue
                patch, placement = item
                if all(_iou(placement.box, p.box) <= spec.max_overlap for p in placed):
                    y, x, s = placement.y, placement.x, placement.scale
                    # max, not sum or overwrite: where items overlap, both stay visible
                    canvas[y:y + s, x:x + s] = torch.maximum(canvas[y:y + s, x:x + s], patch)
                    placed.append(placement)
                    break
        if not placed:  # only if every draw was blank; the first item never overlaps anything
            raise UserError(f"canvas {i}: no Fashion-MNIST item with a pixel above {PIXEL_THRESHOLD} "
                               f"in {PLACEMENT_TRIES} draws")
        return canvas, placed

    def _draw_item(self, g: torch.Generator) -> Optional[tuple[torch.Tensor, Placement]]:
        """Draw one item: its resized, thresholded patch (s, s) and its placement (None if blank)."""
        spec = self.spec
        source = self._randint(g, 0, len(self.images) - 1)
        s = self._randint(g, spec.min_scale, spec.max_scale)
        x = self._randint(g, 0, spec.size - s)
        y = self._randint(g, 0, spec.size - s)
        patch = self._item_patch(source, s)
        visible = patch > 0  # (s, s)
        if not visible.any():
            return None
        rows = visible.any(dim=1).nonzero()[:, 0]
        cols = visible.any(dim=0).nonzero()[:, 0]
        box = (x + int(cols[0]), y + int(rows[0]), x + int(cols[-1]) + 1, y + int(rows[-1]) + 1)
        return patch, Placement(source, int(self.labels[source]), s, x, y, box)

    def _item_patch(self, source: int, scale: int) -> torch.Tensor:
        """Image ``source`` resized to (scale, scale), pixels at or below ``PIXEL_THRESHOLD`` set to black."""
        image = self.images[source].float().div(255)[None, None]  # (1, 1, 28, 28)
        patch = F.interpolate(image, size=(scale, scale), mode="bilinear", antialias=True, align_corners=False)[0, 0]
        patch = patch.clamp(0, 1)
        return patch * (patch > PIXEL_THRESHOLD)

    def mask(self, i: int) -> torch.Tensor:
        """Canvas ``i``'s pixel labels (size, size) int64: each item's visible pixels its class, the rest
        ``BACKGROUND``. Where items overlap, a pixel belongs to the item that the canvas shows there (the brighter one,
        as the canvas keeps the maximum; the later item on a tie)."""
        return self.image_and_mask(i)[1]

    def image_and_mask(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Canvas ``i`` as ``dataset[i]`` gives its image (3, size, size), and its ``mask``, from one drawing."""
        canvas, placed = self._draw(i)
        mask = torch.full(canvas.shape, BACKGROUND, dtype=torch.int64)
        for p in placed:
            patch = self._item_patch(p.source, p.scale)
            region = mask[p.y:p.y + p.scale, p.x:p.x + p.scale]
            shown = (patch > 0) & (patch >= canvas[p.y:p.y + p.scale, p.x:p.x + p.scale])
            region[shown] = p.label
        return canvas.unsqueeze(0).repeat(3, 1, 1), mask

    @staticmethod
    def _randint(g: torch.Generator, low: int, high: int) -> int:
        """Uniform integer in [low, high] (both included)."""
        return int(torch.randint(low, high + 1, (1,), generator=g))


def collate(batch: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """DataLoader ``collate_fn``: (images (B, 3, H, W), list of B targets)."""
    images = torch.stack([image for image, _ in batch])
    return images, [target for _, target in batch]


def image_file_name(split: str, index: int) -> str:
    """The file name canvas ``index`` has in COCO files (the canvases are not written as images)."""
    return f"{split}_{index:06d}.png"


def coco_ground_truth(dataset: DetectionCanvases) -> dict[str, Any]:
    """The data set's boxes and classes as a COCO detection dict (images, annotations, categories)."""
    size = dataset.spec.size
    images, annotations = [], []
    for i in range(len(dataset)):
        _, target = dataset[i]
        images.append({"id": i, "width": size, "height": size, "file_name": image_file_name(dataset.split, i)})
        for label, box in zip(target["class_labels"].tolist(), target["boxes_xywh"].tolist()):
            annotations.append({
                "id": len(annotations) + 1,  # COCOeval treats annotation id 0 as "unmatched"
                "image_id": i,
                "category_id": category_id(label),
                "bbox": [float(v) for v in box],
                "area": float(box[2] * box[3]),
                "iscrowd": 0,
            })
    categories = [{"id": category_id(label), "name": name} for label, name in enumerate(CLASS_NAMES)]
    return {"images": images, "annotations": annotations, "categories": categories}


def write_coco(dataset: DetectionCanvases, path: PathLike) -> Path:
    """Write ``coco_ground_truth(dataset)`` as a JSON file, atomically; return its path."""
    return write_text(path, json.dumps(coco_ground_truth(dataset)) + "\n")


def save_preview(dataset: DetectionCanvases, indices: Sequence[int], path: PathLike, columns: int = 4) -> Path:
    """Draw canvases with their boxes and class names into an image file (PNG by its suffix).

    Args:
        dataset: the canvases.
        indices: which canvases to draw, in order.
        path: the image file to write (atomically).
        columns: canvases per row.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    if not indices:
        raise UserError("save_preview needs at least one canvas index")
    columns = max(1, min(columns, len(indices)))
    rows = -(-len(indices) // columns)
    fig = Figure(figsize=(2.4 * columns, 2.4 * rows))
    FigureCanvasAgg(fig)  # render with Agg, whatever pyplot's backend is
    for k, i in enumerate(indices):
        ax = fig.add_subplot(rows, columns, k + 1)
        image, target = dataset[i]
        ax.imshow(image[0].numpy(), cmap="gray", vmin=0, vmax=1)
        for label, (x, y, w, h) in zip(target["class_labels"].tolist(), target["boxes_xywh"].tolist()):
            # pixel (c, r) covers [c - 0.5, c + 0.5] in imshow's coordinates
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), w, h, fill=False, edgecolor="tab:orange", linewidth=1))
            ax.text(x - 0.5, y - 1.5, CLASS_NAMES[label], color="tab:orange", fontsize=6, va="bottom")
        ax.set_title(f"{dataset.split} #{i}", fontsize=7)
        ax.set_axis_off()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", dpi=120)
    return write_bytes(path, buffer.getvalue())
