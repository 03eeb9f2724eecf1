"""COCO box AP of DETR outputs: post-processing to COCO detections, and pycocotools' COCOeval.

``detections_from_outputs`` turns a batch of DETR outputs (class logits with a last "no object"
class, normalised (cx, cy, w, h) boxes) into COCO result dicts; ``coco_ap`` scores a list of them
against a ground-truth dict such as ``amod.detect.canvases.coco_ground_truth`` returns.
pycocotools is an optional dependency (``pip install 'amod[detr]'``), imported only here.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, Sequence, Union

import torch
from torchvision.ops import box_convert

from .canvases import category_id
from ..errors import MissingDependencyError, UserError

AP_KEYS = ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")  # COCOeval.stats[0:6], in order


def detections_from_outputs(logits: torch.Tensor, pred_boxes: torch.Tensor, image_ids: Sequence[int],
                            size: Union[int, tuple[int, int]], top_k: int = 100) -> list[dict[str, Any]]:
    """COCO detections from DETR outputs, post-processed the standard way.

    Each query gets the real class with the highest softmax probability (over all C + 1 classes,
    the last being "no object") and that probability as its score; its box becomes absolute COCO
    [x, y, w, h], clipped to the image; the ``top_k`` queries by score are kept per image.

    Args:
        logits: (B, Q, C + 1) class logits.
        pred_boxes: (B, Q, 4) boxes, normalised (cx, cy, w, h).
        image_ids: the B image ids.
        size: image side, or (height, width), in pixels.
        top_k: detections kept per image.

    Returns:
        One dict per detection: image_id, category_id, bbox, score (python numbers).
    """
    if logits.ndim != 3 or pred_boxes.shape != (*logits.shape[:2], 4):
        raise UserError(f"expected logits (B, Q, C+1) and pred_boxes (B, Q, 4), got {tuple(logits.shape)} "
                        f"and {tuple(pred_boxes.shape)}")
    if len(image_ids) != logits.shape[0]:
        raise UserError(f"{len(image_ids)} image ids for a batch of {logits.shape[0]}")
    height, width = (size, size) if isinstance(size, int) else size
    probs = logits.detach().float().softmax(-1)[..., :-1]  # (B, Q, C): "no object" dropped after the softmax
    scores, labels = probs.max(-1)  # (B, Q)
    scale = torch.tensor([width, height, width, height], dtype=torch.float32)
    xyxy = box_convert(pred_boxes.detach().float().cpu(), "cxcywh", "xyxy") * scale  # (B, Q, 4) pixels
    xyxy = torch.minimum(xyxy.clamp(min=0), scale)  # clip to the image
    xywh = box_convert(xyxy, "xyxy", "xywh")
    scores, labels = scores.cpu(), labels.cpu()
    detections = []
    for b, image_id in enumerate(image_ids):
        keep = scores[b].topk(min(top_k, scores.shape[1])).indices
        for q in keep.tolist():
            detections.append({
                "image_id": int(image_id),
                "category_id": category_id(int(labels[b, q])),
                "bbox": [float(v) for v in xywh[b, q].tolist()],
                "score": float(scores[b, q]),
            })
    return detections


def coco_ap(ground_truth: dict[str, Any], detections: list[dict[str, Any]],
            class_agnostic: bool = False) -> dict[str, float]:
    """COCO bbox AP (IoU .50:.95), AP50, AP75 and AP by object size of ``detections``.

    ``class_agnostic``: every detection may match any object whatever the two classes (COCOeval's
    ``useCats = 0``), which separates finding the objects from naming them. Only the images of
    ``ground_truth`` are evaluated (detections on other images are ignored).
    As in COCOeval, a size class without any ground-truth object scores -1. With no detections at
    all every value is 0.0.

    Raises:
        ImportError: pycocotools is not installed.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        raise MissingDependencyError("COCO evaluation needs pycocotools: pip install 'amod[detr]'") from None
    image_ids = [image["id"] for image in ground_truth["images"]]
    known = set(image_ids)
    # copies: loadRes and COCOeval write fields (id, area, ignore, ...) into the dicts they are given
    detections = [dict(d) for d in detections if d["image_id"] in known]
    if not detections:  # loadRes refuses an empty list
        return {key: 0.0 for key in AP_KEYS}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress and the summary table
        gt = COCO()
        gt.dataset = {**ground_truth, "annotations": [dict(a) for a in ground_truth["annotations"]]}
        gt.createIndex()
        evaluation = COCOeval(gt, gt.loadRes(detections), "bbox")
        evaluation.params.imgIds = image_ids
        evaluation.params.useCats = 0 if class_agnostic else 1
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return {key: float(value) for key, value in zip(AP_KEYS, evaluation.stats)}
