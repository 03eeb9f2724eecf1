"""amod: Mixture-of-Depths routing for timm Vision Transformers, with A-MoD attention routing.

    import timm, amod
    model = timm.create_model("deit_small_patch16_224", pretrained=True)
    amod.convert(model, router="attention", capacity=0.125, layers="alternate")
    amod.set_capacity(model, 0.5)
    print(amod.flops(model))

Sub-packages: ``amod.mod`` (routers, MoD and fold blocks, conversion), ``amod.tome`` (token merging,
the baseline), ``amod.kernels`` (Triton score kernels), ``amod.weights`` (real pretrained weights),
``amod.train`` (data, engine, run configurations, runs), ``amod.experiments`` (demo, compare, study,
export, analyses, benchmarks). ``amod.methods`` names what a model runs; ``amod.cost`` prices it;
``amod.ops`` is attention with A-MoD's scores; ``amod.deploy`` exports a model to ONNX (``amod.export``)
and checks it in ONNX Runtime; ``amod.checkpoint`` saves and loads models (``amod.save``,
``amod.load``); ``amod.arch`` holds a ViT's architecture arguments and ``set_input_size``.
"""
from . import arch, hf, ops, tome, weights  # hf: Hugging Face models (imports transformers only when used)
from .cost import CostReport, count_flops, flops
from .deploy import export
from .experiments import analysis, stats
from .methods import Dense, IsoFLOP, Method, MoD, TokenMerging, method_of
from .mod.config import MoDConfig
from .mod.convert import (capacity_for_cost, convert, get_config, lowest_capacity, mod_blocks, set_capacity,
                           set_recording)
from .mod.isoflop import isoflop_baseline
from .checkpoint import load, save

__all__ = [
    "MoDConfig", "CostReport", "convert", "set_capacity", "set_recording", "get_config", "mod_blocks",
    "flops", "count_flops", "capacity_for_cost", "lowest_capacity", "tome", "isoflop_baseline", "save", "load",
    "weights", "arch", "ops", "analysis", "stats", "Method", "Dense", "MoD", "IsoFLOP", "TokenMerging", "method_of",
    "export", "hf",
]
__version__ = "0.1.0"

