"""The GPU check: amod's speed on a GPU against dense timm with FlashAttention, then its CUDA tests, each step a command
with a time budget.

    PYTHONPATH=src python benchmarks/gpu_check.py --out runs/gpu_check          # on a GPU: 9 minutes at most
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --out DIR        # the tiny plan on a CPU: seconds

Parts (``--parts``), in this order (the numbers the issue's targets need first), each a share of ``--budget-s``:

- speed: ``benchmarks/bench_methods.py``, dense timm (FlashAttention) against ToMe, PiToMe, A-MoD fold, A-MoD
  calibrated and PPT at cost 0.5 and the paper's A-MoD at C = 0.125, eager and replayed as CUDA graphs
  (``amod.compile(model, example, mode="cuda-graphs")``), bf16, all interleaved: DeiT-S and ViT-B/16 at batch 256,
  then both at batch 1, a step each. Random weights (the machine has no network): the speed is the trained model's;
- tests: ``python -m pytest -m cuda``, every correctness check on CUDA (the tests marked ``cuda``);
- scores: ``benchmarks/bench_scores.py --device cuda``, the score kernels' time over sdpa alone at N = 197;
- inductor: ``amod bench --compile``, dense and A-MoD C = 0.125 on DeiT-S at batch 256 under ``torch.compile``
  (inductor, CUDA graphs), each compile timed.

``--device cpu`` (or ``--quick``, on a GPU too) runs the tiny plan: the speed step on a 64-px ViT-Ti and the tests
part, the same commands, small, one thread each (two processes that spin on one core each slow each other a
hundredfold); scores and inductor take minutes on a CPU and run on a GPU only.

A step runs in a process group of its own with what is left of its part (less the least each later step of the part
needs) and of the whole budget; one that runs past it is stopped, recorded as timed out with the output it had, and the
run goes on. Every step's output is under ``--out`` (``logs/``, each step's result beside them), and ``gpu_check.json``
and ``gpu_check.md`` are rewritten before and after each step, so a killed run keeps what it had. Each target's ``met``
is computed from the numbers measured: ``None`` where its number was not measured, with the reason. Exit status: 0 when
every step finished, 1 when a step failed, 3 when none failed but one ran out of time (timed out or skipped), 2 when the
device asked for is not there.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
# Seconds per part of the default budget: the whole check in 9 minutes of a lent GPU's 15 (its start-up included),
# inside one device command's 10.
BUDGET_S = {"speed": 270, "tests": 150, "scores": 30, "inductor": 90}
TINY_PARTS = ("speed", "tests")  # what the tiny plan runs (scores and inductor take minutes on a CPU)
COST = 0.5
SPEED_MODELS = (("deit_s", "DeiT-S", "deit_small_patch16_224"), ("vit_b", "ViT-B/16", "vit_base_patch16_224"))
STOP_GRACE_S = 5.0  # a stopped step's seconds between SIGTERM and SIGKILL

# runner(argv, cwd=, env=, stdout=, log=, timeout=) -> exit status; raises subprocess.TimeoutExpired
Runner = Callable[..., int]


@dataclass
class Step:
    """One command of the check, run from the repository root with ``PYTHONPATH=src``."""

    part: str
    name: str
    argv: list[str]
    result: Optional[str] = None  # the file (under --out) its numbers are read from
    stdout_is_result: bool = False  # the command prints its result (JSON) instead of writing it
    min_s: float = 15.0  # skipped when less is left for it


def amod(*args: str) -> list[str]:
    return [sys.executable, "-m", "amod", *args]


def speed_step_name(label: str, batch: int) -> str:
    return f"speed {label} batch {batch}"


def plan(out: Path, device: str, gpu: bool) -> list[Step]:
    """Every step on ``device``: sized for the GPU (``gpu``), or the tiny plan (seconds on a CPU)."""
    dev = ["--device", device]
    speed = [sys.executable, "benchmarks/bench_methods.py", "--cost", f"{COST:g}", "--graphs", *dev]
    if not gpu:
        return [Step("speed", speed_step_name("ViT-Ti 64 px", 2), [
                    *speed, "--model", "vit_tiny_patch16_224", "--img-size", "64", "--batch", "2", "--repeats", "2",
                    "--warmup", "1", "--calibration-images", "8", "--out", str(out / "speed_tiny_b2.json")],
                     result="speed_tiny_b2.json", min_s=5),
                Step("tests", "pytest -m cuda", [*pytest_argv(out), "tests/test_ops.py"], result="cuda_tests.xml",
                     min_s=5)]
    steps = []
    for batch in (256, 1):  # the targets' batch first
        for key, label, model in SPEED_MODELS:
            file = f"speed_{key}_b{batch}.json"
            steps.append(Step("speed", speed_step_name(label, batch), [
                *speed, "--amp", "bf16", "--model", model, "--batch", str(batch), "--repeats",
                "10" if batch >= 8 else "15", "--warmup", "3", "--calibration-images", "64", "--out", str(out / file)],
                result=file, min_s=45))
    steps.append(Step("tests", "pytest -m cuda", pytest_argv(out), result="cuda_tests.xml", min_s=30))
    steps.append(Step("scores", "scores N = 197 batch 256 bf16",
                      [sys.executable, "benchmarks/bench_scores.py", *dev, "--dtype", "bfloat16", "--batch", "256",
                       "--repeats", "20", "--out", str(out / "scores.json")], result="scores.json", min_s=10))
    steps.append(Step("inductor", "inductor DeiT-S A-MoD C=0.125 batch 256",
                      amod("bench", "--model", "deit_small_patch16_224", "--method", "mod:capacity=0.125",
                           "--speed-batch", "256", "--amp", "bf16", "--compile", *dev, "--json"),
                      result="inductor.json", stdout_is_result=True, min_s=45))
    return steps


def pytest_argv(out: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "--durations", "15",
            "--junitxml", str(out / "cuda_tests.xml")]


# ---------------------------------------------------------------- running a step

def run_command(argv: list[str], *, cwd: Path, env: dict[str, str], stdout: Path, log: Path, timeout: float) -> int:
    """Run ``argv`` in a process group of its own, its output in ``log`` (its standard output in ``stdout`` where that
    is another file), and return its exit status. Past ``timeout`` seconds, or when this process is interrupted, the
    whole group is stopped (SIGTERM, then SIGKILL) and the exception raised (``subprocess.TimeoutExpired``)."""
    with contextlib.ExitStack() as files:
        err = files.enter_context(open(log, "w"))
        own = err if stdout == log else files.enter_context(open(stdout, "w"))
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=own, stderr=err,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except BaseException:  # (timed out, or interrupted: leave nothing of the step running)
            stop_group(proc)
            raise


def stop_group(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and every process of its group: SIGTERM, and SIGKILL to what is left ``STOP_GRACE_S`` later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def run_step(step: Step, out: Path, timeout: float, env: dict[str, str], runner: Runner) -> dict[str, Any]:
    """Run ``step`` with ``timeout`` seconds; its record: status (ok / failed / timed out), seconds, the end of its
    output (all of it in ``<out>/logs``) and its numbers, read from its result also where it failed or was stopped
    (``partial`` then says what it holds)."""
    record: dict[str, Any] = {"part": step.part, "name": step.name, "command": shlex.join(step.argv),
                              "budget_s": round(timeout)}
    log = out / "logs" / f"{slug(step.name)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    path = out / step.result if step.result else None
    if path is not None:
        path.unlink(missing_ok=True)  # (an earlier run's result in this --out is not this run's)
    start = time.monotonic()
    try:
        code = runner(step.argv, cwd=ROOT, env=env, stdout=path if step.stdout_is_result else log, log=log,
                      timeout=timeout)
        status = "ok" if code == 0 else "failed"
        record["returncode"] = code
        if code != 0:
            record["error"] = f"exit status {code}"
    except subprocess.TimeoutExpired:
        status, record["error"] = "timed out", f"stopped at its time budget ({timeout:.0f} s)"
    except Exception as e:  # noqa: BLE001 - a step that cannot start is recorded; the run goes on
        status, record["error"] = "failed", f"could not run: {type(e).__name__}: {e}"
    record["seconds"] = time.monotonic() - start
    record.update(log=str(log.relative_to(out)), tail=tail(log))
    if path is not None:
        if path.is_file() and path.stat().st_size:
            try:
                record["result"] = read_result(step, path)
            except Exception as e:  # noqa: BLE001 - a result of any other shape is the step's failure, not the report's
                record["result_error"] = f"its result {step.result} is unreadable: {type(e).__name__}: {e}"
        elif status == "ok":
            record["result_error"] = f"it wrote no {step.result}"
        incomplete = (record.get("result") or {}).get("partial")
        if status == "ok" and ("result_error" in record or incomplete):
            status = "failed"
            record.setdefault("result_error", f"its result {step.result} is incomplete: {incomplete}")
    record["status"] = status
    return record


def tail(log: Path, lines: int = 12) -> list[str]:
    try:
        return log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return []


# ---------------------------------------------------------------- reading a step's result

def number(value: Any) -> Optional[float]:
    """``value`` as a float (None stays None); anything else is a malformed result (TypeError / ValueError)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def read_result(step: Step, path: Path) -> dict[str, Any]:
    """The numbers of a step that the report and the targets use, in one shape; raises on a result of another."""
    if step.part == "tests":
        return read_junit(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    if step.part == "speed":
        return read_speed(data)
    if step.part == "scores":
        n197 = data["n197"]
        return {"batch": data.get("batch"), "dtype": data.get("dtype"),
                "kernel_overhead": number(n197["kernel_overhead"]), "module_overhead": number(n197["module_overhead"])}
    compile_s = {str(k): number(v) for k, v in (data.get("compile_seconds") or {}).items()}
    return {"model": str(data["model"]), "batch_size": int(data["batch_size"]), "label": str(data["label"]),
            "compile": bool(data.get("compile")), "speedup": number(data["speedup"]),
            "flop_speedup": number(data["flop_speedup"]), "efficiency": number(data["efficiency"]),
            "images_per_s": {n: number(data[n]["images_per_s"]) for n in ("dense", "mod")},
            "compile_s": compile_s}


def read_junit(path: Path) -> dict[str, Any]:
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    skips = {sk.get("message", "") for s in suites for sk in s.iter("skipped")}
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"], "failures": bad,
            "skip_reasons": sorted(skips)[:5]}


def read_speed(data: dict[str, Any]) -> dict[str, Any]:
    """A ``bench_methods.py`` result: each model's row (eager and graphed speed, or why there is none)."""
    rows = []
    for r in data["rows"]:
        row = {"name": str(r["name"]), "setting": str(r.get("setting") or ""), "cost": number(r.get("cost")),
               "build_s": number(r.get("build_s")), "graph_s": number(r.get("graph_s")),
               "error": str(r.get("error") or ""), "graph_error": str(r.get("graph_error") or "")}
        for mode in ("eager", "graphs"):
            m = r.get(mode)
            row[mode] = None if m is None else {k: number(m.get(k)) for k in
                                                ("images_per_s", "ms", "speedup", "q1", "q3")}
            if row[mode] is not None and row[mode]["speedup"] is None:
                raise ValueError(f"{row['name']} {mode}: no speedup")
        rows.append(row)
    if not rows or rows[0]["name"] != "dense":
        raise ValueError("its first row is not dense")
    stage = str(data["stage"])
    return {"model": str(data["model"]), "batch": int(data["batch"]), "img_size": data.get("img_size"),
            "device_name": str(data.get("device_name", "")), "amp": str(data.get("amp", "")),
            "dense_attention": str(data.get("dense_attention", "")), "graphs": bool(data.get("graphs")),
            "graphs_note": str(data.get("graphs_note") or ""), "weights": str(data.get("weights", "")),
            "calibration_images": str(data.get("calibration_images", "")), "repeats": data.get("repeats"),
            "warmup": data.get("warmup"), "forwards_per_call": data.get("forwards_per_call"), "stage": stage,
            "partial": None if stage == "timed" else f"stopped while {stage} (no timing)", "rows": rows}


# ---------------------------------------------------------------- targets

@dataclass
class Reading:
    """A number read off the steps, or why there is none."""

    value: Optional[float]
    why: str = ""


def targets(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU plan's targets, each with its measured value and ``met`` computed from it (None: not measured, and why).
    A target that cannot be read (a result of a shape not foreseen) says so in its note; the others are read."""
    by_name = {s["name"]: s for s in steps}

    def result(name: str) -> tuple[Optional[dict[str, Any]], str]:
        s = by_name.get(name)
        if s is None:
            return None, f"not measured: no step '{name}' in this run"
        if s.get("result"):
            return s["result"], ""
        why = s.get("reason") or s.get("result_error") or s.get("error") or ""
        return None, f"not measured: '{name}' {s['status']}" + (f" ({why})" if why else "")

    def speed(label: str, batch: int, method: str, mode: str) -> Reading:
        res, why = result(speed_step_name(label, batch))
        if res is None:
            return Reading(None, why)
        row = next((r for r in res["rows"] if r["name"] == method), None)
        if row is None:
            return Reading(None, f"not measured: no {method} in '{speed_step_name(label, batch)}'")
        if row[mode] is not None:
            return Reading(row[mode]["speedup"])
        if row["error"] or (mode == "graphs" and row["graph_error"]):
            return Reading(None, f"not measured: {method}: {row['error'] or row['graph_error']}")
        if mode == "graphs" and not res["graphs"]:
            return Reading(None, f"not measured: no CUDA graphs ({res['graphs_note']})")
        return Reading(None, f"not measured: {method} not timed ({res['partial'] or 'no timing'})")

    def every_method(label: str) -> Reading:
        res, why = result(speed_step_name(label, 256))
        if res is None:
            return Reading(None, why)
        read = {r["name"]: speed(label, 256, r["name"], "graphs") for r in res["rows"][1:]}
        measured = {n: r.value for n, r in read.items() if r.value is not None}
        slow = [f"{n} {v:.2f}x" for n, v in sorted(measured.items(), key=lambda kv: kv[1]) if v <= 1]
        missing = [r.why.removeprefix("not measured: ") for r in read.values() if r.value is None]
        if not measured:
            return Reading(None, "not measured: " + ("; ".join(missing) or "no method in the step"))
        low = min(measured, key=measured.get)
        note = f"slowest: {low}" + (f"; at or below dense: {', '.join(slow)}" if slow else "") + \
               (f"; not measured: {'; '.join(missing)}" if missing else "")
        # (not met once one measured method is at or below dense; not known while one is missing and none is)
        return Reading(measured[low] if slow or not missing else None, note)

    def tests() -> Reading:
        res, why = result("pytest -m cuda")
        if res is None:
            return Reading(None, why)
        if res["passed"] + res["failed"] == 0:
            return Reading(None, f"no `cuda` test ran ({res['skipped']} skipped: {'; '.join(res['skip_reasons'])})")
        return Reading(res["failed"], "; ".join(res["failures"][:5]))

    def efficiency() -> Reading:
        read = speed("ViT-B/16", 256, "A-MoD C=0.125", "eager")
        res, _ = result(speed_step_name("ViT-B/16", 256))
        row = next((r for r in (res or {}).get("rows", []) if r["name"] == "A-MoD C=0.125"), None)
        if read.value is None or row is None or row["cost"] is None:
            return Reading(None, read.why or "not measured: no cost")
        return Reading(read.value * row["cost"], f"speed-up {read.value:.3f}x at cost {row['cost']:.3f}")

    def scores() -> Reading:
        res, why = result("scores N = 197 batch 256 bf16")
        return Reading(None if res is None else res["kernel_overhead"], why)

    plan: list[tuple[str, Callable[[], Reading], Callable[[float], bool]]] = []
    for label, bound in (("DeiT-S", 1.5), ("ViT-B/16", 1.7)):
        for mode, how in (("graphs", "CUDA graphs"), ("eager", "eager")):
            plan.append((f"A-MoD calibrated @ {COST:g}, {label}, batch 256, bf16, {how}: >= {bound}x dense",
                         lambda label=label, mode=mode: speed(label, 256, "A-MoD calibrated", mode),
                         lambda v, b=bound: v >= b))
    for label in ("DeiT-S", "ViT-B/16"):
        plan.append((f"every method faster than dense, {label}, batch 256, bf16, CUDA graphs (value: the slowest)",
                     lambda label=label: every_method(label), lambda v: v > 1))
    plan += [(f"A-MoD calibrated @ {COST:g}, DeiT-S, batch 1, bf16, CUDA graphs: >= 1.2x dense",
              lambda: speed("DeiT-S", 1, "A-MoD calibrated", "graphs"), lambda v: v >= 1.2),
             ("`pytest -m cuda`: no test fails", tests, lambda v: v == 0),
             ("A-MoD C=0.125, ViT-B/16, batch 256, bf16, eager: efficiency (speed-up x cost) >= 0.9", efficiency,
              lambda v: v >= 0.9),
             ("the score kernels add <= 10 % to sdpa at N = 197", scores, lambda v: v <= 0.10)]
    out = []
    for text, read, meets in plan:
        try:
            r = read()
            met = None if r.value is None else bool(meets(r.value))
        except Exception as e:  # noqa: BLE001 - one unreadable target does not hide the others
            r, met = Reading(None, f"not read: {type(e).__name__}: {e}"), None
        out.append({"target": text, "value": r.value, "met": met, "note": r.why})
    return out


# ---------------------------------------------------------------- report

def fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec) if isinstance(v, float) else str(v)


def cell(v: Any, spec: str = "") -> str:
    return fmt(v, spec).replace("|", "/").replace("\n", " ")


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown rows for ``columns`` = (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(r.get(k), f) for _, k, f in columns) + " |" for r in rows]


def speedup_cell(m: Optional[dict[str, Any]]) -> str:
    if m is None:
        return "–"
    spread = f" ({m['q1']:.2f}–{m['q3']:.2f})" if m["q1"] is not None and m["q3"] is not None else ""
    return f"{m['speedup']:.2f}x{spread}"


def speed_summary(steps: list[dict[str, Any]]) -> list[str]:
    """One table of every speed step: each method's speed-up over dense, eager and with CUDA graphs."""
    timed = [s for s in steps if s["part"] == "speed" and s.get("result")]
    if not timed:
        return []
    names = list(dict.fromkeys(r["name"] for s in timed for r in s["result"]["rows"]))
    head = [f"{s['name'].removeprefix('speed ')}, {mode}" for s in timed for mode in ("eager", "graphs")]
    lines = ["## Speed-up over dense", "",
             f"Median over interleaved rounds of dense's time over the method's (eager against eager dense, CUDA "
             f"graphs against dense in CUDA graphs); every method set to cost {COST:g} but the paper's A-MoD C=0.125. "
             "Dense: timm's fused attention, FlashAttention on CUDA (each step's section says which kernel ran).", "",
             "| method | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name in names:
        cells = []
        for s in timed:
            row = next((r for r in s["result"]["rows"] if r["name"] == name), None)
            for mode in ("eager", "graphs"):
                m = None if row is None else row[mode]
                cells.append("–" if m is None else f"{m['speedup']:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def step_section(s: dict[str, Any]) -> list[str]:
    """A step's own section: what it ran and its numbers."""
    res = s["result"]
    lines = ["", f"### {s['name']}", "", f"`{s['command']}`", ""]
    if res.get("partial"):
        lines += [f"Partial: {res['partial']}.", ""]
    if s["part"] == "tests":
        lines += [f"{res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped."]
        lines += [f"- failed: `{name}`" for name in res["failures"]]
    elif s["part"] == "speed":
        calls = res["forwards_per_call"]
        lines += [f"`{res['model']}` at {'x'.join(map(str, res['img_size'] or []))} px, batch {res['batch']}, "
                  f"{res['device_name']}, amp {res['amp']}; {res['weights']}; dense: {res['dense_attention']}; "
                  f"{res['repeats']} interleaved rounds after {res['warmup']} discarded"
                  + (f", {calls} forwards a call" if calls and calls > 1 else "") + f"; A-MoD calibrated on "
                  f"{res['calibration_images']}" + ("" if res["graphs"] else
                                                          f"; no CUDA graphs: {res['graphs_note']}") + ".", ""]
        rows = [{**r, "eager_x": speedup_cell(r["eager"]), "graphs_x": speedup_cell(r["graphs"]),
                 "eager_ips": (r["eager"] or {}).get("images_per_s"), "graphs_ips": (r["graphs"] or {}).get(
                     "images_per_s"), "note": "; ".join(filter(None, (r["error"], r["graph_error"])))}
                for r in res["rows"]]
        lines += table(rows, [("method", "name", ""), ("setting", "setting", ""), ("cost", "cost", ".3f"),
                              ("eager images/s", "eager_ips", ".0f"), ("eager speed-up (quartiles)", "eager_x", ""),
                              ("graphs images/s", "graphs_ips", ".0f"),
                              ("graphs speed-up (quartiles)", "graphs_x", ""), ("recorded in s", "graph_s", ".2f"),
                              ("note", "note", "")])
    elif s["part"] == "scores":
        lines += [f"sdpa + scores over sdpa alone: {res['kernel_overhead']:+.1%} (batch {res['batch']}, "
                  f"{res['dtype']}); timm's attention module: {res['module_overhead']:+.1%}."]
    else:
        ips = res["images_per_s"]
        lines += [f"{res['model']}, batch {res['batch_size']}, {res['label']} compiled: {res['speedup']:.3f}x dense "
                  f"(FLOP bound {res['flop_speedup']:.3f}x, efficiency {res['efficiency']:.3f}; dense "
                  f"{fmt(ips['dense'], '.0f')} images/s); compiled in "
                  + ", ".join(f"{n} {fmt(v, '.1f')} s" for n, v in res["compile_s"].items()) + "."]
    return lines


OVERALL = {0: "ok", 1: "FAILED", 3: "incomplete (out of time)"}


def exit_status(steps: list[dict[str, Any]]) -> int:
    """0: every step finished; 1: a step failed (its command or its result); 3: none failed, but one ran out of time
    (timed out, or skipped for want of it)."""
    statuses = {s["status"] for s in steps}
    return 1 if "failed" in statuses else 3 if statuses & {"timed out", "skipped", "running"} else 0


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# amod GPU check: {m['device_name']}", "",
             f"amod {report['commit']}; torch {m['torch']} (CUDA {m['torch_cuda']}), Python {m['python']}; "
             f"{report['plan']} plan, {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget, "
             f"{report['started']}. Overall: **{report['overall']}**.", ""]
    if report["plan"] == "tiny":
        lines += ["The tiny plan checks the check (the same commands, small); the targets are read on the GPU plan.",
                  ""]
    lines += ["## Targets", ""]
    lines += table(report["targets"], [("target", "target", ""), ("value", "value", ".3f"), ("met", "met", ""),
                                       ("note", "note", "")])
    lines += [""]
    try:
        lines += speed_summary(report["steps"])
    except Exception as e:  # noqa: BLE001 - the rest of the report is still written
        lines += [f"(the speed summary could not be written: {type(e).__name__}: {e})", ""]
    lines += ["## Steps", ""]
    notes = [{**s, "note": s.get("reason") or s.get("result_error") or s.get("error") or "",
              "last": "" if s["status"] in ("ok", "skipped") else " / ".join(s.get("tail", [])[-2:])[:200]}
             for s in report["steps"]]
    lines += table(notes, [("part", "part", ""), ("step", "name", ""), ("status", "status", ""),
                           ("s", "seconds", ".0f"), ("budget s", "budget_s", ""), ("note", "note", ""),
                           ("last output", "last", "")])
    for s in report["steps"]:
        if s.get("result"):
            try:
                lines += step_section(s)
            except Exception as e:  # noqa: BLE001 - one section that cannot be written does not stop the others
                lines += ["", f"### {s['name']}", "", f"(could not be written: {type(e).__name__}: {e})"]
    return "\n".join(lines + [""])


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``gpu_check.json``, then ``gpu_check.md`` (a bare list of the steps where the full page cannot be written)."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    try:
        text = markdown(report)
    except Exception as e:  # noqa: BLE001 - the page is written whatever the results hold
        text = "\n".join([f"# amod GPU check ({report.get('overall')})", "",
                          f"The report could not be written in full ({type(e).__name__}: {e}); gpu_check.json has "
                          "every number.", ""] + [f"- {s.get('name')}: {s.get('status')}" for s in report["steps"]])
    (out / "gpu_check.md").write_text(text + ("" if text.endswith("\n") else "\n"))


# ---------------------------------------------------------------- main

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and every step's output")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--quick", action="store_true", help="the tiny plan, on a GPU too (a CPU always runs it)")
    p.add_argument("--parts", default=",".join(BUDGET_S), help=f"comma-separated, of {', '.join(BUDGET_S)}")
    p.add_argument("--budget-s", type=float, default=float(sum(BUDGET_S.values())),
                   help="seconds for the whole run, shared among the parts as BUDGET_S")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not args.parts or not set(args.parts) <= set(BUDGET_S):
        p.error(f"--parts takes {', '.join(BUDGET_S)} separated by commas, got {args.parts}")
    return args


def commit() -> str:
    """The checkout's commit, ``+changes`` where its files differ from it; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" +changes" if dirty else "")) if head else "unknown"


def run(args: argparse.Namespace, device: str, gpu: bool, runner: Runner = run_command,
        start: Optional[float] = None) -> int:
    """Run the chosen parts' steps, each within its share of the budget, rewriting the report before and after each."""
    import torch

    start = time.monotonic() if start is None else start
    deadline = start + args.budget_s
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if device == "cpu":  # one thread a step: two processes spinning on the same two cores slow each other 100-fold
        env.setdefault("OMP_NUM_THREADS", "1")
    parts = [p for p in args.parts if gpu or p in TINY_PARTS]
    report: dict[str, Any] = {
        "tool": "benchmarks/gpu_check.py", "commit": commit(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "plan": "GPU" if gpu else "tiny", "device": device, "parts": parts,
        "parts_not_in_plan": [p for p in args.parts if p not in parts], "budget_s": args.budget_s,
        "machine": {"device_name": torch.cuda.get_device_name() if device == "cuda" else
                    f"CPU ({platform.processor() or platform.machine()})",
                    "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version()},
        "overall": "running", "ok": False, "wall_s": 0.0, "steps": [], "targets": []}
    steps = [s for s in plan(out, device, gpu) if s.part in parts]
    print(f"gpu_check: {len(steps)} steps on {report['machine']['device_name']}, budget {args.budget_s:.0f} s",
          flush=True)

    def save() -> None:
        report["wall_s"] = time.monotonic() - start
        report["targets"] = targets(report["steps"])
        write_report(out, report)  # a run killed later keeps what it has measured

    for i, part in enumerate(parts):
        # this part's share of what is left: a part that ends early leaves its time to the later ones
        share = BUDGET_S[part] / sum(BUDGET_S[p] for p in parts[i:])
        part_end = time.monotonic() + share * max(0.0, deadline - time.monotonic())
        mine = [s for s in steps if s.part == part]
        for j, step in enumerate(mine):
            later = sum(s.min_s for s in mine[j + 1:])  # (the least each later step of the part needs is kept for it)
            left = min(part_end - time.monotonic() - later, deadline - time.monotonic())
            if left < step.min_s:
                record = {"part": part, "name": step.name, "command": shlex.join(step.argv), "status": "skipped",
                          "reason": f"time budget: {max(0.0, left):.1f} s left for it, it needs {step.min_s:.0f}",
                          "seconds": 0.0, "budget_s": round(max(0.0, left))}
            else:
                report["steps"].append({"part": part, "name": step.name, "command": shlex.join(step.argv),
                                        "status": "running", "budget_s": round(left), "seconds": 0.0})
                save()
                try:
                    record = run_step(step, out, left, env, runner)
                except BaseException:  # interrupted (Ctrl-C, SIGTERM): the report says which step was running
                    report["steps"][-1].update(status="stopped", error="the check was interrupted")
                    report["overall"] = "interrupted"
                    save()
                    raise
                report["steps"].pop()
            report["steps"].append(record)
            print(f"  [{record['status']:9s}] {step.name} ({record['seconds']:.0f} s)", flush=True)
            save()
    code = exit_status(report["steps"])
    report.update(overall=OVERALL[code], ok=code == 0)
    save()
    for t in report["targets"]:
        print(f"target: {t['target']}: {fmt(t['value'])}, met: {fmt(t['met'])} {t['note']}")
    print(f"{report['overall']} in {report['wall_s']:.0f} s (exit status {code}); wrote {out / 'gpu_check.md'}",
          flush=True)
    return code


def main(argv: Optional[list[str]] = None, runner: Runner = run_command) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device cuda, but torch {torch.__version__} sees no CUDA device (use --device cpu to run "
              "the tiny plan on the CPU)", file=sys.stderr)
        return 2
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    return run(args, device, device == "cuda" and not args.quick, runner, start)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (stopped from outside: its running step is stopped too)
    sys.exit(main())
