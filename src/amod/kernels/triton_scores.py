"""Triton kernels for A-MoD's received-attention scores without the N x N matrix (paper Algorithm 1).

Two passes over (query tile, key tile) pairs, both O(N) in memory:
1. row pass: each query row's logsumexp over all keys (online max / sum, as in flash attention);
   skipped when the caller has the logsumexp already (the fused attention kernels return it);
2. column pass, tiled column-first: for a tile of keys, sum exp(q_j . k_i * scale - lse_j) over every
   query j; the result is the attention each key received, per head. Queries and keys may differ in
   number (Nq, Nk).
The attention output itself comes from ``F.scaled_dot_product_attention``.

Runs on CUDA; under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (used by the tests).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..errors import UserError


@triton.jit
def _scaled_logits(q, k, scale, EXACT: tl.constexpr):
    """q (M, D) . k (N, D)^T * scale in float32; EXACT: full fp32 products (no TF32, no bf16 dot)."""
    if EXACT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s.to(tl.float32) * scale


@triton.jit
def _load_rows(ptr, offs_rows, offs_d, N, stride_n, D: tl.constexpr):
    """A (rows, BLOCK_D) tile of an (N, D) matrix with row stride ``stride_n`` (unit column stride);
    rows past N and columns past D read as 0."""
    return tl.load(ptr + offs_rows[:, None] * stride_n + offs_d[None, :],
                   mask=(offs_rows[:, None] < N) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _row_lse_kernel(Q, K, LSE, scale, NQ, NK, H, sqb, sqh, sqn, skb, skh, skn, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, NQ, sqn, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, NK, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + h * skh, offs_n, offs_d, NK, skn, D)
        s = _scaled_logits(q, k, scale, EXACT)  # (BLOCK_M, BLOCK_N)
        s = tl.where(offs_n[None, :] < NK, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE + bh * NQ + offs_m, m_i + tl.log(l_i), mask=offs_m < NQ)


@triton.jit
def _column_sum_kernel(Q, K, LSE, OUT, scale, NQ, NK, H, sqb, sqh, sqn, skb, skh, skn, slb, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b * skb + h * skh, offs_n, offs_d, NK, skn, D)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, NQ, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, NQ, sqn, D)
        lse = tl.load(LSE + bh * slb + offs_m, mask=offs_m < NQ, other=float("inf"))  # padded rows add exp(-inf) = 0
        s = _scaled_logits(q, k, scale, EXACT) - lse[:, None]
        p = tl.where(offs_n[None, :] < NK, tl.exp(s), 0.0)
        acc += tl.sum(p, 0)
    tl.store(OUT + bh * NK + offs_n, acc, mask=offs_n < NK)


def received_attention_triton(q: torch.Tensor, k: torch.Tensor, scale: float, block_m: int = 32,
                              block_n: int = 64, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, H, Nq, D) queries and (B, H, Nk, D) keys -> (B, Nk) float32 mean attention received over heads
    and queries. ``lse``: each query row's logsumexp of the scaled logits, (B, H, >= Nq) float32 (as the
    fused attention kernels return it); given, the row pass is skipped. Strided views (timm's q and k
    are views of the qkv projection) are read in place where the last dimension is contiguous.
    Default tiles: on an H200, the column pass at (B, H, N, D) = (256, 12, 197, 64) in bf16 took 156 us
    with 32 x 64 against 195 us with 64 x 64 (fastest of 32/64/128 each way)."""
    B, H, NQ, D = q.shape
    NK = k.shape[2]
    q, k = q.detach(), k.detach()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    block_d = max(16, triton.next_power_of_2(D))
    # fp32 inputs get IEEE fp32 products (TF32 would miss the 1e-5 tolerance); Triton's interpreter
    # cannot multiply bf16 tiles, so there bf16 inputs are loaded as bf16 and multiplied in fp32.
    exact = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    strides = (H, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    if lse is None:
        lse = torch.empty(B * H, NQ, dtype=torch.float32, device=q.device)
        _row_lse_kernel[(B * H, triton.cdiv(NQ, block_m))](q, k, lse, scale, NQ, NK, *strides, D, block_m, block_n,
                                                           block_d, exact)
    else:
        if lse.shape[:2] != (B, H) or lse.shape[2] < NQ:
            raise UserError(f"lse must be (B, H, >= Nq) = ({B}, {H}, >= {NQ}), got {tuple(lse.shape)}")
        lse = lse.detach().float().reshape(B * H, lse.shape[2])
    cols = torch.empty(B * H, NK, dtype=torch.float32, device=q.device)
    _column_sum_kernel[(B * H, triton.cdiv(NK, block_n))](q, k, lse, cols, scale, NQ, NK, *strides, lse.stride(0), D,
                                                         block_m, block_n, block_d, exact)
    return cols.view(B, H, NK).sum(dim=1) / (H * NQ)
