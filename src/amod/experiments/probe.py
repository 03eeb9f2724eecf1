"""Linear probes: judge a backbone without a classifier for the data (e.g. DINOv2) by a linear
classifier fitted once on the dense model's frozen features and applied unchanged to reduced models.

``features(model, loader)`` gathers the CLS token after the final norm; ``fit_probe`` fits a
multinomial logistic regression (standardised features, L2 penalty chosen on a held-out part of the
training subset, L-BFGS in float64) and returns a ``LinearProbe`` that scores any model's features.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..files import load_torch, torch_save
from ..errors import UserError

log = logging.getLogger("amod")
L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
MIN_PROBE_IMAGES = 10  # fit_probe holds a fifth of its images out to choose the penalty: fewer leave it nothing


def probe_images(available: int, probe_train: int, data: str) -> int:
    """How many training images a linear probe is fitted on: ``--probe-train``, or all ``available`` images of
    ``data`` where there are fewer. Raises ValueError, naming the flag or the data, where that is fewer than
    ``MIN_PROBE_IMAGES`` (to refuse before the dense features are computed)."""
    n = min(probe_train, available)
    if n < MIN_PROBE_IMAGES:
        why = f"--probe-train is {probe_train}" if probe_train < MIN_PROBE_IMAGES else \
            f"{data} has {available} training image{'' if available == 1 else 's'}"
        raise UserError(f"the linear probe needs at least {MIN_PROBE_IMAGES} training images and {why}")
    return n


@torch.no_grad()
def features(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) float32 features (the CLS token after the final norm) and (N,) labels of ``batches``."""
    model.eval()
    device = device or next(model.parameters()).device
    feats, labels = [], []
    for x, y in batches:
        tokens = model.forward_features(x.to(device))  # (B, N, D), after the final norm
        feats.append(model.forward_head(tokens, pre_logits=True).float().cpu())
        labels.append(y.cpu())
    return torch.cat(feats), torch.cat(labels)


@dataclass
class LinearProbe:
    """A linear classifier on standardised features: logits = ((f - mean) / std) @ weight.T + bias."""

    mean: torch.Tensor  # (D,)
    std: torch.Tensor  # (D,)
    weight: torch.Tensor  # (C, D)
    bias: torch.Tensor  # (C,)
    l2: float  # the penalty chosen on the held-out part
    held_out_accuracy: float

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        z = (feats.double() - self.mean) / self.std
        return z @ self.weight.T + self.bias

    def accuracy(self, feats: torch.Tensor, labels: torch.Tensor) -> float:
        return (self.logits(feats).argmax(1) == labels).double().mean().item()


def _fit(z: torch.Tensor, y: torch.Tensor, classes: int, l2: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression with an L2 penalty on the weights, L-BFGS, float64."""
    w = torch.zeros(classes, z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(z @ w.T + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


def fit_probe(feats: torch.Tensor, labels: torch.Tensor, held_out: float = 0.2, l2_grid: Sequence[float] = L2_GRID,
              steps: int = 500, seed: int = 0) -> LinearProbe:
    """Fit a linear probe on ``feats`` (N, D) and ``labels`` (N,).

    The L2 penalty is chosen from ``l2_grid`` by accuracy on a random ``held_out`` share of the
    samples (the rest fit), then the probe is refitted on all of them with that penalty.
    """
    if feats.ndim != 2 or len(feats) != len(labels) or len(feats) < MIN_PROBE_IMAGES:
        raise UserError(f"fit_probe needs (N, D) features and N labels, N >= {MIN_PROBE_IMAGES}; got "
                        f"{tuple(feats.shape)}, {tuple(labels.shape)}")
    if not 0 < held_out < 1:
        raise UserError(f"held_out must be in (0, 1), got {held_out}")
    x = feats.double()
    y = labels.long()
    classes = int(y.max()) + 1
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(held_out * len(x))))
    val, fit = perm[:n_val], perm[n_val:]

    def standardise(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[idx].mean(0), x[idx].std(0).clamp_min(1e-6)

    mean, std = standardise(fit)
    z_fit, z_val = (x[fit] - mean) / std, (x[val] - mean) / std
    scores = {}
    for l2 in l2_grid:
        w, b = _fit(z_fit, y[fit], classes, l2, steps)
        scores[l2] = ((z_val @ w.T + b).argmax(1) == y[val]).double().mean().item()
    best = max(l2_grid, key=lambda l2: (scores[l2], l2))  # ties: the stronger penalty
    mean, std = standardise(torch.arange(len(x)))
    w, b = _fit((x - mean) / std, y, classes, best, steps)
    log.info("linear probe: L2 %g chosen on %d held-out samples (accuracy %.4f); %s", best, n_val, scores[best],
             ", ".join(f"{k:g}: {v:.4f}" for k, v in scores.items()))
    return LinearProbe(mean, std, w, b, best, scores[best])


def fit_probe_cached(path: Path, feats: torch.Tensor, labels: torch.Tensor) -> LinearProbe:
    """``fit_probe(feats, labels)``, kept in ``path``: a resumed study or comparison reuses it instead of
    running the L-BFGS fits again (about 20 s on DINOv2 features). It is fitted again when the features, the
    labels or ``fit_probe``'s defaults differ from the ones it was fitted with, or when the file is unreadable."""
    h = hashlib.sha256(repr(fit_probe.__defaults__).encode())
    for t in (feats.float().contiguous(), labels.long().contiguous()):
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    digest = h.hexdigest()
    if path.exists():
        try:
            saved = load_torch(path)
            if saved["digest"] == digest:
                probe = LinearProbe(**{f.name: saved[f.name] for f in dataclasses.fields(LinearProbe)})
                log.info("linear probe reused from %s (L2 %g, held-out accuracy %.4f)", path, probe.l2,
                         probe.held_out_accuracy)
                return probe
        except Exception as e:  # a torn or foreign file is fitted again, not trusted
            log.warning("%s cannot be reused (%s: %s); fitting the linear probe again", path, type(e).__name__, e)
    log.info("fitting the linear probe on %d images' features (its L2 chosen among %s on a held-out fifth)",
             len(feats), ", ".join(f"{l2:g}" for l2 in L2_GRID))
    probe = fit_probe(feats, labels)
    torch_save({"digest": digest, **dataclasses.asdict(probe)}, path)
    return probe


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of (N, D) features."""
    return F.cosine_similarity(a.double(), b.double(), dim=1).mean().item()
