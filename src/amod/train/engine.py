"""Training engine: the one training loop (``train_steps``) and AdamW's parameter groups (``param_groups``) that
``amod train``/``finetune``, the finetune study and ``amod detect train`` share; warm-up + cosine schedule, label
smoothing, clipping, gradient accumulation, bf16 autocast, DDP, losses read back to the host every N steps (not each
step), per-epoch metrics (the training state a run resumes from is ``train.resume``'s).

One process or many (``torchrun``): everything rank-dependent goes through ``Dist``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler

from .. import files
from .data import BadSample, DataError, collate_checked
from .distill import Distillation, Teacher, training_loss
from .resume import (TRAINING_CHECKPOINT_KEYS, load_training_checkpoint, rng_state, router_state,  # noqa: F401
                     set_rng_state, set_router_state)  # (the one format of training state; named here too)
from ..errors import USER_ERRORS, UserError

log = logging.getLogger("amod")


class NonFiniteError(UserError, RuntimeError):
    """Training produced a NaN or infinite loss, or weights that are no longer finite."""


# ---------------------------------------------------------------- processes

@dataclass
class Dist:
    """This process's place among ``world`` processes (1 when not under torchrun)."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Sum numbers across processes."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()


def world_size() -> int:
    """How many processes torchrun started for this run (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class RefusedOnEveryProcess(Exception):
    """A run every torchrun process refused alike, before the processes met (``cause``: the refusal). The CLI
    prints it once (rank 0) and every process exits with status 0: torchrun turns any other exit status of its
    processes into a traceback of its own, after the one line."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@contextmanager
def refused_alike(world: int) -> Iterator[None]:
    """Under torchrun (``world`` > 1), a user's error raised inside (checks every process makes on the same
    settings, files and data) as ``RefusedOnEveryProcess``; without torchrun as it is."""
    try:
        yield
    except USER_ERRORS as e:
        if world > 1:
            raise RefusedOnEveryProcess(e) from e
        raise


def setup_distributed() -> Dist:
    """Join the process group that torchrun describes (gloo on the CPU, NCCL on GPUs)."""
    world = world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world == 1:
        return Dist(0, 1, device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), world, device)


def teardown_distributed() -> None:
    """Leave the process group cleanly: wait for every rank, then destroy it (its threads must not
    outlive the interpreter, or a rank can abort at exit)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------- schedule and RNG

def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.01) -> Callable[[int], float]:
    """Learning-rate multiplier: linear from ~0 to 1 over warm-up, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- loops

AMP_MODES = ("off", "bf16")  # what --amp takes


def autocast(amp: str, device: torch.device):
    """``--amp``: bf16 autocast on ``device``, or nothing."""
    if amp == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


class BadImages:
    """Unreadable images met by the loops of one run: stop at the first, or skip and remember them."""

    def __init__(self, skip: bool = False) -> None:
        self.skip = skip
        self.paths: dict[str, str] = {}  # path -> error

    def check(self, bad: list[BadSample]) -> None:
        if not bad:
            return
        if not self.skip:
            raise DataError(f"cannot read image {bad[0].path} ({bad[0].error}); remove or replace it, "
                            "or pass --skip-bad-images to skip unreadable images")
        for b in bad:
            if b.path not in self.paths:
                log.warning("skipping unreadable image %s (%s)", b.path, b.error)
                self.paths[b.path] = b.error


def image_batches(loader: Iterable, bad_images: Optional[BadImages] = None) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) batches of a ``make_loader`` loader; unreadable images go to ``bad_images`` (default: stop)."""
    bad_images = bad_images if bad_images is not None else BadImages()
    for x, y, bad in loader:
        bad_images.check(bad)
        if len(y):
            yield x, y


def progress_bar(iterable: Iterable, total: int, desc: str, enabled: bool = True):
    """``iterable`` with a progress bar named ``desc`` where stderr is a terminal (a log file gets the log lines)."""
    if enabled and sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
    return iterable


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, device: torch.device, amp: str = "off",
             dist_info: Optional[Dist] = None, progress: bool = True,
             bad_images: Optional[BadImages] = None) -> dict[str, float]:
    """Top-1/top-5 accuracy, mean cross-entropy and model images/s over ``loader`` (a ``make_loader``)."""
    dist_info = dist_info or Dist()
    model.eval()
    # summed on the device and read back once, after the last batch (a read per batch waits for each forward):
    # in float64, as the per-batch Python floats it replaces summed them, so the metrics are the same bits
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # the loss, top-1 hits, top-5 hits
    n = 0
    model_time = 0.0
    batches = progress_bar(image_batches(loader, bad_images), len(loader), "eval", progress and dist_info.main)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if device.type == "cuda":  # (the timing of the forward alone waits for it)
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast(amp, device):
            logits = model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        model_time += time.perf_counter() - start
        logits = logits.float()
        topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
        sums += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(),
                             (topk[:, 0] == y).sum().double(), (topk == y[:, None]).any(dim=1).sum().double()])
        n += len(y)
    loss, top1, top5 = sums.tolist()  # the evaluation's one read back to the host
    loss, top1, top5, n, model_time = dist_info.sum([loss, top1, top5, float(n), model_time])
    if n == 0:
        raise UserError("the evaluation set is empty")
    return {"loss": loss / n, "top1": top1 / n, "top5": top5 / n, "images": int(n),
            "images_per_s": n / max(model_time, 1e-9)}


def param_groups(model: nn.Module, weight_decay: float, router_lr: Optional[float] = None) -> list[dict[str, Any]]:
    """AdamW's parameter groups for every training run (``amod train``/``finetune``, the finetune study, ``amod
    detect train``): ``weight_decay`` on the weight matrices, none on biases, norms, position embeddings and tokens
    (the usual ViT recipe), each group in ``named_parameters`` order; frozen parameters are left out.

    ``router_lr``: the routers' parameters (every ``amod.mod.routers.Router`` submodule's: a learned router's) get
    groups of their own with this peak learning rate, the same decay rule and the same schedule (a scheduler
    multiplies each group's own rate). A router learned from scratch, or a hybrid correction that starts at zero,
    moves only about lr per AdamW step, so a backbone's finetuning rate (3e-5) leaves it where it started.
    A ``UserError`` when the model has no trainable router parameter; None (the default): two groups as above."""
    from ..mod.routers import Router  # (the training engine does not otherwise depend on the MoD package)

    routed = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters() if p.requires_grad}
    if router_lr is not None and not routed:
        raise UserError("--router-lr is for a learned router (standard, hybrid); this model has no router "
                        "parameters to train")
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {(r, d): [] for r in (False, True) for d in (True, False)}
    for name, p in model.named_parameters():
        if p.requires_grad:
            skip = p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "dist_token", "reg_token"))
            groups[router_lr is not None and id(p) in routed, not skip].append(p)
    out = [{"params": groups[False, True], "weight_decay": weight_decay},
           {"params": groups[False, False], "weight_decay": 0.0}]
    if router_lr is not None:
        out += [{"params": params, "weight_decay": weight_decay if decay else 0.0, "lr": router_lr}
                for decay in (True, False) if (params := groups[True, decay])]
    return out


@dataclass
class StepLoss:
    """What a loss function gives ``train_steps`` for one batch."""

    loss: torch.Tensor  # the scalar the step minimises
    images: int  # the batch's size
    correct: Optional[torch.Tensor] = None  # a classifier's right top-1 answers in the batch (0-dim), else None


# loss_fn(model, batch, step) -> StepLoss; ``step``: how many steps the run has done before this one
LossFn = Callable[[nn.Module, Any, int], StepLoss]


@dataclass
class Report:
    """The steps since the previous report, read back from the device together (``train_steps``' ``on_report``)."""

    losses: list[float]  # each step's loss, in order (with gradient accumulation: the mean of its batches' losses)
    images: list[int]  # each step's images
    correct: Optional[list[int]] = None  # each step's right top-1 answers (a classifier's loss function), else None


def classification_loss(device: torch.device, distillation: Optional[Distillation] = None,
                        teacher: Optional[Callable] = None, label_smoothing: float = 0.0) -> LossFn:
    """The loss function of (x, y) batches: the labels' cross-entropy, or with ``distillation`` its loss against
    ``teacher`` (``distill.training_loss``); it moves the batch to ``device`` and counts the right answers."""

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> StepLoss:
        x, y = batch
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss, logits = training_loss(model, x, y, distillation, teacher, label_smoothing)
        return StepLoss(loss, len(y), (logits.argmax(1) == y).sum())

    return loss_fn


class _Pending:
    """The statistics of the steps not yet reported, kept on the device until ``read`` brings them back at once."""

    def __init__(self, first: int) -> None:
        self.first = first  # the steps done before the first of them
        self.losses: list[torch.Tensor] = []
        self.correct: list[torch.Tensor] = []
        self.images: list[int] = []

    def add(self, loss: torch.Tensor, images: int, correct: Optional[torch.Tensor]) -> None:
        self.losses.append(loss)
        self.images.append(images)
        if correct is not None:
            self.correct.append(correct)

    def read(self) -> Report:
        """The steps' numbers on the host: one transfer (float64 holds a float32 loss and a count exactly)."""
        values = torch.stack(self.losses).double()
        counted = len(self.correct) == len(self.losses)
        if counted:
            values = torch.cat([values, torch.stack(self.correct).double()])
        values = values.tolist()
        n = len(self.losses)
        return Report(values[:n], self.images, [int(c) for c in values[n:]] if counted else None)


def train_steps(model: nn.Module, batches: Iterable[Any], optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, loss_fn: LossFn, *, device: torch.device,
                amp: str = "off", clip_grad: float = 0.0, grad_accum: int = 1, step: int = 0,
                steps: Optional[int] = None, report_every: int | Callable[[int], bool] = 1,
                before_step: Optional[Callable[[int], None]] = None,
                on_report: Optional[Callable[[int, Report], None]] = None,
                non_finite_message: Optional[Callable[[float, int], str]] = None) -> int:
    """The training loop of every run: one optimizer step per ``grad_accum`` batches of ``batches``, until they end
    or the run has done ``steps``; returns how many steps the run has done.

    A step: ``before_step(step)``; then for each of its ``grad_accum`` batches ``loss_fn(model, batch, step)`` under
    ``amp``'s autocast and the backward of its loss / ``grad_accum`` (the first batch's after zeroing the gradients;
    under DDP the gradients are averaged across processes with the last batch's backward only); clip the accumulated
    gradients' norm to ``clip_grad`` (0: no clipping), ``optimizer.step()``, ``scheduler.step()`` (the schedule counts
    optimizer steps). Batches that end the data short of a whole step are left out of it. The order is fixed: a
    resumed run (the states restored, ``step`` = the steps done) consumes the random numbers and steps as an
    unbroken one.

    The steps' losses stay on the device, with no host sync between reports: after the steps ``report_every`` names
    and after the last, they are read back at once, checked, and given to ``on_report(steps done, Report)``, where a
    run logs, evaluates and saves. A non-finite loss raises ``NonFiniteError`` at the report that reads it
    (``non_finite_message(loss, step number)`` names the first such step; the steps after it have run, so nothing of
    them may be saved: save in ``on_report``), or at an error inside a later step, which it then explains.

    Args:
        model: the model in training (a ``DistributedDataParallel`` under torchrun; gradient checkpointing is the
            model's own, ``set_grad_checkpointing``). Set to train mode here.
        batches: what ``loss_fn`` takes, ``grad_accum`` per step; drawn only while a step is left to run.
        loss_fn: the batch's loss (``classification_loss``, the finetune study's, DETR's set loss).
        grad_accum: batches per optimizer step (gradient accumulation), at least 1.
        step: the steps the run has done before this call (the learning-rate schedule's position).
        steps: the run's last step (None: as many as ``batches`` holds).
        report_every: report every N steps (counted from ``step``), or after the steps done for which
            ``report_every(steps done)`` is true.
        before_step: called with the steps done before each step (an any-cost run sets the step's capacity).
        on_report: called at each report, after the non-finite check.
    """
    if grad_accum < 1:
        raise UserError(f"grad_accum must be at least 1, got {grad_accum}")
    if not callable(report_every) and report_every < 1:
        raise UserError(f"report_every must be at least 1 step, got {report_every}")
    due = report_every if callable(report_every) else (lambda done, start=step: (done - start) % report_every == 0)
    no_sync = getattr(model, "no_sync", None)  # DDP: no all-reduce in the backward of all but a step's last batch
    model.train()
    pending = iter(batches)
    unread = _Pending(step)

    def report() -> None:
        nonlocal unread
        if not unread.losses:
            return
        got, first = unread.read(), unread.first
        unread = _Pending(first + len(got.losses))
        _check_finite(got, first, non_finite_message)
        if on_report is not None:
            on_report(first + len(got.losses), got)

    try:
        while steps is None or step < steps:
            batch = next(pending, _END)
            if batch is _END:
                break
            if before_step is not None:
                before_step(step)
            loss = correct = None
            images = 0
            for i in range(grad_accum):
                if i:
                    batch = next(pending, _END)
                    if batch is _END:
                        break
                with no_sync() if no_sync is not None and i < grad_accum - 1 else nullcontext():
                    with autocast(amp, device):
                        out = loss_fn(model, batch, step)
                    part = out.loss if grad_accum == 1 else out.loss / grad_accum
                    if i == 0:
                        optimizer.zero_grad(set_to_none=True)
                    part.backward()
                loss = part.detach() if loss is None else loss + part.detach()
                if out.correct is not None:
                    correct = out.correct if correct is None else correct + out.correct
                images += out.images
            else:
                if clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
                optimizer.step()
                scheduler.step()
                step += 1
                unread.add(loss, images, correct)
                if due(step):
                    report()
                continue
            optimizer.zero_grad(set_to_none=True)  # the batches ended inside a step: it is not taken
            break
        report()
    except NonFiniteError:
        raise
    except Exception as error:  # a step after a non-finite loss can fail on it (a matching of NaN boxes)
        try:
            got = unread.read() if unread.losses else None
        except Exception:
            got = None
        if got is not None:
            _check_finite(got, unread.first, non_finite_message, cause=error)
        raise
    return step


def _check_finite(got: Report, first: int, message: Optional[Callable[[float, int], str]],
                  cause: Optional[BaseException] = None) -> None:
    """Raise ``NonFiniteError`` naming the first step of ``got`` (the steps after ``first``) whose loss is not
    finite."""
    for i, value in enumerate(got.losses):
        if not math.isfinite(value):
            message = message or (lambda value, n: f"the training loss is {value} at step {n}")
            raise NonFiniteError(message(value, first + i + 1)) from cause


_END = object()  # what next() returns at the end of the batches


def train_one_epoch(model: nn.Module, loader: Iterable, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: Any, dist_info: Dist,
                    epoch: int, bad_images: Optional[BadImages] = None, teacher: Optional[Teacher] = None,
                    dial: Optional[Callable[[int], None]] = None) -> dict[str, float]:
    """One epoch of ``loader`` (a ``make_loader``) through ``train_steps``: ``steps_per_epoch`` optimizer steps of
    ``cfg.grad_accum`` batches, with progress, and its metrics summed over the processes. The loss comes back to
    the host four times an epoch (the progress and log lines) and at its end. ``teacher``: distil from it with
    ``cfg.distillation()``; ``dial``: called with the run's step before each step (an any-cost run sets the step's
    capacity)."""
    distillation = cfg.distillation() if teacher is not None else None
    loss_fn = classification_loss(dist_info.device, distillation, teacher, cfg.label_smoothing)
    first = scheduler.last_epoch  # the steps of earlier epochs: one scheduler step per training step
    steps = steps_per_epoch(len(loader), cfg.grad_accum)
    loss_sum = correct = n = 0.0
    start = time.perf_counter()
    batches = progress_bar(image_batches(loader, bad_images), steps * cfg.grad_accum, f"epoch {epoch}/{cfg.epochs}",
                            dist_info.main)
    log_every = max(1, steps // 4)

    def on_report(done: int, report: Report) -> None:
        nonlocal loss_sum, correct, n
        for loss, images, right in zip(report.losses, report.images, report.correct):
            loss_sum += loss * images
            correct += right
            n += images
        k = done - first  # steps of this epoch
        if hasattr(batches, "set_postfix"):
            elapsed = time.perf_counter() - start
            batches.set_postfix(loss=f"{loss_sum / n:.3f}", acc=f"{correct / n:.3f}", img_s=f"{n * dist_info.world / elapsed:.0f}")
        elif dist_info.main and k % log_every == 0 and k < steps:
            elapsed = time.perf_counter() - start
            left = elapsed / k * (steps - k)
            log.info("epoch %d step %d/%d loss %.4f acc %.4f %.0f img/s, %.0fs left in epoch", epoch, k,
                     steps, loss_sum / n, correct / n, n * dist_info.world / elapsed, left)

    train_steps(model, batches, optimizer, scheduler, loss_fn, device=dist_info.device, amp=cfg.amp,
                clip_grad=cfg.clip_grad, grad_accum=cfg.grad_accum, step=first, steps=first + steps,
                report_every=log_every, before_step=dial, on_report=on_report,
                non_finite_message=lambda value, done: f"the training loss is {value} at epoch {epoch}, step "
                                                       f"{done - first}; lower --lr, or check the data")
    elapsed = time.perf_counter() - start
    loss_sum, correct, n = dist_info.sum([loss_sum, correct, n])
    if n == 0:
        skipped = f" ({len(bad_images.paths)} unreadable images skipped so far)" if bad_images and bad_images.paths else ""
        raise DataError(f"no training image could be read in epoch {epoch}{skipped}; "
                        "replace or remove the unreadable files of the training set")
    return {"train_loss": loss_sum / n, "train_acc": correct / n, "train_images_per_s": n / elapsed,
            "epoch_time_s": elapsed, "lr": scheduler.get_last_lr()[0]}


def steps_per_epoch(batches: int, grad_accum: int) -> int:
    """The optimizer steps of an epoch of ``batches`` batches: the last ``batches % grad_accum`` are left out, as a
    loader leaves out the last partial batch."""
    return batches // grad_accum


class ShardSampler(Sampler[int]):
    """Every ``world``-th index from ``rank``, without padding: across ranks each image appears once.

    (``DistributedSampler`` pads the last shard with repeated images, which would count some
    validation images twice.)
    """

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.indices = range(rank, length, world)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(ds: Dataset, batch_size: int, train: bool, seed: int, epoch: int, dist_info: Dist,
                workers: int = 0) -> DataLoader:
    """Loader of (x, y, unreadable samples) batches whose order depends only on (seed, epoch), so a
    resumed run sees the same batches. Iterate it with ``image_batches``."""
    if dist_info.world > 1 and train:
        sampler = DistributedSampler(ds, dist_info.world, dist_info.rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
    elif dist_info.world > 1:
        sampler = ShardSampler(len(ds), dist_info.rank, dist_info.world)
    elif train:
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(seed * 10_007 + epoch))
    else:
        sampler = None
    # drop the last partial batch only when a full one is left: each process must get at least one batch
    images = len(sampler) if sampler is not None else len(ds)  # this process's share
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, shuffle=False, drop_last=train and images >= batch_size,
                      num_workers=workers, pin_memory=dist_info.device.type == "cuda", persistent_workers=False,
                      collate_fn=collate_checked)


class MetricsWriter:
    """metrics.jsonl (one object per epoch), metrics.csv beside it, TensorBoard when installed.

    Non-finite numbers are ``null`` in the JSON and empty cells in the CSV.
    """

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out, self.enabled, self.tb = out, enabled, None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tb"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def clear(self) -> None:
        """A new run: forget the rows of an earlier attempt that was killed before its first checkpoint."""
        if self.enabled:
            for name in ("metrics.jsonl", "metrics.csv"):
                (self.out / name).unlink(missing_ok=True)

    def truncate_after(self, epoch: int) -> None:
        """On resume, forget rows from epochs the checkpoint does not cover (a run killed between
        writing an epoch's row and its checkpoint)."""
        path = self.out / "metrics.jsonl"
        if not self.enabled or not path.exists():
            return
        files.write_together(self._contents([r for r in read_metrics(path) if r["epoch"] <= epoch]))

    def updates(self, row: dict[str, Any]) -> list[tuple[Path, Callable[[BinaryIO], Any]]]:
        """metrics.jsonl and metrics.csv with ``row`` appended, as writes for ``files.write_together``
        (none when this process does not write them)."""
        if not self.enabled:
            return []
        path = self.out / "metrics.jsonl"
        rows = read_metrics(path) if path.exists() else []
        return self._contents([*rows, json.loads(files.dumps(row))])  # non-finite values as null, as read back

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` to the metrics files (and TensorBoard)."""
        files.write_together(self.updates(row))
        self.log_scalars(row)

    def log_scalars(self, row: dict[str, Any]) -> None:
        """``row``'s numbers to TensorBoard, when installed."""
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "epoch":
                    self.tb.add_scalar(k, v, row["epoch"])

    def _contents(self, rows: list[dict[str, Any]]) -> list[tuple[Path, Callable[[BinaryIO], Any]]]:
        jsonl = "".join(files.dumps(r) + "\n" for r in rows).encode()
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "epoch", k))
        # a null (a non-finite number in the JSON) or a missing value is an empty cell, as CSV readers expect
        lines = [",".join(keys)] + [",".join("" if r.get(k) is None else str(r[k]) for k in keys) for r in rows]
        csv = ("\n".join(lines) + "\n").encode()
        return [(self.out / "metrics.jsonl", lambda f: f.write(jsonl)), (self.out / "metrics.csv", lambda f: f.write(csv))]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file; a line that is not JSON is an error naming the file and the line."""
    rows = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise UserError(f"{path} line {number} is not JSON ({line[:60]!r}); the run's metrics are damaged: "
                                "restore the file or start a new run") from None
    return rows
