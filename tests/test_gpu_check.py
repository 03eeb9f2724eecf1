"""benchmarks/gpu_check.py, the prepared GPU check: its CPU quick run end to end, the Triton kernel
check under the interpreter, the failure report, and the pieces that only run on CUDA (the
device-against-CPU comparison, run here CPU against CPU; the targets and the Markdown of a CUDA report)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTION_KEYS = {"title", "status", "seconds", "budget_s", "settings", "items", "error"}


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The script as a user runs it from a plain checkout: PYTHONPATH=src, from the repository root."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": "src", **(env or {})})


def test_quick_cpu_run_writes_both_reports(tmp_path):
    """The whole quick run, with the Triton kernel check run by Triton's interpreter (where triton is installed)."""
    res = run_script("--device", "cpu", "--quick", "--out", str(tmp_path), env={"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert {"tool", "started", "ok", "wall_s", "machine", "settings", "sections", "targets"} <= set(report)
    assert {"device", "name", "torch", "triton", "timm", "python"} <= set(report["machine"])
    assert report["ok"] is True and report["machine"]["device"] == "cpu"
    assert report["settings"]["quick"] is True and set(report["settings"]["per_section"]) == {"1", "2", "3", "4", "5"}
    for n, sec in report["sections"].items():
        assert SECTION_KEYS <= set(sec) and sec["status"] == "ok" and sec["error"] is None, (n, sec)
        for item in sec["items"]:
            assert item["status"] in ("ok", "skipped"), item
            if item["status"] == "skipped":  # only what needs CUDA (or Triton's interpreter) is skipped
                assert "CUDA" in item["reason"] or "CPU" in item["reason"], item
    items = {n: {i["name"]: i for i in s["items"]} for n, s in report["sections"].items()}
    assert sum(i["status"] == "ok" and i["name"].startswith("attention_with_scores") for i in items["1"].values()) >= 20
    for job in items["2"].values():
        assert {r["variant"] for r in job["rows"]} >= {"dense", "A-MoD C=0.5", "A-MoD C=0.125"}
        assert any(r["variant"].startswith("A-MoD fold @") for r in job["rows"])
        assert any(r["variant"].startswith("ToMe @") for r in job["rows"])
        for r in job["rows"]:
            assert r["images_per_s"] > 0 and r["efficiency"] == pytest.approx(r["speedup"] * r["cost"])
    assert all(i["overhead"] > -1 for i in items["3"].values() if i["status"] == "ok")
    train = items["4"]["AdamW steps: dense, A-MoD, standard MoD"]
    assert all(math.isfinite(r["last_loss"]) and r["steps_per_s"] > 0 for r in train["rows"])
    standard = next(r for r in train["rows"] if r["variant"].startswith("standard"))
    assert any("router" in n and ok for n, ok in standard["grads_reached"].items())
    assert items["4"]["DDP, one process"]["status"] == "ok"
    # the frontier: every method at the cost, eager against dense at both batch sizes (CUDA graphs need CUDA); then
    # dense and the calibrated point compiled, with their compile time
    front = items["5"]["frontier vit_tiny_patch16_224"]
    assert {p["method"] for p in front["points"].values()} == {"ToMe", "PiToMe", "A-MoD fold", "A-MoD calibrated",
                                                             "calibrated, nothing protected", "A-MoD (paper)"}
    for batch in ("4", "1"):
        res = front["batches"][batch]
        built = {k for k, p in front["points"].items() if "cost" in p}  # (a setting repeated is timed once)
        assert set(res["eager"]) == {"dense", *built} and res["eager"]["dense"]["speedup"] == 1.0
        assert "cuda_graphs" not in res
    # (with no CPU frontier schedule of its depth, both calibrated methods fall back to one setting)
    assert front["points"]["calibrated, nothing protected @ 0.7"]["same_as"] == "A-MoD calibrated @ 0.7"
    compiled = items["5"]["compiled vit_tiny_patch16_224 batch 4"]
    assert set(compiled["compiled"]) == {"dense", "A-MoD calibrated @ 0.7"}
    assert all(v > 0 for v in compiled["compile_s"].values())
    assert "**vit_tiny_patch16_224, batch 4**" in md and "| eager | CUDA graphs |" in md and "compile s" in md
    assert all(t["met"] is None for t in report["targets"])  # the targets are for the GPU run
    assert report["machine"]["name"] in md and "CPU" in md
    assert "## 2. speed: ok" in md and "| FLOP bound | efficiency |" in md
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    kernel = [i for i in items["1"].values() if i["name"].startswith("received_attention_triton")]
    assert len(kernel) >= 6 and all(i["status"] == "ok" for i in kernel)
    assert {i["name"].split()[1] for i in kernel} == {"float32", "bfloat16"}


def test_a_failing_section_is_reported_and_the_run_goes_on(tmp_path, capsys):
    gpu_check = load_script()
    threads = torch.get_num_threads()
    code = gpu_check.main(["--device", "cpu", "--quick", "--sections", "1,3", "--fail-section", "1",
                           "--out", str(tmp_path)])
    assert code == 1 and torch.get_num_threads() == threads
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed, after = report["sections"]["1"], report["sections"]["3"]
    assert report["ok"] is False and failed["status"] == "failed" and after["status"] == "ok"
    assert failed["error"]["type"] == "RuntimeError" and "--fail-section" in failed["error"]["message"]
    assert failed["error"]["traceback"] and "RuntimeError" in failed["error"]["traceback"][-1]
    assert "1. correctness: failed" in (tmp_path / "gpu_check.md").read_text()
    assert "FAILED" in capsys.readouterr().out


def test_an_item_that_raises_fails_its_section_only(tmp_path):
    gpu_check = load_script()
    sec_budget = gpu_check.Budget(10, float("inf"))

    def body(sec):
        sec.attempt("raises", lambda: 1 / 0)
        sec.attempt("misses its tolerance", lambda: {"passed": False, "summary": "error 1 > 0.1"})
        sec.attempt("fine", lambda: {"summary": "ok"})

    out = gpu_check.run_section(3, body, {"budget_s": 10}, sec_budget, torch.device("cpu"))
    assert out["status"] == "failed" and out["error"] is None
    assert [i["status"] for i in out["items"]] == ["failed", "failed", "ok"]
    assert out["items"][0]["error"]["type"] == "ZeroDivisionError"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_fails_in_one_line(tmp_path, capsys):
    code = load_script().main(["--device", "cuda", "--quick", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--device cuda" in err
    assert not (tmp_path / "out").exists()


def test_device_comparison_cpu_against_cpu():
    """The CUDA-against-CPU model check, with the CPU on both sides: identical in fp32, within the
    bf16 bounds under bf16 autocast."""
    gpu_check = load_script()
    dense = gpu_check.sharpen_attention(gpu_check.build_model(gpu_check.QUICK_MODEL))
    x = torch.randn(2, 3, *gpu_check.input_size(dense), generator=torch.Generator().manual_seed(0))
    model = gpu_check.variant(dense, "A-MoD C=0.5")
    cpu = torch.device("cpu")
    exact = gpu_check.compare_devices(model, x, cpu, cpu, "off")
    assert exact["passed"] and exact["logits_error"] == 0 and exact["same_kept"] is True
    assert gpu_check.compare_devices(model, x, cpu, cpu, "bf16")["passed"]
    a = torch.tensor([[0, 1, 2, 3]])
    assert gpu_check.kept_agreement([a], [torch.tensor([[0, 1, 2, 5]])]) == (False, 0.75)


def test_targets_and_markdown_of_a_cuda_report():
    """The parts only a GPU run reaches: targets met or not, and the memory table."""
    gpu_check = load_script()
    rows = [{"variant": "dense", "efficiency": 1.0}, {"variant": "A-MoD C=0.125", "efficiency": 0.93}]
    report = {
        "machine": {"device": "cuda", "name": "NVIDIA H200", "torch": "2.x", "torch_cuda": "12.x", "triton": "3.x",
                    "timm": "1.x", "python": "3.12"},
        "settings": {"quick": False, "per_section": {}}, "ok": True, "wall_s": 300.0, "started": "now",
        "sections": {
            "2": {"title": "speed", "status": "ok", "seconds": 1.0, "budget_s": 150, "error": None,
                  "settings": {"amp": "bf16"},
                  "items": [{"name": "vit_base_patch16_224 batch 256", "status": "ok", "rows": rows, "notes": [],
                             "model": {"name": "vit_base_patch16_224"}, "batch": 256, "repeats": 10, "warmup": 3}]},
            "3": {"title": "score kernels", "status": "ok", "seconds": 1.0, "budget_s": 30, "error": None,
                  "settings": {}, "items": [
                      {"name": "time N = 197 [256, 12, 197, 64]", "status": "ok", "overhead": 0.25,
                       "shape_BHND": [256, 12, 197, 64], "dtype": "bfloat16", "ms": {"sdpa": 1.0, "sdpa+scores": 1.25},
                       "spread": {"sdpa": 0.01, "sdpa+scores": 0.01}},
                      {"name": "peak memory", "status": "ok", "growth": 2.0, "linear": True, "B_H_D": [2, 12, 64],
                       "dtype": "bfloat16", "peak_mb": {"2049": {"sdpa": 6.0, "sdpa+scores": 7.0, "explicit": 900.0,
                                                                 "fp32_matrix": 384.0}}}]}},
    }
    calibrated = "A-MoD calibrated @ 0.5"

    def frontier(name: str, eager: float, graphed: float) -> dict:
        return {"name": f"frontier {name}", "status": "ok", "model": {"name": name},
                "points": {calibrated: {"method": "A-MoD calibrated", "cost_target": 0.5, "cost": 0.5,
                                        "cpu_top1": None, "source": "x"}},
                "batches": {"256": {"eager": {"dense": {"speedup": 1.0, "ms": 2.0}, calibrated: {"speedup": eager,
                                                                                                "ms": 1.0}}},
                            "1": {"eager": {"dense": {"speedup": 1.0, "ms": 2.0}},
                                  "cuda_graphs": {"dense": {"speedup": 1.0}, calibrated: {"speedup": graphed}}}}}

    def compiled(name: str, speedup: float, seconds: float) -> dict:
        return {"name": f"compiled {name} batch 256", "status": "ok", "model": {"name": name}, "batch": 256,
                "points": {}, "compiled": {"dense": {"speedup": 1.0, "ms": 2.0}, calibrated: {"speedup": speedup,
                                                                                             "ms": 1.0}},
                "compile_s": {"dense": 20.0, calibrated: seconds}}

    report["sections"]["5"] = {"title": "frontier", "status": "ok", "seconds": 1.0, "budget_s": 130, "error": None,
                               "settings": {"amp": "bf16"},
                               "items": [frontier("deit_small_patch16_224", 1.2, 1.0),
                                         frontier("vit_base_patch16_224", 1.8, 1.3),
                                         compiled("deit_small_patch16_224", 1.6, 60.0),
                                         compiled("vit_base_patch16_224", 1.9, 70.0)]}
    report["targets"] = gpu_check.targets(report)
    met = {t["target"]: t["met"] for t in report["targets"]}
    assert [t["met"] for t in report["targets"]] == [True, False, False, True, True, True, True, True, None, True]
    assert report["targets"][0]["value"] == 0.93 and "public ToMe" in report["targets"][8]["target"]
    assert met["compiling a reduced DeiT-S (calibrated @ 0.5, batch 256) <= 90 s"] is True
    md = gpu_check.markdown(report)
    assert "NVIDIA H200" in md and "Peak memory" in md and "| 2049 | 6.0 | 7.0 | 900.0 | 384.0 |" in md
