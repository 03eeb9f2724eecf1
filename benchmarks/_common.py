"""Shared set-up for the benchmark scripts: a quiet allocator and a description of the machine."""
from __future__ import annotations

import os
import platform
import sys

import torch

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"


def ensure_tunables() -> None:
    """Re-run this script with GLIBC_TUNABLES set: glibc's default allocator page-faults on every
    ViT forward and makes speed-ups swing by several percent."""
    if os.environ.get("GLIBC_TUNABLES") != TUNABLES:
        os.environ["GLIBC_TUNABLES"] = TUNABLES
        os.execv(sys.executable, [sys.executable, *sys.argv])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU: {cpu}, {torch.get_num_threads()} threads"
    return f"{dev}; torch {torch.__version__}; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}"


def measure_sizes(img_sizes, measure, markdown, report: dict, out) -> None:
    """``measure(size, report)`` for each image size, the JSON report and its Markdown (``markdown(report)``) beside
    it rewritten after each, so a run stopped part-way keeps the sizes it finished."""
    from pathlib import Path

    from amod.files import write_json, write_text

    out = Path(out)
    for size in img_sizes:
        measure(size, report)
        write_json(out, report)
        write_text(out.with_suffix(".md"), markdown(report))
        print(markdown(report), flush=True)
