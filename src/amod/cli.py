"""The ``amod`` command line: each command, declared once in ``COMMANDS``, parses its flags into a library
configuration and calls one library function; a user's error is one line and exit status 2 (``--debug``: the
traceback). A command imports its own modules (``amod.experiments``, ``amod.tools``, ``amod.train``, ``amod.detect``,
``amod.dense``) only when its flags are built or it runs: ``amod --help`` costs the library's import alone."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

# the library only (amod's own import has loaded it); the application's modules are imported by each command
from .files import dumps
from .flags import (Parser, add_flags, add_parsed_flag, build, given, load_yaml_config, positive_int,
                    refuse_other_mode)
from .methods import Method, parse_method
from .mod.convert import MoD
from .shorthand import SHORTHANDS, SHORTHAND_NAMES, method_from_shorthand, parse_shorthand, with_shorthand
from .mod.modes import skipped_mode
from .mod.config import MoDConfig
from .errors import UserError, run_reporting_errors, setup_logging

if TYPE_CHECKING:
    from .train.config import RunConfig

HF_MODEL = "a Hugging Face model: its save_pretrained directory (with config.json), or hf:HUB_ID"  # (docs/cli.md)


def shorthand_flags(g: argparse._ActionsContainer, names: Optional[Sequence[str]] = None,
                    on: Optional[Method] = None, **kwargs: Any) -> None:
    """The flags of a method's shorthand options (``amod.shorthand.SHORTHANDS``, ``names`` of them; default all):
    ``--capacity 0.5`` sets MoD's capacity. ``on``: the method whose fields they set in this command (its default
    ``--method``): each option's help states that method's value, and its choices are those the method takes."""
    for option in SHORTHANDS:
        if names is None or option.name in names:
            help, choices = option.help, option.choices
            if on is not None and option.field is not None:
                help, choices = _on_method(option, on)
            add_parsed_flag(g, option.name, option.field and functools.partial(parse_shorthand, option), help,
                            choices, **kwargs)


def _on_method(option: Any, on: Method) -> tuple[str, Optional[Callable[[], tuple]]]:
    """(help, choices) of shorthand ``option`` where it sets a field of ``on``, a command's default method: the default
    it states is ``on``'s (a run without the flag runs ``on``), not the method class's, and its choices (where the
    registry gives some) only those ``on``'s own check takes."""
    value = getattr(on, option.field)
    if value is None and option.field == "layers" and isinstance(on, MoD):  # (the skipped mode's)
        value = skipped_mode(on.skipped).default_layers
    shown = "the method's own" if value is None else ",".join(map(str, value)) if isinstance(value, tuple) else value
    help = re.sub(r"\s*\(default[^()]*\)$", "", option.help) + f" (default {shown}: --method {on.spec()})"
    if option.choices is None:
        return help, None
    taken = []
    for choice in option.choices():
        try:
            dataclasses.replace(on, **{option.field: choice})
        except ValueError:  # (the method's check refuses it: amod.UserError)
            continue
        taken.append(choice)
    return help, lambda: tuple(taken)


# ---------------------------------------------------------------- commands: flags, then the call

def _flops_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", help=f"timm model names, or {HF_MODEL}")
    p.add_argument("--capacity", type=float, nargs="+", default=[1.0, 0.5, 0.125],
                   help="MoD capacities priced, each a row (with --router, --layers and --skipped)")
    shorthand_flags(p, FLOPS_MOD_OPTIONS, default=None)
    p.add_argument("--tome-cost", type=float, nargs="+", default=None,
                   help="also price token merging (ToMe) matched to these shares of dense MACs")
    p.add_argument("--method", dest="method_specs", nargs="+", action="extend", default=[], metavar="SPEC",
                   help="also price these registered methods, by spec: KIND[:FIELD=VALUE,...], e.g. pitome:keep=0.7 "
                        "(the flag may be given again)")
    p.add_argument("--img-size", type=positive_int, default=None)


FLOPS_MOD_OPTIONS = ("router", "layers", "skipped")  # the MoD setup of amod flops' capacity rows


def _flops(args: argparse.Namespace) -> int:
    from .tools.flops_command import flops_report

    given = {k: getattr(args, k) for k in FLOPS_MOD_OPTIONS if getattr(args, k) is not None}
    mod = method_from_shorthand({"router": MoDConfig.router, **given})
    print(flops_report(args.models, args.capacity, mod, args.tome_cost or (),
                       [(spec, parse_method(spec)) for spec in args.method_specs], args.img_size))
    return 0


# train's and finetune's flags: RunConfig's fields by group, the method's shorthand options after its spec
RUN_GROUPS = (("model", ("model", "pretrained", "checkpoint", "img_size", "patch_size", "depth", "embed_dim",
                         "num_heads", "num_classes", "drop_path")),
              ("the method: its spec, or the shorthand options of one (none given: dense)", ("method_spec",)),
              ("distillation from a dense teacher", ("distill", "teacher", "distill_logits", "distill_temperature",
                                                     "distill_features")),
              ("data and optimisation", ("any_cost", "data", "train_limit", "val_limit", "workers", "skip_bad_images",
                                         "epochs", "batch_size", "grad_accum", "lr", "router_lr", "warmup_epochs",
                                         "weight_decay", "label_smoothing", "clip_grad", "seed", "amp", "out")))
FINETUNE_ONLY = ("pretrained", "checkpoint", "distill", "teacher", "distill_logits", "distill_temperature",
                 "distill_features")


def _run_flags(p: argparse.ArgumentParser, finetune: bool) -> None:
    """Options of train and finetune, from RunConfig's fields; SUPPRESS tells given flags apart."""
    from .train.config import RunConfig

    for title, names in RUN_GROUPS:
        names = [n for n in names if finetune or n not in FINETUNE_ONLY]
        if names:
            g = p.add_argument_group(title)
            add_flags(g, RunConfig, only=names, suppress=True)
        if names == ["method_spec"]:
            shorthand_flags(g, default=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--config", help="YAML file of options; flags override it")


def run_config_from_args(args: argparse.Namespace, finetune: bool = False) -> RunConfig:
    """The RunConfig of a train/finetune command line (its flags over its --config file)."""
    from .train.config import RunConfig, resolve_run_config

    shorthand = {k: getattr(args, k) for k in SHORTHAND_NAMES if hasattr(args, k)}
    return resolve_run_config({**given(args, RunConfig), **shorthand}, args.config, args.resume, finetune)


def _train(args: argparse.Namespace, finetune: bool = False) -> int:
    from .experiments.presets import check_trainable
    from .train.engine import refused_alike, world_size
    from .train.run import train

    cfg = run_config_from_args(args, finetune)
    with refused_alike(world_size()):  # (train and finetune take timm models; the library's loaders say less)
        for option in ("checkpoint", "teacher"):
            check_trainable(getattr(cfg, option), f"--{option}", args.command,
                                   "timm models: an amod .safetensors file or a timm/DeiT .pth")
    summary = train(cfg, resume=args.resume)
    if os.environ.get("RANK", "0") == "0":
        print(dumps(summary))
    return 0


def _config(where: str) -> type:
    """The configuration dataclass ``where`` names, ``module:Class`` under ``amod`` (imported when its command runs)."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(f"amod.{module}"), name)


def _study_flags(p: argparse.ArgumentParser) -> None:
    from .experiments.finetune_study.plan import FinetuneConfig
    from .experiments.router_study import StudyConfig

    S = argparse.SUPPRESS  # a flag of one study is left out unless given: _study refuses it for the other
    p.add_argument("--out", default=S, help=f"default {StudyConfig.out} (with a backbone: {FinetuneConfig.out})")
    add_flags(p, StudyConfig, only=("checkpoint", "data", "seeds"))
    add_flags(p.add_argument_group("a model with a classifier (--checkpoint, or the demo's): the routers study"),
              StudyConfig, only=("capacities", "epochs", "train_limit", "quick"), suppress=True)
    g = p.add_argument_group("a backbone without classifier (--checkpoint, e.g. DINOv2): the matched-cost finetune study")
    add_flags(g, FinetuneConfig, only=("costs", "img_size", "steps", "batch_size", "lr", "eval_images", "probe_train",
                                       "amp", "fp32_check", "report_only", "leave_one_out", "loo_costs",
                                       "loo_images"), suppress=True)
    _methods_flag(g, "only these methods", "; dense and 'A-MoD (paper)' are always run", default=S)
    _distill_flags(g, "the distilled methods' teacher: a dense model file with the probe's classes (default: the "
                      "study's dense run of seed 0, done again with its final weights kept)", suppress=True)


def _distill_flags(g: argparse._ArgumentGroup, teacher_help: str, suppress: bool = False) -> None:
    """The finetune study's distillation flags: ``--teacher`` and ``Distillation``'s fields as ``--distill-*``."""
    from .train.distill import Distillation

    g.add_argument("--teacher", default=argparse.SUPPRESS if suppress else None, metavar="FILE", help=teacher_help)
    add_flags(g, Distillation, prefix="distill-", suppress=suppress)


def _study(args: argparse.Namespace) -> int:
    from .experiments.finetune_study.plan import FINETUNE_STUDY, ROUTER_STUDY, FinetuneConfig, study_for
    from .experiments.router_study import StudyConfig

    # the flags (by dest) that only one study takes: given to the other, they are refused
    flags = {ROUTER_STUDY: ("capacity", "epochs", "train_limit", "quick"),
             FINETUNE_STUDY: ("cost", "img_size", "steps", "batch_size", "lr", "val_limit", "probe_train", "amp",
                              "no_fp32_check", "report_only", "leave_one_out", "loo_cost", "loo_images", "methods",
                              "teacher", "distill_logits", "distill_temperature", "distill_features")}
    mode = study_for(args.checkpoint)
    names = {ROUTER_STUDY: "the routers study", FINETUNE_STUDY: "the finetune study"}
    why = (f"{args.checkpoint} is a backbone without classifier" if mode == FINETUNE_STUDY else
           f"{args.checkpoint or 'the demo model (no --checkpoint)'} has a classifier") + f": {names[mode]} runs"
    refuse_other_mode(args, mode, flags, names, why)
    if mode == FINETUNE_STUDY:
        from .experiments.finetune_study.study import run_finetune_study
        from .train.distill import Distillation

        ft = build(FinetuneConfig, args, distillation=build(Distillation, args, prefix="distill-"))
        print(run_finetune_study(ft.only(getattr(args, "methods", None))))
        return 0
    from .experiments.router_study import run_study

    cfg = build(StudyConfig, args)
    print(run_study(cfg.as_quick() if cfg.quick else cfg))
    return 0


def _methods_flag(p: Any, lead: str, tail: str = "; default all", default: Any = None) -> None:
    """``--methods`` of compare, frontier and the finetune study: which of its methods a command runs (``.only``)."""
    p.add_argument("--methods", nargs="+", default=default, metavar="NAME",
                   help=f"{lead} (names as in the report, e.g. ToMe 'A-MoD fold'), or any registered method by its "
                        f"kind or spec (pitome, ppt:threshold=1e-4), each set to every --cost (a spec with a cost= of "
                        f"its own is refused){tail}")


def _demo_flags(p: argparse.ArgumentParser) -> None:
    from .experiments.demo import DemoConfig

    add_flags(p, DemoConfig, suppress=True)  # (--out: the toy demo's default is its own)
    p.add_argument("--toy", action="store_true",
                   help="the paper's comparison on a small ViT pretrained here instead of the real model")


def _demo(args: argparse.Namespace) -> int:
    if args.toy:
        from .experiments.toy_demo import run_toy_demo

        run_toy_demo(getattr(args, "out", "runs/toy_demo"), quick=getattr(args, "quick", False))
    else:
        from .experiments.demo import DemoConfig, run_demo

        run_demo(build(DemoConfig, args))
    return 0


def _detect_flags(p: argparse.ArgumentParser) -> None:
    from .detect.config import DETECT_FIELDS, DETECT_FLAGS, DetectConfig, DetectStudyConfig, router_help

    p.add_argument("action", choices=tuple(DETECT_FLAGS),
                   help="train: a DETR from scratch, or a finetune of --init (converted with --method); study: "
                        "--dense converted at matched encoder costs, zero-training and finetuned (docs/detr.md)")
    S = argparse.SUPPRESS  # a flag of one action is left out unless given: _detect refuses it for the other
    for name, parse in (("out", str), ("steps", positive_int), ("lr", float)):  # (each action's own default)
        p.add_argument(f"--{name}", type=parse, default=S,
                       help=f"default {getattr(DetectConfig, name)}; study: {getattr(DetectStudyConfig, name)}")
    add_flags(p, DetectConfig, only=("batch_size", "train_canvases", "val_canvases"))
    g = p.add_argument_group("train")
    add_flags(g, DetectConfig, only=DETECT_FIELDS["train"], suppress=True)
    g.add_argument("--router", default=S, help=router_help())
    shorthand_flags(g, ("layers",), default=S, nargs="+")  # (--layers 1 2 3 as before, or 1,2,3 as train's)
    add_flags(p.add_argument_group("study"), DetectStudyConfig, only=DETECT_FIELDS["study"], suppress=True)


def _detect(args: argparse.Namespace) -> int:
    from .detect.config import DETECT_FLAGS, DETECT_SHORTHAND, DetectConfig, DetectStudyConfig

    refuse_other_mode(args, args.action, DETECT_FLAGS, {a: f"amod detect {a}" for a in DETECT_FLAGS})
    if args.action == "study":
        from .detect.study import run_detect_study  # (imports transformers: the optional extra)
        if not hasattr(args, "dense"):
            raise UserError("amod detect study needs --dense (a dense detector's model.safetensors)")
        print(run_detect_study(build(DetectStudyConfig, args)))
        return 0
    from .detect.train import train_detector  # (imports transformers: the optional extra)
    cfg = build(DetectConfig, args).with_shorthand({k: getattr(args, k, None) for k in DETECT_SHORTHAND})
    row = train_detector(cfg)
    print(f"{cfg.out}: step {row['step']}, COCO AP {row['AP']:.4f}, AP50 {row['AP50']:.4f}")
    return 0


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, its help line, its flags and what it runs. ``flags``: ``"module:Config"`` under
    ``amod`` (the configuration's fields are the flags), or a function adding them; ``run``: ``"module:function"``,
    called with that configuration (and ``json=``) and its result printed, or a function of the parsed flags."""

    name: str
    help: str
    flags: Union[str, Callable[[argparse.ArgumentParser], None]]
    run: Union[str, Callable[[argparse.Namespace], int]]
    json: bool = False  # a --json flag (print one JSON object), passed on as json=
    shorthand: tuple[str, ...] = ()  # method shorthand options (--capacity, ...) that set its configuration's method
    methods: str = ""  # a --methods flag (its help's start), applied with the configuration's ``only``

    def add_flags(self, p: argparse.ArgumentParser) -> None:
        if callable(self.flags):
            return self.flags(p)
        config = _config(self.flags)
        add_flags(p, config, suppress=True)  # (flags given, laid over --config's options)
        if self.shorthand:  # (they set the fields of its method: a run without --method runs the default one)
            default = next(f.default for f in dataclasses.fields(config) if f.name == "method")
            shorthand_flags(p, self.shorthand, on=parse_method(default), default=argparse.SUPPRESS)
        p.add_argument("--config", metavar="FILE", help="YAML file of these options, by their flags' names; flags "
                       "override it")
        if self.json:
            p.add_argument("--json", action="store_true", help="print one JSON object")
        if self.methods:
            _methods_flag(p, self.methods)

    def __call__(self, args: argparse.Namespace) -> int:
        if callable(self.run):
            return self.run(args)
        cfg = build(_config(self.flags), args, under=load_yaml_config(args.config) if args.config else None)
        if self.shorthand:
            options = {k: getattr(args, k) for k in self.shorthand if hasattr(args, k)}
            cfg = dataclasses.replace(cfg, method=with_shorthand(parse_method(cfg.method), options).spec())
        result = _config(self.run)(cfg.only(args.methods) if self.methods else cfg,
                                   **({"json": args.json} if self.json else {}))
        if result is not None:
            print(result)
        return 0


COMMANDS: tuple[Command, ...] = (
    Command("flops", "analytic cost table of timm or Hugging Face ViTs: dense, MoD capacities, ToMe costs, any method",
            _flops_flags, _flops),
    Command("train", "train a timm ViT from scratch, dense or reduced (MoD, ToMe, PiToMe, isoFLOP)",
            lambda p: _run_flags(p, False), _train),
    Command("finetune", "reduce a pretrained timm ViT (MoD, ToMe, PiToMe, isoFLOP, or dense) and train it",
            lambda p: _run_flags(p, True), lambda args: _train(args, finetune=True)),
    Command("eval", "accuracy, loss, cost and speed of a saved model", "tools.evaluate:EvalConfig",
            "tools.evaluate:eval_command", json=True),
    Command("bench", "images/s and peak memory: a timm or Hugging Face model vs its MoD conversion, interleaved",
            "tools.bench:BenchConfig", "tools.bench:bench_command", json=True,
            shorthand=("router", "capacity", "layers")),
    Command("export", "export a saved model to ONNX (dynamic batch by default), checked in ONNX Runtime",
            "tools.export_command:ExportConfig", "tools.export_command:export_command", json=True),
    Command("analyze", "leave-one-out importance, routing pictures or attention statistics",
            "experiments.analyze_command:AnalyzeConfig", "experiments.analyze_command:analyze_command"),
    Command("study", "a backbone: every method finetuned at matched cost, with seeds and CIs; a model with a "
            "classifier: routers x capacities x seeds, with controls, leave-one-out and pictures", _study_flags,
            _study),
    Command("compare", "MoD modes vs token merging (ToMe) at matched cost: zero-training and finetuned accuracy (a "
            "backbone: a linear probe, zero-training only), images/s", "experiments.compare:CompareConfig",
            "experiments.compare:run_compare", methods="compare only these methods"),
    Command("calibrate", "a dense model made A-MoD fold with the schedule chosen on unlabeled images, saved",
            "experiments.calibrate_command:CalibrateConfig", "experiments.calibrate_command:calibrate_command",
            shorthand=("router",)),
    Command("frontier", "every training-free method: accuracy against measured speed-up (by default at batch 32 and 1)",
            "experiments.frontier:FrontierConfig", "experiments.frontier:run_frontier",
            methods="sweep only these methods"),
    Command("dense-frontier", "every training-free method's patch features: segmentation mIoU against measured "
            "speed-up (default 448 px, batch 8)", "dense.frontier:DenseFrontierConfig",
            "dense.frontier:run_dense_frontier", methods="sweep only these methods"),
    Command("demo", "the main job: DINOv2 ViT-S/14 made cheaper on Fashion-MNIST, dense vs ToMe vs A-MoD at two "
            "costs, and a short finetune (--toy: the paper's comparison on a small ViT pretrained here)", _demo_flags,
            _demo),
    Command("weights", "real pretrained weights, converted once and cached", "weights:WeightsConfig",
            "weights:weights_command"),
    Command("detect", "DETR with an MoD encoder on Fashion-MNIST canvases, scored with COCO AP", _detect_flags,
            _detect),
)


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of every command, or with ``only`` a command's name, of that one's flags alone (the others listed
    with their help line; ``""``: no command's flags, for ``amod --help``): what ``main`` builds, so that a command
    imports its own modules only."""
    parser = Parser(prog="amod", description="Mixture-of-Depths routing and token merging for timm and Hugging Face "
                                               "ViTs")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        if only is None or command.name == only:
            command.add_flags(p)
    return parser


def _command_in(argv: Sequence[str]) -> Optional[str]:
    """The command ``argv`` names: its first argument that is not an option (``amod``'s own are flags), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``amod argv``: errors a user can cause print one line and exit with status 2, a bug its traceback and status 1
    (``amod.errors.run_reporting_errors``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(only=_command_in(argv) or "").parse_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    setup_logging()
    return run_reporting_errors(args.command, lambda: command(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
