"""What distillation costs in training time: one training step (forward, backward, AdamW) of each method without
distillation, distilled from a dense teacher run live, and distilled from kept teacher outputs (``TeacherOutputs``:
what the finetune study does on data without random augmentation), at the finetune study's setting (DINOv2
ViT-S/14 at 112 px, batch 32, 10 classes, fp32).

Every (method, mode) takes one step in turn, round after round, in one process (warm-up rounds discarded); the
report gives the median images/s of each and the median of per-round ratios of a distilled step's time to the same
method's step without distillation (the issue's budget: at most 1.35x). The weights are random unless
--checkpoint names a backbone (speed does not depend on them).
Usage:
    python benchmarks/bench_distill_speed.py [--checkpoint PATH] [--img-size 112] [--batch-size 32]
        [--rounds 10] [--warmup 2] [--cost 0.56 0.40] [--out docs/results/distill_speed.json]
"""
from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import ensure_tunables, machine
from bench_train_speed import build, training_speed_args

import amod
from amod.methods import Dense
from amod.mod.convert import MoD
from amod.tome.merging import TokenMerging
from amod.train.distill import Distillation, Teacher, TeacherOutputs, forward_with_features

MODES = ("plain", "live teacher", "kept outputs")


def main() -> None:
    ensure_tunables()
    args = training_speed_args(__doc__, rounds=10, warmup=2, out="docs/results/distill_speed.json",
                               several_costs=True).parse_args()

    dense = build(args.checkpoint, args.img_size)
    methods = {"dense": Dense()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cost in args.cost:
            for name, method in (("A-MoD (paper)", MoD(router="attention", scale_output=False, layers=tuple(range(1, 12)))
                                  if cost < 0.5 else MoD(router="attention", scale_output=False)),
                                 ("ToMe", TokenMerging()), ("A-MoD fold", MoD(skipped="fold"))):
                methods[f"{name} @ {cost:g}"] = method.at_cost(dense, cost)
    models = {name: m.apply(copy.deepcopy(dense)) for name, m in methods.items()}
    costs = {name: amod.flops(m).macs / amod.flops(dense).macs for name, m in models.items()}
    teacher = Teacher(dense)
    distillation = Distillation()  # the defaults amod finetune and the study use
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    indices = torch.arange(args.batch_size)
    kept = TeacherOutputs(Path(tempfile.mkdtemp()) / "outputs", args.batch_size, 10, dense.num_features)
    kept(teacher, x, indices)  # computed once, then read back every step

    runs = {}
    for name, model in models.items():
        for mode in MODES:
            m = copy.deepcopy(model).train()
            runs[(name, mode)] = (m, torch.optim.AdamW(m.parameters(), lr=1e-5))

    def step(model, opt, mode: str) -> float:
        start = time.perf_counter()
        if mode == "plain":
            loss = F.cross_entropy(model(x), y)
        else:
            logits, features = forward_with_features(model, x, distillation.features > 0)
            targets = teacher(x) if mode == "live teacher" else kept(teacher, x, indices)
            loss = distillation.loss(logits, features, *targets, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    times: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    for r in range(args.warmup + args.rounds):
        for key, (model, opt) in runs.items():
            t = step(model, opt, key[1])
            if r >= args.warmup:
                times[key].append(t)
        print(f"round {r + 1}/{args.warmup + args.rounds}" + (" (warm-up)" if r < args.warmup else ""), flush=True)
    result = {"machine": machine(), "img_size": args.img_size, "batch_size": args.batch_size, "rounds": args.rounds,
              "warmup_rounds": args.warmup, "distillation": distillation.text(), "runs": {}}
    print(f"\n{machine()}\nDINOv2 ViT-S/14 at {args.img_size} px, batch {args.batch_size}, fp32, {args.rounds} rounds "
          f"(+{args.warmup} warm-up), one training step of each per round; distillation: {distillation.text()}\n")
    print(f"{'method':24s} {'cost':>6s} {'plain img/s':>12s} {'live teacher':>13s} {'kept outputs':>13s}")
    for name in models:
        plain = times[(name, "plain")]
        row = {"cost": costs[name], "plain_images_per_s": args.batch_size / statistics.median(plain)}
        cells = []
        for mode in MODES[1:]:
            ratio = statistics.median(t / b for t, b in zip(times[(name, mode)], plain))
            row[f"{mode.replace(' ', '_')}_time_ratio"] = ratio
            row[f"{mode.replace(' ', '_')}_images_per_s"] = args.batch_size / statistics.median(times[(name, mode)])
            cells.append(f"{ratio:12.2f}x")
        result["runs"][name] = row
        print(f"{name:24s} {costs[name]:6.3f} {row['plain_images_per_s']:12.1f} {cells[0]:>13s} {cells[1]:>13s}")
    print("\n(live teacher, kept outputs: a step's time over the same method's step without distillation, median of "
          "per-round ratios)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
