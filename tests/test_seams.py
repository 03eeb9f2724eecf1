"""A router and a skipped mode are each one class, and a command one entry: toys of each, defined here, are built,
priced, trained, saved, loaded, chosen and run on the command line with nothing else of amod changed. (A method's
toy is in ``test_method_seam.py``.)"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from conftest import images, make_model
from torch import nn

import amod
from amod.cli import main as amod_main
from amod.cost import count_flops
from amod.mod import config as mod_config
from amod.mod.block import MoDMode
from amod.mod.modes import MODES, register_skipped_mode
from amod.mod.routers import ROUTER_CLASSES, Router, register_router
from amod.tokens import scatter_tokens

TOY_ROUTER, TOY_MODE = "toy-linear", "toy-zero"


class ToyRouter(Router):
    """A learned router: one linear layer per patch token, squashed to (0, 1) (priced by ``Router.macs``)."""

    learnable = True

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    @classmethod
    def build(cls, dim: int, seed: int) -> "ToyRouter":
        return cls(dim)

    def score(self, x_patch: torch.Tensor, attention_scores: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.proj(x_patch)).squeeze(-1)  # (B, n)


class ZeroMode(MoDMode):
    """Skipped tokens leave the block as zeros (priced as bypass: zeros cost nothing)."""

    def forward(self, block, x, xs, index, patch_idx, patch_scores):
        ys = block.gate_updates(block.block_output(xs), xs, patch_idx, patch_scores)
        return scatter_tokens(torch.zeros_like(x), index, ys)


@pytest.fixture
def toy_router():
    register_router(TOY_ROUTER)(ToyRouter)
    yield TOY_ROUTER
    del ROUTER_CLASSES[TOY_ROUTER]


@pytest.fixture
def toy_mode():
    register_skipped_mode(TOY_MODE)(ZeroMode)
    yield TOY_MODE
    del MODES[TOY_MODE]


def assert_priced_as_measured(model: nn.Module) -> None:
    measured = count_flops(model, images(model, 2)) / 2  # per image
    analytic = amod.flops(model).flops
    assert abs(analytic - measured) / measured < 0.02, (analytic, measured)


def assert_saved_and_loaded(model: nn.Module, path) -> nn.Module:
    again = amod.load(amod.save(model, path))
    x = images(model, 2)
    with torch.no_grad():
        assert torch.equal(model(x), again(x))
    assert again.amod_config == model.amod_config and amod.flops(again).macs == amod.flops(model).macs
    return again


def test_a_router_class_is_registered_priced_trained_and_saved(toy_router, tmp_path):
    assert toy_router in mod_config.ROUTERS
    model = amod.convert(make_model("vit"), router=toy_router, capacity=0.5)
    assert all(type(b.router) is ToyRouter for _, b in amod.mod_blocks(model))
    assert_priced_as_measured(model)
    # exactly one linear layer over every patch token of each MoD block more than a parameter-free router
    random = amod.convert(make_model("vit"), router="random", capacity=0.5)
    n, dim = model.patch_embed.num_patches, model.embed_dim
    assert amod.flops(model).macs - amod.flops(random).macs == len(model.amod_config.layers) * n * dim

    model.train()
    before = {i: b.router.proj.weight.detach().clone() for i, b in amod.mod_blocks(model)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = images(model, 8), torch.arange(8) % 10
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    # block 1's router learns (block 3's patch tokens never reach the class-token head: no gradient there)
    assert not torch.equal(dict(amod.mod_blocks(model))[1].router.proj.weight, before[1])

    again = assert_saved_and_loaded(model.eval(), tmp_path / "toy.safetensors")
    trained = dict(amod.mod_blocks(model))
    for i, b in amod.mod_blocks(again):
        assert type(b.router) is ToyRouter and torch.equal(b.router.proj.weight, trained[i].router.proj.weight)


def test_a_skipped_mode_class_is_registered_priced_run_and_saved(toy_mode, tmp_path):
    assert toy_mode in mod_config.SKIPPED_MODES
    model = amod.convert(make_model("vit"), capacity=0.5, skipped=toy_mode)
    bypass = amod.convert(make_model("vit"), capacity=0.5)
    assert model.amod_config.layers == [1, 3]  # the mode's default layers (alternate)
    assert_priced_as_measured(model)
    assert amod.flops(model).macs == amod.flops(bypass).macs

    # block 1 (the first MoD block): kept tokens as in bypass, skipped patch tokens zero
    outs = {}
    for name, m in (("toy", model), ("bypass", bypass)):
        m.blocks[1].register_forward_hook(lambda mod, args, out, name=name: outs.__setitem__(name, out))
    amod.set_recording(model)
    with torch.no_grad():
        model(images(model, 2)), bypass(images(model, 2))
    p, kept = model.num_prefix_tokens, model.blocks[1].amod_last_index
    skipped = torch.ones(2, model.patch_embed.num_patches, dtype=torch.bool).scatter_(1, kept, False)
    toy, ref = outs["toy"][:, p:], outs["bypass"][:, p:]
    assert torch.equal(toy[skipped], torch.zeros_like(toy[skipped])) and toy[~skipped].abs().sum() > 0
    assert torch.equal(toy[~skipped], ref[~skipped]) and torch.equal(outs["toy"][:, :p], outs["bypass"][:, :p])

    assert_saved_and_loaded(model, tmp_path / "zero.safetensors")


def test_the_command_line_offers_and_runs_registered_toys(toy_router, toy_mode, tmp_path, capsys):
    assert amod_main(["flops", "vit_tiny_patch16_224", "--capacity", "0.5", "--router", toy_router,
                      "--skipped", toy_mode]) == 0
    assert f"router={toy_router} layers=alternate skipped={toy_mode}" in capsys.readouterr().out
    run = tmp_path / "run"
    assert amod_main(["train", "--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "2",
                      "--embed-dim", "32", "--num-heads", "2", "--train-limit", "64", "--val-limit", "64",
                      "--batch-size", "32", "--epochs", "1", "--router", toy_router, "--skipped", toy_mode,
                      "--out", str(run)]) == 0
    model = amod.load(run / "model.safetensors")
    assert (model.amod_config.router, model.amod_config.skipped) == (toy_router, toy_mode)
    assert type(model.blocks[1].router) is ToyRouter


def test_a_command_is_one_entry_of_commands(monkeypatch, capsys):
    """A command is one ``Command`` in ``amod.cli.COMMANDS``: ``amod --help`` lists it, its flags are built only when it
    runs, and a user's error in it is one line with exit status 2, as for every command."""
    from amod import cli

    built = []

    def flags(p):
        built.append(True)
        p.add_argument("--blocks", type=cli.positive_int, required=True)

    def run(args):
        if args.blocks > 12:
            raise amod.UserError(f"--blocks {args.blocks}: vit_tiny_patch16_224 has 12")
        print(f"{args.blocks} of 12 blocks")
        return 0

    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + (cli.Command("toy-blocks", "a toy command", flags, run),))
    with pytest.raises(SystemExit) as exit_help:
        cli.main(["--help"])
    assert exit_help.value.code == 0 and "toy-blocks" in capsys.readouterr().out and built == []
    assert cli.main(["flops", "vit_tiny_patch16_224"]) == 0 and built == []  # another command builds its own flags
    capsys.readouterr()
    assert cli.main(["toy-blocks", "--blocks", "3"]) == 0 and built == [True]
    assert capsys.readouterr().out == "3 of 12 blocks\n"
    assert cli.main(["toy-blocks", "--blocks", "13"]) == 2
    assert capsys.readouterr().err.splitlines() == ["amod toy-blocks: error: --blocks 13: vit_tiny_patch16_224 has 12"]
    with pytest.raises(SystemExit) as bad_flag:
        cli.main(["toy-blocks", "--blocks", "0"])
    assert bad_flag.value.code == 2 and "amod toy-blocks: error: argument --blocks" in capsys.readouterr().err
