"""`amod study`: the experiment the review of the A-MoD paper asks for, as one command.

A grid of routers x capacities x seeds, each finetuned from one pretrained dense checkpoint with the
same budget (plus the isoFLOP dense baseline), then:
- accuracy mean ± std per variant and, for A-MoD minus each other variant, the paired difference
  with a 95 % two-level bootstrap CI (seeds, then test images; pairs share the seed);
- convergence: the first epoch at which each variant reaches a target accuracy;
- the 2x2 of the confound {attention, learned} x {scaled, unscaled}, and the controls
  (shuffled attention, random, inverse attention);
- leave-one-out importance inside the trained MoD models vs their router scores (and random);
- attention entropy and attention-sink share per layer; routing pictures.
Finished runs are reused, so a killed study continues where it stopped.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..files import atomic_write, dumps, write_text
from ..mod.convert import MoD
from ..mod.isoflop import IsoFLOP
from ..mod.config import validate_capacity
from ..train import engine
from ..checkpoint import load
from ..train.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, build_datasets, first_images
from ..train.config import RunConfig
from ..train.rundir import run_dir_name
from ..analysis import attention_stats, leave_one_out
from .arms import Arm
from .plots import accuracy_vs_epoch, routing_figure
from .presets import BASE, check_settings, check_trainable, run_in_directory, run_once, starting_checkpoint
from ..stats import mean_std, paired_bootstrap_ci
from ..errors import UserError
from ..flags import flag, positive_int

log = logging.getLogger("amod")


# The study's arms (``arms.Arm``: a name and a method; the capacity is set per grid point), in the report's order.
VARIANTS = (
    Arm("A-MoD", MoD(router="attention", scale_output=False)),
    Arm("A-MoD scaled", MoD(router="attention", scale_output=True)),
    Arm("MoD", MoD(router="standard", scale_output=True)),
    Arm("MoD unscaled (STE)", MoD(router="standard", scale_output=False)),
    Arm("shuffled attention", MoD(router="shuffled-attention", scale_output=False)),
    Arm("random", MoD(router="random", scale_output=False)),
    Arm("inverse attention", MoD(router="inverse-attention", scale_output=False)),
    Arm("isoFLOP dense", IsoFLOP(router="attention")),
)
REFERENCE = "A-MoD"


@dataclass
class StudyConfig:
    # (each field's comment is its flag's help: amod.flags)
    out: str = "runs/study"
    checkpoint: Optional[str] = None  # pretrained dense model (default: amod demo --toy's small ViT, pretrained in
                                      # OUT/pretrain if missing)
    data: str = "fashion-mnist"
    capacities: tuple[float, ...] = flag((0.5, 0.125), flag="capacity")
    seeds: int = flag(3, type=positive_int)
    epochs: int = flag(3, type=positive_int)
    train_limit: Optional[int] = flag(10000, type=positive_int)
    val_limit: Optional[int] = None
    lr: float = 5e-4
    batch_size: int = 128
    loo_images: int = 8
    loo_tokens: int = 16
    quick: bool = False  # a tiny version (for tests)

    def as_quick(self) -> "StudyConfig":
        """The same study in a few seconds (for tests): the first capacity, two seeds, tiny data.

        The settings given are checked first (``validate``): quick mode replaces most of them, but a wrong
        one is still refused rather than ignored.
        """
        self.validate()
        return dataclasses.replace(self, capacities=self.capacities[:1], seeds=2, epochs=1, train_limit=256,
                                   val_limit=128, loo_images=2, loo_tokens=4, quick=True)

    def validate(self) -> "StudyConfig":
        """Check every setting before the first run starts; raises ValueError naming the setting."""
        if not self.capacities:
            raise UserError("give at least one --capacity")
        for c in self.capacities:
            validate_capacity(c)
        check_trainable(self.checkpoint, "--checkpoint", "study", "a dense amod .safetensors file")
        check_settings(self, ("seeds", "epochs", "batch_size", "loo_images", "loo_tokens"), ("train_limit", "val_limit"))
        return self


def run_study(cfg: StudyConfig) -> Path:
    """Run (or reuse) every run of the grid and write the report; returns the path of study.md."""
    cfg.validate()
    return run_in_directory(cfg.out, cfg.data, lambda root: _run_study(cfg, root))


def _run_study(cfg: StudyConfig, root: Path) -> Path:
    pretrained = starting_checkpoint(cfg, root)

    _, val, info = build_datasets(cfg.data, None, None, cfg.val_limit)
    runs: dict[tuple[str, float], list[Path]] = {}
    total = len(VARIANTS) * len(cfg.capacities) * cfg.seeds
    done = 0
    for capacity in cfg.capacities:
        for v in VARIANTS:
            for seed in range(cfg.seeds):
                done += 1
                out = root / f"c{capacity:g}" / f"{run_dir_name(v.name)}_s{seed}"
                log.info("[%d/%d] %s at capacity %g, seed %d", done, total, v.name, capacity, seed)
                method = dataclasses.replace(v.method, capacity=capacity)
                run_cfg = RunConfig(model=BASE["model"], checkpoint=str(pretrained), data=cfg.data,
                                    method_spec=method.spec(), seed=seed, epochs=cfg.epochs, train_limit=cfg.train_limit, val_limit=cfg.val_limit,
                                    lr=cfg.lr, batch_size=cfg.batch_size, warmup_epochs=0.2,
                                    eval_before_training=True, out=str(out))
                run_once(run_cfg)
                _save_correctness(out, val)
                runs.setdefault((v.name, capacity), []).append(out)
    return write_study_report(root, cfg, runs, pretrained, val, info)


@torch.no_grad()
def _save_correctness(run: Path, val) -> np.ndarray:
    """Per-image correctness of a run's final model on the validation set (cached in the run)."""
    path = run / "correct.npy"
    if path.exists():
        return np.load(path)
    model = load(run / "model.safetensors").eval()
    loader = engine.make_loader(val, 256, False, 0, 0, engine.Dist())
    correct = torch.cat([model(x).argmax(1).eq(y) for x, y in engine.image_batches(loader)]).numpy().astype(np.float32)
    atomic_write(path, lambda f: np.save(f, correct))
    return correct


def _target_epoch(rows: list[dict[str, Any]], target: float) -> Optional[int]:
    return next((r["epoch"] for r in rows if r.get("val_top1", 0) >= target), None)


def write_study_report(root: Path, cfg: StudyConfig, runs: dict[tuple[str, float], list[Path]], pretrained: Path,
                       val, info) -> Path:
    lines = [f"# amod study: routers x capacities x {cfg.seeds} seeds on {info.name}" + (" (quick)" if cfg.quick else ""), "",
             f"Every variant finetuned from `{pretrained}` for {cfg.epochs} epochs on "
             f"{cfg.train_limit or 'all'} training images (lr {cfg.lr:g}); validation: {len(val)} images. "
             "MoD on alternate blocks. Pairs share the seed.", ""]
    summary: dict[str, Any] = {"config": cfg.__dict__ | {"capacities": list(cfg.capacities)}, "capacities": {}}
    for capacity in cfg.capacities:
        names = [v.name for v in VARIANTS if (v.name, capacity) in runs]
        metrics = {n: [engine.read_metrics(p / "metrics.jsonl") for p in runs[(n, capacity)]] for n in names}
        finals = {n: np.array([m[-1]["val_top1"] for m in metrics[n]]) for n in names}
        zeros = {n: np.array([m[0]["val_top1"] for m in metrics[n]]) for n in names}
        correct = {n: np.stack([_save_correctness(p, val) for p in runs[(n, capacity)]]) for n in names}
        ref_final = mean_std(finals[REFERENCE])[0]
        target = ref_final - 0.01
        lines += [f"## Capacity {capacity:g}", "",
                  "| variant | zero-training top-1 | final top-1 (mean ± std) | A-MoD − variant [95 % CI] | "
                  f"epochs to {100 * target:.1f} % | ÷ A-MoD's |", "|---|---|---|---|---|---|"]
        cap_summary = {}
        ref_reached = [e for e in (_target_epoch(m, target) for m in metrics[REFERENCE]) if e is not None]
        for n in names:
            m, s = mean_std(finals[n])
            z = mean_std(zeros[n])[0]
            ci = None if n == REFERENCE else paired_bootstrap_ci(correct[REFERENCE], correct[n], n_boot=1000 if cfg.quick else 4000)
            epochs = [_target_epoch(m, target) for m in metrics[n]]
            reached = [e for e in epochs if e is not None]
            ep = f"{np.mean(reached):.1f} ({len(reached)}/{len(epochs)} seeds)" if reached else "not reached"
            # epochs are counted on seeds that reached the target; 0 epochs (already there) has no ratio
            ratio = (f"{np.mean(reached) / np.mean(ref_reached):.2f}x"
                     if reached and ref_reached and np.mean(ref_reached) > 0 else "–")
            ci_text = "—" if ci is None else f"{100 * ci.mean:+.2f} [{100 * ci.low:+.2f}, {100 * ci.high:+.2f}]"
            lines.append(f"| {n} | {100 * z:.2f} | {100 * m:.2f} ± {100 * s:.2f} | {ci_text} | {ep} | {ratio} |")
            cap_summary[n] = {"final_mean": m, "final_std": s, "zero_mean": z, "finals": finals[n].tolist(),
                              "diff_vs_reference": None if ci is None else ci.__dict__, "epochs_to_target": epochs}
        lines += ["", "The confound (review objection 1): routing source x output scaling, final top-1 %:", "",
                  "| | unscaled | scaled |", "|---|---|---|"]
        for label, unscaled, scaled in (("attention (A-MoD)", "A-MoD", "A-MoD scaled"),
                                        ("learned (standard)", "MoD unscaled (STE)", "MoD")):
            cells = [f"{100 * mean_std(finals[x])[0]:.2f} ± {100 * mean_std(finals[x])[1]:.2f}" if x in finals else "–"
                     for x in (unscaled, scaled)]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
        curves = {n: _mean_curve(metrics[n]) for n in names}
        png = accuracy_vs_epoch(curves, root / f"convergence_c{capacity:g}.png",
                                f"Finetuning at capacity {capacity:g} (mean over seeds)")
        lines += ["", f"![convergence]({png.name})", ""]
        cap_summary["analyses"] = _analyses(root, capacity, runs, val, cfg, lines)
        summary["capacities"][str(capacity)] = cap_summary
    report = root / "study.md"
    write_text(report, "\n".join(lines) + "\n")
    write_text(root / "study.json", dumps(summary, indent=2, default=float))
    log.info("study report written to %s", report)
    return report


def _mean_curve(metrics: list[list[dict[str, Any]]]) -> tuple[list[int], list[float]]:
    epochs = [r["epoch"] for r in metrics[0]]
    return epochs, [float(np.mean([m[i]["val_top1"] for m in metrics])) for i in range(len(epochs))]


def _analyses(root: Path, capacity: float, runs, val, cfg: StudyConfig, lines: list[str]) -> dict[str, Any]:
    """Leave-one-out, attention sinks and routing pictures for seed 0 of A-MoD and MoD."""
    xs, ys = first_images(val, cfg.loo_images)
    n = len(ys)
    out: dict[str, Any] = {}
    lines += ["Leave-one-out importance inside the trained MoD model (review objection 3): Spearman correlation "
              f"between the router's scores and the loss increase when a patch token is removed at that layer "
              f"({n} images, {cfg.loo_tokens} tokens each), against random scores:", "",
              "| variant | block | router ρ | random ρ | attention entropy / max | top-token share |", "|---|---|---|---|---|---|"]
    for name in ("A-MoD", "MoD"):
        if (name, capacity) not in runs:
            continue
        model = load(runs[(name, capacity)][0] / "model.safetensors").eval()
        loo = leave_one_out(model, xs, ys, tokens=cfg.loo_tokens)
        att = attention_stats(model, xs)
        for layer, r in loo["layers"].items():
            a = att[layer - 1]  # the attention the router of this block reads (A-MoD) / the block before
            lines.append(f"| {name} | {layer} | {r['router']:+.3f} | {r['random']:+.3f} | "
                         f"{a['entropy'] / a['max_entropy']:.3f} | {a['top_token_share']:.3f} |")
        png = routing_figure(model, xs[:4], root / f"routing_{run_dir_name(name)}_c{capacity:g}.png",
                             mean=(FASHION_MNIST_MEAN,), std=(FASHION_MNIST_STD,))
        out[name] = {"loo": {k: {kk: vv for kk, vv in v.items()} for k, v in loo["layers"].items()},
                     "attention": att, "routing_png": png.name}
    lines += ["", "Attention entropy is that of the block before (the attention A-MoD reads), normalised by log N; "
              "the top-token share is the mean received attention of the most-attended token (attention sinks: "
              "near 1).", ""]
    for name in out:
        lines += [f"![routing {name}]({out[name]['routing_png']})", ""]
    return out
