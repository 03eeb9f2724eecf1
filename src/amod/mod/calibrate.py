"""``amod.calibrate``: A-MoD fold with its token schedule chosen on a few unlabeled images (no labels, no gradients).

A fold model (``amod.mod.fold``) keeps the same share C of its patch tokens in every block: the count falls
geometrically. How many tokens each block should remove at a given cost is a property of the weights, and a few
images tell it: ``calibrate`` tries a small grid of schedules at the asked cost and keeps the one whose features
stay closest to the dense model's on those images.

- A schedule is a *tilt* t: block i of L keeps C ** w_i of its patch tokens, with w_i ∝ exp(t · (i / (L − 1) − ½))
  scaled to mean 1 (``tilt_shape``). t = 0 is plain fold; t < 0 removes more tokens early, t > 0 more late. Every
  tilt is set to the cost by its capacity (``capacity_for_cost``), so the candidates cost the same MACs.
- With each tilt, A-MoD's protection is tried too (``protects``: the share of each block's patch tokens the
  attention router keeps from folding; 0 folds by similarity alone).
- Fidelity: the mean cosine similarity between the candidate's and the dense model's features (the class token
  after the final norm, what a head or a linear probe reads) on the images. Only candidates whose cost comes within
  2 % of the target (``amod.cost.COST_TOLERANCE``) are run; the most faithful wins, ties going to the earlier one.

Equal MACs is taken as equal time: on the CPU (batch 32) fold models of one cost with different schedules run at
the same speed within the timing noise (``benchmarks/bench_schedules.py``).

The choice is saved with the model (``MoDConfig.shape`` and ``protect``: checkpoints, ``amod.save``), and
``amod.set_capacity`` turns the dial along the chosen shape. ``model.amod_calibration`` holds every candidate's
fidelity (not saved).
"""
from __future__ import annotations

import copy
import logging
import math
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..cost import flops, misses_cost, tolerance_text, validate_cost
from ..family import family_of
from .config import MoDConfig, validate_protect
from .convert import capacity_for_cost, convert, get_config
from .routers import router_class
from ..errors import UserError

log = logging.getLogger("amod")

DEFAULT_TILTS = (-2.0, -1.0, 0.0, 1.0)
DEFAULT_PROTECTS = (0.0, 0.1, 0.25)


def tilt_shape(tilt: float, depth: int) -> list[float]:
    """The capacity exponents of a tilt: w_i ∝ exp(tilt · (i / (depth − 1) − ½)), scaled to mean 1."""
    if depth < 2:
        return [1.0] * depth
    raw = [math.exp(tilt * (i / (depth - 1) - 0.5)) for i in range(depth)]
    mean = sum(raw) / depth
    return [round(w / mean, 4) for w in raw]


@dataclass
class Candidate:
    """One schedule tried: its tilt and protect, the capacity that sets it to the cost, that cost, its fidelity."""

    tilt: float
    protect: float
    capacity: float
    cost: float
    fidelity: float  # mean cosine similarity to the dense features on the calibration images


@dataclass
class Calibration:
    """What ``calibrate`` tried and chose (``model.amod_calibration``)."""

    cost_target: float
    images: int
    seconds: float
    candidates: list[Candidate] = field(default_factory=list)
    chosen: int = 0  # index into candidates

    @property
    def best(self) -> Candidate:
        return self.candidates[self.chosen]

    def table(self) -> list[str]:
        """Every candidate, as the lines of a Markdown table, the chosen one marked."""
        return ["| tilt | protect | capacity | cost | fidelity | |", "|---|---|---|---|---|---|"] + [
            f"| {c.tilt:+g} | {c.protect:g} | {c.capacity:.3f} | {c.cost:.3f} | {c.fidelity:.5f} | "
            f"{'chosen' if i == self.chosen else ''} |" for i, c in enumerate(self.candidates)]

    def report(self) -> dict[str, Any]:
        """What a sweep keeps of it (JSON): seconds, images, the chosen candidate's index and every candidate."""
        return {"seconds": self.seconds, "images": self.images, "chosen": self.chosen,
                "candidates": [dataclasses.asdict(c) for c in self.candidates]}


# the columns of ``chosen_cells``: a report's table of the candidate each calibration chose
CHOSEN_COLUMNS = ("tilt", "protect", "capacity", "fidelity", "runner-up fidelity")


def chosen_cells(report: dict[str, Any]) -> list[str]:
    """A ``Calibration.report``'s chosen candidate (``CHOSEN_COLUMNS``: its tilt, protect, capacity and fidelity) and
    the fidelity of the best of the others ("–" where there is none), as table cells."""
    best = report["candidates"][report["chosen"]]
    runner = max((c["fidelity"] for c in report["candidates"] if c is not best), default=None)
    return [f"{best['tilt']:+g}", f"{best['protect']:g}", f"{best['capacity']:.3f}", f"{best['fidelity']:.4f}",
            "–" if runner is None else f"{runner:.4f}"]


@torch.no_grad()
def _features(model: nn.Module, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    module = family_of(model).feature_module(model)
    out = []
    for x in images.split(batch_size):
        out.append(module.forward_head(module.forward_features(x), pre_logits=True).float())
    return torch.cat(out)


# The largest tilt whose schedule can be computed: ``tilt_shape`` takes exp(tilt · (i / (L − 1) − ½)), up to
# exp(|tilt| / 2), and its sum over the blocks; a float holds exp(x) up to x = 709.78, so |tilt| <= 1400 keeps both
# finite at any depth below 17,000 blocks. (The schedule stops changing long before: once a tilt puts nearly all of the
# folding in the first or the last block, e.g. from |tilt| of about 140 on a 12-block model.)
MAX_TILT = 1400.0


def validate_tilts(tilts: Any) -> list[float]:
    """``tilts`` (``calibrate``'s grid of schedules) as a list of floats, or a ValueError saying what is allowed:
    a non-empty list of numbers in [-``MAX_TILT``, ``MAX_TILT``]."""
    if isinstance(tilts, (str, bytes)) or not isinstance(tilts, Sequence) or not tilts:
        raise UserError(f"tilts must be a non-empty list of numbers, got {tilts!r}")
    for t in tilts:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or abs(t) > MAX_TILT:
            raise UserError(f"a tilt must be a finite number in [-{MAX_TILT:g}, {MAX_TILT:g}] (the schedule's slope "
                            f"over the blocks; exp(tilt / 2) must be a float), got {t!r}")
    return [float(t) for t in tilts]


def validate_protects(protects: Any) -> list[float]:
    """``protects`` (``calibrate``'s grid of protected shares) as a list of floats, or a ValueError."""
    if isinstance(protects, (str, bytes)) or not isinstance(protects, Sequence) or not protects:
        raise UserError(f"protects must be a non-empty list of shares in [0, 1), got {protects!r}")
    return [validate_protect(p) for p in protects]


def validate_calibration_router(router: Any) -> str:
    """``router``, if a calibration can rank with it: registered and not learned (a calibration trains nothing, and a
    fold block routes with a parameter-free router); else a ValueError saying which."""
    if router_class(router).learnable:
        raise UserError(f"router {router!r} learns its scores; a calibration trains nothing: give attention (A-MoD) "
                        "or a control such as random")
    return router


def _validate_images(model: nn.Module, images: Any) -> torch.Tensor:
    """``images`` as the model takes them (its device and float dtype), or a ValueError that says what it takes."""
    channels, (h, w) = model.patch_embed.proj.in_channels, tuple(model.patch_embed.img_size)
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or len(images) < 1:
        raise UserError(f"images must be a (N, C, H, W) tensor of at least one image, got "
                        f"{type(images).__name__}{'' if not isinstance(images, torch.Tensor) else tuple(images.shape)}")
    if not images.is_floating_point():
        raise UserError(f"images must be floating-point tensors, preprocessed (normalised) as for the model, got "
                        f"{images.dtype}")
    if tuple(images.shape[1:]) != (channels, h, w):
        raise UserError(f"images are {'x'.join(map(str, images.shape[1:]))} (C x H x W); the model takes "
                        f"{channels}x{h}x{w}: calibrate at the size the model runs at (amod.arch.set_input_size "
                        "changes a timm model's)")
    if not torch.isfinite(images).all():
        raise UserError("images hold NaN or infinite values; the calibration compares features on them")
    weight = next(model.parameters())
    return images.to(weight.device, weight.dtype)


def calibrate(model: nn.Module, images: torch.Tensor, cost: float = 0.5, router: str = MoDConfig.router,
              tilts: Sequence[float] = DEFAULT_TILTS, protects: Sequence[float] = DEFAULT_PROTECTS,
              batch_size: int = 64, closest: bool = False) -> nn.Module:
    """Turn the dense ``model`` into A-MoD fold with the schedule that keeps its features closest on ``images``.

    Args:
        model: a dense model of a family that folds (``amod.convert(..., skipped="fold")`` takes it: timm ViTs,
            Hugging Face ViT/DeiT/DINOv2, CLIP and SigLIP vision models); converted in place, as ``amod.convert`` does.
        images: unlabeled images (N, C, H, W) at the size the model will run at, preprocessed as for the model;
            256 are plenty (the candidates are compared on the same images).
        cost: the share of the dense MACs to run at (``amod.flops``).
        router: ``"attention"`` (A-MoD), or a control (``"random"``) whose scores decide what is protected.
        tilts, protects: the grid tried (see the module docstring); a candidate that cannot come within
            ``COST_TOLERANCE`` of the cost is left out before any image is run.
        batch_size: images per forward.
        closest: where no candidate comes within the tolerance, run those whose cost is closest instead of refusing
            (a sweep over a grid of costs, whose report flags the miss).

    Returns:
        ``model``, converted, with ``model.amod_calibration`` (a ``Calibration``).

    Raises:
        ValueError: bad arguments, a converted model, images the model does not take, or (unless ``closest``) a cost
            no candidate reaches (naming the lowest one that does).
    """
    cost = validate_cost(cost)
    tilts = validate_tilts(tilts)
    protects = validate_protects(protects)
    validate_calibration_router(router)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, got {batch_size!r}")
    family = family_of(model)
    model = family.prepare(model)  # a Hugging Face model's timm-style views (blocks, patch_embed, ...)
    if getattr(model, "amod_config", None) is not None:
        raise UserError("calibrate takes a dense model; this one is already converted (amod.set_capacity turns "
                        "a converted model's dial)")
    start = time.perf_counter()
    depth = family.layers_count(model)
    # the trial model refuses what cannot fold (a router, a family) before any work
    trial = convert(copy.deepcopy(model), router=router, capacity=1.0, skipped="fold", protect=protects[0],
                    shape=tilt_shape(0.0, depth))
    images = _validate_images(model, images)
    config = get_config(trial)
    settings = []  # (tilt, protect, capacity, cost) of every candidate, priced analytically
    for tilt in tilts:
        for protect in protects:
            config.shape, config.protect, config.capacity = tilt_shape(tilt, depth), protect, 1.0
            config.capacity = capacity_for_cost(trial, cost)
            settings.append((tilt, protect, config.capacity, flops(trial).ratio))
    reachable = [s for s in settings if not misses_cost(s[3], cost)]
    if not reachable and closest:
        miss = min(abs(s[3] - cost) for s in settings)
        reachable = [s for s in settings if abs(s[3] - cost) == miss]
    if not reachable:
        low = min(settings, key=lambda s: s[3])
        h, w = model.patch_embed.img_size
        raise UserError(f"no schedule tried reaches cost {cost:g} (within {tolerance_text()}) on this model at "
                        f"{h}x{w} px: the lowest is {low[3]:.3f} (tilt {low[0]:+g}, protect {low[1]:g}); ask for a "
                        "cost of at least that" + (", or a lower protect" if low[1] > 0 else ""))
    for tilt, protect, capacity, matched in settings:
        if (tilt, protect, capacity, matched) not in reachable:
            log.info("calibrate: tilt %+g, protect %g cannot reach cost %g (closest %.3f): not tried", tilt, protect,
                     cost, matched)
    was_training = model.training
    model.eval()
    reference = _features(model, images, batch_size)
    if not torch.isfinite(reference).all():
        raise UserError("the dense model's features on these images are not finite (NaN or inf): check its weights "
                        "and the images' preprocessing")
    report = Calibration(cost_target=cost, images=len(images), seconds=0.0)
    for tilt, protect, capacity, matched in reachable:
        config.shape, config.protect, config.capacity = tilt_shape(tilt, depth), protect, capacity
        fidelity = F.cosine_similarity(_features(trial, images, batch_size), reference, dim=1).mean().item()
        report.candidates.append(Candidate(tilt, protect, capacity, matched, fidelity))
        log.info("calibrate: tilt %+g, protect %g: capacity %.3f, cost %.3f, fidelity %.5f", tilt, protect,
                 capacity, matched, fidelity)
    del trial
    report.chosen = max(range(len(report.candidates)), key=lambda i: (report.candidates[i].fidelity, -i))
    best = report.best
    convert(model, router=router, capacity=best.capacity, skipped="fold", protect=best.protect,
            shape=tilt_shape(best.tilt, depth))
    model.train(was_training)
    report.seconds = time.perf_counter() - start
    model.amod_calibration = report
    log.info("calibrate: chose tilt %+g, protect %g (capacity %.3f, cost %.3f, fidelity %.5f) in %.1f s on %d images",
             best.tilt, best.protect, best.capacity, best.cost, best.fidelity, report.seconds, len(images))
    return model
