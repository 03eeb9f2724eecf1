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
64 → 57 → 51 → ... → 19 patch tokens. ``amod.set_capacity`` turns it at inference time.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block

from ..cost import BlockPrice, attention_macs, linear_macs_per_token
from ..ops import attention_inputs, attention_output, attention_probs, recomputing
from ..tokens import ForwardMemo, MergeState, merge_weighted
from .config import MoDConfig
from .routers import Router
from .routing import num_kept


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


def protected_count(protect: float, tokens: int) -> int:
    """How many of ``tokens`` patch tokens the router protects: ceil(protect · t)."""
    return math.ceil(protect * tokens - 1e-9) if protect > 0 else 0


class FoldAttention(Attention):
    """timm ``Attention`` that also keeps what a fold needs: the keys' mean over heads (the similarity
    metric) and the attention each token receives from the prefix tokens (the importance).

    The output is timm's fused attention with the proportional-attention bias as its mask; the
    prefix rows are computed again on their own (p × N products), so nothing forms the N × N matrix.
    """

    amod_want: bool  # set by the block: compute metric and importance in this forward
    amod_metric: Optional[torch.Tensor]
    amod_importance: Optional[torch.Tensor]
    amod_num_prefix: int

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        q, k, v, gate = attention_inputs(self, x)  # (B, H, N, hd) each
        if self.fused_attn:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            o = self.attn_drop(attention_probs(q * self.scale, k, 1.0, attn_mask).to(v.dtype)) @ v
        if self.amod_want:
            p = max(1, self.amod_num_prefix)
            with torch.no_grad():  # routing is a discrete choice: no gradient through it
                # the class tokens' rows of the attention, (B, H, p, N), averaged over heads and rows
                self.amod_importance = attention_probs(q[:, :, :p] * self.scale, k, 1.0, attn_mask).mean(dim=(1, 2))
            self.amod_metric = k.mean(1)  # (B, N, hd): what the tokens are matched on
        return attention_output(self, o, gate)


@dataclass
class FoldSettings:
    """What a fold block knows besides its weights and its router; set once by ``amod.convert``."""

    config: MoDConfig  # the model's own, shared: capacity, protect
    num_prefix: int  # prefix tokens: never folded
    fold: bool  # whether this block folds (every block of a fold model applies the proportional bias)
    state: MergeState  # the token sizes, shared by the model's blocks during one forward
    first: bool  # block 0 starts every forward with sizes 1
    # the sizes and the router's draw state each forward read, for gradient checkpointing's recompute
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False, compare=False)


class FoldBlock(Block):
    """timm ``Block`` whose skipped patch tokens fold into kept ones between attention and MLP.

    Attributes set by ``amod.convert(..., skipped="fold")``: ``router`` and ``amod`` (its
    ``FoldSettings``). After a forward, ``amod_last_tokens`` holds the tokens left after this block.
    """

    router: Router
    amod: FoldSettings

    def _fold_count(self, tokens: int, capacity: Optional[float] = None) -> int:
        if not self.amod.fold:
            return 0
        config = self.amod.config
        return fold_count(config.capacity if capacity is None else capacity, tokens, config.protect)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError("fold blocks do not support attention masks or causal attention")
        state = self.amod.state
        # gradient checkpointing's recompute takes the sizes and draws of its forward and leaves the state alone
        replay = recomputing()
        if replay:
            size, draws = self.amod.memo.recall(x, "fold block")
        else:
            if self.amod.first:
                state.size = None  # a new forward: every token stands for itself
            size, draws = state.size, self.router.draw_state()
            self.amod.memo.remember(x, (size, draws))
        p = self.amod.num_prefix
        r = self._fold_count(x.shape[1] - p)
        bias = None if size is None else size.log().to(x.dtype).transpose(1, 2).unsqueeze(1)  # (B, 1, 1, N)
        self.attn.amod_want = r > 0
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=bias)))
        if r > 0:
            importance, metric = self.attn.amod_importance, self.attn.amod_metric
            self.attn.amod_importance = self.attn.amod_metric = None  # do not keep activations alive
            with self.router.replay(draws) if replay else contextlib.nullcontext():
                scores = self.router.score(x[:, p:], importance[:, p:])  # (B, t)
            q = protected_count(self.amod.config.protect, x.shape[1] - p)
            protected = None
            if q > 0:
                top = scores.topk(q, dim=1).indices
                protected = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
            if size is None:
                size = x.new_ones(x.shape[0], x.shape[1], 1)
            x, size = merge_weighted(x, size, metric, r, p, protected=protected)
            if not replay:
                state.size = size
        if not replay:
            self.amod_last_tokens = x.shape[1]
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """MACs on ``tokens`` tokens: attention on all of them; when it folds, the class tokens' attention
        rows again (the importance) and the |A| x |B| key similarities; then the MLP on the tokens left."""
        n = tokens - num_prefix
        r = self._fold_count(n, capacity)
        attn = self.attn
        macs = tokens * linear_macs_per_token(attn) + attention_macs(tokens, attn)
        if r > 0:
            macs += max(1, attn.amod_num_prefix) * tokens * attn.attn_dim  # class-token rows of Q K^T
            macs += ((n + 1) // 2) * (n // 2) * attn.head_dim  # |A| x |B| cosine similarities
        return BlockPrice(macs + (tokens - r) * linear_macs_per_token(self.mlp), tokens, tokens - r)
