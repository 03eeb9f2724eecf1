"""One arm of an experiment: a name, a method, and the settings a study gives it. ``amod compare``, ``amod frontier``,
the finetune study (``amod study --checkpoint``) and the routers study (``amod study``) all run lists of arms, and
``--methods`` picks among them by name (``select``), or adds any registered method by its kind or spec
(``amod.methods.parse_method``), the arm named by the text given."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..methods import Method, method_kinds, parse_method
from ..mod.convert import MoD
from ..errors import UserError


@dataclass(frozen=True)
class Arm:
    """One method of an experiment. ``method`` is set to each cost by ``at_cost`` (a method that ``needs_images``
    chooses its setting on unlabeled images given there).

    Finetune study: ``isoflop_of`` names the arm whose MoD setup the isoFLOP baseline matches;
    ``every_block_below`` lets a bypass MoD arm that cannot reach a cost on alternate blocks place MoD on every
    block after the first instead. ``distill``: trained against the study's dense teacher
    (``FinetuneConfig.distillation``). ``any_cost``: one model per seed, trained at a cost drawn per step from this
    range (``amod.train.any_cost``) and evaluated at each study cost. ``steps``: its own schedule length (the long
    runs). ``best_of``: a long run of whichever of these arms has the best mean finetuned accuracy at the cost when
    it starts. ``only_seeds``: run on the first seeds only. ``counterpart``: the arm the report compares it with.
    ``router_lr``: the peak learning rate of its learned router's parameters (``engine.param_groups``; None: the
    study's one rate for every parameter)."""

    name: str
    method: Optional[Method]  # None: set by ``best_of`` when the run is planned
    isoflop_of: Optional[str] = None
    every_block_below: bool = False
    distill: bool = False
    any_cost: Optional[tuple[float, float]] = None
    steps: Optional[int] = None
    best_of: tuple[str, ...] = ()
    only_seeds: Optional[int] = None
    counterpart: Optional[str] = None
    router_lr: Optional[float] = None

    @property
    def needs_images(self) -> bool:
        """Whether the arm's method chooses its setting on unlabeled images (``Method.needs_images``)."""
        return self.method is not None and self.method.needs_images

    def at_cost(self, dense: torch.nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> Method:
        """The method at the cost closest to ``cost`` x the dense model's MACs."""
        return self.method.at_cost(dense, cost, images)


# What A-MoD's attention is worth to fold (amod compare and amod frontier run both): the same schedule and matching
# with nothing protected, and with a random quarter protected.
FOLD_CONTROLS = (
    Arm("fold, nothing protected", MoD(skipped="fold", protect=0.0)),
    Arm("fold, random protected", MoD(router="random", skipped="fold")),
)


def select(arms: tuple[Arm, ...], names: Optional[Iterable[str]], keep: Iterable[str] = ()) -> tuple[Arm, ...]:
    """The arms named in ``names`` (``--methods``) in their usual order, then one arm for each other name that is a
    registered method's kind or spec (``tome:cost=0.5``), named by that text, in the order given; all of ``arms``
    when none is named. ``keep``: arm names always kept, with the arms that any kept arm is compared with or chosen
    from (``counterpart``, ``best_of``). Raises ValueError naming what is allowed."""
    names = list(names or [])
    if not names:
        return arms
    known = [a.name for a in arms]
    extra: list[Arm] = []
    for name in names:
        if name in known or any(a.name == name for a in extra):
            continue
        try:
            extra.append(Arm(name, parse_method(name)))
        except ValueError as e:
            kind = name.partition(":")[0].strip()
            if kind in method_kinds():  # a registered method, badly set: what is wrong with its spec
                raise UserError(f"--methods {name!r}: {e}") from None
            raise UserError(f"unknown method {name!r} for --methods; choose from {', '.join(map(repr, known))}, or a "
                            f"registered method ({', '.join(method_kinds())}) or its spec, e.g. "
                            "'tome:cost=0.5'") from None
    wanted = set(names) | set(keep)
    while True:  # and what the named arms are compared with or chosen from
        more = {n for a in arms if a.name in wanted for n in (a.counterpart, *a.best_of) if n} - wanted
        if not more:
            break
        wanted |= more
    return tuple(a for a in arms if a.name in wanted) + tuple(extra)


def refuse_own_costs(arms: Iterable[Arm], command: str, costs: Iterable[float]) -> None:
    """Refuse, in one line, a method given with a setting of its own for a cost (its ``cost``, or a field its
    ``at_cost`` sets: ``ppt:cost=0.3``, ``tome:r=8``, ``mod:capacity=0.5``; ``Method.given_setting``) in amod
    ``command``, which sets every method to each of its ``--cost`` values (``Arm.at_cost``): the spec's setting would
    be replaced without a word, and its row show it beside the cost that ran. The one check of compare, frontier,
    dense-frontier and the finetune study. Raises UserError."""
    for arm in arms:
        own = [] if arm.method is None else arm.method.given_setting()  # (None: the dense arm)
        if own:
            each = " ".join(f"{c:g}" for c in costs)
            names = " and ".join(f"{o.partition('=')[0]}=" for o in own)
            raise UserError(f"--methods {arm.name!r} gives the method its own setting ({', '.join(own)}), and amod "
                            f"{command} sets every method to each --cost ({each}): drop {names} from the spec, and "
                            "give the cost with --cost")
