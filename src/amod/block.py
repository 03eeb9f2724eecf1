"""The MoD block, and the attention that hands A-MoD scores to the next block.

Conversion swaps the class of existing timm modules instead of building new ones, so every
parameter keeps its name and pretrained state_dicts load unchanged:

- ``MoDBlock`` (a timm ``Block``): gathers the prefix tokens and the top-k patch tokens into a
  (B, p + k, D) tensor, runs the block's own attention and MLP on that alone, and scatters the result
  back. Skipped tokens are copied through untouched.
- ``ScoringAttention`` (a timm ``Attention``): the attention of the block before an attention-routed
  MoD block. It computes the same output and also the mean attention each token received, which it
  leaves in a ``ScoreHandoff`` that the next block reads.

Score of a token the previous block skipped: when the block before an attention-routed MoD block is
itself an MoD block, it measures attention only among the M tokens it processed. Those tokens get
their new score rescaled by M / N (so that uniform attention gives every token 1/N, as over the full
sequence); the tokens it skipped keep the score they had when it routed them, i.e. their most recent
measured importance.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block

from .ops import attention_inputs, attention_output, attention_scores_explicit, attention_with_scores
from .routers import Router
from .routing import flat_index, gather_tokens, keep_index, num_kept, scatter_tokens, select_tokens, skipped_tokens


class ScoreHandoff:
    """Mutable slot between a scoring block and the attention-routed MoD block after it.

    Holds (B, N) scores over the full token sequence for the duration of one forward. Plain object,
    not a module, so it adds nothing to state_dicts.
    """

    def __init__(self) -> None:
        self.scores: Optional[torch.Tensor] = None

    def take(self) -> Optional[torch.Tensor]:
        scores, self.scores = self.scores, None  # do not keep activations alive between forwards
        return scores

    def __repr__(self) -> str:
        return f"ScoreHandoff(holding={self.scores is not None})"


class ScoringAttention(Attention):
    """timm ``Attention`` that also writes the mean received attention to ``self.amod_handoff``.

    Only the attention kernel differs from timm's forward; qkv, q/k-norm, scale-norm, gate, proj and
    dropout are timm's own modules.
    """

    amod_handoff: ScoreHandoff
    amod_scores_need_grad: bool

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        if is_causal or (attn_mask is not None and not attn_mask.is_floating_point()):
            raise NotImplementedError("amod's scoring attention supports additive float masks only")
        q, k, v, gate = attention_inputs(self, x)  # (B, H, N, hd) each
        if attn_mask is not None:  # proportional attention of the merge mode: small gathered sets
            x, scores = attention_scores_explicit(q, k, v, self.scale, self.attn_drop.p if self.training else 0.0,
                                                  bias=attn_mask)
        elif self.fused_attn:
            x, scores = attention_with_scores(
                q, k, v, self.scale,
                dropout_p=self.attn_drop.p if self.training else 0.0,
                scores_need_grad=self.amod_scores_need_grad and torch.is_grad_enabled(),
            )
        else:  # timm's explicit path, attention matrix and all
            x, scores = attention_scores_explicit(q, k, v, self.scale, self.attn_drop.p if self.training else 0.0)
        self.amod_handoff.scores = scores if self.amod_scores_need_grad else scores.detach()
        return attention_output(self, x, gate)


class MoDBlock(Block):
    """timm ``Block`` that processes only the prefix tokens and the top-k routed patch tokens.

    Attributes set by ``amod.convert``:
        router: the ``Router`` module (a submodule; only the standard router has parameters).
        amod_capacity: share C of patch tokens processed.
        amod_num_prefix: number of prefix tokens, always processed and never ranked.
        amod_scale_output: multiply each kept token's block update by its router gate.
        amod_skipped: what skipped tokens do: ``"bypass"`` (copied through, the paper's MoD),
            ``"merge"`` (averaged into their most similar kept token for this block, whose update
            they then take) or ``"kv"`` (keys and values for the processed tokens).
        amod_in_handoff: where the previous block leaves attention scores (attention routers).
        amod_out_handoff: set when this block scores attention for the next block.
        amod_last_index: (B, k) patch indices kept in the last forward, when ``amod_record`` is True.
    """

    router: Router
    amod_capacity: float
    amod_num_prefix: int
    amod_scale_output: bool
    amod_skipped: str
    amod_in_handoff: Optional[ScoreHandoff]
    amod_out_handoff: Optional[ScoreHandoff]
    amod_record: bool

    def _block_output(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError("MoD blocks do not support attention masks or causal attention")
        B, N, D = x.shape
        p = self.amod_num_prefix
        n = N - p
        k = num_kept(self.amod_capacity, n)
        prev_scores = self.amod_in_handoff.take() if self.amod_in_handoff is not None else None
        # STE for a learned router whose output is not scaled: forward multiplies by exactly 1,
        # backward passes the gate's gradient, so the router still learns.
        ste = self.router.learnable and not self.amod_scale_output and torch.is_grad_enabled()
        gated = self.amod_scale_output or ste

        if k == n and not gated:  # capacity 1.0: every token is processed, nothing to route
            patch_idx = torch.arange(n, device=x.device).expand(B, n)
            out = self._block_output(x)
            self._publish_scores(prev_scores, None, N)
            self._record(patch_idx)
            return out

        patch_scores = self.router.score(x[:, p:], None if prev_scores is None else prev_scores[:, p:])  # (B, n)
        patch_idx = select_tokens(patch_scores, k)  # (B, k)
        index = keep_index(patch_idx, p)  # (B, p + k)
        xs = gather_tokens(x, index)  # (B, p + k, D)
        merge = self.amod_skipped == "merge" and k < n
        if merge:
            skip_idx, skipped, partner, merged, bias = self._merge_skipped(x, xs, patch_idx)
            # every kept token keeps its own residual and takes the update computed on its merged group
            ys = xs + (self._block_output(merged, attn_mask=bias) - merged)
        elif self.amod_skipped == "kv" and k < n:
            ys = self._block_output_all_kv(x, xs, index)
        else:
            ys = self._block_output(xs)
        if gated:
            gate = self.router.gate(patch_scores.gather(1, patch_idx))  # (B, k)
            if ste:
                gate = 1.0 + (gate - gate.detach())
            update = (ys[:, p:] - xs[:, p:]) * gate.unsqueeze(-1).to(ys.dtype)
            ys = torch.cat([ys[:, :p], xs[:, p:] + update], dim=1)
        if merge:  # a skipped token takes the update of the kept token it was merged into
            skipped_out = skipped + gather_tokens(ys[:, p:] - xs[:, p:], partner)
            # kept, prefix and skipped tokens cover the sequence: fill a new tensor, no copy of x first
            out = x.new_empty(B * N, D).index_copy_(0, flat_index(index, N), ys.reshape(-1, D))
            out = out.index_copy_(0, flat_index(skip_idx + p, N), skipped_out.reshape(-1, D)).view(B, N, D)
        else:
            out = scatter_tokens(x, index, ys)
        self._publish_scores(prev_scores, index, N)
        self._record(patch_idx)
        return out

    def _merge_skipped(self, x: torch.Tensor, xs: torch.Tensor, patch_idx: torch.Tensor):
        """Merge each skipped patch token into its most similar kept one (cosine after the block's norm1).

        Returns the skipped tokens' patch indices (B, n - k), the skipped tokens (B, n - k, D), each
        one's partner among the kept patches (B, n - k), the gathered tokens with every kept patch replaced by the size-weighted
        average of its group (B, p + k, D), and the proportional-attention bias log(size) (B, 1, 1, p + k).
        """
        p = self.amod_num_prefix
        B, N, D = x.shape
        k = patch_idx.shape[1]
        skip_idx = skipped_tokens(patch_idx, N - p)  # (B, n - k)
        skipped = gather_tokens(x, skip_idx + p)
        kept = xs[:, p:]
        # compared as the block's attention sees them, after its LayerNorm (on the demo model this beat
        # the raw residual stream at zero training: 85.4 vs 84.8 % top-1 at 56 % cost)
        # (the skipped side needs no normalising: a positive factor per row does not move its argmax)
        similarity = self.norm1(skipped) @ F.normalize(self.norm1(kept), dim=-1).transpose(1, 2)  # (B, n - k, k)
        partner = similarity.argmax(dim=-1)
        flat_partner = flat_index(partner, k)
        size = torch.ones(B * k, dtype=x.dtype, device=x.device).index_add_(
            0, flat_partner, torch.ones(flat_partner.shape[0], dtype=x.dtype, device=x.device)).view(B, k)
        summed = kept.reshape(B * k, D).index_add(0, flat_partner, skipped.reshape(-1, D)).view(B, k, D)
        merged = torch.cat([xs[:, :p], summed / size.unsqueeze(-1)], dim=1)
        bias = torch.cat([size.new_zeros(B, p), size.log()], dim=1)[:, None, None, :]
        return skip_idx, skipped, partner, merged, bias

    def _block_output_all_kv(self, x: torch.Tensor, xs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The block on the gathered tokens ``xs``, whose queries attend to the keys and values of all N
        tokens (the skipped ones included): K/V projections for every token, the rest for p + k."""
        attn = self.attn
        B, N, _ = x.shape
        M = xs.shape[1]
        h = self.norm1(x)
        hs = gather_tokens(h, index)
        A, H, hd = attn.attn_dim, attn.num_heads, attn.head_dim
        w, b = attn.qkv.weight, attn.qkv.bias
        q = F.linear(hs, w[:A], None if b is None else b[:A]).view(B, M, H, hd).transpose(1, 2)
        kv = F.linear(h, w[A:], None if b is None else b[A:]).view(B, N, 2, H, hd).permute(2, 0, 3, 1, 4)
        key, value = kv.unbind(0)
        q, key = attn.q_norm(q), attn.k_norm(key)
        o = F.scaled_dot_product_attention(q, key, value, scale=attn.scale,
                                           dropout_p=attn.attn_drop.p if self.training else 0.0)
        o = attention_output(attn, o, attn.gate(hs).sigmoid() if attn.gate is not None else None)
        y = xs + self.drop_path1(self.ls1(o))
        return y + self.drop_path2(self.ls2(self.mlp(self.norm2(y))))

    def _publish_scores(self, prev_scores: Optional[torch.Tensor], index: Optional[torch.Tensor], n_full: int) -> None:
        """Turn the scores our attention measured on the gathered tokens into full-sequence scores."""
        if self.amod_out_handoff is None or index is None:
            return  # nothing to do, or every token was processed and the scores are already full length
        sub = self.amod_out_handoff.scores  # (B, M) from ScoringAttention, over the gathered tokens
        if prev_scores is None:
            raise RuntimeError("an MoD block scoring for the next block must itself be attention-routed")
        sub = sub * (index.shape[1] / n_full)
        full = prev_scores.to(sub.dtype).scatter(1, index, sub)
        self.amod_out_handoff.scores = full

    def _record(self, patch_idx: torch.Tensor) -> None:
        if getattr(self, "amod_record", False):
            self.amod_last_index = patch_idx.detach()
