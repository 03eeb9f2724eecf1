"""Names every Hugging Face module of amod shares; imports nothing (``transformers`` only when called)."""
from __future__ import annotations

# save_pretrained of an amod model writes this file beside config.json: the conversion (the method's metadata) and
# amod's own tensors (routers), which transformers' from_pretrained does not know
# (amod.families.hf_base._save_pretrained)
SIDECAR = "amod.safetensors"
SIDECAR_FORMAT = "1"
# ... and names the conversion under this key of its config.json, so that a folder whose amod.safetensors went missing
# is refused rather than read as the dense model (amod.hf.loading.load_hf_model)
CONFIG_KEY = "amod_conversion"


def attentions_requested() -> bool:
    """Whether the Hugging Face forward running now was asked for ``output_attentions`` (transformers' output
    collector, read inside a layer's forward)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers layout: nothing to check
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected
