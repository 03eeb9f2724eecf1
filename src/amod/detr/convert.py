"""Mixture-of-Depths in the encoder of a Hugging Face DETR (``DetrModel``, ``DetrForObjectDetection``).

A DETR encoder's tokens are the backbone's feature-map positions: no class token, so every token can be
routed. The decoder cross-attends to every position's last encoder state, so a token an MoD layer skips
still reaches the decoder with the representation it had: MoD fits without touching the decoder.

As for timm's blocks (``amod.mod.block``), conversion swaps classes and copies no parameter:

- ``DetrMoDEncoderLayer`` (a ``DetrEncoderLayer``): ranks the positions with its router, gathers the top-k
  (their hidden states and their spatial position embeddings), runs the layer's own forward on those alone
  (post-norm attention with the position embeddings added to queries and keys, then the MLP) and puts the
  result back; skipped positions are copied through (``bypass``, the paper's MoD).
- ``DetrScoringSelfAttention`` (a ``DetrSelfAttention``): the attention of the layer before an
  attention-routed one. Same output (through ``amod.ops.attention_with_scores``, positional embeddings
  added to queries and keys as DETR does), plus the mean attention each position received, handed to the
  next layer in a ``ScoreHandoff``.

Routers: ``attention`` (A-MoD), ``standard`` (learned, gate-scaled), ``random`` and ``feature-norm``: the
positions whose encoder input (the backbone's projected features) has the largest L2 norm, fixed for every
MoD layer, as sparse-encoder DETRs select by a backbone score before the encoder. The other skipped modes
are refused: ``fold`` and ``merge`` move a position's content into another position, and the decoder reads
the encoder output by position; ``kv`` would fit (skipped positions as keys and values) but is not built.

Refused with one line each: a padding mask that masks anything (pad-free batches of one size only; the
routed layers run attention without a mask), ``output_attentions=True``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

try:
    from transformers.models.detr.modeling_detr import DetrEncoderLayer, DetrSelfAttention
except ImportError:  # pragma: no cover - the optional extra is missing
    raise ImportError("DETR models need transformers, the optional extra: pip install 'amod[detr]'") from None

from ..hf import DETR, attentions_requested
from ..hf.adapter import install_save_pretrained
from . import ROUTERS
from ..mod.block import RoutedForward, ScoreHandoff, gated_updates, publish_scores
from ..mod.config import MoDConfig, resolve_layers, validate_capacity
from ..mod.routers import ROUTER_CLASSES, Router, build_router
from ..mod.routing import num_kept, select_tokens
from ..ops import attention_with_scores, recomputing, tracing
from ..tokens import ForwardMemo, gather_tokens, scatter_tokens

DETR_CLASSES = DETR
SKIPPED = ("bypass",)


def detr_class(model: nn.Module) -> Optional[str]:
    """The DETR class ``model`` is (or derives from), or None."""
    return next((c.__name__ for c in type(model).__mro__ if c.__name__ in DETR_CLASSES
                 and c.__module__.startswith("transformers.")), None)


def detr_base(model: nn.Module) -> nn.Module:
    """The ``DetrModel`` inside ``model`` (itself for a ``DetrModel``)."""
    return model.model if detr_class(model) == "DetrForObjectDetection" else model


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    return detr_base(model).encoder.layers


# ---------------------------------------------------------------- the feature-norm router

class FeatureNormRouter(Router):
    """Rank positions by the L2 norm of the encoder's input (the backbone's projected features), the same
    ranking for every MoD layer of a forward. Parameter-free; the norms arrive through ``FeatureNorms``."""

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        if attention_scores is None:
            raise RuntimeError("the feature-norm router found no encoder-input norms; run the DETR's own forward")
        return attention_scores


class FeatureNorms:
    """The (B, N) norms of the encoder input of the current forward, set by a pre-hook on the encoder. Plain
    object: nothing in state_dicts."""

    def __init__(self) -> None:
        self.norms: Optional[torch.Tensor] = None

    def __call__(self, encoder: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("inputs_embeds", args[0] if args else None)
        self.norms = None if x is None else x.detach().float().norm(dim=-1)

    def __repr__(self) -> str:
        return f"FeatureNorms(holding={self.norms is not None})"


def _build_router(name: str, dim: int, seed: int) -> Router:
    return FeatureNormRouter() if name == "feature-norm" else build_router(name, dim, seed=seed)


def _needs_attention(name: str) -> bool:
    return name != "feature-norm" and ROUTER_CLASSES[name].needs_attention


# ---------------------------------------------------------------- the layers

class DetrScoringSelfAttention(DetrSelfAttention):
    """DETR's self-attention that also leaves the mean attention each position received in ``amod_handoff``."""

    amod_handoff: ScoreHandoff
    amod_scores_need_grad: bool
    amod_relayed: bool = False  # its layer is an MoD layer that passes the scores on

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_embeddings: Optional[torch.Tensor] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        _refuse_mask(attention_mask)
        B, N, _ = hidden_states.shape
        qk = hidden_states if position_embeddings is None else hidden_states + position_embeddings
        q = self.q_proj(qk).view(B, N, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(qk).view(B, N, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, N, -1, self.head_dim).transpose(1, 2)
        need_grad = self.amod_scores_need_grad and torch.is_grad_enabled()
        out, scores = attention_with_scores(q, k, v, self.scaling, scores_need_grad=need_grad,
                                            dropout_p=self.attention_dropout if self.training else 0.0)
        if self.amod_relayed or not recomputing():  # a recompute's next layer reads what its forward saw
            self.amod_handoff.scores = scores if self.amod_scores_need_grad else scores.detach()
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1)), None


@dataclass
class DetrMoDSettings:
    """What a DETR MoD layer knows besides its weights and router; set once by ``convert_detr``."""

    config: MoDConfig
    in_handoff: Optional[ScoreHandoff] = None  # the previous layer's attention scores (attention router)
    out_handoff: Optional[ScoreHandoff] = None  # set when this layer scores attention for the next one
    feature_norms: Optional[FeatureNorms] = None  # the encoder input's norms (feature-norm router)
    record: bool = False  # keep the kept positions of the last forward in ``amod_last_index``
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False, compare=False)


class DetrMoDEncoderLayer(RoutedForward, DetrEncoderLayer):
    """A ``DetrEncoderLayer`` that processes the top-k positions of its router and copies the others through."""

    amod: DetrMoDSettings
    amod_label = "DETR MoD layer"

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                spatial_position_embeddings: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        _refuse_mask(attention_mask)
        return self._routed(hidden_states, spatial_position_embeddings, kwargs)

    def _incoming_scores(self) -> Optional[torch.Tensor]:
        if self.amod.feature_norms is not None:  # the encoder input's norms, the same for every MoD layer
            return self.amod.feature_norms.norms
        return super()._incoming_scores()

    def _route(self, x: torch.Tensor, scores_in: Optional[torch.Tensor], draws: Optional[int], replay: bool,
               pos: Optional[torch.Tensor], kwargs: dict) -> torch.Tensor:
        B, N, D = x.shape
        k = num_kept(self.amod.config.capacity, N)
        if k == N and not self._gated:  # every position processed: the layer as it was
            if not replay:
                self._record(torch.arange(N, device=x.device).expand(B, N))
            return super().forward(x, None, spatial_position_embeddings=pos, **kwargs)
        with self.router.replay(draws) if replay else contextlib.nullcontext():
            scores = self.router.score(x, scores_in)  # (B, N)
        idx = select_tokens(scores, k)  # (B, k), in position order
        xs = gather_tokens(x, idx)
        ps = None if pos is None else gather_tokens(pos.expand(B, N, D), idx)
        ys = super().forward(xs, None, spatial_position_embeddings=ps, **kwargs)
        if self._gated:
            ys = gated_updates(self.router, self.amod.config.scale_output, ys, xs, scores.gather(1, idx))
        publish_scores(self.amod.out_handoff, scores_in, idx, N)
        if not replay:
            self._record(idx)
        return scatter_tokens(x, idx, ys)


def _refuse_mask(attention_mask: Optional[torch.Tensor]) -> None:
    """Refuse ``output_attentions`` (the routed layers compute attention on a subset of the positions, the scoring
    ones without returning its probabilities) and a mask that masks anything. transformers hands an all-ones pixel mask on as None in eager mode,
    but as a built mask while tracing (torch.compile, export), whose values a trace cannot read: there the
    batch is taken to be pad-free, as documented."""
    if attentions_requested():
        raise ValueError("output_attentions is not available on an amod-converted DETR encoder: its MoD layers attend "
                         "over the positions they keep and its scoring layers return no probabilities; use the "
                         "dense model")
    if attention_mask is None or tracing():
        return
    attends = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if not bool(attends.all()):
        raise ValueError("an amod DETR encoder takes batches without padding (a pixel_mask of ones: images of one "
                         "size); its MoD layers run attention on a subset of the positions, without a mask")


# ---------------------------------------------------------------- conversion

def convert_detr(model: nn.Module, router: str = "attention", capacity: float = 0.5,
                 layers: Union[str, Sequence[int], None] = None, scale_output: Optional[bool] = None,
                 seed: int = 0, skipped: str = "bypass", protect: Optional[float] = None) -> nn.Module:
    """``amod.convert`` for a DETR: MoD on the encoder layers ``layers`` (default ``"alternate"``: 1, 3, 5),
    in place; returns the model. Arguments as ``amod.convert``; ``router`` also takes ``"feature-norm"``."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r} for a DETR encoder; use one of {', '.join(ROUTERS)}")
    if skipped not in SKIPPED:
        raise ValueError(f"skipped={skipped!r} does not fit a DETR encoder, whose decoder reads every position: "
                         f"use {', '.join(SKIPPED)}")
    if getattr(model, "amod_config", None) is not None:
        raise ValueError("model is already converted; use amod.set_capacity to change its capacity")
    if scale_output is None:
        scale_output = router == "standard"
    if not isinstance(scale_output, bool):
        raise ValueError(f"scale_output must be True, False or None, got {scale_output!r}")
    blocks = encoder_layers(model)
    for i, layer in enumerate(blocks):
        if type(layer) is not DetrEncoderLayer or type(layer.self_attn) is not DetrSelfAttention:
            raise TypeError(f"encoder layer {i} is a {type(layer).__name__}; amod converts transformers' "
                            "DetrEncoderLayer with DetrSelfAttention")
    resolved = resolve_layers("alternate" if layers is None else layers, len(blocks),
                              "random" if router == "feature-norm" else router)
    config = MoDConfig(router=router, capacity=validate_capacity(capacity), layers=resolved,
                       scale_output=scale_output, seed=int(seed), skipped=skipped)
    norms = None
    if router == "feature-norm":
        norms = FeatureNorms()
        detr_base(model).encoder.register_forward_pre_hook(norms, with_kwargs=True)
    dim = model.config.d_model
    for i in resolved:
        layer = blocks[i]
        layer.__class__ = DetrMoDEncoderLayer
        weight = layer.self_attn.q_proj.weight
        layer.router = _build_router(router, dim, config.seed + i).to(device=weight.device, dtype=weight.dtype)
        layer.amod = DetrMoDSettings(config=config, feature_norms=norms)
    if _needs_attention(router):
        for i in resolved:
            handoff = ScoreHandoff()
            prev = blocks[i - 1]
            prev.self_attn.__class__ = DetrScoringSelfAttention
            prev.self_attn.amod_handoff = handoff
            prev.self_attn.amod_scores_need_grad = scale_output
            if isinstance(prev, DetrMoDEncoderLayer):
                prev.amod.out_handoff = handoff
                prev.self_attn.amod_relayed = True
            blocks[i].amod.in_handoff = handoff
    model.amod_config = config
    install_save_pretrained(model)  # save_pretrained keeps the conversion (amod.safetensors beside config.json)
    return model


def mod_layers(model: nn.Module) -> list[tuple[int, DetrMoDEncoderLayer]]:
    """(index, layer) for every MoD layer of a converted DETR's encoder."""
    return [(i, layer) for i, layer in enumerate(encoder_layers(model)) if isinstance(layer, DetrMoDEncoderLayer)]


def set_recording(model: nn.Module, enabled: bool = True) -> None:
    """Keep each MoD layer's kept positions (B, k) of the last forward in ``layer.amod_last_index``."""
    for _, layer in mod_layers(model):
        layer.amod.record = enabled
        if not enabled:
            layer.__dict__.pop("amod_last_index", None)
