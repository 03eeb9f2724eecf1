"""`amod compare`: Mixture-of-Depths against token merging (ToMe) at matched cost, on one model.

For each cost point (a share of the dense model's MACs) every method is set to the cost it can match
most closely: MoD methods by their capacity, ToMe by its merge schedule. Each is measured with zero
training (the dense model's own weights and head), finetuned for one short, equal budget, and timed
(images/s, all models interleaved in one process). Every run is a normal run directory, reused when
finished and resumed when killed, so rerunning the command continues where it stopped.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from . import engine, merge
from .bench import time_models
from .checkpoint import check_dense_file, load
from .config import validate_cost
from .convert import convert, set_capacity
from .cost import capacity_for_cost, flops
from .data import build_datasets
from .demo import BASE, QUICK, pretrain_dense, run_once
from .plots import accuracy_vs_cost_panels
from .files import write_json, write_text
from .run import RunConfig, run_dir_name
from .rundir import RunDirectory, check_output_dir

log = logging.getLogger("amod")
COST_TOLERANCE = 0.02  # a method whose closest cost is further off than this is flagged in the report


@dataclass(frozen=True)
class Method:
    name: str
    merge: bool = False  # ToMe instead of MoD
    router: str = "attention"
    layers: Any = "alternate"  # "alternate", or "last-two-thirds": blocks depth // 3 .. depth - 1
    skipped: str = "bypass"


METHODS = (
    Method("ToMe", merge=True),
    Method("A-MoD"),
    Method("standard MoD", router="standard"),
    Method("A-MoD kv", skipped="kv"),
    Method("A-MoD merge", skipped="merge"),
    Method("A-MoD merge, last 2/3", skipped="merge", layers="last-two-thirds"),
)


@dataclass
class CompareConfig:
    out: str = "runs/compare"
    checkpoint: Optional[str] = None  # dense amod .safetensors to compare on; default: the demo's (trained if missing)
    data: str = "fashion-mnist"
    costs: tuple[float, ...] = (0.56, 0.75)
    epochs: int = 1  # the short finetune, equal for every method
    train_limit: Optional[int] = 10000
    val_limit: Optional[int] = None
    lr: float = 5e-4
    batch_size: int = 128
    speed_batch: int = 256
    speed_repeats: int = 10
    methods: tuple[Method, ...] = field(default=METHODS)
    quick: bool = False

    def validate(self) -> "CompareConfig":
        """Check every setting before the first run starts; raises ValueError naming the setting."""
        if not self.costs:
            raise ValueError("give at least one --cost")
        for cost in self.costs:
            validate_cost(cost, "--cost")
        for name in ("epochs", "batch_size", "speed_batch", "speed_repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("train_limit", "val_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.checkpoint is not None:
            check_dense_file(self.checkpoint)
        return self


def resolve_layers(spec: Any, depth: int) -> Any:
    """The compare-only preset ``last-two-thirds`` as block indices; other specs pass through."""
    if spec == "last-two-thirds":
        return list(range(max(1, depth // 3), depth))
    return spec


def matched_model(dense: torch.nn.Module, method: Method, cost: float) -> tuple[torch.nn.Module, dict[str, Any], float]:
    """A copy of ``dense`` set up as ``method`` at the cost closest to ``cost`` x dense.

    Returns the model, the RunConfig fields that rebuild it, and its cost as a share of dense.
    """
    model = copy.deepcopy(dense)
    if method.merge:
        schedule = merge.schedule_for_cost(dense, cost, tolerance=1.0)  # the closest; the report flags a miss
        merge.apply(model, r=schedule)
        setting: dict[str, Any] = {"merge_r": schedule}
    else:
        layers = resolve_layers(method.layers, len(dense.blocks))
        convert(model, router=method.router, layers=layers, skipped=method.skipped)
        set_capacity(model, capacity_for_cost(model, cost))
        setting = {"router": method.router, "capacity": model.amod_config.capacity, "layers": layers,
                   "skipped": method.skipped}
    return model, setting, flops(model).ratio


def run_compare(cfg: CompareConfig) -> Path:
    """Run every (cost, method) pair (reusing finished runs), time them, and write the report."""
    cfg.validate()
    root = check_output_dir(cfg.out)
    build_datasets(cfg.data, None, None, None)  # the data must be there before the first run
    with RunDirectory(root):
        return _run_compare(cfg, root)


def _run_compare(cfg: CompareConfig, root: Path) -> Path:
    if cfg.quick:
        cfg = dataclasses.replace(cfg, train_limit=QUICK["train_limit"], val_limit=QUICK["val_limit"])
    pretrained = Path(cfg.checkpoint) if cfg.checkpoint else None
    if pretrained is None:
        log.info("pretraining the demo's dense model (or reusing it)")
        _, pretrained = pretrain_dense(root / "pretrain", cfg.data, cfg.quick,
                                       cfg.train_limit if cfg.quick else None, cfg.val_limit)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense = load(pretrained, device).eval()
    if getattr(dense, "amod_config", None) is not None or getattr(dense, "amod_merge", None) is not None:
        raise ValueError(f"{pretrained} is an MoD or merging model; amod compare starts from a dense one")

    _, val, info = build_datasets(cfg.data, dense.patch_embed.img_size[0], None, cfg.val_limit)
    loader = engine.make_loader(val, 256, False, 0, 0, engine.Dist())
    dense_acc = engine.evaluate(dense, loader, device, progress=False)["top1"]
    log.info("dense model %s: val top-1 %.4f on %d images", pretrained, dense_acc, len(val))

    rows: list[dict[str, Any]] = []
    total, done = len(cfg.costs) * len(cfg.methods), 0
    for cost in cfg.costs:
        for method in cfg.methods:
            done += 1
            _, setting, ratio = matched_model(dense, method, cost)
            out = root / f"cost{cost:g}" / run_dir_name(method.name)
            log.info("[%d/%d] %s at cost %g (matched: %.3f of dense)", done, total, method.name, cost, ratio)
            run_cfg = RunConfig(model=BASE["model"], checkpoint=str(pretrained), data=cfg.data, **setting,
                                epochs=cfg.epochs, lr=cfg.lr, batch_size=cfg.batch_size, warmup_epochs=0.2,
                                train_limit=cfg.train_limit, val_limit=cfg.val_limit, eval_before_training=True,
                                out=str(out))
            run_once(run_cfg)
            metrics = engine.read_metrics(out / "metrics.jsonl")
            rows.append({"method": method.name, "cost_target": cost, "cost": ratio, "zero_top1": metrics[0]["val_top1"],
                         "top1": metrics[-1]["val_top1"], "setting": setting, "run": str(out)})

    log.info("timing %d models interleaved (batch %d)", len(rows) + 1, cfg.speed_batch)
    models = {"dense": dense, **{f"{r['method']} @ {r['cost_target']:g}": load(Path(r["run"]) / "model.safetensors", device)
                                 for r in rows}}
    x = torch.randn(cfg.speed_batch, dense.patch_embed.proj.in_channels, *dense.patch_embed.img_size,
                    generator=torch.Generator().manual_seed(0)).to(device)
    timed = time_models(models, x, repeats=cfg.speed_repeats, warmup=2)
    dense_ips = timed["dense"]["images_per_s"]
    for r in rows:
        t = timed[f"{r['method']} @ {r['cost_target']:g}"]
        r["images_per_s"] = t["images_per_s"]
        r["speedup"] = t["images_per_s"] / dense_ips
        r["flop_bound_efficiency"] = r["speedup"] * r["cost"]  # measured speed-up / (1 / cost)
    return write_report(root, cfg, pretrained, info.name, len(val), dense_acc, dense_ips, rows)


def write_report(root: Path, cfg: CompareConfig, pretrained: Path, data_name: str, n_val: int, dense_acc: float,
                 dense_ips: float, rows: list[dict[str, Any]]) -> Path:
    lines = [f"# amod compare: MoD vs token merging at matched cost on {data_name}" + (" (quick)" if cfg.quick else ""),
             "",
             f"Dense model `{pretrained}`: val top-1 **{100 * dense_acc:.2f} %** on {n_val} images, "
             f"{dense_ips:.0f} images/s. Finetune: {cfg.epochs} epoch(s) on {cfg.train_limit or 'all'} training images, "
             f"lr {cfg.lr:g}, the same for every method. Speed: batch {cfg.speed_batch}, all models interleaved in one "
             f"process, median of {cfg.speed_repeats}; efficiency = measured speed-up / FLOP-bound speed-up (1 / cost).",
             "",
             "| cost target | method | setting | cost vs dense | zero-training top-1 | finetuned top-1 | images/s | speed-up | efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["setting"]
        setting = (f"r = {s['merge_r']}" if "merge_r" in s else
                   f"C = {s['capacity']:.3f}, layers {s['layers']}" + ("" if s["skipped"] == "bypass" else f", skipped={s['skipped']}"))
        miss = " (!)" if abs(r["cost"] - r["cost_target"]) / r["cost_target"] > COST_TOLERANCE else ""
        lines.append(f"| {r['cost_target']:g} | {r['method']} | {setting} | {r['cost']:.3f}{miss} | "
                     f"{100 * r['zero_top1']:.2f} | {100 * r['top1']:.2f} | {r['images_per_s']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['flop_bound_efficiency']:.2f} |")
    lines += ["", "(!) the method cannot reach the target cost within 2 % on this model; its closest cost is shown.", ""]
    zero: dict[str, list[tuple[float, float]]] = {}
    final: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        zero.setdefault(r["method"], [(1.0, dense_acc)]).append((r["cost"], r["zero_top1"]))
        final.setdefault(r["method"], [(1.0, dense_acc)]).append((r["cost"], r["top1"]))
    png = accuracy_vs_cost_panels({"zero training (the dense model's weights)": zero,
                                   f"after a {cfg.epochs}-epoch finetune": final}, root / "compare.png")
    lines += [f"![accuracy vs cost]({png.name})", ""]
    report = root / "compare.md"
    write_text(report, "\n".join(lines))
    write_json(root / "compare.json",
               {"dense": {"top1": dense_acc, "images_per_s": dense_ips, "checkpoint": str(pretrained)}, "rows": rows})
    print("\n".join(lines[4:4 + 2 + len(rows)]))
    log.info("report written to %s", report)
    return report
