"""The token-reduction block that fold and ToMe share: sized tokens that leave the sequence for good.

A reduction block is a timm ``Block`` that removes r patch tokens between its attention and its MLP,
each averaged into a token that stays; the tokens left go on through every later block.
``SizedTokensBlock`` is that skeleton, written once:

- every token carries its size s, the patches it stands for (``amod.tokens.TokenSizes``, shared by
  the model's blocks during one forward); block 0 (``first``) starts every forward of the model
  (``forward``, ``forward_features``, ``forward_intermediates``) with sizes 1;
- where a forward asks for the patch grid (``amod.patch_grid.tracking``), ``_reduce`` also says where
  each token went, so that timm's ``forward_intermediates`` and ``amod.patch_features`` lay the reduced
  sequence back on the dense grid; otherwise none of that runs;
- proportional attention: log s enters every later block's attention logits (``proportional_bias``), so a token
  counts as many times as the patches it holds; it rides in one more head channel of the keys, not in a mask
  (``amod.ops.KeyBias``), so the fused kernel runs maskless, FlashAttention on CUDA as on the dense model;
- ``SizedAttention`` keeps what the reduction is decided on: the keys' mean over heads (the
  similarity metric) and, where asked, the attention of the class tokens' rows (the importance);
- gradient checkpointing's recompute (``amod.ops.recomputing``) replays the sizes, and whatever else
  the block read from outside its input, that its forward remembered (``amod.tokens.ForwardMemo``);
- ``amod_price``: its MACs for ``amod.flops`` (``reduction_macs``).

A specialisation says only how many patch tokens a block removes (``_removed``) and which
(``_reduce``): fold (``amod.mod.fold``) folds the most redundant of the tokens its router leaves unprotected,
ToMe (``amod.tome``) merges the r most similar pairs of plain bipartite matching.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, ContextManager, Optional, Sequence, Union

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import nn

from .cost import BlockPrice, attention_macs, linear_macs_per_token
from .errors import UserError
from .ops import (KeyBias, attention_inputs, attention_output, attention_probs, biased_attention, check_key_bias,
                  recomputing)
from .tokens import ForwardMemo, TokenSizes, proportional_bias


ALL_ROWS = -1  # ``class_rows`` of a model without a class token: every token's row (the attention it receives)


def importance_rows(class_rows: int, tokens: int) -> int:
    """The attention rows whose mean is a token's importance: ``class_rows``, or all ``tokens`` (``ALL_ROWS``)."""
    return tokens if class_rows == ALL_ROWS else class_rows


def reduction_macs(blk: nn.Module, tokens: int, r: int, num_prefix: int, class_rows: int = 0) -> int:
    """MACs of a timm block (reducing or not yet) on ``tokens`` tokens that removes r patch tokens: attention
    on all of them; when it removes any, the importance's attention rows again (``importance_rows``) and the
    bipartite matching's |A| x |B| key similarities; then the MLP on the ``tokens - r`` left."""
    n = tokens - num_prefix
    attn = blk.attn
    macs = tokens * linear_macs_per_token(attn) + attention_macs(tokens, attn)
    if r > 0:
        macs += importance_rows(class_rows, tokens) * tokens * attn.attn_dim  # the importance rows of Q K^T
        macs += ((n + 1) // 2) * (n // 2) * attn.head_dim  # |A| x |B| cosine similarities
    return macs + (tokens - r) * linear_macs_per_token(blk.mlp)


class SizedAttention(Attention):
    """timm ``Attention`` that, when its block asks (``amod_want``), also keeps what the block's reduction is decided
    on: the keys' mean over heads, normalised (``amod_metric``: what tokens are matched on) and, where the block asks
    for it (``amod_want_importance``), the mean attention of the first ``amod_class_rows`` query rows
    (``amod_importance``: the attention each token receives from the class tokens; with ``ALL_ROWS``, from every
    token, A-MoD's own score, for a model without a class token).

    The output is timm's attention, fused (maskless: the proportional-attention bias rides in the keys,
    ``amod.ops.KeyBias``) or explicit (the bias added to the logits). The
    importance is computed again on its own rows, under no_grad: with class tokens their rows only, (B, H, rows, N)
    in float32 (rows x N products), so the fused path forms no N x N matrix; with ``ALL_ROWS`` (a model without a
    class token, e.g. SigLIP) that is the whole (B, H, N, N) attention matrix in float32, beside the fused output
    (priced in ``reduction_macs``).
    """

    amod_want: bool  # set by the block: keep the metric of this forward
    amod_want_importance: bool  # set by the block: keep the importance too
    amod_class_rows: int  # class-token rows whose attention is the importance; 0: none; ALL_ROWS: every row
    amod_metric: Optional[torch.Tensor]
    amod_importance: Optional[torch.Tensor]
    amod_role_name = "Sized"  # what a Hugging Face attention in this role is called: SizedViTAttention

    def forward(self, x: torch.Tensor, attn_mask: Optional[KeyBias] = None, is_causal: bool = False) -> torch.Tensor:
        check_key_bias(attn_mask, is_causal, "a token-reduction block's attention")
        q, k, v, gate = attention_inputs(self, x)  # (B, H, N, hd) each
        o = biased_attention(self, q, k, v, attn_mask)  # (fused and maskless: FlashAttention stays on)
        if self.amod_want:
            with torch.no_grad():  # what is merged, and what protected, is a discrete choice: no gradient through it
                self.amod_keep(q, k, v, None if attn_mask is None else attn_mask.tensor)
        return attention_output(self, o, gate)

    def amod_keep(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> None:
        """Keep what the block's reduction reads of this forward ((B, H, N, hd) each, without gradient): the metric,
        and the importance where wanted. A reduction that reads more (PPT's value norms) extends it."""
        rows = importance_rows(self.amod_class_rows, k.shape[2])
        if self.amod_want_importance and rows > 0:
            # the class tokens' rows of the attention, (B, H, rows, N), averaged over heads and rows
            self.amod_importance = attention_probs(q[:, :, :rows], k, self.scale, attn_mask).mean(dim=(1, 2))
        metric = k.mean(1)  # (B, N, hd): what the tokens are matched on, as unit vectors
        self.amod_metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def amod_take(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(metric, importance) of the last forward, let go of here: no activation stays alive between forwards."""
        metric, importance = self.amod_metric, self.amod_importance
        self.amod_metric = self.amod_importance = None
        return metric, importance


@dataclass(kw_only=True)
class SizedSettings:
    """What a token-reduction block knows besides its weights; set once at conversion (``make_sized``)."""

    num_prefix: int  # prefix tokens (class, distillation, registers): never removed
    sizes: TokenSizes  # the token sizes, shared by the model's blocks during one forward
    first: bool  # block 0: every forward of the model starts here, each token standing for itself
    # the sizes (and the block's own state) each forward read, for gradient checkpointing's recompute
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False, compare=False)


class SizedTokensBlock(Block):
    """timm ``Block`` on sized tokens that removes ``_removed(t)`` of its t patch tokens between attention
    and MLP (which ones: ``_reduce``), with proportional attention on the sizes.

    Attribute set at conversion (``make_sized``): ``amod``, its ``SizedSettings``. After a forward,
    ``amod_last_tokens`` holds the tokens left after this block.
    """

    amod: SizedSettings
    amod_kind: ClassVar[str] = "token-reduction block"  # what errors call the block

    # ------------------------------------------------------------ what a specialisation says

    def _removed(self, tokens: int, capacity: Optional[float] = None) -> int:
        """Patch tokens removed from the ``tokens`` patch tokens the block gets (``capacity``: a capacity
        to price at instead of the model's, where the block has one)."""
        raise NotImplementedError

    def _reduce(self, x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor,
                importance: Optional[torch.Tensor], r: int, destinations: bool = False) -> tuple[torch.Tensor, ...]:
        """Tokens (B, N, D) with sizes (B, N, 1; None: all 1) -> the N - r tokens left and their sizes; ``metric``
        (B, N, hd, unit vectors) and ``importance`` (B, N; where ``_wants_importance``) from this block's attention.
        With ``destinations`` (a forward that lays its tokens back on the patch grid: ``amod.patch_grid``), also
        where each of the N tokens went (B, N) int64: the index of the token left that holds it."""
        raise NotImplementedError

    def _image_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1) image numbers of ``x``'s batch for the advanced indexing of ``_reduce`` (``amod.tokens.image_rows``),
        made once per forward and shared by the model's blocks (``TokenSizes.image_rows``)."""
        return self.amod.sizes.image_rows(x)

    def _wants_importance(self) -> bool:
        """Whether ``_reduce`` reads the importance (the attention the class tokens give), which costs its rows."""
        return False

    def _read_state(self) -> Any:
        """What else a forward reads from outside its input, remembered for a recompute (e.g. random draws)."""
        return None

    def _replay(self, state: Any) -> ContextManager:
        """Within this context ``_reduce`` decides as it did in the forward that read ``state``."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------ the skeleton

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError(f"{self.amod_kind}s do not support attention masks or causal attention")
        settings = self.amod
        sizes = settings.sizes
        # gradient checkpointing's recompute takes the sizes and state of its forward and leaves the shared sizes alone
        replay = recomputing()
        if replay:
            size, state = settings.memo.recall(x, self.amod_kind)
            bias = proportional_bias(size)  # (the recompute's own: the shared one has moved on)
        else:
            if settings.first:
                sizes.set(None)  # a new forward: every token stands for itself
            size, bias, state = sizes.size, sizes.bias, self._read_state()
            settings.memo.remember(x, (size, state))
        r = self._removed(x.shape[1] - settings.num_prefix)
        self.attn.amod_want = r > 0
        self.attn.amod_want_importance = r > 0 and self._wants_importance()
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=bias)))
        track = sizes.track and not replay  # a forward that lays its tokens back on the patch grid
        if r > 0:
            metric, importance = self.attn.amod_take()
            with self._replay(state) if replay else contextlib.nullcontext():
                # (B, N - r, D), (B, N - r, 1) and, when tracking, where each of the N went
                x, size, *moved = self._reduce(x, size, metric, importance, r, destinations=track)
            if not replay:
                sizes.set(size, moved[0] if moved else None)
        if not replay:
            self.amod_last_tokens = x.shape[1]
        if track:
            self.amod_source = sizes.source  # where each original token is after this block (amod.patch_grid)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """MACs on ``tokens`` tokens for ``amod.flops`` (``reduction_macs``); ``capacity``: see ``_removed``."""
        r = self._removed(tokens - num_prefix, capacity)
        return BlockPrice(reduction_macs(self, tokens, r, num_prefix, self.attn.amod_class_rows), tokens, tokens - r)


def make_sized(blk: nn.Module, block_cls: type[SizedTokensBlock], settings: SizedSettings,
               class_rows: int = 0) -> None:
    """Turn a timm ``Block`` into ``block_cls`` and its ``Attention`` into ``SizedAttention``, in place.

    Class swaps, like ``amod.convert``: parameters and state_dict keys stay as they were. The blocks of
    one model share one ``TokenSizes`` in their settings, and block 0 is ``first``. ``class_rows``: the
    attention rows whose mean the block reads as importance (0: none; ``ALL_ROWS``: every token's).
    """
    blk.__class__ = block_cls
    blk.attn.__class__ = SizedAttention
    blk.attn.amod_want = blk.attn.amod_want_importance = False
    blk.attn.amod_class_rows = class_rows
    blk.attn.amod_metric = blk.attn.amod_importance = None
    blk.amod = settings


def per_block_counts(r: Union[int, Sequence[int]], count: int, patches: int, block: str = "block",
                     verb: str = "merges", named: str = "") -> list[int]:
    """``r``, tokens removed by each of ``count`` reducing blocks (one int for all, or one per block), as a list; refused
    in one line where it is not ints >= 0, has another length, or names more than the model's ``patches`` patch
    tokens (a block removes at most half of what it has left, so more can only be a mistake). ``block``, ``verb``
    and ``named`` (the blocks, e.g. " [3, 6, 9]") word the messages: ToMe's and PiToMe's blocks merge, PPT's
    remove."""
    done = {"merges": "merged", "removes": "removed"}[verb]
    if isinstance(r, bool) or not isinstance(r, (int, list, tuple)):
        raise UserError(f"r must be an int (tokens {done} in every {block}) or a list of ints (one per {block}), "
                        f"got {r!r}")
    values = [r] * count if isinstance(r, int) else list(r)
    if len(values) != count:
        raise UserError(f"r has {len(values)} entries; the model has {count} {block}s{named}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UserError(f"tokens {done} per {block} must be integers >= 0, got {v!r}")
    too_many = [v for v in values if v > patches]
    if too_many:
        raise UserError(f"r = {too_many[0]} is more than the {patches} patch tokens of the model; each {block} {verb} "
                        "at most half of the patch tokens it has left")
    return values
