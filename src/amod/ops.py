"""Attention that also returns A-MoD's token-importance scores.

``attention_with_scores(q, k, v)`` gives softmax attention and, per key token, the mean attention it
received over heads and queries (paper Eq. 4), without holding the (B, H, N, N) matrix.

Paths: CPU, inference - output and scores from the same memory-bounded tiles of the softmax (on
this CPU as fast as PyTorch's fused kernel, and no second pass). CPU, training - PyTorch's fused CPU
kernel for output and logsumexp (it has a backward), then a tiled pass that sums
exp(q_j . k_i * scale - lse_j) over queries j (paper Algorithm 1).
CUDA - ``F.scaled_dot_product_attention`` for the output and the Triton kernels of
``amod.kernels.triton_scores`` for the scores (explicit attention where Triton is missing). When the
scores must carry gradients (A-MoD with scaled outputs) the explicit path is used everywhere.
Traced (ONNX export, ``torch.compile``: ``tracing()``) - the explicit formula, one graph of plain
ops whose shapes follow the batch (the CPU path's tiles are planned in Python from the batch size).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from .errors import UserError


def tracing() -> bool:
    """Whether this forward is being traced into a graph (ONNX export, ``torch.export``, ``torch.compile``)
    rather than run eagerly: the code paths that plan work in Python then take a plain formulation."""
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


def recomputing() -> bool:
    """Whether this forward is gradient checkpointing's recompute (``torch.utils.checkpoint``, as timm's
    ``set_grad_checkpointing`` uses it, reentrant or not) rather than a forward of its own.

    A checkpointed block runs a second time inside the backward, after later blocks (and maybe later
    forwards) have moved the state blocks share: A-MoD's score handoffs, the random routers' call
    counters, the token sizes of fold and ToMe. Such a rerun must see what its first run saw and leave
    the shared state alone (see ``amod.tokens.ForwardMemo``). It is recognised as a forward that runs
    while autograd executes a backward (a graph task is current), as ``torch.utils.checkpoint`` itself
    tells its recomputes apart; never while tracing, where the question is not asked of the graph.
    """
    return not tracing() and torch._C._current_graph_task_id() != -1


def received_attention(attn: torch.Tensor) -> torch.Tensor:
    """A-MoD importance (paper Eq. 4) from an explicit attention matrix.

    r_i = 1/(H N) sum_h sum_j A[h, j, i]: the mean attention token i receives over heads and queries.

    Args:
        attn: (B, H, N_query, N_key) softmax attention.

    Returns:
        (B, N_key) scores; each row sums to 1.
    """
    return attn.mean(dim=(1, 2))


def attention_inputs(attn, x: torch.Tensor, kv_x: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """timm ``Attention``'s work before the attention kernel: q, k, v (B, H, N, hd) after q/k-norm, and
    the sigmoid output gate of the gated variants (None otherwise). The one copy of this set-up that
    amod's attention classes and analyses share.

    ``kv_x``: keys and values from these tokens instead (B, M, C), queries and gate from ``x``; the
    projections are split, so nothing is computed twice.
    """
    B, N, _ = x.shape
    gate = attn.gate(x).sigmoid() if attn.gate is not None else None
    if kv_x is None:
        q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        A, w, b = attn.attn_dim, attn.qkv.weight, attn.qkv.bias
        q = F.linear(x, w[:A], None if b is None else b[:A]).view(B, N, attn.num_heads, attn.head_dim).transpose(1, 2)
        kv = F.linear(kv_x, w[A:], None if b is None else b[A:])
        k, v = kv.view(B, kv_x.shape[1], 2, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v, gate


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32: itself where it is already (``.float()`` would dispatch an operation that copies nothing)."""
    return t if t.dtype == torch.float32 else t.float()


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias): the explicit (B, H, Nq, Nk) attention matrix, in float32."""
    logits = (as_float32(q) @ as_float32(k).transpose(-2, -1)).mul_(scale)
    if bias is not None:
        logits = logits + as_float32(bias)
    return logits.softmax(dim=-1)


def key_channel_count(head_dim: int) -> int:
    """The head channels a per-key bias adds to a maskless attention (``KeyBias``): one for the bias, then zeros up to
    a multiple of 8, the granularity FlashAttention takes head dims in (64 -> 72)."""
    return 8 - head_dim % 8


# How ``KeyBias.attention`` passes the bias to the fused kernel: None, by device (maskless on CUDA, where a mask
# rules out FlashAttention; a mask on the CPU, whose fused kernel takes one at no cost: docs/performance.md); or
# "maskless" / "mask" everywhere, as ``key_bias_path`` sets it to measure or test one path on any device.
_KEY_BIAS_PATH: list[Optional[str]] = [None]


@contextmanager
def key_bias_path(path: Optional[str]) -> Iterator[None]:
    """Within this context every ``KeyBias.attention`` takes ``path``: ``"maskless"`` (the bias in more head
    channels, as on CUDA), ``"mask"`` (a float ``attn_mask``, as on the CPU) or None (by device, the default): to
    test and time either path on any device."""
    if path not in (None, "maskless", "mask"):
        raise UserError(f"path must be 'maskless', 'mask' or None, got {path!r}")
    _KEY_BIAS_PATH.append(path)
    try:
        yield
    finally:
        _KEY_BIAS_PATH.pop()


class KeyBias:
    """A per-key additive bias of attention logits, ``tensor`` (B, 1, 1, N): proportional attention's log(size) of
    the tokens a reduction merged (``amod.tokens.TokenSizes``), the same for every query and head.

    ``attention`` computes ``softmax(q k^T scale + bias) v`` with the fused kernel. On CUDA it passes no mask, so that
    FlashAttention runs as on the dense model (a float ``attn_mask`` rules it out: PyTorch falls back to the
    memory-efficient kernel): the bias rides in the product instead. Each query gets ``key_channel_count`` more
    channels of ones, each key the bias / scale in the first of its own and zeros after, each value zeros, so
    q'.k' scale = q.k scale + bias; the output's extra channels are zero and cut off. The keys' channels are made once
    per heads, head dim, scale, dtype and device, and shared by every block that reads this bias (one per
    reduction); a block adds two pads, a concatenation and a slice. On the CPU the bias goes in as the mask, which
    the fused CPU kernel takes as it is (``key_bias_path`` chooses either path on any device).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._channels: dict[tuple, torch.Tensor] = {}

    def key_channels(self, k: torch.Tensor, scale: float) -> torch.Tensor:
        """(B, H, N, c) channels for the keys ``k`` (B, H, N, D): bias / scale, then zeros."""
        B, H, N, D = k.shape
        key = (H, D, float(scale), k.dtype, k.device)
        made = self._channels.get(key)
        if made is None:
            c = key_channel_count(D)
            column = (self.tensor.reshape(B, 1, N, 1) * (1.0 / scale)).to(k.dtype)
            made = self._channels[key] = F.pad(column, (0, c - 1)).expand(B, H, N, c)
        return made

    def maskless(self, q: torch.Tensor) -> bool:
        """Whether ``attention`` on ``q`` passes the bias in head channels rather than as a mask."""
        path = _KEY_BIAS_PATH[-1]
        return q.is_cuda if path is None else path == "maskless"

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  dropout_p: float = 0.0) -> torch.Tensor:
        """``F.scaled_dot_product_attention(q, k, v, attn_mask=self.tensor, scale=scale)`` (q, k, v (B, H, N, D));
        maskless on CUDA (see the class docstring), equal to the masked call to float rounding."""
        if not self.maskless(q):  # (timm's own call: its default scale is attn.scale)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.tensor, dropout_p=dropout_p)
        D = q.shape[-1]
        c = key_channel_count(D)
        o = F.scaled_dot_product_attention(F.pad(q, (0, c), value=1.0), torch.cat([k, self.key_channels(k, scale)], -1),
                                           F.pad(v, (0, c)), dropout_p=dropout_p, scale=scale)
        return o[..., :D]

    def __repr__(self) -> str:
        return f"KeyBias(tokens={self.tensor.shape[-1]})"


def check_key_bias(attn_mask: object, is_causal: bool, what: str) -> None:
    """Refuse (NotImplementedError) what amod's attention classes do not take: causal attention, or a mask that is not
    a per-key bias (``KeyBias``: proportional attention); ``what`` names the attention in the message."""
    if is_causal or not (attn_mask is None or isinstance(attn_mask, KeyBias)):
        raise NotImplementedError(f"{what} takes a per-key bias (proportional attention: amod.ops.KeyBias) only, no "
                                  "other mask")


def key_biased_attention(attn, x: torch.Tensor, bias: Optional[KeyBias]) -> torch.Tensor:
    """timm ``Attention``'s forward on ``x`` (B, N, C) with the per-key ``bias`` added to its logits (None: none):
    the fused kernel with no mask (``KeyBias.attention``) where ``attn.fused_attn``, else the explicit softmax."""
    q, k, v, gate = attention_inputs(attn, x)  # (B, H, N, hd) each
    return attention_output(attn, biased_attention(attn, q, k, v, bias), gate)


def biased_attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[KeyBias]) -> torch.Tensor:
    """The attention kernel of timm ``Attention`` ``attn`` on its q, k, v (B, H, N, hd) with the per-key ``bias``
    (None: none): fused and maskless where ``attn.fused_attn``, else the explicit softmax with the bias added."""
    dropout = attn.attn_drop.p if attn.training else 0.0
    if attn.fused_attn:
        if bias is None:  # (timm's own call: its default scale, hd ** -0.5, is attn.scale)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return bias.attention(q, k, v, attn.scale, dropout)
    probs = attention_probs(q * attn.scale, k, 1.0, None if bias is None else bias.tensor)
    return attn.attn_drop(probs.to(v.dtype)) @ v


def attention_output(attn, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """timm ``Attention``'s work after the kernel: (B, H, N, hd) heads -> norm, gate, proj, dropout."""
    B, _, N, _ = o.shape
    o = attn.norm(o.transpose(1, 2).reshape(B, N, attn.attn_dim))
    if gate is not None:
        o = o * gate
    return attn.proj_drop(attn.proj(o))


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise UserError(f"{name} must have shape (B, H, N, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise UserError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise UserError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise UserError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise UserError(
            "q (B, H, Nq, D), k (B, H, Nk, D) and v (B, H, Nk, Dv) do not match: "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] == 0:
        raise UserError(f"the head dimension D must be at least 1, got q {tuple(q.shape)}")
    if k.shape[2] == 0 and q.shape[2] > 0:
        raise UserError(f"queries need at least one key to attend to, got q {tuple(q.shape)}, k {tuple(k.shape)}")


def attention_scores_explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, dropout_p: float = 0.0,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: forms the (B, H, N, N) matrix. Differentiable in both outputs.

    Logits and softmax are computed in float32 whatever the input dtype (bf16 logits would put
    percent-level errors into the scores). ``bias``: an additive term broadcast to the logits (the
    log token sizes of proportional attention).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = attention_probs(q, k, scale, bias)  # (B, H, Nq, Nk)
    scores = received_attention(attn)  # (B, N), before dropout: dropout is noise, not importance
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return attn.to(v.dtype) @ v, scores


# The least working set of the CPU path's tiles (``_tile_plan``): 2 MiB holds a ViT-S's whole attention at 224 px and
# batch 1 (6 heads of 257 x 257 float32, 1.6 MB) in one tile, a dozen operations fewer than two and as fast.
TILE_FLOOR = 2 * 2**20


def _tile_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: Optional[int]) -> tuple[int, int]:
    """(heads per group, query rows per tile) for the CPU path.

    The fp32 working set (one tile of logits, plus the fp32 copy of the group's keys for other
    dtypes) stays within a fifth of the attention output's size (at least ``TILE_FLOOR``, 2 MiB): that keeps the
    op's peak memory within 1.25x of ``scaled_dot_product_attention``'s, O(N) rather than O(N^2). Whole heads
    are grouped while a head's Nq x Nk tile fits (large, efficient matrix products); beyond that, one
    head at a time in blocks of query rows.
    """
    BH, Nq, Nk, D = q.shape[0] * q.shape[1], q.shape[2], k.shape[2], k.shape[-1]
    budget = max(TILE_FLOOR, BH * Nq * v.shape[-1] * v.element_size() // 5)
    key_bytes = 0 if k.dtype == torch.float32 else Nk * D * 4  # per head
    if tile is not None:
        return 1, min(Nq, tile)
    per_head = Nq * Nk * 4 + key_bytes
    if per_head <= budget:
        return min(BH, budget // per_head), Nq
    return 1, max(1, min(Nq, (budget - key_bytes) // (Nk * 4)))


def _tiles(BH: int, Nq: int, Nk: int, group: int, rows: int, buf: torch.Tensor):
    """(head slice, row slice, (G, t, Nk) view of ``buf``) for each tile: one buffer serves every tile."""
    for h in range(0, BH, group):
        for start in range(0, Nq, rows):
            hs, rs = slice(h, min(h + group, BH)), slice(start, min(start + rows, Nq))
            g, t = hs.stop - hs.start, rs.stop - rs.start
            yield hs, rs, buf[: g * t * Nk].view(g, t, Nk)


@torch.no_grad()
def _received_attention_lse(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float,
                            tile: Optional[int]) -> torch.Tensor:
    """Column sums of softmax(q k^T * scale) from the rows' logsumexp, tile by tile (Algorithm 1)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    group, rows = _tile_plan(q, k, q, tile)
    qf, kf, lf = q.reshape(B * H, Nq, D), k.reshape(B * H, Nk, D), lse.reshape(B * H, Nq)
    acc = torch.zeros(B * H, Nk, dtype=torch.float32, device=q.device)
    buf = torch.empty(group * rows * Nk, dtype=torch.float32, device=q.device)
    for hs, rs, logits in _tiles(B * H, Nq, Nk, group, rows, buf):
        torch.matmul(qf[hs, rs].float(), kf[hs].float().transpose(-2, -1), out=logits)  # (G, t, Nk)
        logits.mul_(scale).sub_(lf[hs, rs, None]).exp_()
        acc[hs] += logits.sum(dim=1)
    return acc.view(B, H, Nk).sum(dim=1) / (H * Nq)  # (B, Nk)


@torch.no_grad()
def _attention_scores_onepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              tile: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and column sums from the same tiles of softmax(q k^T): no second pass over QK^T. One tile (the whole
    attention within the budget) is a dozen operations, each further tile as many again."""
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    group, rows = _tile_plan(q, k, v, tile)
    qf, kf, vf = q.reshape(B * H, Nq, D), k.reshape(B * H, Nk, D), v.reshape(B * H, Nk, Dv)
    if group * rows == B * H * Nq:  # one tile: no buffers, no slices
        out, acc = _onepass_tile(qf, kf, vf, scale)
    else:
        out = torch.empty(B * H, Nq, Dv, dtype=v.dtype, device=q.device)
        acc = torch.zeros(B * H, 1, Nk, dtype=torch.float32, device=q.device)
        buf = torch.empty(group * rows * Nk, dtype=torch.float32, device=q.device)
        for hs, rs, p in _tiles(B * H, Nq, Nk, group, rows, buf):
            out_tile = out[hs, rs]  # contiguous: whole heads, or a block of rows of one head
            acc[hs].add_(_onepass_tile(qf[hs, rs], kf[hs], vf[hs], scale, p, out_tile)[1])
    return out.view(B, H, Nq, Dv), acc.view(B, H, Nk).sum(dim=1) / (H * Nq)


def _onepass_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, logits: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile of ``_attention_scores_onepass``: q (G, t, D), k (G, Nk, D), v (G, Nk, Dv) -> softmax(q k^T scale) v
    (G, t, Dv), in ``out`` where given, and the softmax's column sums (G, 1, Nk) float32; ``logits``: a (G, t, Nk)
    float32 buffer for the softmax, else one is made."""
    p = torch.bmm(as_float32(q) * scale, as_float32(k).transpose(-2, -1), out=logits)  # (G, t, Nk) logits
    p.sub_(p.amax(dim=-1, keepdim=True)).exp_()  # unnormalised softmax, in place
    inv_rowsum = p.sum(dim=-1).reciprocal_().unsqueeze(1)  # (G, 1, t)
    # normalise the small results, not the tile: column sums as inv_rowsum . p, output as (p . v) / rowsum
    colsum = torch.bmm(inv_rowsum, p)  # (G, 1, Nk)
    out = torch.bmm(p if p.dtype == v.dtype else p.to(v.dtype), v, out=out)
    factor = inv_rowsum.transpose(-2, -1)
    return out.mul_(factor if factor.dtype == v.dtype else factor.to(v.dtype)), colsum


def _cuda_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                             ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The attention output and each query row's logsumexp (B, H, >= Nq) from one of PyTorch's fused
    CUDA kernels (flash for fp16/bf16, memory-efficient otherwise; both have a backward), or None where
    neither takes the inputs. The scores then need only the column pass."""
    try:
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and v.shape[-1] == q.shape[-1]:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
    except (RuntimeError, NotImplementedError):
        return None
    return res[0], res[1]


def _triton_scores():
    """The Triton score kernel, or None where Triton is not installed (an optional, heavy import)."""
    try:
        from .kernels.triton_scores import received_attention_triton
    except ImportError:
        return None
    return received_attention_triton


def attention_with_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    *,
    dropout_p: float = 0.0,
    scores_need_grad: bool = False,
    tile: Optional[int] = None,
    method: str = "onepass",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention plus the mean attention each key received.

    Args:
        q: (B, H, Nq, D) queries.
        k: (B, H, Nk, D) keys (Nk may differ from Nq; empty batches and sequences are allowed).
        v: (B, H, Nk, Dv) values.
        scale: logit scale; defaults to D ** -0.5 as in ``F.scaled_dot_product_attention``.
        dropout_p: attention dropout on the output (the scores are taken before dropout).
        scores_need_grad: the caller backpropagates through the scores; uses the explicit path.
        tile: query rows per tile in the CPU path; default: what a memory budget of a fifth of the
            output's size (at least ``TILE_FLOOR``, 2 MiB) allows, whole heads at a time where they fit.
        method: CPU path: ``"onepass"`` (output and scores from the same tiles of the softmax; used
            when no gradient is needed) or ``"lse"`` (PyTorch's fused kernel, differentiable, then
            a second pass over QK^T from its logsumexp: paper Algorithm 1; the explicit path where
            the value width differs from the key width, which that kernel does not take).

    Returns:
        ``out`` (B, H, Nq, Dv) like ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` and
        ``scores`` (B, Nk) float32, r_i = 1/(H Nq) sum_h sum_j A[h, j, i]; each row sums to 1.
    """
    _check_qkv(q, k, v)
    if tile is not None and tile < 1:
        raise UserError(f"tile must be a positive number of query rows, got {tile}")
    if method not in ("lse", "onepass"):
        raise UserError(f"method must be 'lse' or 'onepass', got {method!r}")
    B, H, Nq, _ = q.shape
    if B * H * Nq == 0:  # nothing to attend: empty results of the right shapes
        return q.new_zeros(B, H, Nq, v.shape[-1]), torch.zeros(B, k.shape[2], dtype=torch.float32, device=q.device)
    if scores_need_grad or (dropout_p > 0.0 and q.device.type == "cpu") or (q.device.type == "cpu" and tracing()):
        return attention_scores_explicit(q, k, v, scale, dropout_p)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cuda":
        kernel = _triton_scores()
        if kernel is None:  # no Triton: correct, but forms the matrix
            return attention_scores_explicit(q, k, v, scale, dropout_p)
        fused = _cuda_attention_with_lse(q, k, v, scale) if dropout_p == 0.0 else None
        if fused is not None:  # the kernel's logsumexp: the score kernel's row pass is not needed
            out, lse = fused
            return out, kernel(q, k, scale, lse=lse)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        return out, kernel(q, k, scale)
    if q.device.type != "cpu":
        return attention_scores_explicit(q, k, v, scale, dropout_p)
    if method == "onepass" and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return _attention_scores_onepass(q, k, v, scale, tile)  # (its output carries no gradient)
    if v.shape[-1] != q.shape[-1]:  # PyTorch's fused CPU kernel needs Dv == D
        return attention_scores_explicit(q, k, v, scale, dropout_p)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, _received_attention_lse(q.detach(), k.detach(), lse, scale, tile)
