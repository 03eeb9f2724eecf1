"""PiToMe (amod.pitome): the merge against a plain loop over its definition, the isolated tokens it protects, its
schedule and cost, and what it refuses. Every family's contract (capacity 1, MACs against FlopCounterMode, save and
load, bf16, gradient checkpointing, compile, the DETR refusal) is tests/test_families.py's; ONNX tests/test_export.py's."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import images, make_model

import amod
from amod.tome.pitome import energy_merge, margin, matches_all, pitome_count


def merge_by_definition(x, size, metric, r, p, m, match_all=False):
    """The public code's rule written as plainly as possible, one image at a time: the tokens left, (M, D) each."""
    out = []
    for i in range(x.shape[0]):
        keys = F.normalize(metric[i, p:].double(), dim=-1)
        n = keys.shape[0]
        energy = [sum(F.elu(keys[a] @ keys[b] - m).item() for b in range(n)) / n for a in range(n)]
        order = sorted(range(n), key=lambda t: -energy[t])
        split = n if match_all else 2 * r  # early blocks: every token is matched; later: the 2r of highest energy
        a_set, b_set, protected = order[0:split:2], order[1:split:2], order[split:]
        partner = {a: max(b_set, key=lambda b: (keys[a] @ keys[b]).item()) for a in a_set}
        if match_all:  # the r A tokens with the most similar partners merge, the other A tokens stay
            a_set = sorted(a_set, key=lambda a: -(keys[a] @ keys[partner[a]]).item())
            a_set, protected = a_set[:r], a_set[r:]
        sums = {b: (x[i, p + b].double() * size[i, p + b].double(), size[i, p + b].double()) for b in b_set}
        for a in a_set:
            partner_a = partner[a]
            s, w = sums[partner_a]
            sums[partner_a] = (s + x[i, p + a].double() * size[i, p + a].double(), w + size[i, p + a].double())
        rows = [x[i, t].double() for t in range(p)] + [x[i, p + t].double() for t in protected] + \
               [s / w for s, w in sums.values()]
        out.append(torch.stack(rows))
    return out


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (M, D) sets of rows are the same, in any order (within float32 rounding)."""
    left = list(b.double())
    for row in a.double():
        match = next((i for i, other in enumerate(left) if (other - row).abs().max() < 1e-5), None)
        if match is None:
            return False
        left.pop(match)
    return not left


@pytest.mark.parametrize("match_all", [False, True])
def test_the_merge_is_the_public_rule(match_all):
    g = torch.Generator().manual_seed(0)
    B, p, n, D = 3, 2, 11, 6
    x = torch.randn(B, p + n, D, generator=g)
    size = torch.randint(1, 4, (B, p + n, 1), generator=g).float()
    size[:, :p] = 1  # prefix tokens never merge
    metric = F.normalize(torch.randn(B, p + n, 5, generator=g), dim=-1)  # (the attention's unit vectors)
    for r in (1, 3, 5):
        out, new_size = energy_merge(x, size, metric, r, p, margin(2, 12), match_all)
        assert out.shape == (B, p + n - r, D) and new_size.shape == (B, p + n - r, 1)
        assert torch.equal(out[:, :p], x[:, :p]) and torch.equal(new_size[:, :p], size[:, :p])  # prefix untouched
        assert torch.allclose(new_size.sum(1), size.sum(1))  # every patch is still counted once
        expected = merge_by_definition(x, size, metric, r, p, margin(2, 12), match_all)
        assert all(same_rows(got, want) for got, want in zip(out, expected))


def test_early_blocks_merge_the_best_match_of_all_tokens_and_late_blocks_protect():
    """By hand: three tokens X with pairwise cosine 0.9, two identical tokens Y, one isolated token Z (orthogonal to
    the rest), margin 0.5. Energies (x 6): X 0.5 + 2 · 0.4 + 3 (e^-0.5 − 1) ≈ 0.12, Y 2 · 0.5 + 4 (e^-0.5 − 1) ≈ −0.57,
    Z 0.5 + 5 (e^-0.5 − 1) ≈ −1.47: energy ranks X X X Y Y Z. Removing one token: a late block's candidates are the
    two top-ranked X tokens, which merge; an early block matches A = ranks 0, 2, 4 (X, X, Y) against B = ranks 1, 3, 5
    (X, Y, Z), and its best pair is Y with Y (cosine 1 against 0.9), which merges."""
    e = torch.eye(8)
    X = [0.9 ** 0.5 * e[0] + 0.1 ** 0.5 * e[3 + k] for k in range(3)]
    Y, Z = e[1], e[2]
    patches = torch.stack([Y, X[0], Z, X[1], Y, X[2]])  # positions shuffled
    x = torch.cat([torch.zeros(1, 8), patches]).unsqueeze(0)  # one prefix token first

    def kept(out, size, v, s):  # whether a token left equals v and stands for s patches
        return any(torch.allclose(row, v, atol=1e-6) and n.item() == s for row, n in zip(out[0, 1:], size[0, 1:]))

    out, size = energy_merge(x, None, x, 1, 1, 0.5, match_all=True)
    assert out.shape == (1, 6, 8) and kept(out, size, Y, 2)  # the two Y merged into one of size 2
    assert all(kept(out, size, v, 1) for v in (*X, Z))  # every X and Z kept as it was

    out, size = energy_merge(x, None, x, 1, 1, 0.5, match_all=False)
    assert out.shape == (1, 6, 8) and kept(out, size, Z, 1)
    assert sum(torch.allclose(row, Y) and n.item() == 1 for row, n in zip(out[0, 1:], size[0, 1:])) == 2  # Y protected
    assert any(kept(out, size, (X[i] + X[j]) / 2, 2) for i, j in ((0, 1), (0, 2), (1, 2)))  # two X merged


def test_an_isolated_token_is_protected_and_near_duplicates_merge():
    # ten tokens in two tight clusters and one far from both: the isolated one has the lowest energy
    g = torch.Generator().manual_seed(1)
    centres = torch.eye(8)[:3] * 4
    keys = torch.cat([centres[0] + 0.01 * torch.randn(5, 8, generator=g), centres[1] + 0.01 * torch.randn(5, 8, generator=g),
                      centres[2:3]])
    x = torch.cat([torch.zeros(1, 8), keys]).unsqueeze(0)  # one prefix token, then the 11 patch tokens
    out, size = energy_merge(x, torch.ones(1, 12, 1), F.normalize(x, dim=-1), 5, 1, 0.5)
    kept = [i for i, row in enumerate(out[0]) if torch.equal(row, centres[2])]
    assert len(kept) == 1 and size[0, kept[0]].item() == 1  # kept as it was, on its own
    assert out.shape[1] == 1 + 6 and size[0, 1:].sum().item() == 11  # five merges among the ten clustered tokens


def test_keep_sets_the_schedule_and_cost_is_matched():
    assert [pitome_count(0.9, t) for t in (64, 58, 10, 1)] == [6, 5, 1, 0]
    assert pitome_count(0.5, 9) == 4 and pitome_count(1.0, 64) == 0  # at most half; keep 1 merges nothing
    # the public code's schedule (hchautran/PiToMe's timm patch): margin 0.75 − 0.75 l / L, the first half match all
    assert [margin(i, 12) for i in (0, 6, 11)] == pytest.approx([0.75, 0.375, 0.75 / 12])
    assert [matches_all(i, 12) for i in range(12)] == [True] * 6 + [False] * 6
    assert [matches_all(i, 3) for i in range(3)] == [True, True, False]
    model = amod.pitome.apply(make_model("dinov2_reg"), cost=0.6)
    depth = len(model.blocks)
    assert [(b.amod.margin, b.amod.match_all) for b in model.blocks] == \
        [(margin(i, depth), matches_all(i, depth)) for i in range(depth)]
    assert abs(amod.flops(model).ratio - 0.6) < 0.02 * 0.6
    assert amod.method_of(model) == amod.PiToMe(keep=model.amod_pitome.keep)
    with torch.no_grad():
        model(images(model))
    tokens = [blk.amod_last_tokens for blk in model.blocks]
    assert tokens == sorted(tokens, reverse=True) and tokens[-1] < 5 + 16  # registers and CLS stay
    amod.pitome.set_keep(model, 1.0)
    dense = make_model("dinov2_reg")
    with torch.no_grad():
        assert torch.equal(model(images(model)), dense(images(dense)))


def test_refusals_name_the_problem():
    model = make_model("vit")
    for bad in (0.4, 1.5, True):
        with pytest.raises(ValueError, match=r"keep must be a number in \[0.5, 1\]"):
            amod.pitome.apply(copy.deepcopy(model), keep=bad)
    with pytest.raises(ValueError, match="exactly one of keep= .* and cost="):
        amod.pitome.apply(copy.deepcopy(model))
    with pytest.raises(ValueError, match="MoD model"):
        amod.pitome.apply(amod.convert(copy.deepcopy(model)), keep=0.9)
    merged = amod.pitome.apply(copy.deepcopy(model), keep=0.9)
    with pytest.raises(ValueError, match="already merges tokens"):
        amod.pitome.apply(merged, keep=0.8)
    with pytest.raises(ValueError, match="already merges tokens"):
        amod.tome.apply(merged, r=2)
    with pytest.raises(ValueError, match="does not merge with PiToMe"):
        amod.pitome.set_keep(model, 0.8)
