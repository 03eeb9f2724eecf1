"""PPT (Wu et al., 2023, "PPT: Token Pruning and Pooling for Efficient Vision Transformers", arXiv 2310.01812): a
training-free peer of ToMe and PiToMe that, at a few chosen blocks, removes r patch tokens of each image either by
*pooling* them (ToMe's merging) or by *pruning* the least significant ones, chosen per image. Written from the paper
and matched to its public code (xjwu1024/PPT at 706bcdd: ``ppt_deit.py``, its defaults in the README's evaluation).

In a PPT block, after attention and before the MLP, with n patch tokens and r = min(r, n // 2):

- *significance*: each patch token's share of the class token's attention (summed over heads) times the norm of its
  value (all heads' values as one vector), normalised to sum 1 over the patch tokens (``significance``); proportional
  attention is in it, as in every attention of the model;
- *the choice*: where the variance of an image's significances (unbiased, over its patch tokens) is below
  ``threshold`` the image's tokens are spread evenly, the redundancy is duplication, and its block *pools*: ToMe's
  bipartite matching on the keys averaged over heads merges r pairs, size-weighted (``amod.tokens.reduce_weighted``);
  otherwise some tokens matter little, and its block *prunes*: the r least significant patch tokens are dropped, the
  rest kept most significant first, with the sizes they had (``ppt_reduce``);
- every image of a batch loses r tokens either way, so a batch keeps one token count (static shapes: it batches,
  exports and compiles); both reductions run on the whole batch and each image takes its own (``torch.where``);
- proportional attention in every block: a pooled token counts as the patches it holds (log size in the logits).

The other blocks reduce nothing (they run timm's block on sized tokens). Defaults, the public code's for DeiT-S at
224 px: blocks 3, 6 and 9 of 12 (``default_blocks``: a quarter, half and three quarters of the depth), r = 50,
threshold 7e-5 (``PAPER_R``, ``PAPER_THRESHOLD``).

Where this version differs from the public code (docs/ppt.md):

- every discrete choice is made on amod's decision grid (``amod.tokens.decision_key``), the same in every backend and
  batch: which tokens are pruned (significances within 2^-11 / n of each other tie, broken by position), which pairs
  pool (amod's ToMe), and the variance against the threshold (a step of threshold x 2^-11: an image pools where its
  variance is below threshold x (1 - 2^-12));
- the class-token row is that of the first prefix token; prefix tokens (class, distillation, registers) are never
  pruned or pooled and take no part in the normalisation or the variance (the public code sets aside the class token
  only); a model without a class token (SigLIP) reads the attention each token receives from every token instead;
- pooling's sets: amod's ToMe puts the even patch positions in set A, the public ToMe (whose positions count the class
  token) the odd ones;
- the value norms and the class row of the attention are priced in the MACs (``amod.flops``), and ``cost=`` finds r
  for a share of the dense MACs (the paper fixes r).

``apply(model, cost=0.6)`` (or ``r=50``, the paper's setting) makes a dense model of any family that takes token
merging (``amod.families``) run PPT, in place; ``set_r`` changes r; ``PPT`` is the method (``ppt:cost=0.6``) that every
command takes by its spec.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Sequence, Union

import torch
from torch import nn

from .cost import COST_TOLERANCE, BlockPrice, closest_setting, flops, stepped_counts, validate_cost
from .errors import UserError
from .family import family_of, weightless_copy
from .methods import Method, register_method
from .ops import as_float32, tracing
from .reduce import ALL_ROWS, SizedAttention, SizedSettings, SizedTokensBlock, per_block_counts, reduction_macs
from .static import StaticNumbers
from .tokens import (DECISION_GRID, TokenSizes, bipartite_matching, decision_key, gather_tokens, image_rows,
                     matched_destinations, merge_matched, top_indices, with_sizes, without_sizes)
from .tome.merging import check_mergeable

PAPER_R = 50  # patch tokens a PPT block removes (the public code's --r_tokens for DeiT-S)
PAPER_THRESHOLD = 7e-5  # the variance below which an image pools (the public code's evaluation --threshold)


def default_blocks(depth: int) -> tuple[int, ...]:
    """The PPT blocks of a model of ``depth`` blocks: a quarter, half and three quarters of the way (3, 6, 9 of 12, the
    public code's for DeiT-S)."""
    return tuple(sorted({depth // 4, depth // 2, (3 * depth) // 4}))


# ---------------------------------------------------------------- the reduction, as functions on tensors

def significance(importance: torch.Tensor, value_norm: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """Each patch token's significance (B, n): its class-token attention ``importance`` (B, N) times its value norm
    ``value_norm`` (B, N), normalised to sum 1 over the patch tokens (the first ``num_prefix`` tokens left out)."""
    s = as_float32(importance[:, num_prefix:]) * as_float32(value_norm[:, num_prefix:])
    return s / s.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def variance(scores: torch.Tensor) -> torch.Tensor:
    """The unbiased variance of each row of ``scores`` (B, n), n >= 2: (B,), as the public code's ``torch.var``."""
    centred = scores - scores.mean(dim=-1, keepdim=True)
    return centred.square().sum(dim=-1) / (scores.shape[-1] - 1)


def pools(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which images pool (B,) bool: those whose significances' ``variance`` is below ``threshold``, compared on the
    decision grid of the threshold's scale (``decision_key``; threshold 0: none pools)."""
    if threshold <= 0:
        return torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    return decision_key(variance(scores), threshold) < round(1.0 / DECISION_GRID)


def ppt_reduce(x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor, scores: torch.Tensor, r: int,
               num_prefix: int, threshold: float, destinations: bool = False, rows: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, ...]:
    """Remove r patch tokens of every image of ``x`` (B, N, D) by PPT's rule (module docstring); prefix tokens stay.

    Args:
        x: tokens, prefix first; size: their sizes (B, N, 1; None: all 1).
        metric: (B, N, c) keys averaged over heads, as unit vectors (what pooling matches on).
        scores: (B, n) the patch tokens' ``significance``.
        r: patch tokens removed, 1 <= r <= n // 2.
        threshold: an image pools where its significances' variance is below it, and prunes otherwise.
        destinations: also return where each input token went (``ppt_destinations``), for the patch grid.
        rows: ``amod.tokens.image_rows`` of the batch, where already made (the advanced indexing's first index).

    Returns:
        The tokens left (B, N - r, D), their sizes (B, N - r, 1) and which images pooled (B,) bool (then, with
        ``destinations``, (B, N) int64). A pooled image's tokens are in ToMe's order (prefix, set A's unmerged, set
        B), a pruned one's are the prefix, then its kept patch tokens from the most significant down.
    """
    p, n = num_prefix, x.shape[1] - num_prefix
    rows = image_rows(x) if rows is None else rows  # (B, 1)
    xs = with_sizes(x, size)  # (B, N, D + 1): one gather moves features and sizes together
    with torch.no_grad():  # what is pooled or pruned is a discrete choice: no gradient through it
        order, partner = bipartite_matching(metric, p)
        kept = top_indices(scores, n - r, unit=1.0 / n)  # (B, n - r), most significant first
        pooled = pools(scores, threshold)  # (B,)
    by_pooling = merge_matched(xs, order, partner, r, p, rows)  # (B, N - r, D + 1)
    by_pruning = torch.cat([xs[:, :p], xs[:, p:][rows, kept]], dim=1)  # (B, N - r, D + 1)
    x, size = without_sizes(torch.where(pooled.view(-1, 1, 1), by_pooling, by_pruning))
    if not destinations:
        return x, size, pooled
    return x, size, pooled, ppt_destinations(metric, order, partner, kept, pooled, r, p)


def ppt_destinations(metric: torch.Tensor, order: torch.Tensor, partner: torch.Tensor, kept: torch.Tensor,
                     pooled: torch.Tensor, r: int, num_prefix: int) -> torch.Tensor:
    """Where ``ppt_reduce`` put each of its N input tokens (B, N): a pooled image's as ToMe's merging puts them
    (``amod.tokens.matched_destinations``); in a pruned image a kept token goes to its rank after the prefix, and a
    pruned token, which no token holds, takes the place of the kept token most similar to it (cosine of the keys
    averaged over heads): its feature on the patch grid is that token's, as a merged token's is."""
    p, n = num_prefix, metric.shape[1] - num_prefix
    with torch.no_grad():
        by_pooling = matched_destinations(order, partner, r, p, n)
        patches = metric[:, p:].float()
        nearest = torch.bmm(patches, gather_tokens(patches, kept).transpose(1, 2)).argmax(dim=-1)  # (B, n)
        ranks = torch.arange(n - r, device=kept.device).expand_as(kept)
        by_pruning = torch.cat([by_pooling[:, :p], p + nearest.scatter(1, kept, ranks)], dim=1)
        return torch.where(pooled.view(-1, 1), by_pooling, by_pruning)


# ---------------------------------------------------------------- the block

class PPTAttention(SizedAttention):
    """``SizedAttention`` that, when its block reduces (``amod_want``), also keeps each token's value norm over all
    heads (``amod_value_norm``, (B, N) float32), what PPT's significance multiplies the class-token attention by
    (``amod_keep``); its output is ``SizedAttention``'s."""

    amod_value_norm: Optional[torch.Tensor] = None

    def amod_keep(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> None:
        super().amod_keep(q, k, v, attn_mask)
        self.amod_value_norm = as_float32(v).square().sum(dim=(1, 3)).sqrt()  # (B, N): all heads as one vector

    def amod_take_value_norm(self) -> torch.Tensor:
        """The value norms of the last forward, let go of here."""
        value_norm, self.amod_value_norm = self.amod_value_norm, None
        return value_norm


_ATTENTION_CLASSES: dict[type, type] = {SizedAttention: PPTAttention}


def ppt_attention_class(cls: type) -> type:
    """The class a family's sized attention of class ``cls`` (timm's ``SizedAttention``, or a Hugging Face view class
    built on it) becomes in a PPT block: ``PPTAttention`` before it, made once per class."""
    made = _ATTENTION_CLASSES.get(cls)
    if made is None:
        made = type(f"PPT{cls.__name__}", (PPTAttention, cls), {"__module__": __name__})
        _ATTENTION_CLASSES[cls] = made
    return made


@dataclass(kw_only=True)
class PPTSettings(StaticNumbers, SizedSettings):
    """What a PPT block knows besides its weights, beyond every reduction block's ``SizedSettings``."""

    r: int = 0  # patch tokens removed here (0: a block that reduces nothing; at most half of them)
    threshold: float = PAPER_THRESHOLD  # the significances' variance below which an image pools


class PPTBlock(SizedTokensBlock):
    """Token-reduction block (``amod.reduce``) that removes ``amod.r`` patch tokens of each image by pooling or
    pruning (module docstring). After a forward outside a trace, ``amod_last_pooled`` (B,) says which images pooled
    (None where the block removed nothing)."""

    amod: PPTSettings
    amod_kind = "PPT block"
    amod_role_name = "PPT"  # what a Hugging Face layer in this role is called: PPTViTLayer
    amod_last_pooled: Optional[torch.Tensor] = None

    def _removed(self, tokens: int, capacity: Optional[float] = None) -> int:
        return min(self.amod.r, tokens // 2)  # (a capacity does not apply to PPT)

    def _wants_importance(self) -> bool:
        return True

    def _reduce(self, x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor,
                importance: Optional[torch.Tensor], r: int, destinations: bool = False) -> tuple[torch.Tensor, ...]:
        p = self.amod.num_prefix
        scores = significance(importance, self.attn.amod_take_value_norm(), p)
        x, size, pooled, *moved = ppt_reduce(x, size, metric, scores, r, p, self.amod.static("threshold"),
                                             destinations, self._image_rows(x))
        if not tracing():
            self.amod_last_pooled = pooled
        return (x, size, *moved)

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """ToMe's block MACs (the class row of the attention, the |A| x |B| matching) and the value norms."""
        r = self._removed(tokens - num_prefix)
        macs = reduction_macs(self, tokens, r, num_prefix, self.attn.amod_class_rows)
        if r > 0:
            macs += tokens * self.attn.attn_dim  # the squares summed into the value norms
        return BlockPrice(macs, tokens, tokens - r)


# ---------------------------------------------------------------- applying it

@dataclass
class PPTConfig:
    """How a model runs PPT: its PPT blocks, the tokens each removes and the threshold."""

    blocks: list[int]
    r: list[int] = field(default_factory=list)  # one per PPT block
    threshold: float = PAPER_THRESHOLD
    method: ClassVar[str] = "PPT"
    dial: ClassVar[str] = "amod.ppt.set_r"  # what changes the setting in place (a refusal names it)


def _validate_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or threshold < 0:
        raise UserError(f"threshold must be a number >= 0 (the significances' variance below which an image pools; "
                        f"0: every image prunes), got {threshold!r}")
    return float(threshold)


def _validate_blocks(blocks: Optional[Sequence[int]], depth: Optional[int] = None) -> list[int]:
    """``blocks`` sorted, or the default PPT blocks of ``depth`` where None; refuses what is not a list of distinct
    block indices (of a model of ``depth`` blocks, where given)."""
    if blocks is None:
        return list(default_blocks(depth))
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) or not blocks or \
            any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks):
        raise UserError(f"blocks must be a non-empty list of block indices (integers >= 0), got {blocks!r}")
    outside = [b for b in blocks if depth is not None and b >= depth]
    if outside:
        raise UserError(f"PPT block {outside[0]} is not a block of this model: it has blocks 0 to {depth - 1}")
    if len(set(blocks)) != len(blocks):
        raise UserError(f"blocks names a block twice: {list(blocks)}")
    return sorted(blocks)


def _validate_r(model: nn.Module, r: Union[int, Sequence[int]]) -> list[int]:
    blocks = model.amod_ppt.blocks
    return per_block_counts(r, len(blocks), model.patch_embed.num_patches, "PPT block", "removes", f" {list(blocks)}")


def apply(model: nn.Module, r: Union[int, Sequence[int], None] = None, cost: Optional[float] = None,
          threshold: float = PAPER_THRESHOLD, blocks: Optional[Sequence[int]] = None, img_size=None) -> nn.Module:
    """Make a dense model run PPT, in place; returns the same model.

    Args:
        model: a dense model of a family that takes token merging (``amod.families``): timm ViTs, Hugging Face
            ViT/DeiT/DINOv2, CLIP and SigLIP vision models.
        r: patch tokens every PPT block removes (int), or one per PPT block (list); at most half of a block's patch
            tokens are removed. Neither ``r`` nor ``cost``: the paper's r = 50.
        cost: instead of ``r``, the share of the dense model's MACs to match (e.g. 0.6), by ``r_for_cost``.
        threshold: the significances' variance below which an image pools rather than prunes (the paper's 7e-5).
        blocks: the PPT blocks (default ``default_blocks``: 3, 6 and 9 of 12).
        img_size: the input size at which ``cost`` is matched; default: the model's.
    """
    if r is not None and cost is not None:
        raise UserError("give r= (tokens removed per PPT block) or cost= (share of dense MACs), not both")
    threshold = _validate_threshold(threshold)
    cost = None if cost is None else validate_cost(cost)
    r = PAPER_R if r is None and cost is None else r
    return family_of(model).merge_apply(model, lambda m, family: _ppt_blocks(m, r, cost, threshold, blocks,
                                                                             img_size, family))


def _ppt_blocks(model: nn.Module, r, cost: Optional[float], threshold: float, blocks, img_size, family) -> nn.Module:
    check_mergeable(model, family, "PPT")
    chosen = _validate_blocks(blocks, len(model.blocks))
    if r is None:  # priced on a weightless copy: a cost PPT cannot reach leaves the model as it was
        priced = _ppt_blocks(family.prepare(family.weightless_copy(model)), 0, None, threshold, chosen, None, family)
        r = r_for_cost(priced, cost, img_size)
    # the class token's row (the first token's); a model without one: the attention every token receives
    class_rows = 1 if family.class_rows(model) else ALL_ROWS
    sizes = TokenSizes()
    for i, blk in enumerate(model.blocks):
        family.make_sized(blk, PPTBlock, PPTSettings(num_prefix=model.num_prefix_tokens, sizes=sizes, first=i == 0,
                                                     threshold=threshold), class_rows=class_rows)
        blk.attn.__class__ = ppt_attention_class(type(blk.attn))
        blk.attn.amod_value_norm = None
    model.amod_ppt = PPTConfig(blocks=chosen, threshold=threshold)
    return set_r(model, r)


def set_r(model: nn.Module, r: Union[int, Sequence[int]]) -> nn.Module:
    """Change the patch tokens each PPT block of a PPT model removes (an int: every PPT block), in place."""
    config = getattr(model, "amod_ppt", None)
    if config is None:
        raise UserError("model does not run PPT; use amod.ppt.apply first")
    values = _validate_r(model, r)
    per_block = dict(zip(config.blocks, values))
    for i, blk in enumerate(model.blocks):
        blk.amod.r = per_block.get(i, 0)
    config.r = values
    return model


def r_for_cost(model: nn.Module, cost: float, img_size=None, tolerance: float = COST_TOLERANCE) -> list[int]:
    """The r per PPT block whose MACs are closest to ``cost`` x dense (``model``: a PPT model; its own r is
    restored). Candidates, as ToMe's schedules: r + 1 in the first j PPT blocks and r in the others. Raises when
    even the closest misses the cost by more than ``tolerance`` (relative; a block removes at most half of its
    tokens, so PPT's cost has a floor)."""
    cost = validate_cost(cost)
    config = model.amod_ppt
    before, count = list(config.r), len(config.blocks)

    def ratio(values: list[int]) -> float:
        set_r(model, values)
        return flops(model, img_size).ratio

    try:
        n = model.patch_embed.num_patches
        best, _ = closest_setting(
            cost, stepped_counts(count, n // 2, ratio, cost), ratio, tolerance,
            lambda best, got: f"PPT cannot reach {cost:.3f} of dense on this model: the closest r, {best}, costs "
                              f"{got:.3f}" + (" (each PPT block removes at most half of its tokens)" if got > cost
                                              else ""))
    finally:
        set_r(model, before)
    return best


# ---------------------------------------------------------------- the method

@register_method
@dataclass(frozen=True)
class PPT(Method):
    """PPT (``amod.ppt``): ``r`` patch tokens removed per PPT block (an int, or one per block), or ``cost``; images
    whose significances vary less than ``threshold`` pool, the others prune; ``blocks``: the PPT blocks (None: a
    quarter, half and three quarters of the depth)."""

    kind: ClassVar[str] = "ppt"
    setting_fields: ClassVar[tuple[str, ...]] = ("r", "cost")
    metadata_key: ClassVar[Optional[str]] = "amod.ppt"
    r: Optional[Union[int, tuple[int, ...]]] = None
    cost: Optional[float] = None
    threshold: float = PAPER_THRESHOLD
    blocks: Optional[tuple[int, ...]] = None

    def check(self) -> None:
        if self.r is not None and self.cost is not None:
            raise UserError(f"ppt: give r (tokens removed per PPT block) or cost (a share of the dense MACs), not "
                            f"both; got r={self.r}, cost={self.cost}")
        if self.cost is not None:
            validate_cost(self.cost, f"{self.kind}: cost")
        _validate_threshold(self.threshold)
        if self.blocks is not None:
            _validate_blocks(self.blocks)

    def apply(self, model: nn.Module) -> nn.Module:
        r = list(self.r) if isinstance(self.r, tuple) else self.r
        return apply(model, r=r, cost=self.cost, threshold=self.threshold,
                     blocks=None if self.blocks is None else list(self.blocks))

    def label(self) -> str:
        if self.cost is not None:
            return f"ppt@{self.cost:g}"
        return f"ppt r={list(self.r) if isinstance(self.r, tuple) else (PAPER_R if self.r is None else self.r)}"

    def setting_text(self) -> str:
        if self.cost is not None:
            return f"cost {self.cost:g}, threshold {self.threshold:g}"
        r = list(self.r) if isinstance(self.r, tuple) else (PAPER_R if self.r is None else self.r)
        blocks = "default" if self.blocks is None else list(self.blocks)
        return f"r = {r} at blocks {blocks}, threshold {self.threshold:g}"

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["PPT"]:
        config = getattr(model, "amod_ppt", None)
        if config is None:
            return None
        return cls(r=tuple(config.r), threshold=config.threshold, blocks=tuple(config.blocks))

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "PPT":
        model = dataclasses.replace(self, r=0, cost=None).apply(weightless_copy(dense))
        return PPT(r=tuple(r_for_cost(model, cost, tolerance=1.0)), threshold=self.threshold,  # closest; a miss
                   blocks=tuple(model.amod_ppt.blocks))                                         # is flagged
