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
- ``stages=S``: the tokens fold in S blocks only (as PPT and ALGM reduce in two or three), every other block's
  exponent 0 (it keeps all it gets). A forward then sorts, gathers and scatters S times instead of once per block: on a
  GPU, where each of those operations costs a launch, fewer stages run faster at the same MACs. The S blocks are
  placed evenly, from block 1, 2 or 3, every 1, 2 or 3 blocks (``stage_placements``); the tilt spreads the folding
  over them as it does over every block. The search runs in two steps: every placement at tilt 0 and the first
  protect, then every tilt and protect at the placement that kept the features closest.
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
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..cost import flops, misses_cost, tolerance_text, validate_cost
from ..family import family_of
from ..methods import Method, register_method
from .config import MoDConfig, validate_protect
from .convert import MoD, capacity_for_cost, convert, get_config
from .routers import router_class
from ..errors import UserError

log = logging.getLogger("amod")

DEFAULT_TILTS = (-2.0, -1.0, 0.0, 1.0)
DEFAULT_PROTECTS = (0.0, 0.1, 0.25)


def tilt_shape(tilt: float, depth: int, blocks: Optional[Sequence[int]] = None) -> list[float]:
    """The capacity exponents of a tilt: w_i ∝ exp(tilt · (i / (depth − 1) − ½)), scaled to mean 1; with ``blocks``
    (a stage schedule), the same over those blocks in their order and 0 (nothing folds) in every other block."""
    if blocks is not None:
        weights = tilt_shape(tilt, len(blocks))
        shape = [0.0] * depth
        for b, w in zip(blocks, weights):
            shape[b] = w
        return shape
    if depth < 2:
        return [1.0] * depth
    raw = [math.exp(tilt * (i / (depth - 1) - 0.5)) for i in range(depth)]
    mean = sum(raw) / depth
    return [round(w / mean, 4) for w in raw]


def stage_placements(depth: int, stages: int) -> list[tuple[int, ...]]:
    """Where ``stages`` folding blocks sit among ``depth`` blocks (``calibrate(..., stages=...)``): evenly spaced,
    starting at block 1, 2 or 3 (block 0's attention has not mixed the tokens yet) and every 1, 2 or 3 blocks, the
    last at least one block before the end; on a model too shallow for any of them, blocks 1 to ``stages``."""
    placements = []
    for start in (1, 2, 3):
        for gap in (1, 2, 3):
            blocks = tuple(start + gap * i for i in range(stages))
            if blocks[-1] <= depth - 2 and blocks not in placements:
                placements.append(blocks)
    return placements or [tuple(range(1, min(stages, depth - 1) + 1))]


def validate_stages(stages: Any) -> Optional[int]:
    """``stages`` (how many blocks a calibrated schedule folds in; None: every block) as an int, or a ValueError."""
    if stages is None:
        return None
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise UserError(f"stages must be a whole number >= 1 (the blocks the tokens fold in), got {stages!r}")
    return stages


@dataclass
class Candidate:
    """One schedule tried: its tilt and protect, the capacity that sets it to the cost, that cost, its fidelity, and
    (a stage schedule) the blocks it folds in."""

    tilt: float
    protect: float
    capacity: float
    cost: float
    fidelity: float  # mean cosine similarity to the dense features on the calibration images
    blocks: Optional[tuple[int, ...]] = None  # the blocks that fold (``stages``); None: every block


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
        return ["| blocks | tilt | protect | capacity | cost | fidelity | |", "|---|---|---|---|---|---|---|"] + [
            f"| {blocks_text(c.blocks)} | {c.tilt:+g} | {c.protect:g} | {c.capacity:.3f} | {c.cost:.3f} | "
            f"{c.fidelity:.5f} | {'chosen' if i == self.chosen else ''} |" for i, c in enumerate(self.candidates)]

    def report(self) -> dict[str, Any]:
        """What a sweep keeps of it (JSON): seconds, images, the chosen candidate's index and every candidate."""
        return {"seconds": self.seconds, "images": self.images, "chosen": self.chosen,
                "candidates": [dataclasses.asdict(c) for c in self.candidates]}


def blocks_text(blocks: Optional[Sequence[int]]) -> str:
    """The blocks a schedule folds in, as a report writes them: ``all``, or ``1, 4, 7``."""
    return "all" if blocks is None else ", ".join(map(str, blocks))


# the columns of ``chosen_cells``: a report's table of the candidate each calibration chose
CHOSEN_COLUMNS = ("blocks", "tilt", "protect", "capacity", "fidelity", "runner-up fidelity")


def chosen_cells(report: dict[str, Any]) -> list[str]:
    """A ``Calibration.report``'s chosen candidate (``CHOSEN_COLUMNS``: the blocks it folds in, its tilt, protect,
    capacity and fidelity) and the fidelity of the best of the others ("–" where there is none), as table cells."""
    best = report["candidates"][report["chosen"]]
    runner = max((c["fidelity"] for c in report["candidates"] if c is not best), default=None)
    return [blocks_text(best.get("blocks")), f"{best['tilt']:+g}", f"{best['protect']:g}", f"{best['capacity']:.3f}",
            f"{best['fidelity']:.4f}", "–" if runner is None else f"{runner:.4f}"]


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
              batch_size: int = 64, closest: bool = False, stages: Optional[int] = None) -> nn.Module:
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
        stages: fold in this many blocks only (``stage_placements`` says where; the module docstring how they are
            chosen); None: in every block.

    Returns:
        ``model``, converted, with ``model.amod_calibration`` (a ``Calibration``).

    Raises:
        ValueError: bad arguments, a converted model, images the model does not take, or (unless ``closest``) a cost
            no candidate reaches (naming the lowest one that does).
    """
    cost = validate_cost(cost)
    tilts = validate_tilts(tilts)
    protects = validate_protects(protects)
    stages = validate_stages(stages)
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
    if stages is not None and stages >= depth:
        raise UserError(f"stages={stages}: the model has {depth} blocks, so fewer stages than that, or none (every "
                        "block folds)")
    # the trial model refuses what cannot fold (a router, a family) before any work
    trial = convert(copy.deepcopy(model), router=router, capacity=1.0, skipped="fold", protect=protects[0],
                    shape=tilt_shape(0.0, depth))
    images = _validate_images(model, images)
    config = get_config(trial)

    def priced(grid: list[tuple[float, float, Optional[tuple[int, ...]]]]) -> list[tuple]:
        """(tilt, protect, blocks, capacity, cost) of each schedule of ``grid``, set to the cost analytically."""
        settings = []
        for tilt, protect, blocks in grid:
            config.shape, config.protect, config.capacity = tilt_shape(tilt, depth, blocks), protect, 1.0
            config.capacity = capacity_for_cost(trial, cost)
            settings.append((tilt, protect, blocks, config.capacity, flops(trial).ratio))
        return settings

    def reachable(settings: list[tuple]) -> list[tuple]:
        """The settings that come within the tolerance of the cost (or, with ``closest``, the closest)."""
        near = [s for s in settings if not misses_cost(s[4], cost)]
        if not near and closest:
            miss = min(abs(s[4] - cost) for s in settings)
            near = [s for s in settings if abs(s[4] - cost) == miss]
        for s in settings:
            if s not in near:
                log.info("calibrate: %s cannot reach cost %g (closest %.3f): not tried", _candidate_text(*s[:3]),
                         cost, s[4])
        return near

    if stages is None:
        first = priced([(tilt, protect, None) for tilt in tilts for protect in protects])
    else:  # two steps: the placement at tilt 0 and the first protect, then every tilt and protect at the best one
        first = priced([(0.0, protects[0], blocks) for blocks in stage_placements(depth, stages)])
    tried = reachable(first)
    if not tried:
        low = min(first, key=lambda s: s[4])
        h, w = model.patch_embed.img_size
        raise UserError(f"no schedule tried reaches cost {cost:g} (within {tolerance_text()}) on this model at "
                        f"{h}x{w} px: the lowest is {low[4]:.3f} ({_candidate_text(*low[:3])}); ask for a cost of at "
                        "least that" + (", or a lower protect" if low[1] > 0 else ""))
    was_training = model.training
    model.eval()
    reference = _features(model, images, batch_size)
    if not torch.isfinite(reference).all():
        raise UserError("the dense model's features on these images are not finite (NaN or inf): check its weights "
                        "and the images' preprocessing")
    report = Calibration(cost_target=cost, images=len(images), seconds=0.0)

    def run(settings: list[tuple]) -> None:
        for tilt, protect, blocks, capacity, matched in settings:
            config.shape, config.protect, config.capacity = tilt_shape(tilt, depth, blocks), protect, capacity
            fidelity = F.cosine_similarity(_features(trial, images, batch_size), reference, dim=1).mean().item()
            report.candidates.append(Candidate(tilt, protect, capacity, matched, fidelity, blocks))
            log.info("calibrate: %s: capacity %.3f, cost %.3f, fidelity %.5f", _candidate_text(tilt, protect, blocks),
                     capacity, matched, fidelity)

    run(tried)
    if stages is not None:
        placement = max(report.candidates, key=lambda c: c.fidelity).blocks
        second = [(tilt, protect, placement) for tilt in tilts for protect in protects
                  if (tilt, protect) != (0.0, protects[0])]
        if second:
            run(reachable(priced(second)))
    del trial
    report.chosen = max(range(len(report.candidates)), key=lambda i: (report.candidates[i].fidelity, -i))
    best = report.best
    convert(model, router=router, capacity=best.capacity, skipped="fold", protect=best.protect,
            shape=tilt_shape(best.tilt, depth, best.blocks))
    model.train(was_training)
    report.seconds = time.perf_counter() - start
    model.amod_calibration = report
    log.info("calibrate: chose %s (capacity %.3f, cost %.3f, fidelity %.5f) in %.1f s on %d images",
             _candidate_text(best.tilt, best.protect, best.blocks), best.capacity, best.cost, best.fidelity,
             report.seconds, len(images))
    return model


def _candidate_text(tilt: float, protect: float, blocks: Optional[Sequence[int]]) -> str:
    """A candidate as the log names it: ``tilt +1, protect 0.1`` (and ``in blocks 1, 4, 7``)."""
    return f"tilt {tilt:+g}, protect {protect:g}" + ("" if blocks is None else f", in blocks {blocks_text(blocks)}")

# ---------------------------------------------------------------- the method

@register_method
@dataclass(frozen=True)
class Calibrated(Method):
    """A-MoD fold on the per-block schedule (and protection) that ``amod.calibrate`` chooses at a cost on unlabeled
    images: ``at_cost(dense, cost, images)`` is the calibrated ``MoD`` (with its ``shape``). It runs only once set to
    a cost; its ``router`` decides what is protected (``"random"``: the control); ``stages``: the tokens fold in that
    many blocks only (``amod.calibrate``'s stage schedules), None: in every block. A model it makes runs that ``MoD``
    (``method_of``), which its file names; this method's own metadata (its fields) reads back as itself, and a file
    of it is refused as ``apply`` is."""

    kind: ClassVar[str] = "calibrated"
    metadata_key: ClassVar[Optional[str]] = "amod.calibrated"
    needs_images: ClassVar[bool] = True
    router: str = MoDConfig.router
    protects: tuple[float, ...] = DEFAULT_PROTECTS
    tilts: tuple[float, ...] = DEFAULT_TILTS
    stages: Optional[int] = None

    def check(self) -> None:
        validate_calibration_router(self.router)
        validate_protects(self.protects)
        validate_tilts(self.tilts)
        validate_stages(self.stages)

    def __repr__(self) -> str:
        # stages is named only when set: the calibrations measured before it are keyed by the repr of before
        shown = [f for f in dataclasses.fields(self) if f.name != "stages" or self.stages is not None]
        return f"Calibrated({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @classmethod
    def of_model(cls, model: nn.Module) -> None:
        return None  # a model it makes runs an MoD, which method_of finds (and its file names)

    def apply(self, model: nn.Module) -> nn.Module:
        raise UserError(f"{self.spec()} chooses its schedule at a cost on unlabeled images: set it to a cost first "
                        "(at_cost with images; amod calibrate saves a calibrated model to start from)")

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> MoD:
        return self.calibrated(dense, cost, images)[0]

    def calibrated(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor],
                   closest: bool = True) -> tuple[MoD, dict[str, Any]]:
        """The method at ``cost`` (``amod.calibrate`` on a copy of ``dense``) and what the calibration tried and
        chose (the frontier's report): seconds, images, the chosen candidate's index and every candidate.
        ``closest``: where no candidate comes within the cost tolerance, take the closest (a sweep flags the miss)
        rather than refuse."""
        if images is None:
            raise UserError(f"{self.spec()} is set to a cost on unlabeled images; give images")
        model = calibrate(copy.deepcopy(dense), images, cost, router=self.router, tilts=self.tilts,
                          protects=self.protects, closest=closest, stages=self.stages)
        return MoD.of_model(model), model.amod_calibration.report()
