"""One prepared check of amod's CUDA path, and the numbers a GPU user asks for, in a few minutes.

Run from a plain checkout (nothing to install, no network):

    PYTHONPATH=src python benchmarks/gpu_check.py --out DIR             # the GPU run, sized for < 6 minutes
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --quick --out DIR   # the same code on a CPU

Sections (``--sections 1,2,3,4,5``):
1. correctness: ``attention_with_scores`` against the explicit formula (float64 reference) over shapes
   that are not multiples of the kernel tiles; the Triton score kernel on its own (CUDA, or the CPU
   under ``TRITON_INTERPRET=1``); a converted model's CUDA forward against its CPU forward.
2. speed: dense timm against A-MoD (bypass) at two capacities, the fold mode and ToMe at the same
   costs, interleaved, medians, bf16 autocast on CUDA; speed-up, FLOP bound and efficiency.
3. score kernels: ``attention_with_scores`` (sdpa + the Triton score kernels on CUDA) against
   ``F.scaled_dot_product_attention`` alone: time at N = 197 and 4097, peak memory on CUDA.
4. training: AdamW steps on random data (bf16 autocast on CUDA) for dense, A-MoD and standard MoD,
   interleaved; finite losses, gradients in the routed blocks and the router; a one-process DDP run.
5. frontier: every training-free method (ToMe, PiToMe, fold, calibrated, the paper's MoD) at costs 0.4, 0.5, 0.56
   and 0.7 against dense on DeiT-S, ViT-B/16 and DINOv2 ViT-S/14 at 224 px, batch 256 and 1: eager, as CUDA graphs
   (``amod.compile(mode="cuda-graphs")``) and, as the budget allows, compiled (``amod.compile``), with the compile
   time; on DINOv2 each point is the CPU frontier's own setting, joined with its accuracy
   (docs/frontier_dinov2_224.json).

Each item of a section is recorded as ok / failed (with the error) / skipped (with the reason), and
the JSON and Markdown reports are rewritten after every section, so a killed run keeps what it had.
Every section has a time budget; what does not fit is skipped and says so. Exit status: 0 when no
section failed, 1 otherwise, 2 when the requested device is not there.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when imported by the tests
from _common import ensure_tunables, machine  # noqa: E402

import amod  # noqa: E402
from amod.experiments.bench import same_setting_as, time_callables, time_models  # noqa: E402
from amod.files import dumps, write_json, write_text  # noqa: E402
from amod.ops import attention_scores_explicit, attention_with_scores  # noqa: E402

TITLES = {1: "correctness", 2: "speed", 3: "score kernels", 4: "training", 5: "frontier"}
# Seconds per section on the full run: with start-up (~15 s) the run stays under 6 minutes.
SECTION_BUDGET_S = {1: 60, 2: 70, 3: 25, 4: 45, 5: 130}
TOTAL_BUDGET_S = 330
# attention output and scores, relative; float64 inputs too are computed in float32 inside the op
TOLERANCE = {"float64": 1e-5, "float32": 1e-5, "bfloat16": 1e-2}
# Model forward on the device against the CPU, error over the largest logit. fp32: tight (CPU fp32
# against float64: ~1.5e-6), and the same kept tokens. bf16 autocast, calibrated with the CPU's bf16
# against its fp32 (DeiT-S, ViT-Ti): dense 0.8-1.1e-2; a routed model's token choices flip where two
# scores lie within bf16 rounding and each flip moves the logits (0.03-0.17), so its bound is loose,
# yet far below a wrong input's (about 1.0), and at least 90 % of the kept tokens must agree.
MODEL_FP32_TOL, MODEL_DENSE_BF16_TOL, MODEL_ROUTED_BF16_TOL, MODEL_BF16_OVERLAP = 1e-4, 5e-2, 0.3, 0.9
MIN_REPEATS = 3  # fewer timed rounds than this: skip rather than report noise

QUICK_MODEL = {"name": "vit_tiny_patch16_224", "kwargs": {"img_size": 64, "patch_size": 8, "depth": 4}}


def model_spec(name: str) -> dict[str, Any]:
    return {"name": name, "kwargs": {}}


def make_plan(device: torch.device, quick: bool) -> dict[int, dict[str, Any]]:
    """Every setting of every section (all of it goes into the report). Three sizes: the GPU run
    (the issue's models and shapes), ``--quick`` (tiny, seconds on a CPU), and a full run on the CPU
    (DeiT-S-sized, as the CPU benchmarks measure)."""
    cuda = device.type == "cuda"
    size = "quick" if quick else ("cuda" if cuda else "cpu")
    deit_s, vit_b, vit_l = (model_spec(n) for n in ("deit_small_patch16_224", "vit_base_patch16_224",
                                                     "vit_large_patch16_224"))
    dinov2 = {"name": "vit_small_patch14_dinov2", "kwargs": {"img_size": 224, "num_classes": 0}}
    # (B, H, Nq, Nk, D): the models' N, tile remainders (70, 100, 300), Nq != Nk, D = 80
    full_shapes = [[4, 6, 197, 197, 64], [2, 12, 257, 257, 64], [2, 12, 1025, 1025, 64], [1, 16, 4097, 4097, 64],
                   [2, 3, 70, 70, 64], [2, 4, 100, 300, 64], [3, 4, 197, 197, 80]]
    attn_shapes = {"quick": [[2, 3, 17, 17, 32], [1, 2, 70, 70, 64], [2, 2, 9, 40, 16], [1, 2, 130, 130, 64],
                             [1, 1, 197, 197, 64]],
                   "cuda": full_shapes,
                   "cpu": [[1, 2, *sh[2:]] if sh[2] > 1000 else sh for sh in full_shapes]}[size]
    if cuda:
        kernel_cases = [[b, h, nq, nk, d, bm, bn] for b, h, nq, nk, d in
                        ([2, 3, 70, 70, 64], [1, 4, 197, 197, 64], [2, 2, 100, 300, 64]) for bm, bn in ([32, 32], [128, 64])]
    else:  # Triton's interpreter: tiny shapes (small tiles are slow there)
        kernel_cases = [[1, 2, 5, 5, 32, 16, 16], [2, 2, 9, 40, 32, 16, 16], [1, 2, 33, 33, 64, 16, 16],
                        [1, 2, 70, 70, 64, 32, 32], [1, 2, 197, 197, 64, 64, 64]]
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    speed_jobs = {"quick": [(QUICK_MODEL, 8), (QUICK_MODEL, 1)],
                  "cuda": [(deit_s, 256), (vit_b, 256), (vit_b, 1), (vit_l, 256)],
                  "cpu": [(deit_s, 32), (deit_s, 1)]}[size]
    return {
        1: {"attention_shapes_BHNqNkD": attn_shapes,
            "dtypes": ["float32", "bfloat16"] if cuda else ["float64", "float32", "bfloat16"],
            "methods": ["onepass"] if cuda else ["onepass", "lse"], "tolerance": TOLERANCE,
            "kernel_cases_BHNqNkD_blockm_blockn": kernel_cases,
            "kernel_runs": "cuda" if cuda else ("cpu, TRITON_INTERPRET=1" if interp else "skipped"),
            "model": QUICK_MODEL if quick else deit_s, "model_batch": 4,
            "model_variants": ["dense", "A-MoD C=0.5", "standard MoD C=0.5", "A-MoD fold @ 0.75"],
            "model_tolerance": {"fp32_logits": MODEL_FP32_TOL, "bf16_dense_logits": MODEL_DENSE_BF16_TOL,
                                "bf16_routed_logits": MODEL_ROUTED_BF16_TOL, "bf16_kept_overlap": MODEL_BF16_OVERLAP},
            "qkv_init": "N(0, 1/dim): attention far from uniform, so the kept tokens are not near-ties"},
        2: {"jobs": [{"model": m, "batch": b} for m, b in speed_jobs],
            "capacities": [0.5, 0.125], "layers": "alternate", "amp": "bf16" if cuda else "off",
            "repeats": {"quick": 3, "cuda": 10, "cpu": 10}[size],
            "repeats_batch1": {"quick": 5, "cuda": 30, "cpu": 20}[size],
            "warmup": {"quick": 1, "cuda": 3, "cpu": 3}[size],
            "matched": "A-MoD fold (layers all) and ToMe at the cost of each A-MoD capacity (amod.flops ratio)"},
        3: {"shapes_BHND": {"quick": [[4, 3, 65, 64], [1, 2, 257, 64]], "cuda": [[256, 12, 197, 64], [2, 12, 4097, 64]],
                            "cpu": [[32, 6, 197, 64], [2, 12, 4097, 64]]}[size],
            "dtype": "bfloat16" if cuda else "float32", "repeats": {"quick": 3, "cuda": 20, "cpu": 5}[size],
            "warmup": {"quick": 1, "cuda": 5, "cpu": 2}[size], "calls_per_timing": 10 if cuda else 1,
            "memory_N": ([65, 257] if quick else [2049, 4097]) if cuda else None},
        4: {"model": {"quick": QUICK_MODEL, "cuda": vit_b, "cpu": deit_s}[size],
            "batch": {"quick": 4, "cuda": 64, "cpu": 8}[size], "steps": {"quick": 5, "cuda": 200, "cpu": 20}[size],
            "untimed_steps": 1 if quick else 5, "lr": 1e-4, "weight_decay": 0.05,
            "capacity": 0.125, "layers": "alternate", "amp": "bf16" if cuda else "off",
            "data": "one fixed batch of random images and labels", "ddp_steps": 2 if quick else 3,
            "ddp_backend": "nccl" if cuda else "gloo"},
        5: {"models": {"quick": [QUICK_MODEL], "cuda": [deit_s, vit_b, dinov2], "cpu": [deit_s]}[size],
            "methods": list(FRONTIER_METHODS), "costs": {"quick": [0.7], "cuda": [0.4, 0.5, 0.56, 0.7],
                                                         "cpu": [0.5]}[size],
            "batches": {"quick": [4, 1], "cuda": [256, 1], "cpu": [32, 1]}[size], "amp": "bf16" if cuda else "off",
            "repeats": {"quick": 3, "cuda": 10, "cpu": 5}[size], "repeats_batch1": {"quick": 3, "cuda": 20, "cpu": 10}[size],
            "warmup": {"quick": 1, "cuda": 3, "cpu": 2}[size],
            # compiled (amod.compile): dense and these points, in this order, while the budget lasts
            "compile": {"quick": [{"model": QUICK_MODEL["name"], "batch": 4, "points": ["A-MoD calibrated @ 0.7"]}],
                        "cuda": [{"model": "deit_small_patch16_224", "batch": 256,
                                  "points": ["A-MoD calibrated @ 0.5", "ToMe @ 0.5"]},
                                 {"model": "vit_base_patch16_224", "batch": 256,
                                  "points": ["A-MoD calibrated @ 0.5", "ToMe @ 0.5"]},
                                 {"model": "vit_base_patch16_224", "batch": 1, "points": ["A-MoD calibrated @ 0.5"]},
                                 {"model": "vit_small_patch14_dinov2", "batch": 256,
                                  "points": ["A-MoD calibrated @ 0.5", "calibrated, nothing protected @ 0.5"]}],
                        "cpu": [{"model": "deit_small_patch16_224", "batch": 32,
                                 "points": ["A-MoD calibrated @ 0.5"]}]}[size],
            "compile_backend": "aot_eager" if quick else None, "compile_need_s": {"quick": 1, "cuda": 40, "cpu": 90}[size],
            "eager_share": 0.4,  # of the section's budget for the eager and CUDA-graph pass; the compiles get the rest
            "cpu_frontier_model": "vit_small_patch14_dinov2",
            "cpu_frontier": "docs/frontier_dinov2_224.json: settings and accuracy of the same computation"},
    }


# ---------------------------------------------------------------- sections, budgets, items

class Skipped(Exception):
    """An item that cannot or need not run here; its message is the reason."""


class Budget:
    """Seconds left for one section: its own budget, cut to the run's deadline."""

    def __init__(self, seconds: float, deadline: float) -> None:
        self.end = min(time.monotonic() + seconds, deadline)

    def left(self) -> float:
        return self.end - time.monotonic()


def error_record(e: BaseException) -> dict[str, Any]:
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    return {"type": type(e).__name__, "message": str(e)[:2000],
            "traceback": "".join(lines).strip().splitlines()[-8:]}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Section:
    """The record of one section: its items (ok / failed / skipped), tables and errors."""

    def __init__(self, number: int, settings: dict[str, Any], budget: Budget, device: torch.device) -> None:
        self.number, self.settings, self.budget, self.device = number, settings, budget, device
        self.items: list[dict[str, Any]] = []
        self.error: Optional[dict[str, Any]] = None

    def add(self, name: str, status: str, **fields: Any) -> dict[str, Any]:
        item = {"name": name, "status": status, **fields}
        self.items.append(item)
        note = item_note(item)
        print(f"  [{status:7s}] {name}" + (f": {note}" if note else ""), flush=True)
        return item

    def attempt(self, name: str, fn: Callable[[], dict[str, Any]], need_s: float = 0.0) -> Optional[dict[str, Any]]:
        """Run one item; a failure is recorded and the section goes on. ``fn`` returns the item's fields,
        with ``passed`` False when a check misses its tolerance."""
        if self.budget.left() < need_s:
            return self.add(name, "skipped", reason=f"time budget: {max(0.0, self.budget.left()):.0f} s left")
        try:
            fields = fn()
        except Skipped as e:
            outcome = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - every error is recorded, none ends the run
            outcome = {"status": "failed", "error": error_record(e)}
        else:
            return self.add(name, "ok" if fields.pop("passed", True) else "failed", **fields)
        # out of the except clause: the traceback, and the tensors its frames hold, are gone
        free_memory(self.device)
        return self.add(name, **outcome)

    def status(self) -> str:
        states = {i["status"] for i in self.items}
        if self.error is not None or "failed" in states:
            return "failed"
        return "skipped" if states == {"skipped"} else "ok"


def run_section(number: int, body: Callable[[Section], None], settings: dict[str, Any], budget: Budget,
                device: torch.device, fail: bool = False) -> dict[str, Any]:
    print(f"[{number}] {TITLES[number]} (budget {max(0.0, budget.left()):.0f} s)", flush=True)
    sec = Section(number, settings, budget, device)
    start = time.monotonic()
    try:
        if fail:
            raise RuntimeError(f"section {number} made to fail by --fail-section (a test of the report)")
        if budget.left() <= 0:
            raise Skipped("the run's total time budget is spent")
        body(sec)
    except Skipped as e:
        sec.add(TITLES[number], "skipped", reason=str(e))
    except Exception as e:  # noqa: BLE001
        sec.error = error_record(e)
        print(f"  [failed ] {type(e).__name__}: {e}", flush=True)
    free_memory(device)
    seconds = time.monotonic() - start
    print(f"[{number}] {TITLES[number]}: {sec.status()} in {seconds:.1f} s", flush=True)
    return {"title": TITLES[number], "status": sec.status(), "seconds": seconds,
            "budget_s": settings.get("budget_s"), "settings": settings, "items": sec.items, "error": sec.error}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def amp_label(amp: str) -> str:
    return "bf16 autocast" if amp == "bf16" else "fp32"


def autocast(amp: str, device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if amp == "bf16" else nullcontext()


@contextmanager
def exact_fp32() -> Iterator[None]:
    """No TF32 in matmuls and convolutions (cuDNN allows it by default): fp32 means fp32 here."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def build_model(spec: dict[str, Any], seed: int = 0) -> nn.Module:
    """A random-weight timm model on the CPU (weights do not change speed; there is no network)."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model(spec["name"], pretrained=False, **spec["kwargs"]).eval()


def input_size(model: nn.Module) -> tuple[int, int]:
    return tuple(model.patch_embed.img_size)


def variant(dense: nn.Module, name: str) -> nn.Module:
    """A converted copy of ``dense`` named like 'A-MoD C=0.5', 'standard MoD C=0.5', 'A-MoD fold @ 0.75'."""
    model = copy.deepcopy(dense)
    if name == "dense":
        return model
    if name.startswith("A-MoD fold @ "):
        amod.convert(model, router="attention", skipped="fold")
        return amod.set_capacity(model, amod.capacity_for_cost(model, float(name.rsplit(" ", 1)[1])))
    if name.startswith("ToMe @ "):
        return amod.tome.apply(model, cost=float(name.rsplit(" ", 1)[1]))
    router = {"A-MoD": "attention", "standard MoD": "standard"}[name.split(" C=")[0]]
    return amod.convert(model, router=router, capacity=float(name.split(" C=")[1]))


def is_routed(model: nn.Module) -> bool:
    """Whether ``amod.convert`` made ``model`` an MoD model."""
    try:
        amod.get_config(model)
    except ValueError:
        return False
    return True


def folds(model: nn.Module) -> bool:
    """Whether ``model`` is an MoD model with ``skipped="fold"`` (its tokens change identity as they fold)."""
    return is_routed(model) and amod.get_config(model).skipped == "fold"


def describe(model: nn.Module) -> str:
    """The setting of a dense, MoD or ToMe model, for the report."""
    if is_routed(model):
        c = amod.get_config(model)
        blocks = "all" if list(c.layers) == list(range(len(model.blocks))) else list(c.layers)
        return f"router {c.router}, capacity {c.capacity:g}, skipped {c.skipped}, blocks {blocks}"
    schedule = getattr(getattr(model, "amod_tome", None), "schedule", None)
    return f"ToMe, tokens merged per block {schedule}" if schedule is not None else "timm, unconverted"


# ---------------------------------------------------------------- 1. correctness

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The explicit formula in float64: softmax(q k^T / sqrt(D)) v, and the mean attention each key received."""
    q, k, v = q.double(), k.double(), v.double()
    attn = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)  # (B, H, Nq, Nk)
    return attn @ v, attn.sum(dim=(1, 2)) / (q.shape[1] * q.shape[2])


def random_qkv(shape: list[int], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q (B, H, Nq, D), k and v (B, H, Nk, D); drawn on the CPU so every device gets the same numbers.
    Scaled by 2 so that the softmax is far from uniform."""
    B, H, Nq, Nk, D = shape
    g = torch.Generator().manual_seed(Nq * 1000 + Nk)
    return tuple((torch.randn(B, H, n, D, generator=g) * 2).to(device=device, dtype=dtype) for n in (Nq, Nk, Nk))


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise relative error (scores are positive)."""
    return ((got.double() - ref) / ref).abs().max().item()


def rel_to_max(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude (outputs cross zero)."""
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_attention(shape: list[int], dtype: str, method: str, device: torch.device) -> dict[str, Any]:
    q, k, v = random_qkv(shape, getattr(torch, dtype), device)
    with torch.no_grad():
        out, scores = attention_with_scores(q, k, v, method=method)
        ref_out, ref_scores = reference_attention(q, k, v)
    out_err, score_err = rel_to_max(out, ref_out), max_rel(scores, ref_scores)
    tol = TOLERANCE[dtype]
    if scores.dtype != torch.float32 or tuple(scores.shape) != (shape[0], shape[3]):
        raise AssertionError(f"scores are {scores.dtype} {tuple(scores.shape)}, want float32 {(shape[0], shape[3])}")
    return {"passed": max(out_err, score_err) <= tol, "out_error": out_err, "scores_error": score_err,
            "tolerance": tol, "summary": f"out {out_err:.1e}, scores {score_err:.1e} (tolerance {tol:g})"}


def triton_kernel() -> Callable[..., torch.Tensor]:
    """The Triton score kernel (imported late: it needs triton, and on the CPU Triton's interpreter)."""
    from amod.kernels.triton_scores import received_attention_triton

    return received_attention_triton


def check_kernel(case: list[int], dtype: str, device: torch.device) -> dict[str, Any]:
    *shape, block_m, block_n = case
    q, k, _ = random_qkv(shape, getattr(torch, dtype), device)
    with torch.no_grad():
        scores = triton_kernel()(q, k, shape[4] ** -0.5, block_m=block_m, block_n=block_n)
        _, ref = reference_attention(q, k, k)
    err, tol = max_rel(scores, ref), TOLERANCE[dtype]
    return {"passed": err <= tol, "scores_error": err, "tolerance": tol,
            "summary": f"scores {err:.1e} (tolerance {tol:g})"}


def sharpen_attention(model: nn.Module) -> nn.Module:
    """qkv weights ~ N(0, 1/dim): timm's random init gives near-uniform attention, where the kept tokens
    would be decided by ties; this gives logits of order one, as trained models have."""
    for blk in model.blocks:
        nn.init.normal_(blk.attn.qkv.weight, std=blk.attn.qkv.in_features ** -0.5)
    return model


def forward_record(model: nn.Module, x: torch.Tensor, device: torch.device, amp: str
                   ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Logits (float32, CPU) and each MoD block's kept patch indices of one forward of a copy on ``device``."""
    m = copy.deepcopy(model).to(device).eval()
    routed = is_routed(m) and not folds(m)  # a fold model has no kept indices to record
    if routed:
        amod.set_recording(m)
    with torch.no_grad(), autocast(amp, device):
        logits = m(x.to(device)).float().cpu()
    kept = [getattr(b, "amod_last_index", None) for _, b in amod.mod_blocks(m)] if routed else []
    return logits, [None if i is None else i.cpu() for i in kept]


def kept_agreement(a: list[Optional[torch.Tensor]], b: list[Optional[torch.Tensor]]) -> tuple[Optional[bool], Optional[float]]:
    """(every block kept the same tokens, mean share of kept tokens in common); None where nothing is recorded."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs:
        return None, None
    same = all(torch.equal(x, y) for x, y in pairs)
    overlap = statistics.mean((x[:, :, None] == y[:, None, :]).any(-1).float().mean().item() for x, y in pairs)
    return same, overlap


def compare_devices(model: nn.Module, x: torch.Tensor, device: torch.device, ref_device: torch.device,
                    amp: str) -> dict[str, Any]:
    """One model's forward on ``device`` (with ``amp``) against its fp32 forward on ``ref_device``."""
    ref_logits, ref_kept = forward_record(model, x, ref_device, "off")
    logits, kept = forward_record(model, x, device, amp)
    err = rel_to_max(logits, ref_logits.double())
    same, overlap = kept_agreement(kept, ref_kept)
    routed = is_routed(model)
    # a fold model's matching is discrete: near-ties flip with rounding (on the CPU alone, a 1e-5
    # input perturbation of the random-weight DeiT-S moves its logits by 0.08), so a CUDA forward is
    # held to the routed-model tolerance in fp32 too
    if amp == "off" and not folds(model):
        passed = err <= MODEL_FP32_TOL and same is not False
    else:
        passed = (err <= (MODEL_ROUTED_BF16_TOL if routed else MODEL_DENSE_BF16_TOL)
                  and (overlap is None or overlap >= MODEL_BF16_OVERLAP))
    summary = f"logits {err:.1e}" + ("" if same is None else f", same kept tokens {same}, overlap {overlap:.3f}")
    return {"passed": passed, "logits_error": err, "same_kept": same, "kept_overlap": overlap, "summary": summary}


def section_correctness(sec: Section) -> None:
    s, dev = sec.settings, sec.device
    with exact_fp32():
        for dtype in s["dtypes"]:
            for method in s["methods"]:
                for shape in s["attention_shapes_BHNqNkD"]:
                    sec.attempt(f"attention_with_scores {dtype} {method} {shape}",
                                lambda: check_attention(shape, dtype, method, dev), need_s=2)
        if dev.type == "cpu":
            sec.add("model forward: device against CPU", "skipped", reason="the device is the CPU")
        else:
            dense = sharpen_attention(build_model(s["model"]))
            x = torch.randn(s["model_batch"], 3, *input_size(dense), generator=torch.Generator().manual_seed(0))
            for name in s["model_variants"]:
                model = variant(dense, name)
                for amp in ("off", "bf16"):
                    sec.attempt(f"{s['model']['name']} {name}: {dev.type} {amp_label(amp)} vs cpu fp32",
                                lambda: compare_devices(model, x, dev, torch.device("cpu"), amp), need_s=5)
        # the kernel's own tile sizes last: attention_with_scores above already ran it with its defaults
        if s["kernel_runs"] == "skipped":
            sec.add("Triton score kernel", "skipped", reason="runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
            return
        for dtype in ("float32", "bfloat16"):
            for case in s["kernel_cases_BHNqNkD_blockm_blockn"]:
                sec.attempt(f"received_attention_triton {dtype} {case}", lambda: check_kernel(case, dtype, dev),
                            need_s=2)


# ---------------------------------------------------------------- 2. speed

def speed_variants(dense: nn.Module, capacities: list[float]) -> tuple[dict[str, nn.Module], list[str]]:
    """Dense, A-MoD at each capacity, then the fold mode and ToMe at each of those costs; and the notes of
    variants that cannot be built (ToMe cannot reach every cost on a small model)."""
    models, notes = {"dense": dense}, []
    for c in capacities:
        models[f"A-MoD C={c:g}"] = variant(dense, f"A-MoD C={c:g}")
    costs = [amod.flops(models[f"A-MoD C={c:g}"]).ratio for c in capacities]
    for kind in ("A-MoD fold", "ToMe"):
        for cost in costs:
            name = f"{kind} @ {cost:.3f}"
            try:
                models[name] = variant(dense, name)
            except ValueError as e:
                notes.append(f"{name}: {e}")
    return models, notes


def one_round(models: dict[str, nn.Module], x: torch.Tensor, amp: str) -> float:
    """Seconds for one forward of every model (the first also compiles the Triton kernels)."""
    sync(x.device)
    start = time.perf_counter()
    with torch.no_grad(), autocast(amp, x.device):
        for m in models.values():
            m(x)
    sync(x.device)
    return time.perf_counter() - start


def speed_job(job: dict[str, Any], s: dict[str, Any], device: torch.device, budget_s: float) -> dict[str, Any]:
    start = time.monotonic()
    dense = build_model(job["model"])
    models, notes = speed_variants(dense, s["capacities"])
    costs = {n: amod.flops(m).ratio for n, m in models.items()}
    settings = {n: describe(m) for n, m in models.items()}
    models = {n: m.to(device).eval() for n, m in models.items()}
    x = torch.randn(job["batch"], 3, *input_size(dense), device=device)
    # the dense model alone first: a round that cannot fit is skipped before it runs (a CPU at batch 256)
    guess = one_round({"dense": models["dense"]}, x, s["amp"]) * sum(costs.values())
    if guess * (2 + s["warmup"] + MIN_REPEATS) > budget_s - (time.monotonic() - start):
        raise Skipped(f"one round of {len(models)} models would take about {guess:.1f} s; the budget does not "
                      f"allow {2 + s['warmup'] + MIN_REPEATS} rounds")
    round_s = [one_round(models, x, s["amp"]) for _ in range(2)][-1]  # the first also compiles
    repeats = s["repeats"] if job["batch"] > 1 else s["repeats_batch1"]
    affordable = int((budget_s - (time.monotonic() - start)) / round_s) - s["warmup"]
    if affordable < MIN_REPEATS:
        raise Skipped(f"one round of {len(models)} models takes {round_s:.2f} s; the budget allows "
                      f"{max(0, affordable)} timed rounds")
    repeats = min(repeats, affordable)
    timed = time_models(models, x, repeats=repeats, warmup=s["warmup"], amp=s["amp"])
    dense_t = timed["dense"]
    rows = []
    for name, t in timed.items():
        bound = 1.0 / costs[name]
        speedup = t["images_per_s"] / dense_t["images_per_s"]
        paired = statistics.median(d / m for d, m in zip(dense_t["times"], t["times"]))
        rows.append({"variant": name, "setting": settings[name], "cost": costs[name],
                     "images_per_s": t["images_per_s"], "ms_per_batch": 1e3 * t["seconds"], "speedup": speedup,
                     "flop_bound": bound, "efficiency": speedup / bound, "paired_speedup": paired,
                     "paired_efficiency": paired / bound, "spread": t["spread"]})
    del models, x
    free_memory(device)
    best = max(rows[1:], key=lambda r: r["speedup"]) if len(rows) > 1 else rows[0]
    return {"model": job["model"], "batch": job["batch"], "repeats": repeats, "warmup": s["warmup"],
            "round_s": round_s, "rows": rows, "notes": notes,
            "summary": f"{len(rows)} variants, {repeats} rounds; fastest {best['variant']} x{best['speedup']:.2f}"}


def section_speed(sec: Section) -> None:
    s, jobs = sec.settings, sec.settings["jobs"]
    for i, job in enumerate(jobs):
        share = sec.budget.left() / (len(jobs) - i)  # what a job leaves unused goes to the later ones
        sec.attempt(f"{job['model']['name']} batch {job['batch']}", lambda: speed_job(job, s, sec.device, share),
                    need_s=5)


# ---------------------------------------------------------------- 3. score kernels

def repeat_call(fn: Callable[[], Any], times: int) -> Callable[[], Any]:
    def run() -> Any:
        for _ in range(times):
            out = fn()
        return out
    return run


def score_timing(shape: list[int], s: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """ms per call of sdpa alone, sdpa + scores (``attention_with_scores``) and, on CUDA, the score kernel alone."""
    B, H, N, D = shape
    q, k, v = random_qkv([B, H, N, N, D], getattr(torch, s["dtype"]), device)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
           "sdpa+scores": lambda: attention_with_scores(q, k, v)}
    if device.type == "cuda":
        kernel = triton_kernel()
        fns["scores kernel"] = lambda: kernel(q, k, D ** -0.5)
    inner = s["calls_per_timing"]
    timed = time_callables({n: repeat_call(f, inner) for n, f in fns.items()}, s["repeats"], s["warmup"], device)
    ms = {n: 1e3 * t["seconds"] / inner for n, t in timed.items()}
    overhead = ms["sdpa+scores"] / ms["sdpa"] - 1
    paired = statistics.median(a / b for a, b in zip(timed["sdpa+scores"]["times"], timed["sdpa"]["times"])) - 1
    return {"shape_BHND": shape, "dtype": s["dtype"], "ms": ms, "overhead": overhead, "paired_overhead": paired,
            "spread": {n: t["spread"] for n, t in timed.items()},
            "summary": f"sdpa {ms['sdpa']:.3f} ms, +scores {ms['sdpa+scores']:.3f} ms ({overhead:+.1%})"}


def cuda_peak_mb(fn: Callable[[], Any], device: torch.device) -> float:
    """Peak memory (MiB) that one call adds to what is allocated before it."""
    sync(device)
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return (peak - base) / 2**20


def score_memory(s: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Peak memory of sdpa, sdpa + scores and the explicit path at two N, and how it grows with N."""
    if device.type != "cuda":
        raise Skipped("peak memory is measured on CUDA (max_memory_allocated); for the CPU see "
                      "benchmarks/bench_scores.py")
    B, H, _, D = s["shapes_BHND"][-1]
    per_n = {}
    for n in s["memory_N"]:
        q, k, v = random_qkv([B, H, n, n, D], getattr(torch, s["dtype"]), device)
        per_n[n] = {"sdpa": cuda_peak_mb(lambda: F.scaled_dot_product_attention(q, k, v), device),
                    "sdpa+scores": cuda_peak_mb(lambda: attention_with_scores(q, k, v), device),
                    "explicit": cuda_peak_mb(lambda: attention_scores_explicit(q, k, v), device),
                    "fp32_matrix": B * H * n * n * 4 / 2**20}
        del q, k, v
    small, large = s["memory_N"]
    growth = per_n[large]["sdpa+scores"] / per_n[small]["sdpa+scores"]
    extra = per_n[large]["sdpa+scores"] - per_n[large]["sdpa"]
    linear = growth <= 1.25 * large / small and extra <= 0.05 * per_n[large]["fp32_matrix"]
    return {"B_H_D": [B, H, D], "dtype": s["dtype"], "peak_mb": per_n, "growth": growth, "growth_if_linear": large / small,
            "extra_over_sdpa_mb": extra, "linear": linear,
            "summary": f"N {small} -> {large}: sdpa+scores peak x{growth:.2f} (linear: x{large / small:.2f}), "
                       f"{extra:.1f} MiB over sdpa alone"}


def section_scores(sec: Section) -> None:
    s = sec.settings
    for shape in s["shapes_BHND"]:
        sec.attempt(f"time N = {shape[2]} {shape}", lambda: score_timing(shape, s, sec.device), need_s=3)
    sec.attempt("peak memory", lambda: score_memory(s, sec.device), need_s=3)


# ---------------------------------------------------------------- 4. training

def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, amp: str,
               inspect: Optional[Callable[[nn.Module], dict[str, Any]]] = None) -> tuple[float, dict[str, Any]]:
    """One AdamW step; ``inspect`` looks at the gradients between backward and the update."""
    opt.zero_grad(set_to_none=True)
    with autocast(amp, x.device):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    seen = inspect(model) if inspect is not None else {}
    opt.step()
    return loss.item(), seen


def grad_report(model: nn.Module) -> dict[str, Any]:
    """Where the gradients reached: each MoD block's qkv (and the router where it has weights), and
    whether any gradient is missing or not finite."""
    module = getattr(model, "module", model)  # DDP
    params = dict(module.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and p.grad is None]
    nonfinite = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    reached: dict[str, Optional[bool]] = {}
    last = len(module.blocks) - 1
    for i, _ in amod.mod_blocks(module) if is_routed(module) else []:
        for n in (f"blocks.{i}.attn.qkv.weight", f"blocks.{i}.router.proj.weight"):
            if n not in params:
                continue
            g = params[n].grad
            reached[n] = g is not None and bool(g.abs().sum() > 0)
            if "router" in n and i == last and getattr(module, "global_pool", None) == "token" and not reached[n]:
                reached[n] = None  # the last block's patch tokens never reach a class-token head: no gradient expected
    return {"missing": missing, "nonfinite": nonfinite, "reached": reached}


def train_variants(s: dict[str, Any], device: torch.device, budget_s: float) -> dict[str, Any]:
    """dense, A-MoD and standard MoD, one step each in turn (rotating order), timed after the untimed steps."""
    start = time.monotonic()
    dense = build_model(s["model"])
    names = ["dense", f"A-MoD C={s['capacity']:g}", f"standard MoD C={s['capacity']:g}"]
    models = {n: variant(dense, n).to(device).train() for n in names}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=s["lr"], weight_decay=s["weight_decay"]) for n, m in models.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s["batch"], 3, *input_size(dense), generator=g).to(device)
    y = torch.randint(0, dense.num_classes, (s["batch"],), generator=g).to(device)
    losses: dict[str, list[float]] = {n: [] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    grads: dict[str, dict[str, Any]] = {}
    steps = 0
    for step in range(s["steps"]):
        if step >= s["untimed_steps"] + MIN_REPEATS and time.monotonic() - start > budget_s:
            break  # the budget is spent: report the steps done
        for name in names[step % 3:] + names[:step % 3]:
            sync(device)
            t0 = time.perf_counter()
            loss, seen = train_step(models[name], opts[name], x, y, s["amp"], grad_report if step == 0 else None)
            sync(device)
            if step >= s["untimed_steps"]:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
            grads.setdefault(name, seen)
        steps += 1
    if steps <= s["untimed_steps"]:
        raise Skipped(f"the budget allowed {steps} steps, all untimed")
    rows, problems = [], []
    dense_s = statistics.median(times["dense"])
    for name in names:
        sec_per_step = statistics.median(times[name])
        gr = grads[name]
        finite = all(math.isfinite(v) for v in losses[name])
        if not finite:
            problems.append(f"{name}: non-finite loss")
        if gr["missing"]:
            problems.append(f"{name}: no gradient for {gr['missing'][:3]}")
        if gr["nonfinite"]:
            problems.append(f"{name}: non-finite gradient in {gr['nonfinite'][:3]}")
        problems += [f"{name}: zero gradient at {n}" for n, ok in gr["reached"].items() if ok is False]
        if name.startswith("standard") and not any("router" in n and ok for n, ok in gr["reached"].items()):
            problems.append(f"{name}: no router weight received a gradient")
        rows.append({"variant": name, "steps_per_s": 1 / sec_per_step, "images_per_s": s["batch"] / sec_per_step,
                     "speedup": dense_s / sec_per_step, "first_loss": losses[name][0],
                     "last_loss": statistics.mean(losses[name][-5:]), "losses_finite": finite,
                     "grads_reached": gr["reached"], "setting": describe(models[name])})
    del models, opts
    free_memory(device)
    return {"passed": not problems, "problems": problems, "steps": steps, "rows": rows,
            "summary": "; ".join(problems) or ", ".join(f"{r['variant']} {r['steps_per_s']:.2f} steps/s" for r in rows)}


def ddp_check(s: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A-MoD and standard MoD under DistributedDataParallel in one process (NCCL on CUDA, gloo on the CPU):
    the gradient all-reduce sees every parameter (an unused one would make DDP raise)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        raise Skipped("a process group is already initialised")
    dense = build_model(s["model"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s["batch"], 3, *input_size(dense), generator=g).to(device)
    y = torch.randint(0, dense.num_classes, (s["batch"],), generator=g).to(device)
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(s["ddp_backend"], init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            for name in (f"A-MoD C={s['capacity']:g}", f"standard MoD C={s['capacity']:g}"):
                model = variant(dense, name).to(device).train()
                ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
                opt = torch.optim.AdamW(ddp.parameters(), lr=s["lr"])
                losses[name] = [train_step(ddp, opt, x, y, s["amp"])[0] for _ in range(s["ddp_steps"])]
        finally:
            dist.destroy_process_group()
    finite = all(math.isfinite(v) for ls in losses.values() for v in ls)
    return {"passed": finite, "backend": s["ddp_backend"], "losses": losses,
            "summary": f"{s['ddp_backend']}, world size 1, {s['ddp_steps']} steps each, losses finite: {finite}"}


def section_training(sec: Section) -> None:
    s = sec.settings
    sec.attempt("AdamW steps: dense, A-MoD, standard MoD", lambda: train_variants(s, sec.device, sec.budget.left() - 8),
                need_s=10)
    sec.attempt("DDP, one process", lambda: ddp_check(s, sec.device), need_s=3)


# ---------------------------------------------------------------- 5. frontier

FRONTIER_METHODS = ("ToMe", "PiToMe", "A-MoD fold", "A-MoD calibrated", "calibrated, nothing protected",
                    "A-MoD (paper)")
CPU_FRONTIER = Path(__file__).resolve().parents[1] / "docs" / "frontier_dinov2_224.json"


def cpu_frontier_rows() -> list[dict[str, Any]]:
    """The rows of the CPU frontier on DINOv2 ViT-S/14 at 224 px (``amod frontier``): each point's setting and its
    measured accuracy, the settings the GPU times again ("the same computation")."""
    import json

    return json.loads(CPU_FRONTIER.read_text())["rows"] if CPU_FRONTIER.is_file() else []


def method_from_setting(setting: dict[str, Any]) -> amod.Method:
    """The method of a frontier row's ``setting`` (its ``run_fields``)."""
    from amod.methods import method_from_run_fields
    from amod.train.config import RunConfig

    return method_from_run_fields(RunConfig(**setting))


def frontier_method(name: str, dense: nn.Module, cost: float, rows: list[dict[str, Any]], same_model: bool
                    ) -> tuple[amod.Method, str]:
    """``name`` at ``cost`` on ``dense`` and where its setting comes from. On the CPU frontier's own model
    (``same_model``) at one of its costs: that point's setting. Elsewhere ToMe, PiToMe, fold and the paper's MoD are
    set to the cost on this model; a calibrated method takes the schedule (tilt and protect) the CPU frontier chose
    at the nearest cost, its capacity set to the cost here (no calibration images on the GPU machine)."""
    mine = [r for r in rows if r["method"] == name]
    exact = next((r for r in mine if r["cost_target"] == cost), None)
    if same_model and exact is not None:
        return method_from_setting(exact["setting"]), "the CPU frontier's point"
    depth = len(dense.blocks)
    if name in ("A-MoD calibrated", "calibrated, nothing protected"):
        near = min(mine, key=lambda r: abs(r["cost_target"] - cost), default=None)
        if near is not None and len(near["setting"]["shape"]) == depth:
            s = near["setting"]
            base = amod.MoD(skipped="fold", protect=s["protect"], shape=tuple(s["shape"]))
            return base.at_cost(dense, cost), f"the CPU frontier's schedule at {near['cost_target']:g}"
        from amod.mod.calibrate import tilt_shape

        base = amod.MoD(skipped="fold", protect=0.0, shape=tuple(tilt_shape(-1.0, depth)))
        return base.at_cost(dense, cost), "tilt -1, nothing protected (no CPU frontier schedule of this depth)"
    base = {"ToMe": amod.TokenMerging(), "PiToMe": amod.PiToMe(), "A-MoD fold": amod.MoD(skipped="fold"),
            "A-MoD (paper)": amod.MoD()}[name]
    return base.at_cost(dense, cost), "set to the cost on this model"


def timed_rows(models: dict[str, Any], x: torch.Tensor, amp: str, repeats: int, warmup: int,
               device: torch.device) -> dict[str, dict[str, float]]:
    """ms per batch and speed-up over ``models["dense"]`` (round by round, against the dense runs around each call:
    ``time_models`` with dense the reference, as ``amod frontier`` times), all interleaved on ``x``'s device."""
    timed = time_models(models, x, repeats, warmup, amp, reference="dense")
    return {n: {"ms": 1e3 * t["seconds"], "spread": t["spread"], "speedup": t["speedup"]} for n, t in timed.items()}


def frontier_models(spec: dict[str, Any], s: dict[str, Any], only: Optional[list[str]] = None
                    ) -> tuple[dict[str, nn.Module], dict[str, dict[str, Any]]]:
    """Dense and every (method, cost) point of section 5 on ``spec`` (``only``: these points), on the CPU, and each
    point's record: its cost, setting, where the setting comes from, and the CPU frontier's accuracy where the point
    is that frontier's own computation. A point whose setting repeats an earlier point's, of its method (a cost below
    its floor) or of another, is recorded as such (``same_as``) and not built or timed twice: ``same_setting_as``, the
    rule by which `amod frontier` times."""
    rows_cpu = cpu_frontier_rows()
    same_model = spec["name"] == s["cpu_frontier_model"]
    dense = build_model(spec)
    points: dict[str, dict[str, Any]] = {}
    methods: dict[str, amod.Method] = {}
    for name in s["methods"]:
        for cost in s["costs"]:
            key = f"{name} @ {cost:g}"
            if only is not None and key not in only:
                continue
            try:
                methods[key], source = frontier_method(name, dense, cost, rows_cpu, same_model)
            except ValueError as e:
                points[key] = {"method": name, "cost_target": cost, "error": str(e)}
                continue
            cpu = next((r for r in rows_cpu if same_model and r["method"] == name and r["cost_target"] == cost
                        and r["method_repr"] == repr(methods[key])), None)
            points[key] = {"method": name, "cost_target": cost, "setting": repr(methods[key]), "source": source,
                           "cpu_top1": None if cpu is None else cpu["top1"]}
    models: dict[str, nn.Module] = {"dense": dense}
    for key, first in same_setting_as({k: repr(m) for k, m in methods.items()}).items():  # (amod frontier's rule)
        if first != key:
            points[key]["same_as"] = first
            continue
        models[key] = methods[key].apply(copy.deepcopy(dense)).eval()
        points[key]["cost"] = amod.flops(models[key]).ratio
    return models, points


def frontier_job(spec: dict[str, Any], s: dict[str, Any], device: torch.device, budget: Budget) -> dict[str, Any]:
    """Every method at every cost against dense on one model, eager and as CUDA graphs (``amod.compile``'s
    ``cuda-graphs``: eager PyTorch's kernels, their launches gone), at each batch size."""
    models, points = frontier_models(spec, s)
    models = {n: m.to(device) for n, m in models.items()}
    dtype = torch.bfloat16 if s["amp"] == "bf16" else None
    per_batch: dict[str, Any] = {}
    for batch in s["batches"]:
        if budget.left() < 3:
            per_batch[str(batch)] = {"skipped": "time budget"}
            continue
        x = torch.randn(batch, 3, *input_size(models["dense"]), device=device)
        repeats = s["repeats"] if batch > 1 else s["repeats_batch1"]
        result: dict[str, Any] = {"eager": timed_rows(models, x, s["amp"], repeats, s["warmup"], device)}
        if device.type == "cuda":
            graphs, seconds = {}, {}
            for n, m in models.items():
                try:
                    graphs[n] = amod.compile(m, x, mode="cuda-graphs", dtype=dtype)
                    seconds[n] = graphs[n].amod_compile_seconds
                except Exception as e:  # noqa: BLE001 - recorded per model
                    result.setdefault("graph_errors", {})[n] = f"{type(e).__name__}: {str(e)[:300]}"
            if "dense" in graphs:
                result["cuda_graphs"] = timed_rows(graphs, x, "off", repeats, s["warmup"], device)
                result["capture_s"] = seconds
            del graphs
        del x
        free_memory(device)
        per_batch[str(batch)] = result
    del models
    free_memory(device)
    return {"model": spec, "points": points, "batches": per_batch,
            "summary": f"{sum('cost' in p for p in points.values())} points, batches {', '.join(per_batch)}"}


def compiled_job(job: dict[str, Any], s: dict[str, Any], device: torch.device, budget: Budget) -> dict[str, Any]:
    """Dense and a few points compiled by ``amod.compile`` (one graph, static shapes; CUDA graphs on a GPU) at one
    batch size, each compile timed, then all timed interleaved (compiled against compiled)."""
    spec = next(m for m in s["models"] if m["name"] == job["model"])
    models, points = frontier_models(spec, s, only=job["points"])
    dtype = torch.bfloat16 if s["amp"] == "bf16" else None
    x = torch.randn(job["batch"], 3, *input_size(models["dense"]), device=device)
    compiled, seconds, skipped = {}, {}, None
    for n, m in models.items():
        if budget.left() < s["compile_need_s"]:
            skipped = f"time budget: {max(0.0, budget.left()):.0f} s left before compiling {n}"
            break
        compiled[n] = amod.compile(m.to(device), x, dtype=dtype, backend=s["compile_backend"])
        seconds[n] = compiled[n].amod_compile_seconds
    if len(compiled) < 2:
        raise Skipped(skipped or "nothing to compare")
    repeats = s["repeats"] if job["batch"] > 1 else s["repeats_batch1"]
    timed = timed_rows(compiled, x, "off", repeats, s["warmup"], device)
    del compiled, models, x
    torch._dynamo.reset()
    free_memory(device)
    return {"model": spec, "batch": job["batch"], "points": points, "compiled": timed, "compile_s": seconds,
            "skipped": skipped, "summary": ", ".join(f"{n} x{t['speedup']:.2f} (compiled in {seconds[n]:.0f} s)"
                                                       for n, t in timed.items() if n != "dense")}


def section_frontier(sec: Section) -> None:
    s = sec.settings
    eager_end = time.monotonic() + s["eager_share"] * sec.budget.left()
    for i, spec in enumerate(s["models"]):
        share = Budget((eager_end - time.monotonic()) / (len(s["models"]) - i), sec.budget.end)
        sec.attempt(f"frontier {spec['name']}", lambda: frontier_job(spec, s, sec.device, share), need_s=5)
    for job in s["compile"]:  # what is left, in this order
        sec.attempt(f"compiled {job['model']} batch {job['batch']}",
                    lambda: compiled_job(job, s, sec.device, sec.budget), need_s=2 * s["compile_need_s"])

SECTIONS: dict[int, Callable[[Section], None]] = {1: section_correctness, 2: section_speed, 3: section_scores,
                                                  4: section_training, 5: section_frontier}


# ---------------------------------------------------------------- targets and report

def find_item(report: dict[str, Any], section: int, prefix: str) -> Optional[dict[str, Any]]:
    items = report["sections"].get(str(section), {}).get("items", [])
    return next((i for i in items if i["name"].startswith(prefix) and i["status"] == "ok"), None)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for the GPU run: met, not met, or not measured (None) with the reason."""
    full_gpu = report["machine"]["device"] == "cuda" and not report["settings"]["quick"]
    why = None if full_gpu else "the targets are for the full run on CUDA"
    out = []
    job = find_item(report, 2, "vit_base_patch16_224 batch 256")
    row = next((r for r in (job or {}).get("rows", []) if r["variant"] == "A-MoD C=0.125"), None)
    eff = None if row is None else row["efficiency"]
    out.append({"target": "A-MoD C=0.125, ViT-B, batch 256, bf16: efficiency >= 0.9", "value": eff,
                "met": None if why or eff is None else eff >= 0.9, "note": why or ("" if row else "not measured")})
    timing = find_item(report, 3, "time N = 197")
    ov = None if timing is None else timing["overhead"]
    out.append({"target": "score kernels add <= 10 % to sdpa at N = 197", "value": ov,
                "met": None if why or ov is None else ov <= 0.10, "note": why or ("" if timing else "not measured")})
    out += frontier_targets(report, why)
    mem = find_item(report, 3, "peak memory")
    out.append({"target": "sdpa + scores O(N) in memory at N = 4097", "value": None if mem is None else mem["growth"],
                "met": None if why or mem is None else mem["linear"],
                "note": why or ("peak growth from N = 2049 to 4097" if mem else "not measured")})
    return out


def frontier_targets(report: dict[str, Any], why: Optional[str]) -> list[dict[str, Any]]:
    """The GPU-speed issue's targets read off section 5 (each method against dense run the same way)."""
    out = []

    def speedup(model: str, batch: int, way: str, key: str) -> Optional[float]:
        if way == "compiled":
            got = (find_item(report, 5, f"compiled {model} batch {batch}") or {}).get("compiled", {}).get(key)
        else:
            item = find_item(report, 5, f"frontier {model}")
            got = (item or {}).get("batches", {}).get(str(batch), {}).get(way, {}).get(key)
        return None if got is None else got["speedup"]

    checks = [("A-MoD calibrated @ 0.5, DeiT-S, batch 256, eager: >= 1.5x dense", "deit_small_patch16_224", 256,
               "eager", 1.5),
              ("A-MoD calibrated @ 0.5, DeiT-S, batch 256, compiled: >= 1.5x dense", "deit_small_patch16_224", 256,
               "compiled", 1.5),
              ("A-MoD calibrated @ 0.5, ViT-B/16, batch 256, eager: >= 1.7x dense", "vit_base_patch16_224", 256,
               "eager", 1.7),
              ("A-MoD calibrated @ 0.5, ViT-B/16, batch 256, compiled: >= 1.7x dense", "vit_base_patch16_224", 256,
               "compiled", 1.7),
              ("A-MoD calibrated @ 0.5, ViT-B/16, batch 1, CUDA graphs: >= 1.2x dense", "vit_base_patch16_224", 1,
               "cuda_graphs", 1.2)]
    for target, model, batch, way, bound in checks:
        value = speedup(model, batch, way, "A-MoD calibrated @ 0.5")
        out.append({"target": target, "value": value, "met": None if why or value is None else value >= bound,
                    "note": why or ("" if value is not None else "not measured")})
    item = find_item(report, 5, "compiled deit_small_patch16_224 batch 256")
    seconds = (item or {}).get("compile_s", {}).get("A-MoD calibrated @ 0.5")
    out.append({"target": "compiling a reduced DeiT-S (calibrated @ 0.5, batch 256) <= 90 s", "value": seconds,
                "met": None if why or seconds is None else seconds <= 90,
                "note": why or ("" if seconds is not None else "not measured")})
    out.append({"target": "ToMe at least as fast as the public ToMe's merge at the same r", "value": None,
                "met": None, "note": "not measured here: the public ToMe's code is not part of this repository"})
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
    import timm

    def version(pkg: str) -> Optional[str]:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {"device": device.type, "description": machine(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda, "triton": version("triton"), "timm": timm.__version__,
                            "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
                            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=props.total_memory / 2**30, cudnn=torch.backends.cudnn.version())
    else:
        info["name"] = machine().split(";")[0]
    return info


def fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def md_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown rows for ``columns`` = (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k), f).replace("|", "/") for _, k, f in columns) + " |")
    return lines


def item_note(item: dict[str, Any]) -> str:
    """An item's one-line result: the reason it was skipped, its error, or its summary."""
    if item.get("error"):
        return f"{item['error']['type']}: {item['error']['message']}"
    return item.get("reason") or item.get("summary", "")


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# amod GPU check: {m['name']}", "",
             f"Device: **{m['name']}** ({m['device']}); torch {m['torch']} (CUDA {m['torch_cuda']}), "
             f"triton {m['triton']}, timm {m['timm']}, Python {m['python']}; "
             f"{'quick' if report['settings']['quick'] else 'full'} run of {report['wall_s']:.0f} s, "
             f"{report['started']}. Overall: **{'ok' if report['ok'] else 'FAILED'}**.", ""]
    lines += md_table([{"section": f"{n}. {s['title']}", **s} for n, s in report["sections"].items()],
                      [("section", "section", ""), ("status", "status", ""), ("seconds", "seconds", ".1f"),
                       ("budget s", "budget_s", ".0f")])
    lines += ["", "## Targets", ""]
    lines += md_table(report["targets"], [("target", "target", ""), ("value", "value", ".3f"), ("met", "met", ""),
                                          ("note", "note", "")])
    for n, sec in report["sections"].items():
        lines += ["", f"## {n}. {sec['title']}: {sec['status']}", ""]
        if sec["error"]:
            lines += [f"Error: `{sec['error']['type']}: {sec['error']['message']}`", "", "```",
                      *sec["error"]["traceback"], "```", ""]
        if sec["items"]:
            lines += md_table([{**i, "note": item_note(i)} for i in sec["items"]],
                              [("item", "name", ""), ("status", "status", ""), ("result", "note", "")])
        for item in sec["items"]:
            if n == "2" and item.get("rows"):
                lines += ["", f"**{item['model']['name']}, batch {item['batch']}** ({item['repeats']} interleaved "
                          f"rounds after {item['warmup']} discarded, medians; {amp_label(sec['settings']['amp'])})", ""]
                lines += md_table(item["rows"], [("variant", "variant", ""), ("cost", "cost", ".3f"),
                                                 ("images/s", "images_per_s", ".1f"), ("ms/batch", "ms_per_batch", ".2f"),
                                                 ("speed-up", "speedup", ".3f"),
                                                 ("FLOP bound", "flop_bound", ".3f"), ("efficiency", "efficiency", ".3f"),
                                                 ("per-round speed-up", "paired_speedup", ".3f"), ("spread", "spread", ".1%")])
                lines += [f"- {note}" for note in item["notes"]]
            if n == "3" and "ms" in item:
                lines += ["", f"**N = {item['shape_BHND'][2]}**, (B, H, N, D) = {tuple(item['shape_BHND'])}, "
                          f"{item['dtype']}: ms per call"]
                lines += [""] + md_table([{"op": k, "ms": v, "spread": item["spread"][k]} for k, v in item["ms"].items()],
                                         [("op", "op", ""), ("ms", "ms", ".4f"), ("spread", "spread", ".1%")])
            if n == "3" and "peak_mb" in item:
                lines += ["", f"**Peak memory (MiB)**, (B, H, D) = {tuple(item['B_H_D'])}, {item['dtype']}", ""]
                lines += md_table([{"N": k, **v} for k, v in item["peak_mb"].items()],
                                  [("N", "N", ""), ("sdpa", "sdpa", ".1f"), ("sdpa+scores", "sdpa+scores", ".1f"),
                                   ("explicit", "explicit", ".1f"), ("fp32 N×N matrix", "fp32_matrix", ".1f")])
            if n == "4" and item.get("rows"):
                lines += ["", f"**{sec['settings']['model']['name']}, batch {sec['settings']['batch']}, "
                          f"{item['steps']} steps** ({amp_label(sec['settings']['amp'])}, interleaved, medians)", ""]
                lines += md_table(item["rows"], [("variant", "variant", ""), ("steps/s", "steps_per_s", ".2f"),
                                                 ("images/s", "images_per_s", ".1f"), ("speed-up", "speedup", ".3f"),
                                                 ("first loss", "first_loss", ".3f"), ("last loss", "last_loss", ".3f")])
            if n == "5" and item.get("points"):
                lines += frontier_markdown(item, sec["settings"])
    settings = {k: v for k, v in report["settings"].items() if k != "per_section"}
    lines += ["", "## Settings", "", f"- run: `{dumps(settings)}`"]
    lines += [f"- section {n}: `{dumps(v)}`" for n, v in report["settings"]["per_section"].items()] + [""]
    return "\n".join(lines)


def frontier_markdown(item: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Section 5's tables: per batch size, every point's speed-up over dense run the same way (eager, CUDA graphs), with
    the CPU frontier's accuracy where the point is its computation; a compiled item's speed-ups and compile times."""
    lines = []
    how = f"{amp_label(settings['amp'])}; speed-up: dense time / method time, each run the same way, median of " \
          "interleaved rounds"
    if "compiled" in item:
        lines += ["", f"**{item['model']['name']}, batch {item['batch']}, compiled** ({how})", ""]
        lines += md_table([{"point": n, "speedup": t["speedup"], "ms": t["ms"], "compile_s": item["compile_s"][n]}
                           for n, t in item["compiled"].items()],
                          [("point", "point", ""), ("ms", "ms", ".2f"), ("speed-up", "speedup", ".3f"),
                           ("compile s", "compile_s", ".1f")])
        return lines + ([f"- {item['skipped']}"] if item.get("skipped") else [])
    for batch, res in item["batches"].items():
        lines += ["", f"**{item['model']['name']}, batch {batch}** ({how})", ""]
        if "skipped" in res:
            lines += [f"skipped: {res['skipped']}"]
            continue
        table = []
        for key in ["dense", *item["points"]]:
            p = item["points"].get(key, {"cost": 1.0, "cpu_top1": None, "source": ""})
            row = {"point": key, "cost": p.get("cost"), "cpu_top1": p.get("cpu_top1"),
                   "source": p.get("error", "")[:80] or (f"same setting as {p['same_as']}" if "same_as" in p
                                                          else p.get("source", ""))}
            for way in ("eager", "cuda_graphs"):
                got = res.get(way, {}).get(key)
                row[way] = None if got is None else got["speedup"]
            row["eager_ms"] = res["eager"].get(key, {}).get("ms")
            table.append(row)
        lines += md_table(table, [("point", "point", ""), ("cost", "cost", ".3f"), ("CPU top-1", "cpu_top1", ".4f"),
                                  ("eager ms", "eager_ms", ".2f"), ("eager", "eager", ".3f"),
                                  ("CUDA graphs", "cuda_graphs", ".3f"), ("setting from", "source", "")])
        for what in ("graph_errors",):
            if res.get(what):
                lines += [f"- {what.replace('_', ' ')}: {res[what]}"]
    return lines


def write_report(out: Path, report: dict[str, Any]) -> None:
    write_json(out / "gpu_check.json", report)
    write_text(out / "gpu_check.md", markdown(report))


# ---------------------------------------------------------------- main

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--quick", action="store_true", help="tiny shapes and models, few repeats (CI, the CPU)")
    p.add_argument("--sections", default="1,2,3,4,5", help="comma-separated section numbers (default 1,2,3,4,5)")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="time for the whole run, in seconds")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's; 1 with --quick on the CPU)")
    p.add_argument("--fail-section", type=int, default=None, help=argparse.SUPPRESS)  # tests the failure report
    args = p.parse_args(argv)
    try:
        args.sections = sorted({int(n) for n in args.sections.split(",") if n.strip()})
    except ValueError:
        p.error(f"--sections takes numbers from 1 to 5 separated by commas, got {args.sections!r}")
    if not args.sections or not set(args.sections) <= set(SECTIONS):
        p.error(f"--sections takes numbers from 1 to 5 separated by commas, got {args.sections}")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
                           "(use --device cpu to check the CPU path)")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def run(args: argparse.Namespace, device: torch.device) -> int:
    """Run the chosen sections, rewriting the reports after each; 0 when none failed, else 1."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.budget_s
    plan = make_plan(device, args.quick)
    report: dict[str, Any] = {
        "tool": "benchmarks/gpu_check.py", "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ok": False, "wall_s": 0.0, "machine": machine_info(device),
        "settings": {"device": device.type, "quick": args.quick, "sections": args.sections, "budget_s": args.budget_s,
                     "cpu_threads": torch.get_num_threads(), "section_budget_s": SECTION_BUDGET_S,
                     "per_section": {str(n): plan[n] for n in args.sections}},
        "sections": {}, "targets": []}
    print(f"gpu_check on {report['machine']['name']} ({device}), {'quick' if args.quick else 'full'} run", flush=True)
    for n in args.sections:
        settings = {**plan[n], "budget_s": SECTION_BUDGET_S[n]}
        budget = Budget(SECTION_BUDGET_S[n], deadline)
        report["sections"][str(n)] = run_section(n, SECTIONS[n], settings, budget, device, fail=args.fail_section == n)
        report["wall_s"] = time.monotonic() - start
        write_report(out, report)  # a run killed later keeps what it has measured
    report["targets"] = targets(report)
    report["ok"] = all(s["status"] != "failed" for s in report["sections"].values())
    report["wall_s"] = time.monotonic() - start
    write_report(out, report)
    for t in report["targets"]:
        print(f"target: {t['target']}: {fmt(t['value'])}, met: {fmt(t['met'])} {t['note']}")
    print(f"{'ok' if report['ok'] else 'FAILED'} in {report['wall_s']:.0f} s; wrote {out / 'gpu_check.json'} and "
          f"{out / 'gpu_check.md'}", flush=True)
    return 0 if report["ok"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except RuntimeError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    # --quick on the CPU: one thread; its numbers only show that the code runs, and two threads on a
    # shared CPU stall each other (a tiny forward went from 0.03 s to 0.5 s here)
    want = args.threads or (1 if args.quick and device.type == "cpu" else threads)
    torch.set_num_threads(want)
    try:
        return run(args, device)
    finally:
        torch.set_num_threads(threads)  # the tests call main() in their own process


if __name__ == "__main__":
    _args = parse_args()
    if _args.device == "cpu" or (_args.device == "auto" and not torch.cuda.is_available()):
        ensure_tunables()  # CPU timing: glibc's default allocator makes the ratios swing (see _common)
    sys.exit(main())
