"""How many operations a forward dispatches: the overhead that token reduction adds, measured without a GPU.

On a GPU a small ViT's forward is a few milliseconds and every extra operation costs a launch (and, in eager
PyTorch, its Python and dispatcher time) as large as real work; on the CPU at batch 1 the same per-operation cost
shows in the latency. ``count_ops(model, x)`` runs one forward under a ``TorchDispatchMode`` and counts the ATen
operations that reach it (after autograd and the composite ops' decompositions: what a backend runs), in all and
per block, and how many of them are views (which move no data and launch no kernel).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def _is_view(func: Any) -> bool:
    """Whether an ATen overload returns a view of its input (no data moved, no kernel on a GPU)."""
    schema = getattr(func, "_schema", None)
    return bool(schema and schema.returns and any(r.alias_info is not None and not r.alias_info.is_write
                                                  for r in schema.returns))


@dataclass
class OpCount:
    """Operations one forward dispatched."""

    total: int = 0  # every ATen operation
    views: int = 0  # of them, views (view, transpose, slice, expand, ...)
    by_op: Counter = field(default_factory=Counter)  # overload packet name -> count
    per_block: list[int] = field(default_factory=list)  # operations dispatched inside each block, in order

    @property
    def compute(self) -> int:
        """Operations that are not views: on a GPU, the kernels launched."""
        return self.total - self.views

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "views": self.views, "compute": self.compute, "per_block": self.per_block,
                "by_op": dict(self.by_op.most_common())}


class _Counter(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count
        self.block: Optional[int] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count.total += 1
        self.count.views += _is_view(func)
        self.count.by_op[func.overloadpacket.__name__] += 1
        if self.block is not None:
            self.count.per_block[self.block] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def count_ops(model: nn.Module, x: torch.Tensor, blocks: Optional[list[nn.Module]] = None) -> OpCount:
    """The operations one inference forward of ``model`` on ``x`` dispatches (``model.blocks``, or ``blocks``, are
    counted one by one as well). The forward runs once, outside any other dispatch mode; ``model`` stays as it was."""
    blocks = list(getattr(model, "blocks", []) if blocks is None else blocks)
    count = OpCount(per_block=[0] * len(blocks))
    mode = _Counter(count)
    hooks = []
    for i, blk in enumerate(blocks):
        hooks.append(blk.register_forward_pre_hook(lambda m, a, i=i: setattr(mode, "block", i)))
        hooks.append(blk.register_forward_hook(lambda m, a, o: setattr(mode, "block", None)))
    try:
        with mode:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return count
