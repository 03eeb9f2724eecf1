"""Cost of A-MoD's scores: time at N = 197 against the attention they accompany, and peak memory
at N = 4097 against scaled_dot_product_attention alone and the naive N x N matrix.

Usage: python benchmarks/bench_scores.py [--repeats 30] [--device cuda --dtype bfloat16] [--out FILE.json]
(on CUDA the time only; its memory is tests/test_ops.py's `cuda` test.)
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import ensure_tunables, machine
from timm.layers import Attention

from amod.tools.bench import DEVICES, peak_memory_mb, resolve_device, time_callables
from amod.mod.block import ScoreHandoff, ScoringAttention
from amod.ops import attention_with_scores


def main() -> None:
    ensure_tunables()
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=32, help="images at N = 197 (a GPU needs more to be busy: 256)")
    args = p.parse_args()
    dev, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    print(machine())
    report = {"machine": machine(), "device": str(dev), "dtype": args.dtype, "batch": args.batch}
    if dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)

    # 1. time at N = 197 (DeiT-S: 6 heads of 64, batch 32)
    B, H, N, D = args.batch, 6, 197, 64
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
           "sdpa+scores": lambda: attention_with_scores(q, k, v)}
    dense_attn = Attention(H * D, num_heads=H, qkv_bias=True).to(dev, dtype).eval()
    scoring = copy.deepcopy(dense_attn)
    scoring.__class__ = ScoringAttention
    scoring.amod_handoff, scoring.amod_scores_need_grad = ScoreHandoff(), False
    x = torch.randn(B, N, H * D, device=dev, dtype=dtype)
    fns.update({"attention module": lambda: dense_attn(x), "scoring attention module": lambda: scoring(x)})
    with torch.no_grad():
        timed = {n: t["seconds"] for n, t in time_callables(fns, args.repeats, warmup=5, device=dev).items()}
    kernel_overhead = timed["sdpa+scores"] / timed["sdpa"] - 1
    module_overhead = timed["scoring attention module"] / timed["attention module"] - 1
    print(f"\nN = {N} (B {B}, {H} heads of {D}, {args.dtype} on {dev}), median of {args.repeats} interleaved runs:")
    for name, sec in timed.items():
        print(f"  {name:26s} {1e3 * sec:8.3f} ms")
    print(f"  scores add {kernel_overhead:+.1%} to scaled_dot_product_attention, "
          f"{module_overhead:+.1%} to timm's whole attention module (qkv, attention, proj)")
    report["n197"] = {"ms": {k: 1e3 * v for k, v in timed.items()}, "kernel_overhead": kernel_overhead,
                      "module_overhead": module_overhead}
    if dev.type == "cuda":
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
        return

    # 2. peak memory at N = 4097 (1024x1024 images, patch 16; ViT-B: 12 heads of 64, batch 2)
    shape = [2, 12, 4097, 64]
    naive_gb = shape[0] * shape[1] * shape[2] ** 2 * 4 / 2**30
    mem = {op: peak_memory_mb({"kind": "op", "op": op, "shape": shape}) for op in ("sdpa", "scores", "explicit")}
    print(f"\nN = 4097 (B 2, 12 heads of 64): the attention matrix alone is {naive_gb:.2f} GiB in fp32")
    for op, mb in mem.items():
        print(f"  peak extra memory {op:9s} {mb:9.1f} MiB")
    print(f"  scores / sdpa alone: {mem['scores'] / mem['sdpa']:.3f}x")
    report["n4097"] = {"peak_mb": mem, "ratio": mem["scores"] / mem["sdpa"], "naive_matrix_gib": naive_gb}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
