"""The model families amod ships, one adapter module each: ``vit`` (the ViT pattern's shared defaults), ``timm_vit``,
``hf_base`` (what the Hugging Face families share), ``hf_vit`` (ViT, DeiT, DINOv2), ``hf_clip``, ``hf_siglip`` and
``detr``. Each registers its ``Family`` when imported (``amod/__init__`` imports them).

The contract and the registry are ``amod.family``, at the bottom of the package, where the library's modules ask for
a model's family; they are re-exported here (``amod.families.family_of``, ...). Nothing below the families imports
this package.
"""
from __future__ import annotations

from ..family import (  # noqa: F401 (the registry's names, re-exported)
    FAMILIES,
    Family,
    claimed,
    class_names,
    family_for,
    family_of,
    prepare,
    register_family,
    weightless_copy,
)
