"""`amod dense-frontier`: which training-free method keeps the most of the *patch features* at the speed a user needs.

The dense twin of `amod frontier`: every method over a grid of costs, zero training; each point's score is the
segmentation of Fashion-MNIST canvases (``segmentation``) by a linear probe fitted once on the dense model's patch
features and applied unchanged to the reduced model's patch features laid back on the dense grid
(``amod.patch_features``: merged, folded and pruned tokens unmerged); its speed-up is measured on that same call
(the forward and the unmerging), every model interleaved at one batch size, as `amod frontier` times. mIoU is read
at fixed measured speed-ups on each method's frontier (``amod.experiments.frontier.accuracy_at``), the two halves of
the test canvases giving the error bar.

A killed run resumes: the dense probe, the dense test features, every finished (method, cost) measurement, each
calibration and each kept timing round are kept under ``--out``. Writes ``dense_frontier.md``, ``.json`` and
``.png`` (mIoU against measured speed-up).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import check_dense_file, load_weightless, open_model
from ..cost import flops, misses_cost, tolerance_text, validate_cost
from ..errors import UserError
from ..files import load_torch, torch_save, write_json, write_text
from ..flags import flag, positive_int
from ..hf.loading import hf_source
from ..mod.calibrate import Calibrated
from ..mod.convert import MoD
from ..shorthand import setting_text_of
from ..tome.merging import TokenMerging
from ..tome.pitome import PiToMe
from ..patch_grid import patch_features
from ..train.models import fit_to_data
from ..train.rundir import check_output_dir
from ..experiments.arms import Arm, refuse_own_costs, select
from ..tools.bench import (DEVICES, IMPLAUSIBLE_NOTE, TimingRounds, resolve_device, same_setting_as,
                          speedup_text, time_callables, timing_key)
from ..experiments.calibrate_command import CalibrationCache
from ..experiments.features import features_key, finished_probe_rows
from ..experiments.frontier import flag_implausible, readings, speedup_figure, sweep_points
from ..experiments.plots import save_figure
from ..experiments.presets import run_in_directory
from ..detect.canvases import MIN_CANVAS_SIZE
from .segmentation import (PatchProbe, SegmentationCanvases, confusion, fit_patch_probe, grid_features,
                           patch_targets, segmentation_scores)

log = logging.getLogger("amod")

DENSE_FRONTIER_METHODS = (
    Arm("ToMe", TokenMerging()),
    Arm("PiToMe", PiToMe()),
    Arm("A-MoD (paper)", MoD()),
    Arm("A-MoD fold", MoD(skipped="fold")),
    # (its schedule chosen on the fidelity of the class token: amod.calibrate's objective)
    Arm("calibrated, nothing protected", Calibrated(protects=(0.0,))),
)
DEFAULT_DENSE_COSTS = (0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass
class DenseFrontierConfig:
    # (each field's comment is its flag's help: amod.flags)
    checkpoint: Optional[str] = flag(None, required=True)  # the dense timm backbone: an amod .safetensors file
    out: str = "runs/dense_frontier"
    img_size: int = flag(448, type=positive_int)  # canvas and input size (the position grid is resampled)
    costs: tuple[float, ...] = flag(DEFAULT_DENSE_COSTS, flag="cost")  # the cost grid every method is set to, shares
                                                                       # of dense MACs (closest cost it can reach)
    train_canvases: int = flag(256, type=positive_int)  # canvases the patch probe is fitted on (dense features)
    test_canvases: int = flag(128, type=positive_int, flag="val-limit", aliases=("test-canvases",))  # test canvases
                                                                                                     # each point is
                                                                                                     # scored on (two
                                                                                                     # halves: the
                                                                                                     # error bar)
    batch: int = flag(8, type=positive_int, flag="speed-batch", aliases=("batch",))  # the batch size timed (and
                                                                                     # features computed at)
    speed_repeats: int = flag(5, type=positive_int)  # timed rounds (after 2 discarded warm-up rounds)
    speedups: tuple[float, ...] = (1.25, 1.5, 2.0)  # measured speed-ups at which each method's frontier is read
    calibration_images: int = flag(16, type=positive_int)  # unlabeled training canvases each calibrated method
                                                           # chooses its schedule on
    l2: float = 1e-3  # the patch probe's weight decay
    device: str = flag("auto", choices=DEVICES)  # where features are computed and models timed
    methods: tuple[Arm, ...] = flag(DENSE_FRONTIER_METHODS, flag=None)

    def only(self, names: Optional[list[str]]) -> "DenseFrontierConfig":
        """The same sweep restricted to the named methods (``arms.select``)."""
        return dataclasses.replace(self, methods=select(self.methods, names))

    def validate(self) -> "DenseFrontierConfig":
        """Check every setting before any work; raises UserError naming the flag."""
        if not self.checkpoint:
            raise UserError("give --checkpoint: the dense timm backbone (an amod .safetensors file)")
        if hf_source(self.checkpoint) is not None:
            raise UserError("amod dense-frontier takes a timm backbone (an amod .safetensors file); a Hugging Face "
                            "model's patch grid is read with amod.patch_features")
        if not self.costs:
            raise UserError("give at least one --cost")
        for cost in self.costs:
            validate_cost(cost, "--cost")
        refuse_own_costs(self.methods, "dense-frontier", self.costs)
        if self.test_canvases < 2:
            raise UserError(f"--val-limit must be at least 2 (two halves), got {self.test_canvases}")
        if any(a.needs_images for a in self.methods) and self.calibration_images > self.train_canvases:
            raise UserError(f"--calibration-images ({self.calibration_images}) must be at most --train-canvases "
                            f"({self.train_canvases}): they are the first of the probe's training canvases")
        if not self.l2 >= 0:
            raise UserError(f"--l2 must be >= 0, got {self.l2}")
        if not self.speedups or any(not s > 1 for s in self.speedups):
            raise UserError(f"--speedups must be numbers above 1, got {list(self.speedups)}")
        if self.img_size < MIN_CANVAS_SIZE:
            raise UserError(f"--img-size must be at least {MIN_CANVAS_SIZE} px (the segmentation canvases are drawn "
                            f"at the input size), got {self.img_size}")
        resolve_device(self.device)
        check_dense_file(self.checkpoint)
        patch = load_weightless(self.checkpoint).patch_embed.patch_size[0]
        if self.img_size % patch:
            raise UserError(f"--img-size {self.img_size} is not a multiple of the model's patch size {patch}")
        return self


def run_dense_frontier(cfg: DenseFrontierConfig) -> Path:
    """Measure every (method, cost) point (reusing finished ones), time them all, and write the report."""
    cfg.validate()
    check_output_dir(cfg.out)
    # held (its lock, its log) while it runs: a second sweep into --out is refused, as every multi-run command's is
    return run_in_directory(cfg.out, "fashion-mnist", lambda root: _run(cfg, root))  # (the canvases' items)


def _run(cfg: DenseFrontierConfig, root: Path) -> Path:
    device = resolve_device(cfg.device)
    log.info("loading the dense model %s", cfg.checkpoint)
    dense = open_model(cfg.checkpoint, device)
    patch = dense.patch_embed.patch_size[0]  # (--img-size is a multiple of it: validate)
    fit_to_data(dense, 3, cfg.img_size)
    dense.eval()
    log.info("drawing %d training and %d test canvases at %d px", cfg.train_canvases, cfg.test_canvases,
             cfg.img_size)
    train = SegmentationCanvases("train", cfg.train_canvases, cfg.img_size)
    test = SegmentationCanvases("val", cfg.test_canvases, cfg.img_size)
    key = features_key(f"segmentation canvases, l2 {cfg.l2:g}", dense, Path(cfg.checkpoint), train, test)
    probe = _dense_probe(root, key, dense, train, cfg, device)
    masks = torch.stack([test[i][1] for i in range(len(test))])
    dense_feats = _dense_test_features(root, key, dense, test, cfg, device)
    dense_row = {"method": "dense", "cost_target": 1.0, "cost": 1.0, "setting": {},
                 **segmentation_scores(confusion(probe, dense_feats, masks, patch)), "cosine": 1.0}
    log.info("dense model at %d px: mIoU %.4f, pixel accuracy %.4f on %d test canvases", cfg.img_size,
             dense_row["miou"], dense_row["pixel_acc"], len(test))
    rows, same = _measure(cfg, root, key, probe, dense, dense_feats, masks, train, test, device)
    models = {"dense": dense, **{_key(r): r["model"] for r in rows if same[_key(r)] == _key(r)}}
    for r in rows:
        del r["model"]
    speeds = _time(cfg, root, models, same, device)
    dense_row["speed"] = speeds["dense"]
    for r in rows:
        r["speed"] = copy.deepcopy(speeds[same[_key(r)]])
    flag_implausible(rows, (cfg.batch,))
    return _write_report(root, cfg, dense_row, rows, same)


def _key(row: dict[str, Any]) -> str:
    return f"{row['method']} @ {row['cost_target']:g}"


def _dense_probe(root: Path, key: str, dense: torch.nn.Module, train: SegmentationCanvases,
                 cfg: DenseFrontierConfig, device: torch.device) -> PatchProbe:
    """The patch probe fitted on the dense model's patch features of the training canvases, cached in
    ``root/dense_patch_probe_KEY.pt``."""
    path = root / f"dense_patch_probe_{key}.pt"
    if path.exists():
        log.info("patch probe reused from %s", path)
        return PatchProbe(**load_torch(path))
    log.info("dense patch features of %d training canvases at %d px", len(train), cfg.img_size)
    feats = grid_features(dense, train, cfg.batch, device, "dense training features")
    targets = patch_targets(torch.stack([train[i][1] for i in range(len(train))]), dense.patch_embed.patch_size[0])
    log.info("fitting the patch probe on %d patches", feats.shape[0] * feats.shape[1])
    probe = fit_patch_probe(feats, targets, cfg.l2)
    torch_save(probe.state(), path)
    return probe


def _dense_test_features(root: Path, key: str, dense: torch.nn.Module, test: SegmentationCanvases,
                         cfg: DenseFrontierConfig, device: torch.device) -> torch.Tensor:
    """The dense model's patch features of the test canvases (each reduced model's cosine is to them), cached."""
    path = root / f"dense_test_features_{key}.pt"
    if path.exists():
        feats = load_torch(path)
        if isinstance(feats, torch.Tensor) and len(feats) == len(test):
            return feats
        log.warning("%s does not hold %d canvases' features; computing them again", path, len(test))
    log.info("dense patch features of %d test canvases at %d px", len(test), cfg.img_size)
    feats = grid_features(dense, test, cfg.batch, device, "dense test features")
    torch_save(feats, path)
    return feats


def _measure(cfg: DenseFrontierConfig, root: Path, key: str, probe: PatchProbe, dense: torch.nn.Module,
             dense_feats: torch.Tensor, masks: torch.Tensor, train: SegmentationCanvases,
             test: SegmentationCanvases, device: torch.device) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every (method, cost) point's scores, each appended to a file as it finishes (a killed sweep resumes after the
    last one); returns the rows with their models (``model``) and, for every point, the point whose setting it has
    (timed once). A cost whose closest setting the method already has at another cost has no row."""
    patch = dense.patch_embed.patch_size[0]
    finished = finished_probe_rows(root / f"dense_frontier_rows_{key}.jsonl")
    calibrations = CalibrationCache(
        root / f"calibrations_{key}_{cfg.calibration_images}.jsonl",
        lambda: torch.stack([train[i][0] for i in range(cfg.calibration_images)]).to(device))
    rows: list[dict[str, Any]] = []
    settings: dict[str, str] = {}
    for point in sweep_points(cfg.methods, cfg.costs, dense, calibrations, settings):
        entry, cost, method = point.entry, point.cost, point.method
        model = method.apply(copy.deepcopy(dense)).eval()
        measured = finished.get((entry.name, cost, repr(method)))
        if measured is None:
            feats = grid_features(model, test, cfg.batch, device)
            cosine = torch.nn.functional.cosine_similarity(feats, dense_feats, dim=-1).mean().item()
            measured = {"method": entry.name, "cost_target": cost, "method_repr": repr(method),
                        "cost": flops(model).ratio, "setting": method.spec(),
                        **segmentation_scores(confusion(probe, feats, masks, patch)), "cosine": cosine}
            finished.add(measured)
        log.info("[%d/%d] %s at cost %g (matched %.3f): mIoU %.4f (halves %.4f, %.4f), pixel accuracy %.4f",
                 point.number, point.total, entry.name, cost, measured["cost"], measured["miou"],
                 *measured["halves"], measured["pixel_acc"])
        rows.append({**measured, "model": model, **point.calibrated})
    return rows, same_setting_as(settings)


def _time(cfg: DenseFrontierConfig, root: Path, models: dict[str, torch.nn.Module], same: dict[str, str],
          device: torch.device) -> dict[str, dict[str, Any]]:
    """Each model's speed-up over dense on ``amod.patch_features`` (the forward and the unmerging) at ``--speed-batch``,
    all interleaved in the same rounds (``tools.bench.time_callables`` with dense the reference); kept rounds are
    saved, so a killed timing goes on where it stopped."""
    x = torch.randn(cfg.batch, 3, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(0)).to(device)

    def call(model: torch.nn.Module):
        def run() -> Any:
            with torch.inference_mode():
                return patch_features(model, x, output_fmt="NLC")
        return run

    rounds = TimingRounds(root / "timing_rounds.jsonl",
                          timing_key(sorted(models), cfg.checkpoint, cfg.img_size, cfg.batch, sorted(same.items())))
    log.info("timing %d models interleaved at batch %d, %d px (%d rounds after 2 warm-up rounds)", len(models),
             cfg.batch, cfg.img_size, cfg.speed_repeats)
    timed = time_callables({n: call(m) for n, m in models.items()}, cfg.speed_repeats, 2, device, "dense", rounds)
    return {n: {str(cfg.batch): {"images_per_s": cfg.batch / t["seconds"], "spread": t["spread"],
                                 "speedup": t["speedup"]}} for n, t in timed.items()}


def _write_report(root: Path, cfg: DenseFrontierConfig, dense_row: dict[str, Any], rows: list[dict[str, Any]],
                  same: dict[str, str]) -> Path:
    methods = [e.name for e in cfg.methods]
    b = str(cfg.batch)
    tunables = os.environ.get("GLIBC_TUNABLES")
    read = readings(rows, dense_row, cfg.batch, cfg.speedups, methods, metric="miou")
    lines = [f"# amod dense-frontier: patch features against measured speed-up, zero training, {cfg.img_size} px", "",
             f"Dense backbone `{cfg.checkpoint}` at {cfg.img_size} px: segmentation of {cfg.test_canvases} Fashion-MNIST "
             f"canvases (10 classes and background) by a linear probe on the patch features, fitted on the dense "
             f"model's features of {cfg.train_canvases} training canvases and applied unchanged to every reduced "
             f"model's unmerged features (amod.patch_features): mIoU **{100 * dense_row['miou']:.2f}**, pixel "
             f"accuracy {100 * dense_row['pixel_acc']:.2f} %; {dense_row['speed'][b]['images_per_s']:.2f} images/s "
             f"at batch {b}. Speed: amod.patch_features (forward and unmerging), every model interleaved in one "
             f"process, {cfg.speed_repeats} rounds after 2 warm-up rounds, {torch.get_num_threads()} threads, "
             f"GLIBC_TUNABLES={tunables or '(unset: timings swing more)'}; speed-up = median of the round-by-round "
             "ratios to dense. Halves: mIoU on the even and the odd test canvases.", "",
             f"## mIoU at measured speed-up, batch {b}", "",
             "Each method's frontier (dense included, a speed-up flagged (?) left out) read at the speed-up by "
             "linear interpolation; ± half the difference between the two halves' readings; – the method does not "
             "reach that speed-up.", "",
             "| speed-up | " + " | ".join(methods) + " | leader |", "|---" * (len(methods) + 2) + "|"]
    for s, by_method in read.items():
        cells = [("–" if v is None else f"{100 * v['miou']:.2f}"
                  + ("" if v["spread"] is None else f" ± {100 * v['spread']:.2f}")) for v in by_method.values()]
        reached = {n: v["miou"] for n, v in by_method.items() if v is not None}
        lines.append(f"| {s}x | " + " | ".join(cells) + f" | {max(reached, key=reached.get) if reached else '–'} |")
    lines += ["", "## Every point", "",
              "| method | cost target | setting | cost vs dense | mIoU | halves | pixel acc. | patch cosine to dense "
              f"| speed-up b{b} |", "|---" * 9 + "|"]
    for r in [dense_row, *rows]:
        miss = " (!)" if misses_cost(r["cost"], r["cost_target"]) else ""
        setting = setting_text_of(r["setting"]) if r["setting"] else "–"
        lines.append(f"| {r['method']} | {r['cost_target']:g} | {setting} | {r['cost']:.3f}{miss} | "
                     f"{100 * r['miou']:.2f} | {100 * r['halves'][0]:.2f} / {100 * r['halves'][1]:.2f} | "
                     f"{100 * r['pixel_acc']:.2f} | {r['cosine']:.4f} | "
                     f"{speedup_text(r['speed'][b]['speedup'], r['cost'])} |")
    lines.append("")
    if any(misses_cost(r["cost"], r["cost_target"]) for r in rows):
        lines += [f"(!) the method cannot reach the cost target within {tolerance_text()} on this model; its closest "
                  "cost is shown.", ""]
    if not all(not r["speed"][b].get("implausible") for r in rows):
        lines += [IMPLAUSIBLE_NOTE + "; the readings above leave it out.", ""]
    shared = {k: v for k, v in same.items() if k != v}
    if shared:
        lines += ["Points of one setting are one model, timed once: " + "; ".join(
            f"{k} is {v}" for k, v in shared.items()) + ".", ""]
    if any("calibration" in r for r in rows):
        lines += [f"The calibrated points chose their schedules on the first {cfg.calibration_images} training "
                  "canvases (no labels) by amod.calibrate's objective, the fidelity of the class token.", ""]
    png = save_figure(speedup_figure(dense_row, rows, methods, [b], cfg.img_size, metric="miou",
                                     ylabel="segmentation mIoU on test canvases (%)"), root / "dense_frontier.png")
    lines += [f"![mIoU against measured speed-up]({png.name})", ""]
    report = root / "dense_frontier.md"
    write_text(report, "\n".join(lines))
    write_json(root / "dense_frontier.json", {
        "checkpoint": str(cfg.checkpoint), "img_size": cfg.img_size, "train_canvases": cfg.train_canvases,
        "test_canvases": cfg.test_canvases, "batch": cfg.batch, "threads": torch.get_num_threads(),
        "glibc_tunables": tunables, "speed_repeats": cfg.speed_repeats, "dense": dense_row, "rows": rows,
        "readings": read, "same_setting": shared})
    print("\n".join(lines[4:]))
    log.info("report written to %s", report)
    return report
