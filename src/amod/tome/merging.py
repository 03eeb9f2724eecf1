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

Prefix tokens (class, distillation, registers) are never merged. ``apply`` swaps the class of timm's
own ``Block``/``Attention`` modules, like ``amod.convert``, so state_dict keys are unchanged and a
merged model finetunes with the usual pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..cost import BlockPrice, attention_macs, embed_head_macs, linear_macs_per_token, token_sizes, validate_cost
from ..ops import attention_inputs, attention_output, attention_probs, recomputing
from ..tokens import ForwardMemo, MergeState, merge_weighted


class MergeAttention(Attention):
    """timm ``Attention`` that also leaves the keys' mean over heads in ``self.amod_metric``.

    The proportional-attention term arrives as timm's ``attn_mask`` (an additive bias), so the fused
    and the explicit path are timm's own.
    """

    amod_metric: Optional[torch.Tensor]

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        q, k, v, gate = attention_inputs(self, x)
        self.amod_metric = k.mean(1)  # (B, N, head_dim): what ToMe matches tokens on
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            x = self.attn_drop(attention_probs(q * self.scale, k, 1.0, attn_mask).to(v.dtype)) @ v
        return attention_output(self, x, gate)


class MergeBlock(Block):
    """timm ``Block`` that merges ``amod_merge_r`` patch-token pairs between attention and MLP.

    Attributes set by ``apply``: amod_merge_r (tokens removed here), amod_num_prefix, amod_state
    (the shared ``MergeState``), amod_first (block 0 starts every forward with sizes 1), amod_memo
    (the sizes each forward read, for gradient checkpointing's recompute), amod_last_tokens (tokens
    after this block's merge, kept for inspection).
    """

    amod_merge_r: int
    amod_num_prefix: int
    amod_state: MergeState
    amod_first: bool
    amod_memo: ForwardMemo

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError("merged blocks do not support attention masks or causal attention")
        state = self.amod_state
        replay = recomputing()  # gradient checkpointing's recompute: its forward's sizes, the state left alone
        if replay:
            (size,) = self.amod_memo.recall(x, "token-merging block")
        else:
            if self.amod_first:
                state.size = None  # a new forward: every token stands for itself
            size = state.size
            self.amod_memo.remember(x, (size,))
        bias = None if size is None else size.log().to(x.dtype).transpose(1, 2).unsqueeze(1)  # (B, 1, 1, N)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=bias)))
        r = min(self.amod_merge_r, (x.shape[1] - self.amod_num_prefix) // 2)
        if r > 0:
            if size is None:
                size = x.new_ones(x.shape[0], x.shape[1], 1)
            x, size = merge_weighted(x, size, self.attn.amod_metric, r, self.amod_num_prefix)
            if not replay:
                state.size = size
        self.attn.amod_metric = None  # do not keep activations alive between forwards
        if not replay:
            self.amod_last_tokens = x.shape[1]
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """MACs on ``tokens`` tokens for ``amod.flops`` (``capacity`` does not apply to token merging)."""
        macs, after = merge_block_macs(self, tokens, self.amod_merge_r, num_prefix)
        return BlockPrice(macs, tokens, after)


def merge_block_macs(blk: nn.Module, tokens: int, r: int, num_prefix: int) -> tuple[int, int]:
    """(MACs, tokens after the merge) of a timm block (merging or not yet) that merges r tokens: attention
    on ``tokens``, bipartite matching of the patch tokens on the keys' mean over heads, MLP on ``tokens - r``."""
    n = tokens - num_prefix
    r = min(r, n // 2)
    macs = tokens * linear_macs_per_token(blk.attn) + attention_macs(tokens, blk.attn)
    if r > 0:
        macs += ((n + 1) // 2) * (n // 2) * blk.attn.head_dim  # |A| x |B| cosine similarities
    return macs + (tokens - r) * linear_macs_per_token(blk.mlp), tokens - r


def merge_macs(model: nn.Module, schedule: Sequence[int], img_size=None) -> int:
    """Analytic MACs per image of the dense ``model`` if it merged ``schedule[i]`` tokens in block i."""
    _, n, p = token_sizes(model, img_size)
    tokens = n + p
    total = sum(embed_head_macs(model, n))
    for blk, r in zip(model.blocks, schedule):
        macs, tokens = merge_block_macs(blk, tokens, r, p)
        total += macs
    return total


@dataclass
class MergeConfig:
    """How a model was merged: tokens removed in each block."""

    schedule: list[int]


def token_counts(schedule: Sequence[int], num_patches: int, num_prefix: int) -> list[tuple[int, int]]:
    """(tokens into attention, tokens into the MLP) of each block under a merge schedule."""
    counts, n = [], num_patches
    for r in schedule:
        r = min(r, n // 2)
        counts.append((num_prefix + n, num_prefix + n - r))
        n -= r
    return counts


def _validate_schedule(model: nn.Module, r: Union[int, Sequence[int]]) -> list[int]:
    """``r`` as one entry per block; refuses what is not an int, and more merges than the model has tokens."""
    depth = len(model.blocks)
    if isinstance(r, bool) or not isinstance(r, (int, list, tuple)):
        raise ValueError(f"r must be an int (tokens merged in every block) or a list of ints (one per block), "
                         f"got {r!r}")
    schedule = [r] * depth if isinstance(r, int) else list(r)
    if len(schedule) != depth:
        raise ValueError(f"the merge schedule has {len(schedule)} entries; the model has {depth} blocks")
    for v in schedule:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"tokens merged per block must be integers >= 0, got {v!r}")
    # A block merges min(r, half the patch tokens it has left); an r above the model's patch count can
    # only be a mistake.
    n = model.patch_embed.num_patches
    too_many = [v for v in schedule if v > n]
    if too_many:
        raise ValueError(f"r = {too_many[0]} is more than the {n} patch tokens of the model; each block merges at "
                         f"most half of the patch tokens it has left")
    return schedule


def schedule_for_cost(model: nn.Module, cost: float, img_size=None, tolerance: float = 0.02) -> list[int]:
    """The merge schedule whose analytic MACs are closest to ``cost`` x dense.

    Candidates: a constant r per block, with r + 1 in the first j blocks (ToMe's constant schedule,
    refined so that the cost can be matched finely). Raises when none is within ``tolerance``.
    """
    cost = validate_cost(cost)
    depth = len(model.blocks)
    dense = merge_macs(model, [0] * depth, img_size)
    _, n, _ = token_sizes(model, img_size)
    best, best_err = [0] * depth, abs(1.0 - cost)
    for r in range(n // 2 + 1):
        for j in range(depth):
            schedule = [r + 1] * j + [r] * (depth - j)
            ratio = merge_macs(model, schedule, img_size) / dense
            if abs(ratio - cost) < best_err:
                best, best_err = schedule, abs(ratio - cost)
        if merge_macs(model, [r] * depth, img_size) / dense < cost - tolerance:
            break  # cost only falls from here on
    got = merge_macs(model, best, img_size) / dense
    if abs(got - cost) / cost > tolerance:
        raise ValueError(f"token merging cannot reach {cost:.3f} of dense on this model: the closest schedule "
                         f"{best} costs {got:.3f}")
    return best


def apply(model: nn.Module, r: Union[int, Sequence[int], None] = None, cost: Optional[float] = None,
          img_size=None) -> nn.Module:
    """Make a timm ViT merge tokens (ToMe), in place; returns the same model.

    Args:
        model: a dense timm ``VisionTransformer`` (vit_*, deit_*, deit3_*, *_reg*, *_dinov2).
        r: tokens merged in every block (int) or per block (list, one entry per block).
        cost: instead of ``r``, the share of the dense model's MACs to match (e.g. 0.56); the schedule
            is chosen by ``schedule_for_cost`` within 2 %.
        img_size: input size at which ``cost`` is matched; default: the model's.
    """
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"amod.merge supports timm VisionTransformer models, got {type(model).__name__}")
    if getattr(model, "amod_config", None) is not None:
        raise ValueError("model is an MoD model; token merging applies to a dense model")
    if getattr(model, "amod_merge", None) is not None:
        raise ValueError("model already merges tokens; use amod.merge.set_schedule to change it")
    if (r is None) == (cost is None):
        raise ValueError("give exactly one of r= (tokens merged per block) and cost= (share of dense MACs)")
    for i, blk in enumerate(model.blocks):
        if type(blk) is not Block or type(blk.attn) is not Attention:
            raise TypeError(f"block {i} is a {type(blk).__name__} with {type(blk.attn).__name__}; "
                            "token merging supports timm's Block with timm.layers.Attention only")
    schedule = schedule_for_cost(model, cost, img_size) if cost is not None else _validate_schedule(model, r)
    state = MergeState()
    for i, blk in enumerate(model.blocks):
        blk.__class__ = MergeBlock
        blk.attn.__class__ = MergeAttention
        blk.attn.amod_metric = None
        blk.amod_num_prefix = model.num_prefix_tokens
        blk.amod_state = state
        blk.amod_first = i == 0
        blk.amod_memo = ForwardMemo()
    model.amod_merge = MergeConfig(schedule=[])
    set_schedule(model, schedule)
    return model


def set_schedule(model: nn.Module, r: Union[int, Sequence[int]]) -> nn.Module:
    """Change the tokens merged per block of a merged model, in place."""
    config = getattr(model, "amod_merge", None)
    if config is None:
        raise ValueError("model does not merge tokens; use amod.merge.apply first")
    schedule = _validate_schedule(model, r)
    for blk, v in zip(model.blocks, schedule):
        blk.amod_merge_r = v
    config.schedule = schedule
    return model
