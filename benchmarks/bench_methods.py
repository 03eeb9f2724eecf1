"""Dense timm against every training-free method at one cost, on one model at one batch size: eager, and replayed as
CUDA graphs, every model timed in the same rounds. The GPU check's speed part (benchmarks/gpu_check.py) runs it once
per model and batch size:

    PYTHONPATH=src python benchmarks/bench_methods.py --model deit_small_patch16_224 --batch 256 --device cuda \
        --amp bf16 --graphs --out runs/speed_deit_s_b256.json

Dense is timm's model with its fused attention (``F.scaled_dot_product_attention``), held to the FlashAttention kernel
on CUDA (``torch.nn.attention.sdpa_kernel``; where that kernel refuses the input, sdpa's own choice, and the report
says so). Each method is set to ``--cost`` of the dense MACs by its ``at_cost``: ToMe, PiToMe, A-MoD fold, A-MoD
calibrated and PPT; the paper's A-MoD at C = 0.125 runs as it is. A-MoD calibrated chooses its schedule on
``--calibration-images`` images of Gaussian noise: the weights are random too (timing does not depend on them), so its
speed is that of a schedule at the cost, not of the one a trained model would choose. With ``--graphs`` (CUDA) each
model is also recorded by ``amod.compile(model, example, mode="cuda-graphs")``.

Every model, eager and graphed, runs once per round in a rotating order, the device synchronised around each call
(``bench.time_models``; ``--warmup`` rounds discarded, at a batch below 8 a call is 8 forwards). A speed-up is the
median over rounds of dense's seconds over the model's in the same round (quartiles beside it): eager against eager
dense, graphed against graphed dense. The result (JSON, ``--out``) is written once the models are built and again once
they are timed, so a run stopped in between keeps each model's setting, cost and recording time. A method that cannot
be built, recorded or run is reported with its error, and the others are timed.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import timm
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import amod
from amod.cost import flops
from amod.tools.bench import (DEVICES, make_bench_model, paired_ratios, resolve_device, sync_device,
                              time_models)
from amod.methods import parse_method

# The methods timed, by the name the report gives them: a spec, set to --cost by its at_cost, or run as it is.
METHODS = {"ToMe": ("tome", True), "PiToMe": ("pitome", True), "A-MoD fold": ("mod:skipped=fold", True),
           "A-MoD calibrated": ("calibrated", True), "PPT": ("ppt", True),
           "A-MoD C=0.125": ("mod:capacity=0.125", False)}  # (the paper's A-MoD, alternate blocks: not set to a cost)
FORWARDS_PER_CALL = 8  # at a batch below 8: one forward is too short to time alone


class FlashAttentionOnly(nn.Module):
    """``model`` with every ``scaled_dot_product_attention`` held to the FlashAttention kernel."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return self.model(x)


def autocast(amp: str, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16")


def dense_reference(dense: nn.Module, x: torch.Tensor, amp: str) -> tuple[nn.Module, str]:
    """Dense as it is timed, and what its attention is: FlashAttention on CUDA where the kernel takes the input."""
    fused = all(getattr(b.attn, "fused_attn", False) for b in dense.blocks)
    what = "timm, fused attention (F.scaled_dot_product_attention)" if fused else "timm, explicit attention"
    if x.device.type != "cuda":
        return dense, what + f", sdpa's {x.device.type} kernel"
    flash = FlashAttentionOnly(dense)
    try:
        with torch.inference_mode(), autocast(amp, x.device):
            flash(x[:1])
        sync_device(x.device)
    except RuntimeError as e:
        return dense, what + f", sdpa's own choice (FlashAttention refused: {str(e).splitlines()[0][:120]})"
    return flash, what + ", FlashAttention (sdpa_kernel)"


def build(dense: nn.Module, name: str, cost: float, images: torch.Tensor) -> tuple[nn.Module, dict[str, Any]]:
    """The model of the method ``name`` (of METHODS) at ``cost``, and its row: setting, cost, seconds."""
    spec, set_to_cost = METHODS[name]
    start = time.perf_counter()
    method, row = parse_method(spec), {}
    if method.needs_images:
        method, report = method.calibrated(dense, cost, images, closest=True)
        row["calibration"] = {"images": report["images"], "seconds": report["seconds"]}
    elif set_to_cost:
        method = method.at_cost(dense, cost)
    model = method.apply(copy.deepcopy(dense)).eval()
    row.update(setting=method.spec(), cost=flops(model).ratio, build_s=time.perf_counter() - start)
    return model, row


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_small_patch16_224", help="a timm model name (random weights)")
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cost", type=float, default=0.5, help="share of the dense MACs each method is set to")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="NAME",
                   help=f"of {', '.join(METHODS)} (default all)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--amp", choices=["off", "bf16"], default="off")
    p.add_argument("--graphs", action="store_true", help="also time each model replayed as a CUDA graph (CUDA)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="rounds discarded")
    p.add_argument("--calibration-images", type=int, default=64)
    p.add_argument("--out", required=True, help="the result, JSON")
    args = p.parse_args(argv)
    dev = resolve_device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dense = make_bench_model(args.model, args.img_size, None).to(dev)
    size = list(dense.patch_embed.img_size)
    x = torch.randn(args.batch, dense.patch_embed.proj.in_channels, *size, generator=torch.Generator().manual_seed(0)
                    ).to(dev)
    images = torch.randn(args.calibration_images, *x.shape[1:], generator=torch.Generator().manual_seed(1)).to(dev)
    reference, attention = dense_reference(dense, x, args.amp)
    graphs = args.graphs and dev.type == "cuda"
    result: dict[str, Any] = {
        "model": args.model, "img_size": size, "batch": args.batch, "cost_target": args.cost, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU", "amp": args.amp,
        "torch": torch.__version__, "timm": timm.__version__, "threads": torch.get_num_threads(),
        "dense_attention": attention, "weights": f"random ({args.model}, pretrained=False)",
        "calibration_images": f"{args.calibration_images} images of Gaussian noise",
        "graphs": graphs, "graphs_note": "" if graphs else ("not asked for (--graphs)" if not args.graphs else
                                                            f"CUDA graphs need a GPU; this run is on {dev.type}"),
        "repeats": args.repeats, "warmup": args.warmup,
        "forwards_per_call": FORWARDS_PER_CALL if args.batch < 8 else 1, "stage": "building", "rows": []}

    def write(stage: str) -> None:
        result["stage"] = stage
        out.write_text(json.dumps(result, indent=2) + "\n")

    rows = result["rows"]
    rows.append({"name": "dense", "setting": "", "cost": 1.0, "build_s": 0.0})
    eager: dict[str, nn.Module] = {"dense": reference}
    for name in args.methods:
        print(f"building {name} at cost {args.cost:g}", flush=True)
        try:
            eager[name], row = build(dense, name, args.cost, images)
            with torch.inference_mode(), autocast(args.amp, dev):
                eager[name](x)  # (one forward before any timing: a model that cannot run is left out, not the rest)
            sync_device(dev)
        except Exception as e:  # noqa: BLE001 - reported in its row; the other methods are timed
            traceback.print_exc()
            eager.pop(name, None)
            row = {"error": f"not built: {error_text(e)}"}
        rows.append({"name": name, **row})
        write("building")
    graphed: dict[str, nn.Module] = {}
    if graphs:
        for row in rows:
            if row["name"] not in eager:
                continue
            print(f"recording {row['name']} as a CUDA graph", flush=True)
            try:
                compiled = amod.compile(eager[row["name"]], x, mode="cuda-graphs",
                                        dtype=torch.bfloat16 if args.amp == "bf16" else None)
                graphed[row["name"]], row["graph_s"] = compiled, compiled.amod_compile_seconds
            except Exception as e:  # noqa: BLE001 - its row says why it has no graphed timing
                traceback.print_exc()
                row["graph_error"] = f"not recorded: {error_text(e)}"
                try:
                    torch.cuda.synchronize(dev)
                except Exception:  # noqa: BLE001 - a capture that broke the context: no later graphs
                    row["graph_error"] += "; the CUDA context is broken, no later model was recorded"
                    break
            write("building")
        if "dense" not in graphed:
            graphed = {}
    write("built")
    timed_models = {**eager, **{f"{n} (graphs)": m for n, m in graphed.items()}}
    print(f"timing {len(timed_models)} models interleaved at batch {args.batch}: {args.warmup} + {args.repeats} rounds",
          flush=True)
    timed = time_models(timed_models, x, repeats=args.repeats, warmup=args.warmup, amp=args.amp,
                        forwards_per_call=result["forwards_per_call"])
    for row in rows:
        for mode, key in (("eager", row["name"]), ("graphs", f"{row['name']} (graphs)")):
            if key not in timed:
                continue
            t, ref = timed[key], timed["dense" if mode == "eager" else "dense (graphs)"]
            ratios = paired_ratios(ref["times"], t["times"])
            row[mode] = {"images_per_s": t["images_per_s"], "ms": 1e3 * t["seconds"] / result["forwards_per_call"],
                         "spread": t["spread"], "speedup": ratios["median"], "q1": ratios["q1"], "q3": ratios["q3"]}
        line = "  ".join(f"{mode} {row[mode]['speedup']:.3f}x ({row[mode]['images_per_s']:.0f} images/s)"
                         for mode in ("eager", "graphs") if mode in row)
        print(f"  {row['name']:18s} cost {row.get('cost', float('nan')):.3f}  {line or row.get('error', '')}")
    write("timed")


if __name__ == "__main__":
    main()
