"""What the experiments share: the demo's small ViT and training budgets, the quick preset used by
tests, running (or reusing) one training run, the checks a command's inputs and output directory pass before
any work (``check_settings``, ``check_not_hugging_face``, ``check_trainable``, ``check_not_a_training_run``), and running a multi-run
command in its locked directory (``run_in_directory``).

``BASE`` is the embedded default model: a ViT on Fashion-MNIST (28 x 28, patch 4: 49 patches + CLS,
6 blocks of width 64, 2 heads). ``QUICK`` shrinks every experiment to seconds; it is the one
definition of quick mode, used by ``amod demo/study/compare --quick``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn

from ..checkpoint import check_dense_file, family_of_file
from ..family import FAMILIES
from ..hf.loading import hf_source
from ..train.data import DataInfo, build_datasets
from ..train.models import build_model
from ..train.config import RunConfig
from ..train.run import train
from ..train.rundir import RunDirectory, check_output_dir
from ..errors import UserError

log = logging.getLogger("amod")
T = TypeVar("T")

BASE = dict(model="vit_tiny_patch16_224", patch_size=4, depth=6, embed_dim=64, num_heads=2, data="fashion-mnist")
PRETRAIN = dict(epochs=8, batch_size=128, lr=4e-3, warmup_epochs=0.3)
FINETUNE = dict(epochs=2, batch_size=128, lr=5e-4, warmup_epochs=0.2, train_limit=20000)
CAPACITIES = (0.5, 0.125)
QUICK = dict(depth=4, embed_dim=32, train_limit=512, val_limit=256, epochs=1)


def run_once(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` unless its directory already holds the finished run; resume a killed one."""
    out = Path(cfg.out)
    summary = out / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("epochs") == cfg.epochs \
            and (out / "model.safetensors").exists():
        log.info("%s: finished earlier, reused", out)
        return json.loads(summary.read_text())
    return train(cfg, resume=(out / "checkpoint.pt").exists())


def pretrain_config(out: Path, data: str = "fashion-mnist", quick: bool = False, train_limit: Optional[int] = None,
                    val_limit: Optional[int] = None) -> RunConfig:
    """The run of ``pretrain_dense``: the demo's dense ViT trained on ``data`` into ``out``."""
    small = {k: QUICK[k] for k in ("depth", "embed_dim")} if quick else {}
    cfg = RunConfig(**{**BASE, **small, "data": data}, **PRETRAIN, train_limit=train_limit, val_limit=val_limit,
                    out=str(out))
    if quick:
        cfg.epochs = QUICK["epochs"]
    return cfg


def pretrain_dense(out: Path, data: str = "fashion-mnist", quick: bool = False, train_limit: Optional[int] = None,
                   val_limit: Optional[int] = None) -> tuple[dict[str, Any], Path]:
    """Pretrain the demo's dense ViT into ``out`` (or reuse it there); returns its summary and weights file."""
    return run_once(pretrain_config(out, data, quick, train_limit, val_limit)), out / "model.safetensors"


def demo_skeleton(data: str, quick: bool, info: DataInfo) -> nn.Module:
    """The demo's dense ViT as ``pretrain_dense`` makes it for ``data`` (``info``: what it is), on the meta device (no
    weights, no memory): what a command that would pretrain it checks its settings against before any work."""
    with torch.device("meta"):
        return build_model(pretrain_config(Path("."), data, quick), info.num_classes, info.in_chans, info.img_size)


def check_settings(cfg: Any, positive: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """The checks every multi-run configuration shares, before its first run: the ``positive`` fields are
    integers >= 1, the ``optional`` ones too when given, ``lr`` > 0, and the checkpoint (if any) is a
    readable amod file of a dense model. Raises ValueError naming the flag."""
    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    for name in optional:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not cfg.lr > 0:
        raise UserError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.checkpoint is not None:
        check_dense_file(cfg.checkpoint)


def starting_checkpoint(cfg: Any, root: Path) -> Path:
    """The dense model a multi-run command starts from: ``cfg.checkpoint``, or the demo's, pretrained in
    ``root/pretrain`` (or reused from there)."""
    if cfg.checkpoint:
        return Path(cfg.checkpoint)
    log.info("pretraining the demo's dense model (or reusing it)")
    _, pretrained = pretrain_dense(root / "pretrain", cfg.data, cfg.quick,
                                   train_limit=cfg.train_limit if cfg.quick else None, val_limit=cfg.val_limit)
    return pretrained


HF_COMMANDS = "amod eval, flops, bench, compare and frontier"  # the commands that take a Hugging Face model


def check_not_hugging_face(path: Optional[str], option: str, command: str, takes: str) -> None:
    """Refuse, in one line that says what the command takes and which commands take it, a Hugging Face model (a
    ``save_pretrained`` folder or ``hf:ID``) given to ``amod command``'s ``option``, which takes ``takes``."""
    if path is not None and hf_source(path) is not None:
        raise UserError(f"{option} {path} is a Hugging Face model; amod {command} takes {takes} "
                        f"({HF_COMMANDS} take Hugging Face models)")


def check_trainable(path: Optional[str], option: str, command: str, takes: str) -> None:
    """``check_not_hugging_face``, and refuse too, in one line, an ``amod.save`` file of a model that amod's classifier
    training does not take (its family is not ``trainable``: a Hugging Face model saved by amod), given to ``amod
    command``, which trains it. A path that is not an amod file is left to the command's own checks."""
    check_not_hugging_face(path, option, command, takes)
    if path is None or not Path(path).expanduser().is_file():
        return
    try:
        family = family_of_file(Path(path).expanduser())
    except (ValueError, OSError):  # not an amod file (a .pth), or a broken one: the command's checks say which
        return
    if not family.trainable:
        trainable = " and ".join(f.name for f in FAMILIES if f.trainable)  # ("timm")
        raise UserError(f"{option} {path} holds a {family.models} model; amod {command} takes {trainable} models "
                        f"only ({HF_COMMANDS} take Hugging Face models)")


def run_in_directory(out: str, data: str, body: Callable[[Path], T]) -> T:
    """Check the output directory and the data before anything is written, then run ``body(root)`` while
    holding the directory's lock (a multi-run command's root: its own log file, one process at a time)."""
    root = check_output_dir(out)
    check_not_a_training_run(root)
    build_datasets(data, None, None, None)  # the data must be there before the first run
    with RunDirectory(root):
        return body(root)


def check_not_a_training_run(root: Path) -> None:
    """Refuse a multi-run command's output directory that holds an ``amod train``/``finetune`` run (its
    ``config.yaml`` or ``checkpoint.pt``): the command would write its files into that run's directory and its log
    into that run's ``train.log``. Raises ValueError; creates nothing."""
    marks = [name for name in ("config.yaml", "checkpoint.pt") if (root / name).is_file()]
    if marks:
        raise UserError(f"--out {root} holds an amod train or finetune run ({marks[0]}); give this command a "
                        "directory of its own")
