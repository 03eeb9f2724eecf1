"""`amod frontier`: which training-free method keeps the most accuracy at the speed a user needs.

Every method runs over a grid of costs (shares of the dense model's MACs) with zero training; each point gets
its accuracy (the probe protocol of `amod compare`: a linear probe fitted once on the dense model's features,
applied unchanged to every reduced model's) and its *measured* speed-up over dense, at batch 32 and at batch 1,
every model timed interleaved in one process (median of the rounds; the speed-up is the median of the
round-by-round ratios to dense). From those points each method's frontier (its points that no other point of
the same method beats in both speed and accuracy) is read at fixed speed-ups by linear interpolation, so that
methods are compared at the same measured speed, not at the same MACs.

The test images are split in two halves (even and odd positions); each half's accuracy is kept, and the
difference between the two halves' readings is the error bar of a reading. A killed run resumes: the dense
features, the probe and each finished (method, cost) measurement are kept under ``--out``.

Writes ``frontier.md`` (every point, and the readings at each speed-up), ``frontier.json`` and
``frontier.png`` (accuracy against measured speed-up, one panel per batch size).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from ..checkpoint import check_dense_file, open_model
from ..cost import flops, misses_cost, tolerance_text, validate_cost
from ..files import write_json, write_text
from ..hf.loading import hf_source
from ..methods import Method
from ..mod.convert import MoD
from ..shorthand import setting_text_of
from ..tome.merging import TokenMerging
from ..tome.pitome import PiToMe
from ..mod.calibrate import CHOSEN_COLUMNS, Calibrated, chosen_cells
from ..train import engine
from ..train.data import build_datasets
from ..train.models import fit_to_data
from ..train.rundir import check_output_dir
from ..fast import compile as fast_compile, warm_up
from ..train.engine import AMP_MODES
from .arms import FOLD_CONTROLS, Arm, refuse_own_costs, select
from ..tools.bench import (DEVICES, IMPLAUSIBLE_NOTE, resolve_device, same_setting_as, speedup_text, time_models,
                          warn_implausible)
from .calibrate_command import CalibrationCache, calibration_grid
from .compare import check_inputs
from .features import dense_features, dense_probe, feature_model, features_key, finished_probe_rows
from .plots import Figure, frontier_figure, save_figure
from .presets import run_in_directory
from .probe import LinearProbe, features, mean_cosine, probe_images
from ..errors import UserError
from ..flags import flag, positive_int

log = logging.getLogger("amod")


# The methods `amod frontier` runs, in the report's order (``--methods`` picks some by name).
FRONTIER_METHODS = (
    Arm("ToMe", TokenMerging()),
    Arm("PiToMe", PiToMe()),
    Arm("A-MoD (paper)", MoD()),
    Arm("A-MoD fold", MoD(skipped="fold")),
    *FOLD_CONTROLS,
    # amod's training-free mode: fold on a per-block schedule (and protection) chosen on unlabeled images, and what
    # A-MoD's attention is worth to it: the same calibration with random scores, and with nothing protected
    # (each chooses its setting at a cost on the first --calibration-images of the probe's training images, labels unread)
    Arm("A-MoD calibrated", Calibrated()),
    Arm("calibrated, random scores", Calibrated(router="random")),
    Arm("calibrated, nothing protected", Calibrated(protects=(0.0,))),
    # the calibration with the tokens folding in three blocks only: three sorts, gathers and scatters a forward, what
    # a GPU runs fast (issue 72); what it costs in accuracy at the same measured speed
    Arm("calibrated, 3 stages", Calibrated(stages=3)),
)
DEFAULT_COSTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class FrontierConfig:
    # (each field's comment is its flag's help: amod.flags)
    checkpoint: Optional[str] = flag(None, required=True)  # the dense backbone: an amod .safetensors file or a Hugging
                                                           # Face model (directory or hf:ID)
    out: str = "runs/frontier"
    data: str = "fashion-mnist"
    img_size: Optional[int] = flag(None, type=positive_int)  # input size; default the model's own (the position grid is
                                                             # resampled otherwise)
    costs: tuple[float, ...] = flag(DEFAULT_COSTS, flag="cost")  # the cost grid every method is set to, shares of dense
                                                                 # MACs (closest cost it can reach)
    probe_train: int = flag(3000, type=positive_int)  # training images the linear probe is fitted on (dense features)
    val_limit: Optional[int] = flag(2000, type=positive_int)  # test images each point is measured on (two halves give
                                                              # the error bar)
    speed_batches: tuple[int, ...] = flag((32, 1), flag="speed-batch", type=positive_int)  # batch sizes timed,
                                                                                           # every model interleaved;
                                                                                           # the first: the main reading
    speed_repeats: int = flag(5, type=positive_int)  # timed rounds per batch size (after 2 discarded warm-up rounds)
    forwards_per_call: int = flag(8, flag=None)  # forwards per timed call at a batch below 8 (one is too short to time
                                                 # alone)
    speedups: tuple[float, ...] = (1.5, 2.0, 2.5)  # measured speed-ups at which each method's frontier is read
    calibration_images: int = flag(256, type=positive_int)  # unlabeled training images each calibrated method chooses
                                                            # its schedule on
    device: str = flag("auto", choices=DEVICES)  # where features are computed and models timed (auto: a GPU where there
                                                 # is one)
    compile: bool = False  # time every model compiled by amod.compile (one graph, static shapes, CUDA graphs on a GPU)
    amp: str = flag("off", choices=AMP_MODES)  # time under bf16 autocast (the accuracies are the model's own precision)
    methods: tuple[Arm, ...] = flag(FRONTIER_METHODS, flag=None)

    def only(self, names: Optional[list[str]]) -> "FrontierConfig":
        """The same sweep restricted to the named methods (``Arm.name``), in their usual order, and any registered
        method named by its kind or spec (``arms.select``)."""
        return dataclasses.replace(self, methods=select(self.methods, names))

    def validate(self) -> "FrontierConfig":
        """Check every setting before any work; raises ValueError naming the flag."""
        if not self.checkpoint:
            raise UserError("give --checkpoint: the dense backbone to sweep (an amod .safetensors file, a "
                            "save_pretrained folder or hf:ID)")
        if not self.costs:
            raise UserError("give at least one --cost")
        for cost in self.costs:
            validate_cost(cost, "--cost")
        refuse_own_costs(self.methods, "frontier", self.costs)
        for name in ("probe_train", "speed_repeats", "forwards_per_call", "calibration_images"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if any(a.needs_images for a in self.methods) and self.calibration_images > self.probe_train:
            raise UserError(f"--calibration-images ({self.calibration_images}) must be at most --probe-train "
                            f"({self.probe_train}): they are the first of the probe's training images")
        if self.val_limit is not None and self.val_limit < 2:
            raise UserError(f"--val-limit must be at least 2 (two halves of the test images), got {self.val_limit}")
        if not self.speed_batches or any(not isinstance(b, int) or b < 1 for b in self.speed_batches):
            raise UserError(f"--speed-batch must be positive integers, got {list(self.speed_batches)}")
        if not self.speedups or any(not (s > 1 and math.isfinite(s)) for s in self.speedups):
            raise UserError(f"--speedups must be finite numbers above 1, got {list(self.speedups)}")
        if self.amp not in AMP_MODES:
            raise UserError(f"--amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        resolve_device(self.device)
        if hf_source(self.checkpoint) is None:
            check_dense_file(self.checkpoint)
        return self


def run_frontier(cfg: FrontierConfig) -> Path:
    """Measure every (method, cost) point (reusing finished ones), time them all, and write the report."""
    cfg.validate()
    check_output_dir(cfg.out)
    check_inputs(cfg)  # (silent: a refused command says one line; on a terminal, a progress bar)
    check_data_size(cfg)
    return run_in_directory(cfg.out, cfg.data, lambda root: _run(cfg, root))


def check_data_size(cfg: FrontierConfig) -> None:
    """Refuse, before any work, data with too few images for the sweep: fewer training images than the linear
    probe needs (``probe_images``) or than the calibrated methods calibrate on (the first of the probe's), or fewer
    than two test images (the two halves). Raises ValueError naming the flag and the data."""
    train, val, _ = build_datasets(cfg.data, None, None, None)
    n_probe = probe_images(len(train), cfg.probe_train, cfg.data)
    if any(a.needs_images for a in cfg.methods) and cfg.calibration_images > n_probe:
        raise UserError(f"--calibration-images {cfg.calibration_images}: the calibrated methods calibrate on the "
                        f"first of the probe's {n_probe} training images ({cfg.data} has {len(train)}); give at "
                        f"most {n_probe}")
    if min(len(val), cfg.val_limit or len(val)) < 2:
        raise UserError(f"{cfg.data} has {len(val)} test image{'' if len(val) == 1 else 's'}; the frontier needs at "
                        "least 2 (two halves give the error bar)")


# ---------------------------------------------------------------- reading a frontier

def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (speed-up, accuracy) points that no other point beats in both, in speed-up order."""
    best: list[tuple[float, float]] = []
    for s, a in sorted(points, key=lambda p: (-p[0], -p[1])):  # fastest first: keep what gains accuracy
        if not best or a > best[-1][1]:
            best.append((s, a))
    return best[::-1]


def accuracy_at(points: Sequence[tuple[float, float]], speedup: float) -> Optional[float]:
    """The accuracy a method keeps at ``speedup``, linearly interpolated on its frontier (``pareto``); None where
    its fastest point is slower. Below its slowest point the slowest point's accuracy holds (a faster point that
    is as accurate serves a slower need too)."""
    front = pareto(points)
    if not front or speedup > front[-1][0]:
        return None
    if speedup <= front[0][0]:
        return front[0][1]
    for (s0, a0), (s1, a1) in zip(front, front[1:]):
        if s0 <= speedup <= s1:
            return a0 + (a1 - a0) * (speedup - s0) / (s1 - s0)
    return None  # (unreachable: the front is sorted)


# ---------------------------------------------------------------- the sweep

def _run(cfg: FrontierConfig, root: Path) -> Path:
    device = resolve_device(cfg.device)
    log.info("loading the dense model %s and %s", cfg.checkpoint, cfg.data)
    dense = open_model(cfg.checkpoint, device)
    img_size = cfg.img_size or dense.patch_embed.img_size[0]
    train, val, info = build_datasets(cfg.data, img_size, cfg.probe_train, cfg.val_limit)
    fit_to_data(dense, info.in_chans, img_size)  # (nothing to do for a model check_inputs found at its own size)
    key = features_key(cfg.data, dense, Path(cfg.checkpoint), train, val)
    cached = dense_features(root, key, dense, train, val, device)
    probe = dense_probe(root, key, cached)
    dense_row = {"method": "dense", "cost_target": 1.0, "cost": 1.0, "setting": {},
                 **_scores(probe, cached["test"], cached["test_labels"]), "cosine": 1.0}
    log.info("dense model %s at %d px: probe top-1 %.4f on %d test images", cfg.checkpoint, img_size,
             dense_row["top1"], len(val))
    rows, same = _measure(cfg, root, key, probe, dense, cached, train, val, device)
    models = {"dense": dense, **{_key(r): r["model"] for r in rows if same[_key(r)] == _key(r)}}
    for r in rows:
        del r["model"]
    speeds = _time(cfg, models, device)
    dense_row["speed"] = speeds["dense"]
    for r in rows:  # a point of another's setting shares its measurement: one model, one speed-up
        r["speed"] = copy.deepcopy(speeds[same[_key(r)]])
        if same[_key(r)] != _key(r):
            r["timed_as"] = same[_key(r)]
    flag_implausible(rows, cfg.speed_batches)
    return _write_report(root, cfg, info.name, len(train), len(val), img_size, dense_row, rows, same)


def _key(row: dict[str, Any]) -> str:
    return f"{row['method']} @ {row['cost_target']:g}"


def flag_implausible(rows: list[dict[str, Any]], batches: Sequence[int]) -> None:
    """Mark (``speed[batch]["implausible"]``) each measured speed-up faster than the point's MACs allow
    (``implausible_speedup``), after one warning naming them: the readings leave those points out."""
    for b in map(str, batches):
        flagged = set(warn_implausible([(f"{_key(r)} (batch {b})", r["speed"][b]["speedup"], r["cost"])
                                        for r in rows]))
        for r in rows:
            r["speed"][b]["implausible"] = f"{_key(r)} (batch {b})" in flagged


def _trusted(row: dict[str, Any], batch: str) -> bool:
    """Whether ``row``'s speed-up at ``batch`` is a measurement (not flagged by ``flag_implausible``)."""
    return not row["speed"][batch].get("implausible", False)


def _scores(probe: LinearProbe, feats: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """Probe top-1 on all test images and on each half (even and odd positions)."""
    correct = (probe.logits(feats).argmax(1) == labels).double()
    return {"top1": correct.mean().item(), "halves": [correct[0::2].mean().item(), correct[1::2].mean().item()]}


@dataclass
class SweepPoint:
    """One (method, cost) point of a sweep, set to its cost: its place in the sweep (``number`` of ``total``), and
    ``calibrated``: ``{"calibration": report}`` for a method that chose its setting on images, else empty."""

    number: int
    total: int
    entry: Arm
    cost: float
    method: Method
    calibrated: dict[str, Any]


def sweep_points(methods: Sequence[Arm], costs: Sequence[float], dense: torch.nn.Module,
                 calibrations: CalibrationCache, settings: dict[str, str]) -> Iterator[SweepPoint]:
    """Every method at every cost, in order: `amod frontier`'s and `amod dense-frontier`'s sweep. A method that
    ``needs_images`` is calibrated through ``calibrations`` (kept, so a resumed sweep reuses it). Each point's setting
    is recorded in ``settings`` (``"name @ cost"``: the method's repr, for ``tools.bench.same_setting_as``); a cost
    whose closest setting the method already has at an earlier cost is logged and not yielded (measured once)."""
    pairs = [(entry, cost) for entry in methods for cost in costs]
    seen: set[tuple[str, str]] = set()
    for number, (entry, cost) in enumerate(pairs, start=1):
        calibration = None
        if entry.needs_images:
            calibrated = entry.method  # (a ``Calibrated``)
            method, calibration = calibrations.get(
                entry.name, cost, calibration_grid(calibrated),
                lambda images: calibrated.calibrated(dense, cost, images))
        else:
            method = entry.at_cost(dense, cost)
        settings[f"{entry.name} @ {cost:g}"] = repr(method)
        if (entry.name, repr(method)) in seen:
            log.info("[%d/%d] %s at cost %g: the same setting as at another cost, measured once", number,
                     len(pairs), entry.name, cost)
            continue
        seen.add((entry.name, repr(method)))
        yield SweepPoint(number, len(pairs), entry, cost, method, {"calibration": calibration} if calibration else {})


def _measure(cfg: FrontierConfig, root: Path, key: str, probe: LinearProbe, dense: torch.nn.Module,
             cached: dict[str, torch.Tensor], train, val, device: torch.device
             ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every (method, cost) point's accuracy, each appended to a file as it finishes (a killed sweep resumes
    after the last one); returns the rows with their models (``model``), for timing, and for every point the point
    whose setting it has (``tools.bench.same_setting_as``: timed once). A cost whose closest setting is one the method
    already has at another cost is not measured twice: it has no row."""
    loader = engine.make_loader(val, 128, False, 0, 0, engine.Dist(device=device))
    done_path = root / f"frontier_rows_{key}_{probe.l2:g}.jsonl"
    finished = finished_probe_rows(done_path)
    calibrations = CalibrationCache(  # the first images of the probe's training subset, labels unread
        root / f"calibrations_{key}_{cfg.calibration_images}.jsonl",
        lambda: torch.stack([train[i][0] for i in range(cfg.calibration_images)]).to(device))
    rows: list[dict[str, Any]] = []
    settings: dict[str, str] = {}  # every point's setting, the points without a row too
    for point in sweep_points(cfg.methods, cfg.costs, dense, calibrations, settings):
        entry, cost, method = point.entry, point.cost, point.method
        model = method.apply(copy.deepcopy(dense)).eval()
        measured = finished.get((entry.name, cost, repr(method)))
        if measured is None:
            feats, labels = features(feature_model(model), engine.image_batches(loader), device)
            measured = {"method": entry.name, "cost_target": cost, "method_repr": repr(method),
                        "cost": flops(model).ratio, "setting": method.spec(), **_scores(probe, feats, labels),
                        "cosine": mean_cosine(feats, cached["test"])}
            finished.add(measured)
        log.info("[%d/%d] %s at cost %g (matched %.3f): probe top-1 %.4f (halves %.4f, %.4f)", point.number,
                 point.total, entry.name, cost, measured["cost"], measured["top1"], *measured["halves"])
        rows.append({**measured, "model": model, **point.calibrated})
    return rows, same_setting_as(settings)


def _time(cfg: FrontierConfig, models: dict[str, torch.nn.Module],
          device: torch.device) -> dict[str, dict[str, Any]]:
    """Images/s of every model at each batch size, all interleaved in the same rounds, and each model's
    speed-up over dense: the median over rounds of the mean of the two dense runs around it
    (``tools.bench.time_models`` with dense the reference: it runs after every few models) over its own time, so that a
    slow minute of a shared machine touches both sides of a ratio."""
    first = next(iter(models.values()))
    speeds: dict[str, dict[str, Any]] = {name: {} for name in models}
    for batch in cfg.speed_batches:
        calls = cfg.forwards_per_call if batch < 8 else 1
        x = torch.randn(batch, first.patch_embed.proj.in_channels, *first.patch_embed.img_size,
                        generator=torch.Generator().manual_seed(0)).to(device)
        timed_models, compile_s = models, {}
        if cfg.compile:  # each model compiled at this batch (a graph per shape), before its rounds
            timed_models = {n: fast_compile(m, dtype=torch.bfloat16 if cfg.amp == "bf16" else None)
                            for n, m in models.items()}
            for n, m in timed_models.items():
                compile_s[n] = warm_up(m, x)
                log.info("compiled %s at batch %d in %.1f s", n, batch, compile_s[n])
        log.info("timing %d models interleaved at batch %d (%d rounds after 2 warm-up rounds, %d forward(s) a call)",
                 len(models), batch, cfg.speed_repeats, calls)
        amp = "off" if cfg.compile else cfg.amp  # (a compiled model carries its autocast inside)
        timed = time_models(timed_models, x, cfg.speed_repeats, 2, amp, reference="dense", forwards_per_call=calls)
        for name, t in timed.items():
            speeds[name][str(batch)] = {"images_per_s": t["images_per_s"], "spread": t["spread"],
                                        "speedup": t["speedup"],
                                        **({"compile_s": compile_s[name]} if cfg.compile else {})}
    return speeds


# ---------------------------------------------------------------- the report

def readings(rows: list[dict[str, Any]], dense_row: dict[str, Any], batch: int, speedups: Sequence[float],
             methods: Sequence[str], metric: str = "top1") -> dict[str, dict[str, Optional[dict[str, float]]]]:
    """{speed-up: {method: {metric, "spread"} or None}}: each method's frontier of ``metric`` (a key of the rows,
    whose ``halves`` are that metric on each test half) read at each speed-up, its spread half the difference
    between the two test halves' readings."""
    out: dict[str, dict[str, Optional[dict[str, float]]]] = {}
    for s in speedups:
        out[f"{s:g}"] = {}
        for name in methods:
            mine = [dense_row] + [r for r in rows if r["method"] == name and _trusted(r, str(batch))]
            speed = [r["speed"][str(batch)]["speedup"] for r in mine]
            whole = accuracy_at(list(zip(speed, (r[metric] for r in mine))), s)
            halves = [accuracy_at(list(zip(speed, (r["halves"][h] for r in mine))), s) for h in (0, 1)]
            out[f"{s:g}"][name] = None if whole is None else {
                metric: whole, "spread": abs(halves[0] - halves[1]) / 2 if None not in halves else None}
    return out


def speedup_figure(dense_row: dict[str, Any], rows: list[dict[str, Any]], methods: Sequence[str],
                   batches: Sequence[str], img_size: int, metric: str = "top1",
                   ylabel: str = "probe top-1 on test images (%)") -> Figure:
    """``metric`` against measured speed-up, a panel per batch size: each method's points (a speed-up flagged
    implausible left out) joined, dense one marker of its own at 1x; each point's error bar ± half the difference
    between its two test halves (the tables' ±). Draws a report's json again: ``speedup_figure(d["dense"],
    d["rows"], methods, list(d["dense"]["speed"]), d["img_size"])``."""
    def point(r: dict[str, Any], speedup: float) -> tuple[float, float, Optional[float]]:
        halves = r.get("halves")
        return speedup, r[metric], None if not halves else abs(halves[0] - halves[1]) / 2

    panels = {f"zero training, batch {b} ({img_size} px)": (
        point(dense_row, 1.0),
        {name: [point(r, r["speed"][b]["speedup"]) for r in rows if r["method"] == name and _trusted(r, b)]
         for name in methods}) for b in batches}
    return frontier_figure(panels, "measured speed-up over dense", ylabel)


def _write_report(root: Path, cfg: FrontierConfig, data_name: str, n_train: int, n_val: int, img_size: int,
                  dense_row: dict[str, Any], rows: list[dict[str, Any]], same: dict[str, str]) -> Path:
    methods = [e.name for e in cfg.methods]
    batches = [str(b) for b in cfg.speed_batches]
    tunables = os.environ.get("GLIBC_TUNABLES")
    dense_speed = ", ".join(f"{dense_row['speed'][b]['images_per_s']:.1f} images/s at batch {b}" for b in batches)
    read = {b: readings(rows, dense_row, int(b), cfg.speedups, methods) for b in batches}
    lines = [f"# amod frontier: accuracy against measured speed-up, zero training, on {data_name}", "",
             f"Dense backbone `{cfg.checkpoint}` at {img_size} px: linear-probe top-1 **{100 * dense_row['top1']:.2f} %** "
             f"on {n_val} test images (probe fitted on the dense features of {n_train} training images, "
             f"applied unchanged to every reduced model); {dense_speed}. Speed: every model interleaved in one "
             f"process, {cfg.speed_repeats} rounds after 2 warm-up rounds, {torch.get_num_threads()} threads, "
             f"GLIBC_TUNABLES={tunables or '(unset: timings swing more)'}; speed-up = median of the round-by-round "
             "ratios to dense. Halves: top-1 on the even and the odd test images.", ""]
    for b in batches:
        lines += [f"## Accuracy at measured speed-up, batch {b}", "",
                  "Each method's frontier (its points no other of its points beats in speed and accuracy, dense "
                  "included, a speed-up flagged (?) left out) read at the speed-up by linear interpolation; ± half "
                  "the difference between the two halves' readings; – the method does not reach that speed-up.", "",
                  "| speed-up | " + " | ".join(methods) + " | leader |", "|---" * (len(methods) + 2) + "|"]
        for s, by_method in read[b].items():
            cells = [("–" if v is None else f"{100 * v['top1']:.2f}"
                      + ("" if v["spread"] is None else f" ± {100 * v['spread']:.2f}")) for v in by_method.values()]
            reached = {n: v["top1"] for n, v in by_method.items() if v is not None}
            leader = max(reached, key=reached.get) if reached else "–"
            lines.append(f"| {s}x | " + " | ".join(cells) + f" | {leader} |")
        lines.append("")
    lines += ["## Every point", "",
              "| method | cost target | setting | cost vs dense | probe top-1 | halves | cosine to dense | "
              + " | ".join(f"speed-up b{b}" for b in batches) + " |", "|---" * (7 + len(batches)) + "|"]
    for r in [dense_row, *rows]:
        miss = " (!)" if misses_cost(r["cost"], r["cost_target"]) else ""
        setting = setting_text_of(r["setting"]) if r["setting"] else "–"
        lines.append(f"| {r['method']} | {r['cost_target']:g} | {setting} | {r['cost']:.3f}{miss} | "
                     f"{100 * r['top1']:.2f} | {100 * r['halves'][0]:.2f} / {100 * r['halves'][1]:.2f} | "
                     f"{r['cosine']:.4f} | " + " | ".join(speedup_text(r["speed"][b]["speedup"], r["cost"])
                                                          for b in batches) + " |")
    lines.append("")
    if any(misses_cost(r["cost"], r["cost_target"]) for r in rows):
        lines += [f"(!) the method cannot reach the cost target within {tolerance_text()} on this model; its closest "
                  "cost is shown.", ""]
    if not all(_trusted(r, b) for r in rows for b in batches):
        lines += [IMPLAUSIBLE_NOTE + "; the readings above leave it out.", ""]
    shared = {k: v for k, v in same.items() if k != v}
    if shared:
        measured = {_key(r) for r in rows}
        lines += ["Points of one setting are one model, timed once: " + "; ".join(
            f"{k} shares the speed-up of {v}" if k in measured else f"{k} is {v} (measured once, no row of its own)"
            for k, v in shared.items()) + ".", ""]
    calibrated = [r for r in rows if "calibration" in r]
    if calibrated:
        lines += ["## Calibration", "",
                  f"Each calibrated point chose its schedule on the first {cfg.calibration_images} probe-training "
                  "images (labels unread): every candidate schedule (a tilt, and a share its router keeps whole) "
                  "at the cost, the highest fidelity (mean cosine to the dense features on those images) within "
                  f"{tolerance_text()} of the cost wins.", "",
                  "| method | cost target | " + " | ".join(CHOSEN_COLUMNS) + " | seconds |",
                  "|---|---|" + "---|" * len(CHOSEN_COLUMNS) + "---|"]
        for r in calibrated:
            report = r["calibration"]
            lines.append(f"| {r['method']} | {r['cost_target']:g} | {' | '.join(chosen_cells(report))} | "
                         f"{report['seconds']:.0f} |")
        lines.append("")
    png = save_figure(speedup_figure(dense_row, rows, methods, batches, img_size), root / "frontier.png")
    lines += [f"![accuracy against measured speed-up]({png.name})", ""]
    report = root / "frontier.md"
    write_text(report, "\n".join(lines))
    write_json(root / "frontier.json", {
        "checkpoint": str(cfg.checkpoint), "data": data_name, "img_size": img_size, "test_images": n_val,
        "probe_train": n_train, "threads": torch.get_num_threads(), "glibc_tunables": tunables,
        "speed_repeats": cfg.speed_repeats, "dense": dense_row, "rows": rows,
        "readings": read, "same_setting": shared})
    print("\n".join(lines[4:]))
    log.info("report written to %s", report)
    return report
