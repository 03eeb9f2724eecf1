"""amod: Mixture-of-Depths routing for timm Vision Transformers, with A-MoD attention routing.

    import timm, amod
    model = timm.create_model("deit_small_patch16_224", pretrained=True)
    amod.convert(model, router="attention", capacity=0.125, layers="alternate")
    amod.set_capacity(model, 0.5)
    print(amod.flops(model))

Sub-packages: ``amod.mod`` (routers, MoD and fold blocks, conversion), ``amod.tome`` (token merging,
the baseline), ``amod.kernels`` (Triton score kernels), ``amod.train`` (data, engine, runs,
checkpoints), ``amod.experiments`` (demo, compare, study, analyses, benchmarks). ``amod.methods``
names what a model runs; ``amod.cost`` prices it; ``amod.ops`` is attention with A-MoD's scores;
``amod.deploy`` exports a model to ONNX (``amod.export``) and checks it in ONNX Runtime.
"""
import importlib

from . import ops, pretrained, tome
from .cost import CostReport, count_flops, flops
from .deploy import export
from .experiments import analysis, stats
from .methods import Dense, IsoFLOP, Method, MoD, TokenMerging, method_of
from .mod.config import MoDConfig
from .mod.convert import (capacity_for_cost, convert, get_config, lowest_capacity, mod_blocks, set_capacity,
                           set_recording)
from .mod.isoflop import isoflop_baseline
from .train.checkpoint import load, save

__all__ = [
    "MoDConfig", "CostReport", "convert", "set_capacity", "set_recording", "get_config", "mod_blocks",
    "flops", "count_flops", "capacity_for_cost", "lowest_capacity", "tome", "isoflop_baseline", "save", "load",
    "pretrained", "ops", "analysis", "stats", "Method", "Dense", "MoD", "IsoFLOP", "TokenMerging", "method_of",
    "export",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "merge":  # deprecated alias of amod.tome; importing it warns
        return importlib.import_module(".merge", __name__)
    raise AttributeError(f"module 'amod' has no attribute {name!r}")
