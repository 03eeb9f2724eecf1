"""Distillation from a dense teacher (``amod.train.distill``) and the any-cost dial (``amod.train.any_cost``): the
loss, the teacher wired into `amod finetune`, every method, gradient checkpointing, the refusals. DDP and resume
after a kill of a distilled any-cost finetune: tests/test_pipeline.py; the study's distilled arms:
tests/test_finetune_study.py."""
import dataclasses
import json

import pytest
import timm
import torch
import torch.nn.functional as F
import yaml

import amod
from amod.mod.convert import MoD
from amod.tome.merging import TokenMerging
from amod.tome.pitome import PiToMe
from amod.mod.calibrate import tilt_shape
from amod.train.any_cost import AnyCost
from amod.train.config import RunConfig
from amod.train.models import build_teacher
from amod.train.distill import Distillation, Teacher, TeacherOutputs, forward_with_features
from conftest import cli_in_process

ARCH = dict(img_size=28, patch_size=7, depth=3, embed_dim=32, num_heads=2)
ARCH_FLAGS = {k: v for k, v in ARCH.items() if k != "img_size"}
DATA = ["--train-limit", "64", "--val-limit", "32", "--batch-size", "32", "--epochs", "1"]


def vit(num_classes: int = 10, in_chans: int = 1, name: str = "vit_tiny_patch16_224") -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans, **ARCH)


def test_the_loss_is_the_label_term_alone_when_the_student_matches_the_teacher():
    g = torch.Generator().manual_seed(0)
    logits, features, labels = torch.randn(8, 10, generator=g), torch.randn(8, 16, generator=g), torch.arange(8)
    d = Distillation(logits=0.7, temperature=2.0, features=1.0)
    ce = F.cross_entropy(logits, labels)
    assert torch.allclose(d.loss(logits, features, logits, features, labels), 0.3 * ce, atol=1e-6)
    other = torch.randn(8, 10, generator=g)
    kl = F.kl_div(F.log_softmax(logits / 2, -1), F.softmax(other / 2, -1), reduction="batchmean")
    cos = 1 - F.cosine_similarity(features, -features, dim=-1).mean()  # = 2
    assert torch.allclose(d.loss(logits, features, other, -features, labels), 0.3 * ce + 0.7 * 4 * kl + cos, atol=1e-5)
    for bad, message in [(dict(logits=1.5), "in [0, 1]"), (dict(temperature=0.0), "positive"),
                         (dict(logits=0.0, features=0.0), "plain finetuning"), (dict(features=-1.0), ">= 0")]:
        with pytest.raises(ValueError) as e:
            Distillation(**bad).validate()
        assert message in str(e.value)


@pytest.mark.parametrize("method", [MoD(capacity=0.5), MoD(skipped="fold", capacity=0.8, shape=tuple(tilt_shape(-1, 3))),
                                    TokenMerging(r=(3, 3, 3)), PiToMe(keep=0.8)], ids=lambda m: m.label())
def test_every_method_distils_with_the_features_its_head_reads(method):
    """What the hook captures is timm's pre-logits feature; the loss trains every parameter the label loss does,
    and with gradient checkpointing the gradients are the same."""
    teacher = Teacher(vit())
    student = method.apply(vit())
    x, y = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])
    teacher.check_student(student, x)
    logits, features = forward_with_features(student.eval(), x, True)
    assert torch.allclose(features, student.forward_head(student.forward_features(x), pre_logits=True))
    grads = []
    for checkpointing in (False, True):
        student.set_grad_checkpointing(checkpointing)
        student.zero_grad()
        logits, features = forward_with_features(student.train(), x, True)
        Distillation(features=1.0).loss(logits, features, *teacher(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "patch_embed.proj.weight" in grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])
    assert not any(p.requires_grad for p in teacher.model.parameters())


def test_a_distilled_deit_distils_through_both_heads():
    """A distilled DeiT has two classifiers (class and distillation tokens) and averages their logits: its features are
    the mean of what the two read (timm's pre-logits), as teacher and as student, and both heads learn."""
    teacher = Teacher(vit(name="deit_tiny_distilled_patch16_224"))
    student = amod.convert(vit(name="deit_tiny_distilled_patch16_224"), router="attention", capacity=0.5)
    x, y = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])
    teacher.check_student(student, x)
    logits, features = forward_with_features(student.eval(), x, True)
    assert torch.allclose(features, student.forward_head(student.forward_features(x), pre_logits=True))
    assert torch.equal(logits, student(x))
    logits, features = forward_with_features(student.train(), x, True)
    Distillation(features=1.0).loss(logits, features, *teacher(x), y).backward()
    assert student.head.weight.grad.abs().sum() > 0 and student.head_dist.weight.grad.abs().sum() > 0


def test_the_teacher_outputs_are_kept_per_image_and_read_back(tmp_path):
    teacher = Teacher(vit())
    x = torch.randn(6, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    store = TeacherOutputs(tmp_path / "t", 100, 10, 32)
    live = teacher(x)
    first = store(teacher, x, torch.tensor([5, 7, 9, 11, 13, 15]))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(first, live))
    store.flush()
    again = TeacherOutputs(tmp_path / "t", 100, 10, 32)  # another process: read from disk, not computed
    assert again.have.sum() == 6
    read = again(None, x[:2], torch.tensor([13, 5]))
    assert torch.equal(read[0], first[0][[4, 0]]) and torch.equal(read[1], first[1][[4, 0]])


def test_pure_distillation_from_the_starting_weights_starts_at_zero_loss(tmp_path, capsys):
    """With the label term off, a dense student of its own starting weights matches its teacher: the first step's
    soft-logit and feature terms are 0 (the teacher is those weights, frozen; the loss is wired in), where the labels'
    loss of the same step is not."""
    from amod.train.engine import read_metrics

    start = amod.save(vit(), tmp_path / "start.safetensors")
    argv = ["finetune", "--checkpoint", str(start), *DATA, "--batch-size", "64", "--label-smoothing", "0", "--lr",
            "1e-9"]
    res = cli_in_process([*argv, "--distill", "--distill-logits", "1", "--distill-features", "1", "--out",
                          str(tmp_path / "kd")], capsys)
    assert res.returncode == 0, res.stderr
    assert cli_in_process([*argv, "--out", str(tmp_path / "plain")], capsys).returncode == 0
    kd, plain = (read_metrics(tmp_path / name / "metrics.jsonl")[-1]["train_loss"] for name in ("kd", "plain"))
    assert abs(kd) < 1e-5 and plain > 1.0, (kd, plain)


def test_the_any_cost_dial_draws_the_same_capacities_on_every_run():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=56, patch_size=7, depth=12,
                              embed_dim=32, num_heads=2)  # 64 patch tokens: fold reaches 0.4
    model = amod.convert(model, router="attention", skipped="fold", capacity=0.8)
    dial = AnyCost(model, 0.4, 0.9)
    costs = [amod.flops(amod.set_capacity(model, c)).ratio for c in dial.capacities]
    assert costs == sorted(costs) and abs(costs[0] - 0.4) < 0.05 and abs(costs[-1] - 0.9) < 0.05
    draws = [dial.capacity(3, step) for step in range(200)]
    again = AnyCost(model, 0.4, 0.9)  # another process, or the run resumed
    assert draws == [again.capacity(3, step) for step in range(200)]
    assert set(draws) == set(dial.capacities) and draws != [dial.capacity(4, s) for s in range(200)]


def test_distillation_and_any_cost_refusals(tmp_path, capsys):
    pth = tmp_path / "four.pth"  # a timm state dict whose head has other classes than the data's 10
    torch.save(vit(num_classes=4).state_dict(), pth)
    mod_file = amod.save(amod.convert(vit(), router="attention", capacity=0.5), tmp_path / "mod.safetensors")
    other = amod.save(vit(num_classes=4), tmp_path / "four.safetensors")
    base = ["finetune", "--checkpoint", str(pth), "--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth",
            "3", "--embed-dim", "32", "--num-heads", "2", *DATA, "--out", str(tmp_path / "run")]
    for extra, message in [
        (["--distill"], "no classifier trained for the data's 10 classes"),
        (["--teacher", str(pth)], "has no classifier for the data's 10 classes"),
        (["--teacher", str(tmp_path / "none.safetensors")], "no teacher at"),
        (["--teacher", str(mod_file)], "runs attention@0.5; distil from a dense model"),
        (["--teacher", str(other)], "has 4 classes and the data 10"),
        (["--distill", "--distill-logits", "0", "--distill-features", "0"], "plain finetuning"),
        (["--any-cost", "0.4", "0.9"], "give --router"),
        (["--router", "attention", "--any-cost", "0.9", "0.4"], "0 < LOW < HIGH <= 1"),
        (["--tome-cost", "0.7", "--any-cost", "0.7", "0.9"], "give --router"),
        # distillation's weights without distillation would be ignored
        (["--distill-logits", "0.7"], "--distill-logits only applies to a distilled run; add --distill"),
        (["--distill-temperature", "2", "--distill-features", "1"],
         "--distill-temperature, --distill-features only apply to a distilled run"),
    ]:
        res = cli_in_process([*base, *extra], capsys)
        assert res.returncode == 2 and message in res.stderr, (extra, res.stderr)
    assert not (tmp_path / "run").exists()
    # a state dict file with the data's classes teaches with its own classifier, as starting weights or as --teacher
    ten = tmp_path / "ten.pth"
    torch.save(vit().state_dict(), ten)
    cfg = RunConfig(model="vit_tiny_patch16_224", checkpoint=str(ten), distill=True, **ARCH_FLAGS)
    for teacher_file in (None, str(ten)):
        teacher = build_teacher(dataclasses.replace(cfg, teacher=teacher_file), 10, 1, 28)
        assert torch.equal(teacher.head.weight, vit().head.weight)


def test_a_pitome_model_finetunes_and_distils_as_a_tome_one_does(tmp_path, capsys):
    """A PiToMe file keeps its method (and learns from a dense teacher); --pitome-cost (or --method pitome:cost=...)
    makes one from a dense file."""
    pitome_file = amod.save(PiToMe(keep=0.8).apply(vit()), tmp_path / "pitome.safetensors")
    dense_file = amod.save(vit(), tmp_path / "dense.safetensors")
    for i, (start, extra, method) in enumerate([(pitome_file, ["--teacher", str(dense_file)], PiToMe(keep=0.8)),
                                                (dense_file, ["--pitome-cost", "0.6"], None),
                                                (dense_file, ["--method", "pitome:cost=0.6"], None)]):
        out = tmp_path / f"{start.stem}{i}"
        res = cli_in_process(["finetune", "--checkpoint", str(start), *extra, *DATA, "--out", str(out)], capsys)
        assert res.returncode == 0, res.stderr
        trained = amod.methods.method_of(amod.load(out / "model.safetensors"))
        assert isinstance(trained, PiToMe) and (method is None or trained == method), trained
        assert json.loads((out / "summary.json").read_text())["variant"] == (method.label() if method else "pitome@0.6")
        if method is None:
            assert abs(json.loads((out / "summary.json").read_text())["flop_ratio"] - 0.6) < 0.03


def test_any_cost_turns_the_dial_of_a_fold_checkpoint_down_to_its_floor(tmp_path, capsys):
    """A calibrated (shaped) fold file trains any-cost as it is, shape and protect kept; a range whose LOW lies below
    the lowest cost the model reaches is refused, naming that cost, before anything is created."""
    calibrated = MoD(skipped="fold", capacity=0.9, protect=0.1, shape=tuple(tilt_shape(-1, 3)))
    start = amod.save(calibrated.apply(vit()), tmp_path / "calibrated.safetensors")
    floor = amod.flops(amod.load(start), capacity=amod.lowest_capacity(amod.load(start))).ratio  # 0.550
    argv = ["finetune", "--checkpoint", str(start), *DATA, "--out", str(tmp_path / "run")]
    res = cli_in_process([*argv, "--any-cost", "0.05", "0.9"], capsys)
    assert res.returncode == 2 and f"reaches no cost below {floor:.3f} of the dense MACs" in res.stderr, res.stderr
    assert not (tmp_path / "run").exists()
    res = cli_in_process([*argv, "--any-cost", f"{floor:.3f}", "0.9"], capsys)
    assert res.returncode == 0, res.stderr
    assert amod.methods.method_of(amod.load(tmp_path / "run" / "model.safetensors")) == MoD.of_model(amod.load(start))
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["any_cost"] == [round(floor, 3), 0.9]
