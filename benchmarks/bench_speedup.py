"""Wall-clock speed-up of MoD over the unconverted timm model, against the FLOP bound, in eager PyTorch,
in ONNX Runtime (the models exported with ``amod.export``) and under ``torch.compile``.

All models of all runtimes run interleaved in one process (warm-ups discarded, medians reported), so
the ratios are taken under the same conditions. The speed-up of a variant is the median over rounds of
dense seconds / variant seconds in the same round and runtime (quartiles beside it); efficiency is
that speed-up over the FLOP bound. Usage:
    python benchmarks/bench_speedup.py [--model deit_small_patch16_224] [--batch-size 32] [--repeats 15]
        [--runtimes torch,onnxruntime,compile] [--variants dense,attention@0.5,attention@0.125,...]
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
import warnings
from pathlib import Path

import torch
from _common import ensure_tunables, machine

import amod
from amod.tools.bench import (make_bench_model, onnx_sessions, paired_ratios, session_callable,
                              time_callables)

RUNTIMES = ("torch", "onnxruntime", "compile")
VARIANTS = "dense,attention@0.5,attention@0.125,standard@0.5,standard@0.125"


def build_variants(dense: torch.nn.Module, names: list[str]) -> dict[str, torch.nn.Module]:
    models = {"dense": dense}
    for name in names:
        if name == "dense":
            continue
        router, _, capacity = name.partition("@")
        models[name] = amod.convert(copy.deepcopy(dense), router=router, capacity=float(capacity))
    return models


def main() -> None:
    ensure_tunables()
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runtimes", default="torch,onnxruntime",
                   help=f"comma-separated, of {', '.join(RUNTIMES)} (compile: torch.compile, slow to build)")
    p.add_argument("--variants", default=VARIANTS, help="dense and ROUTER@CAPACITY entries, comma-separated")
    p.add_argument("--no-batch1", action="store_true", help="skip the batch-1 rounds")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    runtimes = [r for r in args.runtimes.split(",") if r]
    unknown = set(runtimes) - set(RUNTIMES)
    if unknown:
        p.error(f"unknown runtimes {sorted(unknown)}; choose from {', '.join(RUNTIMES)}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "onnxruntime" in runtimes and dev.type != "cpu":
        p.error("the onnxruntime column is measured on the CPU")
    dense = make_bench_model(args.model, args.img_size, None).to(dev)
    models = build_variants(dense, [v for v in args.variants.split(",") if v])
    for m in models.values():
        m.eval()
    sessions, compiled, exports = {}, {}, {}
    if "onnxruntime" in runtimes:
        with tempfile.TemporaryDirectory(prefix="amod-bench-") as tmp:
            sessions, exports = onnx_sessions(models, tmp)
    if "compile" in runtimes:
        compiled = {name: torch.compile(m) for name, m in models.items()}
    results = {}
    for batch in (args.batch_size,) if args.no_batch1 else (args.batch_size, 1):
        x = torch.randn(batch, 3, *dense.patch_embed.img_size, device=dev)
        fns = {}
        if "torch" in runtimes:
            fns.update({("torch", n): (lambda m=m: m(x)) for n, m in models.items()})
        if "onnxruntime" in runtimes:
            fns.update({("onnxruntime", n): session_callable(s, x) for n, s in sessions.items()})
        if "compile" in runtimes:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for m in compiled.values():
                    m(x)  # compile for this batch size before timing
            fns.update({("compile", n): (lambda m=m: m(x)) for n, m in compiled.items()})
        repeats = args.repeats if batch > 1 else 3 * args.repeats
        timed = time_callables(fns, repeats=repeats, warmup=args.warmup, device=dev)
        results[batch] = timed
    print(f"{args.model}, {machine()}")
    print(f"interleaved, median of {args.repeats} (batch 1: {3 * args.repeats}) after {args.warmup} warm-ups; "
          "speed-up: median over rounds of dense/variant in the same round [quartiles]")
    header = (f"{'runtime':12s} {'variant':16s} {'batch':>5s} {'images/s':>9s} {'speed-up':>8s} {'[q1-q3]':>13s} "
              f"{'FLOP bound':>10s} {'efficiency':>10s} {'spread':>7s}")
    if "compile" in runtimes and "torch" in runtimes:
        header += f" {'vs eager':>8s}"
    print(header)
    rows = []
    dense_macs = amod.flops(dense).macs
    for batch, timed in results.items():
        for (runtime, name), t in timed.items():
            bound = dense_macs / amod.flops(models[name]).macs
            ratio = paired_ratios(timed[(runtime, "dense")]["times"], t["times"])
            row = {"runtime": runtime, "variant": name, "batch": batch, "images_per_s": batch / t["seconds"],
                   "speedup": ratio["median"], "speedup_q1": ratio["q1"], "speedup_q3": ratio["q3"],
                   "flop_speedup": bound, "efficiency": ratio["median"] / bound, "spread": t["spread"]}
            line = (f"{runtime:12s} {name:16s} {batch:5d} {row['images_per_s']:9.1f} {ratio['median']:8.3f} "
                    f"[{ratio['q1']:.2f}-{ratio['q3']:.2f}]".ljust(67)
                    + f" {bound:10.3f} {row['efficiency']:10.3f} {t['spread']:7.1%}")
            if runtime == "compile" and ("torch", name) in timed:
                row["vs_eager"] = paired_ratios(timed[("torch", name)]["times"], t["times"])["median"]
                line += f" {row['vs_eager']:8.3f}"
            rows.append(row)
            print(line)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "model": args.model, "rows": rows,
                                              "onnx_ops": {n: r["ops"] for n, r in exports.items()}}, indent=2))


if __name__ == "__main__":
    main()
