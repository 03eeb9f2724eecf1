"""The model-family contract and its registry: what amod knows about one kind of model (``Family``), one adapter
module each in ``amod.families``, found through one registry (``register_family``, ``family_of``, ``family_for``).

A family is a ``Family`` subclass whose instance its adapter module registers (``register_family``) when imported;
``amod/__init__`` imports the built-in adapters (``timm_vit``, ``hf_vit``, ``hf_clip``, ``hf_siglip``, ``detr``), none
of which imports an optional package (``transformers``) at import time. Every entry point asks ``family_of(model)``
(or, for a checkpoint, ``family_for(info)``) and names no family: ``amod.convert``, ``amod.tome.apply``,
``set_capacity``, ``flops``, ``save``/``load``, ``export`` and the CLI.

What a family knows (the methods below; ``amod.families.vit.ViTFamily`` gives the ViT pattern's defaults):

- whether it claims a model, by its classes' names and modules (``claims``), and a checkpoint's description of one
  (``claims_description``);
- its blocks and token layout: ``prepare`` gives the model timm's names (``blocks``, ``patch_embed``,
  ``num_prefix_tokens``, ...) as views, ``class_rows`` says which tokens' attention fold reads as importance;
- how a block takes amod's roles: ``make_mod`` (an MoD block), ``make_scoring`` (the block before an attention-routed
  one), ``make_sized`` (fold, ToMe, PiToMe); ``check_block`` refuses a block it cannot take;
- what it refuses (``validate``: routers and skipped modes, with the reason) and how it converts (``convert``,
  ``merge_apply``: token merging, ToMe or PiToMe);
- what it costs (``flops``: the blocks price themselves, the family prices the rest);
- its tokens after every block and its final norm, which ``amod.patch_features`` lays back on the patch grid where
  the model has no timm ``forward_intermediates`` (``hidden_states``, ``final_norm``: the Hugging Face families);
- how a checkpoint describes and rebuilds it (``describe``, ``rebuild``), a weightless copy (``weightless_copy``), what
  it exports and evaluates (``tensor_module``, ``feature_module``), its classifier's classes (``num_classes``);
- whether amod's classifier training takes its models (``trainable``).

This module imports nothing of amod: it is the bottom of the package, so the library's modules (``cost``, ``mod``,
``tome``, ``methods``, ``checkpoint``, ...) all ask it, and the family modules, which build on them, register here.
``amod.families`` re-exports these names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence
from .errors import UnsupportedModelError, UserError

if TYPE_CHECKING:
    import torch
    from torch import nn


def class_names(model: Any, module_prefix: str) -> set[str]:
    """The names of ``model``'s classes (its class and every base) defined in a module under ``module_prefix``
    (e.g. ``"transformers."``): how a family claims a model without importing the package."""
    return {c.__name__ for c in type(model).__mro__ if c.__module__.startswith(module_prefix)}


class Family:
    """One model family. Class attributes: ``name`` (in checkpoints and errors) and ``models`` (what it takes, in
    words, for the error that lists every family)."""

    name: str = ""
    models: str = ""
    # whether amod's classifier training (``amod train``/``finetune``, and the studies and demo built on it) takes the
    # family's models: that loop reads timm's classifier interface (logits out of ``forward``, ``reset_classifier``,
    # ``head``); the other families are measured without training (a linear probe on ``feature_module``)
    trainable: bool = False

    # ------------------------------------------------------------ which models

    def claims(self, model: Any) -> bool:
        """Whether ``model`` is one of this family's (by class; imports nothing)."""
        raise NotImplementedError

    def claims_description(self, info: dict[str, Any]) -> bool:
        """Whether a checkpoint's ``amod.model`` entry (``describe``'s output) is one of this family's models."""
        raise NotImplementedError

    # ------------------------------------------------------------ layout and roles

    def prepare(self, model: "nn.Module") -> "nn.Module":
        """Give ``model`` the timm-style views amod's code reads (``blocks``, ``patch_embed``, ``num_prefix_tokens``,
        ...), in place and once; returns it."""
        return model

    def class_rows(self, model: "nn.Module") -> int:
        """How many leading tokens' attention rows fold reads as each token's importance (CLS, distillation); 0:
        no class token, fold reads the attention every token receives from all tokens instead."""
        raise NotImplementedError

    def check_block(self, block: "nn.Module", index: int) -> None:
        """Refuse, with a ``TypeError`` naming it, a block this family cannot give amod's roles (or converted)."""
        raise NotImplementedError

    def make_mod(self, block: "nn.Module") -> "nn.Module":
        """Make ``block`` an MoD block (``amod.mod.block.MoDBlock``'s forward on this family's modules)."""
        raise NotImplementedError

    def make_scoring(self, block: "nn.Module") -> "nn.Module":
        """Make ``block``'s attention hand A-MoD's scores on (``ScoringAttention``); returns that attention. A block
        that is not an MoD block stays dense."""
        raise NotImplementedError

    def make_sized(self, block: "nn.Module", block_cls: type, settings: Any, class_rows: int = 0) -> None:
        """Make ``block`` a token-reduction block of class ``block_cls`` (fold, ToMe) with ``settings``."""
        raise NotImplementedError

    def router_dim(self, block: "nn.Module") -> int:
        """The width of the tokens ``block``'s router scores."""
        raise NotImplementedError

    def lay_out_patch_grid(self, model: "nn.Module") -> None:
        """Make the per-patch outputs of ``model``, which now reduces its tokens, lie on the dense model's patch grid
        (``amod.patch_grid``), in place. Default: nothing (a family whose grid outputs are not laid back refuses or
        returns its reduced sequence as it is)."""

    def hidden_states(self, model: "nn.Module", x: "torch.Tensor") -> "Sequence[torch.Tensor]":
        """What ``amod.patch_features`` lays back on the patch grid for a model without timm's
        ``forward_intermediates``: the tokens of one forward of ``model`` (prepared) on images ``x``, index 0 the
        embeddings and i + 1 block i's output, as long as the blocks hand them on. Default: refused, one line."""
        raise UserError(f"amod.patch_features takes a ViT; {self.name} models give no per-patch features")

    def final_norm(self, model: "nn.Module") -> "Callable[[torch.Tensor], torch.Tensor]":
        """What turns the last block's tokens (``hidden_states``' last) into the model's own final tokens: the norm
        ``amod.patch_features(norm=True)`` applies to each layer it returns."""
        raise NotImplementedError

    # ------------------------------------------------------------ conversion

    def validate(self, config: Any, model: "nn.Module") -> None:
        """Refuse (``ValueError``, one line, saying why) a router or skipped mode this family cannot run. ``config``:
        the model's ``amod.mod.config.MoDConfig`` (typed ``Any``: the registry imports nothing of amod, not even for a
        type hint, which would run an arrow from the bottom of the package back up to ``mod``)."""

    def convert(self, model: "nn.Module", config: Any) -> None:
        """``amod.convert`` once the arguments are checked (``config``: its ``MoDConfig``): the blocks take their
        roles, in place."""
        raise NotImplementedError

    def merge_apply(self, model: "nn.Module", merge: Any) -> "nn.Module":
        """A token-merging method (``amod.tome.apply``, ``amod.pitome.apply``) on this family's model: ``merge(model,
        family)`` makes the blocks merge (through ``check_block`` and ``make_sized``); returns the model."""
        raise NotImplementedError

    def layers_count(self, model: "nn.Module") -> int:
        """The blocks ``layers=`` indexes."""
        return len(model.blocks)

    # ------------------------------------------------------------ cost

    def flops(self, model: "nn.Module", img_size: Any, capacity: Optional[float]) -> Any:
        """``amod.flops``: the cost report of one image."""
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints, copies, export

    def describe(self, model: "nn.Module", **hints: Any) -> dict[str, Any]:
        """What ``amod.save`` stores under ``amod.model``: enough to build the model again, without weights.
        ``hints``: what the caller knows (``amod.save``'s ``arch=`` and ``model_args=``, for timm); None: read off."""
        raise NotImplementedError

    def rebuild(self, info: dict[str, Any], metadata: Optional[dict[str, str]] = None) -> "nn.Module":
        """The dense model ``describe`` described, with random weights (``amod.load`` loads the file's), and through
        ``restore`` what its forward needs beyond them (a DETR's content queries; the Hugging Face families'
        ``rebuild`` calls ``restore``, timm's needs none)."""
        raise NotImplementedError

    def restore(self, model: "nn.Module", info: dict[str, Any], metadata: Optional[dict[str, str]] = None) -> "nn.Module":
        """Give a model built from ``info`` (``describe``'s output; ``metadata``: the file's) what its forward had
        beyond its weights and config (a DETR's content queries); in place."""
        return model

    def weightless_copy(self, model: "nn.Module") -> "nn.Module":
        """A weightless copy of the dense ``model`` (on the ``meta`` device), for pricing other settings."""
        raise NotImplementedError

    def tensor_module(self, model: "nn.Module") -> "nn.Module":
        """``model`` as a module that takes an image batch and returns one tensor (logits, or the features of a
        backbone): what ``amod.export`` exports and ``amod eval`` runs. A ``TypeError`` where there is none."""
        return model

    def feature_module(self, model: "nn.Module") -> "nn.Module":
        """``model`` with timm's ``forward_features`` and ``forward_head(tokens, pre_logits=True)``, for a linear
        probe on its features."""
        return model

    def num_classes(self, model: "nn.Module") -> int:
        """The classifier's classes; 0 for a backbone."""
        return int(getattr(model, "num_classes", 0) or 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


FAMILIES: list[Family] = []  # in the order they were registered


def register_family(family: Family) -> Family:
    """Register ``family`` (an adapter module does this at import); a second family of the same name replaces the
    first, so that reloading a module does not register it twice."""
    if not isinstance(family, Family) or not family.name:
        raise TypeError(f"register_family takes a named Family instance, got {family!r}")
    FAMILIES[:] = [f for f in FAMILIES if f.name != family.name] + [family]
    return family


def family_of(model: Any) -> Family:
    """The registered family that claims ``model``; a ``TypeError`` listing what amod takes otherwise."""
    family = claimed(model)
    if family is not None:
        return family
    supported = "; ".join(f"{f.models}" for f in FAMILIES)
    raise UnsupportedModelError(f"amod cannot take a {type(model).__name__}: it takes {supported}")


def claimed(model: Any) -> Optional[Family]:
    """The family that claims ``model``, or None."""
    return next((f for f in FAMILIES if f.claims(model)), None)


def family_for(info: dict[str, Any]) -> Family:
    """The registered family a checkpoint's ``amod.model`` entry describes; a ``ValueError`` otherwise."""
    for family in FAMILIES:
        if family.claims_description(info):
            return family
    raise UserError(f"no model family of this amod describes {str(info)[:120]}; families: "
                    f"{', '.join(f.name for f in FAMILIES)}")


def prepare(model: Any) -> Any:
    """``family_of(model).prepare(model)``: the model with amod's views (a model no family claims is refused)."""
    return family_of(model).prepare(model)


def weightless_copy(model: Any) -> Any:
    """A weightless copy of the dense ``model`` on the ``meta`` device (``Family.weightless_copy``)."""
    return family_of(model).weightless_copy(model)
