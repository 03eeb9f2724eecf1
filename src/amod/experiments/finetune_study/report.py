"""The finetune study's report: per (cost, arm) the seed-mean curve, final mean ± std, paired bootstrap CIs against
the reference, finetuned dense and the arm's counterpart, steps to dense − 1 point; ``finetune.md``,
``finetune.json`` and the curves."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ...files import write_json, write_text
from ...stats import mean_std, paired_bootstrap_ci
from ...train.distill import Distillation
from .plan import ARMS, DENSE, LONG_STEPS, REFERENCE, Arm, FinetuneConfig, Planned, label
from .rows import EvalRows, unpack
from ..plots import Figure, save_figure, steps_figure
from ..probe import LinearProbe


def summarise(cfg: FinetuneConfig, planned: list[Planned], rows: EvalRows, n_test: int) -> list[dict[str, Any]]:
    """Per (cost, arm): zero-training accuracy, the seed-mean curve, final mean ± std, paired differences with
    95 % bootstrap CIs (to the reference, to finetuned dense, to the arm's counterpart), and steps to reach
    finetuned dense − 1 point. Each uses the seeds whose run finished (a CI: the seeds both finished); None where
    there are none. A long run is compared with the long dense run, a short one with dense."""
    by_name = {(p.arm.name, p.cost_target): p for p in planned}

    def steps_of(name: str, cost: float) -> int:
        p = by_name.get((name, cost)) or by_name.get((name, 1.0))
        return (p.arm.steps if p else None) or cfg.steps

    def finished(name: str, cost: float) -> list[int]:
        return [s for s in range(cfg.seeds) if rows.get(s, cost, name, cfg.amp, steps_of(name, cost)) is not None]

    def finals(name: str, cost: float, seeds: list[int]) -> np.ndarray:
        return np.stack([unpack(rows.get(s, cost, name, cfg.amp, steps_of(name, cost))["correct"], n_test)
                         for s in seeds])

    def against(name: str, cost: float, other: Optional[str], other_cost: float) -> Optional[dict[str, float]]:
        if other is None or other == name:
            return None
        both = [s for s in finished(name, cost) if s in finished(other, other_cost)]
        if not both:
            return None
        return dataclasses.asdict(paired_bootstrap_ci(finals(name, cost, both), finals(other, other_cost, both),
                                                      n_boot=2000))

    def zero_row(p: Planned) -> Optional[dict[str, Any]]:
        name = p.arm.name
        while name is not None:  # a long, distilled or any-cost arm starts where its counterpart does
            row = rows.get(None, p.cost_target, name, cfg.amp, 0)
            if row is not None:
                return row
            q = by_name.get((name, p.cost_target))
            name = q.arm.counterpart if q is not None and q.arm.counterpart != name else None
        return None

    long_dense = f"{DENSE}, {LONG_STEPS} steps"
    out = []
    for p in planned:
        cost, name = p.cost_target, p.arm.name
        steps = [0] + cfg.eval_steps(p.arm.steps)
        zero = zero_row(p)
        seeds = finished(name, cost)
        curve: list[Optional[float]] = [zero["top1"] if zero else None]
        for step in steps[1:]:
            got = [rows.get(s, cost, name, cfg.amp, step) for s in seeds]
            curve.append(float(np.mean([g["top1"] for g in got])) if seeds and all(got) else None)
        accs = finals(name, cost, seeds).mean(axis=1) if seeds else None
        is_dense = cost == 1.0
        vs_ref = None if is_dense or name == REFERENCE or p.arm.steps else against(name, cost, REFERENCE, cost)
        dense_name = long_dense if p.arm.steps and (long_dense, 1.0) in by_name else DENSE
        vs_dense = None if is_dense and not p.arm.steps else against(name, cost, dense_name, 1.0)
        counterpart = p.arm.counterpart
        vs_counterpart = against(name, cost, counterpart, 1.0 if is_dense else cost) if counterpart else None
        out.append({"method": name, "cost_target": cost, "cost": p.cost, "setting": p.setting,
                    "note": p.note, "zero_top1": zero["top1"] if zero else None, "steps": steps, "curve": curve,
                    "finals": None if accs is None else accs.tolist(),
                    "final_mean_std": None if accs is None else mean_std(accs), "seeds_done": len(seeds),
                    "seeds_planned": p.arm.only_seeds or cfg.seeds, "vs_reference": vs_ref, "vs_dense": vs_dense,
                    "counterpart": counterpart, "vs_counterpart": vs_counterpart, "steps_to_target": None,
                    "distilled": p.arm.distill, "train_steps": p.arm.steps or cfg.steps})
    target = steps_target(out)
    for r in out:
        if target is not None and None not in r["curve"][1:] and r["seeds_done"]:
            r["steps_to_target"] = next((s for s, a in zip(r["steps"], r["curve"]) if a is not None and a >= target),
                                       "not reached")
    return out


def router_lr_text(arms: tuple[Arm, ...]) -> str:
    """The clause naming the arms whose learned router has its own learning rate (``Arm.router_lr``), or ''."""
    rates = sorted({a.router_lr for a in arms if a.router_lr is not None})
    return "".join(f"; {' and '.join(repr(a.name) for a in arms if a.router_lr == lr)}: the router's parameters at lr "
                   f"{lr:g} on the same schedule" for lr in rates)


def steps_target(table: list[dict[str, Any]]) -> Optional[float]:
    """The accuracy every row's "steps to dense − 1 point" counts to: the short finetuned dense mean − 1 point (one
    target for every row, long runs included); None until a dense run has finished."""
    dense = next((r for r in table if r["method"] == DENSE and r["cost_target"] == 1.0 and r["final_mean_std"]), None)
    return None if dense is None else dense["final_mean_std"][0] - 0.01


def _pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{100 * v:.2f}"


def write_report(root: Path, cfg: FinetuneConfig, checkpoint: Path, planned: list[Planned], rows: EvalRows,
                 speeds: dict[str, float], n_test: int, probe: LinearProbe) -> Path:
    table = summarise(cfg, planned, rows, n_test)
    target = steps_target(table)
    precision = [(p, rows.get(0, p.cost_target, p.arm.name, "off", cfg.steps),
                  rows.get(0, p.cost_target, p.arm.name, "bf16", cfg.steps)) for p in planned]
    precision = [(p, fp32, bf16) for p, fp32, bf16 in precision if fp32 and bf16]  # seed 0 finished in both
    fp32, bf16 = next(((a, b) for p, a, b in precision if p.arm.name == DENSE), (None, None))
    lines = [f"# Finetuning a real backbone into every method at matched cost ({info_line(cfg)})", "",
             f"Backbone `{checkpoint.name}` at {cfg.img_size} px with a linear head initialised from the dense linear "
             f"probe (fitted on {cfg.probe_train} training images, L2 {probe.l2:g}). Every run: {cfg.steps} steps of "
             f"{cfg.batch_size} images ({cfg.steps * cfg.batch_size} images, the same ones in the same order for "
             f"every method of a seed), AdamW lr {cfg.lr:g}, weight decay {cfg.weight_decay:g}, {cfg.warmup:.0%} "
             f"warm-up then cosine, gradient clipping 1.0, {'bf16 autocast' if cfg.amp == 'bf16' else 'fp32'}"
             f"{router_lr_text(cfg.arms)}. "
             f"Accuracy on a fixed subset of {n_test} test images at steps {', '.join(map(str, [0] + cfg.eval_steps()))}; "
             f"{cfg.seeds} seeds (the seed sets the image order).", "",
             f"Command: `{command_line(cfg)}`", ""]
    if fp32 and bf16 and len(precision) == 1:  # only dense so far; the table below includes this row otherwise
        gap = 100 * (bf16["top1"] - fp32["top1"])
        lines += [f"bf16 check (dense, seed 0, {cfg.steps} steps): fp32 {_pct(fp32['top1'])} %, bf16 "
                  f"{_pct(bf16['top1'])} % ({gap:+.2f} points).", ""]
    if len(precision) > 1:  # more than dense: every method finished in both precisions on seed 0
        lines += [f"fp32 against bf16 autocast, seed 0, after {cfg.steps} steps (top-1 %; the dense row is the bf16 "
                  "check):", "",
                  "| cost target | method | fp32 | bf16 | bf16 − fp32 |", "|---|---|---|---|---|"]
        lines += [f"| {p.cost_target:g} | {p.arm.name} | {_pct(a['top1'])} | {_pct(b['top1'])} | "
                  f"{100 * (b['top1'] - a['top1']):+.2f} |" for p, a, b in precision]
        lines += [""]
    head = ("| cost target | method | setting | cost vs dense | steps | zero-training top-1 | finetuned top-1 (mean ± std) "
            "| vs A-MoD (paper), 95 % CI | vs finetuned dense, 95 % CI | vs counterpart, 95 % CI | steps to dense − 1 pt "
            "| images/s | seeds |")
    lines += [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ci_text(ci: Optional[dict[str, float]]) -> str:
        return "–" if ci is None else f"{100 * ci['mean']:+.2f} [{100 * ci['low']:+.2f}, {100 * ci['high']:+.2f}]"

    for r in table:
        ms = r["final_mean_std"]
        final = "–" if ms is None else f"{100 * ms[0]:.2f} ± {100 * ms[1]:.2f}"
        p = next(p for p in planned if p.arm.name == r["method"] and p.cost_target == r["cost_target"])
        cost = f"{r['cost']:.3f}" + (" (!)" if r["note"] else "")
        counterpart = "–" if r["vs_counterpart"] is None else f"{ci_text(r['vs_counterpart'])} vs {r['counterpart']}"
        speed = speeds.get(label(p))
        lines.append(f"| {r['cost_target']:g} | {r['method']} | {r['setting']} | {cost} | {r['train_steps']} | "
                     f"{_pct(r['zero_top1'])} | {final} | {ci_text(r['vs_reference'])} | {ci_text(r['vs_dense'])} | "
                     f"{counterpart} | {r['steps_to_target'] if r['steps_to_target'] is not None else '–'} | "
                     f"{'–' if speed is None else f'{speed:.1f}'} | {r['seeds_done']}/{r['seeds_planned']} |")
    notes = [f"- {r['method']} at {r['cost_target']:g}: {r['note']}" for r in table if r["note"]]
    if notes:
        lines += ["", "(!) where the cost or the setting differs from what was asked:", *notes]
    curves_png = [save_figure(fig, root / f"finetune_curves_{cost:g}.png")
                  for cost, fig in curve_figures(cfg, planned, table).items()]
    lines += [""] + [f"![curves at {p.stem}]({p.name})" for p in curves_png]
    lines += ["", f"images/s: inference at batch {cfg.speed_batch}, every architecture interleaved in one process, "
                  f"median of {cfg.speed_repeats}. Steps to target: the first evaluation step at which the seed-mean "
                  f"accuracy reaches the finetuned dense model's mean after {cfg.steps} steps − 1 point"
                  f"{'' if target is None else f' ({100 * target:.2f} %)'}, one target for every row, long runs "
                  f"included (a long run's schedule spans its own steps, so its step {cfg.steps} is not a short "
                  "run's end)."]
    report = root / "finetune.md"
    write_text(report, "\n".join(lines) + "\n")
    write_json(root / "finetune.json", {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "arms"},
                                        "rows": table, "speeds": speeds,
                                        "bf16_check": {"fp32": fp32 and fp32["top1"], "bf16": bf16 and bf16["top1"]},
                                        "precision_seed0": [{"method": p.arm.name, "cost_target": p.cost_target,
                                                             "fp32": a["top1"], "bf16": b["top1"]}
                                                            for p, a, b in precision]})
    print("\n".join(lines))
    return report


def curve_figures(cfg: FinetuneConfig, planned: list[Planned], table: list[dict[str, Any]]) -> dict[float, Figure]:
    """Per cost with a finished curve: the seed-mean curves (``summarise``'s rows) of its arms and dense, each in a
    (colour, line style) of its own, an arm with a counterpart in its counterpart's colour where that pair is free."""
    figures = {}
    for cost in cfg.costs:
        series = {}
        for r in table:
            if r["cost_target"] in (cost, 1.0) and None not in r["curve"]:
                series[r["method"]] = (r["steps"], r["curve"])
        if series:
            done = sorted({r["seeds_done"] for r in table if r["method"] in series and r["cost_target"] in (cost, 1.0)})
            seeds = f"{done[0]}" if len(done) == 1 else f"{done[0]}–{done[-1]}"
            figures[cost] = steps_figure(series, f"finetuning at {cost:g} of dense MACs (mean of {seeds} of "
                                                 f"{cfg.seeds} seeds)",
                                         _curve_styles([p.arm for p in planned if p.cost_target in (cost, 1.0)]))
    return figures


def _curve_styles(arms: list[Arm]) -> dict[str, tuple[str, str]]:
    """Each arm with a counterpart drawn in the colour of the arm its chain of counterparts starts from: distilled
    dashed, any-cost dotted, longer runs dash-dotted."""
    counterpart = {a.name: a.counterpart for a in arms}
    styles = {}
    for arm in arms:
        if arm.counterpart is None:
            continue
        root = arm.counterpart
        while counterpart.get(root) is not None:
            root = counterpart[root]
        styles[arm.name] = (root, "-." if arm.steps else ":" if arm.any_cost else "--")
    return styles


def command_line(cfg: FinetuneConfig) -> str:
    """The `amod study` invocation that reruns (or resumes) this study."""
    checkpoint = str(cfg.checkpoint).replace(str(Path.home()), "~", 1)
    parts = ["amod study --checkpoint", checkpoint, "--data", cfg.data, "--img-size", str(cfg.img_size),
             "--cost", *[f"{c:g}" for c in cfg.costs], "--seeds", str(cfg.seeds), "--steps", str(cfg.steps),
             "--batch-size", str(cfg.batch_size), "--lr", f"{cfg.lr:g}", "--val-limit", str(cfg.eval_images),
             "--probe-train", str(cfg.probe_train), "--amp", cfg.amp]
    d, default = cfg.distillation, Distillation()
    if any(a.distill for a in cfg.arms):
        parts += [f"--teacher {cfg.teacher}"] if cfg.teacher else []
        parts += [f"--distill-{k} {getattr(d, k):g}" for k in ("logits", "temperature", "features")
                  if getattr(d, k) != getattr(default, k)]
    if len(cfg.arms) != len(ARMS):
        parts += ["--methods", *[f"'{a.name}'" for a in cfg.arms if a.name not in (DENSE, REFERENCE)]]
    return " ".join(parts)


def info_line(cfg: FinetuneConfig) -> str:
    return f"{cfg.data}, {cfg.img_size} px"
