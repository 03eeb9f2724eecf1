"""What every Hugging Face family shares: amod's roles on transformers' own layers, by class swaps and views.

amod's blocks (``MoDBlock``, ``FoldBlock``, ``ToMeBlock``) and attentions (``ScoringAttention``, ``SizedAttention``)
are written against timm's attribute names: ``blk.norm1``, ``blk.attn``, ``blk.ls1``, ``attn.qkv``, ``attn.proj``,
``attn.num_heads``, ... A Hugging Face layer holds the same modules under other names. So, as ``amod.convert`` does
for timm, the HF layer's *class* is swapped, to a class of three parts:

    (views of the HF names under timm's names, the amod block class, the HF layer class)

The views are read-only properties, not modules: no parameter is copied or re-registered, state_dict keys stay HF's
own, and the HF forward signature stays (``forward(hidden_states, attention_mask=None, **kwargs)`` calls the amod
block's forward). timm's fused ``qkv`` is read off the three HF projections (``FusedQKV``). A swapped class is named
by the role the amod class plays (its ``amod_role_name``) and the HF class: ``MoDViTLayer``, ``ScoringDinov2Attention``.

``HFFamily`` is the family base of the ViT-pattern Hugging Face models (``amod.families.hf_vit``, ``hf_clip``,
``hf_siglip``): a subclass names its classes, where its layers and attentions are and their views; this module
does the rest (``prepare``, the roles, the refusals, ``save_pretrained``, checkpoints, copies, the tensor and feature
modules). ``transformers`` is imported only when a Hugging Face model is met.

Refused (``ValueError``, one line each): an ``attention_mask`` or ``output_attentions=True`` on a converted model
(amod's layers run attention without the probabilities, and with fewer tokens).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from types import MethodType
from typing import Any, ClassVar, Optional, Union

import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from timm.models.vision_transformer import Block
from torch import nn

from ..family import class_names, family_of
from ..files import write_bytes
from ..hf.common import CONFIG_KEY, SIDECAR, SIDECAR_FORMAT, attentions_requested
from ..methods import file_metadata, method_of
from ..mod.block import MoDBlock, ScoringAttention
from ..mod.routers import Router
from ..ops import KeyBias, check_key_bias, key_biased_attention, tracing
from ..reduce import SizedAttention
from .vit import ViTFamily
from ..errors import MissingDependencyError, UnsupportedModelError, UserError

IDENTITY = nn.Identity()  # timm's q_norm, k_norm, norm, proj_drop, ls1, ls2 where HF has none (no parameters)


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "Hugging Face models need transformers, the optional extra: pip install 'amod[hf]'") from None
    return transformers


# ---------------------------------------------------------------- timm's names on HF modules

def alias(name: str) -> property:
    """A read-only view, under timm's name, of the HF module's attribute ``name`` (a view class is mostly these)."""
    return property(lambda self: getattr(self, name), doc=f"the HF module's ``{name}``")


class Dropout:
    """What amod reads of timm's ``attn_drop``: its probability."""

    __slots__ = ("p",)

    def __init__(self, p: float) -> None:
        self.p = p


class FusedQKV:
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


class AttentionViews:
    """timm ``Attention``'s names on an HF attention with ``q_proj``, ``k_proj``, ``v_proj`` and ``head_dim``; a
    subclass aliases its output projection as ``proj`` and names its dropout probability attribute (``_dropout``),
    and aliases ``num_heads`` and ``scale`` where its attention calls them otherwise (``ViTAttentionViews``)."""

    _dropout: ClassVar[str] = "attention_dropout"
    proj = alias("o_proj")
    fused_attn = True
    gate = None
    q_norm = k_norm = norm = proj_drop = IDENTITY

    @property
    def attn_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def qkv(self) -> FusedQKV:
        return FusedQKV(self)

    @property
    def attn_drop(self) -> Dropout:
        return Dropout(float(getattr(self, self._dropout)))


class TimmStyleAttention(nn.Module):
    """timm ``Attention``'s forward (fused kernel) on the views: the attention of an MoD layer that scores nothing."""

    amod_role_name = "Fused"  # FusedViTAttention

    def forward(self, x: torch.Tensor, attn_mask: Optional[KeyBias] = None, is_causal: bool = False) -> torch.Tensor:
        check_key_bias(attn_mask, is_causal, "amod's attention of a Hugging Face layer")
        return key_biased_attention(self, x, attn_mask)  # (fused, maskless)


# ---------------------------------------------------------------- the swapped classes

_CLASSES: dict[tuple[Optional[type], Optional[type], type], type] = {}
TIMM_ROLE_NAMES = {Block: "Dense"}  # timm's own classes, which carry no amod_role_name


def role_name(amod_cls: type) -> str:
    """The short name of the role ``amod_cls`` plays, the prefix of a swapped class's name: the class's own
    ``amod_role_name`` (``MoDBlock``: "MoD"; not inherited, so that a subclass is named by its own class unless it says
    otherwise), else the class name."""
    return vars(amod_cls).get("amod_role_name") or TIMM_ROLE_NAMES.get(amod_cls, amod_cls.__name__)


def hf_base(module: nn.Module) -> type:
    """The Hugging Face class of a (possibly swapped) module."""
    return getattr(type(module), "_amod_hf_base", type(module))


def amod_role(module: nn.Module) -> Optional[str]:
    """The amod class a swapped module runs (its name), None for HF's own forward (views only or untouched)."""
    return getattr(type(module), "_amod_role", None)


def _attends_everywhere(mask: torch.Tensor) -> bool:
    """Whether an HF attention mask lets every token attend to every token (boolean True, or additive 0)."""
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def refuse_kwargs(attention_mask: Optional[torch.Tensor]) -> None:
    """Refuse what an amod-run layer cannot give: masked attention, attention probabilities."""
    # Hugging Face makes no mask when it is given none (sdpa) or an all-attend one (e.g. eager, or while traced for
    # export, where its values cannot be read: amod's export calls the model without one)
    if attention_mask is not None and not tracing() and not _attends_everywhere(attention_mask):
        raise UserError("amod-converted Hugging Face models do not take an attention_mask (routing, folding and "
                        "merging decide which tokens attend); call the model without one")
    if attentions_requested():
        raise UserError("output_attentions is not available on an amod-converted Hugging Face model: amod's layers "
                        "compute attention without its probabilities (A-MoD's scores come from amod's own op) and "
                        "on fewer tokens; use output_hidden_states, or the dense model")


def _layer_forward(amod_cls: type):
    """The HF-signature forward of a layer whose work is ``amod_cls``'s forward (timm's signature)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        refuse_kwargs(attention_mask)
        return amod_cls.forward(self, hidden_states)

    forward.__qualname__ = f"{amod_cls.__name__}.forward"
    return forward


def role_class(views: Optional[type], amod_cls: Optional[type], hf_cls: type, layer: bool) -> type:
    """The class (``views``, ``amod_cls``, ``hf_cls``) a module of HF class ``hf_cls`` is swapped to; ``amod_cls``
    None: the views only, HF's forward kept. ``layer``: a layer, whose HF-signature forward calls the amod block's
    (an attention is called by the amod block itself). Made once per triple."""
    key = (views, amod_cls, hf_cls)
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    name = hf_cls.__name__
    namespace: dict[str, Any] = {"__module__": __name__, "_amod_hf_base": hf_cls,
                                 "_amod_role": None if amod_cls is None else amod_cls.__name__}
    bases = tuple(b for b in (views, amod_cls, hf_cls) if b is not None)
    if amod_cls is None:
        cls_name = name  # the views only: the same name (HF's _no_split_modules and the like go by class name)
    else:
        cls_name = role_name(amod_cls) + name  # e.g. MoDViTLayer, ScoringDinov2Attention
        if layer and views is not None:
            namespace["forward"] = _layer_forward(amod_cls)
            namespace["amod_forward_of"] = amod_cls  # (what the forward runs: how amod.flops tells a dense layer)
    cls = type(cls_name, bases, namespace)
    _CLASSES[key] = cls
    return cls


# ---------------------------------------------------------------- the model's timm-style views

class PatchEmbedView:
    """What amod reads of timm's ``patch_embed`` (img_size, patch_size, grid_size, num_patches, proj), on an HF
    embeddings' patch convolution. A plain object: nothing is registered on the model."""

    def __init__(self, proj: nn.Conv2d, img_size: Any, patch_size: Any) -> None:
        self.proj = proj
        pair = lambda v: (int(v), int(v)) if isinstance(v, int) else tuple(int(s) for s in v)  # noqa: E731
        self.img_size, self.patch_size = pair(img_size), pair(patch_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        (h, w), (ph, pw) = self.img_size, self.patch_size
        return h // ph, w // pw

    @property
    def num_patches(self) -> int:
        gh, gw = self.grid_size
        return gh * gw


def set_view(model: nn.Module, name: str, value: Any) -> None:
    """An instance attribute that is not a submodule (no state_dict entry, no second registration)."""
    object.__setattr__(model, name, value)


class TensorOutput(nn.Module):
    """A Hugging Face model whose forward takes the image batch and returns one tensor, for ONNX export and
    evaluation: the logits of a classifier, else the image embedding of a model with a projection, else the
    features (``last_hidden_state``). amod's views (``blocks``, ``patch_embed``, ``amod_config``, ...) are read
    through to the model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values)
        for name in ("logits", "image_embeds"):
            value = getattr(out, name, None)
            if value is not None:
                return value
        return out.last_hidden_state

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)


class HFFeatures(nn.Module):
    """A Hugging Face model with what a linear probe reads of a timm one: ``forward_features`` (the family's final
    tokens, ``final_tokens``) and ``forward_head(..., pre_logits=True)`` (the family's pooled feature, ``pool``)."""

    def __init__(self, model: nn.Module, family: "HFFamily") -> None:
        super().__init__()
        self.model = model
        self.family = family

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.family.final_tokens(self.model, x)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = True) -> torch.Tensor:
        return self.family.pool(self.model, tokens)


# ---------------------------------------------------------------- save_pretrained

def amod_state_keys(model: nn.Module) -> set[str]:
    """The state_dict keys amod added to a Hugging Face model (its routers' parameters): the ones transformers'
    ``from_pretrained`` does not know."""
    return {f"{name}.{key}" for name, module in model.named_modules() if isinstance(module, Router)
            for key in module.state_dict()}


def _save_pretrained(model: nn.Module, save_directory: Union[str, os.PathLike], *args: Any, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained`` of an amod model: the folder it writes holds the dense model (what
    transformers' own ``from_pretrained`` reads without an unexpected key), and ``amod.safetensors`` holds the
    conversion (the method's metadata, as ``amod.save`` writes it) and amod's own tensors, which ``amod.load(folder)``
    and the CLI read back. config.json names the conversion (``CONFIG_KEY``), so that amod refuses the folder if the
    sidecar goes missing; a warning says that transformers' ``from_pretrained`` reads the folder as the dense model.
    A dense model leaves no such file or key (and removes a stale one)."""
    state = kwargs.pop("state_dict", None)
    state = model.state_dict() if state is None else state
    own = amod_state_keys(model)
    method = method_of(model)
    meta = method.metadata()
    config = model.config
    before = config.__dict__.pop(CONFIG_KEY, None)
    if meta:
        setattr(config, CONFIG_KEY, {"method": method.label(), "file": SIDECAR})
    try:
        result = type(model).save_pretrained(model, save_directory, *args,
                                             state_dict={k: v for k, v in state.items() if k not in own}, **kwargs)
    finally:
        config.__dict__.pop(CONFIG_KEY, None)
        if before is not None:
            config.__dict__[CONFIG_KEY] = before
    if kwargs.get("is_main_process", True):
        sidecar = Path(save_directory) / SIDECAR
        if meta:
            tensors = {k: state[k].detach().contiguous().cpu() for k in sorted(own)}
            meta = {"amod.format": SIDECAR_FORMAT, "amod.model": json.dumps(family_of(model).describe(model)),
                    **file_metadata(method)}
            write_bytes(sidecar, safetensors_bytes(tensors, metadata=meta))
            warnings.warn(f"{save_directory} keeps the {method.label()} conversion in {SIDECAR}: amod.load(folder) or "
                          "amod.hf.load_hf_model(folder) gives it back; transformers' from_pretrained reads the folder "
                          "as the dense model", stacklevel=2)
        elif sidecar.exists():
            sidecar.unlink()
    return result


def install_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` keep amod's conversion (``_save_pretrained``); an instance attribute, so the
    class stays transformers' own (copies keep it, bound to the copy)."""
    object.__setattr__(model, "save_pretrained", MethodType(_save_pretrained, model))


# ---------------------------------------------------------------- checkpoints

class HFCheckpoints:
    """How an ``amod.save`` file describes and rebuilds a Hugging Face model: its class, config and constructor
    arguments. A family that uses it names its classes in ``classes``."""

    classes: ClassVar[tuple[str, ...]] = ()

    def hf_class(self, model: nn.Module) -> str:
        """The supported class ``model`` is (or derives from)."""
        names = class_names(model, "transformers.")
        return next(c for c in self.classes if c in names)

    def claims(self, model: Any) -> bool:
        return bool(class_names(model, "transformers.") & set(self.classes))

    def claims_description(self, info: dict[str, Any]) -> bool:
        return info.get("hf") in self.classes

    def constructor_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """Constructor arguments besides the config that change the state_dict."""
        return {}

    def describe(self, model: nn.Module, **hints: Any) -> dict[str, Any]:
        transformers = transformers_module()
        return {"hf": self.hf_class(model), "config": json.loads(model.config.to_json_string(use_diff=False)),
                "kwargs": self.constructor_kwargs(model), "transformers": transformers.__version__}

    def _build(self, info: dict[str, Any]) -> nn.Module:
        cls = getattr(transformers_module(), info["hf"])
        return cls(cls.config_class.from_dict(info["config"]), **info.get("kwargs", {})).eval()

    def rebuild(self, info: dict[str, Any], metadata: Optional[dict[str, str]] = None) -> nn.Module:
        return self.restore(self.prepare(self._build(info)), info, metadata)

    def weightless_copy(self, model: nn.Module) -> nn.Module:
        info = self.describe(model)
        with torch.device("meta"):
            return self.rebuild(info)


# ---------------------------------------------------------------- the family base

class HFFamily(HFCheckpoints, ViTFamily):
    """A Hugging Face family of the ViT pattern. A subclass gives ``classes``, ``layer_views`` and
    ``attention_views`` (HF class name -> views class), and ``layers``, ``attention``, ``patch_embed``,
    ``prefix_tokens`` and ``heads``; ``final_norm`` where ``last_hidden_state`` is not
    ``base_model.layernorm``'s (``hidden_states``, ``final_norm``: what ``amod.patch_features`` lays back)."""

    layer_views: ClassVar[dict[str, type]] = {}
    attention_views: ClassVar[dict[str, type]] = {}

    # ------------------------------------------------------------ what a subclass says

    def layers(self, model: nn.Module) -> nn.ModuleList:
        raise NotImplementedError

    def attention(self, layer: nn.Module) -> nn.Module:
        """The attention module inside ``layer``."""
        raise NotImplementedError

    def patch_embed(self, model: nn.Module) -> PatchEmbedView:
        raise NotImplementedError

    def prefix_tokens(self, model: nn.Module) -> tuple[int, int]:
        """(prefix tokens, of which registers)."""
        raise NotImplementedError

    def heads(self, model: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
        """(head, head_dist) Linears as timm names them, for the analytic cost."""
        return None, None

    def final_tokens(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The tokens after the encoder's final norm (``last_hidden_state`` of the base model by default)."""
        return model.base_model(pixel_values=x).last_hidden_state

    def pool(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """The pooled feature of the final tokens that a linear probe reads (the class token by default)."""
        return tokens[:, 0]

    def hidden_states(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The model's own ``hidden_states`` (``output_hidden_states=True``): the embeddings, then each layer's
        output, as long as the layers hand them on."""
        return model(pixel_values=x, output_hidden_states=True).hidden_states

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm between the last layer's output and ``last_hidden_state`` (ViT, DeiT, DINOv2: ``layernorm``)."""
        return model.base_model.layernorm

    # ------------------------------------------------------------ the views and roles

    def _swap(self, module: nn.Module, amod_cls: Optional[type], layer: bool) -> None:
        base = hf_base(module)
        table = self.layer_views if layer else self.attention_views
        if base.__name__ not in table:
            raise UnsupportedModelError(f"amod does not know the Hugging Face module {base.__name__}")
        module.__class__ = role_class(table[base.__name__], amod_cls, base, layer)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Give the model amod's timm-style views, in place (idempotent): every layer and attention gets timm's
        names (forward unchanged); the model gets ``blocks`` (its layer list), ``patch_embed``,
        ``num_prefix_tokens``, ``num_reg_tokens``, ``head``/``head_dist``, as plain attributes."""
        if model.__dict__.get("amod_hf_prepared"):
            return model
        layers = self.layers(model)
        for i, layer in enumerate(layers):
            attn = self.attention(layer)
            for module, table in ((layer, self.layer_views), (attn, self.attention_views)):
                if hf_base(module).__name__ not in table:
                    raise UnsupportedModelError(
                        f"layer {i} holds a {hf_base(module).__name__}; amod's {self.name} family takes "
                        f"{', '.join(self.layer_views)} with {', '.join(self.attention_views)}")
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
                raise UnsupportedModelError(
                    f"layer {i}'s attention has no q_proj/k_proj/v_proj: amod.hf needs the attention "
                    f"layout of transformers 5.18 or later (this is {transformers_module().__version__})")
            if getattr(type(layer), "_amod_hf_base", None) is None:
                self._swap(layer, None, layer=True)
            if getattr(type(attn), "_amod_hf_base", None) is None:
                self._swap(attn, None, layer=False)
        prefix, regs = self.prefix_tokens(model)
        head, head_dist = self.heads(model)
        set_view(model, "blocks", layers)
        set_view(model, "patch_embed", self.patch_embed(model))
        set_view(model, "num_prefix_tokens", prefix)
        set_view(model, "num_reg_tokens", regs)
        for name, module in (("head", head), ("head_dist", head_dist)):
            if name not in model._modules:  # (a model's own submodule of that name stays itself: SigLIP's head)
                set_view(model, name, module)
        install_save_pretrained(model)
        set_view(model, "amod_hf_prepared", True)
        return model

    def check_block(self, block: nn.Module, index: int) -> None:
        if amod_role(block) is not None:
            raise UnsupportedModelError(
                f"layer {index} is a {type(block).__name__}; amod converts unconverted Hugging Face "
                "layers only")

    def make_mod(self, block: nn.Module) -> nn.Module:
        self._swap(block, MoDBlock, layer=True)
        self._swap(block.attn, TimmStyleAttention, layer=False)
        return block

    def make_scoring(self, block: nn.Module) -> nn.Module:
        if not isinstance(block, MoDBlock):
            self._swap(block, Block, layer=True)  # a dense layer, run by timm's Block so that its attention can score
        self._swap(block.attn, ScoringAttention, layer=False)
        return block.attn

    def make_sized(self, block: nn.Module, block_cls: type, settings: Any, class_rows: int = 0) -> None:
        self._swap(block, block_cls, layer=True)
        self._swap(block.attn, SizedAttention, layer=False)
        block.attn.amod_want = block.attn.amod_want_importance = False
        block.attn.amod_class_rows = class_rows
        block.attn.amod_metric = block.attn.amod_importance = None
        block.amod = settings

    # ------------------------------------------------------------ evaluation and export

    def tensor_module(self, model: nn.Module) -> nn.Module:
        return TensorOutput(self.prepare(model))

    def feature_module(self, model: nn.Module) -> nn.Module:
        return HFFeatures(self.prepare(model), self)

    def num_classes(self, model: nn.Module) -> int:
        classifier = any(n in model._modules for n in ("classifier", "cls_classifier"))
        return int(model.config.num_labels) if classifier else 0

    def keep_blocks(self, model: nn.Module, keep: list[int]) -> nn.Module:
        layers = self.layers(model)
        kept = [layers[i] for i in keep]
        while len(layers):
            del layers[len(layers) - 1]
        layers.extend(kept)
        model.config.num_hidden_layers = len(kept)  # what a checkpoint rebuilds
        return model
