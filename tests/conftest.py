"""Small registered timm models, one per variant of the timm ViT family amod supports, cheap enough for the CPU."""
from __future__ import annotations

import contextlib
import subprocess

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
