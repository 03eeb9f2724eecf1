"""Zero-training COCO AP of a dense DETR converted at matched encoder cost, every router (docs/detr.md).

    python studies/detr_zero.py [DETECTOR] [--out runs/detect/zero.json]

DETECTOR: an ``amod detect train`` run's model.safetensors (default runs/detect/dense/model.safetensors).
MoD on encoder layers 1-5, the capacity whose encoder MACs are closest to 0.5 and 0.25 of dense; AP on the
run's 1,000 validation canvases. Prints one JSON row per (cost, router) and writes them all to --out.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import amod
from amod.detect.canvases import coco_ground_truth
from amod.detect.config import DetectConfig
from amod.detect.evaluate import coco_ap
from amod.detect.train import datasets, evaluate, load_detector, predict
from amod.families.detr import capacity_for_encoder_cost

ROUTERS = ("attention", "standard", "random", "feature-norm")
LAYERS = [1, 2, 3, 4, 5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("detector", nargs="?", default="runs/detect/dense/model.safetensors")
    parser.add_argument("--out", default="runs/detect/zero.json")
    parser.add_argument("--costs", type=float, nargs="+", default=[0.5, 0.25])
    args = parser.parse_args()
    started = time.perf_counter()
    _, val = datasets(DetectConfig())
    ground_truth = coco_ground_truth(val)
    dense = load_detector(args.detector).eval()
    detections = predict(dense, val)
    agnostic = coco_ap(ground_truth, detections, class_agnostic=True)  # how much of the gap is naming the class
    rows = [{"cost": 1.0, "router": "dense", "capacity": 1.0, "encoder": 1.0, "model": 1.0,
             **coco_ap(ground_truth, detections),
             "class_agnostic_AP": agnostic["AP"], "class_agnostic_AP50": agnostic["AP50"]}]
    print(json.dumps(rows[-1]), flush=True)
    for cost in args.costs:
        for router in ROUTERS:
            torch.manual_seed(0)  # the untrained standard router's weights
            model = amod.convert(load_detector(args.detector).eval(), router=router, capacity=1.0, layers=LAYERS)
            amod.set_capacity(model, capacity_for_encoder_cost(model, cost, val.spec.size))
            report = amod.flops(model, val.spec.size)
            rows.append({"cost": cost, "router": router, "capacity": model.amod_config.capacity,
                         "encoder": report.encoder_ratio, "model": report.ratio,
                         **evaluate(model, val, ground_truth)})
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
