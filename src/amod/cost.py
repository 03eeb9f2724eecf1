"""Analytic cost of a timm ViT, dense or reduced, and a FLOP counter to check it against.

MACs are multiply-accumulates per image, counted the way timm's published figures are: the matrix
products (patch embedding, qkv, attention QK^T and AV, projection, MLP, head). Norms, softmax and
activations are left out. FLOPs = 2 x MACs.

A block that changes the work (an MoD block, a fold block, a token-merging block) prices itself: it
has a method ``amod_price(tokens, num_prefix, capacity=None) -> BlockPrice``; the model's family prices the rest
(``amod.families``: ``vit_flops`` for the ViT pattern). This module knows no reduction and no family, so every
reduction and family can import its pricing helpers without a cycle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, TypeVar, Union

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .family import family_of
from .errors import UserError

ImgSize = Optional[Union[int, Sequence[int]]]


class BlockPrice(NamedTuple):
    """What a block costs for one image: its MACs, the tokens its attention runs on, the tokens it hands on."""

    macs: int
    tokens: int
    tokens_after: int


@dataclass
class BlockCost:
    index: int
    tokens: int  # tokens the block's attention runs on: N dense, p + k in an MoD block, fewer after merges
    macs: int


class MacsRatios:
    """``flops``, ``gmacs`` and ``ratio`` of a report that has ``macs`` and ``dense_macs``."""

    macs: int
    dense_macs: int

    @property
    def flops(self) -> int:
        return 2 * self.macs

    @property
    def gmacs(self) -> float:
        return self.macs / 1e9

    @property
    def ratio(self) -> float:
        """Cost relative to dense; 1 / ratio is the ideal (FLOP-bound) speed-up."""
        return self.macs / self.dense_macs


@dataclass
class CostReport(MacsRatios):
    """Per-image cost of a model at one input size."""

    img_size: tuple[int, int]
    num_tokens: int  # N = prefix + patch tokens
    macs: int
    dense_macs: int  # the same model with every block dense and no scoring overhead
    embed_macs: int
    head_macs: int
    blocks: list[BlockCost] = field(default_factory=list)


COST_TOLERANCE = 0.02  # a method set "to a cost" must come this close to it (relative), or it is refused


def misses_cost(cost: float, target: float) -> bool:
    """Whether ``cost`` (a method's share of the dense MACs) lies further from ``target`` than ``COST_TOLERANCE``."""
    return abs(cost - target) / target > COST_TOLERANCE


COST_DIGITS = 6  # cost targets equal to this many decimals are one cost point (0.4 given, 0.4 computed elsewhere)


def same_cost(a: float, b: float) -> bool:
    """Whether two cost targets (shares of the dense MACs) name the same cost point (``COST_DIGITS``)."""
    return round(float(a), COST_DIGITS) == round(float(b), COST_DIGITS)


def tolerance_text() -> str:
    """``COST_TOLERANCE`` as the reports write it (``2 %``): their words and their check read the one value."""
    return f"{100 * COST_TOLERANCE:g} %"


def validate_cost(cost: Any, name: str = "cost") -> float:
    """Return ``cost`` (a share of the dense model's MACs) as a float in (0, 1], or raise a ValueError."""
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or math.isnan(cost) or not 0.0 < cost <= 1.0:
        raise UserError(f"{name} must be a number in (0, 1] (a share of the dense model's MACs), got {cost!r}")
    return float(cost)



# ---------------------------------------------------------------- the setting for a cost (every method's search)

Setting = TypeVar("Setting")


def closest_setting(cost: float, candidates: Iterable[Setting], ratio: Callable[[Setting], float],
                    tolerance: Optional[float] = None, missed: Optional[Callable[[Setting, float], str]] = None
                    ) -> tuple[Setting, float]:
    """The candidate whose cost ``ratio(candidate)`` (a share of the dense MACs) is closest to ``cost``, and that
    ratio; of equally close ones, the first. The one search behind every method's setting for a cost
    (``Method.at_cost`` through ``capacity_for_cost``, ``tome.schedule_for_cost``, ``pitome.keep_for_cost``,
    ``ppt.r_for_cost``): each gives its candidates, in the order that breaks its ties, and its price. With a
    ``tolerance`` (relative) and the words of a refusal ``missed(candidate, ratio)``, a closest candidate that misses
    ``cost`` by more is refused with a UserError of those words."""
    best: Optional[tuple[Setting, float]] = None
    for candidate in candidates:
        r = ratio(candidate)
        if best is None or abs(r - cost) < abs(best[1] - cost):
            best = (candidate, r)
    if best is None:
        raise RuntimeError("closest_setting: no candidate")  # (every caller gives at least one)
    if tolerance is not None and abs(best[1] - cost) / cost > tolerance:
        raise UserError(missed(*best))
    return best


def stepped_counts(count: int, most: int, ratio: Callable[[list[int]], float], cost: float) -> Iterator[list[int]]:
    """Candidate per-block token counts for ``closest_setting``, for ``count`` reducing blocks: for r = 0, 1, ...,
    ``most``, r + 1 in the first j blocks and r in the others (j = 0 .. count - 1: a constant schedule, refined so
    that a cost is matched finely). Stops after the first r whose constant schedule costs less than ``cost``: every
    later candidate costs less still (a block that removes more costs no more), so none comes closer."""
    for r in range(most + 1):
        for j in range(count):
            yield [r + 1] * j + [r] * (count - j)
        if ratio([r] * count) < cost:
            return


# ---------------------------------------------------------------- pricing helpers (used by the reductions)

def linear_macs_per_token(module: nn.Module) -> int:
    """in x out of the Linears one token goes through in ``module``: for a block (a module with ``attn`` and
    ``mlp``), those of its attention and MLP only (a router or anything else it holds prices itself); for
    any other module, every Linear inside it."""
    if hasattr(module, "attn") and hasattr(module, "mlp"):
        return linear_macs_per_token(module.attn) + linear_macs_per_token(module.mlp)
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def attention_macs(tokens: int, attn: nn.Module) -> int:
    """QK^T and AV on ``tokens`` tokens: each tokens x tokens x attn_dim."""
    return 2 * tokens * tokens * attn.num_heads * attn.head_dim


def _attention_of(blk: nn.Module) -> nn.Module:
    """The attention of a block: its ``attn``, or (a block that wraps one) the one module inside it with
    ``num_heads`` and ``head_dim``; refuses a block without exactly one."""
    if hasattr(blk, "attn"):
        return blk.attn
    found = [m for m in blk.modules() if hasattr(m, "num_heads") and hasattr(m, "head_dim")]
    if len(found) != 1:
        raise UserError(f"a {type(blk).__name__} ({type(blk).__module__}) has {len(found)} attention modules (ones "
                        "with num_heads and head_dim), so amod cannot price it as a dense block; a block of a method "
                        "prices itself with amod_price(tokens, num_prefix, capacity) -> amod.cost.BlockPrice")
    return found[0]


def dense_block_macs(blk: nn.Module, tokens: int) -> int:
    """A timm Block (or a block that wraps one) on ``tokens`` tokens."""
    return tokens * linear_macs_per_token(blk) + attention_macs(tokens, _attention_of(blk))


# the packages whose blocks compute what their weights say (a dense block): a block of any other class changes the
# work (a method's) and must price itself
_ECOSYSTEM_MODULES = ("timm.", "transformers.", "torch.")


def block_price(blk: nn.Module, index: int, tokens: int, num_prefix: int, capacity: Optional[float]) -> BlockPrice:
    """What block ``index`` costs on ``tokens`` tokens: its own ``amod_price``, or, for a block whose forward is
    timm's or transformers' own, a dense block's. A block of any other forward (a method's) without
    ``amod_price`` is refused in one line: amod could not say what it costs, and pricing it as dense would be
    silently wrong."""
    if hasattr(blk, "amod_price"):
        return blk.amod_price(tokens, num_prefix, capacity)
    # (a class whose forward runs another class's, a Hugging Face layer in timm's Block role, names it)
    forward = getattr(getattr(type(blk), "amod_forward_of", type(blk)), "forward", None)
    if not getattr(forward, "__module__", "").startswith(_ECOSYSTEM_MODULES):
        raise UserError(f"block {index} is a {type(blk).__name__} ({type(blk).__module__}) whose forward is not "
                        "timm's or transformers' and which does not price itself: a method's blocks define "
                        "amod_price(tokens, num_prefix, capacity) -> amod.cost.BlockPrice (docs/architecture.md), or "
                        "amod cannot say what the model costs")
    return BlockPrice(dense_block_macs(blk, tokens), tokens, tokens)


def img_size_of(model: nn.Module, img_size: ImgSize) -> tuple[int, int]:
    """``img_size`` as (H, W), the model's own when None; refuses sizes that are not positive."""
    if img_size is None:
        img_size = model.patch_embed.img_size
    if isinstance(img_size, int):
        img_size = (img_size, img_size)
    h, w = int(img_size[0]), int(img_size[1])
    if h < 1 or w < 1:
        raise UserError(f"img_size must be positive, got {h}x{w}")
    return h, w


def token_sizes(model: nn.Module, img_size: ImgSize) -> tuple[tuple[int, int], int, int]:
    """((H, W), patch tokens, prefix tokens) at ``img_size``."""
    h, w = img_size_of(model, img_size)
    ph, pw = model.patch_embed.patch_size
    if h % ph or w % pw:
        raise UserError(f"img_size {(h, w)} is not a multiple of the patch size {(ph, pw)}")
    return (h, w), (h // ph) * (w // pw), model.num_prefix_tokens


def embed_head_macs(model: nn.Module, num_patches: int) -> tuple[int, int]:
    heads = (getattr(model, "head", None), getattr(model, "head_dist", None))
    return (num_patches * model.patch_embed.proj.weight.numel(),
            sum(m.in_features * m.out_features for m in heads if isinstance(m, nn.Linear)))


# ---------------------------------------------------------------- the model

def flops(model: nn.Module, img_size: ImgSize = None, capacity: Optional[float] = None) -> Any:
    """Analytic cost of one image through ``model`` (dense, MoD-converted or token-merging), as its model family
    prices it (``amod.families``).

    Args:
        model: a model of a registered family: a timm ViT, a Hugging Face ViT/DeiT/DINOv2/CLIP/SigLIP vision model
            (converted or not), or a DETR (its report: ``amod.families.detr.DetrCostReport``).
        img_size: input size (int or (H, W)); defaults to the model's own (a DETR needs it).
        capacity: price an MoD model as if set to this capacity (the model is not changed).

    Returns:
        A ``CostReport``: ``.macs``, ``.flops``, ``.gmacs``, ``.ratio`` to dense, per-block costs
        (``tokens``: the tokens a block's attention runs on).
    """
    return family_of(model).flops(model, img_size, capacity)


OutsideBlocks = Callable[[nn.Module, int, int], tuple[int, int]]


def vit_flops(model: nn.Module, img_size: ImgSize, capacity: Optional[float], outside: OutsideBlocks) -> CostReport:
    """``flops`` of a model of the ViT pattern (its family's views in place): every block priced by its own
    ``amod_price`` (a dense block: ``dense_block_macs``), the patch embedding and head by ``outside(model,
    num_patches, tokens out of the last block)``."""
    (h, w), n, p = token_sizes(model, img_size)
    N = n + p
    blocks, dense_blocks = [], 0
    tokens = N  # falls where tokens merge or fold
    for i, blk in enumerate(model.blocks):
        price = block_price(blk, i, tokens, p, capacity)
        blocks.append(BlockCost(i, price.tokens, price.macs))
        tokens = price.tokens_after
        dense_blocks += dense_block_macs(blk, N)
    embed, head = outside(model, n, tokens)
    dense_embed, dense_head = outside(model, n, N)
    macs = embed + head + sum(b.macs for b in blocks)
    return CostReport((h, w), N, macs, dense_embed + dense_head + dense_blocks, embed, head, blocks)


def _cpu_sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts PyTorch's fused CPU attention kernel, which the stock counter
    leaves out."""
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return FlopCounterMode(display=False, custom_mapping={cpu_sdpa: _cpu_sdpa_flops})


def count_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of ``model(x)`` measured by ``torch.utils.flop_counter.FlopCounterMode`` (``flop_counter``)."""
    with flop_counter() as counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()
