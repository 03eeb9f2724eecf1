"""`amod study --checkpoint BACKBONE --leave-one-out`: the review's objections 3 and 4 on the finetune study's models.

Objection 3: do a router's scores rank the tokens as their removal at that block of the *trained MoD model* would?
At each cost of ``FinetuneConfig.loo_costs`` it judges the finetuned model (seed 0; ``study`` keeps its
weights) of each arm of ``LOO_ARMS``, and the dense model (the backbone with the probe's head, zero training: the
paper's protocol, which measures importance in the dense model) with MoD blocks at capacity 1.0 where the paper's
A-MoD has them. In each, at each MoD block, every patch token of the first ``loo_images`` test images skips that block
alone (``analysis.skip_importance``); the block's rank correlation (Spearman, per image) between a router's scores
and those loss rises is averaged over the images, with a 95 % bootstrap CI over the images; the same for the attention
scores the block reads (where its router reads them) and for random scores (the null).

Objection 4: does routing quality fall where attention concentrates on a few tokens? Per MoD block l, the attention
the A-MoD router at l reads is block l - 1's: its most-attended token's share and the entropy of the received
attention (``analysis.attention_stats``), rank-correlated over (model, block) with the attention scores' correlation
at l, with a bootstrap CI over the points.

Kill-safe: each (model, block) is kept in ``OUT/leave_one_out/`` as it finishes and is not measured again.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from ...analysis import attention_stats, skip_importance
from ...cost import same_cost
from ...checkpoint import load
from ...errors import UserError
from ...files import atomic_write, write_json, write_text
from ...mod.convert import MoD
from ...stats import bootstrap_mean_ci, spearman, spearman_ci
from ...train.rundir import run_dir_name
from .plan import LOO_ARMS, REFERENCE, FinetuneConfig, Planned

log = logging.getLogger("amod")

DENSE_LOO = "dense (zero training)"  # the paper's protocol: importance in the pretrained dense model
EVERY_BLOCK = "every block"  # (the key of the correlations averaged over a model's MoD blocks)


@dataclass
class Judged:
    """One model leave-one-out judges: its name, cost, MoD blocks, and how to build it (loaded or converted only when a
    measurement is missing)."""

    name: str
    cost: float
    key: str  # what its kept measurements are bound to (its weights)
    layers: tuple[int, ...]  # its MoD blocks
    build: Callable[[], nn.Module]
    folder: str  # where its measurements are kept, under OUT/leave_one_out


def judged_models(cfg: FinetuneConfig, start: nn.Module, planned: list[Planned], kept: Callable[[Planned], Path],
                  digest: str, digest_of: Callable[[Path], str]) -> list[Judged]:
    """The models of every cost of ``cfg.loo_costs``: the dense one, then the finetuned LOO arms in ``LOO_ARMS``'s
    order. ``kept(p)``: where the finetuned model of ``p`` (seed 0) is kept; ``digest``: the backbone's weights';
    ``digest_of(path)``: a kept model's weights' (what its measurements are bound to). Refuses, naming them, costs the
    study does not run and models that are not kept."""
    models: list[Judged] = []
    missing = []
    for cost in cfg.loo_costs:
        at = {p.arm.name: p for p in planned if same_cost(p.cost_target, cost)}
        if REFERENCE not in at:
            raise UserError(f"--loo-cost {cost:g} is not one of the study's costs ({', '.join(f'{c:g}' for c in cfg.costs)})")
        layers = tuple(at[REFERENCE].method.layers)

        def dense(layers=layers) -> nn.Module:  # MoD blocks at capacity 1.0: the dense model, scores read where A-MoD's are
            return MoD(router="attention", capacity=1.0, layers=layers, scale_output=False).apply(copy.deepcopy(start))

        # (one folder for every cost: at capacity 1.0 a block's importances do not depend on where the other MoD blocks
        # are, so a block measured at one cost is not measured again at another)
        models.append(Judged(DENSE_LOO, cost, f"dense-{digest}", layers, dense, run_dir_name(DENSE_LOO)))
        for name in LOO_ARMS:
            if name not in at:
                continue
            path = kept(at[name])
            if not path.is_file():
                missing.append(f"{name} at {cost:g} ({path})")
                continue
            models.append(Judged(name, cost, digest_of(path), tuple(at[name].method.layers),
                                 lambda path=path: load(path), f"cost{cost:g}/{run_dir_name(name)}"))
    if missing:
        raise UserError(f"leave-one-out judges the finetuned models of seed 0; not kept: {'; '.join(missing)}")
    return models


def measure(judged: Judged, images: torch.Tensor, labels: torch.Tensor, folder: Path) -> dict[str, Any]:
    """Every MoD block's skip importances and scores, and every block's attention statistics, of one model: read from
    ``folder`` where kept (bound to ``judged.key`` and the images), measured and kept there block by block where not."""
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{judged.key}-{len(images)}"
    model: Optional[nn.Module] = None
    out: dict[str, Any] = {"layers": {}}
    stats_path = folder / f"attention_{tag}.json"
    if stats_path.is_file():
        out["attention_stats"] = {int(k): v for k, v in json.loads(stats_path.read_text()).items()}
    else:
        model = judged.build().eval()
        out["attention_stats"] = attention_stats(model, images)
        write_json(stats_path, {str(k): v for k, v in out["attention_stats"].items()})
    for layer in judged.layers:
        path = folder / f"layer{layer}_{tag}.npz"
        if not path.is_file():
            if model is None:
                model = judged.build().eval()
            log.info("leave-one-out: %s at cost %g, block %d, %d images", judged.name, judged.cost, layer, len(images))
            got = skip_importance(model, images, labels, layers=[layer])[layer]
            arrays = {k: v for k, v in got.items() if v is not None}
            atomic_write(path, lambda f: np.savez(f, **arrays))
        with np.load(path) as kept:
            out["layers"][layer] = {k: kept[k] if k in kept else None for k in ("importance", "router", "attention")}
    return out


def correlations(measured: dict[str, Any], seed: int = 0) -> dict[Any, dict[str, Any]]:
    """Per MoD block: the mean per-image Spearman correlation of the router's scores, of the attention scores it reads
    (where it reads them) and of random scores with the skip importances, each with its 95 % bootstrap CI over the
    images; and the attention statistics of the block before (what an attention router at that block reads). Under
    ``EVERY_BLOCK``: each image's correlation averaged over the blocks, with its CI over the images."""
    out: dict[Any, dict[str, Any]] = {}
    every: dict[str, list[list[float]]] = {}
    for layer, got in measured["layers"].items():
        imp = got["importance"]
        rng = np.random.default_rng(seed + layer)
        row: dict[str, Any] = {}
        for name, scores in (("router", got["router"]), ("attention", got["attention"]),
                             ("random", rng.random(imp.shape))):
            if scores is None:
                continue
            per_image = [spearman(s, i) for s, i in zip(scores, imp)]
            row[name] = bootstrap_mean_ci(np.array(per_image), seed=seed)
            every.setdefault(name, []).append(per_image)
        before = measured["attention_stats"].get(layer - 1)
        if before is not None:
            row["top_token_share"] = before["top_token_share"]
            row["received_entropy"] = before["received_entropy"] / before["max_entropy"]
        row["importance_mean"] = float(imp.mean())
        out[layer] = row
    out[EVERY_BLOCK] = {name: bootstrap_mean_ci(np.nanmean(np.array(rhos), axis=0), seed=seed)
                        for name, rhos in every.items()}
    return out


def run_leave_one_out(cfg: FinetuneConfig, start: nn.Module, planned: list[Planned], kept: Callable[[Planned], Path],
                      digest: str, digest_of: Callable[[Path], str], test: Any, root: Path) -> Path:
    """Judge every model of ``judged_models`` on the first ``cfg.loo_images`` images of ``test`` and write
    ``OUT/leave_one_out.md``, ``.json`` and ``.png``; returns the report's path."""
    models = judged_models(cfg, start, planned, kept, digest, digest_of)
    n = min(cfg.loo_images, len(test))
    images = torch.stack([test[i][0] for i in range(n)])
    labels = torch.as_tensor([int(test[i][1]) for i in range(n)])
    results = []
    for judged in models:
        folder = root / "leave_one_out" / judged.folder
        results.append((judged, correlations(measure(judged, images, labels, folder))))
    concentration = concentration_links(results)
    write_json(root / "leave_one_out.json", {
        "images": n, "models": [{"name": j.name, "cost": j.cost, "blocks": {str(k): v for k, v in c.items()}}
                                for j, c in results], "concentration": concentration})
    figure(results, concentration, root / "leave_one_out.png")
    return write_text(root / "leave_one_out.md", report(cfg, results, concentration, n))


def concentration_links(results: list[tuple[Judged, dict[int, dict[str, Any]]]]) -> dict[str, Any]:
    """Rank correlations over (model, block) of the attention the block reads (its top token's share, its entropy)
    with routing quality: the attention scores' correlation (the models whose router reads them) and the router's own
    (every model), each with its bootstrap CI over the points."""
    out = {}
    for quality in ("attention", "router"):
        # one point per model and block (the dense model judged at two costs shares its blocks; EVERY_BLOCK's row
        # has no attention statistics)
        unique = {(j.key, b): row for j, rows in results for b, row in rows.items()}
        points = [(row["top_token_share"], row["received_entropy"], row[quality][0])
                  for row in unique.values() if quality in row and "top_token_share" in row]
        if len(points) < 4:
            continue
        share, entropy, rho = map(np.array, zip(*points))
        out[quality] = {"points": len(points), "top_token_share": spearman_ci(share, rho),
                        "received_entropy": spearman_ci(entropy, rho)}
    return out


def _ci(v: Optional[tuple[float, float, float]]) -> str:
    return "–" if v is None else f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"


def report(cfg: FinetuneConfig, results: list[tuple[Judged, dict[int, dict[str, Any]]]],
           concentration: dict[str, Any], n: int) -> str:
    """The leave-one-out report in Markdown: per cost, a table of blocks x models."""
    lines = [f"# Leave-one-out inside the finetuned models (seed 0, {n} test images x every patch token)", "",
             "Mean per-image Spearman ρ between scores and the loss rise when one patch token skips the block (95 % "
             "bootstrap CI over the images). `router`: the model's own router; `attention`: the attention scores the "
             "block reads; `random`: random scores (the null).", ""]
    words = {"router": "the model's own router's scores", "attention": "the attention scores the block reads (where "
             "its router reads them)", "random": "random scores (the null)"}
    for cost in dict.fromkeys(j.cost for j, _ in results):
        at = [(j, rows) for j, rows in results if j.cost == cost]
        blocks = sorted({b for _, rows in at for b in rows if b != EVERY_BLOCK}) + [EVERY_BLOCK]
        lines += [f"## Cost {cost:g}", ""]
        for key, text in words.items():
            having = [(j, rows) for j, rows in at if any(key in r for r in rows.values())]
            lines += [f"ρ of {text}:", "", "| block | " + " | ".join(j.name for j, _ in having) + " |",
                      "|---|" + "---|" * len(having)]
            for b in blocks:
                lines.append(f"| {b} | " + " | ".join(_ci(rows.get(b, {}).get(key)) for _, rows in having) + " |")
            lines.append("")
        lines += ["Attention the block reads (block − 1's): its most-attended token's share / received-attention "
                      "entropy as a share of log N:", "",
                  "| block | " + " | ".join(j.name for j, _ in at) + " |", "|---|" + "---|" * len(at)]
        for b in blocks[:-1]:
            lines.append(f"| {b} | " + " | ".join(
                f"{rows[b]['top_token_share']:.3f} / {rows[b]['received_entropy']:.3f}" if "top_token_share" in
                rows.get(b, {}) else "–" for _, rows in at) + " |")
        lines.append("")
    lines += ["## Attention concentration against routing quality", "",
              "Spearman over (model, block) points, 95 % bootstrap CI over the points:", "",
              "| routing quality | points | vs top token's share | vs received-attention entropy |", "|---|---|---|---|"]
    for quality, link in concentration.items():
        lines.append(f"| {quality} ρ | {link['points']} | {_ci(link['top_token_share'])} | "
                     f"{_ci(link['received_entropy'])} |")
    return "\n".join(lines) + "\n"


def figure(results: list[tuple[Judged, dict[int, dict[str, Any]]]], concentration: dict[str, Any], path: Path) -> Path:
    """Router ρ per block with CIs, one panel per cost, and the attention scores' ρ against the top token's share."""
    from .. import plots  # (matplotlib, set up for files)

    costs = list(dict.fromkeys(j.cost for j, _ in results))
    fig, axes = plots.plt.subplots(1, len(costs) + 1, figsize=(5.5 * (len(costs) + 1), 4.2))
    for ax, cost in zip(axes, costs):
        for i, (j, rows) in enumerate((j, rows) for j, rows in results if j.cost == cost):
            blocks = sorted(b for b in rows if b != EVERY_BLOCK)
            key = "attention" if j.name == DENSE_LOO else "router"
            mean = np.array([rows[b][key][0] for b in blocks])
            err = np.array([[rows[b][key][0] - rows[b][key][1], rows[b][key][2] - rows[b][key][0]] for b in blocks]).T
            ax.errorbar(np.array(blocks) + 0.08 * (i - 2), mean, yerr=err, marker="o", ms=3, capsize=2,
                        label=f"{j.name} ({key})")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(title=f"cost {cost:g}: scores vs skip importance", xlabel="MoD block", ylabel="mean per-image Spearman ρ")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for j, rows in results:
        pts = [(r["top_token_share"], r["attention"][0]) for r in rows.values()
               if "attention" in r and "top_token_share" in r]
        if pts:
            ax.scatter(*zip(*pts), s=12, label=f"{j.name} @ {j.cost:g}")
    ax.set(title="attention read vs its ρ", xlabel="top token's share of block − 1's attention",
           ylabel="attention scores' ρ")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plots.plt.close(fig)
    return path
