"""benchmarks/gpu_check.py, the GPU check's orchestrator: its tiny plan run for real on the CPU, and its GPU plan with
every command replaced by one that writes what the real command writes (benchmarks/bench_methods.py's result, a junit
report, bench_scores.py's report of docs/results/scores_cpu.json, `amod bench --json`): each target read off the
numbers, and the report written whatever a step does (times out with half its output, fails, writes no result or a
malformed one, is skipped for want of time), with an exit status that says which."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
METHODS = ["ToMe", "PiToMe", "A-MoD fold", "A-MoD calibrated", "PPT", "A-MoD C=0.125"]


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


def default_speed(model: str, batch: int, method: str) -> tuple[float, Optional[float]]:
    """(eager, CUDA graphs) speed-up of ``method`` over dense: every target met."""
    if method == "A-MoD calibrated":
        return {("deit_small_patch16_224", 256): (1.55, 1.62), ("vit_base_patch16_224", 256): (1.75, 1.82)}.get(
            (model, batch), (0.8, 1.25))
    return (1.3, 1.4) if batch == 256 else (0.7, 1.1)


def speed_result(argv: list[str], speed: Callable, stage: str = "timed",
                 graph_errors: tuple[str, ...] = ()) -> dict:
    """What benchmarks/bench_methods.py writes, with the speed-ups ``speed`` gives."""
    model, batch = flag(argv, "--model")[0], int(flag(argv, "--batch")[0])
    rows = [{"name": "dense", "setting": "", "cost": 1.0, "build_s": 0.0, "graph_s": 0.4}]
    for name in METHODS:
        rows.append({"name": name, "setting": f"{name.lower()}:x=[1,2]", "build_s": 0.5, "graph_s": 0.3,
                     "cost": 0.567 if name == "A-MoD C=0.125" else 0.5})
    for row in rows:
        if row["name"] in graph_errors:
            row["graph_error"] = "not recorded: RuntimeError: operation not permitted when stream is capturing"
            del row["graph_s"]
        if stage != "timed":
            continue
        eager, graphs = (1.0, 1.0) if row["name"] == "dense" else speed(model, batch, row["name"])
        for mode, s in (("eager", eager), ("graphs", graphs)):
            if mode == "graphs" and (s is None or row["name"] in graph_errors):
                continue
            row[mode] = {"images_per_s": 1000.0 * s, "ms": 1.0 / s, "spread": 0.01, "speedup": s, "q1": 0.98 * s,
                         "q3": 1.02 * s}
    return {"model": model, "img_size": [224, 224], "batch": batch, "cost_target": 0.5, "device": "cuda:0",
            "device_name": "NVIDIA H100 80GB HBM3", "amp": "bf16", "torch": "2.11.0", "timm": "1.0.29",
            "dense_attention": "timm, fused attention (F.scaled_dot_product_attention), FlashAttention (sdpa_kernel)",
            "weights": f"random ({model}, pretrained=False)", "calibration_images": "64 images of Gaussian noise",
            "graphs": True, "graphs_note": "", "repeats": 10, "warmup": 3, "forwards_per_call": 8 if batch < 8 else 1,
            "stage": stage, "rows": rows}


class FakeCommands:
    """Stands in for gpu_check.run_command: each command writes what the real one writes, with numbers the test
    chooses. ``slow``: commands (by a piece of their text) that run out of time half way, their result written as far
    as the real one would have; ``broken``: {piece: what the command does instead}: ``"no result"`` (exits 0 and
    writes nothing), ``"malformed"`` (writes a result of another shape), ``"crash"`` (exits 1 with a traceback)."""

    def __init__(self, speed: Callable = default_speed, failed_tests: int = 0, slow: tuple[str, ...] = (),
                 broken: Optional[dict[str, str]] = None, graph_errors: tuple[str, ...] = ()) -> None:
        self.speed, self.failed_tests, self.slow, self.broken = speed, failed_tests, slow, broken or {}
        self.graph_errors = graph_errors
        self.calls: list[tuple[list[str], float, Optional[dict]]] = []
        self.out = Path()  # the check's --out

    def __call__(self, argv, *, cwd, env, stdout, log, timeout):
        report = self.out / "gpu_check.json"  # (what the check had written when it ran this command)
        self.calls.append((argv, timeout, json.loads(report.read_text()) if report.is_file() else None))
        assert cwd == ROOT and str(ROOT / "src") in env["PYTHONPATH"].split(os.pathsep)
        text = " ".join(argv)
        broken = next((how for piece, how in self.broken.items() if piece in text), None)
        log.write_text("starting\n")
        if broken == "crash":
            log.write_text("Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access\n")
            return 1
        if broken == "no result":
            return 0
        out_file = Path(flag(argv, "--out")[0]) if "--out" in argv else None
        if broken == "malformed":
            target = out_file or stdout
            target.write_text(json.dumps({"rows": [{"name": "dense", "cost": "one"}], "model": "x", "batch": 1,
                                          "stage": "timed"}) if "bench_methods" in text else "not json\n")
            return 0
        if any(s in text for s in self.slow):
            if "bench_methods" in text:
                out_file.write_text(json.dumps(speed_result(argv, self.speed, "built", self.graph_errors)))
            log.write_text("starting\nhalf way\n")
            raise subprocess.TimeoutExpired(argv, timeout)
        if "pytest" in argv:
            junit(Path(flag(argv, "--junitxml")[0]), 20, self.failed_tests, 0)
            return 1 if self.failed_tests else 0
        if "benchmarks/bench_methods.py" in argv:
            out_file.write_text(json.dumps(speed_result(argv, self.speed, graph_errors=self.graph_errors)))
        elif "benchmarks/bench_scores.py" in argv:
            shutil.copy(ROOT / "docs" / "results" / "scores_cpu.json", out_file)
        else:  # amod bench --json
            assert argv[2:4] == ["amod", "bench"] and stdout != log
            stdout.write_text(json.dumps({
                "model": flag(argv, "--model")[0], "batch_size": int(flag(argv, "--speed-batch")[0]),
                "label": "attention@0.125", "compile": True, "speedup": 1.3, "flop_speedup": 1.76,
                "efficiency": 1.3 / 1.76, "dense": {"images_per_s": 19000.0}, "mod": {"images_per_s": 24700.0},
                "compile_seconds": {"dense": 40.0, "mod": 55.0}}))
        return 0


@pytest.fixture
def gpu_check(monkeypatch):
    module = load_script()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    return module


def run_gpu_plan(gpu_check, tmp_path, fake, *extra: str) -> tuple[int, dict, str]:
    args = gpu_check.parse_args(["--out", str(tmp_path), *extra])
    fake.out = tmp_path
    code = gpu_check.run(args, "cuda", True, runner=fake)
    return code, json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()


def by_target(report: dict) -> dict[str, dict]:
    return {t["target"]: t for t in report["targets"]}


GRAPHS_DEIT = "A-MoD calibrated @ 0.5, DeiT-S, batch 256, bf16, CUDA graphs: >= 1.5x dense"
EAGER_VITB = "A-MoD calibrated @ 0.5, ViT-B/16, batch 256, bf16, eager: >= 1.7x dense"
GRAPHS_VITB = "A-MoD calibrated @ 0.5, ViT-B/16, batch 256, bf16, CUDA graphs: >= 1.7x dense"
EVERY_DEIT = "every method faster than dense, DeiT-S, batch 256, bf16, CUDA graphs (value: the slowest)"
EVERY_VITB = "every method faster than dense, ViT-B/16, batch 256, bf16, CUDA graphs (value: the slowest)"
TESTS = "`pytest -m cuda`: no test fails"
SCORES = "the score kernels add <= 10 % to sdpa at N = 197"


def test_every_target_of_the_gpu_plan_is_read_from_its_step(gpu_check, tmp_path):
    fake = FakeCommands()
    code, report, md = run_gpu_plan(gpu_check, tmp_path, fake)
    assert code == 0 and report["ok"] is True and report["overall"] == "ok" and report["plan"] == "GPU"
    names = [s["name"] for s in report["steps"]]
    assert names == ["speed DeiT-S batch 256", "speed ViT-B/16 batch 256", "speed DeiT-S batch 1",
                     "speed ViT-B/16 batch 1", "pytest -m cuda", "scores N = 197 batch 256 bf16",
                     "inductor DeiT-S A-MoD C=0.125 batch 256"]
    assert [s["status"] for s in report["steps"]] == ["ok"] * 7 and len(fake.calls) == 7
    assert all(flag(argv, "--device") == ["cuda"] for argv, _, _ in fake.calls if "--device" in argv)
    speed_argv = fake.calls[0][0]
    assert {"--graphs", "--amp"} <= set(speed_argv) and flag(speed_argv, "--cost") == ["0.5"]
    # the report is rewritten before and after every step: each command sees the steps before it, and itself running
    for k, (_, _, seen) in enumerate(fake.calls):
        assert [s["status"] for s in seen["steps"]] == ["ok"] * k + ["running"]
    t = by_target(report)
    assert (t[GRAPHS_DEIT]["value"], t[GRAPHS_DEIT]["met"]) == (1.62, True)
    assert (t[EAGER_VITB]["value"], t[EAGER_VITB]["met"]) == (1.75, True)
    assert (t[EVERY_DEIT]["value"], t[EVERY_DEIT]["met"]) == (1.4, True)
    assert t["A-MoD calibrated @ 0.5, DeiT-S, batch 1, bf16, CUDA graphs: >= 1.2x dense"]["value"] == 1.25
    assert (t[TESTS]["value"], t[TESTS]["met"]) == (0, True)
    efficiency = t["A-MoD C=0.125, ViT-B/16, batch 256, bf16, eager: efficiency (speed-up x cost) >= 0.9"]
    assert efficiency["value"] == pytest.approx(1.3 * 0.567) and efficiency["met"] is False
    overhead = json.loads((ROOT / "docs" / "results" / "scores_cpu.json").read_text())["n197"]["kernel_overhead"]
    assert t[SCORES]["value"] == pytest.approx(overhead) and t[SCORES]["met"] is (overhead <= 0.1)
    assert all(x["met"] is not None for x in report["targets"])
    # the page: the summary of every speed step, each step's table, the dense kernel, the compile times
    assert "| method | DeiT-S batch 256, eager | DeiT-S batch 256, graphs |" in md
    assert "| A-MoD calibrated | 1.55x | 1.62x | 1.75x | 1.82x |" in md
    assert "| A-MoD calibrated | a-mod calibrated:x=[1,2] | 0.500 | 1550 | 1.55x (1.52–1.58) | 1620 | 1.62x" in md
    assert "FlashAttention (sdpa_kernel)" in md and "compiled in dense 40.0 s, mod 55.0 s" in md
    assert "NVIDIA H100 80GB HBM3" in md and "**ok**" in md


def test_targets_not_met_are_read_off_the_numbers(gpu_check, tmp_path):
    def speed(model, batch, method):
        if model == "vit_base_patch16_224" and batch == 256 and method == "A-MoD calibrated":
            return 1.5, 1.65
        if model == "deit_small_patch16_224" and batch == 256 and method in ("PiToMe", "ToMe"):
            return 0.8, 0.9 if method == "PiToMe" else 0.95
        return default_speed(model, batch, method)

    fake = FakeCommands(speed=speed, graph_errors=("PPT",))
    code, report, md = run_gpu_plan(gpu_check, tmp_path, fake, "--parts", "speed")
    assert code == 0  # (numbers below a target are results, not failures of the check)
    t = by_target(report)
    assert (t[EAGER_VITB]["value"], t[EAGER_VITB]["met"]) == (1.5, False)
    assert (t[GRAPHS_VITB]["value"], t[GRAPHS_VITB]["met"]) == (1.65, False)
    every = t[EVERY_DEIT]
    assert every["value"] == 0.9 and every["met"] is False
    assert every["note"].startswith("slowest: PiToMe; at or below dense: PiToMe 0.90x, ToMe 0.95x; not measured: PPT")
    # ViT-B: every method measured is faster, but PPT's graph was not recorded: not known, and why
    assert t[EVERY_VITB]["met"] is None and "PPT: not recorded: RuntimeError" in t[EVERY_VITB]["note"]
    assert t[TESTS]["met"] is None and t[TESTS]["note"] == "not measured: no step 'pytest -m cuda' in this run"
    assert "operation not permitted when stream is capturing" in md


def test_a_step_out_of_time_keeps_its_partial_output_and_the_run_goes_on(gpu_check, tmp_path):
    fake = FakeCommands(slow=("vit_base_patch16_224 --batch 256",))
    code, report, md = run_gpu_plan(gpu_check, tmp_path, fake, "--parts", "speed,tests")
    assert code == 3 and report["ok"] is False and report["overall"] == "incomplete (out of time)"
    steps = {s["name"]: s for s in report["steps"]}
    late = steps["speed ViT-B/16 batch 256"]
    assert late["status"] == "timed out" and late["error"].startswith("stopped at its time budget")
    assert late["tail"] == ["starting", "half way"] and "half way" in (tmp_path / late["log"]).read_text()
    # what it had written is kept: each method's setting and cost, no timing
    assert late["result"]["partial"] == "stopped while built (no timing)"
    assert [r["cost"] for r in late["result"]["rows"]][:2] == [1.0, 0.5]
    assert all(s["status"] == "ok" for n, s in steps.items() if n != late["name"]) and len(steps) == 5
    t = by_target(report)
    assert t[GRAPHS_VITB]["met"] is None
    assert t[GRAPHS_VITB]["note"] == "not measured: A-MoD calibrated not timed (stopped while built (no timing))"
    assert t[GRAPHS_DEIT]["met"] is True and t[TESTS]["met"] is True
    assert "Partial: stopped while built (no timing)." in md
    assert "| speed | speed ViT-B/16 batch 256 | timed out |" in md


def test_failed_steps_and_missing_or_malformed_results_are_reported_and_the_run_goes_on(gpu_check, tmp_path):
    fake = FakeCommands(failed_tests=2, broken={"deit_small_patch16_224 --batch 1 ": "malformed",
                                                "vit_base_patch16_224 --batch 1 ": "crash",
                                                "bench_scores.py": "no result", "amod bench": "malformed"})
    code, report, md = run_gpu_plan(gpu_check, tmp_path, fake)
    assert code == 1 and report["overall"] == "FAILED" and len(report["steps"]) == 7
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["speed DeiT-S batch 256"]["status"] == "ok"
    tests = steps["pytest -m cuda"]
    assert tests["status"] == "failed" and tests["result"]["failed"] == 2  # (its report is read all the same)
    malformed = steps["speed DeiT-S batch 1"]
    assert malformed["status"] == "failed" and "result" not in malformed
    assert malformed["result_error"].startswith("its result speed_deit_s_b1.json is unreadable: TypeError")
    crashed = steps["speed ViT-B/16 batch 1"]
    assert crashed["status"] == "failed" and crashed["error"] == "exit status 1"
    assert crashed["tail"][-1] == "RuntimeError: CUDA error: an illegal memory access"
    assert steps["scores N = 197 batch 256 bf16"]["result_error"] == "it wrote no scores.json"
    assert steps["inductor DeiT-S A-MoD C=0.125 batch 256"]["result_error"].startswith(
        "its result inductor.json is unreadable: JSONDecodeError")
    t = by_target(report)
    assert (t[TESTS]["value"], t[TESTS]["met"]) == (2, False) and "tests.test_fast::bad1" in t[TESTS]["note"]
    assert t[SCORES]["met"] is None and t[SCORES]["note"] == (
        "not measured: 'scores N = 197 batch 256 bf16' failed (it wrote no scores.json)")
    assert t[GRAPHS_DEIT]["met"] is True  # (the steps that worked are read)
    assert "- failed: `tests.test_fast::bad1`" in md and "illegal memory access" in md
    assert "| speed | speed DeiT-S batch 1 | failed |" in md


def test_a_result_left_by_an_earlier_run_is_not_read_as_this_runs(gpu_check, tmp_path):
    run_gpu_plan(gpu_check, tmp_path, FakeCommands(), "--parts", "scores")
    code, report, _ = run_gpu_plan(gpu_check, tmp_path, FakeCommands(broken={"bench_scores": "no result"}),
                                   "--parts", "scores")
    assert code == 1 and report["steps"][0]["result_error"] == "it wrote no scores.json"


def test_each_step_gets_what_is_left_of_its_part_and_a_step_that_does_not_fit_is_skipped(gpu_check, tmp_path):
    fake = FakeCommands()
    run_gpu_plan(gpu_check, tmp_path, fake, "--parts", "speed,tests", "--budget-s", "420")
    # speed: 270 s of 420; each step its part's time left less the 45 s each later step of it needs; the tests the rest
    assert [round(t) for _, t, _ in fake.calls] == [135, 180, 225, 270, 420]
    fake = FakeCommands()
    code, report, md = run_gpu_plan(gpu_check, tmp_path / "b", fake, "--parts", "scores,inductor", "--budget-s", "36")
    # scores: 30 / 120 of 36 s = 9 s, below its 10; inductor: 36 s, below its 45
    assert fake.calls == [] and [s["status"] for s in report["steps"]] == ["skipped", "skipped"]
    assert report["steps"][0]["reason"] == "time budget: 9.0 s left for it, it needs 10" and code == 3
    assert by_target(report)[SCORES]["note"] == ("not measured: 'scores N = 197 batch 256 bf16' skipped (time "
                                                 "budget: 9.0 s left for it, it needs 10)")
    assert "| scores | scores N = 197 batch 256 bf16 | skipped | 0 | 9 | time budget" in md


def test_the_page_is_written_when_a_section_cannot_be(gpu_check, tmp_path):
    report = {"steps": [{"name": "speed DeiT-S batch 256", "status": "ok", "part": "speed", "result": {"rows": 3}}],
              "overall": "ok"}  # (no machine, no targets: the page cannot be written in full)
    gpu_check.write_report(tmp_path, report)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "could not be written in full (KeyError" in md and "- speed DeiT-S batch 256: ok" in md
    _, report, _ = run_gpu_plan(gpu_check, tmp_path / "b", FakeCommands(), "--parts", "tests")
    report["steps"].append({"name": "speed odd", "status": "ok", "part": "speed", "seconds": 1.0,
                            "command": "x", "result": {"rows": 3}})
    gpu_check.write_report(tmp_path, report)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "### pytest -m cuda" in md and "### speed odd" in md and "(could not be written: KeyError" in md


def test_a_stopped_step_is_stopped_with_every_process_it_started(gpu_check, tmp_path):
    log, pid = tmp_path / "log", tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_check.run_command(["sh", "-c", f"echo started; sleep 60 & echo $! > {pid}; wait"], cwd=ROOT,
                              env=dict(os.environ), stdout=log, log=log, timeout=1.0)
    assert time.monotonic() - start < 1 + 2 * gpu_check.STOP_GRACE_S and log.read_text() == "started\n"
    grandchild = int(pid.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def test_the_tiny_plan_runs_for_real_on_the_cpu(tmp_path):
    """The issue's command as a new user runs it from a plain checkout: the speed step on a tiny ViT (every method,
    no CUDA graphs on a CPU) and `pytest -m cuda` (every test skipped, and counted, without CUDA), read back."""
    code = load_script().main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, [(s["name"], s.get("tail")) for s in report["steps"]]
    assert report["plan"] == "tiny" and [s["status"] for s in report["steps"]] == ["ok", "ok"]
    speed, tests = (s["result"] for s in report["steps"])
    assert [r["name"] for r in speed["rows"]] == ["dense", *METHODS] and speed["stage"] == "timed"
    assert all(r["eager"]["speedup"] > 0 and not r["error"] for r in speed["rows"])
    assert all(abs(r["cost"] - 0.5) < 0.06 for r in speed["rows"][1:-1])  # (each set to cost 0.5 on this model)
    if not torch.cuda.is_available():
        assert not speed["graphs"] and all(r["graphs"] is None for r in speed["rows"])
        assert tests["passed"] == tests["failed"] == 0 and tests["skipped"] >= 7
        assert by_target(report)[TESTS]["note"].startswith("no `cuda` test ran")
    md = (tmp_path / "gpu_check.md").read_text()
    assert "### speed ViT-Ti 64 px batch 2" in md and "| A-MoD calibrated | mod:capacity=" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_fails_in_one_line(tmp_path, capsys):
    code = load_script().main(["--device", "cuda", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--device cuda" in err
    assert not (tmp_path / "out").exists()
