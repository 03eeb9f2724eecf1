"""Figures for reports (matplotlib, written to PNG without a display)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from ..analysis import kept_positions  # noqa: E402
from ..errors import UserError  # noqa: E402


Series = dict[str, tuple[Sequence[float], Sequence[float]]]
Point = tuple[float, float, Optional[float]]  # (x, a score in [0, 1], its error bar's half-width or None)
LINE_STYLES = ("-", "--", ":", "-.")
REFERENCE_COLOUR = "black"  # the reference point of a frontier (dense): no series takes it


def palette() -> list[str]:
    """The series' colours: matplotlib's ten, then tab20's ten lighter shades of them (black is the reference's)."""
    return [to_hex(c) for c in plt.rcParams["axes.prop_cycle"].by_key()["color"]] + \
        [to_hex(c) for c in matplotlib.colormaps["tab20"].colors[1::2]]


def series_styles(names: Sequence[str], variants: Optional[dict[str, tuple[str, str]]] = None
                  ) -> dict[str, tuple[str, str]]:
    """(colour, line style) of each series in one axes, no two alike. ``variants``: name -> (the series it varies,
    line style): a variant is drawn in its series' colour and its own style, unless another series already has that
    pair (two variants of one series in one style) or its series is not drawn; then, as every other series, it takes
    the first colour no series has yet (a variant keeps its style, the rest are solid); past the palette, the first
    (colour, style) pair no series has."""
    variants = variants or {}
    colours = palette()
    out: dict[str, tuple[str, str]] = {}
    for name in names:
        base, style = variants.get(name, (None, "-"))
        if base in out and (out[base][0], style) not in out.values():
            out[name] = (out[base][0], style)
            continue
        style = style if base in out else "-"
        used = {c for c, _ in out.values()}
        free = [c for c in colours if c not in used]
        if free:
            out[name] = (free[0], style)
        else:
            pairs = [(c, s) for s in LINE_STYLES for c in colours if (c, s) not in out.values()]
            if not pairs:
                raise UserError(f"{len(names)} series in one axes: at most {len(colours) * len(LINE_STYLES)} can "
                                 "be told apart")
            out[name] = pairs[0]
    return out


def save_figure(fig: Figure, path, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG at ``path`` and free it."""
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


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


def steps_figure(curves: dict[str, tuple[Sequence[float], Sequence[float]]], title: str,
                 variants: Optional[dict[str, tuple[str, str]]] = None) -> Figure:
    """One line per method: (finetuning steps, accuracies on test images). ``variants``: method -> (the method it
    varies, line style), drawn in that method's colour where no other line has that colour and style
    (``series_styles``: every line its own pair), so the colours go to the distinct methods and the legend sits
    beside the axes."""
    fig, ax = plt.subplots(figsize=(9.0, 4.6))
    styles = series_styles(list(curves), variants)
    for name, (xs, acc) in curves.items():
        colour, style = styles[name]
        ax.plot(xs, [100 * a for a in acc], marker="o", markersize=3.5, color=colour, linestyle=style, label=name)
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
    ax.set_ylabel("test top-1 (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def frontier_figure(panels: dict[str, tuple[Point, dict[str, Sequence[Point]]]], xlabel: str, ylabel: str,
                    reference: str = "dense") -> Figure:
    """Side-by-side panels, title -> (the reference's point, {method: its points}): each method's points joined in x
    order and the reference (dense, which every method reduces) one marker of its own, not on any method's line;
    every point with its error bar (scores in [0, 1], drawn in %). A method keeps its colour in every panel; one
    legend, beside the last panel, off the lines."""
    names = list(dict.fromkeys(name for _, series in panels.values() for name in series))
    styles = series_styles(names)
    handles = {}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels) + 2.2, 4.4), squeeze=False)
    for ax, (title, (ref, series)) in zip(axes[0], panels.items()):
        for name, points in series.items():
            if not points:
                continue
            points = sorted(points)
            colour, style = styles[name]
            handles[name] = ax.errorbar([p[0] for p in points], [100 * p[1] for p in points],
                                        yerr=[100 * (p[2] or 0.0) for p in points], marker="o", markersize=4,
                                        capsize=2, color=colour, linestyle=style, label=name)
        handles[reference] = ax.errorbar([ref[0]], [100 * ref[1]], yerr=[100 * (ref[2] or 0.0)], marker="*",
                                         markersize=12, capsize=3, color=REFERENCE_COLOUR, linestyle="none",
                                         label=reference, zorder=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    order = [n for n in names if n in handles] + [reference]
    axes[0][-1].legend([handles[n] for n in order], order, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig
