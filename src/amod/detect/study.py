"""The detection study: a trained dense DETR converted at matched encoder cost, zero-training and finetuned.

For each encoder cost (a share of the dense encoder's MACs) and router (A-MoD ``attention``, ``standard``,
``random``, ``feature-norm``), every seed is one ``amod detect train`` run from the dense detector
(``train_detector`` with ``init``), so each run resumes on its own after a kill; its step-0 evaluation is the
zero-training AP. The dense detector is finetuned the same way as the reference. MoD sits on the same encoder
layers for every router (the study's ``method``, default ``mod:layers=[1,2,3,4,5]``: alternate layers cannot bring the
encoder below about half its cost).

The report gives per (cost, router): capacity, encoder and whole-model cost, zero-training AP/AP50, finetuned
AP/AP50 mean ± std over seeds, the paired difference to A-MoD with a 95 % bootstrap CI over seeds, and encoder
and whole-model speed-ups measured interleaved; plus a picture of the positions the encoder keeps.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from .. import files
from ..tools.bench import time_callables
from ..stats import mean_std, paired_bootstrap_ci
from ..train.engine import read_metrics
from ..train.rundir import RunDirectory
from .canvases import collate
from .config import DetectConfig, DetectStudyConfig
from ..families.detr import detr_flops, mod_layers
from ..methods import parse_method
from ..mod.convert import set_recording
from .train import datasets, load_detector, normalise, train_detector
from ..errors import UserError

log = logging.getLogger("amod")
REFERENCE = "attention"


def arms(cfg: DetectStudyConfig) -> list[tuple[Optional[float], Optional[str]]]:
    return [(None, None)] + [(c, r) for c in cfg.costs for r in cfg.routers]


def run_detect_study(cfg: DetectStudyConfig) -> Path:
    """Run (or resume) every run of the study, then write ``OUT/detr.md``, ``detr.json`` and the picture."""
    if Path(cfg.dense).expanduser().is_dir():
        raise UserError(f"--dense {cfg.dense} is a directory; give the dense detector's file (a train run's "
                        "model.safetensors)")
    if not Path(cfg.dense).expanduser().is_file():
        raise FileNotFoundError(f"no dense detector at {cfg.dense}; train one with `amod detect train`")
    cfg.validate()
    out = Path(cfg.out)
    if cfg.report_only and not any(_rows(cfg.run_config(c, r, s)) for s in range(cfg.seeds) for c, r in arms(cfg)):
        raise UserError(f"{out} holds no evaluated run of this study (no metrics.jsonl with these settings); run "
                        "the study without --report-only first")
    with RunDirectory(out, log_name="study.log"):
        # Seed-major: one pass gives every arm's zero-training AP and a first finetune, so a study stopped
        # early still fills every row of the report.
        for seed in range(cfg.seeds):
            for cost, router in arms(cfg):
                run = cfg.run_config(cost, router, seed)
                if not cfg.report_only and not _finished(run):
                    log.info("%s", run.out)
                    train_detector(run)
        return write_report(cfg)


def _finished(run: DetectConfig) -> bool:
    path = Path(run.out) / "metrics.jsonl"
    return path.exists() and any(r["step"] == run.steps for r in read_metrics(path))


def _rows(run: DetectConfig) -> dict[int, dict[str, Any]]:
    path = Path(run.out) / "metrics.jsonl"
    return {r["step"]: r for r in read_metrics(path)} if path.exists() else {}


def summarise(cfg: DetectStudyConfig) -> list[dict[str, Any]]:
    """Per arm: zero-training and final AP/AP50 over the finished seeds, and the paired difference to A-MoD at the
    same cost (over the seeds both finished)."""
    finals: dict[tuple, dict[int, dict[str, Any]]] = {}
    table = []
    for cost, router in arms(cfg):
        runs = {s: _rows(cfg.run_config(cost, router, s)) for s in range(cfg.seeds)}
        finals[(cost, router)] = {s: r[cfg.steps] for s, r in runs.items() if cfg.steps in r}
        zero = [r[0] for r in runs.values() if 0 in r]
        entry: dict[str, Any] = {"cost": cost, "router": router or "dense", "seeds": sorted(finals[(cost, router)])}
        for key in ("AP", "AP50"):
            entry[f"zero_{key}"] = mean_std([z[key] for z in zero]) if zero else None
            done = [f[key] for f in finals[(cost, router)].values()]
            entry[f"final_{key}"] = mean_std(done) if done else None
        table.append(entry)
    for entry in table:
        ref = finals.get((entry["cost"], REFERENCE), {}) if entry["router"] != "dense" else {}
        own = finals[(entry["cost"], None if entry["router"] == "dense" else entry["router"])]
        both = sorted(set(ref) & set(own))
        entry["vs_a_mod_AP50"] = None
        if entry["router"] not in ("dense", REFERENCE) and both:
            ci = paired_bootstrap_ci(np.array([own[s]["AP50"] for s in both]), np.array([ref[s]["AP50"] for s in both]))
            entry["vs_a_mod_AP50"] = dataclasses.asdict(ci)
    return table


Arm = tuple[Optional[float], Optional[str]]


def seed0_models(cfg: DetectStudyConfig) -> dict[Arm, nn.Module]:
    """Seed 0's finished model of every arm that has one, loaded once for the report's speeds, costs and picture."""
    models = {}
    for cost, router in arms(cfg):
        path = Path(cfg.run_config(cost, router, 0).out) / "model.safetensors"
        if path.exists():
            models[(cost, router)] = load_detector(path).eval()
    return models


def speeds(cfg: DetectStudyConfig, arm_models: dict[Arm, nn.Module]) -> dict[str, dict[str, float]]:
    """Images/s of the whole model and of the encoder alone, every arm (seed 0's model) interleaved with dense."""
    _, val = datasets(cfg.run_config(None, None, 0))
    images, _ = collate([val[i] for i in range(min(cfg.speed_batch, len(val)))])
    x = normalise(images)
    models = {"dense" if router is None else f"{router} @ {cost:g}": m for (cost, router), m in arm_models.items()}
    encoder_inputs = {}
    for name, model in models.items():
        captured = {}
        hook = model.model.encoder.register_forward_pre_hook(lambda m, a, kw: captured.update(kw), with_kwargs=True)
        with torch.no_grad():
            model(pixel_values=x)
        hook.remove()
        encoder_inputs[name] = {k: captured[k] for k in ("inputs_embeds", "spatial_position_embeddings")}
    calls = {}
    for name, model in models.items():
        calls[f"{name}|model"] = lambda m=model: m(pixel_values=x)
        calls[f"{name}|encoder"] = lambda m=model, kw=encoder_inputs[name]: m.model.encoder(**kw)
    timed = time_callables(calls, repeats=cfg.speed_repeats, warmup=2)
    return {name: {part: x.shape[0] / timed[f"{name}|{part}"]["seconds"] for part in ("model", "encoder")}
            for name in models}


def kept_positions_figure(cfg: DetectStudyConfig, arm_models: dict[Arm, nn.Module], path: Path, cost: float,
                          canvases: int = 4) -> Optional[Path]:
    """For each router at ``cost`` (seed 0's finetuned model): a few validation canvases with, per feature-map
    position, how many of the MoD layers processed it."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    _, val = datasets(cfg.run_config(None, None, 0))
    images, targets = collate([val[i] for i in range(canvases)])
    rows = []
    for router in cfg.routers:
        model = arm_models.get((cost, router))
        if model is None:
            continue
        set_recording(model)
        seen = {}
        hook = model.model.encoder.register_forward_pre_hook(
            lambda m, a, kw: seen.update(n=kw["inputs_embeds"].shape[1]), with_kwargs=True)
        with torch.no_grad():
            model(pixel_values=normalise(images))
        hook.remove()
        n = int(round(seen["n"] ** 0.5))  # a square canvas: a square feature map
        count = torch.zeros(canvases, n * n)
        for _, layer in mod_layers(model):
            count.scatter_add_(1, layer.amod_last_index, torch.ones_like(layer.amod_last_index, dtype=torch.float))
        rows.append((router, count.view(canvases, n, n), len(mod_layers(model))))
    if not rows:
        return None
    fig = Figure(figsize=(2.2 * canvases, 2.3 * len(rows)))
    FigureCanvasAgg(fig)
    for r, (router, count, layers) in enumerate(rows):
        for c in range(canvases):
            ax = fig.add_subplot(len(rows), canvases, r * canvases + c + 1)
            ax.imshow(images[c, 0].numpy(), cmap="gray", extent=(0, 1, 1, 0))
            ax.imshow(count[c].numpy(), cmap="magma", alpha=0.55, vmin=0, vmax=layers, extent=(0, 1, 1, 0))
            for box in targets[c]["boxes"]:
                cx, cy, w, h = box.tolist()
                ax.add_patch(matplotlib.patches.Rectangle((cx - w / 2, cy - h / 2), w, h, fill=False, color="cyan", lw=1))
            ax.set_xticks([]), ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(router)
    fig.suptitle(f"positions processed, of {rows[0][2]} MoD encoder layers, at encoder cost {cost:g} "
                 "(bright: processed by every one)", fontsize=9)
    fig.tight_layout()
    files.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    return path


def write_report(cfg: DetectStudyConfig) -> Path:
    out = Path(cfg.out)
    table = summarise(cfg)
    models = seed0_models(cfg)
    speed = speeds(cfg, models) if models else {}
    costs = {}
    if (None, None) in models:  # ratios need the dense model
        for (cost, router), model in models.items():
            report = detr_flops(model, cfg.run_config(cost, router, 0).canvas_size)
            costs[(cost, router)] = {"capacity": getattr(getattr(model, "amod_config", None), "capacity", 1.0),
                                     "encoder": report.encoder_ratio, "model": report.ratio}
    picture = kept_positions_figure(cfg, models, out / "detr_kept_positions.png", min(cfg.costs))

    def fmt(ms: Optional[tuple[float, float]]) -> str:
        return "–" if ms is None else f"{100 * ms[0]:.1f} ± {100 * ms[1]:.1f}"

    lines = [f"Finetune: {cfg.steps} steps x {cfg.batch_size} canvases, lr {cfg.lr:g}, {cfg.seeds} seeds planned "
             "(finetuned seeds: how many have finished); "
             f"MoD on encoder layers {', '.join(map(str, parse_method(cfg.method).layers))}. AP and AP50 in % (COCO, pycocotools), "
             "mean ± std over seeds; the difference to A-MoD is in AP50 points with a 95 % paired bootstrap CI "
             "over seeds.", "",
             "| encoder cost | router | capacity | encoder MACs | model MACs | zero-training AP / AP50 | "
             "finetuned seeds | finetuned AP | finetuned AP50 | AP50 − A-MoD | encoder speed-up | model speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        key = (e["cost"], None if e["router"] == "dense" else e["router"])
        c = costs.get(key, {})
        name = "dense" if e["router"] == "dense" else f"{e['router']} @ {e['cost']:g}"
        s, d = speed.get(name), speed.get("dense")
        ci = e["vs_a_mod_AP50"]
        cost = "1" if e["cost"] is None else f"{e['cost']:g}"
        if ci is None:
            diff = "–"
        elif ci["n_seeds"] < 2:  # one paired seed: a difference, no interval
            diff = f"{100 * ci['mean']:+.1f} (1 seed)"
        else:
            diff = f"{100 * ci['mean']:+.1f} [{100 * ci['low']:+.1f}, {100 * ci['high']:+.1f}]"
        up_encoder = "–" if not (s and d) else f"{s['encoder'] / d['encoder']:.2f}x"
        up_model = "–" if not (s and d) else f"{s['model'] / d['model']:.2f}x"
        lines.append(f"| {cost} | {e['router']} | {c.get('capacity', float('nan')):.3f} | "
                     f"{c.get('encoder', float('nan')):.3f} | {c.get('model', float('nan')):.3f} | "
                     f"{fmt(e['zero_AP'])} / {fmt(e['zero_AP50'])} | {len(e['seeds'])} | {fmt(e['final_AP'])} | "
                     f"{fmt(e['final_AP50'])} | "
                     f"{diff} | {up_encoder} | {up_model} |")
    if picture is not None:
        lines += ["", f"![kept positions]({picture.name})"]
    report = out / "detr.md"
    files.write_text(report, "\n".join(lines) + "\n")
    files.write_json(out / "detr.json", {"config": dataclasses.asdict(cfg), "table": table, "speeds": speed,
                                          "costs": {f"{k[0]}|{k[1]}": v for k, v in costs.items()}})
    return report
