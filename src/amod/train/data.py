"""Datasets: the embedded default (Fashion-MNIST), image folders and the paper's torchvision datasets.

``build_datasets(spec, img_size)`` returns the train and validation sets plus what the model needs to
know about them (classes, channels, native size). Missing data gives one message that says what was
looked for where and how to get it.
"""
from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
import torchvision.datasets as tvd
from PIL import Image
from timm.data import create_transform
from torch.utils.data import Dataset, Subset, default_collate

from ..errors import UserError

FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm's transforms for RGB data
TORCHVISION_SETS = {  # name: (class name, train split kwargs, val split kwargs, classes)
    "flowers102": ("Flowers102", {"split": "train"}, {"split": "val"}, 102),
    "oxford-pets": ("OxfordIIITPet", {"split": "trainval"}, {"split": "test"}, 37),
    "stanford-cars": ("StanfordCars", {"split": "train"}, {"split": "test"}, 196),
    "imagenet": ("ImageNet", {"split": "train"}, {"split": "val"}, 1000),
}
DATA_SPECS = ("fashion-mnist", "imagefolder:PATH", *TORCHVISION_SETS)


class DataError(UserError):
    """Data that is missing or malformed; the message says what was looked for and how to get it."""


@dataclass
class DataInfo:
    name: str
    num_classes: int
    in_chans: int
    img_size: int  # native (or default) side length


def normalization(info: "DataInfo") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) per channel the data was normalised with (to show images as they were)."""
    if info.in_chans == 1:
        return (FASHION_MNIST_MEAN,), (FASHION_MNIST_STD,)
    return IMAGENET_MEAN, IMAGENET_STD


def data_root() -> Path:
    """Where datasets are looked for and downloaded: ``$AMOD_DATA`` or ``~/.cache/amod/data``."""
    return Path(os.environ.get("AMOD_DATA") or Path.home() / ".cache" / "amod" / "data")


# ---------------------------------------------------------------- Fashion-MNIST

def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: expected {int(np.prod(dims))} values, found {data.size}")
    return data.reshape(dims)


def _find_idx(directory: Path, stem: str) -> Optional[Path]:
    for name in (stem, stem + ".gz"):
        for candidate in (directory / name, directory / "raw" / name, directory / "FashionMNIST" / "raw" / name):
            if candidate.is_file():
                return candidate
    return None


def load_fashion_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 28, 28) uint8 images and (N,) int64 labels of the Fashion-MNIST ``split`` ("train"/"val").

    Looks in ``$AMOD_DATA``, ``$AMOD_DATA/fashion-mnist`` and Debian's
    ``/usr/share/datasets/fashion-mnist`` (package dataset-fashion-mnist); falls back to torchvision's
    download into ``$AMOD_DATA``.
    """
    images_stem, labels_stem = FASHION_MNIST_FILES[split]
    root = data_root()
    searched = [root, root / "fashion-mnist", *map(Path, FASHION_MNIST_DIRS)]
    for directory in searched:
        images, labels = _find_idx(directory, images_stem), _find_idx(directory, labels_stem)
        if images and labels:
            return _to_tensors(read_idx(images), read_idx(labels), images)
    try:
        ds = tvd.FashionMNIST(str(root / "fashion-mnist"), train=split == "train", download=True)
        return ds.data.clone(), ds.targets.clone()
    except Exception as e:  # no network, or a broken download
        raise DataError(
            f"Fashion-MNIST {split} split not found: looked for {images_stem}[.gz] and {labels_stem}[.gz] in "
            f"{', '.join(map(str, searched))}, and torchvision's download failed ({e}). "
            "Install Debian's package dataset-fashion-mnist (apt-get install dataset-fashion-mnist) "
            "or put the IDX files in $AMOD_DATA."
        ) from None


def _to_tensors(images: np.ndarray, labels: np.ndarray, where: Path) -> tuple[torch.Tensor, torch.Tensor]:
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"malformed Fashion-MNIST files in {where.parent}: images {images.shape}, labels {labels.shape}")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


class TensorImages(Dataset):
    """Grayscale uint8 images held in memory and normalised; optional flips and shifts when training.

    Augmentation is off by default: at the few-epoch budgets amod's demo uses, it only slowed a
    patch-4 ViT down on Fashion-MNIST (2 epochs on 15k images: 74.3 % top-1 without, 66.4 % with
    horizontal flips, 61.9 % with flips and 2-pixel shifts), and the model did not overfit without it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, train: bool, img_size: int,
                 mean: float = FASHION_MNIST_MEAN, std: float = FASHION_MNIST_STD, flip: bool = False,
                 shift: int = 0) -> None:
        self.images, self.labels, self.img_size, self.mean, self.std = images, labels, img_size, mean, std
        self.flip, self.shift = flip and train, shift if train else 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i].float().div_(255).unsqueeze(0)  # (1, H, W)
        if self.shift:  # random translation by up to `shift` pixels (global torch RNG: resumable)
            h, w = x.shape[-2:]
            x = torch.nn.functional.pad(x, (self.shift,) * 4)
            dy, dx = torch.randint(0, 2 * self.shift + 1, (2,)).tolist()
            x = x[:, dy:dy + h, dx:dx + w]
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        if x.shape[-1] != self.img_size:
            x = torch.nn.functional.interpolate(x[None], size=(self.img_size, self.img_size), mode="bilinear",
                                                align_corners=False)[0]
        return (x - self.mean) / self.std, int(self.labels[i])


# ---------------------------------------------------------------- unreadable images

class BadSample(NamedTuple):
    """What a ``CheckedImages`` dataset returns in place of a sample whose image cannot be read."""

    index: int
    path: str
    error: str


# What PIL and the decoders raise for an empty, corrupt or truncated file.
_IMAGE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class CheckedImages(Dataset):
    """A file-backed image dataset whose unreadable images become ``BadSample`` values, not exceptions.

    The decision (stop with the file's name, or skip and count it) is taken in the main process, by
    the loop that meets the batch (``amod.engine.image_batches``), so it works the same with
    DataLoader worker processes.
    """

    def __init__(self, base: Dataset, paths: Callable[[int], str]) -> None:
        self.base, self.path_of = base, paths

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Union[tuple[Any, Any], BadSample]:
        try:
            return self.base[i]
        except _IMAGE_ERRORS as e:
            return BadSample(i, self.path_of(i), f"{type(e).__name__}: {e}")

    def __getattr__(self, name: str) -> Any:  # classes, samples, ... of the wrapped dataset
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


def collate_checked(batch: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, list[BadSample]]:
    """Collate the readable samples; hand the unreadable ones on as a list: (x, y, bad)."""
    good = [b for b in batch if not isinstance(b, BadSample)]
    bad = [b for b in batch if isinstance(b, BadSample)]
    if not good:
        return torch.empty(0), torch.empty(0, dtype=torch.long), bad
    x, y = default_collate(good)
    return x, y, bad


def _sample_path(ds: Dataset, attr: str) -> Callable[[int], str]:
    def path_of(i: int) -> str:
        item = getattr(ds, attr)[i]
        return str(item[0] if isinstance(item, tuple) else item)
    return path_of


# ---------------------------------------------------------------- folders and torchvision sets

def _timm_transform(img_size: int, train: bool) -> Callable:
    return create_transform(input_size=img_size, is_training=train)


def _imagefolder(path: str, img_size: int):
    root = Path(path)
    train_dir, val_dir = root / "train", root / "val"
    if not train_dir.is_dir() or not val_dir.is_dir():
        raise DataError(f"imagefolder:{path} needs {train_dir} and {val_dir}, each with one folder per class")
    try:
        train = tvd.ImageFolder(str(train_dir), transform=_timm_transform(img_size, True))
        val = tvd.ImageFolder(str(val_dir), transform=_timm_transform(img_size, False))
    except (FileNotFoundError, OSError) as e:
        raise DataError(f"imagefolder:{path}: {e}") from None
    if train.classes != val.classes:
        raise DataError(f"imagefolder:{path}: train and val have different class folders")
    train, val = (CheckedImages(ds, _sample_path(ds, "samples")) for ds in (train, val))
    return train, val, DataInfo(f"imagefolder:{path}", len(train.classes), 3, img_size)


def _torchvision_set(name: str, root: Optional[str], img_size: int):
    cls_name, train_kw, val_kw, classes = TORCHVISION_SETS[name]
    cls = getattr(tvd, cls_name)
    directory = Path(root) if root else data_root() / name
    kwargs = {} if name in ("imagenet", "stanford-cars") else {"download": True}  # no public download for these
    try:
        train = cls(str(directory), transform=_timm_transform(img_size, True), **train_kw, **kwargs)
        val = cls(str(directory), transform=_timm_transform(img_size, False), **val_kw, **kwargs)
    except Exception as e:
        hint = {"imagenet": "download ILSVRC2012 from image-net.org and place the archives there",
                "stanford-cars": "torchvision can no longer download it; place the Kaggle copy there"}.get(
            name, "check the network connection, or download it there by hand")
        raise DataError(f"{name} not found in {directory} ({e}); {hint}") from None
    files = {"flowers102": "_image_files", "oxford-pets": "_images", "stanford-cars": "_samples", "imagenet": "samples"}[name]
    train, val = (CheckedImages(ds, _sample_path(ds, files)) for ds in (train, val))
    return train, val, DataInfo(name, classes, 3, img_size)


def _subset(ds: Dataset, limit: Optional[int]) -> Dataset:
    """The same seeded random subset for every run, so compared variants see the same images."""
    if limit is None or limit >= len(ds):
        return ds
    if limit < 1:
        raise UserError(f"a data limit must be a positive number of images, got {limit}")
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[:limit]
    return Subset(ds, idx.tolist())


def first_images(ds: Dataset, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` (image, label) pairs of ``ds`` as a batch: a fixed sample for analyses."""
    n = min(n, len(ds))
    return torch.stack([ds[i][0] for i in range(n)]), torch.tensor([ds[i][1] for i in range(n)])


def build_datasets(spec: str, img_size: Optional[int] = None, train_limit: Optional[int] = None,
                   val_limit: Optional[int] = None) -> tuple[Dataset, Dataset, DataInfo]:
    """Train and validation datasets for ``spec``.

    Args:
        spec: ``fashion-mnist``, ``imagefolder:PATH`` (with PATH/train and PATH/val), or one of
            ``flowers102``, ``oxford-pets``, ``stanford-cars``, ``imagenet`` (optionally ``NAME:ROOT``).
        img_size: input side length; defaults to the dataset's own (28 for Fashion-MNIST, 224 else).
        train_limit, val_limit: use a fixed random subset of this many images.
    """
    name, _, arg = spec.partition(":")
    if name == "fashion-mnist":
        size = img_size or 28
        tx, ty = load_fashion_mnist("train")
        vx, vy = load_fashion_mnist("val")
        train, val = TensorImages(tx, ty, True, size), TensorImages(vx, vy, False, size)
        info = DataInfo("fashion-mnist", 10, 1, size)
    elif name == "imagefolder":
        if not arg:
            raise DataError("imagefolder needs a path: --data imagefolder:PATH")
        train, val, info = _imagefolder(arg, img_size or 224)
    elif name in TORCHVISION_SETS:
        train, val, info = _torchvision_set(name, arg or None, img_size or 224)
    else:
        raise DataError(f"unknown data {spec!r}; use one of: {', '.join(DATA_SPECS)}")
    return _subset(train, train_limit), _subset(val, val_limit), info
