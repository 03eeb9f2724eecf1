"""One finetune for every cost: an MoD or fold model trained at a capacity drawn per step, so that one set of
weights serves the whole capacity dial (``amod.set_capacity``) at inference."""
from __future__ import annotations

import torch
from torch import nn

from ..mod.convert import capacity_for_cost

GRID = 12  # costs drawn from, evenly spaced over the range


class AnyCost:
    """The capacities of ``GRID`` costs evenly spaced over [low, high] (shares of dense MACs) of the converted
    ``model``; ``capacity(seed, step)`` draws one from (seed, step) alone, so a resumed run and every DDP process
    draw the same."""

    def __init__(self, model: nn.Module, low: float, high: float) -> None:
        if not 0 < low < high <= 1:
            raise ValueError(f"an any-cost range is LOW HIGH with 0 < LOW < HIGH <= 1, got {low} {high}")
        self.costs = [low + (high - low) * i / (GRID - 1) for i in range(GRID)]
        self.capacities = [capacity_for_cost(model, c) for c in self.costs]

    def capacity(self, seed: int, step: int) -> float:
        g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
        return self.capacities[int(torch.randint(len(self.capacities), (1,), generator=g))]
