"""PiToMe (Tran et al., NeurIPS 2024, "Accelerating Transformers with Spectrum-Preserving Token Merging"): token
merging guided by an energy score that finds the isolated tokens. A peer of ToMe in amod's comparisons, written from
the paper and matched to the public code (hchautran/PiToMe at 550b5de: ``algo/pitome/merge.py`` and its timm patch).

In every block, after attention and before the MLP, a block with t patch tokens removes r = min(floor(t − keep · t),
t // 2) of them (``keep``: the share of its patch tokens a block keeps, the same in every block, so the count falls
geometrically):

- *energy*: on the keys averaged over heads (ToMe's metric), each patch token's energy is the mean over all patch
  tokens j (itself included) of ELU(cos(k_i, k_j) − m), with the block's margin m = 0.75 − 0.75 · l / L (block l of
  L); a token with many close neighbours has a high energy, an isolated one a low energy;
- the patch tokens, in energy order (highest first), alternate into sets A and B, and each A token's partner is its
  most similar B token;
- in the first ceil(L / 2) blocks (``match_all``) every patch token takes part: the r A tokens with the most similar
  partners merge (ToMe's bipartite matching, with the sets split by energy rank instead of position);
- in the later blocks only the 2r tokens of highest energy are candidates, the others are *protected* (kept as they
  are), and every candidate A token merges into its partner;
- merges are size-weighted averages; proportional attention: as in ToMe, a merged token counts as the patches it holds
  (log size in the logits).

Where this version differs from the public code:

- proportional attention: the public timm block never passes the sizes to its attention, so there a merged token
  counts once; amod weighs it by its size, as ToMe does. DINOv2 ViT-S/14 at 224 px, cost 0.56, 500 Fashion-MNIST test
  images (``docs/frontier.md``, ``studies/pitome_probe.py``): probe top-1 79.2 % with it, 74.0 % without;
- prefix tokens (class, distillation, registers) never merge and take no part in the energy (the public code sets
  aside the class token only);
- the energy's cosine matrix is priced in the MACs (``amod.flops``, checked against FlopCounterMode): n² · head_dim
  per merging block, n the patch tokens, where the public FLOP count leaves it out;
- energies, and partners' similarities, are compared on a grid (``amod.tokens.decision_key``): those within a step
  of 2^-11 of each other are ordered by position, the same in every backend and batch, where the public code's
  ``argsort`` and ``argmax`` leave near-equal ones to the rounding of the kernel that computed them.

``apply(model, keep=0.9)`` or ``apply(model, cost=0.56)`` makes a dense model of any family that takes token
merging (``amod.families``) merge in place; ``set_keep`` changes the share kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..cost import COST_TOLERANCE, BlockPrice, closest_setting, flops, validate_cost
from ..family import family_of, weightless_copy
from ..methods import NEAR_TIE_GRID, Method, refuse_both, register_method
from ..reduce import SizedSettings, SizedTokensBlock, reduction_macs
from ..static import StaticNumbers
from ..ops import as_float32
from ..tokens import (TokenSizes, best_match, descending_order, image_rows, matched_destinations, order_of_keys,
                      reordered_destinations, with_sizes, without_sizes)
from .merging import check_mergeable, merging_metadata
from ..errors import UserError

ALPHA = 1.0  # the ELU's slope below the margin, the public code's


def margin(block: int, depth: int) -> float:
    """The energy's margin in block ``block`` of ``depth``: 0.75 falling to 0.75 / depth (the public code's)."""
    return 0.75 - 0.75 * block / depth


def matches_all(block: int, depth: int) -> bool:
    """Whether block ``block`` of ``depth`` matches every patch token (the first ceil(depth / 2) blocks, as the public
    code does) rather than protecting those outside the 2r of highest energy."""
    return block < math.ceil(depth / 2)


def pitome_count(keep: float, tokens: int) -> int:
    """Patch tokens a block with ``tokens`` patch tokens removes at ``keep``: floor(t − keep · t), at most t // 2."""
    return max(0, min(math.floor(tokens - keep * tokens + 1e-9), tokens // 2))


def energy_merge(x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor, r: int, num_prefix: int,
                 block_margin: float, match_all: bool = False, destinations: bool = False,
                 rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """Remove r patch tokens of ``x`` (B, N, D) by PiToMe's rule (see the module docstring); prefix tokens stay.

    Args:
        x: tokens, prefix first; size: their sizes (B, N, 1; None: all 1); metric: (B, N, c) keys averaged over
            heads, as unit vectors.
        r: tokens removed, at most half of the patch tokens.
        block_margin: the energy's margin in this block.
        match_all: every patch token takes part in the matching and the r best-matched A tokens merge (the early
            blocks); otherwise the 2r tokens of highest energy are the candidates and the rest are protected.
        destinations: also return where each input token went (B, N), for the patch grid (``amod.patch_grid``).
        rows: ``amod.tokens.image_rows`` of the batch, where already made (the advanced indexing's first index).

    Returns:
        The tokens left (B, N - r, D) and their sizes (B, N - r, 1): prefix, then with ``match_all`` set A's unmerged
        tokens (best match first) and set B with set A's merged in; otherwise the protected tokens (in energy order,
        lowest last) and set B with set A merged in.
    """
    p = num_prefix
    rows = image_rows(x) if rows is None else rows  # (B, 1)
    with torch.no_grad():  # which tokens merge is a discrete choice: no gradient through it
        m = as_float32(metric[:, p:])
        sim = torch.bmm(m, m.transpose(1, 2))  # (B, n, n) cosine similarities of the patch tokens
        energy = F.elu(sim - block_margin, alpha=ALPHA).mean(-1)  # (B, n)
        order = descending_order(energy)  # highest energy first, near-ties by position (amod.tokens)
        n = sim.shape[-1]
        split = n if match_all else 2 * r  # the tokens in energy order that alternate into A and B
        a, b = order[:, 0:split:2], order[:, 1:split:2]  # (B, |A|), (B, |B|): patch indices
        sim_ab = sim[rows.unsqueeze(-1), a.unsqueeze(-1), b.unsqueeze(1)]  # (B, |A|, |B|), one gather
        key, partner = best_match(sim_ab)  # (B, |A|): each A token's partner, an index into b (near-ties: the first)
        into = partner  # (B, r): the partner of each A token that merges
        if match_all:  # the A tokens from the most similar partner down, on the same key: the first r merge
            best = order_of_keys(key)
            a = a.gather(1, best)  # set A's patch indices in that order
            into = partner.gather(1, best[:, :r])
    xs = with_sizes(x, size)  # (B, N, D + 1): one gather and one scatter-add move features and sizes together
    C, patches = xs.shape[-1], xs[:, p:]
    index = into.unsqueeze(-1).expand(-1, -1, C)
    if match_all:  # set A: the even energy ranks (``a``, best match first), set B: the odd ones
        merged, kept = patches[rows, a].split([r, a.shape[1] - r], dim=1)
        left = [kept, patches[rows, b].scatter_add(1, index, merged)]
        moved = matched_destinations(best, partner, r, p, n) if destinations else None
    else:  # set A and set B: the even and odd energy ranks below 2r, the others protected
        left = [patches[rows, order[:, split:]], patches[rows, b].scatter_add(1, index, patches[rows, a])]
        moved = candidates_destinations(partner, r, p, n) if destinations else None
    left = without_sizes(torch.cat([xs[:, :p], *left], dim=1))
    return left if moved is None else (*left, reordered_destinations(moved, order, p))


def candidates_destinations(into: torch.Tensor, r: int, num_prefix: int, num_patches: int) -> torch.Tensor:
    """Where ``energy_merge`` without ``match_all`` puts each token of the prefix and the patches in energy order
    (B, p + n): energy rank 2j (set A) merges into B token ``into[j]``, rank 2j + 1 is B token j, the protected
    ranks from 2r on keep their order after the prefix, and set B follows them."""
    p, n, B = num_prefix, num_patches, into.shape[0]
    positions = torch.arange(p + n, device=into.device)
    b_start = p + n - 2 * r
    candidates = torch.stack([b_start + into, (b_start + positions[:r]).expand(B, -1)], dim=-1).reshape(B, 2 * r)
    return torch.cat([positions[:p].expand(B, -1), candidates, positions[p:p + n - 2 * r].expand(B, -1)],
                     dim=1)


@dataclass(kw_only=True)
class PiToMeSettings(StaticNumbers, SizedSettings):
    """What a PiToMe block knows besides its weights, beyond every reduction block's ``SizedSettings``."""

    keep: float = 1.0  # the share of its patch tokens the block keeps (1: it merges nothing)
    margin: float = 0.75  # the energy's margin in this block
    match_all: bool = False  # every patch token takes part in the matching (the early blocks), none protected


class PiToMeBlock(SizedTokensBlock):
    """Token-reduction block (``amod.reduce``) that merges by PiToMe's rule between attention and MLP (module
    docstring). Attribute set by ``apply``: ``amod`` (its ``PiToMeSettings``)."""

    amod: PiToMeSettings
    amod_kind = "PiToMe block"
    amod_role_name = "PiToMe"  # what a Hugging Face layer in this role is called: PiToMeViTLayer

    def _removed(self, tokens: int, capacity: Optional[float] = None) -> int:
        return pitome_count(self.amod.static("keep"), tokens)  # (a compile-time constant: amod.static)  # (a capacity does not apply to token merging)

    def _reduce(self, x: torch.Tensor, size: Optional[torch.Tensor], metric: torch.Tensor,
                importance: Optional[torch.Tensor], r: int, destinations: bool = False) -> tuple[torch.Tensor, ...]:
        return energy_merge(x, size, metric, r, self.amod.num_prefix, self.amod.margin, self.amod.match_all,
                            destinations, self._image_rows(x))

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        """ToMe's block MACs with the energy's n x n cosine matrix in place of the |A| x |B| matching."""
        r = self._removed(tokens - num_prefix)
        macs = reduction_macs(self, tokens, r, num_prefix)
        if r > 0:
            n, hd = tokens - num_prefix, self.attn.head_dim
            macs += n * n * hd - ((n + 1) // 2) * (n // 2) * hd
        return BlockPrice(macs, tokens, tokens - r)


@dataclass
class PiToMeConfig:
    """How a model merges with PiToMe: the share of its patch tokens each block keeps."""

    keep: float
    method: ClassVar[str] = "PiToMe"
    dial: ClassVar[str] = "amod.pitome.set_keep"  # what changes the setting in place (a refusal names it)


def _validate_keep(keep: float) -> float:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.5 <= keep <= 1.0:
        raise UserError(f"keep must be a number in [0.5, 1] (the share of its patch tokens a block keeps; a block "
                        f"merges at most half of them), got {keep!r}")
    return float(keep)


def apply(model: nn.Module, keep: Optional[float] = None, cost: Optional[float] = None) -> nn.Module:
    """Make a dense model merge tokens with PiToMe, in place; returns the same model.

    Args:
        model: a dense model of a family that takes token merging (``amod.families``): timm ViTs, Hugging Face
            ViT/DeiT/DINOv2, CLIP and SigLIP vision models.
        keep: the share of its patch tokens every block keeps, in [0.5, 1] (the paper's ratio, e.g. 0.9).
        cost: instead of ``keep``, the share of the dense model's MACs to match (e.g. 0.56), by ``keep_for_cost``.
    """
    if (keep is None) == (cost is None):
        raise UserError("give exactly one of keep= (share of patch tokens each block keeps) and cost= (share of "
                        "dense MACs)")
    keep = None if keep is None else _validate_keep(keep)
    cost = None if cost is None else validate_cost(cost)
    return family_of(model).merge_apply(model, lambda m, family: _merging_blocks(m, keep, cost, family))


def _merging_blocks(model: nn.Module, keep: Optional[float], cost: Optional[float], family) -> nn.Module:
    check_mergeable(model, family, "PiToMe")
    if keep is None:  # priced on a weightless copy: a cost PiToMe cannot reach leaves the model as it was
        keep = keep_for_cost(_merging_blocks(family.prepare(family.weightless_copy(model)), 1.0, None, family), cost)
    sizes, depth = TokenSizes(), len(model.blocks)
    for i, blk in enumerate(model.blocks):
        family.make_sized(blk, PiToMeBlock, PiToMeSettings(num_prefix=model.num_prefix_tokens, sizes=sizes,
                                                           first=i == 0, margin=margin(i, depth),
                                                           match_all=matches_all(i, depth)))
    model.amod_pitome = PiToMeConfig(keep=1.0)
    return set_keep(model, keep)


def set_keep(model: nn.Module, keep: float) -> nn.Module:
    """Change the share of its patch tokens every block of a PiToMe model keeps, in place."""
    config = getattr(model, "amod_pitome", None)
    if config is None:
        raise UserError("model does not merge with PiToMe; use amod.pitome.apply first")
    keep = _validate_keep(keep)
    for blk in model.blocks:
        blk.amod.keep = keep
    config.keep = keep
    return model


def keep_for_cost(model: nn.Module, cost: float, img_size=None, tolerance: float = COST_TOLERANCE) -> float:
    """The keep, on a grid of 0.001 steps in [0.5, 1], whose MACs are closest to ``cost`` x dense (``model``: a
    PiToMe model; its own keep is restored). The MACs only grow with keep: a bisection. Raises when even the
    closest misses the cost by more than ``tolerance`` (relative; PiToMe merges at most half of a block's tokens, so
    its cost has a floor)."""
    cost = validate_cost(cost)
    before = model.amod_pitome.keep

    def ratio(k: int) -> float:
        set_keep(model, k / 1000)
        return flops(model, img_size).ratio

    try:
        lo, hi = 500, 1000
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ratio(mid) < cost else (lo, mid)
        best, _ = closest_setting(
            cost, (lo, hi), ratio, tolerance,
            lambda best, got: f"PiToMe cannot reach {cost:.3f} of dense on this model: the closest keep, "
                              f"{best / 1000:g}, costs {got:.3f}"
                              + (" (each block merges at most half of its tokens)" if got > cost else ""))
    finally:
        set_keep(model, before)
    return best / 1000

# ---------------------------------------------------------------- the method

@register_method
@dataclass(frozen=True)
class PiToMe(Method):
    """PiToMe (``amod.pitome``): every block keeps the share ``keep`` of its patch tokens, or ``cost``."""

    kind: ClassVar[str] = "pitome"
    setting_fields: ClassVar[tuple[str, ...]] = ("keep", "cost")
    metadata_key: ClassVar[Optional[str]] = "amod.pitome"
    behaviour: ClassVar[int] = 3
    behaviour_changes: ClassVar[dict[int, str]] = {
        2: "the public algorithm's schedule: the first half of the blocks match every token, margin 0.75 - 0.75 l/L "
           "(amod 838defc)",
        3: NEAR_TIE_GRID}
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (3, None)
    keep: Optional[float] = None
    cost: Optional[float] = None

    def check(self) -> None:
        refuse_both(self.kind, self, ("keep", "cost"), ("the share of its patch tokens each block keeps",
                                                    "a share of the dense MACs"))
        if self.cost is not None:
            validate_cost(self.cost, f"{self.kind}: cost")

    def apply(self, model: nn.Module) -> nn.Module:
        return apply(model, keep=self.keep, cost=self.cost)

    def label(self) -> str:
        return f"pitome@{self.cost:g}" if self.cost is not None else f"pitome keep={self.keep:g}"

    def setting_text(self) -> str:
        if self.keep is None and self.cost is None:
            return self.spec()  # not set yet
        return f"keep {self.keep:g} a block" if self.keep is not None else f"cost {self.cost:g}"

    def metadata(self) -> dict[str, str]:
        return {self.metadata_key: merging_metadata({"keep": self.keep, "cost": self.cost})}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["PiToMe"]:
        data = cls.stored_settings(meta)
        if data is None:
            return None
        keep, cost = data.get("keep"), data.get("cost")
        return cls(keep=None if keep is None else float(keep), cost=None if cost is None else float(cost))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["PiToMe"]:
        config = getattr(model, "amod_pitome", None)
        return None if config is None else cls(keep=config.keep)

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "PiToMe":
        model = PiToMe(keep=1.0).apply(weightless_copy(dense))
        return PiToMe(keep=keep_for_cost(model, cost, tolerance=1.0))  # closest; a miss is flagged
