"""Routers: how an MoD block ranks its patch tokens, and the gate applied when outputs are scaled.

Each router maps the block input's patch tokens (and, for the attention routers, the previous
block's received-attention scores, handed over in an ``amod.mod.block.ScoreHandoff``) to one score
per patch token; top-k on those scores (``amod.mod.routing``) picks the tokens the block processes.
Six routers here: ``attention`` (A-MoD), ``standard`` (learned linear), ``hybrid`` (A-MoD's scores times a learned
correction that starts at exactly 1), and the controls ``random``, ``shuffled-attention`` and ``inverse-attention``; a
seventh, ``feature-norm`` (DETR only), is registered in
``amod.families.detr``.

A router is one ``Router`` subclass registered under its name with ``@register_router(name)``: that
registry, ``ROUTER_CLASSES``, is where ``amod.convert``, ``MoDConfig``'s check, the CLI's ``--router``
choices and checkpoints find it by name; the class says how it is built (``build``), what its scoring
costs (``macs``) and whether block outputs are scaled by its gate by default (``default_scale_output``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional, TypeVar

import torch
from torch import nn

from ..cost import linear_macs_per_token
from ..tokens import DECISION_GRID
from .routing import mean_normalized_gate
from ..errors import UserError

R = TypeVar("R", bound=type)


class Router(nn.Module):
    """Base class. ``needs_attention`` routers read the previous block's received-attention scores;
    ``learnable`` ones have weights that train (through the gate); ``default_scale_output``: whether
    block outputs are scaled by the gate when ``amod.convert`` is not told; ``families``: the model families it
    routes (None: all), ``families_why`` says why where it is fewer."""

    needs_attention: bool = False
    learnable: bool = False
    default_scale_output: bool = False
    # the model families (``amod.families``, by name) whose models it can route, and why; None: every family
    families: Optional[tuple[str, ...]] = None
    families_why: str = ""

    @classmethod
    def build(cls, dim: int, seed: int) -> "Router":
        """The router of a block of width ``dim``; ``seed`` seeds its draws (the default needs neither)."""
        return cls()

    def macs(self, num_patches: int) -> int:
        """MACs of scoring ``num_patches`` patch tokens, for ``amod.flops``: each of the router's
        ``nn.Linear`` layers once per token (0 without any). A router with other products overrides it."""
        return num_patches * linear_macs_per_token(self)

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, n, D) patch tokens -> (B, n) scores."""
        raise NotImplementedError

    def gate(self, kept_scores: torch.Tensor) -> torch.Tensor:
        """(B, k) scores of the kept tokens -> (B, k) multipliers of their block output."""
        return mean_normalized_gate(kept_scores)

    def score_unit(self, num_patches: int) -> float:
        """The scale of the scores of ``num_patches`` patch tokens, which the ranking's grid is relative to
        (``amod.tokens.decision_key``): 1 by default (a learned logit, a norm)."""
        return 1.0

    def draw_state(self) -> Optional[int]:
        """What the next ``score`` draws its random numbers from; None for a router that draws none."""
        return None

    def replay(self, state: Optional[int]) -> ContextManager:
        """Within this context ``score`` draws as it did at ``state`` and moves nothing on: the recompute of
        gradient checkpointing must route as its forward did."""
        return contextlib.nullcontext()


ROUTER_CLASSES: dict[str, type[Router]] = {}  # name -> class, in the order they were registered


def register_router(name: str) -> Callable[[R], R]:
    """Class decorator: register a ``Router`` subclass under ``name``."""

    def wrap(cls: R) -> R:
        old = ROUTER_CLASSES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise UserError(f"router {name!r} is already registered ({old.__qualname__})")
        ROUTER_CLASSES[name] = cls
        return cls

    return wrap


@register_router("attention")
class AttentionRouter(Router):
    """A-MoD (paper Eqs. 4-5): rank by the mean attention each token received in the previous block.

    No parameters. The scores arrive from the previous block (see ``amod.mod.block.ScoreHandoff``).
    """

    needs_attention = True

    def score_unit(self, num_patches: int) -> float:
        return 1.0 / num_patches  # a token receives about 1 / n of the attention

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        if attention_scores is None:
            raise RuntimeError(
                "the attention router found no scores from the previous block; blocks must run in order "
                "(model.blocks as a sequence), as timm's forward does"
            )
        return attention_scores


@register_router("standard")
class StandardRouter(Router):
    """Learned linear router (Raposo et al. 2024; paper Eqs. 1-2): r_i = w . x_i + b.

    The gate is g_i = 2 sigmoid(r_i) rather than the raw r_i of Eq. 2: with the weights initialised
    small (truncated normal, std 0.02; bias 0), r_i is near 0, so g_i starts near 1 and a pretrained
    block keeps its function when converted, while d g / d r = 0.5 at 0 lets the gradient reach w.
    (A raw r_i near 0 would multiply every processed token's update by about 0.) The ranking is the
    same as by r_i, since the sigmoid is monotonic.
    """

    learnable = True
    default_scale_output = True  # it learns through the gate

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    @classmethod
    def build(cls, dim: int, seed: int) -> "StandardRouter":
        return cls(dim)

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        return self.proj(x_patch).squeeze(-1)  # (B, n)

    def gate(self, kept_scores: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.sigmoid(kept_scores)


class SeededDraws:
    """Mixin for routers that draw random numbers: a fresh generator per forward, seeded with
    (seed, call number), so two models converted with the same seed route identically, call for
    call. ``calls`` is run state (saved in training checkpoints), not a weight.

    Frozen (``freeze_draws``, what ``amod.export`` does: a graph cannot hold the generator), the
    router draws once, at its current call number, a table of ``rows`` x n numbers, and every later
    forward reuses it: image b gets row b mod ``rows``. The first ``rows`` images get exactly the
    draws an unfrozen forward at that call number gives them. The first frozen forward must run
    eagerly (it draws the table); traced forwards then take the table as a constant.
    """

    seed: int
    calls: int
    amod_frozen_rows: Optional[int] = None  # set while frozen
    amod_frozen: Optional[torch.Tensor] = None  # the frozen draws, (rows, n)

    @classmethod
    def build(cls, dim: int, seed: int) -> Router:
        return cls(seed)

    def _init_draws(self, seed: int) -> None:
        self.seed = int(seed)
        self.calls = 0

    def _generator(self, device: torch.device, call: int) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed * 1_000_003 + call)
        return gen

    def _next_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generator(device, self.calls)
        self.calls += 1
        return gen

    def draw_state(self) -> Optional[int]:
        return self.calls

    @contextlib.contextmanager
    def replay(self, state: Optional[int]) -> Iterator[None]:
        calls, self.calls = self.calls, state  # the call number of the forward; ours again after
        try:
            yield
        finally:
            self.calls = calls

    def freeze_draws(self, rows: int) -> None:
        """Reuse one call's draws from the next forward on (see the class docstring)."""
        if rows < 1:
            raise UserError(f"rows must be at least 1, got {rows}")
        self.amod_frozen_rows, self.amod_frozen = int(rows), None

    def unfreeze_draws(self) -> None:
        self.amod_frozen_rows = self.amod_frozen = None

    def _uniform(self, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """(B, n) float32 numbers uniform in [0, 1): this call's draws, or the frozen ones."""
        if self.amod_frozen_rows is None:
            return torch.rand(shape, generator=self._next_generator(device), device=device, dtype=torch.float32)
        B, n = shape
        table = self.amod_frozen
        if table is None or table.shape[1] != n or table.device != device:
            if torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling():
                raise RuntimeError(f"{type(self).__name__} has no frozen draws for {n} tokens: run one eager "
                                   "forward after freeze_draws before tracing the model")
            table = torch.rand((self.amod_frozen_rows, n), generator=self._generator(device, self.calls),
                               device=device, dtype=torch.float32)
            self.amod_frozen = table
        rows = torch.arange(B, device=device) % table.shape[0]
        return table.index_select(0, rows)


@register_router("random")
class RandomRouter(SeededDraws, Router):
    """Control: a uniformly random subset of patch tokens, reproducible from ``seed``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._init_draws(seed)

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        return self._uniform(x_patch.shape[:2], x_patch.device)

    def score_unit(self, num_patches: int) -> float:
        # draws carry no rounding noise: steps of 2^-24, torch.rand's own, leave them as they are
        return 2.0 ** -24 / DECISION_GRID


@register_router("shuffled-attention")
class ShuffledAttentionRouter(SeededDraws, AttentionRouter):
    """Control: A-MoD's scores permuted across the patch tokens of each image (a fresh seeded
    permutation per forward). Same capacity and the same multiset of scores, but the link between a
    token and its attention is cut: if this routes as well as A-MoD, the attention signal is not
    doing the work."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._init_draws(seed)

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        scores = super().score(x_patch, attention_scores)
        perm = self._uniform(scores.shape, scores.device).argsort(dim=1)  # (B, n)
        return scores.gather(1, perm)


@register_router("inverse-attention")
class InverseAttentionRouter(AttentionRouter):
    """Control: keeps the tokens A-MoD would skip (the lowest mean received attention)."""

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        return -super().score(x_patch, attention_scores)

    def gate(self, kept_scores: torch.Tensor) -> torch.Tensor:
        return mean_normalized_gate(-kept_scores)


@register_router("hybrid")
class HybridRouter(AttentionRouter):
    """A-MoD plus a learned correction: s_i = a_i * exp(c_i), c_i = w . x_i (a ``Linear(d, 1)`` without bias), where
    a_i is the attention token i received in the previous block (``AttentionRouter``'s score).

    It ranks by log a_i + c_i: the correction is a learned logit added to A-MoD's log-score. Its weight starts at
    exactly zero, so c_i = 0.0, exp(0.0) = 1.0 and a_i * 1.0 = a_i bit for bit: at initialisation the
    scores, the ranking, the gate (A-MoD's ``mean_normalized_gate``, inherited) and so the forward in either output
    rule are A-MoD's exactly. The correction multiplies rather than adds, so that the scores stay positive whatever
    it learns: the mean-normalised gate (s_i over the kept tokens' mean) stays a positive weight averaging 1, where
    an additive correction could push a kept score to zero or below and flip or blow up the gate. No bias: a factor
    exp(b) common to every score changes neither the ranking nor the mean-normalised gate, so it would never learn.

    How it learns from zero. The top-k choice has no gradient; the gate does. d s_i / d c_i = a_i * exp(c_i) = a_i
    (> 0) at c = 0, and c is linear in w, so d loss / d w = sum_i a_i * x_i * d loss / d s_i is nonzero at
    w = 0 (a zero weight still gets x times the gradient of the score; only a correction that vanished to first
    order, e.g. a product of two zero-initialised factors, would not). The block gates kept tokens' updates with
    the router's gate in both output rules (``amod.mod.block.gated_updates``):

    - ``scale_output=True``: a processed token becomes x_i + g_i * f(X)_i, g_i = s_i / mean_kept s (A-MoD's scaled
      forward at init), and the gradient also reaches the previous block's queries and keys through a_i, as A-MoD's;
    - ``scale_output=False`` (the default): the straight-through estimator of a learned router: its forward is the
      ungated block's (y + (y - x) * (g - g.detach()) = y exactly, A-MoD's unscaled forward bit for bit, in
      training too), its backward g_i's gradient, so the correction still learns; with grad off (evaluation) the
      block does not gate at all.

    ``default_scale_output`` is False, A-MoD's: a model converted with defaults computes A-MoD's default forward
    (unscaled) at initialisation, and learns through the straight-through gate; scaled outputs are asked for.
    Its MACs are the ``Linear``'s, d per patch token (the elementwise exp and product are not counted).
    """

    learnable = True
    default_scale_output = False  # A-MoD's: at init the default converted model is A-MoD's default model exactly
    max_correction = 30.0  # |c_i| is clipped here so that exp(c_i) stays finite in float32 (e^30 ~ 1e13)

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)  # (a bias, one factor exp(b) on every score, would change nothing)
        nn.init.zeros_(self.proj.weight)  # exactly zero: the scores start as A-MoD's, bit for bit

    @classmethod
    def build(cls, dim: int, seed: int) -> "HybridRouter":
        return cls(dim)

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        scores = super().score(x_patch, attention_scores)  # (B, n) A-MoD's, float32
        correction = self.proj(x_patch).squeeze(-1).to(scores.dtype)  # (B, n), 0.0 at init (also under autocast)
        return scores * correction.clamp(-self.max_correction, self.max_correction).exp()


def router_names(family: Optional[str] = None) -> tuple[str, ...]:
    """The registered routers' names (the ``--router`` choices); ``family``: only those that route that family's
    models (``Router.families``)."""
    return tuple(name for name, cls in ROUTER_CLASSES.items()
                 if family is None or cls.families is None or family in cls.families)


def vit_routers() -> tuple[str, ...]:
    """The ``--router`` choices of the ViT commands (train, finetune, flops, bench, calibrate): the routers that route
    every family, so not DETR's ``feature-norm`` (``amod detect`` takes it)."""
    return tuple(name for name, cls in ROUTER_CLASSES.items() if cls.families is None)


def router_class(name: str) -> type[Router]:
    """The router class registered under ``name``; a ValueError naming the supported ones otherwise."""
    if not isinstance(name, str) or name not in ROUTER_CLASSES:
        raise UserError(f"unknown router {name!r}; supported routers: {', '.join(ROUTER_CLASSES)}")
    return ROUTER_CLASSES[name]


def build_router(name: str, dim: int, seed: int = 0) -> Router:
    """Make the router ``name`` for blocks of width ``dim``."""
    return router_class(name).build(dim, seed)
