"""The training engine's loop (``amod.train.engine.train_steps``): host reads only at reports, the non-finite check
that names the first bad step, and gradient accumulation (the gradient of the batches' union, clipped once, the
schedule counting optimizer steps, DDP's all-reduce on a step's last batch only)."""
from __future__ import annotations

import collections
import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amod.train import engine
from conftest import make_model

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def host_reads_of_the_engine():
    """Count the tensor reads to the host (``.item()``, ``.tolist()``, ``bool(t)``, ...) made by engine.py itself."""
    counts = collections.Counter()
    real = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename == engine.__file__:
                counts[name] += 1
            return real[name](self, *args, **kwargs)
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        yield counts
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def linear(lr: float = 1e-2):
    """A linear classifier, its AdamW and a constant schedule."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def linear_run(losses=None, reports=None, **kwargs):
    """``train_steps`` over 8 batches of a linear classifier; ``losses``: step (from 1) -> a factor of its loss.
    Returns (steps done, the reports as (steps done, Report)), the reports also appended to ``reports``."""
    model, optimizer, scheduler = linear()
    batches = [(torch.randn(5, 4), torch.randint(3, (5,))) for _ in range(8)]
    reports = [] if reports is None else reports

    def loss_fn(model, batch, step):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if losses and step + 1 in losses:
            loss = loss * losses[step + 1]
        return engine.StepLoss(loss, len(y), (logits.argmax(1) == y).sum())

    done = engine.train_steps(model, batches, optimizer, scheduler, loss_fn, device=torch.device("cpu"),
                              on_report=lambda done, report: reports.append((done, report)), **kwargs)
    return done, reports


def test_the_losses_come_back_to_the_host_once_per_report_and_as_each_step_had_them():
    with host_reads_of_the_engine() as counts:
        done, reports = linear_run(report_every=3)
    assert done == 8 and [d for d, _ in reports] == [3, 6, 8]  # every 3 steps, and after the last
    assert sum(counts.values()) == 3, counts  # one transfer per report: none in between
    every_step = linear_run(report_every=1)[1]
    assert [r.losses[0] for _, r in every_step] == [x for _, r in reports for x in r.losses]
    assert [r.correct[0] for _, r in every_step] == [x for _, r in reports for x in r.correct]
    assert all(r.images == [5] * len(r.losses) for _, r in reports)
    chosen = linear_run(report_every=lambda done: done in (2, 7))[1]
    assert [d for d, _ in chosen] == [2, 7, 8]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_the_run_at_the_next_report_naming_its_first_step(bad):
    with pytest.raises(engine.NonFiniteError, match=f"the training loss is {bad} at step 3$"):
        linear_run({3: bad, 4: bad}, report_every=5)
    reports = []
    with pytest.raises(engine.NonFiniteError, match="at step 6$"):
        linear_run({6: bad}, reports, report_every=4)
    assert [d for d, _ in reports] == [4]  # the report of steps 5-8 raised before reaching the caller


def test_an_error_in_a_step_after_a_non_finite_loss_is_reported_as_the_divergence():
    """A step after a non-finite one may fail on its NaN weights (DETR's matching of NaN boxes): the run says where
    the loss stopped being finite, with the step's error as the cause."""
    def loss_fn(nan_at):
        def loss(model, batch, step):
            if step == 2:
                raise ValueError("cost matrix is infeasible")
            return engine.StepLoss(model(batch).sum() * (float("nan") if step == nan_at else 1.0), len(batch))
        return loss

    for nan_at, error in ((1, engine.NonFiniteError), (None, ValueError)):
        model, optimizer, scheduler = linear()
        with pytest.raises(error, match="at step 2$" if nan_at else "infeasible$") as caught:
            engine.train_steps(model, [torch.randn(2, 4)] * 4, optimizer, scheduler, loss_fn(nan_at),
                               device=torch.device("cpu"), report_every=10)
        if nan_at:  # (without a non-finite loss, the step's error is the error)
            assert isinstance(caught.value.__cause__, ValueError)


def accumulated(grad_accum: int, batch: int, clip: float):
    """A tiny ViT in float64 trained for 3 steps of ``grad_accum`` batches of ``batch`` images (the same 12 images in
    the same order), clipped at ``clip``: its weights, the reported step losses and the schedule's steps."""
    model = make_model("vit", depth=2, embed_dim=32, num_heads=2).double()
    torch.manual_seed(1)
    x, y = torch.randn(12, 3, 32, 32, dtype=torch.float64), torch.randint(10, (12,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # (AdamW's step would not see a gradient's scale)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, engine.warmup_cosine(3, 1))
    steps_seen, reports = [], []

    def loss_fn(model, b, step):
        steps_seen.append(step)
        logits = model(b[0])
        return engine.StepLoss(F.cross_entropy(logits, b[1]), len(b[1]), (logits.argmax(1) == b[1]).sum())

    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, 12, batch)]
    done = engine.train_steps(model, batches, optimizer, scheduler, loss_fn, device=torch.device("cpu"),
                              clip_grad=clip, grad_accum=grad_accum, report_every=100,
                              on_report=lambda d, r: reports.append(r))
    assert done == 3 and scheduler.last_epoch == 3 and steps_seen == [s for s in range(3) for _ in range(grad_accum)]
    return model.state_dict(), reports[0]


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_two_batches_accumulated_train_as_one_batch_of_both(clip):
    """K=2 batches of 2 images make the step K=1 makes with 4 (SGD: the loss is scaled by 1/K), and the clipping
    (1e-3: active at every step) acts on the accumulated gradient, once per step."""
    (one, one_report), (two, two_report) = accumulated(1, 4, clip), accumulated(2, 2, clip)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-12
    assert two_report.losses == pytest.approx(one_report.losses, abs=1e-12)
    assert two_report.images == one_report.images == [4, 4, 4] and two_report.correct == one_report.correct


def test_batches_that_end_the_data_inside_a_step_are_not_a_step():
    done, reports = linear_run(grad_accum=3, report_every=100)  # 8 batches: 2 steps, the last 2 batches left out
    assert done == 2 and reports[0][1].images == [15, 15]


class NoSyncCounter(nn.Module):
    """A model with DDP's ``no_sync``: how many forwards ran inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.inside, self.forwards = nn.Linear(4, 1), False, []

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, x):
        self.forwards.append(self.inside)
        return self.linear(x)


def test_under_ddp_only_the_last_batch_of_a_step_all_reduces_its_gradients():
    model = NoSyncCounter()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine.train_steps(model, [torch.randn(2, 4)] * 6, optimizer, scheduler,
                       lambda m, b, s: engine.StepLoss(m(b).sum(), len(b)), device=torch.device("cpu"), grad_accum=3)
    assert model.forwards == [True, True, False] * 2
    model.forwards.clear()
    engine.train_steps(model, [torch.randn(2, 4)] * 2, optimizer, scheduler,
                       lambda m, b, s: engine.StepLoss(m(b).sum(), len(b)), device=torch.device("cpu"))
    assert model.forwards == [False, False]


def test_grad_accum_below_one_is_refused():
    with pytest.raises(ValueError, match="grad_accum must be at least 1, got 0"):
        linear_run(grad_accum=0)


def per_batch_sums(model, loader) -> dict[str, float]:
    """``engine.evaluate``'s metrics as it summed them before: three reads back to the host per batch."""
    loss_sum = top1 = top5 = n = 0.0
    with torch.no_grad():
        for x, y in engine.image_batches(loader):
            logits = model(x).float()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
            top1 += (topk[:, 0] == y).sum().item()
            top5 += (topk == y[:, None]).any(dim=1).sum().item()
            n += len(y)
    return {"loss": loss_sum / n, "top1": top1 / n, "top5": top5 / n, "images": int(n)}


def test_evaluate_reads_back_once_and_gives_the_per_batch_sums_bit_for_bit(monkeypatch):
    """The loss and hits are summed on the device and read back after the last batch: the metrics are the same
    bits as the three reads per batch gave."""
    import timm
    from torch.utils.data import DataLoader
    from amod.train.data import TensorImages, collate_checked

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, depth=2,
                              embed_dim=16, num_heads=2, in_chans=1, num_classes=10).eval()
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randint(0, 256, (37, 28, 28), generator=g, dtype=torch.uint8), torch.arange(37) % 10
    loader = list(DataLoader(TensorImages(images, labels, False, 28), batch_size=5, collate_fn=collate_checked))
    expected = per_batch_sums(model, loader)
    reads = []
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, real=real, name=name: reads.append(name) or real(t))
    got = engine.evaluate(model, loader, torch.device("cpu"), progress=False)
    monkeypatch.undo()
    assert len(loader) == 8 and reads == ["tolist"]  # one read back for 8 batches
    assert {k: got[k] for k in expected} == expected  # exact: the same float64 sums
    assert 0 < expected["top1"] < expected["top5"] <= 1  # (not a degenerate case)
