"""A reduction's discrete decisions (which tokens merge, into which, in what order; which are protected or kept)
depend on its input alone: scores a few ulps apart, as another backend or batch size computes them, decide as the
exact scores do (``amod.tokens.decision_key``), at every site that decides; and a reduced model's output for an
image does not depend on the batch it is in."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model

import amod
import amod.ppt
from amod.deploy import flat_region_images
from amod.mod.block import MergeMode
from amod.mod.routing import select_tokens
from amod.tokens import DECISION_GRID, best_match, bipartite_matching, decision_key, descending_order
from amod.tome.pitome import energy_merge


def ulps(t: torch.Tensor, seed: int, count: int = 4) -> torch.Tensor:
    """``t`` with each element moved by up to ``count`` ulps (float32), as another kernel's rounding moves it."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(-count, count + 1, t.shape, generator=g).float()
    return t * (1 + steps * 2.0 ** -23)


def half_vectors(batch: int, tokens: int, seed: int) -> torch.Tensor:
    """(batch, tokens, 8) unit vectors with four entries of 1/2: their cosines are exactly 0, 1/4, 1/2, 3/4 or 1,
    grid points of any decision grid, and most of them tie."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(batch, tokens, 8, generator=g).argsort(-1)[..., :4]
    return torch.zeros(batch, tokens, 8).scatter_(-1, pick, 0.5)


def test_the_decision_key_is_a_grid_that_noise_below_its_step_does_not_move():
    scores = torch.tensor([[0.75, 0.75 + 1e-7, 0.75 - 1e-7, 0.75 + 0.4 * DECISION_GRID, 0.75 + DECISION_GRID,
                            float("-inf")]])
    key = decision_key(scores)
    assert key[0, :4].unique().numel() == 1 and key[0, 4] == key[0, 0] + 1 and key[0, 5] == float("-inf")
    assert torch.equal(key, key.round())  # whole steps
    # the unit scales the grid: attention shares of n tokens (about 1/n each) on steps of DECISION_GRID / n
    assert torch.equal(decision_key(scores / 64, 1 / 64)[:, :5], key[:, :5])
    # near-ties are decided by position, the lower first, as exact ties are
    assert descending_order(scores)[0].tolist() == [4, 0, 1, 2, 3, 5]
    assert best_match(scores)[1].item() == 4 and best_match(scores[:, :4])[1].item() == 0


def test_bipartite_matching_decides_near_ties_as_exact_ties():
    """ToMe's and fold's matching: each A token's partner and the order the A tokens merge in, with and without
    protected tokens."""
    metric = half_vectors(4, 1 + 40, seed=0)  # one prefix token
    protected = torch.rand(4, 40, generator=torch.Generator().manual_seed(1)) < 0.25
    for mask in (None, protected):
        order, partner = bipartite_matching(metric, 1, mask)
        for seed in range(3):
            near = bipartite_matching(ulps(metric, seed), 1, mask)
            assert torch.equal(near[0], order) and torch.equal(near[1], partner)


def test_top_k_selection_decides_near_ties_as_exact_ties():
    """MoD's kept tokens and fold's protected ones: attention shares of n tokens, tied in four values."""
    n = 48
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(1, 5, (4, n), generator=g).float() / (4 * n)
    unit = amod.mod.routers.AttentionRouter().score_unit(n)
    kept = select_tokens(scores, 20, unit)
    for seed in range(3):
        assert torch.equal(select_tokens(ulps(scores, seed), 20, unit), kept)


def test_fold_protects_the_same_tokens_under_noise():
    """Fold's block on its own: the attention shares it protects by, tied, moved by a few ulps."""
    model = amod.convert(make_model("vit", depth=2), skipped="fold", capacity=0.7)
    blk = model.blocks[0]
    p, t = model.num_prefix_tokens, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, p + t, 192, generator=g)
    metric = half_vectors(2, p + t, seed=1)
    importance = torch.randint(1, 4, (2, p + t), generator=g).float() / (p + t)
    r = blk._removed(t)
    out, size = blk._reduce(x, None, metric, importance, r)
    for seed in range(3):
        near_out, near_size = blk._reduce(x, None, metric, ulps(importance, seed), r)
        assert torch.equal(near_out, out) and torch.equal(near_size, size)


def test_pitome_orders_and_pairs_near_ties_as_exact_ties():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1 + 30, 6, generator=g)
    metric = half_vectors(3, 1 + 30, seed=1)
    out, size = energy_merge(x, None, metric, 10, 1, 0.5)
    for seed in range(3):
        near_out, near_size = energy_merge(x, None, ulps(metric, seed), 10, 1, 0.5)
        assert torch.equal(near_out, out) and torch.equal(near_size, size)


def test_mod_merge_pairs_near_ties_as_exact_ties():
    """The skipped mode ``merge``: each skipped token's kept partner, among kept tokens that are copies."""
    model = amod.convert(make_model("vit", depth=2), capacity=0.5, skipped="merge")
    blk = model.blocks[1]
    p, n = model.num_prefix_tokens, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, p + n, 192, generator=g)
    x[:, p + 1::2] = x[:, p:p + 1]  # every odd patch a copy of the first: kept copies tie as partners
    patch_idx = torch.arange(1, n, 2).expand(2, -1)  # the copies are kept
    xs = amod.tokens.gather_tokens(x, amod.mod.routing.keep_index(patch_idx, p))
    partner = MergeMode.merge_skipped(blk, x, xs, patch_idx)[2]
    assert (partner == 0).all()  # exact ties: the first kept copy
    for seed in range(3):
        near = ulps(x, seed)
        near_xs = amod.tokens.gather_tokens(near, amod.mod.routing.keep_index(patch_idx, p))
        assert torch.equal(MergeMode.merge_skipped(blk, near, near_xs, patch_idx)[2], partner)


REDUCTIONS = {
    "fold": lambda m: amod.convert(m, skipped="fold", capacity=0.5),
    "tome": lambda m: amod.tome.apply(m, r=3),
    "pitome": lambda m: amod.pitome.apply(m, keep=0.6),
    "ppt": lambda m: amod.ppt.apply(m, r=3, threshold=1.3e-5),  # (pools some of these images and prunes others)
}


@pytest.mark.parametrize("name", REDUCTIONS)
def test_an_images_output_does_not_depend_on_its_batch(name):
    """On images with flat regions, whose background tokens are near-equal (here: a position embedding shrunk to
    1e-4 of its size, so they are as close as a real model's background tokens get), row i of a batch is image i
    alone. A batch's kernels round differently; with decisions on the raw scores 3 to 13 of these 24 images moved by
    up to 0.008 (fold 7, ToMe 3, PiToMe 13)."""
    model = make_model("vit", depth=4)
    with torch.no_grad():
        model.pos_embed.mul_(1e-4)
    model = REDUCTIONS[name](model)
    x = flat_region_images(24, 3, 32, 32, seed=0)
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
    assert (together - alone).abs().max() < 1e-5
