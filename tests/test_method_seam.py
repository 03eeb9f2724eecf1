"""A method is one class: a toy, defined and registered here (it skips the last blocks), is priced, saved, loaded,
found in a model, set to a cost, and taken by name by every command (train, eval, export, compare, frontier) with
nothing else of amod changed."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar, Optional

import pytest
import torch
from conftest import cli_in_process, images, make_model
from timm.models.vision_transformer import Block
from torch import nn

import amod
from amod.cost import BlockPrice, count_flops
from amod.methods import METHOD_CLASSES, Method, method_of, parse_method, register_method
from amod.train.config import RunConfig


class SkippedBlock(Block):
    """A timm block that passes its tokens on untouched (its weights kept, unused): it costs nothing."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x

    def amod_price(self, tokens: int, num_prefix: int, capacity: Optional[float] = None) -> BlockPrice:
        return BlockPrice(0, tokens, tokens)


@dataclass(frozen=True)
class SkipLast(Method):
    """The last ``blocks`` blocks of a timm ViT skipped."""

    kind: ClassVar[str] = "toy-skip"
    metadata_key: ClassVar[Optional[str]] = "amod.toy-skip"
    blocks: int = 1

    def apply(self, model: nn.Module) -> nn.Module:
        for blk in model.blocks[len(model.blocks) - self.blocks:]:
            blk.__class__ = SkippedBlock
        return model

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["SkipLast"]:
        skipped = sum(isinstance(b, SkippedBlock) for b in model.blocks)
        return cls(blocks=skipped) if skipped else None

    def at_cost(self, dense: nn.Module, cost: float, images=None) -> "SkipLast":
        return min((SkipLast(k) for k in range(1, len(dense.blocks))), key=lambda m: abs(m.cost_of(dense) - cost))


@pytest.fixture
def toy_method():
    register_method(SkipLast)
    yield SkipLast.kind
    del METHOD_CLASSES[SkipLast.kind]


def test_a_method_class_is_registered_priced_found_saved_and_set_to_a_cost(toy_method, tmp_path):
    assert parse_method("toy-skip:blocks=2") == SkipLast(2) and SkipLast(2).spec() == "toy-skip:blocks=2"
    model = SkipLast(1).apply(make_model("vit"))  # (4 blocks)
    assert amod.method_of(model) == SkipLast(1)
    report = amod.flops(model)
    assert report.ratio < 0.85 and report.macs == pytest.approx(count_flops(model, images(model, 1)) / 2, rel=0.02)
    again = amod.load(amod.save(model, tmp_path / "toy.safetensors"))
    assert amod.method_of(again) == SkipLast(1) and amod.flops(again).macs == report.macs
    x = images(model, 2)
    with torch.no_grad():
        assert torch.equal(model(x), again(x))
    assert SkipLast().at_cost(make_model("vit"), 0.5) == SkipLast(2)
    assert RunConfig(method_spec="toy-skip:blocks=1").validate().method() == SkipLast(1)


def test_every_command_takes_a_registered_method_by_name(toy_method, backbone_path, tmp_path, capsys, monkeypatch):
    from amod.experiments import probe as probe_module

    # a quick linear probe (one penalty, 50 L-BFGS steps; the probe's cache is keyed by these defaults): the method
    # is under test here, not the probe
    monkeypatch.setattr(probe_module.fit_probe, "__defaults__", (0.2, (1e-3,), 50, 0))
    run = tmp_path / "run"
    res = cli_in_process(["train", "--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "3",
                          "--embed-dim", "32", "--num-heads", "2", "--train-limit", "64", "--val-limit", "64",
                          "--batch-size", "32", "--epochs", "1", "--method", "toy-skip:blocks=1", "--out", str(run)],
                         capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["variant"] == "toy-skip"  # (its spec: blocks=1 is the default)
    model = amod.load(run / "model.safetensors")
    assert amod.method_of(model) == SkipLast(1) and isinstance(model.blocks[2], SkippedBlock)
    assert "method_spec: toy-skip" in (run / "config.yaml").read_text()

    res = cli_in_process(["eval", "--checkpoint", str(run / "model.safetensors"), "--val-limit", "32", "--json"],
                         capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["macs"] == amod.flops(model).macs < amod.flops(make_dense(model)).macs
    res = cli_in_process(["export", "--checkpoint", str(run / "model.safetensors"), "--out",
                          str(tmp_path / "toy.onnx"), "--exporter", "torchscript", "--json"], capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["method"] == "toy-skip"

    res = cli_in_process(["flops", "vit_tiny_patch16_224", "--capacity", "1.0", "--method", "toy-skip:blocks=6"],
                         capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "toy-skip:blocks=6" in res.stdout  # (half of vit_tiny's 12 blocks skipped)

    probe = ["--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.5", "--probe-train", "20",
             "--val-limit", "8", "--methods", "ToMe", "toy-skip", "--speed-batch", "2", "--speed-repeats", "1",
             "--out", str(tmp_path / "sweeps")]
    res = cli_in_process(["compare", *probe], capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "sweeps" / "compare.json").read_text())["rows"]
    assert [(r["method"], r["setting"]) for r in rows] == \
        [("ToMe", rows[0]["setting"]), ("toy-skip", {"method_spec": "toy-skip:blocks=2"})]  # 2 of the 4 blocks
    assert "| 0.5 | toy-skip | toy-skip:blocks=2 |" in (tmp_path / "sweeps" / "compare.md").read_text()
    res = cli_in_process(["frontier", *probe], capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "sweeps" / "frontier.json").read_text())["rows"]
    assert [(r["method"], r["setting"]) for r in rows] == \
        [("ToMe", rows[0]["setting"]), ("toy-skip", {"method_spec": "toy-skip:blocks=2"})]
    assert "| toy-skip | 0.5 | toy-skip:blocks=2 |" in (tmp_path / "sweeps" / "frontier.md").read_text()


def make_dense(model: nn.Module) -> nn.Module:
    """The dense model of ``model``'s architecture (its skipped blocks made timm blocks again)."""
    import copy

    dense = copy.deepcopy(model)
    for blk in dense.blocks:
        blk.__class__ = Block
    assert isinstance(method_of(dense), amod.Dense)
    return dense
