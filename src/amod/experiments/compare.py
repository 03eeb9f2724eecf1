"""`amod compare`: Mixture-of-Depths against token merging (ToMe) at matched cost, on one model.

For each cost point (a share of the dense model's MACs) every method is set to the cost it can match
most closely: MoD methods by their capacity, ToMe by its merge schedule. Two protocols:

- a model with a classifier for the data (e.g. the demo's): each method is measured with zero
  training (the dense model's own weights and head) and after one short, equal finetune. Every run
  is a normal run directory, reused when finished and resumed when killed.
- a backbone without one (``num_classes=0``, e.g. DINOv2): a linear probe is fitted once on the
  dense model's frozen features (CLS after the final norm) of a training subset, its L2 penalty
  chosen on a held-out part of it, and every reduced model is measured with that same probe (zero
  training), with the mean cosine of its features to the dense ones. The dense features are cached,
  and so is each finished (cost, method) measurement: a killed comparison resumes where it stopped.

A Hugging Face model (``--checkpoint`` a ``save_pretrained`` directory or ``hf:ID``) is compared with the probe
protocol, classifier or not: its features are the CLS token of ``last_hidden_state`` (after the final norm).

Then all models are timed (images/s, interleaved in one process), and ``compare.md``,
``compare.json`` and ``compare.png`` are written.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..cost import flops, misses_cost, tolerance_text, validate_cost
from ..family import family_of
from ..files import write_json, write_text
from ..hf.loading import hf_source
from ..methods import cost_of, Method
from ..mod.convert import MoD
from ..shorthand import setting_text_of
from ..tome.merging import TokenMerging
from ..train import engine
from ..checkpoint import load, load_weightless, open_model
from ..train.data import DataInfo, build_datasets
from ..arch import set_input_size
from ..train.models import fit_to_data
from ..train.config import RunConfig
from ..train.rundir import check_output_dir, run_dir_name
from .arms import FOLD_CONTROLS, Arm, refuse_own_costs, select
from ..tools.bench import IMPLAUSIBLE_NOTE, speedup_text, time_models, warn_implausible
from .plots import accuracy_vs_cost_panels
from .presets import BASE, QUICK, check_settings, demo_skeleton, run_in_directory, run_once, starting_checkpoint
from .features import dense_features, dense_probe, feature_model, features_key, finished_probe_rows
from .probe import features, mean_cosine, probe_images
from ..errors import UserError
from ..flags import flag, positive_int

log = logging.getLogger("amod")


# The methods `amod compare` runs, in the report's order (``--methods`` picks some by name).
COMPARED = (
    Arm("ToMe", TokenMerging()),
    Arm("A-MoD", MoD()),
    Arm("standard MoD", MoD(router="standard")),
    Arm("A-MoD kv", MoD(skipped="kv")),
    Arm("A-MoD merge", MoD(skipped="merge")),
    Arm("A-MoD merge, last 2/3", MoD(skipped="merge", layers="last-two-thirds")),
    Arm("A-MoD fold", MoD(skipped="fold")),
    *FOLD_CONTROLS,  # what is left of A-MoD fold's lead over them is the attention's doing
)


@dataclass
class CompareConfig:
    # (each field's comment is its flag's help: amod.flags)
    out: str = "runs/compare"
    checkpoint: Optional[str] = None  # dense model (default: amod demo --toy's small ViT, pretrained in OUT/pretrain if
                                      # missing), or a Hugging Face model (directory or hf:ID; probe protocol)
    data: str = "fashion-mnist"
    costs: tuple[float, ...] = flag((0.56, 0.75), flag="cost")  # cost points, shares of dense MACs
    img_size: Optional[int] = flag(None, type=positive_int)  # input size of a backbone without classifier (probe
                                                             # protocol); default the model's own
    epochs: int = flag(1, type=positive_int)  # the short finetune, equal for every method (classifier protocol)
    train_limit: Optional[int] = flag(10000, type=positive_int)  # finetuning images (classifier protocol)
    probe_train: int = flag(3000, type=positive_int)  # training images the linear probe is fitted on (backbone without
                                                      # classifier)
    val_limit: Optional[int] = flag(None, type=positive_int)
    lr: float = 5e-4
    batch_size: int = flag(128, flag=None)
    speed_batch: int = flag(256, type=positive_int)
    speed_repeats: int = flag(10, type=positive_int)
    methods: tuple[Arm, ...] = flag(COMPARED, flag=None)
    quick: bool = False  # a tiny version (for tests)

    def only(self, names: Optional[list[str]]) -> "CompareConfig":
        """The same comparison restricted to the named methods (``Arm.name``), in their usual order, and any
        registered method named by its kind or spec (``arms.select``)."""
        return dataclasses.replace(self, methods=select(self.methods, names))

    def as_quick(self) -> "CompareConfig":
        """The same comparison in seconds (for tests): the demo's quick model and data, one epoch."""
        return dataclasses.replace(self, epochs=1, train_limit=QUICK["train_limit"], val_limit=QUICK["val_limit"],
                                   probe_train=min(self.probe_train, QUICK["train_limit"]), speed_batch=32,
                                   speed_repeats=2, quick=True)

    def validate(self) -> "CompareConfig":
        """Check every setting before the first run starts; raises ValueError naming the setting."""
        if not self.costs:
            raise UserError("give at least one --cost")
        for cost in self.costs:
            validate_cost(cost, "--cost")
        refuse_own_costs(self.methods, "compare", self.costs)
        calibrated = [a.name for a in self.methods if a.needs_images]
        if calibrated:
            raise UserError(f"--methods {calibrated[0]!r} chooses its setting on unlabeled images, which amod compare "
                            "does not take: run it in amod frontier or amod study")
        hf = hf_source(self.checkpoint) is not None  # (check_settings reads amod files: check_inputs checks HF ones)
        check_settings(dataclasses.replace(self, checkpoint=None) if hf else self,
                       ("epochs", "batch_size", "speed_batch", "speed_repeats", "probe_train"),
                       ("train_limit", "val_limit", "img_size"))
        return self


def run_compare(cfg: CompareConfig) -> Path:
    """Run every (cost, method) pair (reusing finished runs), time them, and write the report (``cfg.quick``: its
    tiny version, ``as_quick``)."""
    cfg = cfg.as_quick() if cfg.quick else cfg
    cfg.validate()
    check_output_dir(cfg.out)
    native = check_inputs(cfg)  # (silent: a refused command says one line; on a terminal, a progress bar)
    return run_in_directory(cfg.out, cfg.data, lambda root: _run_compare(cfg, root, native.img_size))


def check_inputs(cfg: CompareConfig) -> DataInfo:
    """Refuse, before any work, images the model cannot be compared on; raises ValueError saying why.
    Returns what the data is at its own size.

    A model with a classifier is compared on the data it was trained for, at its own input size
    (its head and the finetunes take that data as it is); a backbone without one (probe protocol) is
    resampled to ``--img-size``, which must be a multiple of its patch size, and its linear probe needs enough
    training images (``probe_images``). A model amod does not train (its family is not ``trainable``: a Hugging Face
    folder, ``hf:ID`` or ``amod.save`` file of one) is compared by the probe protocol at its own input size and
    channels. Every method must come near every ``--cost`` on the model at that size (``check_costs_reachable``).
    """
    train, _, info = build_datasets(cfg.data, None, None, None)
    if cfg.checkpoint is None:  # the demo's model, pretrained on this data at the data's own size
        if cfg.img_size is not None and cfg.img_size != info.img_size:
            raise UserError(f"--img-size {cfg.img_size}: the demo's model has a classifier and is compared at its own "
                            f"input size, {info.img_size} px ({info.name}); --img-size is for a backbone without "
                            "classifier (probe protocol)")
        check_costs_reachable(cfg, demo_skeleton(cfg.data, cfg.quick, info))
        return info
    # the model without its weights (an amod file), or as loaded (a Hugging Face folder or hf:ID)
    model = open_model(cfg.checkpoint) if hf_source(cfg.checkpoint) is not None else load_weightless(cfg.checkpoint)
    family = family_of(model)
    h, w = model.patch_embed.img_size
    ph, pw = model.patch_embed.patch_size
    chans = model.patch_embed.proj.in_channels
    if not family.trainable:  # (a Hugging Face model) the probe protocol, at its own input size and channels
        if cfg.img_size is not None and cfg.img_size != h:
            raise UserError(f"--img-size {cfg.img_size}: {cfg.checkpoint} is a {family.models} model of {h}-px "
                            "images (its config's image_size); drop --img-size")
        if chans != info.in_chans:
            raise UserError(f"{cfg.checkpoint} takes {chans}-channel images and {cfg.data} has {info.in_chans} "
                            "channels")
        probe_images(len(train), cfg.probe_train, cfg.data)
        check_costs_reachable(cfg, model)
        return info
    classes = family.num_classes(model)
    if classes == 0:
        if cfg.img_size is not None and (cfg.img_size % ph or cfg.img_size % pw):
            raise UserError(f"--img-size {cfg.img_size} is not a multiple of the patch size {ph}x{pw} of "
                            f"{cfg.checkpoint}")
        probe_images(len(train), cfg.probe_train, cfg.data)
        check_costs_reachable(cfg, set_input_size(model, cfg.img_size) if cfg.img_size else model)
        return info
    if cfg.img_size is not None and (cfg.img_size, cfg.img_size) != (h, w):
        raise UserError(f"--img-size {cfg.img_size}: {cfg.checkpoint} has a classifier and is compared at its own "
                        f"input size, {h}x{w} px; --img-size is for a backbone without classifier (probe protocol)")
    if info.in_chans != chans:
        raise UserError(f"{cfg.checkpoint} takes {chans}-channel images and {cfg.data} has {info.in_chans} "
                        "channels: a model with a classifier is compared on the data it was trained for")
    if info.num_classes > classes:
        raise UserError(f"{cfg.data} has {info.num_classes} classes and the classifier of {cfg.checkpoint} "
                        f"{classes}: a model with a classifier is compared on the data it was trained for")
    check_costs_reachable(cfg, model)
    return info


def check_costs_reachable(cfg: Any, model: nn.Module) -> None:
    """Refuse, before any work, a ``--cost`` that a method of ``cfg.methods`` cannot come near on ``model`` (at the size
    it runs at; a weightless model on the meta device will do): ``Method.at_cost`` raises where the closest setting is
    too far off, e.g. token merging on a model with few tokens. A method that chooses its setting on images takes its
    closest."""
    settings = [(cost, arm) for cost in cfg.costs for arm in cfg.methods if not arm.needs_images]
    for cost, arm in engine.progress_bar(settings, len(settings), "checking every method at each cost"):
        try:
            arm.at_cost(model, cost)
        except ValueError as e:
            raise UserError(f"--cost {cost:g} ({arm.name}): {e}") from None


def _run_compare(cfg: CompareConfig, root: Path, native_size: int) -> Path:
    pretrained = starting_checkpoint(cfg, root)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log.info("loading the dense model %s and %s", pretrained, cfg.data)
    dense = open_model(pretrained, device)
    family = family_of(dense)
    img_size = cfg.img_size or dense.patch_embed.img_size[0]
    # a model amod does not train (a Hugging Face one) is compared by the probe protocol, as a backbone is
    probe_mode = not family.trainable or family.num_classes(dense) == 0
    train, val, info = build_datasets(cfg.data, img_size, cfg.probe_train if probe_mode else None, cfg.val_limit)
    fit_to_data(dense, info.in_chans, img_size)  # (nothing to do for a model check_inputs found at its own size)
    if probe_mode:
        rows, dense_acc = _probe_rows(cfg, root, dense, pretrained, train, val, device)
    else:
        # the finetunes see the data at the model's size (as the dense model does), not at the data's own
        run_size = None if img_size == native_size else img_size
        rows, dense_acc = _finetune_rows(cfg, root, dense, pretrained, val, device, run_size)
    log.info("timing %d models interleaved (batch %d)", len(rows) + 1, cfg.speed_batch)
    models = {"dense": dense, **{_key(r): _rebuild(dense, r, device) for r in rows}}
    x = torch.randn(cfg.speed_batch, dense.patch_embed.proj.in_channels, *dense.patch_embed.img_size,
                    generator=torch.Generator().manual_seed(0)).to(device)
    timed = time_models(models, x, repeats=cfg.speed_repeats, warmup=2)
    dense_ips = timed["dense"]["images_per_s"]
    for r in rows:
        t = timed[_key(r)]
        r["images_per_s"] = t["images_per_s"]
        r["speedup"] = t["images_per_s"] / dense_ips
        r["flop_bound_efficiency"] = r["speedup"] * r["cost"]  # measured speed-up / (1 / cost)
    return write_report(root, cfg, pretrained, info.name, len(val), img_size, dense_acc, dense_ips, rows, probe_mode)


def _key(row: dict[str, Any]) -> str:
    return f"{row['method']} @ {row['cost_target']:g}"


def _rebuild(dense: torch.nn.Module, row: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The model a row measured: its finetuned weights, or (probe protocol) the dense ones set up again."""
    if row.get("run"):
        return load(Path(row["run"]) / "model.safetensors", device)
    return row["method_obj"].apply(copy.deepcopy(dense)).eval()


def _finetune_rows(cfg: CompareConfig, root: Path, dense: torch.nn.Module, pretrained: Path, val,
                   device: torch.device, img_size: Optional[int] = None) -> tuple[list[dict[str, Any]], float]:
    """Zero-training and finetuned accuracy of every (cost, method): one run directory each."""
    loader = engine.make_loader(val, 256, False, 0, 0, engine.Dist())
    dense_acc = engine.evaluate(dense, loader, device, progress=False)["top1"]
    log.info("dense model %s: val top-1 %.4f on %d images", pretrained, dense_acc, len(val))
    rows: list[dict[str, Any]] = []
    for done, total, cost, entry, method in _grid(cfg, dense):
        ratio = cost_of(method, dense)
        out = root / f"cost{cost:g}" / run_dir_name(entry.name)
        log.info("[%d/%d] %s at cost %g (matched: %.3f of dense)", done, total, entry.name, cost, ratio)
        run_cfg = RunConfig(model=BASE["model"], checkpoint=str(pretrained), data=cfg.data, method_spec=method.spec(),
                            epochs=cfg.epochs, lr=cfg.lr, batch_size=cfg.batch_size, warmup_epochs=0.2,
                            train_limit=cfg.train_limit, val_limit=cfg.val_limit, eval_before_training=True,
                            img_size=img_size, out=str(out))
        run_once(run_cfg)
        metrics = engine.read_metrics(out / "metrics.jsonl")
        rows.append({"method": entry.name, "cost_target": cost, "cost": ratio, "zero_top1": metrics[0]["val_top1"],
                     "top1": metrics[-1]["val_top1"], "setting": method.spec(), "run": str(out)})
    return rows, dense_acc


def _grid(cfg: CompareConfig, dense: torch.nn.Module) -> Iterator[tuple[int, int, float, Arm, Method]]:
    """Every (cost, method) pair in report order, numbered from 1: (number, total, cost, entry, method at cost)."""
    total = len(cfg.costs) * len(cfg.methods)
    pairs = ((cost, entry) for cost in cfg.costs for entry in cfg.methods)
    for done, (cost, entry) in enumerate(pairs, start=1):
        yield done, total, cost, entry, entry.at_cost(dense, cost)


def _probe_rows(cfg: CompareConfig, root: Path, dense: torch.nn.Module, pretrained: Path, train, val,
                device: torch.device) -> tuple[list[dict[str, Any]], float]:
    """Zero-training probe accuracy and feature cosine of every (cost, method)."""
    key = features_key(cfg.data, dense, pretrained, train, val)
    cached = dense_features(root, key, dense, train, val, device)
    probe = dense_probe(root, key, cached)
    dense_acc = probe.accuracy(cached["test"], cached["test_labels"])
    log.info("dense model %s at %d px: probe top-1 %.4f on %d test images (probe fitted on %d, L2 %g)", pretrained,
             dense.patch_embed.img_size[0], dense_acc, len(val), len(train), probe.l2)
    loader = engine.make_loader(val, 128, False, 0, 0, engine.Dist(device=device))
    # one measurement per line, appended as each finishes: a killed comparison resumes after the last one
    done_path = root / f"probe_rows_{key}_{probe.l2:g}.jsonl"
    finished = finished_probe_rows(done_path)
    rows: list[dict[str, Any]] = []
    for done, total, cost, entry, method in _grid(cfg, dense):
        measured = finished.get((entry.name, cost, repr(method)))
        if measured is None:
            model = method.apply(copy.deepcopy(dense)).eval()
            feats, labels = features(feature_model(model), engine.image_batches(loader), device)
            measured = {"method": entry.name, "cost_target": cost, "method_repr": repr(method),
                        "cost": flops(model).ratio, "zero_top1": probe.accuracy(feats, labels),
                        "cosine": mean_cosine(feats, cached["test"])}
            finished.add(measured)
            how = ""
        else:
            how = " (measured before)"
        row = {"method": entry.name, "method_obj": method, "cost_target": cost, "cost": measured["cost"],
               "zero_top1": measured["zero_top1"], "top1": None, "cosine": measured["cosine"],
               "setting": method.spec(), "run": None}
        log.info("[%d/%d] %s at cost %g (matched %.3f): probe top-1 %.4f, cosine to dense %.4f%s", done, total,
                 entry.name, cost, row["cost"], row["zero_top1"], row["cosine"], how)
        rows.append(row)
    return rows, dense_acc




def write_report(root: Path, cfg: CompareConfig, pretrained: Path, data_name: str, n_val: int, img_size: int,
                 dense_acc: float, dense_ips: float, rows: list[dict[str, Any]], probe_mode: bool) -> Path:
    speed = (f"Speed: batch {cfg.speed_batch}, all models interleaved in one process, median of {cfg.speed_repeats}; "
             "efficiency = measured speed-up / FLOP-bound speed-up (1 / cost).")
    if probe_mode:
        head = (f"Dense backbone `{pretrained}` at {img_size} px: linear-probe top-1 **{100 * dense_acc:.2f} %** on "
                f"{n_val} test images (probe fitted on the dense features of {cfg.probe_train} training images, L2 "
                f"chosen on a held-out fifth; applied unchanged to every reduced model), {dense_ips:.1f} images/s. "
                "Zero training: every model has the dense weights.")
        columns = "| cost target | method | setting | cost vs dense | probe top-1 | cosine to dense | images/s | speed-up | efficiency |"
    else:
        head = (f"Dense model `{pretrained}`: val top-1 **{100 * dense_acc:.2f} %** on {n_val} images, "
                f"{dense_ips:.0f} images/s. Finetune: {cfg.epochs} epoch(s) on {cfg.train_limit or 'all'} training "
                f"images, lr {cfg.lr:g}, the same for every method.")
        columns = "| cost target | method | setting | cost vs dense | zero-training top-1 | finetuned top-1 | images/s | speed-up | efficiency |"
    flagged = warn_implausible([(_key(r), r["speedup"], r["cost"]) for r in rows])
    lines = [f"# amod compare: MoD vs token merging at matched cost on {data_name}" + (" (quick)" if cfg.quick else ""),
             "", f"{head} {speed}", "", columns, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        miss = " (!)" if misses_cost(r["cost"], r["cost_target"]) else ""
        second = f"{r['cosine']:.4f}" if probe_mode else f"{100 * r['top1']:.2f}"
        lines.append(f"| {r['cost_target']:g} | {r['method']} | {setting_text_of(r['setting'])} | {r['cost']:.3f}{miss} | "
                     f"{100 * r['zero_top1']:.2f} | {second} | {r['images_per_s']:.1f} | "
                     f"{speedup_text(r['speedup'], r['cost'])} | {r['flop_bound_efficiency']:.2f} |")
    lines.append("")
    if flagged:
        lines += [IMPLAUSIBLE_NOTE + ".", ""]
    if any(misses_cost(r["cost"], r["cost_target"]) for r in rows):
        lines += [f"(!) the method cannot reach the target cost within {tolerance_text()} on this model; its closest "
                  "cost is shown.", ""]
    zero: dict[str, list[tuple[float, float]]] = {}
    final: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        zero.setdefault(r["method"], [(1.0, dense_acc)]).append((r["cost"], r["zero_top1"]))
        if not probe_mode:
            final.setdefault(r["method"], [(1.0, dense_acc)]).append((r["cost"], r["top1"]))
    panels = {f"zero training, linear probe ({img_size} px)" if probe_mode else
              "zero training (the dense model's weights)": zero}
    if not probe_mode:
        panels[f"after a {cfg.epochs}-epoch finetune"] = final
    png = accuracy_vs_cost_panels(panels, root / "compare.png")
    lines += [f"![accuracy vs cost]({png.name})", ""]
    report = root / "compare.md"
    write_text(report, "\n".join(lines))
    write_json(root / "compare.json",
               {"protocol": "probe" if probe_mode else "finetune", "img_size": img_size,
                "dense": {"top1": dense_acc, "images_per_s": dense_ips, "checkpoint": str(pretrained)},
                "rows": [{k: v for k, v in r.items() if k != "method_obj"} | {"implausible_speedup": _key(r) in flagged}
                         for r in rows]})
    print("\n".join(lines[4:4 + 2 + len(rows)] + ([IMPLAUSIBLE_NOTE + "."] if flagged else [])))
    log.info("report written to %s", report)
    return report
