"""benchmarks/gpu_check.py, the GPU check's orchestrator: its tiny plan run for real on the CPU, and its GPU plan with
every command replaced by one that writes what the real command writes (the real frontier report of
docs/frontier_dinov2_224.json, bench_scores.py's report of benchmarks/results/scores_cpu.json): each target read
from the numbers, a step out of time or failing recorded while the run goes on, a part out of budget skipped."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def junit(path: Path, passed: int, failed: int, skipped: int) -> None:
    cases = ([f'<testcase classname="tests.test_ops" name="ok{i}"/>' for i in range(passed)]
             + [f'<testcase classname="tests.test_fast" name="bad{i}"><failure message="x"/></testcase>'
                for i in range(failed)]
             + [f'<testcase classname="tests.test_ops" name="skip{i}"><skipped message="no GPU"/></testcase>'
                for i in range(skipped)])
    path.write_text(f'<testsuites><testsuite tests="{passed + failed + skipped}" failures="{failed}" errors="0" '
                    f'skipped="{skipped}">{"".join(cases)}</testsuite></testsuites>')


def flag(argv: list[str], name: str) -> list[str]:
    """The values after ``name`` in ``argv`` (up to the next flag)."""
    i = argv.index(name) + 1
    values = []
    while i < len(argv) and not argv[i].startswith("--"):
        values.append(argv[i])
        i += 1
    return values


class FakeCommands:
    """Stands in for subprocess.run: each command writes what the real one writes, with numbers the test chooses."""

    def __init__(self, efficiency: float = 0.93, failed_tests: int = 0, slow: tuple[str, ...] = ()) -> None:
        self.efficiency, self.failed_tests, self.slow = efficiency, failed_tests, slow
        self.calls: list[tuple[list[str], float, dict]] = []
        self.out = Path()  # the check's --out

    def __call__(self, argv, cwd, env, capture_output, text, timeout):
        out_dir = Path(flag(argv, "--out")[0]) if "--out" in argv else None
        report = self.out / "gpu_check.json"  # (what the check had written when it ran this command)
        self.calls.append((argv, timeout, json.loads(report.read_text()) if report.is_file() else None))
        assert cwd == ROOT and str(ROOT / "src") in env["PYTHONPATH"].split(os.pathsep)
        if any(s in " ".join(argv) for s in self.slow):
            raise subprocess.TimeoutExpired(argv, timeout, output=b"half way")
        stdout = ""
        if "pytest" in argv:
            junit(Path(flag(argv, "--junitxml")[0]), 20, self.failed_tests, 0)
        elif argv[2:4] == ["amod", "bench"]:
            stdout = json.dumps({"model": flag(argv, "--model")[0], "batch_size": int(flag(argv, "--batch-size")[0]),
                                 "device": "cuda:0", "amp": "bf16", "compile": "--compile" in argv,
                                 "label": "attention@0.125", "speedup": 1.5, "flop_speedup": 1.5 / self.efficiency,
                                 "efficiency": self.efficiency, "dense": {"images_per_s": 1000.0},
                                 "mod": {"images_per_s": 1500.0}})
        elif argv[1].endswith("bench_scores.py"):
            shutil.copy(ROOT / "benchmarks" / "results" / "scores_cpu.json", out_dir)
        else:  # amod frontier: the CPU frontier's real report, as if timed at this step's batch sizes
            data = json.loads((ROOT / "docs" / "frontier_dinov2_224.json").read_text())
            for row in [data["dense"], *data["rows"]]:
                speeds = list(row["speed"].values())
                row["speed"] = {b: {**s, **({"compile_s": 42.0} if "--compile" in argv else {})}
                                for b, s in zip(flag(argv, "--speed-batch"), speeds)}
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "frontier.json").write_text(json.dumps(data))
        return subprocess.CompletedProcess(argv, 1 if self.failed_tests and "pytest" in argv else 0, stdout, "")


@pytest.fixture
def gpu_check(monkeypatch):
    module = load_script()
    monkeypatch.setattr(module, "write_backbone", lambda spec: None)  # (a random ViT-B is 350 MB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    return module


def run_gpu_plan(gpu_check, tmp_path, fake, *extra: str) -> tuple[int, dict, str]:
    args = gpu_check.parse_args(["--out", str(tmp_path), *extra])
    fake.out = tmp_path
    code = gpu_check.run(args, "cuda", True, runner=fake)
    return code, json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()


def test_every_target_of_the_gpu_plan_is_read_from_its_step(gpu_check, tmp_path):
    fake = FakeCommands(efficiency=0.93)
    code, report, md = run_gpu_plan(gpu_check, tmp_path, fake)
    assert code == 0 and report["ok"] is True and report["plan"] == "GPU"
    assert [s["status"] for s in report["steps"]] == ["ok"] * len(fake.calls) and len(fake.calls) == 9
    assert all("--device" not in argv or flag(argv, "--device") == ["cuda"] for argv, _, _ in fake.calls)
    # the report is rewritten after every step: each command sees the steps before it
    assert [len(seen["steps"]) if seen else 0 for _, _, seen in fake.calls] == list(range(9))
    frontier = json.loads((ROOT / "docs" / "frontier_dinov2_224.json").read_text())
    calibrated = next(r for r in frontier["rows"] if r["method"] == "A-MoD calibrated" and r["cost_target"] == 0.5)
    eager, batch1 = (s["speedup"] for s in calibrated["speed"].values())
    overhead = json.loads((ROOT / "benchmarks" / "results" / "scores_cpu.json").read_text())["n197"]["kernel_overhead"]
    expected = [(0, True), (0.93, True), (overhead, overhead <= 0.1), (eager, eager >= 1.5), (eager, eager >= 1.7),
                (eager, eager >= 1.5), (batch1, batch1 >= 1.2), (42.0, True)]
    assert [(t["value"], t["met"]) for t in report["targets"]] == expected
    # each calibrated row says where its schedule comes from, and each frontier step what its weights are
    setting = calibrated["setting"]
    assert (f"calibrated on this model ({calibrated['calibration']['images']} images): shape "
            f"{','.join(f'{w:g}' for w in setting['shape'])}, protect {setting['protect']:g}") in md
    assert "Weights: random (deit_small_patch16_224, pretrained=False)" in md and "means nothing" in md
    assert "NVIDIA H100 80GB HBM3" in md and "| compile s, batch 256 |" in md


def test_targets_not_met_failed_tests_and_a_step_out_of_time_are_reported_and_the_run_goes_on(gpu_check, tmp_path):
    fake = FakeCommands(efficiency=0.77, failed_tests=2, slow=("vit_base_patch16_224",))
    code, report, md = run_gpu_plan(gpu_check, tmp_path, fake, "--parts", "tests,bench")
    assert code == 1 and report["ok"] is False
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["pytest -m cuda"]["status"] == "failed" and steps["pytest -m cuda"]["result"]["failed"] == 2
    assert steps["bench ViT-B/16 C=0.125 batch 256"]["status"] == "timed out"  # (both ViT-B steps: `slow`)
    assert steps["bench ViT-B/16 C=0.125 batch 1"]["status"] == "timed out"
    assert steps["bench DeiT-S C=0.125 batch 256 compiled"]["status"] == "ok"
    targets = {t["target"].split(":")[0]: t for t in report["targets"]}
    assert targets["`pytest -m cuda`"]["value"] == 2 and targets["`pytest -m cuda`"]["met"] is False
    bench = targets["A-MoD C=0.125, ViT-B/16, batch 256, bf16"]
    assert bench["met"] is None and bench["note"] == "not measured: 'bench ViT-B/16 C=0.125 batch 256' timed out"
    assert "- failed: `tests.test_fast::bad1`" in md and "half way" in (tmp_path / "logs" / "bench_ViT_B_16_C_0_125_batch_256.log").read_text()


def test_a_part_gets_its_share_of_the_budget_and_a_step_that_does_not_fit_is_skipped(gpu_check, tmp_path):
    fake = FakeCommands()
    _, report, md = run_gpu_plan(gpu_check, tmp_path, fake, "--parts", "scores,frontier", "--budget-s", "26")
    # scores: 20 / 260 of 26 s = 2 s, below its 10 s: skipped; the frontier's steps need 30 s of its 24
    assert {s["status"] for s in report["steps"]} == {"skipped"} and fake.calls == []
    assert report["steps"][0]["reason"].startswith("time budget: 2 s left")
    assert report["ok"] is True and all(t["met"] is None for t in report["targets"])
    _, report, _ = run_gpu_plan(gpu_check, tmp_path / "b", fake, "--parts", "tests,bench", "--budget-s", "220")
    # the tests' share is 150 / 220 of it; they took no time, and what a part leaves goes to the later ones
    assert [round(t) for _, t, _ in fake.calls][:2] == [150, 220]


def test_the_tiny_plan_runs_for_real_on_the_cpu(tmp_path):
    """The commands as they run from a plain checkout (PYTHONPATH=src, set by the check): `pytest -m cuda` (every test
    skipped, and counted, on a machine without CUDA) and `amod bench` on a tiny ViT, read back into the report."""
    code = load_script().main(["--device", "cpu", "--parts", "tests,bench", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, [s.get("tail") for s in report["steps"]]
    assert report["plan"] == "tiny" and [s["status"] for s in report["steps"]] == ["ok", "ok"]
    tests, bench = (s["result"] for s in report["steps"])
    if not torch.cuda.is_available():
        assert tests["passed"] == tests["failed"] == 0 and tests["skipped"] >= 7
        assert report["targets"][0]["met"] is None and "no `cuda` test ran" in report["targets"][0]["note"]
    assert bench["model"] == "vit_tiny_patch16_224" and bench["efficiency"] == pytest.approx(
        bench["speedup"] / bench["flop_speedup"])
    assert "### bench ViT-Ti C=0.125 batch 4" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_fails_in_one_line(tmp_path, capsys):
    code = load_script().main(["--device", "cuda", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--device cuda" in err
    assert not (tmp_path / "out").exists()
