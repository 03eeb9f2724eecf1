"""How amod runs on Hugging Face ViT, DeiT and DINOv2: class swaps of the HF layers, as for timm's blocks.

amod's blocks (``MoDBlock``, ``FoldBlock``, ``ToMeBlock``) and attentions (``ScoringAttention``,
``SizedAttention``) are written against timm's attribute names: ``blk.norm1``, ``blk.attn``, ``blk.ls1``,
``attn.qkv``, ``attn.proj``, ``attn.num_heads``, ... A Hugging Face layer holds the same modules under other
names (``layernorm_before``, ``attention``, ``layer_scale1``, ``attention.q_proj``/``k_proj``/``v_proj``,
``o_proj``). So, exactly as ``amod.convert`` does for timm, the HF layer's *class* is swapped, to a class made
of three parts:

    (views of the HF names under timm's names, the amod block class, the HF layer class)

The views are read-only properties, not modules: no parameter is copied or re-registered, state_dict keys stay
HF's own (``save_pretrained``/``from_pretrained`` still read them; only the standard router adds
``...router.proj.*``, as on timm), and the HF forward signature stays (``forward(hidden_states,
attention_mask=None, **kwargs)`` calls the amod block's forward). timm's fused ``qkv`` is read off the three
HF projections (their weights concatenated per call; ``_FusedQKV``).

Which layers change:

- ``prepare`` (called by every amod entry point) gives every layer and attention the views only: their forward
  stays Hugging Face's, with its attention backend (sdpa, flash, eager), and the model gets the timm-style
  views amod's cost and conversion code read (``blocks``, ``patch_embed``, ``num_prefix_tokens``, ``head``)
  as plain instance attributes, not submodules.
- ``amod.convert`` (MoD: bypass, merge, kv): the MoD layers become ``MoDBlock`` s; the layer before an
  attention-routed one becomes timm's ``Block`` run by amod with a ``ScoringAttention`` (A-MoD's scores from
  amod's own op, ``amod.ops.attention_with_scores``, never from ``output_attentions``). Every other layer keeps
  HF's forward and backend.
- fold and ToMe: every layer becomes a ``FoldBlock``/``ToMeBlock`` with a ``SizedAttention`` (every later
  attention needs the proportional-attention bias).

Refused (``ValueError``, one line each): an ``attention_mask`` or ``output_attentions=True`` on a converted
model (amod's layers run attention without the probabilities, and with fewer tokens); a skipped mode that is
neither an MoD-block mode nor fold. Unsupported classes get a ``TypeError`` naming the supported ones.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import MethodType
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from timm.models.vision_transformer import Block
from torch import nn

try:
    import transformers
except ImportError:  # pragma: no cover - the optional extra is missing
    raise ImportError("Hugging Face models need transformers, the optional extra: pip install 'amod[hf]'") from None

from ..mod.block import MoDBlock, MoDMode, MoDSettings, ScoreHandoff, ScoringAttention
from ..mod.config import MoDConfig
from ..mod.fold import FoldBlock, FoldMode, FoldSettings
from ..mod.modes import skipped_mode
from ..files import write_bytes
from ..mod.routers import Router, build_router, router_class
from ..ops import attention_inputs, attention_output, tracing
from ..reduce import SizedAttention, SizedTokensBlock
from ..tokens import TokenSizes
from ..tome.merging import ToMeBlock, merge_blocks
from . import DETR, SIDECAR, SIDECAR_FORMAT, SUPPORTED, attentions_requested, is_detr_model

# HF layer / attention classes amod knows, by name (the class objects differ between transformers versions)
VIT_LAYERS = ("ViTLayer", "DeiTLayer")  # layernorm_before, attention, dropout, layernorm_after, mlp
DINOV2_LAYERS = ("Dinov2Layer", "Dinov2WithRegistersLayer")  # norm1, attention, layer_scale1, drop_path, ...
ATTENTIONS = ("ViTAttention", "DeiTAttention", "Dinov2Attention", "Dinov2WithRegistersAttention")

_IDENTITY = nn.Identity()  # timm's q_norm, k_norm, norm, proj_drop, ls1, ls2 where HF has none (no parameters)


# ---------------------------------------------------------------- timm's names on HF modules

class _Dropout:
    """What amod reads of timm's ``attn_drop``: its probability."""

    __slots__ = ("p",)

    def __init__(self, p: float) -> None:
        self.p = p


class _FusedQKV:
    """timm's fused ``qkv`` Linear, read off HF's ``q_proj``, ``k_proj``, ``v_proj`` (no parameter of its own:
    the weights are concatenated per call, ~3 D^2 numbers, little next to the product itself)."""

    __slots__ = ("attn",)

    def __init__(self, attn: nn.Module) -> None:
        self.attn = attn

    @property
    def weight(self) -> torch.Tensor:
        a = self.attn
        return torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])

    @property
    def bias(self) -> Optional[torch.Tensor]:
        a = self.attn
        if a.q_proj.bias is None:
            return None
        return torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])

    @property
    def in_features(self) -> int:
        return self.attn.q_proj.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class HFAttentionViews:
    """timm ``Attention``'s names on an HF ViT/DeiT/DINOv2 attention (q_proj, k_proj, v_proj, o_proj)."""

    fused_attn = True
    gate = None
    q_norm = k_norm = norm = proj_drop = _IDENTITY

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def scale(self) -> float:
        return self.scaling

    @property
    def attn_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def qkv(self) -> _FusedQKV:
        return _FusedQKV(self)

    @property
    def proj(self) -> nn.Linear:
        return self.o_proj

    @property
    def attn_drop(self) -> _Dropout:
        return _Dropout(self.attention_dropout)


class HFViTLayerViews:
    """timm ``Block``'s names on ``ViTLayer``/``DeiTLayer`` (its hidden dropout sits where timm's drop path does:
    x + dropout(attention(...)), as HF computes it)."""

    ls1 = ls2 = _IDENTITY

    @property
    def norm1(self) -> nn.Module:
        return self.layernorm_before

    @property
    def norm2(self) -> nn.Module:
        return self.layernorm_after

    @property
    def attn(self) -> nn.Module:
        return self.attention

    @property
    def drop_path1(self) -> nn.Module:
        return self.dropout

    drop_path2 = drop_path1


class HFDinov2LayerViews:
    """timm ``Block``'s names on ``Dinov2Layer`` (``norm1``, ``norm2`` and ``mlp`` already match)."""

    @property
    def attn(self) -> nn.Module:
        return self.attention

    @property
    def ls1(self) -> nn.Module:
        return self.layer_scale1

    @property
    def ls2(self) -> nn.Module:
        return self.layer_scale2

    @property
    def drop_path1(self) -> nn.Module:
        return self.drop_path

    drop_path2 = drop_path1


class _TimmStyleAttention(nn.Module):
    """timm ``Attention``'s forward (fused kernel) on the views: the attention of an MoD layer that scores nothing."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        q, k, v, gate = attention_inputs(self, x)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           dropout_p=self.attn_drop.p if self.training else 0.0)
        return attention_output(self, o, gate)


# ---------------------------------------------------------------- the swapped classes

_CLASSES: dict[tuple[Optional[type], type], type] = {}
_PREFIXES = {MoDBlock: "MoD", Block: "Dense", FoldBlock: "Fold", ToMeBlock: "ToMe", ScoringAttention: "Scoring",
             SizedAttention: "Sized", _TimmStyleAttention: "Fused"}


def hf_base(module: nn.Module) -> type:
    """The Hugging Face class of a (possibly swapped) layer or attention module."""
    return getattr(type(module), "_amod_hf_base", type(module))


def _attends_everywhere(mask: torch.Tensor) -> bool:
    """Whether an HF attention mask lets every token attend to every token (boolean True, or additive 0)."""
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _refuse_kwargs(attention_mask: Optional[torch.Tensor]) -> None:
    """Refuse what an amod-run layer cannot give: masked attention, attention probabilities."""
    # Hugging Face makes no mask when it is given none (sdpa) or an all-attend one (e.g. eager, or while traced for
    # export, where its values cannot be read: amod's export calls the model without one)
    if attention_mask is not None and not tracing() and not _attends_everywhere(attention_mask):
        raise ValueError("amod-converted Hugging Face models do not take an attention_mask (routing, folding and "
                         "merging decide which tokens attend); call the model without one")
    if attentions_requested():
        raise ValueError("output_attentions is not available on an amod-converted Hugging Face model: amod's layers "
                         "compute attention without its probabilities (A-MoD's scores come from amod's own op) and "
                         "on fewer tokens; use output_hidden_states, or the dense model")


def _layer_forward(amod_cls: type):
    """The HF-signature forward of a layer whose work is ``amod_cls``'s forward (timm's signature)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        _refuse_kwargs(attention_mask)
        return amod_cls.forward(self, hidden_states)

    forward.__qualname__ = f"{amod_cls.__name__}.forward"
    return forward


def role_class(amod_cls: Optional[type], hf_cls: type) -> type:
    """The class (views, ``amod_cls``, ``hf_cls``) a module of HF class ``hf_cls`` is swapped to; ``amod_cls``
    None: the views only, HF's forward kept. Made once per pair."""
    key = (amod_cls, hf_cls)
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    name = hf_cls.__name__
    if name in ATTENTIONS:
        views = HFAttentionViews
    elif name in VIT_LAYERS:
        views = HFViTLayerViews
    elif name in DINOV2_LAYERS:
        views = HFDinov2LayerViews
    else:
        raise TypeError(f"amod does not know the Hugging Face module {name}")
    namespace: dict[str, Any] = {"__module__": __name__, "_amod_hf_base": hf_cls,
                                 "_amod_role": None if amod_cls is None else amod_cls.__name__}
    if amod_cls is None:
        bases: tuple[type, ...] = (views, hf_cls)
        cls_name = name  # the views only: the same name (HF's _no_split_modules and the like go by class name)
    else:
        bases = (views, amod_cls, hf_cls)
        cls_name = _PREFIXES.get(amod_cls, amod_cls.__name__) + name  # e.g. MoDViTLayer, ScoringDinov2Attention
        if views is not HFAttentionViews:
            namespace["forward"] = _layer_forward(amod_cls)
    cls = type(cls_name, bases, namespace)
    _CLASSES[key] = cls
    return cls


def _swap(module: nn.Module, amod_cls: Optional[type]) -> None:
    module.__class__ = role_class(amod_cls, hf_base(module))


# ---------------------------------------------------------------- the model's timm-style views

class PatchEmbedView:
    """What amod reads of timm's ``patch_embed`` (img_size, patch_size, grid_size, num_patches, proj), on HF's
    ``embeddings.patch_embeddings``. A plain object: nothing is registered on the model."""

    def __init__(self, patch_embeddings: nn.Module) -> None:
        self.module = patch_embeddings

    @property
    def img_size(self) -> tuple[int, int]:
        return tuple(int(s) for s in self.module.image_size)

    @property
    def patch_size(self) -> tuple[int, int]:
        return tuple(int(s) for s in self.module.patch_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        (h, w), (ph, pw) = self.img_size, self.patch_size
        return h // ph, w // pw

    @property
    def num_patches(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    @property
    def proj(self) -> nn.Conv2d:
        return self.module.projection


def supported_class(model: nn.Module) -> str:
    """The name of the supported Hugging Face class ``model`` is (or derives from); a TypeError otherwise."""
    name = next((c.__name__ for c in type(model).__mro__ if c.__name__ in SUPPORTED
                 and c.__module__.startswith("transformers.")), None)
    if name is None:
        raise TypeError(f"amod cannot take the Hugging Face model {type(model).__name__}: supported are "
                        f"{', '.join(SUPPORTED)}")
    return name


def _layers(base: nn.Module) -> nn.ModuleList:
    if "layers" in base._modules:  # ViTModel, DeiTModel
        return base.layers
    return base.encoder.layer  # Dinov2Model, Dinov2WithRegistersModel


def _heads(model: nn.Module, base: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
    """(head, head_dist) as timm names them, for the analytic cost."""
    if "cls_classifier" in model._modules:  # DeiTForImageClassificationWithTeacher
        return model.cls_classifier, model.distillation_classifier
    if "classifier" in model._modules:
        return model.classifier, None
    pooler = base._modules.get("pooler")  # ViTModel/DeiTModel with their pooler (a Linear + tanh)
    return (pooler.dense if pooler is not None else None), None


def _set_view(model: nn.Module, name: str, value: Any) -> None:
    """An instance attribute that is not a submodule (no state_dict entry, no second registration)."""
    object.__setattr__(model, name, value)


def prepare(model: nn.Module) -> nn.Module:
    """Give a supported Hugging Face model amod's timm-style views, in place (idempotent): every layer and
    attention gets timm's names (forward unchanged); the model gets ``blocks`` (its layer list),
    ``patch_embed``, ``num_prefix_tokens``, ``num_reg_tokens``, ``head``/``head_dist``, as plain attributes."""
    if model.__dict__.get("amod_hf_prepared"):
        return model
    supported_class(model)
    base = model.base_model
    layers = _layers(base)
    for i, layer in enumerate(layers):
        for module in (layer, layer.attention):
            hf_name = hf_base(module).__name__
            if hf_name not in VIT_LAYERS + DINOV2_LAYERS + ATTENTIONS:
                raise TypeError(f"layer {i} holds a {hf_name}; amod converts {', '.join(VIT_LAYERS + DINOV2_LAYERS)} "
                                f"with {', '.join(ATTENTIONS)} only")
        if not all(hasattr(layer.attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise TypeError(f"layer {i}'s attention has no q_proj/k_proj/v_proj/o_proj: amod.hf needs the attention "
                            f"layout of transformers 5.18 or later (this is {transformers.__version__})")
        if getattr(type(layer), "_amod_hf_base", None) is None:
            _swap(layer, None)
        if getattr(type(layer.attention), "_amod_hf_base", None) is None:
            _swap(layer.attention, None)
    regs = int(getattr(base.config, "num_register_tokens", 0) or 0)
    distilled = "distillation_token" in base.embeddings._parameters
    head, head_dist = _heads(model, base)
    _set_view(model, "blocks", layers)
    _set_view(model, "patch_embed", PatchEmbedView(base.embeddings.patch_embeddings))
    _set_view(model, "num_prefix_tokens", 1 + int(distilled) + regs)
    _set_view(model, "num_reg_tokens", regs)
    _set_view(model, "head", head)
    _set_view(model, "head_dist", head_dist)
    install_save_pretrained(model)
    _set_view(model, "amod_hf_prepared", True)
    return model


# ---------------------------------------------------------------- save_pretrained

def amod_state_keys(model: nn.Module) -> set[str]:
    """The state_dict keys amod added to a Hugging Face model (its routers' parameters): the ones transformers'
    ``from_pretrained`` does not know."""
    return {f"{name}.{key}" for name, module in model.named_modules() if isinstance(module, Router)
            for key in module.state_dict()}


def _save_pretrained(model: nn.Module, save_directory: Union[str, os.PathLike], *args: Any, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained`` of an amod-prepared model: the folder it writes holds the dense model
    (what transformers' own ``from_pretrained`` reads without an unexpected key), and ``amod.safetensors`` holds
    the conversion (the method's metadata, as ``amod.save`` writes it) and amod's own tensors, which
    ``amod.load(folder)`` and the CLI read back. A dense model leaves no such file (and removes a stale one)."""
    from ..methods import method_of  # (the method classes sit above the model families)

    state = kwargs.pop("state_dict", None)
    state = model.state_dict() if state is None else state
    own = amod_state_keys(model)
    result = type(model).save_pretrained(model, save_directory, *args,
                                         state_dict={k: v for k, v in state.items() if k not in own}, **kwargs)
    if kwargs.get("is_main_process", True):
        sidecar = Path(save_directory) / SIDECAR
        meta = method_of(model).metadata()
        if meta:
            tensors = {k: state[k].detach().contiguous().cpu() for k in sorted(own)}
            meta = {"amod.format": SIDECAR_FORMAT, "amod.model": json.dumps(model_info(model)), **meta}
            write_bytes(sidecar, safetensors_bytes(tensors, metadata=meta))
        elif sidecar.exists():
            sidecar.unlink()
    return result


def install_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` keep amod's conversion (``_save_pretrained``); an instance attribute, so
    the class stays transformers' own (copies keep it, bound to the copy)."""
    object.__setattr__(model, "save_pretrained", MethodType(_save_pretrained, model))


# ---------------------------------------------------------------- amod.convert

def _check_layer(blk: nn.Module, index: int) -> None:
    """Refuse a layer amod already runs (a model converts once)."""
    if getattr(type(blk), "_amod_role", "?") is not None:
        raise TypeError(f"layer {index} is a {type(blk).__name__}; amod converts unconverted Hugging Face layers only")


def convert_hf(model: nn.Module, config: MoDConfig) -> None:
    """``amod.convert``'s policy for Hugging Face models (``amod.hf.policy``): MoD-block modes (bypass, merge, kv)
    and fold."""
    prepare(model)
    mode = skipped_mode(config.skipped)
    if isinstance(mode, FoldMode):
        _convert_fold(model, config)
    elif isinstance(mode, MoDMode):
        _convert_mod(model, config)
    else:
        raise ValueError(f"skipped={config.skipped!r} has no Hugging Face conversion; amod.hf converts the MoD-block "
                         "modes (bypass, merge, kv) and fold")


def _convert_mod(model: nn.Module, config: MoDConfig) -> None:
    """``amod.mod.block.convert_to_mod_blocks`` on HF layers: the MoD layers become ``MoDBlock`` s; for an attention
    router, the layer before each becomes timm's ``Block`` with a ``ScoringAttention`` (a dense layer) or passes
    the scores on (an MoD layer)."""
    blocks = model.blocks
    for i in config.layers:
        _check_layer(blocks[i], i)
    for i in config.layers:
        blk = blocks[i]
        _swap(blk, MoDBlock)
        _swap(blk.attn, _TimmStyleAttention)
        weight = blk.attn.q_proj.weight
        blk.router = build_router(config.router, blk.norm1.normalized_shape[0], seed=config.seed + i)
        blk.router.to(device=weight.device, dtype=weight.dtype)
        blk.amod = MoDSettings(config=config, num_prefix=model.num_prefix_tokens)
    if router_class(config.router).needs_attention:
        for i in config.layers:
            prev = blocks[i - 1]
            handoff = ScoreHandoff()
            if not isinstance(prev, MoDBlock):
                _check_layer(prev, i - 1)
                _swap(prev, Block)  # a dense layer, run by timm's Block forward so that its attention can score
            _swap(prev.attn, ScoringAttention)
            prev.attn.amod_handoff = handoff
            prev.attn.amod_scores_need_grad = config.scale_output  # gradients through the scores: scaled outputs only
            if isinstance(prev, MoDBlock):
                prev.amod.out_handoff = handoff
                prev.attn.amod_relayed = True
            blocks[i].amod.in_handoff = handoff


def _make_sized(blk: nn.Module, block_cls: type[SizedTokensBlock], settings: Any, class_rows: int = 0) -> None:
    """``amod.reduce.make_sized`` on an HF layer: the swapped classes carry the views, the attributes are the same."""
    _swap(blk, block_cls)
    _swap(blk.attn, SizedAttention)
    blk.attn.amod_want = False
    blk.attn.amod_class_rows = class_rows
    blk.attn.amod_metric = blk.attn.amod_importance = None
    blk.amod = settings


def _convert_fold(model: nn.Module, config: MoDConfig) -> None:
    """``FoldMode.convert`` on HF layers: every layer a ``FoldBlock``; those in ``config.layers`` fold."""
    for i, blk in enumerate(model.blocks):
        _check_layer(blk, i)
    sizes = TokenSizes()
    class_tokens = model.num_prefix_tokens - model.num_reg_tokens  # CLS (and distillation)
    for i, blk in enumerate(model.blocks):
        settings = FoldSettings(config=config, num_prefix=model.num_prefix_tokens, fold=i in config.layers,
                                sizes=sizes, first=i == 0)
        _make_sized(blk, FoldBlock, settings, class_rows=max(1, class_tokens))
        blk.router = build_router(config.router, blk.attn.qkv.in_features, seed=config.seed + i)


# ---------------------------------------------------------------- amod.tome.apply

def tome_apply(model: nn.Module, r: Union[int, Sequence[int], None] = None, cost: Optional[float] = None,
               img_size=None) -> nn.Module:
    """``amod.tome.apply`` on a Hugging Face model: every layer becomes a ``ToMeBlock``."""
    prepare(model)
    return merge_blocks(model, r, cost, img_size, _check_layer, _make_sized)


# ---------------------------------------------------------------- amod.save / amod.load

def _constructor_kwargs(model: nn.Module) -> dict[str, Any]:
    """The constructor arguments besides the config that change the state_dict (ViTModel/DeiTModel's pooler)."""
    if not is_detr_model(model) and supported_class(model) in ("ViTModel", "DeiTModel"):
        return {"add_pooling_layer": model.pooler is not None}
    return {}


def model_info(model: nn.Module) -> dict[str, Any]:
    """What ``amod.save`` stores under ``amod.model`` for a Hugging Face model: its class, config and
    constructor arguments (instead of timm's architecture name and ``create_model`` arguments)."""
    name = next((c.__name__ for c in type(model).__mro__ if c.__name__ in DETR), None) or supported_class(model)
    info = {"hf": name, "config": json.loads(model.config.to_json_string(use_diff=False)),
            "kwargs": _constructor_kwargs(model), "transformers": transformers.__version__}
    if name in DETR:
        from ..detr.models import has_content_queries

        info["content_queries"] = has_content_queries(model)  # a forward hook: not in the weights or the config
    return info


def restore_forward_hooks(model: nn.Module, info: dict[str, Any]) -> nn.Module:
    """Give a model built from ``info`` (``model_info``) what its forward had beyond weights and config: a DETR's
    content queries."""
    if info.get("content_queries"):
        from ..detr.models import use_content_queries

        use_content_queries(model)
    return model


def build_model(info: dict[str, Any]) -> nn.Module:
    """The (randomly initialised) Hugging Face model ``model_info`` describes."""
    name = info["hf"]
    if name not in SUPPORTED + DETR:
        raise ValueError(f"unknown Hugging Face class {name!r}; amod supports {', '.join(SUPPORTED + DETR)}")
    cls = getattr(transformers, name)
    config = cls.config_class.from_dict(info["config"])
    if name in DETR:  # every weight comes from the file: never ask for a pretrained backbone as well
        config.use_pretrained_backbone = False
    return restore_forward_hooks(cls(config, **info.get("kwargs", {})).eval(), info)


# ---------------------------------------------------------------- amod.export

class TensorOutput(nn.Module):
    """A Hugging Face model whose forward takes the image batch and returns one tensor, for ONNX export and its
    check: the logits of a classifier, else the features (``last_hidden_state``). amod's views (``blocks``,
    ``patch_embed``, ``amod_config``, ...) are read through to the model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)
