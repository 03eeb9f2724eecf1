"""The ``amod`` command line. Library errors become one-line messages and a non-zero exit."""
from __future__ import annotations

import argparse
import sys
import os
from typing import Callable, Optional, Sequence

from .config import ROUTERS, SKIPPED_MODES

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}
ROUTER_NAMES = list(ROUTERS)
RUN_META = {"command", "config", "resume", "debug"}


class Parser(argparse.ArgumentParser):
    """argparse with amod's error format: one line, ``amod COMMAND: error: ...``, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_layers(text: str):
    """``alternate``, ``later`` or a comma-separated list of block indices."""
    if text in ("alternate", "later", "all"):
        return text
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers must be 'alternate', 'later', 'all' or comma-separated block indices, got {text!r}") from None


def parse_schedule(text: str):
    """One int (every block) or a comma-separated list (one per block)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or comma-separated ints, got {text!r}") from None
    return values[0] if len(values) == 1 and "," not in text else values


def parse_bool(text: str) -> bool:
    if text.lower() in ("true", "yes", "1", "on"):
        return True
    if text.lower() in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _cmd_flops(args: argparse.Namespace) -> int:
    import timm
    import torch

    from .config import validate_capacity
    from .convert import convert
    from .cost import flops
    from .merge import apply as apply_merging

    capacities = [validate_capacity(c) for c in args.capacity]
    rows = []
    for name in args.models:
        if name not in timm.list_models():
            raise ValueError(f"unknown timm model {name!r}")
        setups = [(f"{c:.3f}", dict(capacity=c)) for c in capacities]
        setups += [(f"ToMe@{c:g}", dict(merge_cost=c)) for c in args.merge_cost or ()]
        for label, setup in setups:
            with torch.device("meta"):  # costs need shapes only: no memory, no weights
                model = timm.create_model(name, pretrained=False)
                if "merge_cost" in setup:
                    apply_merging(model, cost=setup["merge_cost"], img_size=args.img_size)
                elif setup["capacity"] < 1.0 or args.router == "standard":
                    convert(model, router=args.router, capacity=setup["capacity"], layers=args.layers,
                            skipped=args.skipped)
            rows.append((name, label, flops(model, args.img_size)))
    header = f"{'model':34s} {'img':>9s} {'capacity':>10s} {'GMACs':>8s} {'GFLOPs':>8s} {'vs dense':>8s} {'ideal x':>7s}"
    layers = args.layers or ("all" if args.skipped == "fold" else "alternate")
    print(f"router={args.router} layers={layers}" + ("" if args.skipped == "bypass" else f" skipped={args.skipped}"))
    print(header)
    for name, label, r in rows:
        print(f"{name:34s} {r.img_size[0]:>4d}x{r.img_size[1]:<4d} {label:>10s} {r.gmacs:>8.3f} "
              f"{r.flops / 1e9:>8.3f} {r.ratio:>8.3f} {1 / r.ratio:>7.2f}")
    return 0


COMMANDS["flops"] = _cmd_flops


def _setup_logging() -> None:
    """Plain lines on stderr (rank 0 only under torchrun). A run directory adds its own log file
    (``amod.rundir.RunDirectory``) once the run's settings have been checked."""
    import logging

    log = logging.getLogger("amod")
    log.handlers.clear()
    log.propagate = False
    rank0 = os.environ.get("RANK", "0") == "0"
    log.setLevel(logging.INFO if rank0 else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)


def resolve_run_config(args: argparse.Namespace, finetune: bool):
    """RunConfig from: defaults (or the checkpoint's config when resuming) <- --config YAML <- flags."""
    from pathlib import Path

    from .engine import load_training_checkpoint
    from .run import RunConfig, load_yaml_config, mod_options_without_router

    flags = {k: v for k, v in vars(args).items() if k not in RUN_META}
    base = RunConfig(eval_before_training=finetune).to_dict()
    yaml_values = load_yaml_config(args.config) if args.config else {}
    if args.resume:  # the run's own settings; anything given again must agree (checked in train)
        out = flags.get("out", yaml_values.get("out", base["out"]))
        base = load_training_checkpoint(Path(out) / "checkpoint.pt")["config"]
    RunConfig.from_dict({**RunConfig().to_dict(), **yaml_values}, args.config or "options")  # names and types
    base.update(yaml_values)
    base.update(flags)
    cfg = RunConfig.from_dict(base, args.config or "options")
    mod_options_without_router({**yaml_values, **flags}, cfg.router, cfg.isoflop)
    if finetune and not args.resume and not (cfg.pretrained or cfg.checkpoint):
        raise ValueError("finetune starts from a trained model: give --pretrained or --checkpoint FILE")
    return cfg


def _cmd_train(args: argparse.Namespace, finetune: bool = False) -> int:
    from .files import dumps
    from .run import train

    _setup_logging()
    cfg = resolve_run_config(args, finetune)
    summary = train(cfg, resume=args.resume)
    if os.environ.get("RANK", "0") == "0":
        print(dumps(summary))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import load
    from .convert import set_capacity
    from .cost import flops
    from .data import build_datasets
    from .engine import BadImages, Dist, evaluate, make_loader
    from .files import dumps

    _setup_logging()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load(args.checkpoint, device)
    if args.capacity is not None:
        set_capacity(model, args.capacity)
    native = model.patch_embed.img_size[0]
    if args.img_size is not None and args.img_size != native:
        raise ValueError(f"{args.checkpoint} takes {native}-px images, not {args.img_size}: drop --img-size, "
                         "or finetune the model at that size first")
    if model.num_classes == 0:
        raise ValueError(f"{args.checkpoint} has no classifier (a backbone): finetune it with amod finetune, "
                         "or compare reduced versions of it with amod compare's linear probe")
    _, val, info = build_datasets(args.data, native, None, args.val_limit)
    if info.num_classes > model.num_classes or info.in_chans != model.patch_embed.proj.in_channels:
        raise ValueError(f"the model ({model.num_classes} classes, {model.patch_embed.proj.in_channels} channels) "
                         f"does not fit {info.name} ({info.num_classes} classes, {info.in_chans} channels)")
    dist_info = Dist(device=device)
    loader = make_loader(val, args.batch_size, False, 0, 0, dist_info)
    bad_images = BadImages(skip=args.skip_bad_images)
    metrics = evaluate(model, loader, device, args.amp, dist_info, progress=not args.json, bad_images=bad_images)
    metrics["macs"] = flops(model).macs
    metrics["skipped_images"] = len(bad_images.paths)
    if args.json:
        print(dumps(metrics))
    else:
        skipped = f", {len(bad_images.paths)} unreadable images skipped" if bad_images.paths else ""
        print(f"top1 {metrics['top1']:.4f}  top5 {metrics['top5']:.4f}  loss {metrics['loss']:.4f}  "
              f"{metrics['macs'] / 1e6:.2f} MMACs/image  {metrics['images_per_s']:.0f} images/s  "
              f"({metrics['images']} images{skipped})")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    _setup_logging()
    run_demo(args.out, quick=args.quick)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    from .config import validate_capacity
    from .files import dumps

    result = run_bench(args.model, args.router, validate_capacity(args.capacity), args.layers, args.batch_size,
                       args.img_size, args.repeats, args.warmup, args.amp, args.device, memory=not args.no_memory)
    if args.json:
        print(dumps(result))
        return 0
    d, m = result["dense"], result["mod"]
    mem = lambda v: "n/a" if v is None else f"{v:.0f} MiB"  # noqa: E731
    print(f"{args.model} {result['img_size'][0]}x{result['img_size'][1]} batch {args.batch_size} on {result['device']}"
          f" ({result['threads']} threads), median of {args.repeats} interleaved runs after {args.warmup} warm-ups")
    print(f"GLIBC_TUNABLES={result['glibc_tunables'] or '(unset)'}")
    print(f"  dense (timm)        {d['images_per_s']:9.1f} images/s  {d['macs'] / 1e9:7.3f} GMACs  peak {mem(d['peak_mem_mb'])}")
    print(f"  {args.router}@{args.capacity:<10g}   {m['images_per_s']:9.1f} images/s  {m['macs'] / 1e9:7.3f} GMACs  "
          f"peak {mem(m['peak_mem_mb'])}")
    print(f"  speed-up {result['speedup']:.3f}x  FLOP bound {result['flop_speedup']:.3f}x  "
          f"efficiency {result['efficiency']:.3f}")
    return 0


COMMANDS["bench"] = _cmd_bench


def _cmd_analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .analysis import attention_stats, keep_frequency_figure, kept_positions, leave_one_out, routing_figure
    from .checkpoint import load
    from .data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, build_datasets, first_images
    from .files import dumps, write_text
    from .rundir import check_output_dir

    _setup_logging()
    out = check_output_dir(args.out)
    model = load(args.checkpoint).eval()
    if args.analysis in ("loo", "routing") and getattr(model, "amod_config", None) is None:
        raise ValueError(f"analyze {args.analysis} needs an MoD model (one trained or finetuned with --router); "
                         f"{args.checkpoint} is not one")
    _, val, info = build_datasets(args.data, model.patch_embed.img_size[0], None, None)
    if info.in_chans != model.patch_embed.proj.in_channels:
        raise ValueError(f"the model takes {model.patch_embed.proj.in_channels}-channel images; {info.name} has "
                         f"{info.in_chans} channels")
    xs, ys = first_images(val, args.images)
    n = len(ys)
    out.mkdir(parents=True, exist_ok=True)
    if args.analysis == "loo":
        result = leave_one_out(model, xs, ys, tokens=args.tokens)
        summary = {str(k): {"router": v["router"], "random": v["random"]} for k, v in result["layers"].items()}
        print(dumps(summary))
    elif args.analysis == "routing":
        gray = info.in_chans == 1
        png = routing_figure(model, xs[: min(n, 8)], out / "routing.png",
                             mean=(FASHION_MNIST_MEAN,) if gray else (0.485, 0.456, 0.406),
                             std=(FASHION_MNIST_STD,) if gray else (0.229, 0.224, 0.225))
        frequency = {k: m.float().mean(dim=0) for k, m in kept_positions(model, xs).items()}
        freq_png = keep_frequency_figure(frequency, tuple(model.patch_embed.grid_size), out / "keep_frequency.png")
        result = {str(k): f.tolist() for k, f in frequency.items()}  # how often each position is kept
        print(f"routing pictures: {png}, {freq_png}")
    else:
        result = {str(k): v for k, v in attention_stats(model, xs).items()}
        print(dumps(result))
    write_text(out / f"{args.analysis}.json", dumps(result, indent=1))
    return 0


def _cmd_study(args: argparse.Namespace) -> int:
    from .study import StudyConfig, run_study

    _setup_logging()
    if args.quick:
        cfg = StudyConfig(out=args.out, checkpoint=args.checkpoint, data=args.data, capacities=(0.5,), seeds=2,
                          epochs=1, train_limit=256, val_limit=128, loo_images=2, loo_tokens=4, quick=True)
    else:
        cfg = StudyConfig(out=args.out, checkpoint=args.checkpoint, data=args.data, capacities=tuple(args.capacity),
                          seeds=args.seeds, epochs=args.epochs, train_limit=args.train_limit)
    print(run_study(cfg))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .compare import CompareConfig, run_compare

    _setup_logging()
    if args.quick:
        cfg = CompareConfig(out=args.out, checkpoint=args.checkpoint, data=args.data, costs=tuple(args.cost),
                            epochs=1, speed_batch=32, speed_repeats=2, quick=True)
    else:
        cfg = CompareConfig(out=args.out, checkpoint=args.checkpoint, data=args.data, costs=tuple(args.cost),
                            img_size=args.img_size, epochs=args.epochs, train_limit=args.train_limit,
                            probe_train=args.probe_train, val_limit=args.val_limit, lr=args.lr,
                            speed_batch=args.speed_batch, speed_repeats=args.speed_repeats)
    print(run_compare(cfg))
    return 0


COMMANDS["compare"] = _cmd_compare
COMMANDS["analyze"] = _cmd_analyze
COMMANDS["study"] = _cmd_study
COMMANDS["train"] = _cmd_train
COMMANDS["finetune"] = lambda args: _cmd_train(args, finetune=True)
COMMANDS["eval"] = _cmd_eval
COMMANDS["demo"] = _cmd_demo


def _add_run_options(p: argparse.ArgumentParser, finetune: bool) -> None:
    """Options shared by train and finetune. Defaults live in RunConfig; SUPPRESS tells given flags apart."""
    S = argparse.SUPPRESS
    g = p.add_argument_group("model")
    g.add_argument("--model", default=S, help="timm model name (default vit_tiny_patch16_224)")
    if finetune:
        g.add_argument("--pretrained", action="store_true", default=S, help="timm's pretrained weights (model hub)")
        g.add_argument("--checkpoint", default=S, help="start from a file: amod .safetensors or timm/DeiT .pth")
    for name in ("img-size", "patch-size", "depth", "embed-dim", "num-heads", "num-classes"):
        g.add_argument(f"--{name}", type=int, default=S)
    g.add_argument("--drop-path", type=float, default=S)
    g = p.add_argument_group("Mixture-of-Depths (no --router: dense)")
    g.add_argument("--router", choices=ROUTER_NAMES, default=S)
    g.add_argument("--capacity", type=float, default=S)
    g.add_argument("--layers", type=parse_layers, default=S,
                   help="alternate | later | all | 1,3,5 (default: all for --skipped fold, alternate otherwise)")
    g.add_argument("--scale-output", type=parse_bool, default=S, help="true | false (default: per router)")
    g.add_argument("--isoflop", action="store_true", default=S,
                   help="train the dense isoFLOP baseline of --router/--capacity/--layers instead")
    g.add_argument("--skipped", choices=list(SKIPPED_MODES), default=S,
                   help="what MoD blocks do with skipped tokens (default bypass)")
    g.add_argument("--protect", type=float, default=S,
                   help="--skipped fold: share of a fold block's patch tokens the router protects (default 0.25)")
    g = p.add_argument_group("token merging (ToMe) instead of MoD")
    g.add_argument("--merge-cost", type=float, default=S, help="share of the dense MACs to match, e.g. 0.56")
    g.add_argument("--merge-r", type=parse_schedule, default=S, help="tokens merged per block: 8 or 8,8,6,...")
    g = p.add_argument_group("data and optimisation")
    g.add_argument("--data", default=S, help="fashion-mnist | imagefolder:PATH | flowers102 | oxford-pets | "
                                             "stanford-cars | imagenet")
    g.add_argument("--train-limit", type=int, default=S, help="train on a fixed random subset of N images")
    g.add_argument("--val-limit", type=int, default=S)
    g.add_argument("--workers", type=int, default=S)
    g.add_argument("--skip-bad-images", action="store_true", default=S,
                   help="skip unreadable image files (and count them) instead of stopping at the first")
    g.add_argument("--epochs", type=int, default=S)
    g.add_argument("--batch-size", type=int, default=S)
    g.add_argument("--lr", type=float, default=S)
    g.add_argument("--warmup-epochs", type=float, default=S)
    g.add_argument("--weight-decay", type=float, default=S)
    g.add_argument("--label-smoothing", type=float, default=S)
    g.add_argument("--clip-grad", type=float, default=S)
    g.add_argument("--seed", type=int, default=S)
    g.add_argument("--amp", choices=["off", "bf16"], default=S)
    g.add_argument("--out", default=S, help="run directory (default runs/run)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--config", help="YAML file of options; flags override it")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="amod", description="Mixture-of-Depths routing for timm ViTs")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("flops", help="analytic cost table for timm ViTs and MoD capacities")
    p.add_argument("models", nargs="+", help="timm model names")
    p.add_argument("--capacity", type=float, nargs="+", default=[1.0, 0.5, 0.125])
    p.add_argument("--router", default="attention", choices=ROUTER_NAMES)
    p.add_argument("--layers", type=parse_layers, default=None, help="default: all for --skipped fold, alternate otherwise")
    p.add_argument("--skipped", choices=list(SKIPPED_MODES), default="bypass")
    p.add_argument("--merge-cost", type=float, nargs="+", default=None,
                   help="also price token merging (ToMe) matched to these shares of dense MACs")
    p.add_argument("--img-size", type=positive_int, default=None)

    _add_run_options(sub.add_parser("train", help="train a model from scratch (dense or MoD)"), finetune=False)
    _add_run_options(sub.add_parser("finetune", help="convert a pretrained model to MoD and train it"), finetune=True)

    p = sub.add_parser("eval", help="accuracy, loss, cost and speed of a saved model")
    p.add_argument("--checkpoint", required=True, help="model.safetensors of a run (or any amod.save file)")
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--img-size", type=positive_int, default=None, help="must be the model's own input size")
    p.add_argument("--val-limit", type=positive_int, default=None)
    p.add_argument("--batch-size", type=positive_int, default=256)
    p.add_argument("--skip-bad-images", action="store_true", help="skip unreadable image files (and count them)")
    p.add_argument("--capacity", type=float, default=None, help="evaluate an MoD model at another capacity")
    p.add_argument("--amp", choices=["off", "bf16"], default="off")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("bench", help="images/s and peak memory: timm model vs its MoD conversion, interleaved")
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--router", default="attention", choices=ROUTER_NAMES)
    p.add_argument("--capacity", type=float, default=0.125)
    p.add_argument("--layers", type=parse_layers, default="alternate")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--img-size", type=positive_int, default=None)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--warmup", type=nonnegative_int, default=3)
    p.add_argument("--amp", choices=["off", "bf16"], default="off")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("analyze", help="leave-one-out importance, routing pictures or attention statistics")
    p.add_argument("analysis", choices=["loo", "routing", "attention"])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--images", type=positive_int, default=16)
    p.add_argument("--tokens", type=positive_int, default=None, help="patch tokens sampled per image (loo; default all)")
    p.add_argument("--out", default="runs/analysis")

    p = sub.add_parser("study", help="routers x capacities x seeds, with CIs, controls, leave-one-out and pictures")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--checkpoint", default=None, help="pretrained dense model (default: the demo's, trained if missing)")
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--capacity", type=float, nargs="+", default=[0.5, 0.125])
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--train-limit", type=positive_int, default=10000)
    p.add_argument("--quick", action="store_true", help="a tiny version (for tests)")

    p = sub.add_parser("compare", help="MoD vs token merging (ToMe) at matched cost: zero-training, finetuned, images/s")
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--checkpoint", default=None, help="dense model (default: the demo's, trained if missing)")
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--cost", type=float, nargs="+", default=[0.56, 0.75], help="cost points, shares of dense MACs")
    p.add_argument("--img-size", type=positive_int, default=None,
                   help="input size of a backbone without classifier (probe protocol); default the model's own")
    p.add_argument("--epochs", type=positive_int, default=1, help="the short finetune, equal for every method")
    p.add_argument("--train-limit", type=positive_int, default=10000, help="finetuning images (classifier protocol)")
    p.add_argument("--probe-train", type=positive_int, default=3000,
                   help="training images the linear probe is fitted on (backbone without classifier)")
    p.add_argument("--val-limit", type=positive_int, default=None)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--speed-batch", type=positive_int, default=256)
    p.add_argument("--speed-repeats", type=positive_int, default=10)
    p.add_argument("--quick", action="store_true", help="a tiny version (for tests)")

    p = sub.add_parser("demo", help="the main job: pretrain, convert, finetune and compare on Fashion-MNIST")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--quick", action="store_true", help="a tiny version (for tests)")

    from .pretrained import add_parser as add_weights_parser, cmd_weights  # amod weights NAME
    add_weights_parser(sub)
    COMMANDS.setdefault("weights", cmd_weights)
    return parser


def _one_line(e: BaseException) -> str:
    """An exception as one line for the user: the OS error's own words and file, or the message."""
    if isinstance(e, OSError) and e.strerror:
        named = e.filename is None or str(e.filename) in e.strerror
        text = e.strerror if named else f"{e.strerror}: {e.filename}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    from safetensors import SafetensorError
    from yaml import YAMLError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except KeyboardInterrupt:
        print("amod: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, RuntimeError, NotImplementedError, SafetensorError, YAMLError) as e:
        if args.debug:
            raise
        print(f"amod {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
