"""Routing for Mixture-of-Depths: how many patch tokens a block keeps (k), which ones (top-k), the
kept and skipped indices, and the output gate of the routers whose scores are not a learned logit.

Pure functions on tensors, no modules and no state, so that each piece can be tested on its own.
Gathering and scattering the tokens is ``amod.tokens``; the attention scores A-MoD ranks by come
from ``amod.ops``; the routers that score the tokens are ``amod.mod.routers``.
Shapes: B images, N tokens (p prefix tokens first, then n patch tokens), D channels.
"""
from __future__ import annotations

import math

import torch

from ..ops import tracing
from ..tokens import top_indices


def num_kept(capacity: float, num_patches: int) -> int:
    """Number of patch tokens an MoD block processes: ceil(C * n), at least 1 (and at most n)."""
    # The small tolerance keeps e.g. 0.7 * 10 = 7.000000000000001 from rounding up to 8.
    return max(1, min(num_patches, math.ceil(capacity * num_patches - 1e-9)))


def select_tokens(scores: torch.Tensor, k: int, unit: float = 1.0) -> torch.Tensor:
    """Indices of the k highest scores per row, in ascending position order.

    Args:
        scores: (B, n) patch-token scores.
        k: how many to keep per row.
        unit: the scores' scale (the router's ``score_unit``), which the ranking's grid is relative to
            (``amod.tokens.decision_key``: scores within a step of each other tie, and the lower position is kept).

    Returns:
        (B, k) int64 indices into the patch tokens, sorted so gathered tokens keep their order.
    """
    return top_indices(scores, k, unit).sort(dim=1).values  # (B, k)


def skipped_tokens(patch_idx: torch.Tensor, num_patches: int) -> torch.Tensor:
    """The patch indices not in ``patch_idx`` (B, k), in ascending order: (B, n - k)."""
    B, k = patch_idx.shape
    if tracing():  # the same indices without a boolean mask (whose result size a graph cannot know)
        position = torch.arange(num_patches, device=patch_idx.device).expand(B, -1)
        key = position.scatter(1, patch_idx, num_patches + patch_idx)  # kept patches sort after every skipped one
        return key.topk(num_patches - k, dim=1, largest=False, sorted=True).values
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


def mean_normalized_gate(kept_scores: torch.Tensor) -> torch.Tensor:
    """Output gate for routers whose scores are not a learned logit (attention, random).

    g_i = r_i / mean_j r_j over the kept patch tokens of the same image: the gates average 1, so
    scaling changes how much each token's update counts relative to the others, not the overall size
    of the update (raw A-MoD scores are about 1/N and would all but erase the block's output).

    Args:
        kept_scores: (B, k) scores of the kept patch tokens (non-negative).
    """
    return kept_scores / kept_scores.mean(dim=1, keepdim=True).clamp_min(torch.finfo(kept_scores.dtype).tiny)
