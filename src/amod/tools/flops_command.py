"""`amod flops`: the analytic cost of timm ViTs (or Hugging Face ones: a ``save_pretrained`` directory or
``hf:ID``), dense, as MoD at several capacities, and with token merging."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Callable, Optional, Sequence

import timm
import torch
from torch import nn

from ..cost import CostReport, flops, img_size_of
from ..checkpoint import open_model
from ..hf.loading import hf_source
from ..methods import Dense, Method, method_of
from ..tome.merging import TokenMerging
from ..mod.config import validate_capacity
from ..mod.convert import MoD, lowest_capacity
from ..mod.modes import skipped_mode
from ..mod.routers import router_class
from ..tome import schedule_for_cost
from ..train.models import check_vit_name
from .bench import dense_twin
from ..errors import UserError


def flops_methods(capacities: Sequence[float], mod: MoD = MoD(),
                  tome_costs: Sequence[float] = ()) -> list[tuple[str, Method]]:
    """(label, method) of every row: ``mod`` at each capacity (dense at 1.0, unless its router has weights that
    the dense model lacks), then token merging matched to each cost."""
    rows: list[tuple[str, Method]] = []
    for c in capacities:
        c = validate_capacity(c)
        dense = c >= 1.0 and not router_class(mod.router).learnable
        rows.append((f"{c:.3f}", Dense() if dense else dataclasses.replace(mod, capacity=c)))
    rows += [(f"ToMe@{c:g}", TokenMerging(cost=c)) for c in tome_costs]
    return rows


def dense_models(models: Sequence[str]) -> list[tuple[str, Callable[[], nn.Module], Optional[nn.Module]]]:
    """(name, a function making a fresh dense copy, the model as saved where it runs a method) of every model,
    checked before any is priced: a timm name (made on the ``meta`` device: costs need shapes only), or a Hugging
    Face model (loaded once; a converted ``save_pretrained`` folder's dense copies are of its architecture)."""
    makers = []
    for name in models:
        source = hf_source(name)
        if source is not None:
            hf_model = open_model(name)
            if isinstance(method_of(hf_model), Dense):
                makers.append((name, lambda m=hf_model: copy.deepcopy(m), None))
            else:
                makers.append((name, lambda m=hf_model: dense_twin(m), hf_model))
            continue
        if name not in timm.list_models():
            raise UserError(f"unknown timm model {name!r} (a Hugging Face model: its save_pretrained directory, "
                            "with config.json, or hf:ID)")
        check_vit_name(name)
        makers.append((name, lambda n=name: open_model(n, timm_names=True), None))
    return makers


SAVED = "saved"  # the label of a converted model's row: the model as it was saved


def flops_table(models: Sequence[str], methods: Sequence[tuple[str, Method]],
                img_size: Optional[int] = None) -> list[tuple[str, str, CostReport]]:
    """(model, label, cost) for every model and method; costs need shapes only, so no weights are made (but a
    Hugging Face model's, loaded from its directory or the hub). A converted model (a ``save_pretrained`` folder)
    gets a first row, ``SAVED``: itself as saved; its other rows price its dense architecture."""
    rows = []
    for name, make, saved in dense_models(models):
        if saved is not None:
            rows.append((name, SAVED, flops(saved, img_size)))
        with torch.device("meta"):  # what every row is a share of (an isoFLOP row's own model has fewer blocks)
            dense_macs = flops(make(), img_size).macs
        for label, method in methods:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a fold capacity below its floor: floor_notes says so, at this size
                model = make()
                if isinstance(method, TokenMerging) and method.cost is not None:  # matched at the table's size
                    model = TokenMerging(r=tuple(schedule_for_cost(model, method.cost, img_size))).apply(model)
                else:
                    model = method.apply(model)
            rows.append((name, label, dataclasses.replace(flops(model, img_size), dense_macs=dense_macs)))
    return rows


def floor_notes(models: Sequence[str], methods: Sequence[tuple[str, Method]], img_size: Optional[int] = None
                ) -> list[str]:
    """One line per model whose fold rows ask for less than the lowest capacity it reaches
    (``amod.lowest_capacity``): those rows cost what that capacity costs."""
    folds = [m for _, m in methods if isinstance(m, MoD) and m.skipped == "fold"]
    notes = []
    for name, make, _ in dense_models(models) if folds else ():
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = folds[0].apply(make())
        lowest = lowest_capacity(model, img_size)  # the same for every fold row: they differ in capacity only
        below = [m.capacity for m in folds if m.capacity < lowest]
        if below:
            h, w = img_size_of(model, img_size)
            notes.append(f"note: {name} at {h}x{w}: skipped=fold reaches no capacity below {lowest:.3f} (a fold block "
                         f"removes at most about half of its patch tokens, less the share its router "
                         f"protects); capacity {', '.join(f'{c:.3f}' for c in below)} "
                         f"cost{'s' if len(below) == 1 else ''} what {lowest:.3f} costs")
    return notes


def saved_notes(rows: Sequence[tuple[str, str, CostReport]]) -> list[str]:
    """One line per converted model of ``flops_table``'s rows (a ``save_pretrained`` folder of a converted model):
    its ``SAVED`` row prices it as saved, its other rows its dense architecture."""
    return [f"note: {name} is a converted model: the {SAVED!r} row prices it as saved, the others its dense "
            "architecture at these settings" for name, label, _ in rows if label == SAVED]


FLOPS_COLUMNS = ("model", "img", "capacity", "GMACs", "GFLOPs", "vs dense", "ideal x")


def format_flops_table(rows: Sequence[tuple[str, str, CostReport]]) -> list[str]:
    """The table's lines: each column as wide as its widest cell (a long model name or method spec included), two
    spaces between columns, the model names left-aligned and the numbers right-aligned."""
    cells = [FLOPS_COLUMNS] + [(name, f"{r.img_size[0]}x{r.img_size[1]}", label, f"{r.gmacs:.3f}",
                                f"{r.flops / 1e9:.3f}", f"{r.ratio:.3f}", f"{1 / r.ratio:.2f}")
                               for name, label, r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(FLOPS_COLUMNS))]
    return ["  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])
            for row in cells]


def flops_report(models: Sequence[str], capacities: Sequence[float], mod: MoD, tome_costs: Sequence[float] = (),
                 methods: Sequence[tuple[str, Method]] = (), img_size: Optional[int] = None) -> str:
    """``amod flops``: the table of ``models`` at ``mod``'s capacities, token merging at ``tome_costs`` and
    ``methods`` (label, method), its MoD setup first and its notes after (checked before any line is written)."""
    methods = flops_methods(capacities, mod, tome_costs) + list(methods)
    rows = flops_table(models, methods, img_size)
    layers = mod.layers or skipped_mode(mod.skipped).default_layers
    layers = list(layers) if isinstance(layers, tuple) else layers
    return "\n".join([f"router={mod.router} layers={layers}" + ("" if mod.skipped == "bypass" else
                                                                f" skipped={mod.skipped}"),
                      *format_flops_table(rows), *saved_notes(rows), *floor_notes(models, methods, img_size)])
