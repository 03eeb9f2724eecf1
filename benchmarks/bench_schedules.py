"""Does a fold model's token schedule change its speed at the same MACs? And what do ToMe and PiToMe run at there?

At one cost (share of the dense MACs), fold models with every tilt that ``amod.calibrate`` tries (block i keeps
C ** w_i of its patch tokens; the tilt bends w from early to late removal), and ToMe and PiToMe set to the same
cost, are timed interleaved with the dense model at each batch size: the speed-up of a model is the median over
rounds of dense seconds / its seconds in the same round (quartiles beside it). Weights do not change the time:
the architecture is built without them. Usage:
    python benchmarks/bench_schedules.py [--model vit_small_patch14_dinov2] [--img-size 112] [--cost 0.5]
        [--batch-sizes 32,1] [--repeats 9]
"""
from __future__ import annotations

import argparse
import copy

import timm
import torch
from _common import ensure_tunables, machine

import amod
from amod.tools.bench import paired_ratios, time_callables
from amod.mod.calibrate import DEFAULT_TILTS, tilt_shape


def variants(dense: torch.nn.Module, cost: float, tilts: list[float]) -> dict[str, torch.nn.Module]:
    depth = len(dense.blocks)
    models = {"dense": dense}
    for tilt in tilts:
        m = amod.convert(copy.deepcopy(dense), skipped="fold", capacity=1.0, protect=0.0, shape=tilt_shape(tilt, depth))
        amod.set_capacity(m, amod.capacity_for_cost(m, cost))
        models[f"fold tilt {tilt:+g}"] = m
    models["ToMe"] = amod.tome.apply(copy.deepcopy(dense), cost=cost)
    models["PiToMe"] = amod.pitome.apply(copy.deepcopy(dense), cost=cost)
    return {n: m.eval() for n, m in models.items()}


def main() -> None:
    ensure_tunables()
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vit_small_patch14_dinov2")
    p.add_argument("--img-size", type=int, default=112)
    p.add_argument("--cost", type=float, default=0.5)
    p.add_argument("--tilts", default=",".join(f"{t:g}" for t in DEFAULT_TILTS))
    p.add_argument("--batch-sizes", default="32,1")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    dense = timm.create_model(args.model, pretrained=False, img_size=args.img_size).eval()
    models = variants(dense, args.cost, [float(t) for t in args.tilts.split(",")])
    print(f"{args.model} at {args.img_size} px, cost {args.cost}; {machine()}")
    print("| model | cost | patch tokens after each block | " + " | ".join(
        f"speed-up b{b} (q1-q3)" for b in args.batch_sizes.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(args.batch_sizes.split(",")))
    cells: dict[str, list[str]] = {n: [] for n in models}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        x = torch.randn(batch, 3, args.img_size, args.img_size)
        calls = 1 if batch >= 8 else 8  # one forward at a small batch is too short to time alone

        def run(m: torch.nn.Module):
            def call() -> None:
                with torch.no_grad():
                    for _ in range(calls):
                        m(x)
            return call

        timed = time_callables({n: run(m) for n, m in models.items()}, args.repeats, args.warmup)
        for n in models:
            r = paired_ratios(timed["dense"]["times"], timed[n]["times"])
            cells[n].append(f"{r['median']:.2f}x ({r['q1']:.2f}-{r['q3']:.2f})")
    for n, m in models.items():
        tokens = "–" if n == "dense" else " ".join(str(b.amod_last_tokens - m.num_prefix_tokens)
                                                   for b in m.blocks if hasattr(b, "amod_last_tokens"))
        print(f"| {n} | {amod.flops(m).ratio:.3f} | {tokens} | " + " | ".join(cells[n]) + " |")


if __name__ == "__main__":
    main()
