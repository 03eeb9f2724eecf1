"""Attention that also returns A-MoD's token-importance scores.

``attention_with_scores(q, k, v)`` gives softmax attention and, per key token, the mean attention it
received over heads and queries (paper Eq. 4). The fused path never holds the (B, H, N, N) matrix:
PyTorch's fused kernel returns the output and each query row's logsumexp, and the column sums are
accumulated over query tiles as sum_j exp(q_j . k_i * scale - lse_j) (paper Algorithm 1).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .routing import received_attention

# Query rows per tile in the fused path: memory is O(B * H * tile * N) on top of the attention itself.
DEFAULT_TILE = 128


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "q (B, H, Nq, D), k (B, H, Nk, D) and v (B, H, Nk, Dv) do not match: "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def attention_scores_explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: forms the (B, H, N, N) matrix. Differentiable in both outputs.

    Logits and softmax are computed in float32 whatever the input dtype (bf16 logits would put
    percent-level errors into the scores).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = (q.float() @ k.float().transpose(-2, -1)).mul_(scale).softmax(dim=-1)  # (B, H, N, N)
    scores = received_attention(attn)  # (B, N), before dropout: dropout is noise, not importance
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return attn.to(v.dtype) @ v, scores


@torch.no_grad()
def _received_attention_tiled(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float, tile: int
) -> torch.Tensor:
    """Column sums of softmax(q k^T * scale) from the rows' logsumexp, one query tile at a time."""
    B, H, N, _ = q.shape
    acc = torch.zeros(B, H, k.shape[2], dtype=torch.float32, device=q.device)
    kt = k.float().transpose(-2, -1)
    for start in range(0, N, tile):
        logits = torch.matmul(q[:, :, start:start + tile].float(), kt)  # (B, H, t, N), fp32 as the lse is
        logits.mul_(scale).sub_(lse[:, :, start:start + tile, None])
        acc += logits.exp_().sum(dim=2)
    return acc.sum(dim=1) / (H * N)  # (B, N)


def attention_with_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    *,
    dropout_p: float = 0.0,
    scores_need_grad: bool = False,
    tile: int = DEFAULT_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention plus the mean attention each key received.

    Args:
        q: (B, H, N, D) queries.
        k: (B, H, N, D) keys.
        v: (B, H, N, Dv) values.
        scale: logit scale; defaults to D ** -0.5 as in ``F.scaled_dot_product_attention``.
        dropout_p: attention dropout on the output (the scores are taken before dropout).
        scores_need_grad: the caller backpropagates through the scores; uses the explicit path.
        tile: query rows per tile in the fused path.

    Returns:
        ``out`` (B, H, N, Dv) like ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` and
        ``scores`` (B, N) float32, r_i = 1/(H N) sum_h sum_j A[h, j, i]; each row sums to 1.
    """
    _check_qkv(q, k, v)
    if tile < 1:
        raise ValueError(f"tile must be a positive number of query rows, got {tile}")
    if scores_need_grad or dropout_p > 0.0 or q.device.type != "cpu":
        return attention_scores_explicit(q, k, v, scale, dropout_p)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, _received_attention_tiled(q.detach(), k.detach(), lse, scale, tile)
