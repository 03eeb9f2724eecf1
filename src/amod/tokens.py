"""Token bookkeeping shared by every token reduction: gather, scatter, bipartite matching and pairs
reduced by size-weighted average.

Pure functions on tensors (plus two small state holders), no modules: each piece can be tested on its
own. Shapes: B images, N tokens (p prefix tokens first, then n patch tokens), D channels.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from .ops import KeyBias, as_float32, recomputing, tracing


def flat_index(index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(B, M) per-image token indices -> (B, M) row indices into the (B * N, D) flattened batch (three operations: the
    image offsets, their column, the sum).

    Whole-row copies from the flattened batch (``gather_tokens``) are several times faster on the CPU than ``gather``
    with an index expanded over D.
    """
    B = index.shape[0]
    return index + torch.arange(0, B * num_tokens, num_tokens, device=index.device).unsqueeze(1)


def image_rows(index: torch.Tensor) -> torch.Tensor:
    """(B, 1): each image's number, the first index of an advanced indexing ``t[image_rows(i), i]`` that picks row
    ``i[b, j]`` of image b (one operation for the gather or the write, where ``gather`` takes an index expanded over
    the channels)."""
    return torch.arange(index.shape[0], device=index.device).unsqueeze(1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, N, D) tokens, (B, M) indices -> (B, M, D) gathered tokens: rows of the flattened batch, by
    ``F.embedding`` (one operation, ``index_select``'s row copies)."""
    B, N, D = x.shape
    return F.embedding(flat_index(index, N), x.reshape(B * N, D))


def scatter_tokens(x: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of x (B, N, D) with rows ``index`` (B, M) replaced by ``values`` (B, M, D).

    Out of place, so autograd sees it and the untouched rows are bit-identical to x. One write (``index_put``, as
    fast as ``index_copy`` on the flattened batch, with no flat index to make).
    """
    return x.index_put((image_rows(index), index), values)


# ---------------------------------------------------------------- ranking

DECISION_GRID = 2.0 ** -11  # a decision key's step, in units of the score's scale (``decision_key``)


def decision_key(scores: torch.Tensor, unit: float = 1.0) -> torch.Tensor:
    """What every discrete choice of a reduction (a top-k, an order, a best partner) ranks ``scores`` by: the
    scores on a grid of ``DECISION_GRID`` x ``unit`` steps, as whole numbers of steps in float32; -inf stays -inf.

    A score carries rounding noise that depends on the backend and on the batch (a kernel's blocking changes with
    the number of rows): on the real DINOv2 ViT-S/14 at 224 px, cosines differ by up to about 5e-7 between ONNX
    Runtime and eager PyTorch. Decided on the raw scores, a choice flips wherever two scores lie within that noise,
    as the near-equal tokens of a flat background do, and one flipped merge changes every later block. On the
    grid, scores within a step of each other tie, and ties go by position (the lower index first:
    ``descending_order``, ``best_match``) in every backend. A choice still flips where a score lies within the
    noise of a grid line: rarer, not never (docs/export.md has the measured rates; a coarser grid flips less and
    keeps the reduction further from its exact scores).

    ``unit`` is the scores' scale, which the step is relative to: 1 for cosines and PiToMe's energies (in
    [-1, 1]), 1 / n for the attention shares of n tokens (about 1 / n each), a router's own for its scores
    (``Router.score_unit``). A multiplication and ``round`` (half to even in PyTorch, under ``torch.compile`` and
    in ONNX): the same key from the same score in every backend. (A cast to a lower precision would round too, but
    ``torch.compile`` removes a cast there and back.) Scores of a lower precision are cast to float32 first; float32
    ones are not (a cast to their own dtype is one more operation dispatched).
    """
    return torch.round(as_float32(scores) * (1.0 / (unit * DECISION_GRID)))


def descending_order(scores: torch.Tensor, unit: float = 1.0) -> torch.Tensor:
    """Indices that order each row of ``scores`` (B, n) from the highest down by ``decision_key(scores, unit)``,
    ties broken by position (the lower index first): (B, n) int64.

    A reduced model's output depends on this order (which tokens are protected, merged or kept, and the order of
    the tokens left), and ties are common: near-equal scores share a key, and protected tokens all score -inf in
    the matching. So every backend breaks them the same way: a stable sort in eager PyTorch and under
    ``torch.compile``; ONNX's TopK in an export (the ONNX exporters have no stable sort, and TopK's specification
    breaks ties by the lower index, as ONNX Runtime does).
    """
    return order_of_keys(decision_key(scores, unit))


def order_of_keys(key: torch.Tensor) -> torch.Tensor:
    """``descending_order`` of scores that are already decision keys (``decision_key``, ``best_match``'s first
    output), for a reduction that ranks by a key it also uses for another choice."""
    if torch.onnx.is_in_onnx_export():
        return key.topk(key.shape[-1], dim=-1).indices
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def top_indices(scores: torch.Tensor, k: int, unit: float = 1.0) -> torch.Tensor:
    """The indices of the k highest scores of each row of ``scores`` (B, n), highest first, by ``decision_key``
    and ties to the lower position (``descending_order``): (B, k)."""
    return descending_order(scores, unit)[:, :k]


def best_match(scores: torch.Tensor, unit: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best column of ``scores`` (..., n): (its ``decision_key``, its index), a tie to the lower index
    (``max``'s, ONNX ArgMax's and ONNX Runtime's rule)."""
    return decision_key(scores, unit).max(dim=-1)


# ---------------------------------------------------------------- sized tokens

class TokenSizes:
    """The state of one forward that every block of a model that reduces tokens (fold, ToMe, PiToMe, PPT:
    ``amod.reduce``) shares: the token sizes (B, N, 1), the patches each token stands for, and the
    proportional-attention bias made of them, log(size) as a per-key bias (B, 1, 1, N) (``proportional_bias``, a
    ``KeyBias``); both None while every size is 1.

    While ``track`` is set (``amod.patch_grid.tracking``: a forward asked for the patch grid), it also keeps
    ``source`` (B, N0): for each of the N0 tokens the model started with (prefix, then patches in grid order),
    the index of the token that holds it now; None while no token has left. An index map, one int per original
    token: laying a sequence back on the grid is one gather (``lay_back``). Off, the reductions compute none of it.
    """

    def __init__(self) -> None:
        self.size: Optional[torch.Tensor] = None
        self.bias: Optional[KeyBias] = None
        self.track = False
        self.source: Optional[torch.Tensor] = None
        self.rows: Optional[torch.Tensor] = None  # this forward's ``image_rows``, made by the first block that asks

    def set(self, size: Optional[torch.Tensor], destinations: Optional[torch.Tensor] = None) -> None:
        """The sizes after a reduction, and their bias (made once here, read by every later block); ``size`` None
        starts a new forward. ``destinations`` (B, N), while tracking: where each token before the reduction went,
        composed into ``source``."""
        self.size, self.bias = size, proportional_bias(size)
        if size is None:
            self.source = self.rows = None
        elif destinations is not None:
            self.source = destinations if self.source is None else destinations.gather(1, self.source)

    def image_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1) image numbers of ``x``'s batch (``amod.tokens.image_rows``), made once per forward and shared by its
        reductions (two operations fewer in each); gradient checkpointing's recompute makes its own."""
        rows = self.rows
        if recomputing():
            return image_rows(x)
        if rows is None or rows.shape[0] != x.shape[0] or rows.device != x.device:
            rows = self.rows = image_rows(x)
        return rows

    def __repr__(self) -> str:
        return f"TokenSizes(tokens={None if self.size is None else self.size.shape[1]})"


def proportional_bias(size: Optional[torch.Tensor]) -> Optional[KeyBias]:
    """Proportional attention: log(size) (B, N, 1) as a per-key bias of the attention logits, (B, 1, 1, N)
    (``amod.ops.KeyBias``: added in one more head channel of the keys, no mask); None while every token stands for
    itself. A token then counts in every query's softmax as many times as the patches it holds."""
    return None if size is None else KeyBias(size.log().view(size.shape[0], 1, 1, size.shape[1]))


def with_sizes(x: torch.Tensor, size: Optional[torch.Tensor]) -> torch.Tensor:
    """Tokens (B, N, D) and their sizes (B, N, 1; None: every size 1) as one (B, N, D + 1) tensor: each token times
    its size, then the size. Averages by size are then sums of its rows, and one gather or scatter moves a token's
    features and its size together (``without_sizes`` divides them out again)."""
    if size is None:
        return torch.cat([x, x.new_ones(x.shape[0], x.shape[1], 1)], dim=-1)
    return torch.cat([x * size, size], dim=-1)


def without_sizes(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``with_sizes``'s (B, N, D + 1) sums -> the tokens' size-weighted averages (B, N, D) and their sizes (B, N, 1).

    The sizes are counts, not activations: they carry no gradient (detached where the sums carry one), so the
    proportional bias made of them is not part of any block's autograd graph (gradient checkpointing recomputes it).
    """
    sums, size = xs.split([xs.shape[-1] - 1, 1], dim=-1)  # (one split: two views in one operation)
    if size.requires_grad:
        size = size.detach()
    return sums / size, size


def bipartite_matching(metric: torch.Tensor, num_prefix: int, protected: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """ToMe's bipartite soft matching of the patch tokens: they alternate into set A (even patch positions) and set
    B (odd ones), and each A token's partner is its most similar B token.

    Args:
        metric: (B, N, c) unit vectors to compare (``SizedAttention``'s: the keys averaged over heads, normalised);
            the first ``num_prefix`` (prefix tokens) take no part.
        protected: optional (B, N - num_prefix) bool over the patch tokens; a protected token is neither merged
            away (as an A token: it ranks last) nor merged into (as a B token: no A token takes it as a partner).

    Returns:
        ``order`` (B, |A|): the A tokens from the most similar partner down, so that merging r pairs merges the
        first r; ``partner`` (B, |A|): each A token's partner, an index into set B. Both are decided on
        ``decision_key`` of the similarities, near-ties by position (``best_match``, ``descending_order``).
    """
    a, b = metric[:, num_prefix::2], metric[:, num_prefix + 1::2]
    scores = torch.bmm(a, b.transpose(1, 2))  # (B, |A|, |B|) cosine similarities
    if protected is not None:
        scores = scores.masked_fill(protected[:, None, 1::2], -math.inf)  # never into a protected B
    best, partner = best_match(scores)  # the partner and the order on one key: near-ties by position
    if protected is not None:
        best = best.masked_fill(protected[:, ::2], -math.inf)  # a protected A token stays
    return order_of_keys(best), partner  # ties (protected tokens: all -inf) by position


def merge_matched(xs: torch.Tensor, order: torch.Tensor, partner: torch.Tensor, r: int, num_prefix: int,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Merge the first r A tokens of ``order`` into their partners (``bipartite_matching``) in ``with_sizes``'s
    (B, N, C) sums: (B, N - r, C), in ToMe's order: the prefix tokens, set A's unmerged tokens (in ``order``), set B.
    A handful of operations with static shapes: one gather puts set A in order (advanced indexing by ``rows``,
    ``image_rows``, made here where not given: one operation, where ``gather`` needs its index expanded over C), one
    scatter-add merges (each B token plus its merged A tokens in ``order``'s order)."""
    C = xs.shape[-1]
    p, na = num_prefix, order.shape[1]
    rows = image_rows(order) if rows is None else rows
    a = xs[:, p::2][rows, order]  # (B, |A|, C): set A in matching order, the merged first
    merged, kept = a.split([r, na - r], dim=1)
    into = partner.gather(1, order[:, :r]).unsqueeze(-1).expand(-1, -1, C)  # (B, r, C): each merged one's partner
    return torch.cat([xs[:, :p], kept, xs[:, p + 1::2].scatter_add(1, into, merged)], dim=1)


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's permutation ``order`` (B, n): where each index stands in ``order``."""
    ranks = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter(1, order, ranks)


def matched_destinations(order: torch.Tensor, partner: torch.Tensor, r: int, num_prefix: int, num_patches: int
                         ) -> torch.Tensor:
    """Where ``merge_matched`` puts each of its p + n input tokens (B, p + n), given the same ``order``, ``partner``,
    r and prefix: a prefix token stays, an unmerged A token of rank m goes to p + m - r, a merged one to its
    partner's place, B token j to p + |A| - r + j (A: the even patch positions, B: the odd ones)."""
    p, (B, na) = num_prefix, order.shape
    b_start = p + na - r
    rank = inverse_order(order)
    to_a = torch.where(rank >= r, p + rank - r, b_start + partner)  # (B, |A|)
    positions = torch.arange(p + na, device=order.device)
    to_b = (b_start + positions[:na]).expand(B, -1)  # (B, |A|): B has |A| or |A| - 1 tokens, the last cut below
    patches = torch.stack([to_a, to_b], dim=-1).reshape(B, 2 * na)[:, :num_patches]
    return torch.cat([positions[:p].expand(B, -1), patches], dim=1)


def reordered_destinations(destinations: torch.Tensor, order: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """Destinations (B, N) of a sequence whose patch tokens were first put in ``order`` (B, n) -> the
    destinations of the sequence before that reordering (prefix tokens were not reordered)."""
    p = num_prefix
    return torch.cat([destinations[:, :p], destinations[:, p:].gather(1, inverse_order(order))], dim=1)


def lay_back(x: torch.Tensor, source: Optional[torch.Tensor]) -> torch.Tensor:
    """Tokens (B, N, D) of a reduced sequence -> (B, N0, D): each of the N0 original tokens gets the feature of the
    token that holds it (``TokenSizes.source``; None: nothing was reduced, ``x`` itself). One gather."""
    return x if source is None else gather_tokens(x, source)


def reduce_weighted(x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor, r: int, num_prefix: int,
                    protected: Optional[torch.Tensor] = None, destinations: bool = False,
                    rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """Remove r patch tokens of ``x`` (B, N, D) with sizes ``size`` (B, N, 1; None: all 1): the r best pairs of
    ``bipartite_matching`` on ``metric`` (B, N, c), each A token averaged into its B partner by size; prefix tokens
    stay. ``protected``: see ``bipartite_matching``; ``rows``: ``image_rows`` of the batch, where already made.

    Returns the tokens left (B, N - r, D) in ToMe's order (prefix, set A's unmerged tokens, then set B) and their
    sizes (B, N - r, 1); with ``destinations``, also where each input token went (B, N: ``matched_destinations``).
    """
    order, partner = bipartite_matching(metric, num_prefix, protected)
    x, size = without_sizes(merge_matched(with_sizes(x, size), order, partner, r, num_prefix, rows))
    if not destinations:
        return x, size
    return x, size, matched_destinations(order, partner, r, num_prefix, metric.shape[1] - num_prefix)


# ---------------------------------------------------------------- gradient checkpointing

class ForwardMemo:
    """What one block read from outside its input in each forward, kept for gradient checkpointing.

    A checkpointed block runs again in the backward (``amod.ops.recomputing``) on the same input (a
    detached alias of it when reentrant) and must see what its first run saw, though the shared state
    has moved on by then. Entries are keyed by that input's storage and hold a weak reference to it:
    an entry lives as long as the autograd graph keeps the input (until the backward), and keeps no
    activation alive itself. Plain object: nothing in state_dicts; copies start empty.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[StorageWeakRef, Any]] = {}

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return x.untyped_storage()._cdata, x.storage_offset(), tuple(x.shape), x.stride()

    def _prune(self) -> None:
        for key in [key for key, (ref, _) in self._entries.items() if ref.expired()]:
            del self._entries[key]

    def remember(self, x: torch.Tensor, value: tuple) -> None:
        """Keep ``value`` for a recompute on ``x``, if a backward may follow: with grad enabled, or in
        reentrant checkpointing's forward (no grad, an input that requires it). Nothing while tracing."""
        if tracing() or not (torch.is_grad_enabled() or x.requires_grad):
            return
        # tensors kept detached (no graph kept alive) but requiring grad as they did: the recompute must
        # record the autograd ops, and save the tensors, that the forward did (checkpointing checks)
        value = tuple(v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                      for v in value)
        self._prune()
        key = self._key(x)
        # the same live input twice: a recompute could not tell the two forwards apart
        self._entries[key] = (StorageWeakRef(x.untyped_storage()), _AMBIGUOUS if key in self._entries else value)

    def recall(self, x: torch.Tensor, owner: str) -> tuple:
        """What the forward on ``x`` remembered; ``owner`` names the block in the errors."""
        entry = self._entries.get(self._key(x))
        if entry is None or entry[0].expired():
            raise RuntimeError(f"the {owner} found no record of its forward on this input to recompute for "
                               "gradient checkpointing; recompute each block on its own input, as timm's "
                               "set_grad_checkpointing does")
        if entry[1] is _AMBIGUOUS:
            raise RuntimeError(f"the {owner} ran twice on the same input before the backward: gradient "
                               "checkpointing cannot tell which forward it recomputes")
        return entry[1]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        self._prune()
        return len(self._entries)

    def __reduce__(self):
        return ForwardMemo, ()  # copies and pickles start empty (the weak references are per process)

    def __repr__(self) -> str:
        return f"ForwardMemo(entries={len(self)})"


_AMBIGUOUS = object()
