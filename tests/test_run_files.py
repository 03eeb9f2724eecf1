"""What the machine can do to a run's files: one run per directory, single output files with one writer and a
temporary name, full disks, diverging runs, strict JSON."""
from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process, run_in_process, SHORT, strict_json, TINY, TINY_CFG

import amod
from amod import files
from amod.train.engine import read_metrics
from amod.train.config import RunConfig
from amod.train.run import train


# ---------------------------------------------------------------- one run per directory

def test_a_second_run_into_a_busy_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *TINY, "--train-limit", "6000", "--epochs", "2", "--out", str(out)]  # seconds of training
    first = subprocess.Popen([sys.executable, "-m", "amod", *args, "--seed", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "train.log").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second could start"
        code, err = run_in_process([*args, "--seed", "2"], capsys)  # in this process: it starts at once
        assert code == 2
        assert f"is in use by another amod run (pid {first.pid})" in err
        assert len(err.splitlines()) == 1
    finally:
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2]
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 1
    # (a stale lock, left by a process that no longer exists, does not block a new run:
    # test_finetuning_an_mod_checkpoint_keeps_and_records_its_method_and_architecture, whose run starts on one)


# ---------------------------------------------------------------- single output files: temporary names, one writer

# (command, flags, the output's name): the commands that write one --out file; a tiny calibration
SINGLE_FILE_COMMANDS = [("export", [], "m.onnx"),
                        ("calibrate", ["--images", "4", "--cost", "0.7"], "c.safetensors")]


def _skip_without_extras(command: str) -> None:
    for module in ("onnx", "onnxruntime", "onnxscript") if command == "export" else ():
        pytest.importorskip(module, reason="amod export needs the onnx extra: pip install 'amod[onnx]'")


def _check_written(command: str, path: Path) -> None:
    """The file ``command`` wrote reads back as what it is: an ONNX graph, an amod model."""
    if command == "export":
        import onnx

        assert onnx.load(str(path)).graph.node
    else:
        assert amod.get_config(amod.load(path)).skipped == "fold"


@pytest.mark.parametrize("command, flags, name", SINGLE_FILE_COMMANDS, ids=[c for c, _, _ in SINGLE_FILE_COMMANDS])
def test_a_single_output_file_has_one_writer_and_never_replaces_the_input(command, flags, name, checkpoints, tmp_path,
                                                                          capsys, monkeypatch):
    """Issue 55. amod wrote <out>.tmp and renamed it over --out, so `--checkpoint m.onnx.tmp --out m.onnx` exited 0
    and the checkpoint was gone: every temporary file is now a new one (files.temporary_beside). Two commands writing
    one --out both reported success and the last one's file won: the first now holds the file (a lock beside it, as a
    run directory's) from its checks to its write, and a second one started meanwhile, even with --force, is refused
    in one line naming it. A lock file left by a killed process blocks nobody, and none is left behind."""
    import amod.experiments.calibrate_command as calibration
    import amod.tools.export_command as export

    _skip_without_extras(command)
    source, out = tmp_path / (name + ".tmp"), tmp_path / name
    source.write_bytes((checkpoints / "dense.safetensors").read_bytes())
    weights = source.read_bytes()
    (tmp_path / f".{name}.amod.lock").write_text("999999\n")  # a stale lock: its process is gone
    argv = [command, "--checkpoint", str(source), "--out", str(out), *flags]
    second = []
    module, work = (export, "export") if command == "export" else (calibration, "calibrate")
    real = getattr(module, work)

    def second_command_meanwhile(*args, **kwargs):  # the first command's long part, with a second one started
        if not second:  # (the second command's own call, if it gets that far, runs as it is)
            second.append(None)
            second[0] = run_in_process([*argv, "--force"], capsys)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, work, second_command_meanwhile)
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    code, err = second[0]
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{out} is in use by another amod command (pid {os.getpid()})" in err
    assert source.read_bytes() == weights, "the input was replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, source.name])  # no lock or temporary file
    _check_written(command, out)
    from amod.train.rundir import output_file_lock

    with output_file_lock(out):  # released
        pass


# ---------------------------------------------------------------- full disks

def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    written = []

    def fill_up(f):
        f.write(b"x" * 10)
        written.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(files.DiskFullError, match=f"no space left on device while writing {target}"):
        files.atomic_write(target, fill_up)
    assert written and target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    # torch.save turns the failed write into a RuntimeError; the recorded OSError still says why
    real_write = files._RecordingWriter.write

    def write_then_fail(self, data):
        if len(bytes(data)) > 1000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real_write(self, data)

    monkeypatch.setattr(files._RecordingWriter, "write", write_then_fail)
    with pytest.raises(files.DiskFullError, match="checkpoint.pt"):
        files.torch_save({"w": torch.randn(10_000)}, tmp_path / "checkpoint.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def _small_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return res.returncode == 0


def test_training_on_a_full_disk_stops_with_one_line_and_no_temporary_file(tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "300k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        res = cli_in_process(["train", *TINY, "--train-limit", "256", "--epochs", "1", "--out", str(disk / "run")],
                             capsys)
        assert res.returncode == 2
        assert "no space left on device while writing" in res.stderr and len(res.stderr.strip().splitlines()) >= 1
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("amod train: error: no space left on device while writing")
        assert not [p for p in (disk / "run").iterdir() if p.name.endswith(".tmp")]
        again = cli_in_process(["train", "--resume", "--out", str(disk / "run")], capsys)
        assert again.returncode == 2 and "Traceback" not in again.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("name", ["metrics.jsonl", "model.safetensors", "checkpoint.pt"])
def test_a_full_disk_in_epoch_2_leaves_the_run_at_epoch_1(name, tmp_path, monkeypatch):
    real_write = files._RecordingWriter.write
    writers = []  # every writer of a temporary file of <name> (<name>.<random>.tmp) so far: one per epoch

    def write(self, data):
        written = Path(self.f.name).name
        if written.startswith(name + ".") and written.endswith(".tmp"):
            if not any(w is self for w in writers):
                writers.append(self)
            if len(writers) == 2:
                self.error = OSError(errno.ENOSPC, "No space left on device")
                raise self.error
        return real_write(self, data)

    monkeypatch.setattr(files._RecordingWriter, "write", write)
    out = tmp_path / "r"
    cfg = RunConfig(**TINY_CFG, train_limit=128, epochs=2, out=str(out))
    with pytest.raises(files.DiskFullError, match=re.escape(f"no space left on device while writing {out / name}")):
        train(cfg)
    monkeypatch.undo()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 1
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert len((out / "metrics.csv").read_text().splitlines()) == 2
    weights = amod.load(out / "model.safetensors").state_dict()
    assert all(torch.equal(weights[k], ckpt["model"][k]) for k in weights), "model.safetensors is not epoch 1"
    assert not list(out.glob("*.tmp"))
    train(cfg, resume=True)
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_a_completely_full_disk_names_the_lock_file(tmp_path, monkeypatch, capsys):
    import amod.train.rundir as rundir

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", no_space)
    with pytest.raises(files.DiskFullError, match=re.escape(f"while writing {tmp_path / 'run' / '.amod.lock'}")):
        with rundir.RunDirectory(tmp_path / "run"):
            pass
    monkeypatch.undo()
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to the last byte
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        res = cli_in_process(["train", *TINY, *SHORT, "--out", str(disk / "run")], capsys)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"no space left on device while writing {disk / 'run' / '.amod.lock'}" in res.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_full_disk_during_export_is_named_as_such_not_as_an_exporter_failure(checkpoints, tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "100k"):  # the ONNX file of the 2-block model is larger
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        res = cli_in_process(["export", "--checkpoint", str(checkpoints / "dense.safetensors"), "--out",
                              str(disk / "m.onnx")], capsys)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"no space left on device while writing {disk / 'm.onnx'}" in res.stderr and "exporter" not in res.stderr
        assert list(disk.iterdir()) == []  # no temporary file left
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---------------------------------------------------------------- diverging runs, strict JSON

def test_a_diverging_run_stops_with_a_clear_message_and_no_nan_in_any_file(tmp_path, capsys):
    res = cli_in_process(["train", *TINY, "--train-limit", "128", "--epochs", "1", "--lr", "1e6", "--out",
                          str(tmp_path / "r")], capsys)
    assert res.returncode == 2, res.stderr
    assert "training stopped" in res.stderr and "no checkpoint was written" in res.stderr
    assert not (tmp_path / "r" / "summary.json").exists() and not (tmp_path / "r" / "model.safetensors").exists()
    for path in (tmp_path / "r").glob("*.json*"):
        for line in path.read_text().splitlines():
            strict_json(line)


def test_the_last_finite_checkpoint_is_kept_when_a_later_epoch_diverges(tmp_path, monkeypatch):
    import amod.train.engine as engine

    real_evaluate = engine.evaluate
    calls = []

    def evaluate(*args, **kwargs):
        metrics = real_evaluate(*args, **kwargs)
        calls.append(1)
        return {**metrics, "loss": float("nan")} if len(calls) == 2 else metrics

    monkeypatch.setattr(engine, "evaluate", evaluate)
    out = tmp_path / "r"
    with pytest.raises(engine.NonFiniteError, match="keeps the checkpoint of epoch 1, the last finite one"):
        train(RunConfig(**TINY_CFG, train_limit=128, epochs=2, out=str(out)))
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]


def test_json_is_strict():
    assert files.dumps({"a": float("nan"), "b": [float("inf"), 1.5], "c": torch.tensor(2.0).numpy()}) == \
        '{"a": null, "b": [null, 1.5], "c": 2.0}'


def test_metrics_csv_leaves_a_non_finite_value_empty_as_the_json_writes_null(tmp_path):
    import csv

    from amod.train.engine import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"epoch": 0, "val_loss": float("nan"), "val_top1": 0.1})
    writer.write({"epoch": 1, "val_loss": float("inf"), "val_top1": 0.5, "lr": 1e-3})
    assert [strict_json(line)["val_loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [None, None]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["epoch"], r["val_loss"], r["val_top1"], r["lr"]) for r in rows] == [("0", "", "0.1", ""), ("1", "", "0.5", "0.001")]
