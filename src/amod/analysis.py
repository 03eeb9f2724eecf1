"""Analyses of a (converted) model: leave-one-out token importance inside the MoD model, which
patches each MoD layer keeps, and attention entropy / attention sinks per layer."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .family import family_of
from .mod.block import publish_scores
from .mod.convert import mod_blocks, set_recording
from .mod.modes import mode_list, skipped_mode
from .ops import attention_inputs, attention_probs, received_attention
from .stats import spearman
from .tokens import gather_tokens, scatter_tokens
from .errors import UserError


def in_handoff(blk: nn.Module) -> Optional[Any]:
    """Where an MoD block finds the attention scores it routes on (None for other blocks)."""
    return getattr(getattr(blk, "amod", None), "in_handoff", None)


class _Reached(Exception):
    """Stops a forward at a block (``run_until``), carrying the tokens that entered it."""

    def __init__(self, tokens: torch.Tensor) -> None:
        super().__init__()
        self.tokens = tokens


def run_until(model: nn.Module, images: torch.Tensor, layer: int) -> torch.Tensor:
    """Tokens entering block ``layer``: the model's own forward (its family's ``tensor_module``, so any family),
    stopped there; the scores block ``layer`` reads are left in its handoff."""

    def stop(module: nn.Module, args: tuple) -> None:
        raise _Reached(args[0])

    hook = model.blocks[layer].register_forward_pre_hook(stop)
    try:
        family_of(model).tensor_module(model)(images)
    except _Reached as reached:
        return reached.tokens
    finally:
        hook.remove()
    raise RuntimeError(f"block {layer} did not run in the model's forward")


def run_from(model: nn.Module, images: torch.Tensor, x: torch.Tensor, layer: int,
             scores: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits of the model's own forward on ``images`` with the tokens entering block ``layer`` replaced by ``x``
    (the blocks from ``layer`` on, and the head, run on ``x``'s rows, however many) and the scores that block reads
    by ``scores``."""

    def replace(module: nn.Module, args: tuple) -> tuple:
        handoff = in_handoff(module)
        if handoff is not None:
            handoff.scores = scores
        return (x, *args[1:])

    hook = model.blocks[layer].register_forward_pre_hook(replace)
    try:
        return family_of(model).tensor_module(model)(images)
    finally:
        hook.remove()


def _drop_token(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(1, N, ...) -> (T, N - 1, ...): row r without token index[r]."""
    N = t.shape[1]
    keep = torch.ones(len(index), N, dtype=torch.bool, device=t.device)
    keep[torch.arange(len(index)), index] = False
    expanded = t.expand(len(index), *t.shape[1:])
    return expanded[keep].view(len(index), N - 1, *t.shape[2:])


def check_loo_model(model: nn.Module, name: str = "the model") -> None:
    """Refuse a model leave-one-out cannot judge: one without a classifier (a backbone: there is no loss to
    measure), or one whose skipped mode has its blocks route on the attention they compute themselves
    (``own_attention``: fold), so no scores exist at a block's input to compare with."""
    if family_of(model).num_classes(model) == 0:
        raise UserError(f"leave-one-out measures how much the loss of the model's classifier rises without each "
                        f"token; {name} has no classifier (a backbone)")
    config = getattr(model, "amod_config", None)
    if config is not None and skipped_mode(config.skipped).own_attention:
        raise UserError(f"leave-one-out needs an MoD model with skipped {mode_list(lambda m: not m.own_attention)}; "
                        f"{name} is a {config.skipped} model. It compares the scores a router reads at an MoD "
                        "block's input with the loss of removing each token there, but its blocks score their "
                        "tokens on the attention they compute themselves: there are no input scores to compare")


@torch.no_grad()
def leave_one_out(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, tokens: Optional[int] = None,
                  batch: int = 64, seed: int = 0) -> dict[str, Any]:
    """Leave-one-out token importance inside the given MoD model, against its router's scores.

    For each image and each MoD layer l, each sampled patch token is removed from the sequence at
    the input of block l (and from the scores block l reads); the rest of the model runs on the
    shorter sequence, and the token's importance is the increase of the image's loss. The Spearman
    correlation of the router's scores at l with those importances is reported per layer, and, as
    the baseline, that of random scores.

    Args:
        model: a converted model (any router; not a fold model, see ``check_loo_model``).
        images: (B, C, H, W) images; labels: (B,) classes.
        tokens: patch tokens sampled per image (all when None).
        batch: removals evaluated per forward.

    Returns:
        ``{"layers": {l: {"router": mean corr, "random": mean corr, "per_image": [...]}},
        "importance": {l: [[...] per image]}, "scores": ..., "tokens": ...}``
    """
    check_loo_model(model)
    model.eval()
    gen = np.random.default_rng(seed)
    p = model.num_prefix_tokens
    result: dict[str, Any] = {"layers": {}, "importance": {}, "scores": {}, "tokens": {}}
    for layer, blk in mod_blocks(model):
        per_image, per_image_random, imps, scs, toks = [], [], [], [], []
        for img, label in zip(images, labels):
            x = run_until(model, img[None], layer)  # (1, N, D)
            handoff = in_handoff(blk)
            full_scores = handoff.take() if handoff is not None else None  # (1, N) or None
            n = x.shape[1] - p
            sample = np.arange(n) if tokens is None or tokens >= n else np.sort(gen.choice(n, tokens, replace=False))
            router_scores = blk.router.score(x[:, p:], None if full_scores is None else full_scores[:, p:])[0]
            base = F.cross_entropy(run_from(model, img[None], x, layer, full_scores), label[None]).item()
            deltas = []
            for start in range(0, len(sample), batch):
                idx = torch.as_tensor(sample[start:start + batch] + p, device=x.device)
                xs = _drop_token(x, idx)
                ss = None if full_scores is None else _drop_token(full_scores, idx)
                logits = run_from(model, img[None], xs, layer, ss)
                deltas.append(F.cross_entropy(logits, label.expand(len(idx)), reduction="none") - base)
            delta = torch.cat(deltas).cpu().numpy()
            chosen = router_scores[torch.as_tensor(sample, device=x.device)].float().cpu().numpy()
            per_image.append(spearman(chosen, delta))
            per_image_random.append(spearman(gen.random(len(sample)), delta))
            imps.append(delta.tolist()), scs.append(chosen.tolist()), toks.append(sample.tolist())
        result["layers"][layer] = {"router": float(np.nanmean(per_image)), "random": float(np.nanmean(per_image_random)),
                                   "per_image": per_image, "per_image_random": per_image_random}
        result["importance"][layer], result["scores"][layer], result["tokens"][layer] = imps, scs, toks
    return result


@torch.no_grad()
def skip_importance(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 64,
                    layers: Optional[Sequence[int]] = None) -> dict[int, dict[str, Optional[np.ndarray]]]:
    """Leave-one-out inside an MoD model as MoD removes a token: at each MoD block l, each patch token in turn skips
    block l alone (copied through it and absent from its attention, as a bypass MoD block treats a token it skips)
    while the block processes every other token; every other block runs as the model does. A token's importance at
    l is the rise of the image's cross-entropy over the same forward with block l processing every token. Where the
    block gates its outputs (scaled outputs), the processed tokens get the gate of their scores, as in the model.

    Unlike ``leave_one_out`` (the token leaves the sequence for good), the token is back from block l + 1 on: this is
    what the router at l decides. A converted model at capacity 1.0 (``MoD(capacity=1.0)``) is the dense model with
    MoD blocks where they would be: its importances are the dense model's.

    Args:
        model: a timm MoD model with skipped ``bypass`` and a classifier; random routers are frozen to one draw
            for the duration (``SeededDraws.freeze_draws``), so that every forward of an image routes alike.
        images: (B, C, H, W); labels: (B,).
        batch: removals per forward.
        layers: only these MoD blocks (default every one).

    Returns:
        Per MoD block: ``importance`` (B, n), ``router`` (B, n): its router's scores of the patch tokens, and
        ``attention`` (B, n): the attention scores the block reads (None where its router reads none).
    """
    check_loo_model(model)
    config = model.amod_config
    if config.skipped != "bypass" or not hasattr(model, "blocks"):
        raise UserError(f"skip importance makes a token skip one block as a bypass MoD block skips it; the model is a "
                        f"{config.skipped} model{'' if hasattr(model, 'blocks') else ' without timm blocks'}")
    model.eval()
    frozen = [r for _, blk in mod_blocks(model) if hasattr(r := blk.router, "freeze_draws")]
    for router in frozen:
        router.freeze_draws(1)
    try:
        result: dict[int, dict[str, Optional[np.ndarray]]] = {}
        for layer, blk in mod_blocks(model):
            if layers is not None and layer not in layers:
                continue
            rows = [_skip_importance_of_image(model, layer, blk, img[None], label, batch)
                    for img, label in zip(images, labels)]
            result[layer] = {key: None if rows[0][key] is None else np.stack([r[key] for r in rows])
                             for key in ("importance", "router", "attention")}
        return result
    finally:
        for router in frozen:
            router.unfreeze_draws()


def _skip_importance_of_image(model: nn.Module, layer: int, blk: nn.Module, image: torch.Tensor,
                              label: torch.Tensor, batch: int) -> dict[str, Optional[np.ndarray]]:
    """``skip_importance`` of one image (1, C, H, W) at one MoD block."""
    p = blk.amod.num_prefix
    x = run_until(model, image, layer)  # (1, N, D)
    handoff = in_handoff(blk)
    prev = handoff.take() if handoff is not None else None  # (1, N) or None
    N = x.shape[1]
    n = N - p
    patch_scores = blk.router.score(x[:, p:], None if prev is None else prev[:, p:])  # (1, n)
    everything = torch.arange(N, device=x.device)[None]  # (1, N)

    def loss_without(skipped: Optional[torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of each row: block ``layer`` processes every token but ``skipped[r]`` (None: every one)."""
        index = everything if skipped is None else _drop_token(everything[..., None], skipped + p)[..., 0]
        T = index.shape[0]
        xe = x.expand(T, -1, -1)
        xs = gather_tokens(xe, index)
        patch_idx = index[:, p:] - p
        ys = blk.gate_updates(blk.block_output(xs), xs, patch_idx, patch_scores.expand(T, -1))
        out = scatter_tokens(xe, index, ys)
        handed = blk.amod.out_handoff
        if handed is not None:  # the next block's scores: this block's attention, as the block itself hands them on
            publish_scores(handed, prev.expand(T, -1), index, N)
        logits = run_replacing_output(model, image, layer, out)
        return F.cross_entropy(logits, label.expand(T), reduction="none")

    base = loss_without(None)
    deltas = [loss_without(torch.arange(s, min(s + batch, n), device=x.device)) - base for s in range(0, n, batch)]
    return {"importance": torch.cat(deltas).float().cpu().numpy(),
            "router": patch_scores[0].float().cpu().numpy(),
            "attention": None if prev is None else prev[0, p:].float().cpu().numpy()}


def run_replacing_output(model: nn.Module, images: torch.Tensor, layer: int, out: torch.Tensor) -> torch.Tensor:
    """Logits of the model's own forward on ``images`` with block ``layer``'s output replaced by ``out`` (its rows,
    however many, go on through the later blocks and the head); the block itself does not run, and the scores it
    hands on are left as they are."""
    blk = model.blocks[layer]
    blk.forward = lambda *args, **kwargs: out  # (an instance attribute: nn.Module.__call__ finds it first)
    try:
        return family_of(model).tensor_module(model)(images)
    finally:
        del blk.forward


@torch.no_grad()
def attention_stats(model: nn.Module, images: torch.Tensor) -> dict[int, dict[str, float]]:
    """Per block: mean attention entropy (nats, per query row), its maximum log N, and the share of
    all attention held by the single most-attended token (attention sinks push it towards 1)."""
    model.eval()
    stats: dict[int, dict[str, float]] = {}
    captured: dict[int, torch.Tensor] = {}
    hooks = [blk.attn.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0]))
             for i, blk in enumerate(model.blocks)]
    try:
        model(images)
    finally:
        for h in hooks:
            h.remove()
    missing = [i for i in range(len(model.blocks)) if i not in captured]
    if missing:  # e.g. an MoD kv block: its selected tokens attend to all of them, outside its attention module
        config = getattr(model, "amod_config", None)
        kind = f"an MoD block with skipped {config.skipped}" if config is not None else "its own code"
        raise UserError(f"attention statistics read the tokens each block's attention module takes; block "
                        f"{missing[0]} computes its attention another way ({kind}), so there are none to read")
    for i, blk in enumerate(model.blocks):
        attn_mod, h = blk.attn, captured[i]
        B, N, _ = h.shape
        q, k, _, _ = attention_inputs(attn_mod, h)
        attn = attention_probs(q * attn_mod.scale, k, 1.0)  # (B, H, N, N)
        entropy = -(attn * attn.clamp_min(1e-12).log()).sum(-1).mean().item()
        received = received_attention(attn)  # (B, N)
        share = received / received.sum(dim=1, keepdim=True)  # (B, N): each token's share of the attention
        stats[i] = {"entropy": entropy, "max_entropy": float(np.log(N)),
                    "top_token_share": received.max(dim=1).values.mean().item(),
                    "received_entropy": -(share * share.clamp_min(1e-12).log()).sum(1).mean().item(),
                    "tokens": N}
    return stats


@torch.no_grad()
def kept_positions(model: nn.Module, images: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per MoD layer: a (B, n_patches) bool mask of the patches that layer processed."""
    set_recording(model, True)
    try:
        model.eval()(images)
        n = model.patch_embed.num_patches
        return {i: torch.zeros(blk.amod_last_index.shape[0], n, dtype=torch.bool).scatter_(1, blk.amod_last_index.cpu(), True)
                for i, blk in mod_blocks(model)}
    finally:
        set_recording(model, False)
