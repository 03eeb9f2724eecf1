"""Save and load (converted) timm ViTs: safetensors weights with the architecture and MoD config inside.

The file's metadata holds ``amod.model`` (the model family's description of the architecture: for timm, its
architecture name and creation kwargs; ``amod.families``), ``amod.method`` (the kind of the model's method,
``amod.methods``) and what that method writes under its ``metadata_key``: ``amod.mod`` (an MoD model's
``MoDConfig``), ``amod.tome`` (a token-merging model's schedule; ``amod.merge`` in older files, which still load) or
another registered method's, so ``amod.load(path)`` needs nothing else; and for any method but dense the version of
its behaviour (``amod.method.behaviour``) and its package (``amod.method.provider``). A file whose method is not
registered (a package's method, the package not installed), is another package's than the one registered under its
kind, or was written by another version of its method's behaviour is refused in one line, never opened as another
model (``amod.methods.check_method_file``).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from . import files
from .family import Family, family_for, family_of
from .hf.loading import hf_source, load_hf_model, load_hf_source
from .methods import (METHOD_ENTRY, Dense, Method, check_method_file, file_metadata, method_entries,
                      method_from_metadata, method_of)
from .errors import UserError

PathLike = Union[str, os.PathLike]
FORMAT_VERSION = "3"  # the newest file format this amod reads (and writes)
# A file is written in the oldest format whose every reader rebuilds the model that was saved; a reader refuses a
# newer format than its own ("upgrade amod"), so an older amod never opens a file as another model:
# - format 1, what every amod reads: a dense model, or a method whose files format-1 readers found (``amod.mod``,
#   ``amod.pitome``, ``amod.isoflop``) and ran as today (``FORMAT_1_BEHAVIOURS``);
# - format 2: a method a format-1 reader would not find (ToMe's ``amod.tome``, any installed package's method: it
#   would open as a dense model) or would run by an older rule (MoD and PiToMe changed on the near-tie grid);
# - format 3: a method whose behaviour is newer than the one files recorded no version of (``amod.method.behaviour``
#   is read from this format on; a format-2 reader would run such a file by its older rule).
FORMAT_1_BEHAVIOURS = {"isoflop": 1}  # kind -> the behaviour every format-1 reader ran


def file_format(method: Method) -> str:
    """The file format of a model running ``method`` (see ``FORMAT_VERSION``)."""
    cls = type(method)
    if isinstance(method, Dense) or FORMAT_1_BEHAVIOURS.get(cls.kind) == cls.behaviour:
        return "1"
    unrecorded = cls.unrecorded_behaviour[0]
    return "2" if unrecorded is not None and cls.behaviour <= unrecorded else "3"


def save(
    model: nn.Module,
    path: PathLike,
    arch: Optional[str] = None,
    model_args: Optional[dict[str, Any]] = None,
    metadata: Optional[dict[str, str]] = None,
) -> Path:
    """Write ``model`` (dense or converted) to a safetensors file that ``amod.load`` rebuilds alone.

    Args:
        model: a model of a registered family (``amod.families``), converted or not.
        path: destination file; written to a temporary name first, then renamed.
        arch: timm architecture name; defaults to ``model.pretrained_cfg['architecture']`` (timm models only).
        model_args: kwargs for ``timm.create_model``; defaults to ones read off the model (timm models only).
        metadata: extra string entries for the file's metadata.
    """
    path = Path(path)
    data = to_bytes(model, arch, model_args, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    return files.write_bytes(path, data)


def to_bytes(
    model: nn.Module,
    arch: Optional[str] = None,
    model_args: Optional[dict[str, Any]] = None,
    metadata: Optional[dict[str, str]] = None,
) -> bytes:
    """The content ``save`` writes (arguments as there), for writing it together with other files
    (``amod.files.write_together``)."""
    info = family_of(model).describe(model, arch=arch, model_args=model_args)  # (a family's own description)
    method = method_of(model)
    meta = {"amod.format": file_format(method), "amod.model": json.dumps(info), **file_metadata(method)}
    meta.update(metadata or {})
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return safetensors_bytes(tensors, metadata=meta)


def read_metadata(path: PathLike) -> dict[str, str]:
    """The string metadata of an amod safetensors file; clear errors for missing or foreign files."""
    path = Path(path)
    if path.is_dir():
        inside = path / "model.safetensors"
        hint = f"; did you mean {inside}?" if _written_by_amod(inside) else "; give the .safetensors file"
        raise UserError(f"checkpoint {path} is a directory{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors checkpoint ({e})") from None
    if "amod.model" not in meta:
        raise UserError(f"{path} was not written by amod.save (no 'amod.model' metadata)")
    version = meta.get("amod.format", "1")  # every amod.save wrote it; a file without it is format 1
    if not version.isdigit() or int(version) > int(FORMAT_VERSION):
        raise UserError(f"{path} is in amod file format {version!r}; this amod reads format {FORMAT_VERSION} and "
                        "older: upgrade amod to load it")
    methods = method_entries(meta)  # (the registry's, now: a method registered after import is known)
    if len(methods) > 1:
        raise UserError(f"{path} names two methods ({' and '.join(methods)} metadata); an amod checkpoint holds one "
                        "model, so one method's entry at most")
    check_method_file(meta, str(path))  # (a method not registered, another package's, another behaviour)
    return meta


def _written_by_amod(path: Path) -> bool:
    """Whether ``path`` is a file ``read_metadata`` takes (a directory's ``model.safetensors`` may be another
    library's: suggesting it would only be refused next)."""
    try:
        return path.is_file() and read_metadata(path) is not None
    except (ValueError, OSError):
        return False


def check_dense_file(path: PathLike) -> None:
    """Refuse a file that is not a readable amod checkpoint of a dense model (the start of a comparison)."""
    meta = read_metadata(path)
    if meta.get(METHOD_ENTRY, "dense") != "dense" or method_entries(meta):
        raise UserError(f"{path} is not a dense model (it runs {method_from_metadata(meta).label()}); give a dense "
                        "one")


def family_of_file(path: PathLike) -> Family:
    """The family of the model an ``amod.save`` file holds, read from its metadata: nothing is built (to check a
    command's model before any work). Raises as ``read_metadata`` does, and a ValueError for metadata that names no
    family of this amod."""
    meta = read_metadata(path)
    try:
        return family_for(_description(meta))
    except ValueError as e:
        raise UserError(f"{path}: its amod metadata cannot be rebuilt into a model ({type(e).__name__}: {e})") from None


def _description(meta: dict[str, str]) -> dict[str, Any]:
    """The ``amod.model`` entry of a file's metadata: a JSON object (what ``Family.describe`` wrote), or a
    ValueError saying what it is instead."""
    info = json.loads(meta["amod.model"])
    if not isinstance(info, dict):
        raise UserError(f"amod.model is a {type(info).__name__}, not a description")
    return info


def _build(path: PathLike, meta: dict[str, str]) -> tuple[nn.Module, dict[str, Any]]:
    """(the model the metadata names, without its weights; the ``amod.model`` entry)."""
    try:
        info = _description(meta)
        dense = family_for(info).rebuild(info, meta)
        info = {**info, "arch": info.get("arch") or info.get("hf")}  # what the errors below name
        model = method_from_metadata(meta).restore(dense)  # (an isoFLOP file's blocks are the fewer already)
    except (ValueError, TypeError, KeyError, RuntimeError, AssertionError) as e:
        raise UserError(f"{path}: its amod metadata cannot be rebuilt into a model "
                        f"({type(e).__name__}: {e})") from None
    return model, info


def load_weightless(path: PathLike) -> nn.Module:
    """``amod.load`` without the weights: the model an ``amod.save`` file holds on the ``meta`` device, its
    architecture, input size and method, no weights and no memory (to check a command's settings before any work)."""
    meta = read_metadata(path)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. a fold capacity below its floor: load says so
        return _build(path, meta)[0]


skeleton = load_weightless  # the name of before


def load(path: PathLike, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Rebuild a model saved with ``amod.save``: architecture, method (MoD, token merging) and weights. A
    Hugging Face ``save_pretrained`` folder (config.json, safetensors weights) loads too, converted where the
    converted model wrote it (``amod.hf.load_hf_model``)."""
    if hf_source(path) is not None and Path(path).expanduser().is_dir():
        return load_hf_model(Path(path).expanduser()).to(device)
    meta = read_metadata(path)
    model, info = _build(path, meta)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} is corrupt: {e}") from None
    own = model.state_dict()
    wrong = [k for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if wrong:  # torch's own error would not name the file
        k = wrong[0]
        raise UserError(f"{path} does not fit the architecture it names ({info['arch']}): {k} is "
                        f"{tuple(state[k].shape)} in the file and {tuple(own[k].shape)} in the model "
                        f"({len(wrong)} tensor{'s' if len(wrong) > 1 else ''} differ{'' if len(wrong) > 1 else 's'})")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(
            f"{path} does not fit the architecture it names ({info['arch']}): "
            f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    return model.to(device)


def open_model(source: PathLike, device: Union[str, torch.device, None] = None, *, timm_names: bool = False,
               img_size: Optional[int] = None) -> nn.Module:
    """The model a command's model argument names, in eval mode: how the commands that take a Hugging Face model
    as well as an amod file open it (``eval``, ``flops``, ``bench``, ``compare``, ``frontier``). The commands that
    take an amod file only (``train``/``finetune``, ``export``, ``calibrate``, ``analyze``, ``study``, ``detect``)
    call ``load`` themselves, after their own checks.

    - a Hugging Face model (``hf.loading.hf_source``: a ``save_pretrained`` folder with its config.json, or
      ``hf:ID`` from the hub): ``load_hf_source``, with amod's timm-style views;
    - with ``timm_names`` (the commands that time or price an architecture, ``amod bench`` and ``amod flops``): a
      timm model name, with random weights (timing and cost do not depend on them), at ``img_size`` if given;
    - otherwise an ``amod.save`` file: ``load`` (whose errors name the file: missing, unreadable, corrupt).

    Args:
        source: the command-line text (or a path).
        device: where the model goes; None: where it is made (the CPU, or the device in a ``torch.device``
            context such as ``"meta"``).
        timm_names: whether ``source`` may be a timm name; an amod file is then not taken (those commands
            take architectures, not files).
        img_size: a timm name's input size (default its own); a loaded model keeps its own, which the caller checks.
    """
    hf = hf_source(source)
    if hf is not None:
        model = load_hf_source(hf)
    elif timm_names:
        import timm

        try:
            model = timm.create_model(os.fspath(source), pretrained=False,
                                      **({"img_size": img_size} if img_size else {}))
        except RuntimeError as e:  # timm's "Unknown model"
            raise UserError(str(e)) from None
    else:
        model = load(source, "cpu" if device is None else device)
    return (model if device is None else model.to(device)).eval()
