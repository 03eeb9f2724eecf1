"""Every patch keeps its feature: a reduced model's tokens laid back on the dense model's patch grid.

A model that reduces tokens (fold, calibrated, ToMe, PiToMe, PPT: ``amod.reduce``) hands fewer tokens from block to
block, in an order of its own. Whoever asks for a grid of patch features (timm's ``forward_intermediates``,
``amod.patch_features``) gets the dense model's shapes in the original patch order instead: every original patch
gets the feature of the token it was merged, folded or (PPT) pruned into.

- ``tracking(model)``: within it, the reduction blocks also say where each of their tokens went, and the blocks'
  shared ``TokenSizes`` composes that into ``source`` (B, N0): for each original token, the index of the token that
  holds it now. An index map (one int per original token), not an N x N matrix; outside it none of this runs, so
  classification keeps its fast path.
- ``lay_back``: a reduced sequence on the grid, one gather per returned layer.
- ``PatchGridViT``: the mixin a family puts before its model class (``Family.lay_out_patch_grid``) so that the
  model's own ``forward_intermediates`` lays its outputs back, with every option the dense model's has.
- ``patch_features``: the one call for any ViT amod takes; a Hugging Face model (whose own outputs stay the reduced
  sequence) gets its layers' ``hidden_states`` laid back (``Family.hidden_states``, ``Family.final_norm``).

A model that keeps every token in place (MoD: bypass, merge, kv) needs none of it: its grid is already whole.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from .errors import UserError
from .family import Family, claimed
from .reduce import SizedTokensBlock
from .tokens import TokenSizes, lay_back

__all__ = ["tracking", "lay_back", "PatchGridViT", "grid_class", "patch_features"]


def shared_sizes(model: nn.Module) -> Optional[TokenSizes]:
    """The ``TokenSizes`` the reduction blocks of ``model`` share; None in a model that reduces no tokens."""
    for blk in getattr(model, "blocks", ()):
        if isinstance(blk, SizedTokensBlock):
            return blk.amod.sizes
    return None


@contextlib.contextmanager
def tracking(model: nn.Module) -> Iterator[Optional[TokenSizes]]:
    """Within this context a forward of ``model`` tracks where each original token goes (``TokenSizes.source``, and
    ``amod_source`` on each reduction block: the map after that block). Leaves no state behind: the maps are let go
    of on exit. Yields the shared ``TokenSizes`` (None for a model that reduces nothing)."""
    sizes = shared_sizes(model)
    if sizes is None:
        yield None
        return
    sizes.track = True
    try:
        yield sizes
    finally:
        sizes.track, sizes.source = False, None
        for blk in model.blocks:
            blk.__dict__.pop("amod_source", None)


def _block_sources(model: nn.Module, taken: Sequence[int]) -> list[Optional[torch.Tensor]]:
    """The token map after each block in ``taken`` (ascending), carried over blocks that reduce nothing."""
    sources, source = [], None
    wanted, last = set(taken), max(taken, default=-1)
    for i, blk in enumerate(model.blocks):
        if i > last:
            break
        source = blk.__dict__.get("amod_source", source)
        if i in wanted:
            sources.append(source)
    return sources


class PatchGridViT:
    """Mixin before a ViT class whose ``forward_intermediates`` follows timm's: the same call, every option, with
    the reduced model's intermediates and final features laid back on the dense model's grid (``lay_back``)."""

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, list[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False, output_dict: bool = False,
                              **kwargs: Any) -> Any:
        _check_fmt(output_fmt)
        from timm.models._features import feature_take_indices  # (timm's own reading of ``indices``)

        taken, _ = feature_take_indices(len(self.blocks), indices)
        with tracking(self) as sizes:
            out = super().forward_intermediates(  # type: ignore[misc]
                x, indices=indices, return_prefix_tokens=True, norm=norm, stop_early=stop_early, output_fmt="NLC",
                intermediates_only=intermediates_only, output_dict=True, **kwargs)
            final_source = None if sizes is None else sizes.source
            taken_sorted = sorted(set(int(i) for i in taken))
            sources = _block_sources(self, taken_sorted)
        hw = self.patch_embed.dynamic_feat_size(x.shape[-2:])  # type: ignore[attr-defined]
        p = self.num_prefix_tokens
        patches, prefixes = out["image_intermediates"], out.get("image_intermediates_prefix")
        grids, prefix_out = [], []
        for k, (y, source) in enumerate(zip(patches, sources)):
            full = y if prefixes is None else torch.cat([prefixes[k], y], dim=1)
            full = lay_back(full, source)
            prefix_out.append(full[:, :p])
            grids.append(_as_grid(full[:, p:], hw, output_fmt, block=int(taken_sorted[k])))
        features = out.get("image_features")
        if features is not None:
            features = lay_back(features, final_source)
        if output_dict:
            result: dict[str, Any] = {"image_intermediates": grids}
            if p and return_prefix_tokens:
                result["image_intermediates_prefix"] = prefix_out
            if features is not None:
                result["image_features"] = features
            return result
        if p and return_prefix_tokens:
            grids = list(zip(grids, prefix_out))
        return grids if intermediates_only else (features, grids)


def _check_fmt(output_fmt: str) -> None:
    """Refuse an ``output_fmt`` other than the two the grid comes in."""
    if output_fmt not in ("NCHW", "NLC"):
        raise UserError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")


def _as_grid(y: torch.Tensor, hw: Sequence[int], output_fmt: str, block: Optional[int] = None) -> torch.Tensor:
    """(B, n, D) patch tokens in grid order -> NCHW (B, D, H, W) for a grid of ``hw`` patches or, for NLC, as they
    are. Refuses, in one line, a layer (``block``) that holds another number of patch tokens than the grid: tokens a
    model's blocks removed without saying where they went (blocks that are not amod's reduction blocks,
    ``amod.reduce.SizedTokensBlock``) cannot be laid back."""
    if y.shape[1] != hw[0] * hw[1]:
        where = "" if block is None else f"block {block} hands on "
        raise UserError(f"{where}{y.shape[1]} patch tokens where the grid has {hw[0]} x {hw[1]} = {hw[0] * hw[1]}, "
                        "and the model does not say where the others went (only amod's reduction blocks track it): "
                        "its patch features cannot be laid back on the grid")
    if output_fmt == "NLC":
        return y
    return y.reshape(y.shape[0], *hw, -1).permute(0, 3, 1, 2).contiguous()


def grid_class(cls: type) -> type:
    """``cls`` with ``PatchGridViT`` before it, made once per class and kept in this module (so that a model of it
    pickles and deep-copies); named like ``cls``, so that what prints or describes the model reads as before."""
    if issubclass(cls, PatchGridViT):
        return cls
    qualname = f"PatchGrid{cls.__name__}"
    made = globals().get(qualname)
    if made is None:
        made = type(cls.__name__, (PatchGridViT, cls), {"__module__": __name__, "__qualname__": qualname})
        setattr(sys.modules[__name__], qualname, made)
    return made


def patch_features(model: nn.Module, x: torch.Tensor, layers: Union[int, Sequence[int], None] = None,
                   norm: bool = True, output_fmt: str = "NCHW") -> Union[torch.Tensor, list[torch.Tensor]]:
    """The feature of every patch, on the dense model's grid, whatever the model reduces.

    For a Hugging Face model this is the per-patch call: its own outputs (``last_hidden_state``, ``hidden_states``)
    stay the reduced sequence, in the reduction's order; here its ``hidden_states`` are laid back on the grid.

    Args:
        model: a ViT, dense or converted by amod (MoD, fold, calibrated, ToMe, PiToMe, PPT): timm's (through its
            ``forward_intermediates``), or a Hugging Face ViT, DeiT, DINOv2 (with registers too), CLIP or SigLIP
            vision model.
        x: images (B, C, H, W).
        layers: a block index (negative: from the end) or a list of them; default: the last block.
        norm: apply the model's final norm to each layer: the one that makes the last layer the model's own final
            features (timm: ``norm``; Hugging Face: what its ``last_hidden_state`` has, ``layernorm`` for ViT, DeiT
            and DINOv2, ``post_layernorm`` for SigLIP, none for CLIP, whose ``post_layernorm`` norms the pool only).
        output_fmt: ``"NCHW"`` (B, D, H/patch, W/patch) or ``"NLC"`` (B, n, D), patches in grid order.

    Returns:
        One tensor for an int or None ``layers``, a list (one per index, in block order) for a list.
    """
    _check_fmt(output_fmt)
    family = None
    if not (callable(getattr(model, "forward_intermediates", None)) and hasattr(model, "blocks")):
        family = claimed(model)
        if family is None:
            raise UserError(f"amod.patch_features takes a timm ViT (one with forward_intermediates) or a Hugging "
                            f"Face vision transformer amod converts, got {type(model).__name__}")
        model = family.prepare(model)
    depth = len(model.blocks)
    single = layers is None or isinstance(layers, int)
    wanted = [depth - 1 if layers is None else layers] if single else list(layers)
    blocks = []
    for i in wanted:
        if isinstance(i, bool) or not isinstance(i, int) or not -depth <= i < depth:
            raise UserError(f"layers must be block indices in [-{depth}, {depth - 1}], got {i!r}")
        blocks.append(i % depth)
    taken = sorted(set(blocks))
    if family is None:  # (as rows, laid on the grid here: a model that dropped tokens is refused in one line)
        rows = model.forward_intermediates(x, indices=taken, norm=norm, output_fmt="NLC", intermediates_only=True)
        hw = model.patch_embed.dynamic_feat_size(x.shape[-2:])
        grids = [_as_grid(y, hw, output_fmt, block=i) for i, y in zip(taken, rows)]
    else:
        grids = _hidden_state_grids(model, family, x, taken, norm, output_fmt)
    by_block = dict(zip(taken, grids))
    return by_block[blocks[0]] if single else [by_block[i] for i in blocks]


def _hidden_state_grids(model: nn.Module, family: Family, x: torch.Tensor, taken: Sequence[int], norm: bool,
                        output_fmt: str) -> list[torch.Tensor]:
    """``patch_features`` of a model without ``forward_intermediates`` (Hugging Face): the family's hidden states of
    the blocks ``taken`` (ascending), each normed by its ``final_norm`` (``norm``) and laid back on the grid."""
    with tracking(model):
        states = family.hidden_states(model, x)
        sources = _block_sources(model, taken)
    final = family.final_norm(model) if norm else None
    p = model.num_prefix_tokens
    hw = [n // k for n, k in zip(x.shape[-2:], model.patch_embed.patch_size)]
    grids = []
    for i, source in zip(taken, sources):
        y = states[i + 1] if final is None else final(states[i + 1])  # (normed before laying back: fewer tokens)
        grids.append(_as_grid(lay_back(y, source)[:, p:], hw, output_fmt, block=i))
    return grids
