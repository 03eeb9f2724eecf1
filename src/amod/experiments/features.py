"""The probe protocol's caches, shared by `amod compare`, `amod frontier` and the finetune study: a dense backbone's
features of the probe's training subset and of the test set, the linear probe fitted on them, and the measurements a
killed sweep finished. Each cache lies under the command's output directory, named by ``features_key`` (what it
depends on), so a resumed command reuses it and a changed model, data or subset computes it again.

A dense-features file (``dense_features_KEY.pt``) that is torn, corrupt or foreign is computed again with a
warning naming it, never trusted (``read_features``); a torn last line of a measurements file is skipped with a
warning and measured again (``finished_probe_rows``).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Optional, Union

import torch

from ..families import family_of
from ..files import UnreadableFileError, load_torch, torch_save
from ..train import engine
from ..train.resume import Journal
from .probe import LinearProbe, features, fit_probe_cached

log = logging.getLogger("amod")

FEATURE_KEYS = ("train", "train_labels", "test", "test_labels")  # the tensors of a dense-features file


def features_key(data: str, dense: torch.nn.Module, pretrained: Union[str, Path], train, val) -> str:
    """What the dense features and every probe measurement depend on: the weights (``pretrained``'s path and
    modification time), the data, the input size and the sizes of the two subsets; 16 hex digits.

    Args:
        data: the ``--data`` text.
        dense: the dense model (its input size is read).
        pretrained: a file, a save_pretrained directory (its newest file is stamped), or hf:ID (no stamp).
        train: the probe's training subset.
        val: the test images.
    """
    path = Path(pretrained)
    stamp = max(p.stat().st_mtime_ns for p in [path, *(path.iterdir() if path.is_dir() else ())]) \
        if path.exists() else 0
    return hashlib.sha256(f"{Path(pretrained).resolve()}:{stamp}:{data}:"
                          f"{dense.patch_embed.img_size}:{len(train)}:{len(val)}".encode()).hexdigest()[:16]


def dense_features(root: Path, key: str, dense: torch.nn.Module, train, val,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The dense model's features of the probe's training subset and of the test set (``FEATURE_KEYS``), cached in
    ``root/dense_features_KEY.pt``: reused where that file holds them for these subsets, else computed and saved."""
    path = root / f"dense_features_{key}.pt"
    if path.exists():
        cached, problem = read_features(path, len(train), len(val))
        if cached is not None:
            log.info("dense features reused from %s", path)
            return cached
        log.warning("%s cannot be reused (%s); computing the dense features again", path, problem)
    log.info("dense features of %d training and %d test images (cached in %s)", len(train), len(val), path)
    dist = engine.Dist(device=device)
    model = feature_model(dense)
    loaders = [engine.make_loader(images, 128, False, 0, 0, dist) for images in (train, val)]
    train_f, train_y = features(model, engine.progress_bar(engine.image_batches(loaders[0]), len(loaders[0]),
                                                           "dense training features"), device)
    test_f, test_y = features(model, engine.progress_bar(engine.image_batches(loaders[1]), len(loaders[1]),
                                                         "dense test features"), device)
    cached = {"train": train_f, "train_labels": train_y, "test": test_f, "test_labels": test_y}
    torch_save(cached, path)
    return cached


def dense_probe(root: Path, key: str, cached: dict[str, torch.Tensor]) -> LinearProbe:
    """The linear probe fitted on the cached dense training features (``dense_features``), itself cached in
    ``root/dense_probe_KEY.pt``."""
    return fit_probe_cached(root / f"dense_probe_{key}.pt", cached["train"], cached["train_labels"])


def feature_model(model: torch.nn.Module) -> torch.nn.Module:
    """The part of ``model`` whose output is the probe's features (its family's ``feature_module``: the class token
    after the final norm)."""
    return family_of(model).feature_module(model)


def read_features(path: Path, n_train: int, n_test: int) -> tuple[Optional[dict[str, torch.Tensor]], str]:
    """(the cached dense features, "") if ``path`` holds them for ``n_train`` and ``n_test`` images, else
    (None, what is wrong with it): a torn, corrupt or foreign file is computed again, not trusted."""
    try:
        cached = load_torch(path)
    except (OSError, UnreadableFileError) as e:  # a torn, foreign or crafted file alike
        return None, f"unreadable: {e}"
    if not isinstance(cached, dict) or not all(isinstance(cached.get(k), torch.Tensor) for k in FEATURE_KEYS):
        return None, f"not a dense-features file: it needs the tensors {', '.join(FEATURE_KEYS)}"
    sizes = {k: len(cached[k]) for k in FEATURE_KEYS}
    if sizes != {"train": n_train, "train_labels": n_train, "test": n_test, "test_labels": n_test}:
        return None, f"it holds {sizes}, not {n_train} training and {n_test} test images"
    if cached["train"].ndim != 2 or cached["test"].shape[1:] != cached["train"].shape[1:]:
        return None, "its features are not (images, width) tensors of one width"
    return cached, ""


def finished_probe_rows(path: Path) -> Journal:
    """The journal of a sweep's probe measurements (`amod compare`'s and `amod frontier`'s), one row each as it
    finishes: a ``train.resume.Journal`` keyed by (method, cost target, the method's repr), without a fingerprint
    (``path`` is named by the settings); a torn last line is skipped with a warning, and measured again."""
    return Journal(path, lambda r: (r["method"], float(r["cost_target"]), r["method_repr"]), what="a measurement")
