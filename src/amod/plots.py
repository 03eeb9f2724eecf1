"""Figures for reports (matplotlib, written to PNG without a display)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


Series = dict[str, tuple[Sequence[float], Sequence[float]]]


def _draw(ax, series: Series, title: str, xlabel: str) -> None:
    """One line per series (x values, accuracies in [0, 1]) on an accuracy axis."""
    for name, (xs, acc) in series.items():
        ax.plot(xs, [100 * a for a in acc], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("val top-1 (%)")
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
                            xlabel: str = "cost (share of dense MACs)") -> Path:
    """Side-by-side accuracy-vs-cost panels (e.g. zero-training and finetuned), one curve per method."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.4), squeeze=False)
    for ax, (title, points) in zip(axes[0], panels.items()):
        _draw(ax, _cost_series(points), title, xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
