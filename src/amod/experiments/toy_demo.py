"""`amod demo --toy`: the paper's comparison in small, on a ViT pretrained here on Fashion-MNIST.

1. Pretrain a small dense ViT (28x28, patch 4: 49 patches + CLS), or reuse it.
2. Convert it to A-MoD and to standard MoD at 50 % and 12.5 % capacity (alternate blocks) and
   measure zero-training accuracy (paper Table 3).
3. Finetune each, and the isoFLOP dense baseline of each capacity, for the same budget (Table 1, Fig. 9).
4. Measure images/s of every final model in one process, and write report.md with two plots.

Each step is a normal run directory under ``out``; finished runs are reused and killed ones resumed,
so rerunning the demo continues where it stopped.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..cost import flops
from ..files import write_json, write_text
from ..methods import Method
from ..mod.convert import MoD
from ..mod.isoflop import IsoFLOP
from ..train import engine
from ..checkpoint import load
from ..train.config import RunConfig
from ..tools.bench import time_models
from .plots import accuracy_vs_cost, accuracy_vs_epoch
from .presets import BASE, CAPACITIES, FINETUNE, QUICK, pretrain_dense, run_in_directory, run_once

log = logging.getLogger("amod")

def _variants() -> list[tuple[str, Method]]:
    out: list[tuple[str, Method]] = []
    for c in CAPACITIES:
        out.append((f"A-MoD {c:g}", MoD(router="attention", capacity=c)))
        out.append((f"standard MoD {c:g}", MoD(router="standard", capacity=c)))
        out.append((f"isoFLOP dense {c:g}", IsoFLOP(router="attention", capacity=c)))
    return out


def _slug(name: str) -> str:
    # the demo's own naming (not run_dir_name): its run directories predate that helper and are reused
    return name.lower().replace(" ", "_").replace("-", "")


def run_toy_demo(out: str, quick: bool = False) -> Path:
    """Run every step (reusing finished ones) and return the path of report.md."""
    return run_in_directory(out, BASE["data"], lambda root: _run_demo(root, quick))


def _run_demo(root: Path, quick: bool) -> Path:
    base = {**BASE, **({k: v for k, v in QUICK.items() if k in ("depth", "embed_dim")} if quick else {})}
    limits = {k: QUICK[k] for k in ("train_limit", "val_limit")} if quick else {}
    log.info("step 1/4: pretrain the dense ViT")
    pre, pretrained = pretrain_dense(root / "pretrain", BASE["data"], quick, **limits)

    log.info("step 2-3/4: convert and finetune %d variants", len(_variants()))
    runs: dict[str, Path] = {}
    for name, method in _variants():
        ft = {**FINETUNE, **limits, **({"epochs": QUICK["epochs"]} if quick else {})}
        cfg = RunConfig(**{**base, "model": BASE["model"]}, **ft, method_spec=method.spec(), checkpoint=str(pretrained),
                        eval_before_training=True, out=str(root / _slug(name)))
        run_once(cfg)
        runs[name] = Path(cfg.out)

    log.info("step 4/4: measure images/s in one process and write the report")
    speed = measure_speed(pretrained, runs, batch=64 if quick else 256, repeats=3 if quick else 10)
    return write_report(root, pre, runs, speed, quick)


def measure_speed(pretrained: Path, runs: dict[str, Path], batch: int, repeats: int) -> dict[str, float]:
    """images/s of the dense model and each variant, interleaved in one process."""
    models = {"dense": load(pretrained)}
    models.update({name: load(path / "model.safetensors") for name, path in runs.items()})
    size = models["dense"].patch_embed.img_size
    x = torch.randn(batch, models["dense"].patch_embed.proj.in_channels, *size,
                    generator=torch.Generator().manual_seed(0))
    timed = time_models(models, x, repeats=repeats, warmup=2)
    return {name: t["images_per_s"] for name, t in timed.items()}


def write_report(root: Path, pre: dict[str, Any], runs: dict[str, Path], speed: dict[str, float],
                 quick: bool) -> Path:
    dense_macs = pre["macs"]
    rows, curves, points = [], {}, {}
    for name, path in runs.items():
        metrics = engine.read_metrics(path / "metrics.jsonl")
        zero = next((m["val_top1"] for m in metrics if m["epoch"] == 0), None)
        final = metrics[-1]["val_top1"]
        macs = flops(load(path / "model.safetensors")).macs
        rows.append((name, zero, final, macs, speed[name]))
        curves[name] = ([m["epoch"] for m in metrics], [m["val_top1"] for m in metrics])
        method = name.rsplit(" ", 1)[0]
        points.setdefault(method, []).append((macs / 1e6, final))
    for method in points:
        points[method].append((dense_macs / 1e6, pre["val_top1"]))
    accuracy_vs_epoch(curves, root / "accuracy_vs_epoch.png", "Finetuning from the dense ViT (Fashion-MNIST)")
    accuracy_vs_cost(points, root / "accuracy_vs_cost.png", "Accuracy vs cost after finetuning")

    lines = [
        "# amod demo: A-MoD vs standard MoD vs isoFLOP on Fashion-MNIST" + (" (quick mode)" if quick else ""),
        "",
        f"Dense ViT ({BASE['depth'] if not quick else QUICK['depth']} blocks, patch 4 on 28x28: 49 patches + CLS), "
        f"pretrained {pre['epochs']} epochs: val top-1 **{100 * pre['val_top1']:.2f} %**, "
        f"{dense_macs / 1e6:.2f} MMACs/image, {speed['dense']:.0f} images/s.",
        "MoD on alternate blocks; every variant finetuned from the same dense checkpoint with the same budget.",
        "",
        "| variant | zero-training top-1 | finetuned top-1 | MMACs/image | cost vs dense | images/s | speed-up |",
        "|---|---|---|---|---|---|---|",
        f"| dense | – | {100 * pre['val_top1']:.2f} | {dense_macs / 1e6:.2f} | 1.000 | {speed['dense']:.0f} | 1.00x |",
    ]
    for name, zero, final, macs, ips in rows:
        lines.append(f"| {name} | {100 * zero:.2f} | {100 * final:.2f} | {macs / 1e6:.2f} | {macs / dense_macs:.3f} | "
                     f"{ips:.0f} | {ips / speed['dense']:.2f}x |")
    lines += ["", "![accuracy vs epoch](accuracy_vs_epoch.png)", "", "![accuracy vs cost](accuracy_vs_cost.png)", "",
              "Zero-training = the converted model evaluated before any finetuning (epoch 0). "
              "Speed: batch of random images, models interleaved in one process, median of repeats.", ""]
    report = root / "report.md"
    write_text(report, "\n".join(lines))
    write_json(root / "report.json",
               {"dense": {"top1": pre["val_top1"], "macs": dense_macs, "images_per_s": speed["dense"]},
                "variants": [dict(zip(("name", "zero_top1", "top1", "macs", "images_per_s"), r)) for r in rows]})
    print("\n".join(lines[6:6 + 2 + len(rows) + 1]))
    log.info("report written to %s", report)
    return report
