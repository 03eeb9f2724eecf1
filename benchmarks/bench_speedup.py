"""Wall-clock speed-up of MoD over the unconverted timm model, against the FLOP bound.

All models run interleaved in one process (warm-ups discarded, medians reported), so the ratios are
taken under the same conditions. Usage:
    python benchmarks/bench_speedup.py [--model deit_small_patch16_224] [--batch-size 32] [--repeats 15]
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from _common import ensure_tunables, machine

import amod
from amod.experiments.bench import make_bench_model, time_models


def main() -> None:
    ensure_tunables()
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense = make_bench_model(args.model, args.img_size, None).to(dev)
    models = {"dense": dense}
    for router in ("attention", "standard"):
        for capacity in (0.5, 0.125):
            models[f"{router}@{capacity}"] = amod.convert(copy.deepcopy(dense), router=router, capacity=capacity)
    results = {}
    for batch in (args.batch_size, 1):
        x = torch.randn(batch, 3, *dense.patch_embed.img_size, device=dev)
        timed = time_models(models, x, repeats=args.repeats if batch > 1 else 3 * args.repeats, warmup=args.warmup)
        results[batch] = timed
    print(f"{args.model}, {machine()}")
    print(f"interleaved, median of {args.repeats} (batch 1: {3 * args.repeats}) after {args.warmup} warm-ups")
    print(f"{'variant':18s} {'batch':>5s} {'images/s':>10s} {'speed-up':>9s} {'FLOP bound':>10s} {'efficiency':>10s} {'spread':>7s}")
    rows = []
    dense_macs = amod.flops(dense).macs
    for batch, timed in results.items():
        for name, t in timed.items():
            bound = dense_macs / amod.flops(models[name]).macs
            speedup = t["images_per_s"] / timed["dense"]["images_per_s"]
            rows.append({"variant": name, "batch": batch, "images_per_s": t["images_per_s"], "speedup": speedup,
                         "flop_speedup": bound, "efficiency": speedup / bound, "spread": t["spread"]})
            print(f"{name:18s} {batch:5d} {t['images_per_s']:10.1f} {speedup:9.3f} {bound:10.3f} {speedup / bound:10.3f} "
                  f"{t['spread']:7.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "model": args.model, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
