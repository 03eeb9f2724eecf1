"""Wall-clock speed of MoD and token merging at matched cost, against each one's FLOP bound.

The methods of ``amod compare`` are set to the same cost points on one timm model (random weights:
speed does not depend on them), then all run interleaved in one process (warm-ups discarded,
medians reported). Efficiency = measured speed-up / FLOP-bound speed-up (1 / cost). The speed-up is
also taken round by round (dense time / method time within the same round, then the median), which
cancels drifts of the machine's speed that are slower than one round. Usage:
    python benchmarks/bench_compare.py [--model deit_small_patch16_224] [--batch-size 32] [--costs 0.56 0.75]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
from _common import ensure_tunables, machine

from amod.cost import flops
from amod.tools.bench import make_bench_model, time_models
from amod.experiments.compare import COMPARED


def main() -> None:
    ensure_tunables()
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--costs", type=float, nargs="+", default=[0.56, 0.75])
    p.add_argument("--methods", nargs="+", default=None, help="names from amod.experiments.compare.COMPARED (default: all "
                   "but standard MoD, which computes what A-MoD does plus one linear per token)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense = make_bench_model(args.model, None, None).to(dev).eval()
    models, costs = {"dense": dense}, {"dense": 1.0}
    for cost in args.costs:
        for entry in COMPARED:
            if (entry.name not in args.methods) if args.methods else getattr(entry.method, "router", "") == "standard":
                continue
            name = f"{entry.name} @ {cost:g}"
            models[name] = entry.at_cost(dense, cost).apply(copy.deepcopy(dense)).eval()
            costs[name] = flops(models[name]).ratio
    x = torch.randn(args.batch_size, 3, *dense.patch_embed.img_size, device=dev)
    timed = time_models(models, x, repeats=args.repeats, warmup=args.warmup)
    print(f"{args.model} batch {args.batch_size}, {machine()}")
    print(f"interleaved, median of {args.repeats} after {args.warmup} warm-ups")
    print(f"{'method':28s} {'cost':>6s} {'images/s':>9s} {'speed-up':>9s} {'FLOP bound':>10s} {'efficiency':>10s} "
          f"{'per-round':>10s} {'spread':>7s}")
    rows = []
    dense_times = timed["dense"]["times"]
    for name, t in timed.items():
        speedup = t["images_per_s"] / timed["dense"]["images_per_s"]
        paired = statistics.median(d / m for d, m in zip(dense_times, t["times"]))
        bound = 1.0 / costs[name]
        rows.append({"method": name, "cost": costs[name], "images_per_s": t["images_per_s"], "speedup": speedup,
                     "flop_speedup": bound, "efficiency": speedup / bound, "paired_speedup": paired,
                     "paired_efficiency": paired / bound, "spread": t["spread"]})
        print(f"{name:28s} {costs[name]:6.3f} {t['images_per_s']:9.1f} {speedup:9.3f} {bound:10.3f} "
              f"{speedup / bound:10.3f} {paired / bound:10.3f} {t['spread']:7.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "model": args.model, "batch": args.batch_size,
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
