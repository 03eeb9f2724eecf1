"""Digests of what amod computes, to show that a change of code alone (a refactor, a move) left every result as it was.

Runs, on a tiny random ViT and real Fashion-MNIST images, ``amod train`` (dense and A-MoD), ``amod finetune`` (ToMe
and the fold, from the dense run's file) and an ``amod frontier`` sweep (ToMe, PiToMe, PPT, A-MoD fold and
calibrated at two costs), then prints one SHA-256 per result: a model file's tensors and its method's metadata, a run's
per-epoch metrics without times, a sweep's rows without times. Run it in two trees and compare the lines:

    PYTHONPATH=src python tools/behaviour_digests.py --work /tmp/digests_after

Everything runs on the CPU with one thread, so the digests are bit-for-bit repeatable on one machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "28", "--patch-size", "7", "--depth", "4", "--embed-dim", "64",
        "--num-heads", "2", "--batch-size", "32", "--seed", "3", "--workers", "0"]
SHORT = ["--epochs", "2", "--train-limit", "256", "--val-limit", "128"]
TIMES = {"seconds", "time", "wall_s", "elapsed", "images_per_s", "speed", "ms", "speedup", "readings", "started",
         "finished", "host", "commit", "amod_commit", "versions", "python", "torch", "timm", "date", "seconds_per_epoch"}


def amod(*argv: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", "amod", *argv], check=True, env=env, stdout=subprocess.DEVNULL)


def without_times(value):
    """``value`` (JSON) without the entries that measure time or name the machine."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in sorted(value.items())
                if k not in TIMES and not any(word in k for word in ("time", "per_s", "seconds"))}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def model_digest(path: Path) -> str:
    from safetensors import safe_open
    h = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        for name in sorted(f.keys()):
            h.update(name.encode())
            h.update(f.get_tensor(name).float().numpy().tobytes())
    method = {k: v for k, v in meta.items() if k in ("amod.method", "amod.mod", "amod.tome", "amod.pitome", "amod.ppt",
                                                   "amod.isoflop", "amod.calibrated")}
    return h.hexdigest()[:16] + " " + digest(method)


def jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_all(w: Path, methods: list[str]) -> None:
    """The runs the digests are of, into the empty directory ``w``."""
    amod("train", *TINY, *SHORT, "--out", str(w / "dense"))
    amod("train", *TINY, *SHORT, "--router", "attention", "--capacity", "0.5", "--out", str(w / "mod"))
    dense = w / "dense" / "model.safetensors"
    amod("finetune", *TINY, *SHORT, "--checkpoint", str(dense), "--tome-r", "2", "--out", str(w / "ft_tome"))
    amod("finetune", *TINY, *SHORT, "--checkpoint", str(dense), "--router", "attention", "--capacity", "0.5",
         "--skipped", "fold", "--out", str(w / "ft_fold"))
    amod("frontier", "--checkpoint", str(dense), "--img-size", "28", "--cost", "0.5", "0.8", "--probe-train", "200",
         "--val-limit", "128", "--speed-batch", "2", "--speed-repeats", "1", "--calibration-images", "16",
         "--methods", *methods, "--device", "cpu", "--out", str(w / "frontier"))


def digests(w: Path) -> dict[str, str]:
    """Each result in ``w`` (``run_all``'s) by name, its digest."""
    results = {}
    for run in ("dense", "mod", "ft_tome", "ft_fold"):
        results[f"{run} model"] = model_digest(w / run / "model.safetensors")
        metrics = w / run / "metrics.jsonl"
        if metrics.exists():
            results[f"{run} metrics"] = digest(without_times(jsonl(metrics)))
    for row in json.loads((w / "frontier" / "frontier.json").read_text())["rows"]:
        results[f"frontier {row['method']} @{row['cost_target']}"] = digest(without_times(row))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a directory for the runs (emptied first)")
    parser.add_argument("--digest-only", action="store_true", help="digest the runs already in --work, run nothing")
    parser.add_argument("--methods", nargs="+", default=["ToMe", "PiToMe", "ppt", "A-MoD fold", "A-MoD calibrated"],
                        help="the frontier sweep's methods (default: %(default)s)")
    args = parser.parse_args()
    if not args.digest_only:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        run_all(args.work, args.methods)
    for name, value in digests(args.work).items():
        print(f"{name:34s} {value}")


if __name__ == "__main__":
    main()
