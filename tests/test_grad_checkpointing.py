"""Gradient checkpointing (timm's ``set_grad_checkpointing``): a checkpointed training step gives the
plain step's loss, output and gradients for every router, skipped mode and ToMe, reentrant or not."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import images, make_model, one_torch_thread
from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt

import amod
from amod import tome
from amod.mod.routers import ROUTER_CLASSES, SeededDraws, router_names
from amod.ops import recomputing

ATOL = 1e-6
# reentrant checkpointing runs the forward without grad, on the inference kernels (A-MoD's one-pass scores,
# PyTorch's inference attention): the same function, rounded differently (measured: up to 1.2e-6)
ATOL_REENTRANT = 1e-5


def _allowed(router: str, skipped: str, scale_output: bool) -> bool:
    """What ``amod.convert`` accepts: fold routes parameter-free and unscaled."""
    return skipped != "fold" or not (ROUTER_CLASSES[router].learnable or scale_output)


CASES = [(r, s, so) for r in router_names("timm") for s in ("bypass", "merge", "kv", "fold") for so in (False, True)
         if _allowed(r, s, so)]


def _build(method, family: str = "vit", drop_path: float = 0.0) -> torch.nn.Module:
    """A small model in train mode: ``method`` is "tome" or (router, skipped, scale_output)."""
    model = make_model(family, drop_path_rate=drop_path)
    if method == "tome":
        tome.apply(model, r=[2, 3, 2, 1])
    else:
        router, skipped, scale_output = method
        # consecutive MoD blocks hand A-MoD scores from one MoD block to the next (kv needs a dense block before)
        layers = None if skipped == "fold" else [1, 3] if skipped == "kv" else [1, 2, 3]
        capacity = 0.75 if skipped == "fold" else 0.5  # (fold goes no lower than about 0.5 + protect)
        amod.convert(model, router=router, skipped=skipped, scale_output=scale_output, capacity=capacity, layers=layers)
    return model.train()


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int):
    """One forward and backward: (loss, output, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # drop path: checkpointing replays the global RNG, so both runs draw the same
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return loss.detach(), out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_steps(method, family: str = "vit", drop_path: float = 0.0, steps: int = 2,
                       atol: float = ATOL) -> None:
    """Plain and checkpointed models, from the same weights, agree step for step."""
    plain = _build(method, family, drop_path)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = images(plain, 3)
    y = torch.tensor([1, 4, 7])
    for step in range(steps):  # the random routers' draws must advance once per forward, not per recompute
        loss, out, grads = _step(plain, x, y, seed=step)
        loss_c, out_c, grads_c = _step(ckpt, x, y, seed=step)
        torch.testing.assert_close(loss_c, loss, atol=atol, rtol=0)
        torch.testing.assert_close(out_c, out, atol=atol, rtol=0)
        assert grads_c.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(grads_c[name], grads[name], atol=atol, rtol=0, msg=f"step {step}: {name}")
    calls = [m.calls for m in plain.modules() if isinstance(m, SeededDraws)]
    assert calls == [m.calls for m in ckpt.modules() if isinstance(m, SeededDraws)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds waiting (on a busy 2-core machine, 4 min instead of 15 s)."""
    with one_torch_thread():
        yield


@pytest.fixture
def reentrant():
    before = use_reentrant_ckpt()
    set_reentrant_ckpt(True)
    yield
    set_reentrant_ckpt(before)


@pytest.mark.parametrize("router, skipped, scale_output", CASES)
def test_checkpointed_step_equals_the_plain_step(router, skipped, scale_output):
    _assert_same_steps((router, skipped, scale_output))


def test_checkpointed_tome_equals_the_plain_step():
    _assert_same_steps("tome")


@pytest.mark.parametrize("method", [("attention", "bypass", True), ("random", "merge", False),
                                    ("shuffled-attention", "fold", False), "tome"])
@pytest.mark.parametrize("family", ["registers", "deit_distilled"])
def test_prefix_tokens_and_drop_path(method, family):
    _assert_same_steps(method, family, drop_path=0.2)


@pytest.mark.parametrize("router, skipped, scale_output",
                         [c for c in CASES if not (ROUTER_CLASSES[c[0]].needs_attention and c[2])])
def test_reentrant_checkpointed_step_equals_the_plain_step(reentrant, router, skipped, scale_output):
    _assert_same_steps((router, skipped, scale_output), steps=1, atol=ATOL_REENTRANT)


def test_reentrant_checkpointed_tome_equals_the_plain_step(reentrant):
    _assert_same_steps("tome", steps=1, atol=ATOL_REENTRANT)


@pytest.mark.parametrize("router", [r for r in router_names("timm") if ROUTER_CLASSES[r].needs_attention])
def test_reentrant_checkpointing_refuses_gradients_through_a_mod_scores(reentrant, router):
    # its forward runs without grad: the scaled outputs' gradient into the block before would be lost
    model = _build((router, "bypass", True))
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match=r"reentrant gradient checkpointing .*set_reentrant_ckpt\(False\)"):
        model(images(model, 2))


@pytest.mark.parametrize("method", [("attention", "bypass", True), ("random", "fold", False), "tome"])
def test_forward_intermediates_checkpoints_block_by_block(method):
    # timm's forward_intermediates checkpoints each block on its own (timm.models.checkpoint, not checkpoint_seq)
    plain = _build(method)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = images(plain, 2)
    grads = []
    for model in (plain, ckpt):
        model.zero_grad(set_to_none=True)
        final, inter = model.forward_intermediates(x, output_fmt="NLC")  # NLC: fold and ToMe drop tokens
        (final.square().mean() + sum(t.mean() for t in inter)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[1].keys() == grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=ATOL, rtol=0)


def test_two_forwards_then_one_backward():
    # e.g. two crops per step: each recompute must find its own forward's state
    plain = _build(("random", "fold", False))
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    xa, xb = images(plain, 2, seed=1), images(plain, 3, seed=2)
    grads = []
    for model in (plain, ckpt):
        model.zero_grad(set_to_none=True)
        (model(xa).square().mean() + model(xb).logsumexp(1).mean()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", [("attention", "bypass", True), ("attention", "fold", False), "tome"])
def test_memos_live_only_with_the_graph_and_a_lost_one_is_an_error(method):
    model = _build(method)
    model.set_grad_checkpointing(True)
    x = images(model, 2)
    settings = [blk.amod for blk in model.blocks if hasattr(blk, "amod")]  # MoD, fold and ToMe blocks
    memos = [s.memo for s in settings]
    handoffs = [s.in_handoff for s in settings if getattr(s, "in_handoff", None) is not None]
    assert len(memos) >= 3
    with torch.no_grad():
        model(x)
    assert all(len(m) == 0 for m in memos), "no memo without grad"
    model(x).sum().backward()
    assert all(len(m) == 0 for m in memos), "the backward freed the graph: nothing may stay"
    assert all(h.scores is None for h in handoffs), "a recompute hands no scores on"
    out = model(x)
    assert all(len(m) == 1 for m in memos)
    memos[-2].clear()
    with pytest.raises(RuntimeError, match="block found no record of its forward"):
        out.sum().backward()


def test_a_block_run_twice_on_one_input_before_the_backward_is_refused():
    # two forwards drew different random tokens: a recompute could not tell which one it redoes
    blk = _build(("random", "bypass", False)).blocks[1]
    x = torch.randn(2, 17, 192, requires_grad=True)  # CLS + 16 patch tokens of the tiny ViT
    y = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False) + \
        torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="ran twice on the same input before the backward"):
        y.sum().backward()


def test_recomputing_is_true_only_inside_a_checkpoint_recompute():
    seen = []

    def fn(t):
        seen.append(recomputing())
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    for reentrant_mode in (False, True):
        seen.clear()
        torch.utils.checkpoint.checkpoint(fn, x * 1, use_reentrant=reentrant_mode).sum().backward()
        assert seen == [False, True]
    fn(x).sum().backward()
    assert seen[-1] is False
