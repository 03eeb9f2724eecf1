"""Deploying a model: export to ONNX, the check of the file in ONNX Runtime, and ONNX Runtime sessions.

``export(model, path)`` writes any amod model (dense, every router, every skipped mode, token merging)
as one ONNX file with a dynamic batch dimension, after checking it: ONNX Runtime runs the file on a
few images (the caller's, e.g. real validation images, or by default seeded images with flat regions, where a
reduction's scores nearly tie: ``flat_region_images``) at two
batch sizes, and its logits must match the PyTorch forward's (max abs difference <= 1e-4, the same
top-1 on every image). The file is written under a temporary name and renamed only once it passed:
a failed export or check leaves nothing behind. Top-k, gather and scatter stay graph ops (TopK,
Gather/GatherElements, ScatterElements/ScatterND), so the runtime skips the routed-out work too.

What makes a model traceable is in the model code: under tracing (``amod.ops.tracing``) the CPU score
path is the explicit formula instead of Python-planned tiles, and the skipped tokens are found with
top-k instead of a boolean mask. Routers that draw random numbers (random, shuffled-attention) cannot
keep their generator in a graph: the exported model reuses the draws of one call
(``SeededDraws.freeze_draws``), and the check compares with PyTorch under the same frozen draws.

``onnx``, ``onnxscript`` and ``onnxruntime`` are the optional extra ``amod[onnx]``; they are imported
only when needed. ``amod export`` (a checkpoint file in, real check images where the data is at hand)
is ``amod.tools.export_command``.
"""
from __future__ import annotations

import copy
import logging
import os
import re
import signal
import threading
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from .arch import pair
from .family import family_of
from .files import _remove_quietly, check_output_file, disk_full_error, naming_a_full_disk, temporary_beside
from .methods import method_of
from .mod.routers import SeededDraws
from .errors import MissingDependencyError, UserError

PathLike = Union[str, os.PathLike]
EXPORTERS = ("dynamo", "torchscript")
DEFAULT_EXPORTER = "dynamo"
CHECK_IMAGES = 8  # images of the check's first batch; the second batch has 3
TOLERANCE = 1e-4  # max abs logit difference between ONNX Runtime and PyTorch, fp32
# A reduced model's discrete choices still flip where a score lies within rounding noise of the decision grid (about
# one image in 64-128 at 224 px: docs/export.md), and such an image's logits differ by more than TOLERANCE. More
# images than this share beyond it is not a flip but an export that computes something else: refused.
MAX_FLIP_SHARE = 0.25
FROZEN_ROWS = 256  # random routers: images with their own frozen draws (later images reuse them, cyclically)
# the ONNX ops that carry the routing; the check counts them in the graph
ROUTING_OPS = ("TopK", "Gather", "GatherElements", "ScatterElements", "ScatterND")


def _require(module: str):
    """Import one of the optional extra's packages, or say how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"{module} is not installed; ONNX export needs the optional extra: "
            "pip install 'amod[onnx]' (onnx, onnxscript, onnxruntime)") from None


# ---------------------------------------------------------------- sessions

def onnx_session(path: PathLike, threads: Optional[int] = None, spinning: bool = True):
    """An ONNX Runtime CPU session on ``path`` with all graph optimisations; ``threads`` intra-op threads
    (default: as many as torch uses, so that timings compare). ``spinning=False``: idle worker threads
    sleep at once instead of spinning (for timings interleaved with other runtimes)."""
    ort = _require("onnxruntime")
    opts = ort.SessionOptions()
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 4  # errors reach the caller as exceptions
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_session(session, x: torch.Tensor) -> torch.Tensor:
    """The session's first output for the input batch ``x``."""
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})[0])


def op_counts(path: PathLike) -> Counter:
    """How often each op type occurs in the ONNX file's graph (functions and subgraphs included)."""
    return _graph_summary(path)[0]


def _graph_summary(path: PathLike) -> tuple[Counter, int]:
    """(op counts, default-domain opset) of an ONNX file, read once."""
    onnx = _require("onnx")
    model = onnx.load(str(path), load_external_data=False)
    counts: Counter = Counter()

    def walk(nodes) -> None:
        for node in nodes:
            counts[node.op_type] += 1
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    walk(attr.g.node)
                for g in attr.graphs:
                    walk(g.node)

    walk(model.graph.node)
    for fn in model.functions:
        walk(fn.node)
    return counts, next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


# ---------------------------------------------------------------- tracing set-up

@contextmanager
def frozen_draws(model: nn.Module, example: torch.Tensor, rows: int = FROZEN_ROWS) -> Iterator[list[SeededDraws]]:
    """Freeze the draws of the model's random routers for a graph (see ``SeededDraws``): one eager forward
    on ``example`` draws each router's table at its current call number; the call counters are left as
    they were. Undone on exit."""
    routers = [m for m in model.modules() if isinstance(m, SeededDraws)]
    calls = [r.calls for r in routers]
    for r in routers:
        r.freeze_draws(rows)
    try:
        if routers:
            with torch.no_grad():
                model(example)
        yield routers
    finally:
        for r, c in zip(routers, calls):
            r.unfreeze_draws()
            r.calls = c


def _unsupported_op(text: str) -> Optional[str]:
    """The operator an exporter's error names, e.g. ``aten.kthvalue.default``, if it names one."""
    for pattern in (r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)", r"target=torch\.ops\.([\w.]+)",
                    r"(aten(?:::|\.)\w+(?:\.\w+)?)"):
        m = re.search(pattern, text)
        if m:
            return ".".join(g for g in m.groups() if g).replace("::", ".")
    return None


class ExportError(UserError, RuntimeError):
    """An ONNX exporter could not export the model as asked (an op it does not handle, another opset, a model the
    torchscript exporter mistranslates): another exporter, opset or model is the way out. A ``RuntimeError``, as
    before this type existed."""


def _export_error(e: BaseException, exporter: str, model_label: str) -> ExportError:
    """One line for an exporter's failure: the op it could not handle (where it names one) and why."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{e}\n{e.__cause__ or ''}")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    summary = [line for line in lines if line.startswith("<class ")]  # the dynamo exporter's exception summary
    reason = re.sub(r"^<class '[\w.]+'>:\s*", "", summary[0]) if summary else (lines[0] if lines else type(e).__name__)
    op = _unsupported_op(text)
    what = f"the op {op} in {model_label}" if op else model_label
    return ExportError(f"the {exporter} ONNX exporter cannot export {what}: {reason[:300]}")


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporters' own warnings and progress lines off (their errors still raise)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torch_export(model: nn.Module, x: torch.Tensor, path: Path, exporter: str, dynamic: bool,
                  opset: Optional[int]) -> None:
    """torch.onnx.export with the chosen exporter; input ``image``, output ``logits``."""
    names = {"input_names": ["image"], "output_names": ["logits"]}
    with _quiet_exporter():
        if exporter == "dynamo":
            _require("onnxscript")
            shapes = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},) if dynamic else None  # of the one input
            torch.onnx.export(model, (x,), str(path), dynamo=True, dynamic_shapes=shapes, opset_version=opset,
                              external_data=False, optimize=True, verbose=False, **names)
        else:
            axes = {"image": {0: "batch"}, "logits": {0: "batch"}} if dynamic else None
            torch.onnx.export(model, (x,), str(path), dynamo=False, dynamic_axes=axes,
                              opset_version=opset or 17, do_constant_folding=True, **names)


# ---------------------------------------------------------------- the check

def flat_region_images(count: int, chans: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """``count`` seeded images (count, chans, h, w) with flat regions, as photographs and scans have: each a flat
    background (one random value per channel) around one rectangle of random pixels, a quarter to a half of each
    side, at a random place.

    A check on them sees what a check on noise cannot: the background's patch tokens are (near-)equal, so a
    reduction's scores tie or nearly tie there, and a backend that decided those ties differently would show.
    """
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(count, chans, 1, 1, generator=g).expand(count, chans, h, w).contiguous()
    for image in out:
        rh, rw = (int(torch.randint(max(1, s // 4), max(1, s // 2) + 1, (), generator=g)) for s in (h, w))
        top, left = (int(torch.randint(0, s - r + 1, (), generator=g)) for s, r in ((h, rh), (w, rw)))
        image[:, top:top + rh, left:left + rw] = torch.randn(chans, rh, rw, generator=g)
    return out


def check_inputs(model: nn.Module, images: Union[int, torch.Tensor], seed: int = 0) -> tuple[torch.Tensor, str]:
    """(the check's images, where they come from): ``images`` itself when it is a tensor (``"given"``;
    it must be a batch the model takes, ``(N, C, H, W)`` at its input size), else that many seeded
    images with flat regions (``flat_region_images``: ``"flat-region"``)."""
    h, w = pair(model.patch_embed.img_size)
    chans = model.patch_embed.proj.in_channels
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or tuple(images.shape[1:]) != (chans, h, w):
            raise UserError(f"check_images must be a batch of images shaped (N, {chans}, {h}, {w}) for this "
                            f"model, got a tensor of shape {tuple(images.shape)}")
        return images.detach().cpu().float(), "given"
    return flat_region_images(images, chans, h, w, seed), "flat-region"


def _runtime_error(e: BaseException) -> str:
    """An ONNX Runtime error without its status prefix and C++ source locations, at most 400 characters."""
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", " ".join(str(e).split()))
    text = re.sub(r"/onnxruntime_src/\S+ [\w:<>&*, ]+?\([^)]*\)\s*", "", text)
    return text[:400]


@torch.no_grad()
def check_onnx(path: PathLike, model: nn.Module, inputs: list[torch.Tensor], tolerance: float = TOLERANCE
               ) -> dict[str, Any]:
    """Run ``path`` in ONNX Runtime on each batch of ``inputs`` and compare with ``model``'s forward.

    Returns ``max_abs_diff`` (over every image), ``flipped`` (the images whose logits differ by more than
    ``tolerance``: a discrete choice that flipped within rounding noise) of ``images``, ``flip_rate``, ``same_top1``
    (on every image that did not flip) and the ``batches`` checked; raises a RuntimeError when more than
    ``MAX_FLIP_SHARE`` of the images differ by more than ``tolerance`` (the export computes something else), a
    top-1 of another image differs, or a logit is not finite.
    """
    worst, same, flipped, count = 0.0, True, 0, 0
    try:
        session = onnx_session(path)
    except Exception as e:  # onnxruntime's own exception types
        raise RuntimeError(f"ONNX Runtime cannot load the exported model: {_runtime_error(e)}") from None
    for x in inputs:
        ref = model(x).float()
        try:
            got = run_session(session, x)
        except Exception as e:
            raise RuntimeError(f"ONNX Runtime cannot run the exported model on a batch of {x.shape[0]}: "
                               f"{_runtime_error(e)}") from None
        if got.shape != ref.shape:
            raise RuntimeError(f"ONNX Runtime returned logits of shape {tuple(got.shape)} for a batch of "
                               f"{x.shape[0]}; PyTorch {tuple(ref.shape)}")
        per_image = (got - ref).abs().flatten(1).max(dim=1).values  # (B,)
        if not bool(per_image.isfinite().all()):
            worst = float("nan")
        elif per_image.numel():
            worst = max(worst, per_image.max().item())
        agree = per_image <= tolerance
        flipped += int((~agree).sum())
        count += int(x.shape[0])
        same = same and bool((got.argmax(-1) == ref.argmax(-1))[agree].all())
    result = {"max_abs_diff": worst, "flipped": flipped, "images": count, "flip_rate": flipped / max(count, 1),
              "same_top1": same, "batches": [int(x.shape[0]) for x in inputs], "tolerance": tolerance}
    if not worst == worst or flipped > MAX_FLIP_SHARE * count or not same:  # (NaN fails)
        raise RuntimeError(f"the exported model does not match PyTorch: max abs logit difference {worst:.3g} "
                           f"(allowed {tolerance:g}) on {flipped} of {count} images (a flip of a discrete choice "
                           f"moves at most {MAX_FLIP_SHARE:.0%} of them), same top-1 on the others: {same}")
    return result


# ---------------------------------------------------------------- export

class _Terminated(BaseException):
    """SIGTERM arrived during an export (raised so that the temporary file is removed on the way out)."""


@contextmanager
def _sigterm_cleans_up() -> Iterator[None]:
    """Turn SIGTERM into ``_Terminated`` inside the block, so that ``finally``/``except`` clauses run; once
    they have, the signal is delivered again to the handler that was there before (by default the
    process ends, as it would have). Only the main thread can set a handler; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:  # SIGTERM ignored: nothing to clean up after
        yield
        return

    def terminated(signum, frame) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        raise RuntimeError("the export was stopped by SIGTERM; nothing was written") from None  # a handler that returns
    finally:
        if signal.getsignal(signal.SIGTERM) is terminated:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def export(model: nn.Module, path: PathLike, *, img_size: Optional[int] = None,
           batch: Union[str, int] = "dynamic", opset: Optional[int] = None, exporter: str = DEFAULT_EXPORTER,
           check: bool = True, check_images: Union[int, torch.Tensor] = CHECK_IMAGES) -> dict[str, Any]:
    """Export an amod model (or a timm ViT) to the ONNX file ``path``, checked in ONNX Runtime.

    Args:
        model: a timm ViT, dense or amod-converted (MoD with any router and skipped mode, token merging);
            left as it is (a float32 CPU copy is exported).
        path: the ``.onnx`` file; written under a temporary name, renamed into place after the check (an
            existing file is replaced). The temporary file is removed on any failure, and on SIGTERM.
        img_size: input size to export at (the position embedding is resampled when it differs from the
            model's own); default the model's.
        batch: ``"dynamic"`` (a batch dimension of any size) or a fixed batch size.
        opset: ONNX opset; default the exporter's.
        exporter: ``"dynamo"`` (``torch.onnx.export(..., dynamo=True)``, the default) or ``"torchscript"``.
        check: run the file in ONNX Runtime and compare with PyTorch (see ``check_onnx``).
        check_images: the check's images: a number of seeded images with flat regions (``flat_region_images``;
            default 8), or the images
            themselves, an ``(N, C, H, W)`` tensor at the exported input size, e.g. real validation
            images (``amod export`` passes the first Fashion-MNIST validation images for a
            Fashion-MNIST model). A dynamic batch is checked on all of them and on the first 3 (at
            least 2 are needed); a fixed batch on the first ``batch`` (at least that many are needed).

    Returns:
        ``path``, ``exporter``, ``opset``, ``batch``, ``img_size``, ``method`` (the model's label),
        ``ops`` (counts of the routing ops in the graph), ``check`` (``check_onnx``'s result plus the
        ``inputs`` used: ``"flat-region"`` or ``"given"``) and ``bytes``.

    Raises:
        RuntimeError: the exporter cannot handle the model (naming the op where it names one), or the
            check failed; no file is left behind.
        ValueError: bad arguments.
        ImportError: the ``onnx`` extra is missing.
    """
    if exporter not in EXPORTERS:
        raise UserError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    dynamic = batch == "dynamic"
    if not dynamic and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise UserError(f"batch must be 'dynamic' or a positive integer, got {batch!r}")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset < 7):
        raise UserError(f"opset must be an integer >= 7, got {opset!r}")
    given = isinstance(check_images, torch.Tensor)
    if given:
        if check_images.ndim != 4:
            raise UserError(f"check_images must be a batch of images (N, C, H, W), got a tensor of shape "
                            f"{tuple(check_images.shape)}")
        count = int(check_images.shape[0])
    elif isinstance(check_images, bool) or not isinstance(check_images, int):
        raise UserError(f"check_images must be a number of images or a tensor of them, got {check_images!r}")
    else:
        count = check_images
    if count < 2 and dynamic:
        raise UserError("a dynamic-batch check needs at least 2 images")
    if given and not dynamic and count < batch:
        raise UserError(f"check_images holds {count} images; a fixed batch of {batch} needs at least that many")
    for extra in ("onnx", "onnxruntime") if check else ("onnx",):
        _require(extra)
    path = check_output_file(path, "the .onnx file")
    family = family_of(model)
    family.tensor_module(family.prepare(model))  # (a family with nothing to export says so here, before any work)
    model = copy.deepcopy(model).cpu().float().eval()
    if img_size is not None and pair(img_size) != pair(model.patch_embed.img_size):
        family.set_input_size(model, img_size)  # (a family with a fixed input size refuses)
    model = family.tensor_module(model).eval()  # one image tensor in, one tensor out
    label = method_of(model).label()
    example, source = check_inputs(model, check_images if given or dynamic else batch)
    example = example if dynamic else example[:batch]
    n = example.shape[0]
    with _sigterm_cleans_up():
        tmp = temporary_beside(path)  # (never a file of the user's: m.onnx.tmp may be the checkpoint)
        try:
            with frozen_draws(model, example):
                try:
                    with torch.no_grad():
                        _torch_export(model, example, tmp, exporter, dynamic, opset)
                except (ImportError, KeyboardInterrupt):
                    raise
                except Exception as e:
                    full = disk_full_error(e, path)  # the exporter's failed write, wrapped in its own error
                    if full is not None:
                        raise full from None
                    raise _export_error(e, exporter, label) from e
                if not tmp.is_file() or tmp.stat().st_size == 0:
                    raise RuntimeError(f"the {exporter} ONNX exporter wrote no file for {label}")
                ops, written = _graph_summary(tmp)
                if opset is not None and written != opset:
                    raise ExportError(
                        f"the {exporter} ONNX exporter wrote opset {written}, not the {opset} asked for "
                        f"(it converts to older opsets only where onnx's version converter can)")
                result: dict[str, Any] = {
                    "path": str(path), "exporter": exporter, "opset": written, "batch": batch,
                    "img_size": list(pair(model.patch_embed.img_size)), "method": label,
                    "ops": {op: ops.get(op, 0) for op in ROUTING_OPS}, "nodes": sum(ops.values()),
                }
                if check:
                    batches = [example, example[:3] if n > 3 else example[:1]] if dynamic else [example]
                    try:
                        result["check"] = {**check_onnx(tmp, model, batches), "inputs": source}
                    except RuntimeError as e:
                        if exporter == "torchscript":  # it mistranslates some of amod's index ops (merge, fold)
                            raise ExportError(
                                f"{e}; the dynamo exporter (the default) exports every amod "
                                "model") from None
                        raise
            with naming_a_full_disk(path):
                os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise
    result["bytes"] = path.stat().st_size
    return result
