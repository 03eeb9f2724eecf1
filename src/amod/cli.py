"""The ``amod`` command line. Library errors become one-line messages and a non-zero exit."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def parse_layers(text: str):
    """``alternate``, ``later`` or a comma-separated list of block indices."""
    if text in ("alternate", "later"):
        return text
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers must be 'alternate', 'later' or comma-separated block indices, got {text!r}") from None


def _cmd_flops(args: argparse.Namespace) -> int:
    import timm
    import torch

    from .config import validate_capacity
    from .convert import convert
    from .cost import flops

    capacities = [validate_capacity(c) for c in args.capacity]
    rows = []
    for name in args.models:
        if name not in timm.list_models():
            raise ValueError(f"unknown timm model {name!r}")
        for capacity in capacities:
            with torch.device("meta"):  # costs need shapes only: no memory, no weights
                model = timm.create_model(name, pretrained=False)
                if capacity < 1.0 or args.router == "standard":
                    convert(model, router=args.router, capacity=capacity, layers=args.layers)
            report = flops(model, args.img_size)
            rows.append((name, capacity, report))
    header = f"{'model':34s} {'img':>9s} {'capacity':>8s} {'GMACs':>8s} {'GFLOPs':>8s} {'vs dense':>8s} {'ideal x':>7s}"
    print(f"router={args.router} layers={args.layers}")
    print(header)
    for name, capacity, r in rows:
        print(f"{name:34s} {r.img_size[0]:>4d}x{r.img_size[1]:<4d} {capacity:>8.3f} {r.gmacs:>8.3f} "
              f"{r.flops / 1e9:>8.3f} {r.ratio:>8.3f} {1 / r.ratio:>7.2f}")
    return 0


COMMANDS["flops"] = _cmd_flops


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amod", description="Mixture-of-Depths routing for timm ViTs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("flops", help="analytic cost table for timm ViTs and MoD capacities")
    p.add_argument("models", nargs="+", help="timm model names")
    p.add_argument("--capacity", type=float, nargs="+", default=[1.0, 0.5, 0.125])
    p.add_argument("--router", default="attention", choices=["attention", "standard", "random"])
    p.add_argument("--layers", type=parse_layers, default="alternate")
    p.add_argument("--img-size", type=int, default=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except KeyboardInterrupt:
        print("amod: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, NotImplementedError) as e:
        print(f"amod {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
