"""`amod analyze`: one analysis of a saved model on the first images of its validation set, written to a folder.

``loo`` (leave-one-out importance inside the MoD model, against random scores), ``routing`` (the
kept patches per MoD layer, and how often each position is kept) or ``attention`` (entropy and
attention-sink share per block). The analyses themselves are in ``amod.analysis``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..files import dumps, made_directory, write_text
from ..mod.modes import mode_list, skipped_mode
from ..checkpoint import load
from ..train.data import build_datasets, first_images, normalization
from ..train.rundir import RunDirectory, check_output_dir
from ..analysis import attention_stats, check_loo_model, kept_positions, leave_one_out
from .plots import keep_frequency_figure, routing_figure
from ..errors import UserError
from ..flags import flag, positive_int

ANALYSES = ("loo", "routing", "attention")


@dataclass
class AnalyzeConfig:
    # (each field's comment is its flag's help: amod.flags)
    analysis: str = flag(positional=True, choices=ANALYSES)
    checkpoint: str
    data: str = "fashion-mnist"
    images: int = flag(16, type=positive_int)  # the first N validation images
    tokens: Optional[int] = flag(None, type=positive_int)  # patch tokens sampled per image (loo; default all)
    out: str = "runs/analysis"


def run_analysis(cfg: AnalyzeConfig) -> tuple[Any, str]:
    """Run ``cfg.analysis`` and write ``<analysis>.json`` (and pictures) under ``cfg.out``.

    Returns the result and a one-line summary for the terminal.
    """
    if cfg.analysis not in ANALYSES:
        raise UserError(f"unknown analysis {cfg.analysis!r}; use one of {', '.join(ANALYSES)}")
    out = check_output_dir(cfg.out)
    model = load(cfg.checkpoint).eval()
    if cfg.analysis in ("loo", "routing") and getattr(model, "amod_config", None) is None:
        raise UserError(f"analyze {cfg.analysis} needs an MoD model (one trained or finetuned with --router); "
                        f"{cfg.checkpoint} is not one")
    if cfg.analysis == "loo":
        check_loo_model(model, str(cfg.checkpoint))
    if cfg.analysis == "routing" and not skipped_mode(model.amod_config.skipped).records_kept_indices:
        usable = mode_list(lambda m: m.records_kept_indices)
        raise UserError(f"analyze routing needs an MoD model with skipped {usable}; "
                        f"{cfg.checkpoint} is a {model.amod_config.skipped} model, whose tokens change identity as "
                        "they are reduced: there are no kept patch positions")
    _, val, info = build_datasets(cfg.data, model.patch_embed.img_size[0], None, None)
    if info.in_chans != model.patch_embed.proj.in_channels:
        raise UserError(f"the model takes {model.patch_embed.proj.in_channels}-channel images; {info.name} has "
                        f"{info.in_chans} channels")
    xs, ys = first_images(val, cfg.images)
    # (an analysis that fails leaves no empty --out; held while it writes: a second command into --out is refused)
    with made_directory(out), RunDirectory(out, log_name=None):
        if cfg.analysis == "loo":
            result = leave_one_out(model, xs, ys, tokens=cfg.tokens)
            summary = dumps({str(k): {"router": v["router"], "random": v["random"]}
                             for k, v in result["layers"].items()})
        elif cfg.analysis == "routing":
            mean, std = normalization(info)
            png = routing_figure(model, xs[: min(len(ys), 8)], out / "routing.png", mean=mean, std=std)
            frequency = {k: m.float().mean(dim=0) for k, m in kept_positions(model, xs).items()}
            freq_png = keep_frequency_figure(frequency, tuple(model.patch_embed.grid_size), out / "keep_frequency.png")
            result = {str(k): f.tolist() for k, f in frequency.items()}  # how often each position is kept
            summary = f"routing pictures: {png}, {freq_png}"
        else:
            result = {str(k): v for k, v in attention_stats(model, xs).items()}
            summary = dumps(result)
        write_text(Path(out) / f"{cfg.analysis}.json", dumps(result, indent=1))
    return result, summary


def analyze_command(cfg: AnalyzeConfig) -> str:
    """``amod analyze``: the analysis run and written, its summary in words."""
    return run_analysis(cfg)[1]
