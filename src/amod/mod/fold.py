"""``skipped="fold"``: Mixture-of-Depths whose skipped tokens fold into kept ones for good.

In the paper's MoD a skipped token is copied past the block and comes back, stale, in the next one;
without training a pretrained model loses much of its accuracy to that. In a fold block the skipped
tokens instead leave the sequence for every later block, their content carried by the token they
are folded into, so the saving persists and compounds like token merging's:

- after the block's attention and before its MLP, the router ranks the t patch tokens by the
  attention this block has just computed (for A-MoD: the attention each token receives from the
  class token(s), a row the attention computes anyway) and *protects* the top ``protect`` share of
  them: a protected token is neither folded away nor diluted by another;
- the block keeps ceil(C · t) patch tokens (C: the capacity); the t − k others are chosen among the
  unprotected tokens as the most redundant ones: patch tokens alternate into sets A and B, each A
  token's most similar B token (cosine of the attention keys averaged over heads) is its partner,
  and the A tokens with the most similar partners fold into them (size-weighted averages);
- every later attention adds log(size) to its logits (proportional attention), so a folded token
  counts as many times as the patches it holds. The bias enters timm's attention as an additive
  mask: the fused attention path stays on.

Prefix tokens (class, distillation, registers) never fold. Capacity is per fold block, so the number
of patch tokens falls geometrically: C = 0.89 on all 12 blocks of a ViT-S at 112 px keeps
64 → 57 → 51 → ... → 19 patch tokens. ``amod.set_capacity`` turns it at inference time. A ``shape``
(``MoDConfig.shape``, one exponent w_i per block; ``amod.calibrate`` chooses it on unlabeled images) bends
that schedule: block i keeps the share C ** w_i, so one dial C still sets the whole model.

``FoldBlock`` is a thin specialisation of the token-reduction block that ToMe shares (``amod.reduce``:
sized tokens, proportional attention, the per-forward reset of the sizes, gradient checkpointing,
pricing); it only says how many tokens fold and which.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from ..cost import BlockPrice, flops, token_sizes
from ..reduce import ALL_ROWS, SizedSettings, SizedTokensBlock
from ..tokens import TokenSizes, reduce_weighted, top_indices
from .config import MoDConfig
from .modes import SkippedMode, register_skipped_mode
from .routers import Router, build_router, router_class
from .routing import num_kept
from ..errors import UserError


def fold_count(capacity: float, tokens: int, protect: float) -> int:
    """Patch tokens a fold block removes from the ``tokens`` it gets: t − ceil(C · t), at most what the
    matching can take (every removed token is an unprotected token of set A with an unprotected
    partner in set B)."""
    if tokens < 2:
        return 0
    q = protected_count(protect, tokens)
    if q >= tokens // 2:
        return 0
    return max(0, min(tokens - num_kept(capacity, tokens), (tokens + 1) // 2 - q))


def block_capacity(capacity: float, shape: Optional[list[float]], index: int) -> float:
    """The share of its patch tokens block ``index`` keeps at the model's ``capacity``: C ** shape[index]."""
    return capacity if shape is None else capacity ** shape[index]


def protected_count(protect: float, tokens: int) -> int:
    """How many of ``tokens`` patch tokens the router protects: ceil(protect · t)."""
    return math.ceil(protect * tokens - 1e-9) if protect > 0 else 0


@dataclass(kw_only=True)
class FoldSettings(SizedSettings):
    """What a fold block knows besides its weights and its router, beyond every reduction block's
    ``SizedSettings`` (prefix tokens, the shared token sizes, ``first``, the memo); set once by ``amod.convert``."""

    config: MoDConfig  # the model's own, shared: capacity, protect, shape
    fold: bool  # whether this block folds (every block of a fold model applies the proportional bias)
    index: int = 0  # the block's position in the model (its exponent in ``config.shape``)


class FoldBlock(SizedTokensBlock):
    """Token-reduction block (``amod.reduce``) whose skipped patch tokens fold into kept ones between
    attention and MLP: its router protects the most attended, the most redundant of the others fold.

    Attributes set by ``amod.convert(..., skipped="fold")``: ``router`` and ``amod`` (its
    ``FoldSettings``); its attention keeps the class tokens' rows (the importance). After a forward,
    ``amod_last_tokens`` holds the tokens left after this block.
    """

    router: Router
    amod: FoldSettings
    amod_kind = "fold block"
    amod_role_name = "Fold"  # what a Hugging Face layer in this role is called: FoldViTLayer

    def _removed(self, tokens: int, capacity: Optional[float] = None) -> int:
        if not self.amod.fold:
            return 0
        config = self.amod.config  # (its numbers read as compile-time constants: amod.static)
        capacity = config.static("capacity") if capacity is None else capacity
        return fold_count(block_capacity(capacity, config.static("shape"), self.amod.index), tokens,
                          config.static("protect"))

    def _reduce(self, x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor,
                importance: Optional[torch.Tensor], r: int, destinations: bool = False) -> tuple[torch.Tensor, ...]:
        p = self.amod.num_prefix
        t = x.shape[1] - p
        q = protected_count(self.amod.config.static("protect"), t)
        protected = None
        if q > 0:
            scores = self.router.score(x[:, p:], importance[:, p:])  # (B, t)
            top = top_indices(scores, q, self.router.score_unit(t))  # near-ties by position (amod.tokens)
            protected = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
        return reduce_weighted(x, size, metric, r, p, protected=protected, destinations=destinations,
                               rows=self._image_rows(x))

    def _wants_importance(self) -> bool:
        return self.amod.config.static("protect") > 0  # the router ranks by it only to protect

    def _read_state(self) -> Optional[int]:
        return self.router.draw_state()  # the random router's draws: a recompute protects what its forward did

    def _replay(self, state: Optional[int]) -> ContextManager:
        return self.router.replay(state)

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """The reduction's MACs (``amod.reduce``), and the router's when the block folds (it scores then)."""
        price = super().amod_price(tokens, num_prefix, capacity)
        if price.tokens_after == tokens:
            return price
        return price._replace(macs=price.macs + self.router.macs(tokens - num_prefix))


def fold_schedule(model: nn.Module, num_patches: int, capacity: float) -> tuple[int, ...]:
    """Patch tokens left after each block of a fold model at ``capacity`` (what ``FoldBlock`` removes)."""
    config, t, left = model.amod_config, num_patches, []
    for i, blk in enumerate(model.blocks):
        if isinstance(blk, FoldBlock) and blk.amod.fold:
            t -= fold_count(block_capacity(capacity, config.shape, i), t, config.protect)
        left.append(t)
    return tuple(left)


@register_skipped_mode("fold")
class FoldMode(SkippedMode):
    """``skipped="fold"`` (this module): every block becomes a ``FoldBlock`` and the blocks in ``layers`` fold,
    routing on the attention they have just computed; its tokens are new tokens, not kept positions."""

    default_layers = "all"
    own_attention = True
    records_kept_indices = False

    def validate(self, config: MoDConfig, model: nn.Module) -> None:
        if router_class(config.router).learnable or config.scale_output:
            raise UserError("skipped='fold' routes with a parameter-free router and no output scaling; use "
                            "router='attention' (or a control router) and scale_output=False")

    def convert(self, model: nn.Module, config: MoDConfig, family: Any) -> None:
        """Every block becomes a FoldBlock (all of them apply the proportional-attention bias once tokens have
        folded); the blocks in ``config.layers`` fold. Importance: the attention each token receives from the class
        tokens (CLS, distillation), or, in a model without one, from every token (``ALL_ROWS``)."""
        for i, blk in enumerate(model.blocks):
            family.check_block(blk, i)
        sizes = TokenSizes()
        class_rows = family.class_rows(model) or ALL_ROWS
        for i, blk in enumerate(model.blocks):
            settings = FoldSettings(config=config, num_prefix=model.num_prefix_tokens, fold=i in config.layers,
                                    sizes=sizes, first=i == 0, index=i)
            family.make_sized(blk, FoldBlock, settings, class_rows=class_rows)
            blk.router = build_router(config.router, family.router_dim(blk), seed=config.seed + i)
        family.lay_out_patch_grid(model)  # its tokens leave the sequence: lay per-patch outputs back (amod.patch_grid)

    def lowest_capacity(self, model: nn.Module, num_patches: int) -> float:
        """A fold block removes at most the tokens the bipartite matching can pair (about half its patch tokens,
        less the protected share; ``fold_count``), so the floor is about 0.5 + protect: the largest capacity, on
        a grid of 0.001 steps, whose tokens block by block are those of the lowest capacity."""
        floor = fold_schedule(model, num_patches, 0.001)
        lowest = 0.001
        for i in range(2, 1001):  # the schedule only grows with the capacity: the first change ends the floor
            if fold_schedule(model, num_patches, i / 1000) != floor:
                break
            lowest = i / 1000
        return lowest

    def capacity_candidates(self, model: nn.Module, num_patches: int) -> list[float]:
        """A fold model's k changes block by block: a grid of 0.001 steps from its floor up, one capacity (the
        largest, as ``capacity_for_cost``'s ties go) per distinct token schedule, so that each cost is priced once."""
        lowest = round(self.lowest_capacity(model, num_patches) * 1000)
        largest: dict[tuple[int, ...], float] = {}
        for i in range(lowest, 1001):
            largest[fold_schedule(model, num_patches, i / 1000)] = i / 1000  # (the schedule grows with capacity)
        return list(largest.values())

    def below_floor_warning(self, model: nn.Module, capacity: float) -> Optional[str]:
        if capacity >= 1.0:
            return None
        _, n, _ = token_sizes(model, None)
        lowest = self.lowest_capacity(model, n)
        if capacity >= lowest:
            return None
        h, w = model.patch_embed.img_size
        protect = model.amod_config.protect
        return (f"skipped='fold' cannot go below capacity {lowest:g} on this model at {h}x{w} px "
                f"({flops(model, capacity=lowest).ratio:.3f} of the dense MACs): a fold block removes at most the "
                f"tokens the bipartite matching can pair, about half of its patch tokens less the {protect:.0%} it "
                f"protects, so capacity {capacity:g} runs as {lowest:g} does"
                + (" (a lower protect goes further)" if protect > 0 else ""))
