"""Statistics for comparing variants: mean ± std over seeds, paired bootstrap confidence intervals,
and Spearman rank correlation."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from .errors import UserError


@dataclass
class PairedCI:
    """Difference A - B with a bootstrap confidence interval."""

    mean: float
    low: float
    high: float
    level: float
    n_seeds: int

    def __str__(self) -> str:
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}] ({100 * self.level:.0f} % CI, {self.n_seeds} seeds)"


def paired_bootstrap_ci(a: np.ndarray, b: np.ndarray, level: float = 0.95, n_boot: int = 10_000,
                        seed: int = 0) -> PairedCI:
    """Bootstrap CI of mean(A) - mean(B) for paired runs.

    Args:
        a, b: per-seed accuracies, shape (S,), or per-seed, per-image correctness, shape (S, M) with the
            same images in the same order; row s of ``a`` and of ``b`` share seed s.
        level: confidence level.
        n_boot: bootstrap resamples.

    With (S,) inputs the seeds are resampled; with (S, M) inputs seeds and then images are resampled
    (a two-level bootstrap), so the interval reflects both run-to-run and test-set variation.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim not in (1, 2) or a.shape[0] < 1:
        raise UserError(f"a and b must be paired arrays of shape (seeds,) or (seeds, images); got {a.shape}, {b.shape}")
    if not 0 < level < 1:
        raise UserError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    diff = a - b  # paired: same seed (and image)
    S = diff.shape[0]
    seed_idx = rng.integers(0, S, size=(n_boot, S))
    if diff.ndim == 1:
        stats = diff[seed_idx].mean(axis=1)
    else:
        M = diff.shape[1]
        stats = np.empty(n_boot)
        for i in range(n_boot):  # resample seeds, then images within the resampled seeds
            rows = diff[seed_idx[i]]
            stats[i] = rows[np.arange(S)[:, None], rng.integers(0, M, size=(S, M))].mean()
    alpha = (1 - level) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return PairedCI(float(diff.mean()), float(low), float(high), level, S)


def bootstrap_mean_ci(values: np.ndarray, level: float = 0.95, n_boot: int = 10_000, seed: int = 0
                      ) -> tuple[float, float, float]:
    """Mean of ``values`` (NaNs left out) and its percentile bootstrap CI, resampling the values."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    ci = paired_bootstrap_ci(values, np.zeros_like(values), level, n_boot, seed)  # (the values against 0)
    return ci.mean, ci.low, ci.high


def spearman_ci(x: np.ndarray, y: np.ndarray, level: float = 0.95, n_boot: int = 10_000, seed: int = 0
                ) -> tuple[float, float, float]:
    """Spearman correlation of paired points and its percentile bootstrap CI, resampling the pairs."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    rng = np.random.default_rng(seed)
    draws = [spearman(x[i], y[i]) for i in rng.integers(0, x.size, size=(n_boot, x.size))]
    alpha = (1 - level) / 2
    low, high = np.nanquantile(draws, [alpha, 1 - alpha])
    return spearman(x, y), float(low), float(high)


def mean_std(values: np.ndarray) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size < 2:
        raise UserError("spearman needs two 1-d arrays of the same length >= 2")
    rx, ry = _rank(x), _rank(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _rank(v: np.ndarray) -> np.ndarray:
    order = v.argsort(kind="mergesort")
    ranks = np.empty_like(v)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    # average the ranks of ties
    uniq, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    if len(uniq) < v.size:
        sums = np.bincount(inverse, weights=ranks)
        ranks = (sums / counts)[inverse]
    return ranks
