"""The MoD block, and the attention that hands A-MoD scores to the next block.

Conversion swaps the class of existing timm modules instead of building new ones, so every
parameter keeps its name and pretrained state_dicts load unchanged:

- ``MoDBlock`` (a timm ``Block``): gathers the prefix tokens and the top-k patch tokens into a
  (B, p + k, D) tensor, runs the block's own attention and MLP on that alone, and puts the result
  back. What the skipped tokens do is the model's ``skipped`` mode, one small ``MoDMode`` class each
  (registered in ``amod.mod.modes``): ``bypass`` (copied through, the paper's MoD), ``merge``
  (averaged into their most similar kept token for this block, whose update they then take) and
  ``kv`` (keys and values for the processed tokens).
- ``ScoringAttention`` (a timm ``Attention``): the attention of the block before an attention-routed
  MoD block. It computes the same output and also the mean attention each token received, which it
  leaves in a ``ScoreHandoff`` that the next block reads.

Score of a token the previous block skipped: when the block before an attention-routed MoD block is
itself an MoD block, it measures attention only among the M tokens it processed. Those tokens get
their new score rescaled by M / N (so that uniform attention gives every token 1/N, as over the full
sequence); the tokens it skipped keep the score they had when it routed them, i.e. their most recent
measured importance.

Gradient checkpointing (timm's ``set_grad_checkpointing``) runs each block again in the backward, when
the handoffs and the random routers' call counters have moved on: a block remembers what it read in
each forward (``amod.tokens.ForwardMemo``) and its recompute (``amod.ops.recomputing``) routes from
that, handing nothing to the next block.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import nn

from ..cost import BlockPrice, attention_macs, linear_macs_per_token
from ..ops import (KeyBias, attention_inputs, attention_output, attention_scores_explicit, attention_with_scores,
                   check_key_bias, key_biased_attention, recomputing)
from ..tokens import ForwardMemo, best_match, flat_index, gather_tokens, image_rows, scatter_tokens
from .config import MoDConfig
from .modes import MODES, SkippedMode, register_skipped_mode
from .routers import Router, build_router, router_class
from .routing import keep_index, num_kept, select_tokens, skipped_tokens
from ..errors import UserError


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
    amod_relayed: bool = False  # its block is an MoD block that passes the scores on (set by amod.convert)
    amod_role_name = "Scoring"  # what a Hugging Face attention in this role is called: ScoringDinov2Attention

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        check_key_bias(attn_mask, is_causal, "amod's scoring attention")
        q, k, v, gate = attention_inputs(self, x)  # (B, H, N, hd) each
        dropout = self.attn_drop.p if self.training else 0.0
        if attn_mask is not None:  # proportional attention of the merge mode: small gathered sets
            x, scores = attention_scores_explicit(q, k, v, self.scale, dropout, bias=attn_mask.tensor)
        elif self.fused_attn:
            x, scores = attention_with_scores(q, k, v, self.scale, dropout_p=dropout,
                                              scores_need_grad=self.amod_scores_need_grad and torch.is_grad_enabled())
        else:  # timm's explicit path, attention matrix and all
            x, scores = attention_scores_explicit(q, k, v, self.scale, dropout)
        # in a checkpoint recompute the next block reads the scores its forward remembered: only a block that
        # passes them on takes them, to redo its forward's autograd ops, and clears them after
        if self.amod_relayed or not recomputing():
            detach = scores.requires_grad and not self.amod_scores_need_grad  # (no op where nothing to detach)
            self.amod_handoff.scores = scores.detach() if detach else scores
        return attention_output(self, x, gate)


def gated_updates(router: Router, scale_output: bool, ys: torch.Tensor, xs: torch.Tensor,
                  kept_scores: torch.Tensor) -> torch.Tensor:
    """Kept tokens ``xs`` (B, k, D) plus their block updates ``ys - xs`` times the router gate of their scores
    ``kept_scores`` (B, k); without ``scale_output``, the straight-through estimator (forward x 1, backward the
    gate's gradient, so that a learned router still learns)."""
    gate = router.gate(kept_scores)  # (B, k)
    if not scale_output:  # ys + (ys - xs) * 0: ys itself, bit for bit (xs + (ys - xs) * 1 is ys only to a rounding)
        return ys + (ys - xs) * (gate - gate.detach()).unsqueeze(-1).to(ys.dtype)
    return xs + (ys - xs) * gate.unsqueeze(-1).to(ys.dtype)


def publish_scores(out: Optional[ScoreHandoff], prev_scores: Optional[torch.Tensor], index: torch.Tensor,
                   n_full: int) -> None:
    """Turn the scores a routed block's attention measured over its M gathered tokens (at ``index`` (B, M) of
    the ``n_full``-token sequence) into full-sequence scores for the next block: rescaled by M / N, so that
    uniform attention gives 1/N as over the full sequence; the tokens it skipped keep ``prev_scores``."""
    if out is None:
        return
    if prev_scores is None:
        raise RuntimeError("an MoD block scoring for the next block must itself be attention-routed")
    sub = out.scores * (index.shape[1] / n_full)  # (B, M) from the scoring attention, over the gathered tokens
    out.scores = prev_scores.to(sub.dtype).scatter(1, index, sub)


@dataclass
class MoDSettings:
    """What an MoD block knows besides its weights and its router; set once by ``amod.convert``."""

    config: MoDConfig  # the model's own, shared by its MoD blocks: capacity, skipped mode, output scaling
    num_prefix: int  # prefix tokens (CLS, distillation, registers): always processed, never ranked
    in_handoff: Optional[ScoreHandoff] = None  # where the previous block leaves attention scores
    out_handoff: Optional[ScoreHandoff] = None  # set when this block scores attention for the next one
    record: bool = False  # keep the kept patch indices of the last forward in ``amod_last_index``
    # what each forward read from the handoff and the router, for gradient checkpointing's recompute
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False, compare=False)


class RoutedForward:
    """The forward every MoD layer shares, timm's ``MoDBlock`` and DETR's ``DetrMoDLayer``: read the
    incoming scores and the router's draw state and remember them; in gradient checkpointing's recompute,
    route as the forward did and hand nothing on.

    A subclass has ``router``, ``amod`` (its settings: ``config``, ``in_handoff``, ``out_handoff``, ``record``,
    ``memo``) and ``_route(x, scores, draws, replay, *args)``, which it calls through ``_routed(x, *args)``.
    """

    router: Router
    amod_label = "MoD block"  # in the errors

    @property
    def _gated(self) -> bool:
        """Whether kept tokens' updates go through the router gate: scaled outputs, or the straight-through
        estimator of a learned router whose output is not scaled (so that the router still learns)."""
        return self.amod.config.scale_output or (self.router.learnable and torch.is_grad_enabled())

    def _routed(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        if not recomputing():
            return self._route(x, *self._read_inputs(x), False, *args)
        # gradient checkpointing's recompute: route as the forward did (its scores, its draws), hand nothing on
        try:
            return self._route(x, *self.amod.memo.recall(x, self.amod_label), True, *args)
        finally:  # (also when the recompute stops early, as soon as it has what the backward needs)
            if self.amod.out_handoff is not None:
                self.amod.out_handoff.scores = None

    def _incoming_scores(self) -> Optional[torch.Tensor]:
        """The scores this forward ranks by, before its router: the previous layer's attention, if any."""
        return self.amod.in_handoff.take() if self.amod.in_handoff is not None else None

    def _read_inputs(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[int]]:
        """The incoming scores and the router's draw state for this forward, remembered for a recompute."""
        scores = self._incoming_scores()
        if self.amod.in_handoff is not None and scores is not None and self.amod.config.scale_output \
                and not torch.is_grad_enabled() and x.requires_grad:  # reentrant checkpointing's forward
            raise RuntimeError("reentrant gradient checkpointing runs the layers without grad, so the gradient that "
                               "A-MoD's scaled outputs send through the scores into the layer before would be "
                               "lost; use non-reentrant checkpointing (timm's default: "
                               "timm.layers.set_reentrant_ckpt(False); transformers: gradient_checkpointing_kwargs="
                               "{'use_reentrant': False}) or scale_output=False")
        draws = self.router.draw_state()
        self.amod.memo.remember(x, (scores, draws))
        return scores, draws

    def _record(self, idx: torch.Tensor) -> None:
        if self.amod.record:
            self.amod_last_index = idx.detach()


class MoDBlock(RoutedForward, Block):
    """timm ``Block`` that processes only the prefix tokens and the top-k routed patch tokens.

    Attributes set by ``amod.convert``: ``router`` (a submodule; a learned router has parameters) and
    ``amod`` (its ``MoDSettings``). After a forward with recording on,
    ``amod_last_index`` holds the (B, k) kept patch indices.
    """

    amod: MoDSettings
    amod_role_name = "MoD"  # what a Hugging Face layer in this role is called: MoDViTLayer

    def block_output(self, x: torch.Tensor, bias: Optional[KeyBias] = None) -> torch.Tensor:
        """timm's block on the tokens ``x`` (B, M, D): attention, then MLP, each with its residual; ``bias``: a
        per-key bias of the attention logits (the merge mode's proportional attention): amod's scoring attention takes
        it itself; timm's attention through ``amod.ops.key_biased_attention`` (maskless where fused, added to the
        logits where not)."""
        h = self.norm1(x)
        if bias is None:
            a = self.attn(h)
        elif isinstance(self.attn, ScoringAttention):
            a = self.attn(h, attn_mask=bias)
        else:
            a = key_biased_attention(self.attn, h, bias)
        x = x + self.drop_path1(self.ls1(a))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError("MoD blocks do not support attention masks or causal attention")
        return self._routed(x)

    def _route(self, x: torch.Tensor, prev_scores: Optional[torch.Tensor], draws: Optional[int],
               replay: bool) -> torch.Tensor:
        """The block on the top-k routed tokens, given the previous block's scores and the router's draw state."""
        B, N, D = x.shape
        p = self.amod.num_prefix
        n = N - p
        k = num_kept(self.amod.config.static("capacity"), n)  # (a compile-time constant: amod.static)
        if k == n and not self._gated:  # capacity 1.0: every token is processed, nothing to route
            self._publish_scores(prev_scores, None, N)
            if not replay:
                self._record(torch.arange(n, device=x.device).expand(B, n))
            return self.block_output(x)
        with self.router.replay(draws) if replay else contextlib.nullcontext():
            patch_scores = self.router.score(x[:, p:], None if prev_scores is None else prev_scores[:, p:])  # (B, n)
        patch_idx = select_tokens(patch_scores, k, self.router.score_unit(n))  # (B, k)
        index = keep_index(patch_idx, p)  # (B, p + k)
        xs = gather_tokens(x, index)  # (B, p + k, D)
        mode = MODES[self.amod.config.skipped if k < n else "bypass"]  # nothing skipped: every mode is bypass
        out = mode.forward(self, x, xs, index, patch_idx, patch_scores)
        self._publish_scores(prev_scores, index, N)  # in a recompute too: the same autograd ops as the forward
        if not replay:
            self._record(patch_idx)
        return out

    # ------------------------------------------------------------ shared pieces

    def gate_updates(self, ys: torch.Tensor, xs: torch.Tensor, patch_idx: torch.Tensor,
                     patch_scores: torch.Tensor) -> torch.Tensor:
        """Multiply kept patch tokens' updates by the router gate where the outputs are gated."""
        if not self._gated:
            return ys
        p = self.amod.num_prefix
        out = gated_updates(self.router, self.amod.config.scale_output, ys[:, p:], xs[:, p:],
                            patch_scores.gather(1, patch_idx))
        return torch.cat([ys[:, :p], out], dim=1)

    def _publish_scores(self, prev_scores: Optional[torch.Tensor], index: Optional[torch.Tensor], n_full: int) -> None:
        """Turn the scores our attention measured on the gathered tokens into full-sequence scores."""
        if index is None:
            return  # every token was processed: the scores are already full length
        publish_scores(self.amod.out_handoff, prev_scores, index, n_full)

    # ------------------------------------------------------------ cost

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """MACs of this block on ``tokens`` tokens (at ``capacity`` if given), for ``amod.flops``.

        A-MoD's scores come from the attention's own softmax tiles at inference (amod.ops): no extra
        products. (In training, and in the CUDA kernel, QK^T is recomputed: not counted here.)
        """
        n = tokens - num_prefix
        kept = num_prefix + num_kept(self.amod.config.capacity if capacity is None else capacity, n)
        mode = MODES[self.amod.config.skipped if kept < tokens else "bypass"]  # nothing skipped: every mode is bypass
        # the router scores every patch token, unless nothing is routed: every token kept and no gate (unscaled
        # outputs at inference), where the block runs as it was (``_route``) and a learned router is not run
        scored = kept < tokens or self.amod.config.scale_output
        macs = mode.macs(self, tokens, kept, num_prefix) + (self.router.macs(n) if scored else 0)
        return BlockPrice(macs, kept, tokens)


# ---------------------------------------------------------------- the MoD block's skipped modes

class MoDMode(SkippedMode):
    """A skipped mode of ``MoDBlock``: what the block does once it has gathered the prefix and top-k patch
    tokens. A new one is a subclass with ``forward`` (and ``macs`` where it costs more or less than the block
    on the kept tokens) registered with ``@register_skipped_mode(name)``; its models convert as every MoD
    model does (``convert_to_mod_blocks``)."""

    def convert(self, model: nn.Module, config: MoDConfig, family: Any) -> None:
        convert_to_mod_blocks(model, config, family)

    def forward(self, block: MoDBlock, x: torch.Tensor, xs: torch.Tensor, index: torch.Tensor,
                patch_idx: torch.Tensor, patch_scores: torch.Tensor) -> torch.Tensor:
        """The block's output (B, N, D) from its input ``x`` (B, N, D), the gathered tokens ``xs`` (B, p + k, D)
        at ``index`` (B, p + k) of x, the kept patch indices ``patch_idx`` (B, k) and every patch token's score
        ``patch_scores`` (B, n). ``block.block_output`` runs the block, ``block.gate_updates`` applies the gate."""
        raise NotImplementedError

    def macs(self, block: MoDBlock, tokens: int, kept: int, num_prefix: int) -> int:
        """MACs of ``block`` on ``tokens`` tokens of which it processes ``kept`` (prefix included; fewer than
        ``tokens``), its router left out: the attention and MLP on the kept tokens."""
        return kept * linear_macs_per_token(block) + attention_macs(kept, block.attn)


@register_skipped_mode("bypass")
class BypassMode(MoDMode):
    """Skipped tokens are copied through; kept ones get the block's output (the paper's MoD)."""

    def forward(self, block, x, xs, index, patch_idx, patch_scores) -> torch.Tensor:
        ys = block.gate_updates(block.block_output(xs), xs, patch_idx, patch_scores)
        return scatter_tokens(x, index, ys)


@register_skipped_mode("merge")
class MergeMode(MoDMode):
    """Skipped tokens join their most similar kept token for this block and take its group's update."""

    def forward(self, block, x, xs, index, patch_idx, patch_scores) -> torch.Tensor:
        B, N, D = x.shape
        p = block.amod.num_prefix
        skip_idx, skipped, partner, merged, bias = self.merge_skipped(block, x, xs, patch_idx)
        # every kept token keeps its own residual and takes the update computed on its merged group
        ys = block.gate_updates(xs + (block.block_output(merged, bias=bias) - merged), xs, patch_idx,
                                patch_scores)
        skipped_out = skipped + gather_tokens(ys[:, p:] - xs[:, p:], partner)
        # kept, prefix and skipped tokens cover the sequence: fill a new tensor, no copy of x first
        rows = image_rows(index)
        return x.new_empty(B, N, D).index_put_((rows, index), ys).index_put_((rows, skip_idx + p), skipped_out)

    def macs(self, block: MoDBlock, tokens: int, kept: int, num_prefix: int) -> int:
        n, k = tokens - num_prefix, kept - num_prefix
        return super().macs(block, tokens, kept, num_prefix) + (n - k) * k * block.norm1.normalized_shape[0]  # cosines

    @staticmethod
    def merge_skipped(block: MoDBlock, x: torch.Tensor, xs: torch.Tensor, patch_idx: torch.Tensor):
        """Merge each skipped patch token into its most similar kept one (cosine after the block's norm1).

        Returns the skipped tokens' patch indices (B, n - k), the skipped tokens (B, n - k, D), each
        one's partner among the kept patches (B, n - k), the gathered tokens with every kept patch replaced
        by the size-weighted average of its group (B, p + k, D), and the proportional-attention bias
        log(size) (B, 1, 1, p + k), as a ``KeyBias``.
        """
        p = block.amod.num_prefix
        B, N, D = x.shape
        k = patch_idx.shape[1]
        skip_idx = skipped_tokens(patch_idx, N - p)  # (B, n - k)
        skipped = gather_tokens(x, skip_idx + p)
        kept = xs[:, p:]
        # compared as the block's attention sees them, after its LayerNorm (on the demo model this beat
        # the raw residual stream at zero training: 85.4 vs 84.8 % top-1 at 56 % cost)
        # cosines, on the grid of amod.tokens.decision_key: near-ties go to the first kept patch in every backend
        similarity = F.normalize(block.norm1(skipped), dim=-1) @ F.normalize(block.norm1(kept), dim=-1).transpose(1, 2)
        partner = best_match(similarity)[1]  # (B, n - k): an index into the kept patches
        flat_partner = flat_index(partner, k).reshape(-1)
        size = torch.ones(B * k, dtype=x.dtype, device=x.device).index_add_(
            0, flat_partner, torch.ones(flat_partner.shape[0], dtype=x.dtype, device=x.device)).view(B, k)
        summed = kept.reshape(B * k, D).index_add(0, flat_partner, skipped.reshape(-1, D)).view(B, k, D)
        merged = torch.cat([xs[:, :p], summed / size.unsqueeze(-1)], dim=1)
        bias = KeyBias(torch.cat([size.new_zeros(B, p), size.log()], dim=1)[:, None, None, :])
        return skip_idx, skipped, partner, merged, bias


@register_skipped_mode("kv")
class KVMode(MoDMode):
    """Kept tokens' queries attend to the keys and values of all N tokens; skipped ones are not updated."""

    def validate(self, config: MoDConfig, model: nn.Module) -> None:
        consecutive = [i for i in config.layers if i - 1 in config.layers]
        if router_class(config.router).needs_attention and consecutive:
            raise UserError(
                f"skipped='kv' cannot score attention for the next block (blocks {consecutive[0] - 1} and "
                f"{consecutive[0]} are both MoD blocks); use layers with a dense block before each MoD block, "
                "e.g. 'alternate'")

    def forward(self, block, x, xs, index, patch_idx, patch_scores) -> torch.Tensor:
        ys = block.gate_updates(self.block_output_all_kv(block, x, xs, index), xs, patch_idx, patch_scores)
        return scatter_tokens(x, index, ys)

    def macs(self, block: MoDBlock, tokens: int, kept: int, num_prefix: int) -> int:
        attn = block.attn
        kv = 2 * attn.attn_dim * attn.qkv.in_features  # K and V projections per token
        attention = 2 * kept * tokens * attn.num_heads * attn.head_dim  # kept queries x all keys and values
        return kept * (linear_macs_per_token(block) - kv) + tokens * kv + attention

    @staticmethod
    def block_output_all_kv(block: MoDBlock, x: torch.Tensor, xs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The block on the gathered tokens ``xs``, whose queries attend to the keys and values of all N
        tokens (the skipped ones included): K/V projections for every token, the rest for p + k."""
        attn = block.attn
        h = block.norm1(x)
        q, key, value, gate = attention_inputs(attn, gather_tokens(h, index), kv_x=h)
        o = F.scaled_dot_product_attention(q, key, value, scale=attn.scale,
                                           dropout_p=attn.attn_drop.p if block.training else 0.0)
        y = xs + block.drop_path1(block.ls1(attention_output(attn, o, gate)))
        return y + block.drop_path2(block.ls2(block.mlp(block.norm2(y))))


# ---------------------------------------------------------------- conversion to MoD blocks

def convert_to_mod_blocks(model: nn.Module, config: MoDConfig, family: Any) -> None:
    """Make the blocks in ``config.layers`` MoD blocks, each with its router, and, for an attention router, hand
    A-MoD's scores to each from the block before it (the conversion of every ``MoDMode``). ``family``: the model's
    (``amod.families``), which makes each block take its role."""
    blocks = model.blocks
    scored = router_class(config.router).needs_attention
    for i in config.layers:
        family.check_block(blocks[i], i)
        if scored and i - 1 not in config.layers:  # (checked before any block changes: a block before another MoD
            family.check_block(blocks[i - 1], i - 1)  # block is converted here, and scores as one)
    for i in config.layers:
        blk = family.make_mod(blocks[i])
        weight = next(blk.parameters())
        blk.router = build_router(config.router, family.router_dim(blk), seed=config.seed + i)
        blk.router.to(device=weight.device, dtype=weight.dtype)
        blk.amod = MoDSettings(config=config, num_prefix=model.num_prefix_tokens)
    if scored:
        wire_score_handoffs(blocks, config.layers, config.scale_output, family.make_scoring)


def wire_score_handoffs(blocks: Sequence[nn.Module], layers: Sequence[int], scale_output: bool,
                        make_scoring: Callable[[nn.Module], nn.Module]) -> None:
    """For each MoD block in ``layers``: the block before it scores attention (``make_scoring`` makes its attention
    a scoring one and returns it) and leaves the scores in a ``ScoreHandoff`` the MoD block reads. An MoD block
    before another passes its scores on (``publish_scores``). Written once for every family."""
    for i in layers:
        handoff = ScoreHandoff()
        prev = blocks[i - 1]
        attn = make_scoring(prev)
        attn.amod_handoff = handoff
        attn.amod_scores_need_grad = scale_output  # gradients through the scores: scaled outputs only
        if isinstance(prev, RoutedForward):
            prev.amod.out_handoff = handoff
            attn.amod_relayed = True
        blocks[i].amod.in_handoff = handoff
