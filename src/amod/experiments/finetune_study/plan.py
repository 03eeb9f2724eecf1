"""The finetune study's arms, settings and plan: what ``amod study --checkpoint`` runs at each cost
(``ARMS``, ``FinetuneConfig``) and each arm's matched setting (``plan``). Running them is ``study``; the
report is ``report``."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
from torch import nn

from ...checkpoint import load_weightless
from ...cost import misses_cost, same_cost, validate_cost
from ...family import family_of
from ...methods import Dense, Method
from ...mod.calibrate import Calibrated
from ...mod.convert import MoD
from ...mod.isoflop import IsoFLOP
from ...tome.merging import TokenMerging
from ...train.distill import Distillation
from ..arms import Arm, refuse_own_costs, select
from ...errors import UserError
from ...flags import flag, flag_of, positive_int

if TYPE_CHECKING:
    from .rows import EvalRows


REFERENCE = "A-MoD (paper)"
DENSE = "dense"
CALIBRATED = "calibrated, nothing protected"
ANY_COST = "any-cost A-MoD fold + distillation"
LONG_STEPS = 1024
HYBRID, HYBRID_STE = "hybrid", "hybrid unscaled (STE)"
# A router that starts from zero (the hybrid's correction) or from a random draw (standard MoD's) moves about lr per
# AdamW step: at the backbone's 3e-5 the hybrid's correction stays within 0.0075 of zero in 256 steps and routes as
# A-MoD. These arms give the router's parameters a rate of their own (the rest keeps the study's).
ROUTER_LR = 1e-3
STANDARD_FAST, HYBRID_STE_FAST = (f"{name}, router lr {ROUTER_LR:g}" for name in ("standard MoD", HYBRID_STE))
# the arms whose finetuned models leave-one-out judges (``loo``): their seed-0 weights are kept
LOO_ARMS = (REFERENCE, "standard MoD", HYBRID, HYBRID_STE, STANDARD_FAST, HYBRID_STE_FAST, "random")
CALIBRATION_IMAGES = 256  # the first of the probe's training images (labels unread)
# The study's arms (``arms.Arm``), in the report's order (``--methods`` picks some by name).
ARMS = (
    Arm(DENSE, Dense()),
    Arm(REFERENCE, MoD(router="attention", scale_output=False), every_block_below=True),
    Arm("standard MoD", MoD(router="standard", scale_output=True), every_block_below=True),
    Arm("A-MoD scaled", MoD(router="attention", scale_output=True), every_block_below=True),
    Arm("standard MoD unscaled (STE)", MoD(router="standard", scale_output=False), every_block_below=True),
    # the review's hybrid router (A-MoD's attention times a learned correction that starts at 1), both output rules
    Arm(HYBRID, MoD(router="hybrid", scale_output=True), every_block_below=True, counterpart="standard MoD"),
    Arm(HYBRID_STE, MoD(router="hybrid", scale_output=False), every_block_below=True, counterpart="standard MoD"),
    Arm(STANDARD_FAST, MoD(router="standard", scale_output=True), every_block_below=True, counterpart="standard MoD",
        router_lr=ROUTER_LR),
    Arm(HYBRID_STE_FAST, MoD(router="hybrid", scale_output=False), every_block_below=True, counterpart=STANDARD_FAST,
        router_lr=ROUTER_LR),
    Arm("random", MoD(router="random", scale_output=False), every_block_below=True),
    Arm("isoFLOP dense", IsoFLOP(), isoflop_of=REFERENCE),
    Arm("ToMe", TokenMerging()),
    Arm("A-MoD fold", MoD(skipped="fold")),
    # the frontier's best zero-training mode: fold on the schedule amod.calibrate picks, nothing protected
    Arm(CALIBRATED, Calibrated(protects=(0.0,))),
    # with distillation from the dense teacher
    Arm("A-MoD fold + distillation", MoD(skipped="fold"), distill=True, counterpart="A-MoD fold"),
    Arm("ToMe + distillation", TokenMerging(), distill=True, counterpart="ToMe"),
    Arm(f"{CALIBRATED} + distillation", Calibrated(protects=(0.0,)), distill=True, counterpart=CALIBRATED),
    Arm(f"{REFERENCE} + distillation", MoD(router="attention", scale_output=False), every_block_below=True,
        distill=True, counterpart=REFERENCE),
    # one finetune that serves every cost
    Arm(ANY_COST, MoD(skipped="fold"), distill=True, any_cost=(0.35, 0.9), counterpart="A-MoD fold + distillation"),
    # the 4x longer schedule, one seed
    Arm(f"{DENSE}, {LONG_STEPS} steps", Dense(), steps=LONG_STEPS, only_seeds=1, counterpart=DENSE),
    Arm(f"best distilled, {LONG_STEPS} steps", None, steps=LONG_STEPS, only_seeds=1,
        best_of=("A-MoD fold + distillation", "ToMe + distillation", f"{CALIBRATED} + distillation")),
    Arm(f"{REFERENCE}, {LONG_STEPS} steps", MoD(router="attention", scale_output=False), every_block_below=True,
        steps=LONG_STEPS, only_seeds=1, counterpart=REFERENCE),
)
TEACHER = "dense (teacher)"  # the dense run of seed 0 again, its final weights kept: the distilled arms' teacher


@dataclass
class FinetuneConfig:
    # (the comments of the fields `amod study` takes are their flags' help: amod.flags)
    checkpoint: str
    out: str = "runs/finetune"
    data: str = "fashion-mnist"
    img_size: int = flag(112, type=positive_int)
    costs: tuple[float, ...] = flag((0.56, 0.40), flag="cost")  # cost points, shares of dense MACs
    seeds: int = flag(3, type=positive_int)
    steps: int = flag(256, type=positive_int)  # finetuning steps of every run
    batch_size: int = flag(32, type=positive_int)
    lr: float = 3e-5
    weight_decay: float = 0.05
    warmup: float = 0.1  # share of the steps
    eval_at: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)  # shares of the steps (step 0 is always evaluated)
    eval_images: int = flag(2000, type=positive_int, flag="val-limit", aliases=("eval-images",))  # the fixed test
                                                                                                  # subset every
                                                                                                  # evaluation uses
    probe_train: int = flag(3000, type=positive_int)  # training images the linear probe (the starting head) is fitted
                                                      # on
    # (off: bf16 autocast is ~20x slower than fp32 on a CPU without bf16 instructions, AVX2)
    amp: str = flag("off", choices=("bf16", "off"))
    fp32_check: bool = flag(True, negate=True)  # the one fp32 dense run (seed 0) that checks bf16 (with --amp bf16)
    arms: tuple[Arm, ...] = field(default=ARMS)
    speed_batch: int = 32
    speed_repeats: int = 5
    # also save a run's state between its evaluations once this many seconds of training passed since the last save
    # (None: at its evaluations only), so that a kill loses at most that much of it; results do not depend on it
    state_every_s: Optional[float] = None
    report_only: bool = False  # write the report from the evaluations in OUT/evals.jsonl; train nothing
    # (a run of a LOO arm whose weights were not kept is trained again, its rows replaced by the new run's)
    leave_one_out: bool = False  # also judge the finetuned models of seed 0 and the dense one by leave-one-out
    loo_costs: tuple[float, ...] = flag((0.40,), flag="loo-cost")  # the costs whose finetuned models it judges
    loo_images: int = flag(64, type=positive_int)  # test images leave-one-out removes every patch token of
    # the distilled arms: the loss's weights, and the teacher (None: the study's dense run of seed 0, kept)
    distillation: Distillation = field(default_factory=Distillation)
    teacher: Optional[str] = None

    def only(self, names: Optional[list[str]]) -> "FinetuneConfig":
        """The same study restricted to the named arms (dense and the reference are always kept, and what a named arm
        is compared with or chosen from), and any registered method named by its kind or spec (``arms.select``)."""
        return dataclasses.replace(self, arms=select(self.arms, names, keep=(DENSE, REFERENCE)))

    def validate(self) -> "FinetuneConfig":
        if not self.costs:
            raise UserError("give at least one --cost")
        for cost in self.costs:
            validate_cost(cost, "--cost")
        refuse_own_costs(self.arms, "study", self.costs)
        for name in ("seeds", "steps", "batch_size", "eval_images", "probe_train", "img_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag_of(FinetuneConfig, name)} must be a positive integer, got {value!r}")
        if not self.eval_at or any(not 0 < f <= 1 for f in self.eval_at):
            raise UserError(f"evaluation points are shares of the steps in (0, 1], got {self.eval_at}")
        if self.amp not in ("off", "bf16"):
            raise UserError(f"--amp must be off or bf16, got {self.amp!r}")
        if not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.state_every_s is not None and not self.state_every_s >= 0:
            raise UserError(f"state_every_s must be None or at least 0 seconds, got {self.state_every_s}")
        self.distillation.validate()
        return self

    def eval_steps(self, steps: Optional[int] = None) -> list[int]:
        """The steps after which a run of ``steps`` (default the study's) is evaluated (besides step 0), ascending,
        the last one the end; a longer run is also evaluated where the study's runs are."""
        steps = steps or self.steps
        at = {max(1, math.ceil(f * steps)) for f in self.eval_at} | {steps}
        if steps > self.steps:
            at |= set(self.eval_steps())
        return sorted(at)

    def fingerprint(self, checkpoint_digest: str) -> str:
        """What a run's rows depend on besides (seed, cost, arm, amp): rows of another fingerprint are not reused."""
        fields = [checkpoint_digest, self.data, self.img_size, self.steps, self.batch_size, self.lr,
                  self.weight_decay, self.warmup, self.eval_images, self.probe_train]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Planned:
    """One (cost, arm) of the study at its matched setting."""

    arm: Arm
    cost_target: float  # 1.0 for dense
    method: Method
    cost: float  # what it reaches, as a share of dense MACs
    depth: int  # the backbone's blocks
    note: str = ""

    @property
    def setting(self) -> str:
        """What the method runs, in words: its blocks, capacity or merge schedule."""
        m = self.method
        if isinstance(m, Dense):
            return f"all {self.depth} blocks"
        if isinstance(m, TokenMerging):
            return f"r = {list(m.r)}"
        if isinstance(m, IsoFLOP):
            return f"isoFLOP of C = {m.capacity:.3f}"
        if not isinstance(m, MoD):  # another registered method: its own words
            return m.setting_text()
        layers = list(m.layers or [])
        contiguous = len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1))
        text = f"C = {m.capacity:.3f}, blocks {f'{layers[0]}–{layers[-1]}' if contiguous else layers}"
        return text if m.skipped == "bypass" else f"{text}, {m.skipped}"


def plan(cfg: FinetuneConfig, model: nn.Module, calibrated: Optional[Callable[[float, Method], Method]] = None,
         rows: Optional["EvalRows"] = None) -> list[Planned]:
    """Every (cost, arm) at its matched setting: dense once, then each cost's reduced arms in order.

    ``calibrated(cost, method)``: a calibrated arm's method (one that ``needs_images``, e.g. ``Calibrated``) set to a
    cost on the study's calibration images (required when the study has one). A long run of
    the best arm (``Arm.best_of``) is planned once ``rows`` hold a finished run of one of its candidates."""
    depth = len(model.blocks)
    planned: list[Planned] = []
    for arm in cfg.arms:
        if arm.method == Dense():
            planned.append(Planned(arm, 1.0, Dense(), 1.0, depth))
    for cost in cfg.costs:
        resolved: dict[str, Method] = {}
        for arm in cfg.arms:
            if arm.method == Dense():
                continue
            if arm.best_of:
                best = _best_of(cfg, arm, cost, planned, rows)
                if best is not None:
                    planned.append(best)
                continue
            note = ""
            if arm.isoflop_of is not None:
                ref = resolved[arm.isoflop_of]
                method = IsoFLOP(router=ref.router, capacity=ref.capacity, layers=ref.layers)
            elif arm.needs_images:
                if calibrated is None:
                    raise UserError(f"{arm.name} needs calibration images to be planned")
                method = calibrated(cost, arm.method)
            else:
                method = arm.method.at_cost(model, cost)
                reached = method.cost_of(model)
                if arm.every_block_below and misses_cost(reached, cost):
                    wider = dataclasses.replace(arm.method, layers=tuple(range(1, depth))).at_cost(model, cost)
                    if abs(wider.cost_of(model) - cost) < abs(reached - cost):
                        method = wider
                        note = f"alternate blocks reach {reached:.3f} at best: MoD on blocks 1–{depth - 1}"
            resolved[arm.name] = method
            reached = method.cost_of(model)
            if misses_cost(reached, cost) and not note:
                note = f"closest cost it reaches is {reached:.3f}"
            planned.append(Planned(arm, cost, method, reached, depth, note))
    return planned


def _best_of(cfg: FinetuneConfig, arm: Arm, cost: float, planned: list[Planned], rows: Optional["EvalRows"]
             ) -> Optional[Planned]:
    """The long run of ``arm.best_of``'s best at ``cost``: the one its rows name once it has started, else the
    candidate with the best mean finetuned accuracy over its finished seeds; None while none has finished."""
    if rows is None:
        return None
    candidates = {p.arm.name: p for p in planned if p.cost_target == cost and p.arm.name in arm.best_of}
    started = next((r.get("of") for r in rows.rows.values() if r["method"] == arm.name
                    and same_cost(r["cost_target"], cost) and r.get("of") in candidates), None)
    if started is None:
        means = {}
        for name in candidates:
            finals = [r["top1"] for s in range(cfg.seeds) if (r := rows.get(s, cost, name, cfg.amp, cfg.steps))]
            if finals:
                means[name] = float(np.mean(finals))
        if not means:
            return None
        started = max(means, key=means.get)
    chosen = candidates[started]
    long_arm = dataclasses.replace(chosen.arm, name=arm.name, steps=arm.steps, only_seeds=arm.only_seeds,
                                   best_of=(started,), counterpart=started)
    return dataclasses.replace(chosen, arm=long_arm, note=f"the best distilled at {cost:g} after {cfg.steps} steps: "
                                                          f"{started}")


def label(p: Planned) -> str:
    return p.arm.name if p.arm.name == DENSE else f"{p.arm.name} @ {p.cost_target:g}"


FINETUNE_STUDY, ROUTER_STUDY = "finetune", "routers"  # the two studies `amod study` runs (study_for)


def study_for(checkpoint: Optional[str]) -> str:
    """Which study `amod study` runs on ``checkpoint``: ``FINETUNE_STUDY`` (``experiments.finetune_study``: the methods
    at matched costs, each finetuned, scored by a linear probe) for a backbone without classifier (its family's
    ``num_classes`` 0, e.g. DINOv2), which has no head for the routers' study to measure; ``ROUTER_STUDY`` (``experiments.router_study``:
    routers x capacities x seeds, with the model's own classifier) for a model with one, or none given (the
    demo's model)."""
    if checkpoint is None:
        return ROUTER_STUDY
    model = load_weightless(os.path.expanduser(checkpoint))
    if family_of(model).num_classes(model) == 0:
        return FINETUNE_STUDY
    return ROUTER_STUDY
