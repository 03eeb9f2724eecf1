"""Figures for reports (matplotlib, written to PNG without a display)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from ..analysis import kept_positions  # noqa: E402


Series = dict[str, tuple[Sequence[float], Sequence[float]]]


def _draw(ax, series: Series, title: str, xlabel: str, ylabel: str = "val top-1 (%)") -> None:
    """One line per series (x values, accuracies in [0, 1]) on an accuracy axis."""
    for name, (xs, acc) in series.items():
        ax.plot(xs, [100 * a for a in acc], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _line_plot(series: Series, path: Path, title: str, xlabel: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _draw(ax, series, title, xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def accuracy_vs_epoch(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path, title: str) -> Path:
    """One line per variant: (epochs, accuracies)."""
    return _line_plot(curves, path, title, "finetuning epoch (0 = zero-training)")


def accuracy_vs_cost(points: dict[str, Sequence[tuple[float, float]]], path: Path, title: str,
                     xlabel: str = "MMACs per image") -> Path:
    """One series per method: (cost, accuracy) points, joined in cost order."""
    return _line_plot(_cost_series(points), path, title, xlabel)


def _cost_series(points: dict[str, Sequence[tuple[float, float]]]) -> Series:
    return {name: ([p[0] for p in sorted(pts)], [p[1] for p in sorted(pts)]) for name, pts in points.items()}


def accuracy_vs_cost_panels(panels: dict[str, dict[str, Sequence[tuple[float, float]]]], path: Path,
                            xlabel: str = "cost (share of dense MACs)", ylabel: str = "val top-1 (%)") -> Path:
    """Side-by-side accuracy-vs-cost panels (e.g. zero-training and finetuned), one curve per method."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.4), squeeze=False)
    for ax, (title, points) in zip(axes[0], panels.items()):
        _draw(ax, _cost_series(points), title, xlabel, ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def routing_figure(model: nn.Module, images: torch.Tensor, path, mean: Sequence[float] = (0.0,),
                   std: Sequence[float] = (1.0,)) -> Any:
    """Overlay of the kept patches of each MoD layer on each image (paper Fig. 16); PNG at ``path``."""
    masks = kept_positions(model, images)
    gh, gw = model.patch_embed.grid_size
    B = images.shape[0]
    layers = sorted(masks)
    fig, axes = plt.subplots(B, len(layers) + 1, figsize=(1.6 * (len(layers) + 1), 1.6 * B), squeeze=False)
    shown = images.cpu() * torch.tensor(std).view(-1, 1, 1) + torch.tensor(mean).view(-1, 1, 1)
    for b in range(B):
        img = shown[b].permute(1, 2, 0).squeeze(-1).clamp(0, 1).numpy()
        axes[b][0].imshow(img, cmap="gray")
        for j, layer in enumerate(layers):
            ax = axes[b][j + 1]
            ax.imshow(img, cmap="gray")
            mask = masks[layer][b].view(gh, gw).float().numpy()
            ax.imshow(mask, cmap="autumn", alpha=0.45, extent=(-0.5, img.shape[1] - 0.5, img.shape[0] - 0.5, -0.5),
                      interpolation="nearest")
            if b == 0:
                ax.set_title(f"block {layer}", fontsize=8)
    for ax in axes.flat:
        ax.axis("off")
    axes[0][0].set_title("input", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def keep_frequency_figure(frequency: dict[int, torch.Tensor], grid: tuple[int, int], path) -> Any:
    """Heatmap per MoD layer of how often each patch position is kept (a (n_patches,) rate each)."""
    layers = sorted(frequency)
    fig, axes = plt.subplots(1, len(layers), figsize=(2.2 * len(layers), 2.4), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        im = ax.imshow(frequency[layer].view(*grid).numpy(), vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"block {layer}", fontsize=8)
        ax.axis("off")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="share of images kept")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_vs_steps(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path, title: str,
                      variants: Optional[dict[str, tuple[str, str]]] = None) -> Path:
    """One line per method: (finetuning steps, accuracies). ``variants``: method -> (the method it varies, line
    style), drawn in that method's colour (e.g. the same method distilled, dashed), so the colours go to the
    distinct methods and the legend sits beside the axes."""
    variants = variants or {}
    fig, ax = plt.subplots(figsize=(9.0, 4.6))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours: dict[str, str] = {}
    for name, (xs, acc) in curves.items():
        base, style = variants.get(name, (None, "-"))
        if base not in colours:
            base, style = name, "-"
            colours[name] = palette[len(colours) % len(palette)]
        ax.plot(xs, [100 * a for a in acc], marker="o", markersize=3.5, color=colours[base], linestyle=style,
                label=name)
    steps = sorted({int(x) for xs, _ in curves.values() for x in xs})
    positive = [x for x in steps if x > 0]
    if positive and positive[-1] >= 8 * positive[0]:
        # Evaluation steps double (32, 64, ..., 1024): a log axis gives each the same room, so the short runs are not
        # squeezed into the left quarter by the long ones; symlog keeps step 0 (zero-training) on the axis.
        ax.set_xscale("symlog", linthresh=positive[0], linscale=0.5)
        ax.set_xticks(steps)
        ax.set_xticklabels([str(x) for x in steps])
        ax.minorticks_off()
    ax.set_xlabel("finetuning step (0 = zero-training)")
    ax.set_ylabel("val top-1 (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
