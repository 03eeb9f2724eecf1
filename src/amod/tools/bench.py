"""Wall-clock measurement that can be trusted on a noisy machine: the models compared run
alternately in one process, warm-up runs are thrown away, and medians are reported."""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..files import dumps
from ..cost import flops
from ..deploy import export, onnx_session
from ..families import family_of
from ..checkpoint import open_model
from ..hf.loading import hf_source
from ..methods import Dense, method_of, parse_method
from ..flags import flag, nonnegative_int, positive_int
from ..fast import compile as fast_compile
from ..ops import attention_scores_explicit, attention_with_scores
from ..train.engine import AMP_MODES, autocast
from ..train.models import check_vit_name
from ..train.resume import Journal
from ..errors import UserError


DEVICES = ("auto", "cpu", "cuda")  # what --device takes


def resolve_device(name: str) -> torch.device:
    """``--device``: ``auto`` (a GPU where torch sees one), ``cpu`` or ``cuda``; refuses ``cuda`` where there is none."""
    if name not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda, but torch {torch.__version__} sees no CUDA device; use --device cpu")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA), so that a timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


REFERENCE_EVERY = 4  # with a reference, it runs again after every this many others in a round: each ratio has a near one


@torch.no_grad()
def time_callables(fns: dict[str, Callable[[], Any]], repeats: int = 10, warmup: int = 2,
                   device: torch.device = torch.device("cpu"), reference: Optional[str] = None,
                   rounds: Optional[TimingRounds] = None) -> dict[str, dict[str, Any]]:
    """Median seconds per call of each callable, measured interleaved: amod's one timing loop.

    Round r calls every function once, in a rotating order (so none always goes first), the device synchronised
    around each call; the first ``warmup`` rounds are discarded. Each entry has ``seconds`` (the median of the kept
    rounds), ``spread`` ((max - min) / median) and ``times`` (the kept rounds' seconds, in round order, for ratios
    taken round by round).

    With a ``reference`` (one of the names), each round runs it first and again after every ``REFERENCE_EVERY`` of
    the others, and every entry gains ``ratios`` (one per kept round: the mean of the reference's runs just before
    and after the call, over the call's own seconds, so that a slow spell of a shared machine touches both sides of
    a ratio) and ``speedup`` (their median); the reference's ``times`` are the median of its runs in each round and
    its ratios 1.

    ``rounds``: where each kept round is saved as it finishes (``TimingRounds``). Every kept round times every
    callable, so a round is a whole comparison: the kept rounds a killed timing saved are reused, and only the
    missing ones are run, after ``warmup`` rounds of this sitting (none when no round is missing).
    """
    if repeats < 1 or warmup < 0:
        raise UserError("repeats must be >= 1 and warmup >= 0")
    if reference is not None and reference not in fns:
        raise UserError(f"the reference {reference!r} is not one of the callables timed ({', '.join(fns)})")
    kept = list(rounds.rounds[:repeats]) if rounds is not None else []
    for saved in kept:
        if set(saved["times"]) != set(fns) or (reference is not None and set(saved.get("ratios", ())) != set(fns)):
            raise UserError(f"a saved round of {rounds.path} times {', '.join(saved['times'])}, not "
                            f"{', '.join(fns)}{' against ' + reference if reference else ''}")
    if len(kept) < repeats:
        for r in range(warmup):
            _round(fns, r, device, reference)
        for r in range(warmup + len(kept), warmup + repeats):  # (the rotation an unbroken run would use)
            kept.append(_round(fns, r, device, reference))
            if rounds is not None:
                rounds.add(kept[-1])
    out: dict[str, dict[str, Any]] = {}
    for n in fns:
        t = [k["times"][n] for k in kept]
        median = statistics.median(t)
        out[n] = {"seconds": median, "spread": (max(t) - min(t)) / median, "times": t}
        if reference is not None:
            ratios = [k["ratios"][n] for k in kept]
            out[n].update(ratios=ratios, speedup=statistics.median(ratios))
    return out


def _round(fns: dict[str, Callable[[], Any]], r: int, device: torch.device, reference: Optional[str]
           ) -> dict[str, dict[str, float]]:
    """One round of ``time_callables`` (its ``r``-th, which decides the order): ``{"times": {name: seconds}}``, and
    with a ``reference`` ``"ratios"`` too."""
    others = [n for n in fns if n != reference]
    order = others[r % len(others):] + others[:r % len(others)] if others else []

    def timed(name: str) -> float:
        sync_device(device)
        start = time.perf_counter()
        fns[name]()
        sync_device(device)
        return time.perf_counter() - start

    if reference is None:
        return {"times": {name: timed(name) for name in order}}
    times, ratios = {}, {}
    before = timed(reference)
    reference_runs, group = [before], []
    for i, name in enumerate(order, start=1):
        group.append((name, timed(name)))
        if i % REFERENCE_EVERY == 0 or i == len(order):
            after = timed(reference)
            reference_runs.append(after)
            for n, t in group:
                times[n], ratios[n] = t, (before + after) / 2 / t
            before, group = after, []
    times[reference], ratios[reference] = statistics.median(reference_runs), 1.0
    return {"times": times, "ratios": ratios}


class TimingRounds:
    """The kept rounds of one interleaved timing (``time_callables``'s ``rounds``), each appended to a JSON-lines
    file as it finishes, so that a killed timing goes on with the rounds it is missing. ``key`` names what the rounds
    measure (``timing_key``, the rows' fingerprint); rows of another key in the file are not read; a torn last line is
    skipped with a warning and timed again."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = Path(path), key
        # a train.resume.Journal of rounds in order, bound to ``key`` (rows written before that format name it "key")
        self.journal = Journal(self.path, fingerprint=key, what="a timing round",
                               older=lambda r: {"fingerprint": r["key"], **{k: v for k, v in r.items() if k != "key"}})
        self.rounds: list[dict[str, dict[str, float]]] = [{k: r[k] for k in ("times", "ratios") if k in r}
                                                          for r in self.journal.values()]

    def done(self, repeats: int) -> bool:
        """Whether ``repeats`` rounds are saved: the timing is finished and times nothing again."""
        return len(self.rounds) >= repeats

    def add(self, timed: dict[str, dict[str, float]]) -> None:
        self.journal.add(timed)
        self.rounds.append(timed)


def timing_key(*settings: Any) -> str:
    """What a timing's rounds depend on, as 16 hex digits: the caller's ``settings`` (the models' settings, the
    input) with this process's thread count and ``GLIBC_TUNABLES``, so that rounds of another set-up are not mixed
    into one median."""
    fields = [*map(str, settings), torch.get_num_threads(), os.environ.get("GLIBC_TUNABLES")]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def same_setting_as(settings: dict[str, Any]) -> dict[str, str]:
    """{name: the first name whose setting equals its own} of the (name, setting) pairs of ``settings`` (a setting:
    a method's ``repr``): points that resolve to one model are built and timed once, and share that measurement
    (every other name maps to itself). The one rule of `amod frontier`, the finetune study's timing and the GPU
    check."""
    first: dict[Any, str] = {}
    return {name: first.setdefault(setting, name) for name, setting in settings.items()}


def time_models(models: dict[str, nn.Module], x: torch.Tensor, repeats: int = 10, warmup: int = 2,
                amp: str = "off", reference: Optional[str] = None, forwards_per_call: int = 1,
                rounds: Optional[TimingRounds] = None) -> dict[str, dict[str, Any]]:
    """``time_callables`` for models on one batch ``x`` (each call ``forwards_per_call`` forwards under
    ``torch.inference_mode`` and ``amp``'s autocast; several make a batch-1 call long enough to time); adds
    ``images_per_s``. ``reference`` and ``rounds``: as ``time_callables`` (ratios to it, round by round; the kept
    rounds saved as they finish)."""
    for m in models.values():
        m.eval()

    def call(m: nn.Module) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode(), autocast(amp, x.device):
                for _ in range(forwards_per_call):
                    out = m(x)
            return out
        return run

    timed = time_callables({n: call(m) for n, m in models.items()}, repeats, warmup, x.device, reference, rounds)
    for t in timed.values():
        t["images_per_s"] = x.shape[0] * forwards_per_call / t["seconds"]
    return timed


# ---------------------------------------------------------------- a measured speed-up checked against the MACs

# At a share ``cost`` of the dense MACs the FLOP bound of a speed-up is 1 / cost; measured runs reach 0.3-1.1 of it
# (fewer tokens also fit the caches better). A speed-up above MAX_EFFICIENCY times the bound is not the model's: the
# timing was disturbed (other work on the machine slowed the dense runs it is a ratio to).
MAX_EFFICIENCY = 1.5
IMPLAUSIBLE_NOTE = (f"(?) faster than its MACs allow (measured speed-up x cost above {MAX_EFFICIENCY:g}; the FLOP "
                    "bound is 1 / cost): other work on the machine disturbed the timing, so it is not a result; "
                    "time again on a quiet machine")


def implausible_speedup(speedup: float, cost: float) -> bool:
    """Whether a measured ``speedup`` of a model at a share ``cost`` of the dense MACs is more than
    ``MAX_EFFICIENCY`` times what its MACs allow: a timing gone wrong, to flag rather than report."""
    return speedup * cost > MAX_EFFICIENCY


def speedup_text(speedup: float, cost: float) -> str:
    """A measured speed-up as a report shows it: ``1.52x``, or ``7.46x (?)`` where it is implausible
    (``IMPLAUSIBLE_NOTE`` says why)."""
    return f"{speedup:.2f}x" + (" (?)" if implausible_speedup(speedup, cost) else "")


def warn_implausible(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """The names of the (name, measured speed-up, cost) ``points`` whose speed-up is implausible, after one warning
    that names them all (none: no warning)."""
    flagged = [(n, s, c) for n, s, c in points if implausible_speedup(s, c)]
    if flagged:
        shown = ", ".join(f"{n} {s:.2f}x at cost {c:.3f}" for n, s, c in flagged)
        warnings.warn(f"{len(flagged)} measured speed-up{'s are' if len(flagged) > 1 else ' is'} faster than the MACs "
                      f"allow (more than {MAX_EFFICIENCY:g} / cost): {shown}; the timing was disturbed (other work on "
                      "the machine), flagged (?) in the report, not a result: time again on a quiet machine")
    return [n for n, _, _ in flagged]


# ---------------------------------------------------------------- peak memory

def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _build_probe_target(spec: dict[str, Any], small: bool = False) -> Callable[[], Any]:
    """A zero-argument callable running the thing to measure, with its inputs already allocated.

    ``small``: the same computation on a tiny input, run first so that one-time library set-up
    (BLAS and oneDNN workspaces, thread pools) is not counted as the op's memory.
    """
    if spec["kind"] == "model":
        model = make_bench_model(spec["model"], spec.get("img_size"), spec.get("method"))
        model = dense_twin(model) if spec.get("dense_twin") else model
        x = torch.randn(1 if small else spec["batch_size"], model.patch_embed.proj.in_channels,
                        *model.patch_embed.img_size)
        return lambda: model(x)
    g = torch.Generator().manual_seed(0)
    shape = list(spec["shape"])
    if small:
        shape[0], shape[2] = 1, 8
    q, k, v = (torch.randn(*shape, generator=g, dtype=getattr(torch, spec.get("dtype", "float32")))
               for _ in range(3))
    method = spec.get("method", "onepass")
    fn = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
          "scores": lambda: attention_with_scores(q, k, v, method=method),
          "explicit": lambda: attention_scores_explicit(q, k, v)}[spec["op"]]
    return fn


def _probe_main() -> None:
    """Child process: build the target, reset the peak-RSS mark, run once, report the extra peak."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    with torch.no_grad():
        _build_probe_target(spec, small=True)()
        fn = _build_probe_target(spec)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak resident set) to the current size
        before = _rss_kib("VmRSS")
        fn()
        peak = _rss_kib("VmHWM")
    print(json.dumps({"peak_mb": (peak - before) / 1024}))


def peak_memory_mb(spec: dict[str, Any]) -> float:
    """Extra peak memory (MiB) of one forward described by ``spec``, measured in a fresh process.

    CPU only: a child process with glibc's default allocator, so that freed memory does not hide the
    peak; the figure is the rise of the resident-set high-water mark during the call.
    """
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    res = subprocess.run([sys.executable, "-c", "from amod.tools.bench import _probe_main; _probe_main()"],
                         input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"memory probe failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout)["peak_mb"]


# ---------------------------------------------------------------- dense vs MoD, side by side

def dense_twin(model: nn.Module) -> nn.Module:
    """A dense model of ``model``'s architecture with random weights (timing and cost do not depend on them; under
    ``torch.device("meta")``, none at all): what a converted ``save_pretrained`` folder is timed and priced against."""
    family = family_of(model)
    return family.rebuild(family.describe(model)).eval()


def make_bench_model(name: str, img_size: Optional[int], method: Optional[str]) -> nn.Module:
    """A timm model with random weights (timing does not depend on them), or a Hugging Face model (a
    ``save_pretrained`` directory or ``hf:ID``, at its config's ``image_size``), made into ``method`` (a spec) where
    one is given."""
    torch.manual_seed(0)
    model = open_model(name, timm_names=True, img_size=img_size)
    if hf_source(name) is not None:
        native = model.patch_embed.img_size[0]
        if img_size is not None and img_size != native:
            raise UserError(f"{name} is a Hugging Face model of {native}-px images (its config's image_size); "
                            f"drop --img-size {img_size}")
        torch.manual_seed(0)
    return (parse_method(method).apply(model) if method else model).eval()


def paired_ratios(base: list[float], other: list[float]) -> dict[str, float]:
    """Speed-up of ``other`` over ``base`` taken round by round (both timed in the same interleaved rounds):
    median, quartiles, min and max of base[r] / other[r]. Each round's two runs share the machine's state
    at that moment, so these ratios are steadier than a quotient of medians on a noisy machine."""
    ratios = sorted(b / o for b, o in zip(base, other))
    if not ratios:
        raise UserError("no rounds to compare")
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": statistics.median(ratios), "q1": q[0], "q3": q[2], "min": ratios[0], "max": ratios[-1],
            "rounds": len(ratios)}


def onnx_sessions(models: dict[str, nn.Module], directory: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Export each model to ``directory`` with ``amod.export`` (checked, dynamic batch) and open an ONNX
    Runtime session on it (idle threads sleep, so that interleaved timings do not disturb each other).
    Returns the sessions and the export reports, by name."""
    sessions, reports = {}, {}
    for name, m in models.items():
        path = os.path.join(directory, f"{name}.onnx")
        reports[name] = export(m, path, check_images=2)
        sessions[name] = onnx_session(path, spinning=False)
    return sessions, reports


def session_callable(session: Any, x: torch.Tensor) -> Callable[[], Any]:
    """A zero-argument callable running the ONNX Runtime ``session`` on the batch ``x``."""
    feed = {session.get_inputs()[0].name: x.detach().cpu().numpy()}
    return lambda: session.run(None, feed)


RUNTIMES = ("torch", "onnxruntime")


@dataclass
class BenchConfig:
    """``amod bench``: ``run_bench``'s arguments (each field's comment is its flag's help: amod.flags)."""

    model: str = "deit_small_patch16_224"  # a timm model name, or a Hugging Face model (directory or hf:ID)
    method: str = flag("mod:capacity=0.125", metavar="SPEC")  # the reduced model timed against the dense one: any
                                                              # registered method by its spec (--router, --capacity
                                                              # and --layers set an MoD spec's fields)
    batch_size: int = flag(32, type=positive_int, flag="speed-batch", aliases=("batch-size",))  # the batch size timed
    img_size: Optional[int] = flag(None, type=positive_int)
    repeats: int = flag(10, type=positive_int)
    warmup: int = flag(3, type=nonnegative_int)
    amp: str = flag("off", choices=AMP_MODES)
    device: str = flag("auto", choices=DEVICES)
    memory: bool = flag(True, negate=True)  # the peak-memory measurement
    compile: bool = False  # time both models compiled by amod.compile (one graph, static shapes, CUDA graphs on a GPU),
                           # their eager forms in the same rounds
    runtime: str = flag("torch", choices=RUNTIMES)  # onnxruntime: export both models (amod export) and time them in
                                                    # ONNX Runtime on the CPU


def run_bench(model: str, method: str = BenchConfig.method, batch_size: int = 32,
              img_size: Optional[int] = None, repeats: int = 10, warmup: int = 3, amp: str = "off",
              device: str = "auto", memory: bool = True, compile: bool = False, runtime: str = "torch"
              ) -> dict[str, Any]:
    """Measure the unconverted timm model and the model ``method`` (a spec, ``amod.methods.parse_method``) makes of it
    alternately in this process. A Hugging Face folder of a converted model (its ``save_pretrained``) is timed as
    saved, against a dense model of its architecture: ``method`` is not used (``label`` says what ran).

    ``runtime="torch"``: eager PyTorch, or with ``compile`` both models under ``torch.compile`` (their
    eager forms are timed in the same rounds, under ``eager``). ``runtime="onnxruntime"``: both models
    exported with ``amod.export`` (checked) and run in ONNX Runtime on the CPU.

    Returns a dict with ``dense`` and ``mod`` (``images_per_s``, ``peak_mem_mb``, ``macs``),
    ``speedup`` (measured: quotient of the medians), ``paired_speedup`` (round by round, see
    ``paired_ratios``), ``flop_speedup`` (ideal: dense MACs / MoD MACs) and ``efficiency``
    (speedup / flop_speedup), plus the settings. Peak memory is measured for eager PyTorch only.
    """
    if runtime not in RUNTIMES:
        raise UserError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    reduced = parse_method(method)
    if reduced.needs_images:
        raise UserError(f"--method {method}: {reduced.kind} chooses its setting on images: time the model amod "
                        "calibrate saved (amod eval, amod frontier)")
    if hf_source(model) is None:
        check_vit_name(model)  # amod's supported-models line, not timm's error about an argument of another family
    if runtime == "onnxruntime":
        if compile:
            raise UserError("--compile applies to the torch runtime; ONNX Runtime compiles the graph itself")
        if device == "cuda" or amp != "off":
            raise UserError("the ONNX Runtime benchmark runs fp32 on the CPU: use --device cpu (or auto) and --amp off")
        device = "cpu"
    dev = resolve_device(device)
    dense = make_bench_model(model, img_size, None).to(dev)
    saved = method_of(dense)
    if isinstance(saved, Dense):
        mod = make_bench_model(model, img_size, reduced.spec()).to(dev)
        layers = getattr(reduced, "layers", None)  # (an MoD method's setting, as the result has always named it)
        label, settings = reduced.label(), {"method": reduced.spec(), "router": getattr(reduced, "router", None),
                                            "capacity": getattr(reduced, "capacity", None),
                                            "layers": list(layers) if isinstance(layers, tuple) else layers}
        specs = ({"method": None}, {"method": reduced.spec()})  # (how the memory probe builds each)
    else:  # a converted save_pretrained folder: as saved (its settings in its label), against its dense architecture
        dense, mod = dense_twin(dense).to(dev), dense
        label, settings = f"{saved.label()} (saved)", dict(method=saved.spec(), router=None, capacity=None, layers=None)
        specs = ({"method": None, "dense_twin": True}, {"method": None})
    x = torch.randn(batch_size, dense.patch_embed.proj.in_channels, *dense.patch_embed.img_size, device=dev)
    result: dict[str, Any] = {
        "model": model, **settings, "batch_size": batch_size,
        "img_size": list(dense.patch_embed.img_size), "device": str(dev), "amp": amp, "repeats": repeats,
        "warmup": warmup, "threads": torch.get_num_threads(), "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "runtime": runtime, "compile": compile, "hf": hf_source(model) is not None, "label": label,
    }
    eager = {"dense": dense, "mod": mod}
    if runtime == "onnxruntime":
        import onnxruntime

        with tempfile.TemporaryDirectory(prefix="amod-bench-") as tmp:
            sessions, reports = onnx_sessions(eager, tmp)
        timed = time_callables({n: session_callable(s, x) for n, s in sessions.items()}, repeats, warmup, dev)
        for t in timed.values():
            t["images_per_s"] = batch_size / t["seconds"]
        result["onnxruntime"] = onnxruntime.__version__
        result["exporter"] = reports["mod"]["exporter"]
        result["onnx_ops"] = {n: r["ops"] for n, r in reports.items()}
    elif compile:  # amod.compile: one graph, static shapes, CUDA graphs on a GPU
        compiled, result["compile_seconds"] = {}, {}
        for n, m in eager.items():
            compiled[n] = fast_compile(m)
            start = time.perf_counter()
            with torch.inference_mode(), autocast(amp, x.device):  # (as time_models runs them)
                for _ in range(3):  # compile, record the CUDA graph (on a GPU), replay it: before timing
                    compiled[n](x)
            sync_device(x.device)
            result["compile_seconds"][n] = time.perf_counter() - start
        timed = time_models({**compiled, "dense_eager": dense, "mod_eager": mod}, x, repeats=repeats,
                            warmup=warmup, amp=amp)
        result["eager"] = {n: {"images_per_s": timed[f"{n}_eager"]["images_per_s"],
                               "seconds_per_batch": timed[f"{n}_eager"]["seconds"],
                               "spread": timed[f"{n}_eager"]["spread"]} for n in eager}
        result["compile_speedup"] = {n: paired_ratios(timed[f"{n}_eager"]["times"], timed[n]["times"])
                                     for n in eager}
    else:
        timed = time_models(eager, x, repeats=repeats, warmup=warmup, amp=amp)
    for name, m in eager.items():
        result[name] = {"images_per_s": timed[name]["images_per_s"], "seconds_per_batch": timed[name]["seconds"],
                        "spread": timed[name]["spread"], "macs": flops(m).macs, "peak_mem_mb": None}
    if memory and runtime == "torch" and not compile:
        for name, m, spec in (("dense", dense, specs[0]), ("mod", mod, specs[1])):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
                with torch.no_grad():
                    m(x)
                result[name]["peak_mem_mb"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
            else:
                result[name]["peak_mem_mb"] = peak_memory_mb({"kind": "model", "model": model, "img_size": img_size,
                                                              "batch_size": batch_size, **spec})
    result["speedup"] = result["mod"]["images_per_s"] / result["dense"]["images_per_s"]
    result["paired_speedup"] = paired_ratios(timed["dense"]["times"], timed["mod"]["times"])
    result["flop_speedup"] = result["dense"]["macs"] / result["mod"]["macs"]
    result["efficiency"] = result["speedup"] / result["flop_speedup"]
    result["paired_efficiency"] = result["paired_speedup"]["median"] / result["flop_speedup"]
    return result


def format_bench(result: dict[str, Any], cfg: BenchConfig) -> str:
    """``amod bench``'s lines: a ``run_bench`` result in words."""
    d, m = result["dense"], result["mod"]
    mem = lambda v: "" if v is None else f"  peak {v:.0f} MiB"  # noqa: E731
    how = {"torch": "amod.compile" + (" (CUDA graphs)" if result["device"].startswith("cuda") else "")
                    if cfg.compile else "eager PyTorch",
           "onnxruntime": f"ONNX Runtime {result.get('onnxruntime', '')} ({result.get('exporter', '')} exporter)"}
    label, dense = result["label"], "dense (HF)" if result["hf"] else "dense (timm)"
    lines = [f"{cfg.model} {result['img_size'][0]}x{result['img_size'][1]} batch {cfg.batch_size} on {result['device']}"
             f" ({result['threads']} threads), {how[cfg.runtime]}, median of {cfg.repeats} interleaved runs after "
             f"{cfg.warmup} warm-ups",
             f"GLIBC_TUNABLES={result['glibc_tunables'] or '(unset)'}",
             f"  {dense:20s} {d['images_per_s']:9.1f} images/s  {d['macs'] / 1e9:7.3f} GMACs{mem(d['peak_mem_mb'])}",
             f"  {label:20s} {m['images_per_s']:9.1f} images/s  {m['macs'] / 1e9:7.3f} GMACs{mem(m['peak_mem_mb'])}"]
    if cfg.compile:
        for name, text in (("dense", "dense eager"), ("mod", f"{label} eager")):
            c = result["compile_speedup"][name]
            lines.append(f"  {text:20s} {result['eager'][name]['images_per_s']:9.1f} images/s  compiled/eager "
                         f"{c['median']:.3f}x (rounds {c['q1']:.3f}-{c['q3']:.3f}), compiled in "
                         f"{result['compile_seconds'][name]:.1f} s")
    p = result["paired_speedup"]
    lines.append(f"  speed-up {result['speedup']:.3f}x (round by round {p['median']:.3f}x, quartiles {p['q1']:.3f}-"
                 f"{p['q3']:.3f})  FLOP bound {result['flop_speedup']:.3f}x  efficiency {result['efficiency']:.3f}")
    return "\n".join(lines)


def bench_command(cfg: BenchConfig, json: bool = False) -> str:
    """``amod bench``: the two models timed, in words (``json``: one JSON object)."""
    result = run_bench(**vars(cfg))
    return dumps(result) if json else format_bench(result, cfg)
