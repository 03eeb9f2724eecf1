"""Training images/s (forward + backward + AdamW step) of the dense model, A-MoD and A-MoD fold, in fp32 and
under bf16 autocast, at the finetune study's setting: DINOv2 ViT-S/14 at 112 px, batch 32, 10 classes.

Every (method, precision) takes one training step in turn, round after round, in one process (warm-up
rounds discarded); the report gives the median images/s of each and the median of per-round ratios to
dense fp32. The weights are random unless --checkpoint names a backbone (speed does not depend on them).
Usage:
    python benchmarks/bench_train_speed.py [--checkpoint PATH] [--img-size 112] [--batch-size 32]
        [--rounds 12] [--warmup 3] [--cost 0.56] [--out docs/results/train_speed.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from _common import ensure_tunables, machine

import amod
from amod.mod.convert import MoD


def build(checkpoint: str | None, img_size: int) -> torch.nn.Module:
    if checkpoint:
        model = amod.load(Path(checkpoint).expanduser())
        amod.arch.set_input_size(model, img_size)
    else:
        model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=img_size)
    model.reset_classifier(10)
    return model


def training_speed_args(doc: str, rounds: int, warmup: int, out: str,
                        several_costs: bool = False) -> argparse.ArgumentParser:
    """The options of the training-speed benchmarks (this one and bench_distill_speed.py); ``several_costs``:
    --cost takes a list (default 0.56 0.40) instead of one value (default 0.56)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="timm/amod weights file (default: random weights)")
    p.add_argument("--img-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    p.add_argument("--warmup", type=int, default=warmup, help="rounds discarded first")
    if several_costs:
        p.add_argument("--cost", type=float, nargs="+", default=[0.56, 0.40])
    else:
        p.add_argument("--cost", type=float, default=0.56)
    p.add_argument("--out", default=out)
    return p


def main() -> None:
    ensure_tunables()
    args = training_speed_args(__doc__, rounds=12, warmup=3, out="docs/results/train_speed.json").parse_args()

    dense = build(args.checkpoint, args.img_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        methods = {"dense": dense,
                   "A-MoD": MoD(router="attention", scale_output=False).at_cost(dense, args.cost).apply(copy.deepcopy(dense)),
                   "A-MoD fold": MoD(skipped="fold").at_cost(dense, args.cost).apply(copy.deepcopy(dense))}
    costs = {name: amod.flops(m).macs / amod.flops(dense).macs for name, m in methods.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    runs = {}
    for name, model in methods.items():
        for amp in ("fp32", "bf16"):
            m = copy.deepcopy(model).train()
            runs[f"{name} {amp}"] = (m, torch.optim.AdamW(m.parameters(), lr=1e-5), amp == "bf16")

    def step(model, opt, bf16) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.warmup + args.rounds):
        for name, (model, opt, bf16) in runs.items():
            t = step(model, opt, bf16)
            if r >= args.warmup:
                times[name].append(t)
        print(f"round {r + 1}/{args.warmup + args.rounds}" + (" (warm-up)" if r < args.warmup else ""), flush=True)
    base = times["dense fp32"]
    result = {"machine": machine(), "img_size": args.img_size, "batch_size": args.batch_size, "rounds": args.rounds,
              "warmup_rounds": args.warmup, "cost_target": args.cost, "runs": {}}
    print(f"\n{machine()}\nDINOv2 ViT-S/14 at {args.img_size} px, batch {args.batch_size}, {args.rounds} rounds "
          f"(+{args.warmup} warm-up), one training step of each per round\n")
    print(f"{'method':22s} {'cost':>6s} {'images/s':>9s} {'vs dense fp32':>14s}")
    for name, ts in times.items():
        ips = args.batch_size / statistics.median(ts)
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        method = name.rsplit(" ", 1)[0]
        result["runs"][name] = {"images_per_s": ips, "ratio_to_dense_fp32": ratio, "cost": costs[method]}
        print(f"{name:22s} {costs[method]:6.3f} {ips:9.1f} {ratio:13.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
