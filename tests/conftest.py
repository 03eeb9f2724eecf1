"""Small registered timm models, one per variant of the timm ViT family amod supports, cheap enough for the CPU."""
from __future__ import annotations

import contextlib
import copy
import json
import subprocess
from pathlib import Path

import pytest
import timm
import torch

# variant -> (timm name, overrides): the variants of timm's VisionTransformer amod supports (distillation token, layer
# scale, registers, qk norm), shrunk to a few ms per forward. They are one family (amod.families); the contract every
# family keeps is tests/test_families.py's.
TIMM_VARIANTS = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=4)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, depth=4)),
    "deit3_layerscale": ("deit3_small_patch16_224", dict(img_size=32, patch_size=8, depth=4, embed_dim=96, num_heads=3)),
    "registers": ("vit_base_patch16_reg4_gap_256", dict(img_size=32, patch_size=8, depth=4, embed_dim=96, num_heads=3)),
    "dinov2_reg": ("vit_small_patch14_reg4_dinov2", dict(img_size=28, patch_size=7, depth=4, embed_dim=96, num_heads=3)),
    "qk_norm": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=4, qk_norm=True)),
}

# The devices a test parametrised over ``device`` runs on: the CPU always; CUDA marked ``cuda`` (``pytest -m cuda`` runs
# only those), skipped with its reason where torch sees no GPU (pytest_runtest_setup below).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); run `pytest -m cuda` on a GPU"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``cuda`` is skipped, and counted as skipped, where torch sees no GPU."""
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


def make_model(variant: str = "vit", seed: int = 0, **extra) -> torch.nn.Module:
    name, kwargs = TIMM_VARIANTS[variant]
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=10, **{**kwargs, **extra})
    return model.eval()


def images(model: torch.nn.Module, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, w = model.patch_embed.img_size
    return torch.randn(batch, 3, h, w, generator=g)


@pytest.fixture(scope="module")
def backbone_path(tmp_path_factory):
    """A small random DINOv2-style backbone (no classifier) saved by amod: what the backbone commands take."""
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=42, patch_size=7, depth=4,
                              embed_dim=64, num_heads=2, num_classes=0)
    import amod

    return amod.save(model, tmp_path_factory.mktemp("backbone") / "backbone.safetensors")


@pytest.fixture
def tiny_vit():
    return make_model("vit")


def cli_in_process(argv: list[str], capsys) -> subprocess.CompletedProcess:
    """``amod argv`` run in this process, returned as a CompletedProcess (code, stdout, stderr). It starts at
    once: a subprocess spends seconds importing torch, timm and torchvision on this 2-core machine.
    Argparse errors exit by SystemExit."""
    from amod.cli import main as amod_main

    capsys.readouterr()  # drop what the test printed before
    try:
        code = amod_main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["amod", *argv], code, out, err)


def run_in_process(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``amod argv`` run in this process."""
    res = cli_in_process(argv, capsys)
    return res.returncode, res.stderr.strip()


@contextlib.contextmanager
def one_torch_thread():
    """One intra-op torch thread within the block, the count restored after: tiny tensors on the test machine's 2
    shared cores only wait on a second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- shared by the hardening tests (CLI errors, run files,
# inputs, checkpoint runs)

TINY = ["--model", "vit_tiny_patch16_224", "--patch-size", "7", "--depth", "2", "--embed-dim", "32",
        "--num-heads", "2", "--val-limit", "128", "--batch-size", "64"]
TINY_CFG = dict(model="vit_tiny_patch16_224", patch_size=7, depth=2, embed_dim=32, num_heads=2, val_limit=128,
                batch_size=64)
SHORT = ["--epochs", "1", "--train-limit", "64", "--val-limit", "64"]  # a run that would start, kept short


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A dense, a PiToMe, a fold and an MoD (bypass and kv) amod checkpoint of a 28-px, 1-channel Fashion-MNIST model,
    its backbone without classifier, a .pth of another width, and a safetensors file whose amod metadata is broken."""
    import amod

    root = tmp_path_factory.mktemp("ckpt")
    kwargs = dict(patch_size=7, depth=2, embed_dim=32, num_heads=2, img_size=28, in_chans=1, num_classes=10)
    torch.manual_seed(0)
    dense = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs)
    amod.save(dense, root / "dense.safetensors")
    amod.save(amod.pitome.apply(copy.deepcopy(dense), cost=0.7), root / "pitome.safetensors")
    kv = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5, skipped="kv")
    amod.save(kv, root / "kv.safetensors")
    amod.save(amod.convert(copy.deepcopy(dense), skipped="fold", capacity=0.8), root / "fold.safetensors")
    amod.save(amod.convert(dense, router="attention", capacity=0.5), root / "mod.safetensors")
    backbone = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**kwargs, "num_classes": 0})
    amod.save(backbone, root / "backbone.safetensors")
    wide = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**kwargs, "embed_dim": 64})
    torch.save(wide.state_dict(), root / "wide.pth")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(root / "badmeta.safetensors"), metadata={"amod.model": "{not json"})
    (root / "a_file").write_text("x")
    return root


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """imagefolder data with 3 classes; train and val each hold an empty .jpg, a corrupt .png and a truncated .jpg."""
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in range(3):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(8):
                pixels = (torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()
                Image.fromarray(pixels).save(d / f"img{i}.jpg", quality=95)
        (root / split / "class0" / "empty.jpg").write_bytes(b"")
        (root / split / "class1" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
        whole = (root / split / "class2" / "img0.jpg").read_bytes()
        (root / split / "class2" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    return root


FOLDER_MODEL = ["--model", "vit_tiny_patch16_224", "--img-size", "32", "--patch-size", "8", "--depth", "1",
                "--embed-dim", "32", "--num-heads", "2", "--batch-size", "8"]


def counted_parses(monkeypatch) -> list[str]:
    """The specs ``amod.methods.parse_method`` parses from now on (in this test), in every amod module imported now
    that holds it by name: the list fills as they are parsed."""
    import sys

    from amod import methods

    parsed, parse = [], methods.parse_method

    def counted(text: str):
        parsed.append(text)
        return parse(text)

    for module in [m for name, m in list(sys.modules.items()) if name.startswith("amod") and m is not None]:
        if getattr(module, "parse_method", None) is parse:
            monkeypatch.setattr(module, "parse_method", counted)
    return parsed

