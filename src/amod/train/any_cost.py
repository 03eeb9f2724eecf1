"""One finetune for every cost: an MoD or fold model trained at a capacity drawn per step, so that one set of
weights serves the whole capacity dial (``amod.set_capacity``) at inference."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..cost import COST_TOLERANCE, flops
from ..methods import method_of
from ..mod.convert import MoD, capacity_for_cost, set_capacity
from ..errors import UserError

GRID = 12  # costs drawn from, evenly spaced over the range
# What --any-cost needs, said by the run's settings (``RunConfig.validate``) and by the model (``AnyCost``).
NEEDS_MOD = ("--any-cost turns an MoD model's capacity per step: give --router (and --skipped fold for the dial that "
             "serves every cost), or a --checkpoint file that runs MoD")


class AnyCost:
    """The capacities of ``GRID`` costs evenly spaced over [low, high] (shares of dense MACs) of the converted
    ``model``; ``capacity(seed, step)`` draws one from (seed, step) alone, so a resumed run and every DDP process
    draw the same."""

    def __init__(self, model: nn.Module, low: float, high: float) -> None:
        if not 0 < low < high <= 1:
            raise UserError(f"an any-cost range is LOW HIGH with 0 < LOW < HIGH <= 1, got {low} {high}")
        running = method_of(model)
        if not isinstance(running, MoD):
            raise UserError(f"{NEEDS_MOD}; the starting model runs {running.label()}")
        self.own_capacity = running.capacity  # what the run evaluates and saves at
        self.costs = [low + (high - low) * i / (GRID - 1) for i in range(GRID)]
        self.capacities = [capacity_for_cost(model, c) for c in self.costs]
        self.lowest_cost = flops(model, capacity=self.capacities[0]).ratio  # what a draw of LOW runs at

    def check_reachable(self) -> "AnyCost":
        """Refuse a range whose LOW lies below the lowest cost the model reaches (by more than ``COST_TOLERANCE``): every
        cost under that floor would run at the floor, so the dial would train on the floor's cost alone for those
        draws (a fold model has a lowest capacity: ``amod.lowest_capacity``).
        Returns self."""
        low, high = self.costs[0], self.costs[-1]
        if self.lowest_cost > low * (1 + COST_TOLERANCE):
            raise UserError(f"--any-cost {low:g} {high:g}: this model reaches no cost below {self.lowest_cost:.3f} "
                            f"of the dense MACs (capacity {self.capacities[0]:g}, its lowest); give LOW of at least "
                            f"{self.lowest_cost:.3f}")
        return self

    def capacity(self, seed: int, step: int) -> float:
        g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
        return self.capacities[int(torch.randint(len(self.capacities), (1,), generator=g))]

    def restore(self, model: nn.Module) -> None:
        """Set ``model`` back to the run's own capacity (evaluated and saved at it)."""
        set_capacity(model, self.own_capacity)

    def before_step(self, model: nn.Module, seed: int) -> Callable[[int], None]:
        """``engine.train_steps``' ``before_step`` of an any-cost run: set ``model`` to the capacity drawn for
        (``seed``, the steps done)."""
        return lambda step: set_capacity(model, self.capacity(seed, step))
