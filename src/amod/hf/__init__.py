"""Hugging Face ``transformers`` vision models: ViT, DeiT and DINOv2 under ``amod.convert``, ToMe and fold.

``amod.convert``, ``amod.tome.apply``, ``amod.set_capacity``, ``amod.flops``, ``amod.save``/``amod.load`` and
``amod.export`` take ``ViTModel``/``ViTForImageClassification``, ``DeiTModel``/``DeiTForImageClassification``
(``...WithTeacher``), ``Dinov2Model``/``Dinov2ForImageClassification`` (and ``Dinov2WithRegisters*``) as they
are: same forward signature, same output classes, same state_dict keys (see docs/hf.md and
``amod.hf.adapter``).

This package imports nothing at import time, ``transformers`` included (an optional extra,
``pip install 'amod[hf]'``): the library calls ask ``is_hf_model`` first, which only looks at the class's
module name, and import the adapter only for a Hugging Face model.
"""
from __future__ import annotations

from typing import Any

SUPPORTED = ("ViTModel", "ViTForImageClassification", "DeiTModel", "DeiTForImageClassification",
             "DeiTForImageClassificationWithTeacher", "Dinov2Model", "Dinov2ForImageClassification",
             "Dinov2WithRegistersModel", "Dinov2WithRegistersForImageClassification")


# save_pretrained of an amod model writes this file beside config.json: the conversion (the method's metadata) and
# amod's own tensors (routers), which transformers' from_pretrained does not know (amod.hf.adapter._save_pretrained)
SIDECAR = "amod.safetensors"
SIDECAR_FORMAT = "1"

# Hugging Face DETRs: amod.detr converts their encoders (MoD on the feature-map positions)
DETR = ("DetrModel", "DetrForObjectDetection")


def attentions_requested() -> bool:
    """Whether the Hugging Face forward running now was asked for ``output_attentions`` (transformers' output
    collector, read inside a layer's forward; imports ``transformers`` only when called)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers layout: nothing to check
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def is_detr_model(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face DETR (by its classes' names: nothing is imported)."""
    return any(c.__name__ in DETR and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a ``transformers`` model (by its class's module: nothing is imported)."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def prepare(model: Any) -> Any:
    """Give a Hugging Face model the timm-style views amod's library code reads (``blocks``, ``patch_embed``,
    ``num_prefix_tokens``, ...), once; anything else is returned untouched. Called by ``amod.convert``,
    ``amod.tome.apply``, ``amod.flops``, ``amod.save`` and ``amod.export``."""
    if is_hf_model(model) and not is_detr_model(model):  # a DETR keeps its own names (amod.detr)
        from .adapter import prepare as _prepare

        _prepare(model)
    return model


def policy(model: Any) -> Any:
    """``amod.convert``'s converter for a Hugging Face model (the model prepared), or None for any other model. (Not
    in ``amod.mod.convert.POLICIES``: that registry, and the error that lists it, stay timm's.)"""
    if not is_hf_model(model):
        return None
    from .adapter import convert_hf, prepare as _prepare

    _prepare(model)
    return convert_hf


def __getattr__(name: str) -> Any:
    """The rest of the package (``load_hf_model``, ``from_timm``, ``timm_to_hf_state_dict``, ...), imported
    when first asked for: it needs ``transformers``."""
    if name in ("load_hf_model",):
        from . import loading

        return getattr(loading, name)
    if name in ("from_timm", "timm_to_hf_state_dict", "hf_config_from_timm"):
        from . import weights

        return getattr(weights, name)
    if name in ("adapter",):
        from . import adapter

        return adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
