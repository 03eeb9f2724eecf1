"""Token bookkeeping for Mixture-of-Depths: who is kept, gather, scatter, and attention scores.

Pure functions on tensors, no modules and no state, so that each piece can be tested on its own.
Shapes: B images, N tokens (p prefix tokens first, then n patch tokens), D channels.
"""
from __future__ import annotations

import math

import torch


def num_kept(capacity: float, num_patches: int) -> int:
    """Number of patch tokens an MoD block processes: ceil(C * n), at least 1 (and at most n)."""
    # The small tolerance keeps e.g. 0.7 * 10 = 7.000000000000001 from rounding up to 8.
    return max(1, min(num_patches, math.ceil(capacity * num_patches - 1e-9)))


def select_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores per row, in ascending position order.

    Args:
        scores: (B, n) patch-token scores.
        k: how many to keep per row.

    Returns:
        (B, k) int64 indices into the patch tokens, sorted so gathered tokens keep their order.
    """
    idx = torch.topk(scores, k, dim=1, sorted=False).indices  # (B, k)
    return idx.sort(dim=1).values


def skipped_tokens(patch_idx: torch.Tensor, num_patches: int) -> torch.Tensor:
    """The patch indices not in ``patch_idx`` (B, k), in ascending order: (B, n - k)."""
    B, k = patch_idx.shape
    mask = torch.ones(B, num_patches, dtype=torch.bool, device=patch_idx.device).scatter_(1, patch_idx, False)
    return torch.arange(num_patches, device=patch_idx.device).expand(B, -1)[mask].view(B, num_patches - k)


def keep_index(patch_idx: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """Token indices of an MoD block's gathered set: every prefix token, then the chosen patches.

    Args:
        patch_idx: (B, k) indices into the patch tokens.
        num_prefix: p, the number of prefix tokens (CLS, distillation, registers).

    Returns:
        (B, p + k) indices into the full token sequence.
    """
    B = patch_idx.shape[0]
    prefix = torch.arange(num_prefix, device=patch_idx.device).expand(B, num_prefix)
    return torch.cat([prefix, patch_idx + num_prefix], dim=1)


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


def received_attention(attn: torch.Tensor) -> torch.Tensor:
    """A-MoD importance (paper Eq. 4) from an explicit attention matrix.

    r_i = 1/(H N) sum_h sum_j A[h, j, i]: the mean attention token i receives over heads and queries.

    Args:
        attn: (B, H, N_query, N_key) softmax attention.

    Returns:
        (B, N_key) scores; each row sums to 1.
    """
    return attn.mean(dim=(1, 2))


def mean_normalized_gate(kept_scores: torch.Tensor) -> torch.Tensor:
    """Output gate for routers whose scores are not a learned logit (attention, random).

    g_i = r_i / mean_j r_j over the kept patch tokens of the same image: the gates average 1, so
    scaling changes how much each token's update counts relative to the others, not the overall size
    of the update (raw A-MoD scores are about 1/N and would all but erase the block's output).

    Args:
        kept_scores: (B, k) scores of the kept patch tokens (non-negative).
    """
    return kept_scores / kept_scores.mean(dim=1, keepdim=True).clamp_min(torch.finfo(kept_scores.dtype).tiny)
