"""Token bookkeeping shared by every token reduction: gather, scatter, bipartite matching and pairs
reduced by size-weighted average.

Pure functions on tensors (plus two small state holders), no modules: each piece can be tested on its
own. Shapes: B images, N tokens (p prefix tokens first, then n patch tokens), D channels.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .ops import tracing


def flat_index(index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(B, M) per-image token indices -> (B * M,) row indices into the (B * N, D) flattened batch.

    Whole-row copies by ``index_select``/``index_copy``/``index_add`` on the flattened batch are several
    times faster on the CPU than ``gather``/``scatter`` with an index expanded over D.
    """
    offsets = torch.arange(index.shape[0], device=index.device).unsqueeze(1) * num_tokens
    return (index + offsets).reshape(-1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, N, D) tokens, (B, M) indices -> (B, M, D) gathered tokens."""
    B, N, D = x.shape
    return x.reshape(B * N, D).index_select(0, flat_index(index, N)).view(B, index.shape[1], D)


def scatter_tokens(x: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of x (B, N, D) with rows ``index`` (B, M) replaced by ``values`` (B, M, D).

    Out of place, so autograd sees it and the untouched rows are bit-identical to x.
    """
    B, N, D = x.shape
    return x.reshape(B * N, D).index_copy(0, flat_index(index, N), values.reshape(-1, D)).view(B, N, D)


# ---------------------------------------------------------------- ranking

def descending_order(scores: torch.Tensor) -> torch.Tensor:
    """Indices that order each row of ``scores`` (B, n) from the highest score down, ties broken by position
    (the lower index first): (B, n) int64.

    A reduced model's output depends on this order (which tokens are protected, merged or kept, and the order of
    the tokens left), and ties are common: identical background patches score alike, and protected tokens all
    score -inf in the matching. So every backend must break them the same way: a stable sort in eager PyTorch and
    under ``torch.compile``; ONNX's TopK in an export (the ONNX exporters have no stable sort, and TopK's
    specification breaks ties by the lower index, as ONNX Runtime does).
    """
    if torch.onnx.is_in_onnx_export():
        return scores.topk(scores.shape[-1], dim=-1).indices
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores of each row of ``scores`` (B, n), highest first, ties to the lower
    position (``descending_order``): (B, k)."""
    return descending_order(scores)[:, :k]


# ---------------------------------------------------------------- sized tokens

class TokenSizes:
    """Token sizes (B, N, 1), the patches each token stands for, shared by the blocks of one model that
    reduces tokens (fold, ToMe: ``amod.reduce``) during one forward; None while every size is 1."""

    def __init__(self) -> None:
        self.size: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return f"TokenSizes(tokens={None if self.size is None else self.size.shape[1]})"


def bipartite_soft_matching(metric: torch.Tensor, r: int, protected: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ToMe's matching on patch tokens only.

    Args:
        metric: (B, n, c) features to compare (keys averaged over heads).
        r: pairs to merge, at most n // 2 (with ``protected``: at most the unprotected A tokens).
        protected: optional (B, n) bool; a protected token is neither merged away (as an A token) nor
            merged into (as a B token).

    Returns:
        (unmerged, src, dst): indices into set A (even positions) of the A tokens kept, (B, a - r, 1),
        and of those merged, (B, r, 1); and, for each merged A token, its partner's index in set B
        (odd positions), (B, r, 1).
    """
    metric = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    a, b = metric[:, ::2], metric[:, 1::2]
    scores = a @ b.transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
    if protected is not None:
        scores = scores.masked_fill(protected[:, 1::2].unsqueeze(1), -math.inf)  # never into a protected B
    node_max, node_idx = scores.max(dim=-1)
    if protected is not None:
        node_max = node_max.masked_fill(protected[:, ::2], -math.inf)  # a protected A token stays
    edge_idx = descending_order(node_max)[..., None]  # ties (protected tokens: all -inf) by position
    unmerged, src = edge_idx[:, r:], edge_idx[:, :r]
    dst = node_idx[..., None].gather(1, src)
    return unmerged, src, dst


def _pair_sum(x: torch.Tensor, unmerged: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Set A's unmerged tokens, then set B with A's merged tokens added to their partners.

    ``x``: (B, n, c) patch tokens, contiguous; set A = even positions, set B = odd positions.
    """
    B, n, c = x.shape
    kept = gather_tokens(x, 2 * unmerged.squeeze(-1))  # A's index i is position 2i: no copy of A first
    moved = gather_tokens(x, 2 * src.squeeze(-1))
    b = x[:, 1::2].reshape(B * (n // 2), c)
    b = b.index_add(0, flat_index(dst.squeeze(-1), n // 2), moved.reshape(-1, c)).view(B, n // 2, c)
    return torch.cat([kept, b], dim=1)


def reduce_weighted(x: torch.Tensor, size: torch.Tensor, metric: torch.Tensor, r: int,
                    num_prefix: int, protected: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Remove r patch tokens of ``x`` (B, N, D): the r best pairs of ``bipartite_soft_matching`` on ``metric``
    (B, N, c), each A token averaged into its B partner by size; prefix tokens stay.

    ``protected``: optional (B, N - num_prefix) bool over the patch tokens (see ``bipartite_soft_matching``).
    Returns the tokens left (B, N - r, D) in ToMe's order (set A's unmatched tokens, then set B) and their
    sizes (B, N - r, 1).
    """
    p = num_prefix
    unmerged, src, dst = bipartite_soft_matching(metric[:, p:], r, protected)
    weighted = _pair_sum(x[:, p:] * size[:, p:], unmerged, src, dst)
    new_size = _pair_sum(size[:, p:].contiguous(), unmerged, src, dst)
    merged = weighted / new_size
    return torch.cat([x[:, :p], merged.to(x.dtype)], 1), torch.cat([size[:, :p], new_size], 1)


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
