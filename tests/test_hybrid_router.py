"""The hybrid router (``amod.mod.routers.HybridRouter``): A-MoD's scores times exp of a learned correction whose
weight starts at zero. At initialisation it is A-MoD bit for bit (scores, kept tokens, outputs) under either output
rule; it gets a gradient from the first backward in both (the gate, or its straight-through estimator), and moves
away from A-MoD once trained; its weights save and load. The other contracts every router keeps (gradient
checkpointing, bf16 autocast, save/load on every family) run over ``router_names()`` in tests/test_families.py and
tests/test_grad_checkpointing.py; ONNX export in tests/test_export.py."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import cli_in_process, images, make_model, one_torch_thread

import amod
from amod.mod.routers import HybridRouter, router_class, router_names, vit_routers

LAYERS = [1, 2, 3]  # consecutive MoD blocks: the scores an MoD block passes on are read too
CAPACITY = 0.5
ARMS = [pytest.param(True, id="scaled"), pytest.param(False, id="straight-through")]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors; a busy 2-core machine: one intra-op thread."""
    with one_torch_thread():
        yield


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus a loss on every output token: the last block's patch tokens reach no class-token logit
    (they are its output only), so its router would get a zero gradient from the logits alone."""
    features = model.forward_features(x)
    return F.cross_entropy(model.forward_head(features), y) + features.square().mean()


def pair(scale_output: bool, variant: str = "vit", **extra):
    """The same model converted with A-MoD and with the hybrid router."""
    dense = make_model(variant, **extra)
    return tuple(amod.convert(copy.deepcopy(dense), router=r, capacity=CAPACITY, layers=LAYERS,
                              scale_output=scale_output) for r in ("attention", "hybrid"))


def capture_scores(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every MoD block's patch scores of each forward, in the order the blocks score."""
    seen: list[torch.Tensor] = []
    for _, blk in amod.mod_blocks(model):
        score = blk.router.score

        def recording(x_patch, attention_scores, score=score):
            out = score(x_patch, attention_scores)
            seen.append(out.detach().clone())
            return out

        blk.router.score = recording  # (an instance attribute: only this copy of the model records)
    return seen


def run(model: torch.nn.Module, x: torch.Tensor, grad: bool):
    """(output, [each MoD block's scores], [each MoD block's kept patch indices]) of one forward."""
    amod.set_recording(model, True)
    seen = capture_scores(model)
    with torch.set_grad_enabled(grad):
        out = model(x)
    kept = [blk.amod_last_index.clone() for _, blk in amod.mod_blocks(model)]
    return out, seen, kept


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) == len(LAYERS)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and torch.equal(u, v)


@pytest.mark.parametrize("scale_output", ARMS)
def test_at_init_the_hybrid_router_is_a_mod_bit_for_bit(scale_output):
    att, hyb = pair(scale_output)
    x = images(att, 3)
    # evaluation (what zero-training accuracy measures), and the training forward with grad on
    for train, grad in ((False, False), (True, True)):
        att.train(train), hyb.train(train)
        out_a, scores_a, kept_a = run(att, x, grad)
        out_h, scores_h, kept_h = run(hyb, x, grad)
        assert_same(scores_h, scores_a)
        assert_same(kept_h, kept_a)
        # scaled: the same gate; straight-through: y + (y - x) * 0 (amod.mod.block.gated_updates), y itself
        assert torch.equal(out_h, out_a)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 autocast: the same too
        att.eval(), hyb.eval()
        assert torch.equal(hyb(x), att(x))


@pytest.mark.parametrize("scale_output", ARMS)
def test_the_correction_gets_a_gradient_from_zero_in_both_output_rules(scale_output):
    att, hyb = pair(scale_output)
    hyb.train()
    x, y = images(hyb, 4), torch.tensor([1, 4, 7, 2])
    for _, blk in amod.mod_blocks(hyb):
        assert not blk.router.proj.weight.any()
    loss_of(hyb, x, y).backward()
    for i, blk in amod.mod_blocks(hyb):
        grad = blk.router.proj.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, i
    # the backward changed no weight: the forward (evaluation) is still A-MoD's, also in the straight-through arm
    with torch.no_grad():
        att.eval(), hyb.eval()
        assert torch.equal(hyb(x), att(x))


@pytest.mark.parametrize("scale_output", ARMS)
def test_after_a_step_the_scores_are_its_own(scale_output):
    att, hyb = pair(scale_output)
    hyb.train()
    x, y = images(hyb, 4), torch.tensor([1, 4, 7, 2])
    routers = [p for n, p in hyb.named_parameters() if ".router." in n]
    assert len(routers) == len(LAYERS)  # one weight (d,) per MoD block, no bias
    opt = torch.optim.Adam(routers, lr=1e-3)
    loss_of(hyb, x, y).backward()
    opt.step()
    att.eval(), hyb.eval()
    _, scores_a, _ = run(att, x, grad=False)
    out_h, scores_h, _ = run(hyb, x, grad=False)
    # every block scores differently from A-MoD, on the tokens it reads (the first MoD block reads the same ones)
    assert not torch.equal(scores_h[0], scores_a[0])
    torch.testing.assert_close(scores_h[0], scores_a[0], rtol=0.3, atol=0)  # a small correction: exp(c) near 1
    for s in scores_h:
        assert (s > 0).all()  # A-MoD's positive scores times exp(c): still positive
    if scale_output:  # the gates follow the scores
        with torch.no_grad():
            assert not torch.equal(out_h, att(x))


def test_a_router_lr_moves_the_routers_alone_at_their_own_rate():
    """``engine.param_groups(router_lr=...)``: the routers' parameters, and only they, take the rate (AdamW's first
    step moves a weight by about its rate); every other parameter steps exactly as without it. A model without a
    learned router is refused in one line."""
    from amod.errors import UserError
    from amod.train.engine import param_groups

    _, hyb = pair(False)
    hyb.train()
    x, y = images(hyb, 4), torch.tensor([1, 4, 7, 2])
    routers = {id(blk.router.proj.weight) for _, blk in amod.mod_blocks(hyb)}
    groups = param_groups(hyb, 0.05, router_lr=1e-2)
    plain = param_groups(hyb, 0.05)
    # (the router weights are (1, d) matrices: they leave the decayed group for a decayed group of their own)
    assert len(groups) == 3 and [len(g["params"]) for g in plain] == [len(groups[0]["params"]) + len(routers),
                                                                      len(groups[1]["params"])]
    listed = [id(p) for g in groups for p in g["params"]]
    assert sorted(listed) == sorted(id(p) for p in hyb.parameters()) and len(set(listed)) == len(listed)
    assert {id(p) for g in groups if "lr" in g for p in g["params"]} == routers
    assert all(g["lr"] == 1e-2 and g["weight_decay"] == 0.05 for g in groups if "lr" in g)  # (d,)-row matrices
    assert len(plain) == 2 and not any("lr" in g for g in plain)
    assert {id(p) for g in plain for p in g["params"]} == set(listed)

    def one_step(router_lr):
        model = copy.deepcopy(hyb)
        # (eps far below the tiny model's router gradients, ~1e-8: the first step is then lr * sign(grad))
        opt = torch.optim.AdamW(param_groups(model, 0.05, router_lr), lr=1e-5, eps=1e-20)
        loss_of(model, x, y).backward()
        opt.step()
        return dict(model.named_parameters())

    fast, slow = one_step(1e-2), one_step(None)
    for name, p in fast.items():
        if ".router." in name:  # from zero, AdamW's first step is lr * sign(grad) where the gradient is not 0
            assert p.abs().max().item() == pytest.approx(1e-2, rel=1e-3), name
            assert slow[name].abs().max().item() == pytest.approx(1e-5, rel=1e-3), name
        else:
            assert torch.equal(p, slow[name]), name
    att, _ = pair(False)
    with pytest.raises(UserError, match=r"^--router-lr is for a learned router"):
        param_groups(att, 0.05, router_lr=1e-3)


def test_train_takes_a_router_lr_and_refuses_one_without_a_learned_router(tmp_path, capsys):
    """``amod train --router-lr``: recorded in the run's settings (a resume with another rate is refused as any
    changed setting is); zero, or a router without parameters, is refused in one line."""
    import yaml

    tiny = ["--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "3", "--embed-dim", "32",
            "--num-heads", "2", "--train-limit", "64", "--val-limit", "32", "--batch-size", "32", "--epochs", "1",
            "--capacity", "0.5"]
    out = tmp_path / "hybrid"
    res = cli_in_process(["train", *tiny, "--router", "hybrid", "--router-lr", "1e-2", "--out", str(out)], capsys)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["router_lr"] == 1e-2
    for args, message in ((["--router", "hybrid", "--router-lr", "0"], "--router-lr must be a positive number"),
                          (["--router", "attention", "--router-lr", "1e-3"], "--router-lr is for a learned router")):
        res = cli_in_process(["train", *tiny, *args, "--out", str(tmp_path / "refused")], capsys)
        assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
            res.stderr


def test_save_and_load_keep_its_weights_and_outputs(tmp_path):
    _, hyb = pair(True)
    torch.manual_seed(3)
    for _, blk in amod.mod_blocks(hyb):  # trained-looking weights, so that they matter
        torch.nn.init.normal_(blk.router.proj.weight, std=0.5)
    path = amod.save(hyb, tmp_path / "hybrid.safetensors")
    loaded = amod.load(path).eval()
    assert amod.get_config(loaded) == amod.get_config(hyb) and amod.get_config(loaded).router == "hybrid"
    for (_, a), (_, b) in zip(amod.mod_blocks(hyb), amod.mod_blocks(loaded)):
        assert isinstance(b.router, HybridRouter) and torch.equal(a.router.proj.weight, b.router.proj.weight)
    x = images(hyb, 3)
    with torch.no_grad():
        assert torch.equal(loaded(x), hyb(x))


def test_registry_conversion_defaults_and_cost():
    cls = router_class("hybrid")
    assert cls is HybridRouter and cls.needs_attention and cls.learnable and cls.families is None
    assert "hybrid" in vit_routers() and all("hybrid" in router_names(f) for f in ("timm", "detr", "hf-clip"))
    dense = make_model("vit")
    keys = set(dense.state_dict())
    hyb = amod.convert(copy.deepcopy(dense), router="hybrid", capacity=0.5)
    att = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5)
    cfg = amod.get_config(hyb)
    # unscaled by default, as A-MoD: the default conversion is A-MoD's default model at initialisation
    assert cfg.scale_output is False and amod.get_config(att).scale_output is False
    assert set(hyb.state_dict()) - keys == {f"blocks.{i}.router.proj.weight" for i in cfg.layers}
    x = images(dense, 2)
    with torch.no_grad():
        assert torch.equal(hyb(x), att(x))
    # its cost: A-MoD's plus the Linear(d, 1) on every patch token of every MoD block
    n = hyb.patch_embed.num_patches
    d = hyb.embed_dim
    assert amod.flops(hyb).macs - amod.flops(att).macs == len(cfg.layers) * n * d
    # fold routes parameter-free: refused, as the standard router is
    with pytest.raises(ValueError, match="skipped='fold' routes with a parameter-free router"):
        amod.convert(copy.deepcopy(dense), router="hybrid", skipped="fold")


def test_the_cli_takes_it(capsys):
    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--router", "hybrid", "--capacity", "1", "0.5"], capsys)
    assert res.returncode == 0, res.stderr
    assert "router=hybrid" in res.stdout


def test_it_compiles_without_a_graph_break():
    import torch._dynamo

    _, hyb = pair(True)
    for _, blk in amod.mod_blocks(hyb):
        torch.nn.init.normal_(blk.router.proj.weight, std=0.1)
    x = images(hyb, 4)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = hyb(x)
        got = torch.compile(hyb, backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("scale_output", ARMS)
def test_ddp_without_unused_parameters_trains_it(scale_output, tmp_path):
    """DDP without ``find_unused_parameters`` raises at the next step if a parameter got no gradient: the correction
    must get one every step in both output rules (one process over gloo; tests/ddp_worker.py runs two)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _, hyb = pair(scale_output, global_pool="avg")  # every output token reaches the logits: every router learns
    hyb.train()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(hyb)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        x, y = images(hyb, 4), torch.tensor([1, 4, 7, 2])
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            assert all(p.grad is not None for p in hyb.parameters())
            assert all(blk.router.proj.weight.grad.any() for _, blk in amod.mod_blocks(hyb))
            opt.step()
    finally:
        dist.destroy_process_group()
