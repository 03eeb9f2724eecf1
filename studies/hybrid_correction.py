"""What a finetuned hybrid router learned: how far its correction moved it from A-MoD.

For every hybrid model the finetune study kept (``OUT/models/seed0/COST/hybrid*.safetensors``), at each MoD block,
over the study's first 64 test images: the norm of the correction's weight w, the largest change exp(c_i) - 1 it
makes to any token's score, the per-image Spearman correlation between the hybrid's scores and the attention scores
they multiply (mean and smallest), and the share of the tokens the block keeps that the attention scores alone would
not keep. Usage:

    python studies/hybrid_correction.py runs/finetune_review [--images 64]

The images are the study's (Fashion-MNIST at its settings, ``FinetuneConfig``'s defaults) read as the study reads
them (``build_datasets``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import amod
from amod.experiments.finetune_study.plan import FinetuneConfig
from amod.mod.routers import AttentionRouter, HybridRouter
from amod.mod.routing import select_tokens
from amod.stats import spearman
from amod.train.data import build_datasets


def block_scores(model: torch.nn.Module, x: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
    """Per MoD block: (the attention scores it reads, the hybrid's scores, how many patch tokens it keeps)."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, blk in amod.mod_blocks(model):
        router = blk.router
        assert isinstance(router, HybridRouter), f"block {i} has a {type(router).__name__}"

        def recording(x_patch, attention_scores, router=router, i=i):
            scores = HybridRouter.score(router, x_patch, attention_scores)
            seen[i] = (AttentionRouter.score(router, x_patch, attention_scores), scores)
            return scores

        router.score = recording  # (an instance attribute: this loaded copy only)
    amod.set_recording(model, True)
    with torch.no_grad():
        model(x)
    return {i: (*seen[i], blk.amod_last_index.shape[1]) for i, blk in amod.mod_blocks(model)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the finetune study's --out")
    ap.add_argument("--images", type=int, default=64)
    args = ap.parse_args()
    cfg = FinetuneConfig(checkpoint="")
    _, test, _ = build_datasets(cfg.data, cfg.img_size, cfg.probe_train, cfg.eval_images)
    x = torch.stack([test[i][0] for i in range(args.images)])
    print(f"first {args.images} test images; per MoD block in order\n")
    print("| model | ‖w‖ | largest score change | rank corr with attention: mean (smallest) | kept tokens attention "
          "alone would not keep |")
    print("|---|---|---|---|---|")
    for path in sorted(args.out.glob("models/seed0/*/hybrid*.safetensors")):
        model = amod.load(path).eval()
        norms, changes, rhos, moved = [], [], [], []
        routers = dict(amod.mod_blocks(model))
        for i, (attention, scores, k) in block_scores(model, x).items():
            norms.append(routers[i].router.proj.weight.norm().item())
            changes.append((scores / attention - 1).abs().max().item())
            per_image = [spearman(a, s) for a, s in zip(attention.numpy(), scores.numpy())]
            rhos.append(f"{np.mean(per_image):.3f} ({min(per_image):.3f})")
            unit = routers[i].router.score_unit(attention.shape[1])  # (the model's own ranking, near-ties included)
            kept_a, kept_s = (select_tokens(s, k, unit) for s in (attention, scores))
            moved.append(1 - np.mean([len(set(a.tolist()) & set(s.tolist())) / k for a, s in zip(kept_a, kept_s)]))
        print(f"| {path.parent.name} {path.stem} | {', '.join(f'{n:.4f}' for n in norms)} | "
              f"{', '.join(f'{100 * c:.1f} %' for c in changes)} | {', '.join(rhos)} | "
              f"{', '.join(f'{100 * m:.1f} %' for m in moved)} |", flush=True)


if __name__ == "__main__":
    main()
