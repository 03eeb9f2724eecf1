"""Fashion-MNIST detection canvases (reproducible, exact boxes, real labels) and COCO AP evaluation."""
from __future__ import annotations

import json

import pytest
import torch

from amod.detect.canvases import (CLASS_NAMES, CanvasSpec, DetectionCanvases, category_id, collate,
                                  coco_ground_truth, label_of, write_coco)
from amod.detect.evaluate import coco_ap, detections_from_outputs

SINGLE = CanvasSpec(size=64, min_items=1, max_items=1, min_scale=16, max_scale=40)


def _same(a, b) -> bool:
    (image_a, target_a), (image_b, target_b) = a, b
    return (torch.equal(image_a, image_b) and target_a["image_id"] == target_b["image_id"]
            and all(torch.equal(target_a[k], target_b[k]) for k in ("class_labels", "boxes", "boxes_xywh")))


def test_canvases_are_a_function_of_seed_split_and_index():
    first, second = DetectionCanvases("train", 30, seed=3), DetectionCanvases("train", 30, seed=3)
    forward = [first[i] for i in range(30)]
    backward = {i: second[i] for i in reversed(range(30))}
    assert all(_same(forward[i], backward[i]) for i in range(30))
    assert all(_same(first[i], first[i]) for i in (0, 7, 29))  # no state carried between accesses

    other_seed = DetectionCanvases("train", 30, seed=4)
    val = DetectionCanvases("val", 30, seed=3)
    assert not any(torch.equal(first[i][0], other_seed[i][0]) for i in range(30))
    assert not any(torch.equal(first[i][0], val[i][0]) for i in range(30))

    # a DataLoader in any order gives the same canvases (collate: stacked images, list of targets)
    loader = torch.utils.data.DataLoader(second, batch_size=4, shuffle=True, collate_fn=collate)
    images, targets = next(iter(loader))
    assert images.shape == (4, 3, 128, 128) and images.dtype == torch.float32 and len(targets) == 4
    for image, target in zip(images, targets):
        assert _same((image, target), forward[target["image_id"]])


def test_single_item_box_is_exactly_the_items_pixels():
    ds = DetectionCanvases("val", 40, SINGLE, seed=1)
    for i in range(len(ds)):
        image, target = ds[i]
        assert image.shape == (3, 64, 64) and 0 <= image.min() and image.max() <= 1
        assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
        (x, y, w, h), = target["boxes_xywh"].tolist()
        assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= 64 and y + h <= 64
        assert all(v == int(v) for v in (x, y, w, h))
        x, y, w, h = int(x), int(y), int(w), int(h)
        rows, cols = image[0].nonzero().unbind(1)
        # the only nonzero pixels are in the box, and they touch all four of its sides: nothing in a
        # 1-pixel ring around it, something on each of its edges
        assert (cols.min(), rows.min(), cols.max() + 1, rows.max() + 1) == (x, y, x + w, y + h)
        ring = torch.nn.functional.pad(image[0], (1, 1, 1, 1))[y:y + h + 2, x:x + w + 2].clone()
        ring[1:-1, 1:-1] = 0
        assert ring.count_nonzero() == 0
        inside = image[0, y:y + h, x:x + w]
        assert inside[0].any() and inside[-1].any() and inside[:, 0].any() and inside[:, -1].any()


def test_boxes_of_many_items_lie_inside_and_agree_between_formats():
    ds = DetectionCanvases("train", 40, seed=2)
    spec = ds.spec
    counts = set()
    for i in range(len(ds)):
        image, target = ds[i]
        xywh, cxcywh, labels = target["boxes_xywh"], target["boxes"], target["class_labels"]
        counts.add(len(labels))
        assert xywh.dtype == cxcywh.dtype == torch.float32 and labels.dtype == torch.int64
        assert xywh.shape == cxcywh.shape == (len(labels), 4)
        assert (xywh[:, 2:] > 0).all() and (xywh[:, :2] >= 0).all() and (xywh[:, :2] + xywh[:, 2:] <= spec.size).all()
        assert (cxcywh >= 0).all() and (cxcywh <= 1).all()
        expected = torch.cat([xywh[:, :2] + xywh[:, 2:] / 2, xywh[:, 2:]], 1) / spec.size
        torch.testing.assert_close(cxcywh, expected)
        for (x, y, w, h) in xywh.int().tolist():
            assert image[0, y:y + h, x:x + w].any()  # max-combining keeps every item visible
        boxes = [p.box for p in ds.placements(i)]
        for a in range(len(boxes)):
            for b in range(a):
                assert _iou(boxes[a], boxes[b]) <= spec.max_overlap
    assert counts == set(range(spec.min_items, spec.max_items + 1))


def _iou(a, b) -> float:
    w, h = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0) * max(h, 0)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_labels_are_the_fashion_mnist_labels_of_the_items():
    ds = DetectionCanvases("train", 200, SINGLE, seed=5)
    histogram = torch.zeros(10, dtype=torch.int64)
    for i in range(len(ds)):
        label, = ds[i][1]["class_labels"].tolist()
        placement, = ds.placements(i)
        assert label == placement.label == int(ds.labels[placement.source])
        histogram[label] += 1
    assert (histogram > 0).all(), histogram  # all ten classes occur
    val = DetectionCanvases("val", 5, SINGLE)
    assert len(val.images) == 10_000  # validation canvases take their items from the test split
    assert len(CLASS_NAMES) == 10 and CLASS_NAMES[9] == "Ankle boot"
    assert [label_of(category_id(k)) for k in range(10)] == list(range(10)) and category_id(0) == 1


def test_coco_ground_truth_and_ap(tmp_path):
    pytest.importorskip("pycocotools")
    ds = DetectionCanvases("val", 24, CanvasSpec(size=96, max_scale=40), seed=7)
    gt = coco_ground_truth(ds)
    assert [image["id"] for image in gt["images"]] == list(range(24))
    assert gt["images"][3]["file_name"] == "val_000003.png" and gt["images"][3]["width"] == 96
    assert [a["id"] for a in gt["annotations"]] == list(range(1, len(gt["annotations"]) + 1))
    assert [c["id"] for c in gt["categories"]] == list(range(1, 11))
    first = gt["annotations"][0]
    assert first["area"] == first["bbox"][2] * first["bbox"][3] and first["iscrowd"] == 0
    path = write_coco(ds, tmp_path / "val.json")
    assert json.loads(path.read_text()) == gt and not list(tmp_path.glob("*.tmp"))

    perfect = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": list(a["bbox"]), "score": 1.0}
               for a in gt["annotations"]]
    ap = coco_ap(gt, perfect)
    assert abs(ap["AP"] - 1.0) < 1e-6 and abs(ap["AP50"] - 1.0) < 1e-6, ap
    assert len(gt["annotations"][0]) == 6 and "ignore" not in gt["annotations"][0]  # gt left as it was

    shifted = [{**d, "bbox": [d["bbox"][0] + d["bbox"][2] / 2, *d["bbox"][1:]]} for d in perfect]
    worse = coco_ap(gt, shifted)
    assert worse["AP50"] < 1.0 and worse["AP"] < ap["AP"]
    assert coco_ap(gt, []) == {k: 0.0 for k in ap}
    misnamed = [{**d, "category_id": d["category_id"] % 10 + 1} for d in perfect]  # right boxes, wrong classes
    assert coco_ap(gt, misnamed)["AP50"] == 0.0 and coco_ap(gt, misnamed, class_agnostic=True)["AP50"] > 1 - 1e-6
    assert coco_ap(gt, [{**perfect[0], "image_id": 10_000}]) == {k: 0.0 for k in ap}  # not in the gt

    # round trip through DETR's output format: all probability on the true class at the true box,
    # padding queries on "no object"
    batch = [ds[i] for i in range(len(ds))]
    queries = max(len(t["class_labels"]) for _, t in batch) + 2
    logits = torch.zeros(len(batch), queries, 11)
    logits[:, :, 10] = 20.0
    boxes = torch.full((len(batch), queries, 4), 0.25)
    for b, (_, target) in enumerate(batch):
        m = len(target["class_labels"])
        logits[b, :m, 10] = 0.0
        logits[b, torch.arange(m), target["class_labels"]] = 20.0
        boxes[b, :m] = target["boxes"]
    detections = detections_from_outputs(logits, boxes, [t["image_id"] for _, t in batch], 96, top_k=queries)
    assert len(detections) == len(batch) * queries
    assert all(0 <= d["bbox"][0] and d["bbox"][0] + d["bbox"][2] <= 96 + 1e-4 for d in detections)
    round_trip = coco_ap(gt, detections)
    assert abs(round_trip["AP"] - 1.0) < 1e-6 and abs(round_trip["AP50"] - 1.0) < 1e-6, round_trip
    assert len(detections_from_outputs(logits, boxes, list(range(len(batch))), (96, 96), top_k=3)) == 3 * len(batch)


def test_detections_clip_boxes_to_the_image():
    logits = torch.zeros(1, 1, 3)
    detection, = detections_from_outputs(logits, torch.tensor([[[0.9, 0.5, 0.4, 0.2]]]), [0], (50, 100))
    assert detection["bbox"] == pytest.approx([70.0, 20.0, 30.0, 10.0])  # x from 70 to 110 -> 100
    assert detection["category_id"] in (1, 2) and detection["score"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("fields, name", [
    (dict(min_items=3, max_items=2), "min_items"),
    (dict(size=16), "size"),
    (dict(min_items=0), "min_items"),
    (dict(min_scale=50, max_scale=40), "min_scale"),
    (dict(max_scale=200), "max_scale"),
    (dict(max_overlap=1.0), "max_overlap"),
])
def test_nonsense_specs_are_refused_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        CanvasSpec(**fields).validate()
    with pytest.raises(ValueError, match=name):
        DetectionCanvases("train", 1, CanvasSpec(**fields))


def test_bad_split_and_index_are_refused():
    with pytest.raises(ValueError, match="split"):
        DetectionCanvases("test", 1)
    with pytest.raises(IndexError):
        DetectionCanvases("val", 3)[3]
