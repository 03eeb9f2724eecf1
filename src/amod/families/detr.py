"""Hugging Face DETR (``DetrModel``, ``DetrForObjectDetection``): Mixture-of-Depths in its encoder.

A DETR encoder's tokens are the backbone's feature-map positions: no class token, so every token can be routed. The
decoder cross-attends to every position's last encoder state, so a token an MoD layer skips still reaches the
decoder with the representation it had: MoD fits without touching the decoder.

As for every family, conversion swaps classes and copies no parameter (the roles are built on the layer's own
class when a DETR is met, so importing amod imports no ``transformers``):

- an MoD layer (``DetrMoDLayer`` on ``DetrEncoderLayer``): ranks the positions with its router, gathers the top-k
  (their hidden states and their spatial position embeddings), runs the layer's own forward on those alone
  (post-norm attention with the position embeddings added to queries and keys, then the MLP) and puts the result
  back; skipped positions are copied through (``bypass``, the paper's MoD).
- a scoring attention (``DetrScoringAttention`` on ``DetrSelfAttention``): the attention of the layer before an
  attention-routed one. Same output (through ``amod.ops.attention_with_scores``, positional embeddings added to
  queries and keys as DETR does), plus the mean attention each position received, handed to the next layer.

Routers: those of ``router_names("detr")``, the registry's: every router of every family (``attention``, A-MoD;
``standard``, learned and gate-scaled; the controls) and ``feature-norm`` (``FeatureNormRouter``, registered here
for DETR alone: the positions whose encoder input, the backbone's projected features, has the largest L2 norm, fixed
for every MoD layer, as sparse-encoder DETRs select by a backbone score before the encoder). The other skipped modes
are refused: ``fold`` and ``merge`` move a position's content into another position, and the decoder reads the
encoder output by position; ``kv`` would fit but is not built. Token merging is refused for the same reason. Refused
with one line each: a padding mask that masks anything (pad-free batches of one size only; the routed layers run
attention without a mask), ``output_attentions=True``.

Cost (``flops``: a ``DetrCostReport``): the encoder analytically (the positions each layer processes, the routers'
own products, A-MoD's column sums); the backbone, the input projection, the decoder and the heads, which routing
does not change, measured with ``FlopCounterMode`` on one blank image. ``ContentQueries`` (a forward pre-hook that
starts the decoder from the query embeddings) is recorded in checkpoints and restored by ``amod.load``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from ..cost import BlockCost, MacsRatios, flop_counter, validate_cost
from ..family import register_family
from ..hf.common import attentions_requested
from ..mod.block import RoutedForward, gated_updates, publish_scores
from ..mod.config import MoDConfig
from ..mod.routers import Router, register_router
from ..mod.routing import num_kept, select_tokens
from ..ops import attention_with_scores, recomputing, tracing
from ..tokens import gather_tokens, scatter_tokens
from .hf_base import HFCheckpoints, amod_role, hf_base, install_save_pretrained, role_class, set_view
from .vit import ViTFamily
from ..errors import UnsupportedModelError, UserError

ImgSize = Union[int, tuple[int, int]]


# ---------------------------------------------------------------- the feature-norm router

@register_router("feature-norm")
class FeatureNormRouter(Router):
    """Rank positions by the L2 norm of the encoder's input (the backbone's projected features), the same ranking
    for every MoD layer of a forward. Parameter-free; the norms arrive through ``FeatureNorms``
    (``norms``, set at conversion)."""

    families = ("detr",)
    families_why = "it ranks a DETR encoder's positions by the norm of the backbone features they start from"
    norms: Optional["FeatureNorms"] = None

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, n) scores: the encoder-input norms, which ``DetrMoDLayer`` hands in as ``attention_scores`` (the
        argument carries norms for this router, not attention)."""
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


# ---------------------------------------------------------------- the roles

def _refuse(attention_mask: Optional[torch.Tensor]) -> None:
    """Refuse ``output_attentions`` (the routed layers compute attention on a subset of the positions, the scoring
    ones without returning its probabilities) and a mask that masks anything. transformers hands an all-ones pixel
    mask on as None in eager mode, but as a built mask while tracing (torch.compile, export), whose values a trace
    cannot read: there the batch is taken to be pad-free, as documented."""
    if attentions_requested():
        raise UserError("output_attentions is not available on an amod-converted DETR encoder: its MoD layers attend "
                        "over the positions they keep and its scoring layers return no probabilities; use the "
                        "dense model")
    if attention_mask is None or tracing():
        return
    attends = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if not bool(attends.all()):
        raise UserError("an amod DETR encoder takes batches without padding (a pixel_mask of ones: images of one "
                        "size); its MoD layers run attention on a subset of the positions, without a mask")


class DetrScoringAttention:
    """Mixin of ``DetrSelfAttention``: the same output, and the mean attention each position received left in
    ``amod_handoff`` (set by ``amod.mod.block.wire_score_handoffs``)."""

    amod_relayed: bool = False  # its layer is an MoD layer that passes the scores on

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_embeddings: Optional[torch.Tensor] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        _refuse(attention_mask)
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


class DetrMoDLayer(RoutedForward):
    """Mixin of ``DetrEncoderLayer``: processes the top-k positions of its router and copies the others through."""

    amod_label = "DETR MoD layer"

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                spatial_position_embeddings: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        _refuse(attention_mask)
        return self._routed(hidden_states, spatial_position_embeddings, kwargs)

    def _incoming_scores(self) -> Optional[torch.Tensor]:
        if isinstance(self.router, FeatureNormRouter):  # the encoder input's norms, the same for every MoD layer
            return self.router.norms.norms
        return super()._incoming_scores()

    def _route(self, x: torch.Tensor, scores_in: Optional[torch.Tensor], draws: Optional[int], replay: bool,
               pos: Optional[torch.Tensor], kwargs: dict) -> torch.Tensor:
        B, N, D = x.shape
        k = num_kept(self.amod.config.static("capacity"), N)  # (a compile-time constant: amod.static)
        if k == N and not self._gated:  # every position processed: the layer as it was
            if not replay:
                self._record(torch.arange(N, device=x.device).expand(B, N))
            return super().forward(x, None, spatial_position_embeddings=pos, **kwargs)
        with self.router.replay(draws) if replay else contextlib.nullcontext():
            scores = self.router.score(x, scores_in)  # (B, N)
        idx = select_tokens(scores, k, self.router.score_unit(N))  # (B, k), in position order
        xs = gather_tokens(x, idx)
        ps = None if pos is None else gather_tokens(pos.expand(B, N, D), idx)
        ys = super().forward(xs, None, spatial_position_embeddings=ps, **kwargs)
        if self._gated:
            ys = gated_updates(self.router, self.amod.config.scale_output, ys, xs, scores.gather(1, idx))
        publish_scores(self.amod.out_handoff, scores_in, idx, N)
        if not replay:
            self._record(idx)
        return scatter_tokens(x, idx, ys)


# ---------------------------------------------------------------- content queries

class ContentQueries:
    """Forward pre-hook of a ``DetrModel``: the decoder starts from the object queries' embeddings instead of zeros
    (``decoder_inputs_embeds``), unless the caller passes its own. With zeros, every query's content is the same and
    only the attention to its position embedding tells queries apart; on amod's detection canvases a small DETR
    trained from scratch then predicts one box with every query for thousands of steps, while with content queries
    the queries' boxes spread within a few hundred steps. The weights are the same: only the forward differs."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if kwargs.get("decoder_inputs_embeds") is not None:
            return None
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        batch = pixels.shape[0] if pixels is not None else kwargs["inputs_embeds"].shape[0]
        queries = module.query_position_embeddings.weight
        # a copy, not a view: a view of a parameter made under no_grad claims a gradient it has no function for
        return args, {**kwargs, "decoder_inputs_embeds": queries.unsqueeze(0).repeat(batch, 1, 1)}


def detr_base(model: nn.Module) -> nn.Module:
    """The ``DetrModel`` inside ``model`` (itself for a ``DetrModel``)."""
    return model.model if "class_labels_classifier" in model._modules else model


def has_content_queries(model: nn.Module) -> bool:
    """Whether the DETR ``model`` starts its decoder from the query embeddings (``use_content_queries``)."""
    return any(isinstance(h, ContentQueries) for h in detr_base(model)._forward_pre_hooks.values())


def use_content_queries(model: nn.Module) -> nn.Module:
    """Make a DETR start its decoder from the object queries' embeddings (``ContentQueries``), once; in place."""
    if not has_content_queries(model):
        detr_base(model).register_forward_pre_hook(ContentQueries(), with_kwargs=True)
    return model


LEGACY_CONTENT_QUERIES = "amod.detr.content_queries"  # what older `amod detect train` files said it with


# ---------------------------------------------------------------- cost

@dataclass
class DetrCostReport(MacsRatios):
    """MACs of one image through a DETR. ``layers``: each encoder layer's MACs and the positions it runs on."""

    img_size: tuple[int, int]
    tokens: int  # encoder positions (the backbone's feature map)
    encoder_macs: int
    encoder_dense_macs: int
    other_macs: int  # backbone, input projection, decoder, heads: the same dense or converted
    layers: list[BlockCost]

    @property
    def macs(self) -> int:
        return self.encoder_macs + self.other_macs

    @property
    def dense_macs(self) -> int:
        return self.encoder_dense_macs + self.other_macs

    @property
    def encoder_ratio(self) -> float:
        return self.encoder_macs / self.encoder_dense_macs


def layer_macs(layer: nn.Module, tokens: int) -> int:
    """A DETR encoder layer run densely on ``tokens`` positions: q/k/v/o projections and MLP per position, then
    QK^T and AV (each tokens x tokens x d_model)."""
    linears = [m for part in (layer.self_attn, layer.mlp) for m in part.modules() if isinstance(m, nn.Linear)]
    per_token = sum(m.in_features * m.out_features for m in linears)
    return tokens * per_token + 2 * tokens * tokens * layer.self_attn.q_proj.out_features


def _img_size(img_size: Optional[ImgSize]) -> tuple[int, int]:
    if img_size is None:
        raise UserError("a DETR takes images of any size: give img_size (an int or (H, W))")
    h, w = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
    if h < 1 or w < 1:
        raise UserError(f"img_size must be positive, got {h}x{w}")
    return h, w


def measured(model: nn.Module, img_size: ImgSize) -> tuple[int, int, int]:
    """(all MACs, encoder MACs, encoder positions) of ``model`` on one blank image, by ``FlopCounterMode``."""
    h, w = _img_size(img_size)
    param = next(model.parameters())
    x = torch.zeros(1, 3, h, w, device=param.device, dtype=param.dtype)
    encoder = detr_base(model).encoder
    seen: list[int] = []
    hook = encoder.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("inputs_embeds", args[0] if args else None).shape[1]),
        with_kwargs=True)
    was_training = model.training
    try:
        model.eval()
        with flop_counter() as counter, torch.no_grad():
            model(pixel_values=x)
    finally:
        hook.remove()
        model.train(was_training)
    counts = counter.get_flop_counts()
    total = counter.get_total_flops()
    name = next(k for k in counts if k.endswith(".encoder") and k.count(".") <= 2)
    return total // 2, sum(counts[name].values()) // 2, seen[0]


def _report(model: nn.Module, img_size: tuple[int, int], n: int, other: int,
            capacity: Optional[float]) -> DetrCostReport:
    layers, macs, dense = [], 0, 0
    for i, layer in enumerate(detr_base(model).encoder.layers):
        dense += layer_macs(layer, n)
        if isinstance(layer, DetrMoDLayer):
            k = num_kept(layer.amod.config.capacity if capacity is None else capacity, n)
            # (every position kept and no gate, as at inference unscaled: the layer runs as it was, no router)
            cost = layer_macs(layer, k) + (layer.router.macs(n) if k < n or layer.amod.config.scale_output else 0)
        else:
            k, cost = n, layer_macs(layer, n)
        if isinstance(layer.self_attn, DetrScoringAttention):  # A-MoD's column sums: k x k per head
            cost += k * k * (layer.self_attn.q_proj.out_features // layer.self_attn.head_dim)
        layers.append(BlockCost(i, k, cost))
        macs += cost
    return DetrCostReport(img_size, n, macs, dense, other, layers)


def _positions_and_rest(model: nn.Module, img_size: tuple[int, int]) -> tuple[int, int]:
    """(encoder positions, MACs of everything but the encoder) at ``img_size``, measured."""
    total, encoder_counted, n = measured(model, img_size)
    return n, total - encoder_counted


def detr_flops(model: nn.Module, img_size: ImgSize = None, capacity: Optional[float] = None) -> DetrCostReport:
    """Cost of one ``img_size`` image through the DETR ``model`` (dense or converted), priced at ``capacity``
    if given (the model is not changed). The encoder is analytic; the rest is measured (``measured``)."""
    h, w = _img_size(img_size)
    return _report(model, (h, w), *_positions_and_rest(model, (h, w)), capacity)


def capacity_for_encoder_cost(model: nn.Module, cost: float, img_size: ImgSize) -> float:
    """The capacity at which the converted DETR's encoder costs closest to ``cost`` x the dense encoder's MACs
    (ties to the larger capacity; the model is not changed). Tries every k / N."""
    cost = validate_cost(cost)
    if getattr(model, "amod_config", None) is None:
        raise UserError("model is not an amod MoD model; convert it with amod.convert first")
    h, w = _img_size(img_size)
    n, other = _positions_and_rest(model, (h, w))
    ratios = {k / n: _report(model, (h, w), n, other, k / n).encoder_ratio for k in range(1, n + 1)}
    return min(ratios, key=lambda c: (abs(ratios[c] - cost), -c))


# ---------------------------------------------------------------- the family

LAYERS, ATTENTIONS = ("DetrEncoderLayer",), ("DetrSelfAttention",)


class DetrFamily(HFCheckpoints, ViTFamily):
    name = "detr"
    models = "Hugging Face DETR (DetrModel, DetrForObjectDetection: MoD in the encoder)"
    classes = ("DetrModel", "DetrForObjectDetection")

    def prepare(self, model: nn.Module) -> nn.Module:
        if model.__dict__.get("amod_hf_prepared"):
            return model
        set_view(model, "blocks", detr_base(model).encoder.layers)
        set_view(model, "num_prefix_tokens", 0)
        install_save_pretrained(model)
        set_view(model, "amod_hf_prepared", True)
        return model

    def check_block(self, block: nn.Module, index: int) -> None:
        if hf_base(block).__name__ not in LAYERS or hf_base(block.self_attn).__name__ not in ATTENTIONS:
            raise UnsupportedModelError(
                f"encoder layer {index} is a {type(block).__name__}; amod converts transformers' "
                "DetrEncoderLayer with DetrSelfAttention")
        if amod_role(block) is not None and not isinstance(block, DetrMoDLayer):
            raise UnsupportedModelError(f"encoder layer {index} is already converted ({type(block).__name__})")

    def make_mod(self, block: nn.Module) -> nn.Module:
        block.__class__ = role_class(None, DetrMoDLayer, hf_base(block), layer=False)
        return block

    def make_scoring(self, block: nn.Module) -> nn.Module:
        attn = block.self_attn
        attn.__class__ = role_class(None, DetrScoringAttention, hf_base(attn), layer=False)
        return attn

    def router_dim(self, block: nn.Module) -> int:
        return block.self_attn.q_proj.in_features

    def class_rows(self, model: nn.Module) -> int:
        return 0

    def validate(self, config: MoDConfig, model: nn.Module) -> None:
        # (the router: any of router_names("detr"), checked by amod.convert from the router's ``families``)
        if config.skipped != "bypass":
            raise UserError(f"skipped={config.skipped!r} does not fit a DETR encoder, whose decoder reads every "
                            "position: use bypass")

    def convert(self, model: nn.Module, config: MoDConfig) -> None:
        super().convert(model, config)
        if config.router == "feature-norm":  # one pre-hook on the encoder measures the norms every layer ranks by
            norms = FeatureNorms()
            detr_base(model).encoder.register_forward_pre_hook(norms, with_kwargs=True)
            for i in config.layers:
                model.blocks[i].router.norms = norms

    def merge_apply(self, model: nn.Module, merge: Any) -> nn.Module:
        raise UnsupportedModelError(
            "token merging does not fit a DETR encoder: it moves a position's content into another, and "
            "the decoder reads the encoder output by position; use amod.convert (MoD, bypass)")

    def flops(self, model: nn.Module, img_size: Any, capacity: Optional[float]) -> DetrCostReport:
        return detr_flops(self.prepare(model), img_size, capacity)

    def describe(self, model: nn.Module, **hints: Any) -> dict[str, Any]:
        return {**super().describe(model), "content_queries": has_content_queries(model)}

    def _build(self, info: dict[str, Any]) -> nn.Module:
        # every weight comes from the file: never ask for a pretrained backbone as well
        return super()._build({**info, "config": {**info["config"], "use_pretrained_backbone": False}})

    def restore(self, model: nn.Module, info: dict[str, Any], metadata: Optional[dict[str, str]] = None) -> nn.Module:
        if info.get("content_queries") or (metadata or {}).get(LEGACY_CONTENT_QUERIES) == "1":
            use_content_queries(model)
        return model

    def tensor_module(self, model: nn.Module) -> nn.Module:
        raise UnsupportedModelError(
            "amod.export takes one image tensor in and one tensor out; for a DETR, torch.onnx.export a "
            "wrapper returning its logits and pred_boxes (docs/detr.md)")

    def feature_module(self, model: nn.Module) -> nn.Module:
        raise UnsupportedModelError("a DETR has no image features for a linear probe; evaluate it with amod detect")


def mod_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, layer) for every MoD layer of a converted DETR's encoder."""
    return [(i, layer) for i, layer in enumerate(detr_base(model).encoder.layers) if isinstance(layer, DetrMoDLayer)]


FAMILY = register_family(DetrFamily())
