"""Runs from a checkpoint: its method and architecture kept and recorded, resume of another run refused, the
capacity it runs at, isoFLOP priced against its dense model."""
from __future__ import annotations

import dataclasses
import os

import pytest
import timm
from conftest import cli_in_process, run_in_process, SHORT, strict_json, TINY

import amod
from amod import files
from amod.train.run import train


# ---------------------------------------------------------------- runs from a checkpoint; permissions, locks, resume

def test_finetuning_an_mod_checkpoint_keeps_and_records_its_method_and_architecture(checkpoints, tmp_path, capsys):
    """One short run, checked for what every run must do: it starts in a directory holding a stale lock, its files get
    the umask's permissions, resuming it changes nothing and resuming it with more epochs is refused."""
    import yaml

    out = tmp_path / "ft"
    out.mkdir()
    (out / ".amod.lock").write_text("999999\n")  # left by a process that no longer exists: it does not block the run
    old = os.umask(0o022)
    try:
        code, err = run_in_process(["finetune", "--checkpoint", str(checkpoints / "mod.safetensors"), *SHORT,
                                    "--batch-size", "32", "--out", str(out)], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    for name in ("model.safetensors", "checkpoint.pt", "summary.json", "metrics.jsonl", "config.yaml"):
        assert (out / name).stat().st_mode & 0o777 == 0o644, name  # the umask's permissions, not mkstemp's 0600
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert amod.methods.parse_method(config["method_spec"]) == amod.MoD(layers=(1,), scale_output=False)
    assert (config["model"], config["patch_size"], config["depth"], config["embed_dim"], config["num_heads"]) == \
        ("vit_tiny_patch16_224", 7, 2, 32, 2)
    assert strict_json((out / "summary.json").read_text())["variant"] == "attention@0.5"
    assert "attention@0.5 on fashion-mnist" in (out / "train.log").read_text()
    assert amod.methods.method_of(amod.load(out / "model.safetensors")).label() == "attention@0.5"
    # the same method given again is the checkpoint's own; resuming the run changes nothing
    code, err = run_in_process(["train", "--resume", "--out", str(out)], capsys)
    assert code == 0, err
    # resuming with more epochs than the run was made for is refused, and changes nothing
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.log"}
    code, err = run_in_process(["train", "--resume", "--epochs", "2", "--out", str(out)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "cannot resume with --epochs 2" in err and "made for 1 epoch" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train.log"} == before


def test_resume_refuses_the_checkpoint_of_another_run_and_changes_nothing(tmp_path, capsys):
    import shutil

    runs = {}
    for seed in (1, 2):
        runs[seed] = tmp_path / f"seed{seed}"
        code, err = run_in_process(["train", *TINY, *SHORT, "--seed", str(seed), "--out", str(runs[seed])], capsys)
        assert code == 0, err
    # a whole run directory copied (or moved) is still that run: it resumes
    shutil.copytree(runs[1], tmp_path / "copy")
    code, err = run_in_process(["train", "--resume", "--out", str(tmp_path / "copy")], capsys)
    assert code == 0, err
    # the run of seed 2 with the checkpoint of seed 1 copied in: refused, every file as it was
    shutil.copy(runs[1] / "checkpoint.pt", runs[2] / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in runs[2].iterdir()}
    code, err = run_in_process(["train", "--resume", "--out", str(runs[2])], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{runs[2] / 'checkpoint.pt'} is not the checkpoint of the run in {runs[2]} (it has seed=1; config.yaml " \
           "has seed=2); nothing was changed" in err
    assert {p.name: p.read_bytes() for p in runs[2].iterdir()} == before


@pytest.mark.parametrize("saved", ["mod", "fold"])
def test_capacity_given_for_a_checkpoint_that_runs_mod_or_fold_is_the_capacity_it_runs_at(saved, checkpoints, tmp_path,
                                                                                         capsys):
    """``finetune --checkpoint FILE --capacity C`` of a file that runs MoD or fold (issue 55: "add --router", to a model
    that has one): the file's method at capacity C, as ``amod eval --capacity`` turns the dial, recorded as such."""
    import yaml

    out = tmp_path / "ft"
    code, err = run_in_process(["finetune", "--checkpoint", str(checkpoints / f"{saved}.safetensors"), "--capacity",
                                "0.6", *SHORT, "--batch-size", "32", "--out", str(out)], capsys)
    assert code == 0, err
    before = amod.methods.method_of(amod.load(checkpoints / f"{saved}.safetensors"))
    after = amod.methods.method_of(amod.load(out / "model.safetensors"))
    assert after == dataclasses.replace(before, capacity=0.6)  # the same router, layers, skipped mode, protect
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert amod.methods.parse_method(config["method_spec"]) == after
    summary = strict_json((out / "summary.json").read_text())
    assert summary["variant"] == after.label() and summary["flop_ratio"] == pytest.approx(
        amod.flops(amod.load(out / "model.safetensors")).ratio)


def test_an_isoflop_run_is_priced_against_the_dense_model_it_replaces(checkpoints, tmp_path, capsys):
    """The isoFLOP baseline (fewer dense blocks) is dense in itself: its cost is a share of the dense model it was
    cut from, not of itself (issue 55: "1.000 of dense", flop_ratio 1.0), in the run's log and summary, in
    ``IsoFLOP.cost_of`` and in ``amod flops --method isoflop``."""
    dense = amod.load(checkpoints / "dense.safetensors")
    expected = amod.flops(amod.isoflop_baseline(dense, 0.125)).macs / amod.flops(dense).macs
    assert 0.45 < expected < 0.55  # one of the two blocks
    assert amod.IsoFLOP(capacity=0.125).cost_of(dense) == pytest.approx(expected)
    out = tmp_path / "iso"
    code, err = run_in_process(["finetune", "--checkpoint", str(checkpoints / "dense.safetensors"), "--isoflop",
                                "--router", "attention", "--capacity", "0.125", *SHORT, "--out", str(out)], capsys)
    assert code == 0, err
    summary = strict_json((out / "summary.json").read_text())
    assert summary["variant"] == "isoflop@0.125" and summary["flop_ratio"] == pytest.approx(expected)
    assert f"({expected:.3f} of dense)" in (out / "train.log").read_text()
    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--capacity", "1", "--method", "isoflop:capacity=0.125"],
                         capsys)
    assert res.returncode == 0, res.stderr
    row = next(line.split() for line in res.stdout.splitlines() if "isoflop:capacity=0.125" in line)
    assert float(row[-2]) == pytest.approx(amod.IsoFLOP(capacity=0.125).cost_of(
        timm.create_model("vit_tiny_patch16_224")), abs=1e-3) and float(row[-2]) < 0.7
