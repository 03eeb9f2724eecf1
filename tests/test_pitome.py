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
from amod.tome.pitome import energy_merge, margin, pitome_count


def merge_by_definition(x, size, metric, r, p, m):
    """The paper's rule written as plainly as possible, one image at a time: the tokens left, (M, D) each."""
    out = []
    for i in range(x.shape[0]):
        keys = F.normalize(metric[i, p:].double(), dim=-1)
        n = keys.shape[0]
        energy = [sum(F.elu(keys[a] @ keys[b] - m).item() for b in range(n)) / n for a in range(n)]
        order = sorted(range(n), key=lambda t: -energy[t])
        cand, protected = order[:2 * r], order[2 * r:]
        a_set, b_set = cand[0::2], cand[1::2]
        sums = {b: (x[i, p + b].double() * size[i, p + b].double(), size[i, p + b].double()) for b in b_set}
        for a in a_set:
            partner = max(b_set, key=lambda b: (keys[a] @ keys[b]).item())
            s, w = sums[partner]
            sums[partner] = (s + x[i, p + a].double() * size[i, p + a].double(), w + size[i, p + a].double())
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


def test_the_merge_is_the_papers_rule():
    g = torch.Generator().manual_seed(0)
    B, p, n, D = 3, 2, 11, 6
    x = torch.randn(B, p + n, D, generator=g)
    size = torch.randint(1, 4, (B, p + n, 1), generator=g).float()
    size[:, :p] = 1  # prefix tokens never merge
    metric = F.normalize(torch.randn(B, p + n, 5, generator=g), dim=-1)  # (the attention's unit vectors)
    for r in (1, 3, 5):
        out, new_size = energy_merge(x, size, metric, r, p, margin(2, 12))
        assert out.shape == (B, p + n - r, D) and new_size.shape == (B, p + n - r, 1)
        assert torch.equal(out[:, :p], x[:, :p]) and torch.equal(new_size[:, :p], size[:, :p])  # prefix untouched
        assert torch.allclose(new_size.sum(1), size.sum(1))  # every patch is still counted once
        expected = merge_by_definition(x, size, metric, r, p, margin(2, 12))
        assert all(same_rows(got, want) for got, want in zip(out, expected))


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
    assert margin(0, 12) == pytest.approx(0.9) and margin(11, 12) == pytest.approx(0.9 - 0.8 * 11 / 12)
    model = amod.pitome.apply(make_model("dinov2_reg"), cost=0.6)
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
