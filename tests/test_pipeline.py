"""The command-line pipeline on real Fashion-MNIST subsets: train, eval, resume, DDP, errors, demo."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import amod
from amod.cli import main as amod_main
from amod.train.engine import read_metrics
from amod.mod.convert import MoD
from amod.train.config import RunConfig
from amod.train.run import train
from conftest import cli_in_process, images, make_model

TINY = ["--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "2", "--embed-dim", "32",
        "--num-heads", "2", "--val-limit", "256", "--batch-size", "64"]
TINY_CFG = dict(model="vit_tiny_patch16_224", patch_size=7, depth=2, embed_dim=32, num_heads=2, val_limit=256,
                batch_size=64)
TIMING_KEYS = {"epoch_time_s", "train_images_per_s", "val_images_per_s"}


def without_timings(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_training_lowers_the_loss_and_eval_agrees(tmp_path, capsys):
    cfg = RunConfig(**TINY_CFG, train_limit=1024, epochs=3, lr=2e-3, warmup_epochs=0.5,
                    method_spec="mod:router=attention,capacity=0.5", eval_before_training=True, out=str(tmp_path / "run"))
    summary = train(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.1
    assert rows[-1]["train_loss"] < rows[1]["train_loss"]
    assert rows[-1]["val_top1"] > 0.18  # 10 classes: chance is 0.1
    csv = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert csv[0].startswith("epoch,") and len(csv) == 5
    res = cli_in_process(["eval", "--checkpoint", str(tmp_path / "run" / "model.safetensors"), "--val-limit", "256",
                          "--json"], capsys)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert {"top1", "top5", "loss", "macs", "images_per_s"} <= set(got)
    assert got["top1"] == rows[-1]["val_top1"] and abs(got["loss"] - rows[-1]["val_loss"]) < 1e-5
    assert got["macs"] == summary["macs"] < amod.flops(timm.create_model(
        "vit_tiny_patch16_224", patch_size=7, depth=2, embed_dim=32, num_heads=2, img_size=28, in_chans=1,
        num_classes=10)).macs


# A training run that kills itself (SIGKILL: no clean-up) just before or just after the COUNT-th time a
# file named NAME is renamed into place, i.e. at a chosen write of a chosen epoch. Written next to the
# test and run as `python kill_at.py before|after NAME COUNT amod-arguments...`.
KILL_AT = '''
import os, signal, sys
from pathlib import Path

when, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
real_replace, seen = os.replace, []


def replace(src, dst, *args, **kwargs):
    if Path(dst).name == name:
        seen.append(dst)
    hit = Path(dst).name == name and len(seen) == count
    if hit and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)
    if hit and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace  # every file amod writes is renamed into place (amod.files)
from amod.cli import main

sys.exit(main(sys.argv[4:]))
'''
def tiny_start(path: Path, seed: int = 0) -> Path:
    """A TINY dense model with Fashion-MNIST's 10 classes, as a timm state dict (``.pth``) or an amod file."""
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, patch_size=7, depth=2, embed_dim=32,
                              num_heads=2, img_size=28, in_chans=1, num_classes=10)
    if path.suffix == ".pth":
        torch.save(model.state_dict(), path)
        return path
    return amod.save(model, path)


@pytest.fixture(scope="module")
def kill_args(tmp_path_factory) -> list[str]:
    """A finetune with drop path, a random router, a capacity drawn per step (any cost) and feature distillation
    from the starting weights: every source of randomness and state a resumed run must restore."""
    start = tiny_start(tmp_path_factory.mktemp("start") / "start.pth")
    return ["finetune", "--checkpoint", str(start), *TINY, "--train-limit", "512", "--epochs", "3", "--router",
            "random", "--capacity", "0.5", "--drop-path", "0.1", "--seed", "7", "--any-cost", "0.6", "0.9",
            "--distill", "--distill-logits", "0", "--distill-features", "1"]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, kill_args) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    assert amod_main([*kill_args, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("when", ["before", "after"])
def test_kill_and_resume_ends_with_the_same_metrics(tmp_path, uninterrupted_run, kill_args, when, capsys):
    """Killed between writing the metrics row of epoch 2 and its checkpoint, or right after the checkpoint."""
    script = tmp_path / "kill_at.py"
    script.write_text(KILL_AT)
    killed = tmp_path / "killed"
    res = subprocess.run([sys.executable, str(script), when, "checkpoint.pt", "2", *kill_args,
                          "--out", str(killed)], capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["epoch"] == (1 if when == "before" else 2)
    # each epoch's row is written before its checkpoint: the metrics are never behind the checkpoint (epoch 0: the
    # finetune's zero-training evaluation)
    assert [r["epoch"] for r in read_metrics(killed / "metrics.jsonl")] == [0, 1, 2]
    res = cli_in_process(["finetune", "--resume", "--out", str(killed)], capsys)  # resumed in this process
    assert res.returncode == 0, res.stderr
    full = uninterrupted_run
    assert without_timings(read_metrics(killed / "metrics.jsonl")) == without_timings(read_metrics(full / "metrics.jsonl"))
    assert (killed / "metrics.csv").read_text().count("\n") == (full / "metrics.csv").read_text().count("\n") == 5
    a = amod.load(killed / "model.safetensors").state_dict()
    b = amod.load(full / "model.safetensors").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a finished run is not silently restarted
    assert amod.load(killed / "model.safetensors").amod_config.capacity == 0.5  # saved at its own capacity
    again = cli_in_process([*kill_args, "--out", str(killed)], capsys)
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_kill_and_resume_with_grad_accum_ends_with_the_same_run(tmp_path, capsys, monkeypatch):
    """--grad-accum 2: 4 batches an epoch make 2 optimizer steps (the schedule counts them); stopped right after the
    checkpoint of epoch 1 (a step boundary; in this process, as KILL_AT's "after" leaves the files) and resumed, the
    run ends as an unbroken one."""
    args = ["train", *TINY, "--val-limit", "32", "--train-limit", "64", "--batch-size", "16", "--epochs", "2",
            "--grad-accum", "2", "--router", "random", "--capacity", "0.5", "--drop-path", "0.1", "--seed", "3"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert amod_main([*args, "--out", str(full)]) == 0
    assert torch.load(full / "checkpoint.pt", weights_only=True)["scheduler"]["last_epoch"] == 4

    class Killed(BaseException):
        pass

    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        real_replace(src, dst, *a, **kw)
        if Path(dst).name == "checkpoint.pt":
            raise Killed

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        amod_main([*args, "--out", str(killed)])
    monkeypatch.setattr(os, "replace", real_replace)
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["scheduler"]["last_epoch"] == 2
    assert cli_in_process(["train", "--resume", "--out", str(killed)], capsys).returncode == 0
    assert without_timings(read_metrics(killed / "metrics.jsonl")) == without_timings(read_metrics(full / "metrics.jsonl"))
    a, b = (amod.load(run / "model.safetensors").state_dict() for run in (killed, full))
    assert all(torch.equal(a[k], b[k]) for k in a)
    res = cli_in_process(["train", "--resume", "--grad-accum", "1", "--out", str(killed)], capsys)
    assert res.returncode == 2 and "grad_accum" in res.stderr  # (the schedule was made for its steps)


@pytest.mark.parametrize("value, message", [("0", "--grad-accum must be at least 1, got 0"),
                                            ("9", "--grad-accum 9 needs 9 batches per epoch and process; this run "
                                                  "has 8 (--batch-size 64)")])
def test_a_grad_accum_below_one_or_above_the_batches_is_refused_in_one_line(tmp_path, capsys, value, message):
    res = cli_in_process(["train", *TINY, "--train-limit", "512", "--grad-accum", value, "--out",
                          str(tmp_path / "r")], capsys)
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "r").exists()


def test_torchrun_two_processes_end_with_identical_weights(tmp_path):
    """The one torchrun launch of the suite (tests/ddp_worker.py): `amod finetune` under DDP (a learned router, a
    capacity drawn per step, distilled from a teacher file), then a learned router trained under DDP on a converted
    DETR and a converted CLIP vision encoder, and a calibrated fold on a timm ViT. The finetune accumulates 2 batches
    per step (--grad-accum 2: DDP's all-reduce with the second only)."""
    worker = Path(__file__).with_name("ddp_worker.py")
    start, teacher = tiny_start(tmp_path / "start.safetensors"), tiny_start(tmp_path / "teacher.safetensors", seed=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           "finetune", "--checkpoint", str(start), "--teacher", str(teacher), "--distill-features", "0.5",
           "--any-cost", "0.6", "0.9", *TINY, "--train-limit", "512", "--epochs", "2", "--grad-accum", "2", "--router",
           "standard",
           "--capacity", "0.5", "--val-limit", "127", "--out", str(tmp_path / "ddp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]
    lines = [s for s in res.stdout.splitlines() if s.startswith("CHECKSUMS")]
    assert lines, res.stdout[-3000:] + res.stderr[-3000:]
    sums = json.loads(lines[0].split(" ", 1)[1])
    assert sums.pop("train") == 0
    for name, ((total0, router0), (total1, router1)) in sums.items():  # the ranks saw other images
        assert total0 == total1 and router0 == router1, (name, sums[name])
        assert (router0 > 0) == (name != "timm-calibrated-fold"), (name, router0)  # (A-MoD has no parameters)
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert len(summary["rank_weight_checksums"]) == 2 and len(set(summary["rank_weight_checksums"])) == 1
    rows = read_metrics(tmp_path / "ddp" / "metrics.jsonl")
    # validation split across both ranks and summed, each image counted once (127 is odd: no padding)
    assert len(rows) == 3 and rows[-1]["val_images"] == 127 and summary["val_images"] == 127


@pytest.mark.cuda
def test_ddp_over_nccl_on_one_gpu_trains_every_parameter(tmp_path):
    """DDP's CUDA path, in one process (world size 1: the torchrun test above runs two CPU processes over gloo): A-MoD,
    standard MoD and a calibrated-style fold train under bf16 autocast with NCCL, every parameter in the graph with a
    finite gradient (DDP without find_unused_parameters raises at the next step otherwise), the learned routers
    reached."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from amod.mod.calibrate import tilt_shape

    conversions = {"A-MoD": dict(router="attention", capacity=0.125),
                   "standard MoD": dict(router="standard", capacity=0.125),
                   "fold": dict(router="attention", capacity=0.8, skipped="fold", protect=0.1, shape=tilt_shape(-1.0, 4))}
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for name, kwargs in conversions.items():
            model = amod.convert(make_model("vit", img_size=64), **kwargs).cuda().train()
            ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
            x, y = images(model, 8).cuda(), torch.arange(8, device="cuda") % 10
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(ddp(x).float(), y)
                loss.backward()
                assert torch.isfinite(loss), name
                grads = {n: p.grad for n, p in model.named_parameters()}
                assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), name
                opt.step()
            routers = [g for n, g in grads.items() if ".router." in n]
            assert bool(routers) == (name == "standard MoD") and all(g.abs().sum() > 0 for g in routers[:1]), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_fewer_training_images_than_processes_give_one_line_and_status_0(tmp_path, capsys,
                                                                                        monkeypatch, rank):
    """What each torchrun process does (in-process: torchrun's environment, the check comes before the processes
    meet): every process refuses alike before they meet, rank 0 says so in one line, and each exits with status 0
    so that torchrun adds no ChildFailedError traceback of its own."""
    for key, value in {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(key, value)
    argv = ["train", *TINY, "--train-limit", "1", "--epochs", "1", "--out", str(tmp_path / "ddp")]
    assert amod_main(argv) == 0
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    if rank == "0":
        assert len(errors) == 1 and errors[0].startswith("amod train: error: 1 training image for 2 processes"), errors
    else:
        assert errors == []
    assert not (tmp_path / "ddp").exists()


def test_every_process_gets_a_batch_when_its_share_is_smaller_than_the_batch_size():
    from amod.train.engine import Dist, make_loader

    data = torch.utils.data.TensorDataset(torch.zeros(100, 1))  # 50 images per process, batches of 64
    for rank in (0, 1):
        assert len(make_loader(data, 64, True, 0, 1, Dist(rank, 2))) == 1


def test_corrupt_checkpoints_are_refused_and_left_alone(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"\x00garbage")
    assert amod_main(["train", "--resume", "--out", str(run)]) == 2
    assert "is corrupt or unreadable" in capsys.readouterr().err
    assert (run / "checkpoint.pt").read_bytes() == b"\x00garbage"
    (tmp_path / "m.safetensors").write_bytes(b"junk")
    assert amod_main(["eval", "--checkpoint", str(tmp_path / "m.safetensors")]) == 2
    assert "is not a readable safetensors checkpoint" in capsys.readouterr().err
    # (a flag's invalid choice, and the other user errors: tests/test_cli_errors.py's BAD_INVOCATIONS)


@pytest.mark.parametrize("layout", ["plain", "deit"])
def test_finetune_loads_a_checkpoint_saved_from_plain_timm(tmp_path, layout):
    torch.manual_seed(3)
    dense = timm.create_model("vit_tiny_patch16_224", pretrained=False, patch_size=7, depth=2, embed_dim=32,
                              num_heads=2, img_size=28, in_chans=1, num_classes=10).eval()
    sd = dense.state_dict()
    path = tmp_path / "timm.pth"
    torch.save(sd if layout == "plain" else {"model": sd, "epoch": 3}, path)
    # capacity 1.0 with an unscaled router is the dense function: epoch 0 must match the dense model
    cfg = RunConfig(**TINY_CFG, checkpoint=str(path), method_spec="mod:capacity=1.0", epochs=1, train_limit=128,
                    eval_before_training=True, out=str(tmp_path / "ft"))
    train(cfg)
    zero = read_metrics(tmp_path / "ft" / "metrics.jsonl")[0]
    from amod.train.data import build_datasets
    from amod.train.engine import evaluate, make_loader, Dist

    _, val, _ = build_datasets("fashion-mnist", 28, None, 256)
    ref = evaluate(dense, make_loader(val, 64, False, 0, 0, Dist()), torch.device("cpu"), progress=False)
    assert zero["val_top1"] == ref["top1"] and abs(zero["val_loss"] - ref["loss"]) < 1e-5


def test_toy_demo_quick_writes_a_report_with_every_variant(tmp_path):
    from amod.experiments.toy_demo import _variants, run_toy_demo as run_demo

    report = run_demo(str(tmp_path / "demo"), quick=True)
    text = report.read_text()
    for name, _ in _variants():
        assert f"| {name} |" in text
    assert "| dense |" in text
    for png in ("accuracy_vs_epoch.png", "accuracy_vs_cost.png"):
        assert (tmp_path / "demo" / png).stat().st_size > 1000
    data = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert len(data["variants"]) == 6 and all(v["images_per_s"] > 0 for v in data["variants"])
    # rerunning reuses every finished run instead of training again
    mtime = (tmp_path / "demo" / "amod_0.5" / "model.safetensors").stat().st_mtime
    run_demo(str(tmp_path / "demo"), quick=True)
    assert (tmp_path / "demo" / "amod_0.5" / "model.safetensors").stat().st_mtime == mtime


def test_yaml_config_is_overridden_by_flags(tmp_path):
    from amod.cli import build_parser, run_config_from_args

    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("epochs: 3\nlr: 0.01\nrouter: attention\nlayers: [1, 3]\nwarmup-epochs: 0.5\n")
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--lr", "0.002"])
    cfg = run_config_from_args(args, finetune=False)
    assert (cfg.epochs, cfg.lr, cfg.method(), cfg.warmup_epochs) == (3, 0.002, MoD(layers=(1, 3)), 0.5)
    cfg_file.write_text("method: tome:cost=0.6\nepochs: 2\n")  # a key by its flag's name (--method fills method_spec)
    assert run_config_from_args(build_parser().parse_args(["train", "--config", str(cfg_file)])).method_spec == \
        "tome:cost=0.6"
    cfg_file.write_text("epochs: 3\nlearning_rate: 0.01\n")
    with pytest.raises(ValueError, match=r"unknown keys \['learning_rate'\]"):
        run_config_from_args(build_parser().parse_args(["train", "--config", str(cfg_file)]), finetune=False)
