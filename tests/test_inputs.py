"""Inputs a run cannot read: unreadable images named or skipped and counted; pretrained weights without a network."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import timm
import torch
from conftest import cli_in_process, FOLDER_MODEL, run_in_process, SHORT, strict_json

import amod
from amod.cli import main as amod_main
from amod.train.run import train


# ---------------------------------------------------------------- unreadable images

def test_unreadable_images_are_named_or_skipped_and_counted(image_folder, tmp_path, capsys):
    # in this process: an uncaught exception fails the test, and stderr holds the log lines a user sees
    data = f"imagefolder:{image_folder}"
    code, err = run_in_process(["train", *FOLDER_MODEL, "--data", data, "--epochs", "1", "--out", str(tmp_path / "a")],
                               capsys)
    assert code == 2
    last = err.splitlines()[-1]
    assert "cannot read image" in last and "--skip-bad-images" in last
    assert any(name in last for name in ("empty.jpg", "corrupt.png", "truncated.jpg"))

    res = cli_in_process(["train", *FOLDER_MODEL, "--data", data, "--epochs", "1", "--skip-bad-images", "--out",
                          str(tmp_path / "b")], capsys)
    assert res.returncode == 0, res.stderr
    summary = strict_json((tmp_path / "b" / "summary.json").read_text())
    assert summary["skipped_images"] == 6 and summary["val_images"] == 24
    assert "skipped 6 unreadable images" in res.stderr

    model = str(tmp_path / "b" / "model.safetensors")
    code, err = run_in_process(["eval", "--checkpoint", model, "--data", data], capsys)
    assert code == 2 and "cannot read image" in err
    assert amod_main(["eval", "--checkpoint", model, "--data", data, "--skip-bad-images", "--json"]) == 0
    out = strict_json(capsys.readouterr().out)
    assert out["images"] == 24 and out["skipped_images"] == 3


def test_skipping_every_training_image_gives_one_line(image_folder, tmp_path, capsys):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(image_folder / "val", root / "val")
    for c in range(3):  # the same classes, every training image unreadable
        (root / "train" / f"class{c}").mkdir(parents=True)
        (root / "train" / f"class{c}" / "bad.jpg").write_bytes(b"")
    code, err = run_in_process(["train", *FOLDER_MODEL, "--data", f"imagefolder:{root}", "--epochs", "1",
                                "--skip-bad-images", "--out", str(tmp_path / "r")], capsys)
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("amod train: error:") and "no training image could be read" in last, err


# ---------------------------------------------------------------- no network

def test_pretrained_weights_without_a_network_fail_fast_with_one_line(tmp_path):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "amod", "finetune", "--pretrained", "--model", "vit_tiny_patch16_224",
                          "--img-size", "32", *SHORT, "--out", str(tmp_path / "r")], capture_output=True, text=True,
                         timeout=300, env=env)
    took = time.perf_counter() - start
    startup = 0.0
    if took >= 30:  # what starting the command costs on this machine now (imports; slow on a busy machine)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import amod.cli, amod.train.run, timm, torch"], check=True, env=env,
                       timeout=300)
        startup = time.perf_counter() - start
        took -= startup  # beyond start-up: the download attempt, no retries with back-off
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Retrying" not in res.stderr, res.stderr
    assert "cannot download the pretrained weights of vit_tiny_patch16_224" in res.stderr
    assert took < 30, f"took {took:.0f} s beyond the {startup:.0f} s start-up"
    assert not (tmp_path / "r").exists()


def test_cached_pretrained_weights_need_no_network(tmp_path):
    from safetensors.torch import save_file

    repo = timm.models.get_pretrained_cfg("vit_tiny_patch16_224").hf_hub_id
    cache = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("0" * 40)
    (cache / "snapshots" / ("0" * 40)).mkdir(parents=True)
    torch.manual_seed(0)
    weights = timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()
    save_file(weights, str(cache / "snapshots" / ("0" * 40) / "model.safetensors"))
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    res = subprocess.run([sys.executable, "-m", "amod", "finetune", "--pretrained", "--model", "vit_tiny_patch16_224",
                          "--img-size", "32", *SHORT, "--batch-size", "32", "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "Retrying" not in res.stderr
