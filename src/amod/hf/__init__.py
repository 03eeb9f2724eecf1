"""Hugging Face ``transformers`` models: loading, and weights from timm.

``load_hf_model`` loads a ``save_pretrained`` folder (``amod.hf.loading``); ``from_timm`` builds the Hugging Face model
of a timm ViT with its weights (``amod.hf.timm_weights``); ``amod.hf.common`` holds the names they and the families share.
The model families themselves are ``amod.families.hf_vit`` (ViT, DeiT, DINOv2), ``hf_clip`` and ``hf_siglip`` (the
CLIP and SigLIP vision encoders) and ``detr``, above this package; ``amod.families.hf_base`` is what they share
(amod's roles on transformers' layers by class swaps and views, ``save_pretrained`` that keeps a conversion,
checkpoints). This package imports no family: a loaded model gets its family from the registry (``amod.family``).

This package imports nothing at import time, ``transformers`` included (an optional extra,
``pip install 'amod[hf]'``): it is imported when a Hugging Face model is met or loaded.
"""
from __future__ import annotations

from typing import Any

from .common import SIDECAR, SIDECAR_FORMAT, attentions_requested  # noqa: F401 (the package's names)


def __getattr__(name: str) -> Any:
    """The rest of the package (``load_hf_model``, ``from_timm``, ``timm_to_hf_state_dict``, ...), imported
    when first asked for: it needs ``transformers``."""
    if name in ("load_hf_model",):
        from . import loading

        return getattr(loading, name)
    if name in ("from_timm", "timm_to_hf_state_dict", "hf_config_from_timm"):
        from . import timm_weights

        return getattr(timm_weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
