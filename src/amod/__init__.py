"""amod: Mixture-of-Depths routing for timm Vision Transformers, with A-MoD attention routing.

    import timm, amod
    model = timm.create_model("deit_small_patch16_224", pretrained=True)
    amod.convert(model, router="attention", capacity=0.125, layers="alternate")
    amod.set_capacity(model, 0.5)
    print(amod.flops(model))

Sub-packages: ``amod.mod`` (routers, MoD and fold blocks, conversion), ``amod.tome`` (token merging,
the baseline), ``amod.families`` (the model families: timm, Hugging Face ViT/DeiT/DINOv2, CLIP, SigLIP, DETR),
``amod.kernels`` (Triton score kernels), ``amod.weights`` (real pretrained weights), ``amod.analysis`` and
``amod.stats`` (leave-one-out, routing and attention analyses; bootstrap CIs); the application:
``amod.train`` (data, engine, run configurations, runs), ``amod.tools`` (eval, export, flops, bench: one model
measured or converted), ``amod.experiments`` (demo, compare, study, frontier), ``amod.detect`` (DETR on detection
canvases), ``amod.dense`` (segmentation of patch features on the same canvases), ``amod.cli``. ``amod.methods`` names what a model runs; ``amod.cost`` prices it;
``amod.ops`` is attention with A-MoD's scores; ``amod.deploy`` exports a model to ONNX (``amod.export``)
and checks it in ONNX Runtime; ``amod.fast`` is the compiled (and CUDA-graph) inference path (``amod.compile``); ``amod.checkpoint`` saves and loads models (``amod.save``,
``amod.load``); ``amod.arch`` holds a ViT's architecture arguments and ``set_input_size``; ``amod.patch_features``
(``amod.patch_grid``) gives every patch its feature on the dense grid, whatever the model reduces.
"""
from . import arch, hf, ops, tome, weights  # hf: Hugging Face models (imports transformers only when used)
# the model families amod ships: each module registers its family (none imports transformers at import time)
from .families import timm_vit as _timm_vit, hf_vit as _hf_vit  # noqa: F401
from .families import hf_clip as _hf_clip, hf_siglip as _hf_siglip, detr as _detr  # noqa: F401
from . import analysis, families, stats
from .cost import CostReport, count_flops, flops
from .deploy import export
from .errors import UserError
from .fast import compile
from .methods import Dense, Method, method_of
from .tome.merging import TokenMerging
from .tome import pitome
from .tome.pitome import PiToMe
from .mod.config import MoDConfig
from .mod.convert import (MoD, capacity_for_cost, convert, get_config, lowest_capacity, mod_blocks, set_capacity,
                           set_recording)
from .mod.isoflop import IsoFLOP, isoflop_baseline
from .mod.calibrate import Calibrated, calibrate
from .checkpoint import load, save
from .patch_grid import patch_features

__all__ = [
    "MoDConfig", "CostReport", "convert", "set_capacity", "set_recording", "get_config", "mod_blocks",
    "flops", "count_flops", "capacity_for_cost", "lowest_capacity", "tome", "isoflop_baseline", "save", "load",
    "weights", "arch", "ops", "analysis", "stats", "Method", "Dense", "MoD", "IsoFLOP", "TokenMerging", "PiToMe", "pitome",
    "ppt",
    "method_of", "calibrate", "Calibrated",
    "export", "compile", "hf", "families", "UserError", "patch_features",
]
__version__ = "0.1.0"

# every built-in method registers on import (found in the source, no list: amod.methods.load_builtin_methods); this
# also imports amod.ppt, PPT's module, which nothing above names
from .methods import load_builtin_methods as _load_builtin_methods  # noqa: E402
_load_builtin_methods()

