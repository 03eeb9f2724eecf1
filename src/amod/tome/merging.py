"""Token merging (ToMe, Bolya et al., ICLR 2023): the training-free baseline amod is compared against.

Written from the paper's description. In every block, after attention and before the MLP, the r most
similar pairs of patch tokens are merged:

- *bipartite soft matching*: patch tokens alternate into sets A and B; each A token's most similar
  B token (cosine similarity of the attention keys averaged over heads) is its candidate edge; the
  r A tokens with the most similar edges are merged into their B partner;
- *size-weighted averages*: every token carries its size s (the number of patches it stands for);
  merging averages features weighted by size and adds the sizes;
- *proportional attention*: log s is added to the attention logits, so a merged token counts as many
  times as the patches it holds. It enters timm's attention as an additive mask, so the fused
  attention path (and LayerScale, q/k-norm, gates) stay timm's own.

Prefix tokens (class, distillation, registers) are never merged. ``ToMeBlock`` is a thin specialisation
of the token-reduction block that fold shares (``amod.reduce``: sized tokens, proportional attention,
the per-forward reset of the sizes, gradient checkpointing); it only says how many tokens it merges and
which. ``apply`` swaps the class of the model's own block and attention modules (through its family,
``amod.families``), like ``amod.convert``, so state_dict keys are unchanged and a merged model finetunes with the
usual pipeline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union

import torch
from torch import nn

from ..cost import COST_TOLERANCE, closest_setting, stepped_counts, token_sizes, validate_cost
from ..family import family_of
from ..methods import NEAR_TIE_GRID, Method, as_list, as_tuple, refuse_both, register_method
from ..reduce import SizedSettings, SizedTokensBlock, per_block_counts, reduction_macs
from ..tokens import TokenSizes, reduce_weighted
from ..errors import UserError


@dataclass(kw_only=True)
class ToMeSettings(SizedSettings):
    """What a token-merging block knows besides its weights, beyond every reduction block's
    ``SizedSettings``; set by ``apply`` and ``set_schedule``."""

    r: int = 0  # patch-token pairs merged here (at most half of the patch tokens the block gets)


class ToMeBlock(SizedTokensBlock):
    """Token-reduction block (``amod.reduce``) that merges its ``amod.r`` most similar pairs of patch
    tokens (plain bipartite matching) between attention and MLP.

    Attribute set by ``apply``: ``amod`` (its ``ToMeSettings``). After a forward, ``amod_last_tokens``
    holds the tokens left after this block's merge.
    """

    amod: ToMeSettings
    amod_kind = "token-merging block"
    amod_role_name = "ToMe"  # what a Hugging Face layer in this role is called: ToMeViTLayer

    def _removed(self, tokens: int, capacity: Optional[float] = None) -> int:
        return min(self.amod.r, tokens // 2)  # (a capacity does not apply to token merging)

    def _reduce(self, x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor,
                importance: Optional[torch.Tensor], r: int, destinations: bool = False) -> tuple[torch.Tensor, ...]:
        return reduce_weighted(x, size, metric, r, self.amod.num_prefix, destinations=destinations,
                               rows=self._image_rows(x))


def tome_block_macs(blk: nn.Module, tokens: int, r: int, num_prefix: int) -> tuple[int, int]:
    """(MACs, tokens after the merge) of a timm block (merging or not yet) that merges r tokens: attention
    on ``tokens``, bipartite matching of the patch tokens on the keys' mean over heads, MLP on ``tokens - r``."""
    r = min(r, (tokens - num_prefix) // 2)
    return reduction_macs(blk, tokens, r, num_prefix), tokens - r


def tome_macs(model: nn.Module, schedule: Sequence[int], img_size=None) -> int:
    """Analytic MACs per image of the dense ``model`` if it merged ``schedule[i]`` tokens in block i (what lies
    outside the blocks priced by its family)."""
    _, n, p = token_sizes(model, img_size)
    tokens = n + p
    total = 0
    for blk, r in zip(model.blocks, schedule):
        macs, tokens = tome_block_macs(blk, tokens, r, p)
        total += macs
    return total + sum(family_of(model).outside_blocks_macs(model, n, tokens))


@dataclass
class ToMeConfig:
    """How a model was merged: tokens removed in each block."""

    schedule: list[int]
    method: ClassVar[str] = "ToMe"
    dial: ClassVar[str] = "amod.tome.set_schedule"  # what changes the setting in place (a refusal names it)


def token_counts(schedule: Sequence[int], num_patches: int, num_prefix: int) -> list[tuple[int, int]]:
    """(tokens into attention, tokens into the MLP) of each block under a merge schedule."""
    counts, n = [], num_patches
    for r in schedule:
        r = min(r, n // 2)
        counts.append((num_prefix + n, num_prefix + n - r))
        n -= r
    return counts


def _validate_schedule(model: nn.Module, r: Union[int, Sequence[int]]) -> list[int]:
    """``r`` as one entry per block (``amod.reduce.per_block_counts``)."""
    return per_block_counts(r, len(model.blocks), model.patch_embed.num_patches)


def schedule_for_cost(model: nn.Module, cost: float, img_size=None, tolerance: float = COST_TOLERANCE) -> list[int]:
    """The merge schedule whose analytic MACs are closest to ``cost`` x dense.

    Candidates: a constant r per block, with r + 1 in the first j blocks (ToMe's constant schedule,
    refined so that the cost can be matched finely). Raises when none is within ``tolerance``.
    """
    cost = validate_cost(cost)
    depth = len(model.blocks)
    dense = tome_macs(model, [0] * depth, img_size)
    _, n, _ = token_sizes(model, img_size)

    def ratio(schedule: list[int]) -> float:
        return tome_macs(model, schedule, img_size) / dense

    return closest_setting(cost, stepped_counts(depth, n // 2, ratio, cost), ratio, tolerance,
                           lambda best, got: f"token merging cannot reach {cost:.3f} of dense on this model: the "
                                             f"closest schedule {best} costs {got:.3f}")[0]


def apply(model: nn.Module, r: Union[int, Sequence[int], None] = None, cost: Optional[float] = None,
          img_size=None) -> nn.Module:
    """Make a dense ViT merge tokens (ToMe), in place; returns the same model.

    Args:
        model: a dense model of a registered family (``amod.families``): a timm ``VisionTransformer`` (vit_*,
            deit_*, deit3_*, *_reg*, *_dinov2), a Hugging Face ViT/DeiT/DINOv2, CLIP or SigLIP vision model.
        r: tokens merged in every block (int) or per block (list, one entry per block).
        cost: instead of ``r``, the share of the dense model's MACs to match (e.g. 0.56); the schedule
            is chosen by ``schedule_for_cost`` within ``amod.cost.COST_TOLERANCE`` (2 %).
        img_size: input size at which ``cost`` is matched; default: the model's.
    """
    return family_of(model).merge_apply(model, lambda m, family: merge_blocks(m, r, cost, img_size, family))


def reduces_tokens(model: nn.Module) -> bool:
    """Whether ``model`` already reduces its tokens: an MoD model, or one with a token-reduction block
    (``amod.reduce.SizedTokensBlock``: ToMe, PiToMe, fold, or any method built on it)."""
    blocks = getattr(model, "blocks", ())
    return getattr(model, "amod_config", None) is not None or any(isinstance(b, SizedTokensBlock) for b in blocks)


def check_mergeable(model: nn.Module, family: Any, method: str) -> None:
    """Refuse, in one line, a model that token merging (``method``: its name) cannot take: an MoD model, a model that
    already merges (any token-reduction block, ``reduces_tokens``), a block its family cannot take
    (``family.check_block``)."""
    if getattr(model, "amod_config", None) is not None:
        raise UserError(f"model is an MoD model; {method} applies to a dense model")
    if reduces_tokens(model):
        # the method's settings on the model name it and its dial (``ToMeConfig.dial``, PiToMe's, PPT's)
        own = [v for v in vars(model).values() if isinstance(getattr(type(v), "dial", None), str)]
        raise UserError("model already merges tokens" + (
            f" ({own[0].method}); change its setting with {own[0].dial}, or apply {method} to a dense model" if own
            else f"; apply {method} to a dense model"))
    for i, blk in enumerate(model.blocks):
        family.check_block(blk, i)


def merge_blocks(model: nn.Module, r, cost: Optional[float], img_size, family: Any) -> nn.Module:
    """What ``apply`` does once the model family is known (``Family.merge_apply`` of the ViT pattern): the shared
    checks (``check_mergeable``), then every block made a ``ToMeBlock`` by ``family.make_sized``."""
    if (r is None) == (cost is None):
        raise UserError("give exactly one of r= (tokens merged per block) and cost= (share of dense MACs)")
    check_mergeable(model, family, "token merging")
    schedule = schedule_for_cost(model, cost, img_size) if cost is not None else _validate_schedule(model, r)
    sizes = TokenSizes()
    for i, blk in enumerate(model.blocks):
        family.make_sized(blk, ToMeBlock, ToMeSettings(num_prefix=model.num_prefix_tokens, sizes=sizes, first=i == 0))
    model.amod_tome = ToMeConfig(schedule=[])
    set_schedule(model, schedule)
    return model


def set_schedule(model: nn.Module, r: Union[int, Sequence[int]]) -> nn.Module:
    """Change the tokens merged per block of a merged model, in place."""
    config = getattr(model, "amod_tome", None)
    if config is None:
        raise UserError("model does not merge tokens; use amod.tome.apply first")
    schedule = _validate_schedule(model, r)
    for blk, v in zip(model.blocks, schedule):
        blk.amod.r = v
    config.schedule = schedule
    return model

# ---------------------------------------------------------------- the method

def merging_metadata(fields: dict[str, Any]) -> str:
    """A token-merging method's metadata entry: the fields that are set."""
    return json.dumps({k: as_list(v) for k, v in fields.items() if v is not None})


@register_method
@dataclass(frozen=True)
class TokenMerging(Method):
    """Token merging (ToMe): ``r`` tokens merged per block (an int or one per block), or ``cost``."""

    kind: ClassVar[str] = "tome"
    setting_fields: ClassVar[tuple[str, ...]] = ("r", "cost")
    metadata_key: ClassVar[Optional[str]] = "amod.tome"
    # older files name ToMe "amod.merge", which is also the name of a skipped mode: read, never written
    former_metadata_keys: ClassVar[tuple[str, ...]] = ("amod.merge",)
    behaviour: ClassVar[int] = 2
    behaviour_changes: ClassVar[dict[int, str]] = {2: NEAR_TIE_GRID}
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (2, None)
    r: Optional[Union[int, tuple[int, ...]]] = None
    cost: Optional[float] = None

    def check(self) -> None:
        refuse_both(self.kind, self, ("r", "cost"), ("tokens merged per block", "a share of the dense MACs"))
        if self.cost is not None:
            validate_cost(self.cost, f"{self.kind}: cost")

    def apply(self, model: nn.Module) -> nn.Module:
        r = as_list(self.r)
        return apply(model, r=r, cost=self.cost)

    def label(self) -> str:
        if self.cost is not None:
            return f"tome@{self.cost:g}"
        return f"tome r={as_list(self.r)}"

    def setting_text(self) -> str:
        if self.r is None and self.cost is None:
            return self.spec()  # not set yet
        return f"r = {as_list(self.r)}" if self.r is not None else f"cost {self.cost:g}"

    def metadata(self) -> dict[str, str]:
        # a model's schedule under "schedule", the name files have always had; a cost where one is given
        return {self.metadata_key: merging_metadata({"schedule": self.r, "cost": self.cost})}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["TokenMerging"]:
        data = cls.stored_settings(meta)
        if data is None:
            return None
        return cls(r=as_tuple(data.get("schedule")), cost=data.get("cost"))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["TokenMerging"]:
        merging = getattr(model, "amod_tome", None)
        return None if merging is None else cls(r=tuple(merging.schedule))

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "TokenMerging":
        return TokenMerging(r=tuple(schedule_for_cost(dense, cost, tolerance=1.0)))  # closest; a miss is flagged
