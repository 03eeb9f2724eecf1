"""Triton kernels for A-MoD's received-attention scores without the N x N matrix (paper Algorithm 1).

Two passes over (query tile, key tile) pairs, both O(N) in memory:
1. row pass: each query row's logsumexp over all keys (online max / sum, as in flash attention);
2. column pass, tiled column-first: for a tile of keys, sum exp(q_j . k_i * scale - lse_j) over every
   query j; the result is the attention each key received, per head. Queries and keys may differ in
   number (Nq, Nk).
The attention output itself comes from ``F.scaled_dot_product_attention``.

Runs on CUDA; under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (used by the tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled_logits(q, k, scale, EXACT: tl.constexpr):
    """q (M, D) . k (N, D)^T * scale in float32; EXACT: full fp32 products (no TF32, no bf16 dot)."""
    if EXACT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s.to(tl.float32) * scale


@triton.jit
def _load_rows(ptr, offs_rows, offs_d, N, D: tl.constexpr):
    """A (rows, BLOCK_D) tile of an (N, D) matrix; rows past N and columns past D read as 0."""
    return tl.load(ptr + offs_rows[:, None] * D + offs_d[None, :],
                   mask=(offs_rows[:, None] < N) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _row_lse_kernel(Q, K, LSE, scale, NQ, NK, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + bh * NQ * D, offs_m, offs_d, NQ, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, NK, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + bh * NK * D, offs_n, offs_d, NK, D)
        s = _scaled_logits(q, k, scale, EXACT)  # (BLOCK_M, BLOCK_N)
        s = tl.where(offs_n[None, :] < NK, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE + bh * NQ + offs_m, m_i + tl.log(l_i), mask=offs_m < NQ)


@triton.jit
def _column_sum_kernel(Q, K, LSE, OUT, scale, NQ, NK, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    bh = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + bh * NK * D, offs_n, offs_d, NK, D)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, NQ, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q = _load_rows(Q + bh * NQ * D, offs_m, offs_d, NQ, D)
        lse = tl.load(LSE + bh * NQ + offs_m, mask=offs_m < NQ, other=float("inf"))  # padded rows add exp(-inf) = 0
        s = _scaled_logits(q, k, scale, EXACT) - lse[:, None]
        p = tl.where(offs_n[None, :] < NK, tl.exp(s), 0.0)
        acc += tl.sum(p, 0)
    tl.store(OUT + bh * NK + offs_n, acc, mask=offs_n < NK)


def received_attention_triton(q: torch.Tensor, k: torch.Tensor, scale: float,
                              block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """(B, H, Nq, D) queries and (B, H, Nk, D) keys -> (B, Nk) float32 mean attention received over heads
    and queries."""
    B, H, NQ, D = q.shape
    NK = k.shape[2]
    qc = q.detach().contiguous().view(B * H, NQ, D)
    kc = k.detach().contiguous().view(B * H, NK, D)
    block_d = max(16, triton.next_power_of_2(D))
    # fp32 inputs get IEEE fp32 products (TF32 would miss the 1e-5 tolerance); Triton's interpreter
    # cannot multiply bf16 tiles, so there bf16 inputs are loaded as bf16 and multiplied in fp32.
    exact = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    lse = torch.empty(B * H, NQ, dtype=torch.float32, device=q.device)
    cols = torch.empty(B * H, NK, dtype=torch.float32, device=q.device)
    _row_lse_kernel[(B * H, triton.cdiv(NQ, block_m))](qc, kc, lse, scale, NQ, NK, D, block_m, block_n, block_d, exact)
    _column_sum_kernel[(B * H, triton.cdiv(NK, block_n))](qc, kc, lse, cols, scale, NQ, NK, D, block_m, block_n,
                                                         block_d, exact)
    return cols.view(B, H, NK).sum(dim=1) / (H * NQ)
