"""The `stableflash` command: thin sub-commands over the packages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _explain_add(args) -> int:
    from stableflash.numerics import explain_add

    result = explain_add(args.a, args.b, args.format, args.operand_format)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0


def _demo(args) -> int:
    from stableflash.demo import run_demo

    run_demo(Path(args.out), train=not args.no_train)
    return 0


def _train(args) -> int:
    from stableflash.train.cli import train_command

    return train_command(args)


def _prepare(args) -> int:
    from stableflash.train.prepare import prepare_command

    return prepare_command(args)


def _torch_missing(error: ImportError) -> str:
    return (f"needs PyTorch, which is not installed here ({error}); install it first, e.g. `pip install torch` (a "
            "CUDA build) or `pip install torch --index-url https://download.pytorch.org/whl/cpu`")


def _needs(error: ImportError):
    """A command's stand-in where PyTorch is missing: it says so when called."""
    def refuse(args) -> int:
        raise ImportError(_torch_missing(error), name="stableflash")
    return refuse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stableflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain-add", help="bit-level walk through one floating-point addition")
    p.add_argument("a", type=float)
    p.add_argument("b", type=float)
    p.add_argument("--format", default="bf16", help="format the sum is rounded to (default bf16)")
    p.add_argument("--operand-format", default="fp32", help="format the operands are held in (default fp32)")
    p.add_argument("--json", action="store_true", help="print every field as JSON")
    p.set_defaults(func=_explain_add)

    p = sub.add_parser("demo", help="the main job on the embedded data (CPU, a few minutes)")
    p.add_argument("--out", default="stableflash-demo", help="output folder (default ./stableflash-demo)")
    p.add_argument("--no-train", action="store_true", help="only the numerics part (seconds)")
    p.set_defaults(func=_demo)

    try:
        from stableflash.train.cli import add_train_arguments
        from stableflash.train.prepare import add_prepare_arguments
    except ImportError as error:  # no PyTorch: the commands that need it say so when called
        for name in ("train", "prepare", "diagnose", "isolate", "report", "reproduce"):
            p = sub.add_parser(name, help=f"(needs PyTorch: {error.name or error})", add_help=False)
            p.set_defaults(func=_needs(error), any_arguments=True)
        return parser
    p = sub.add_parser("train", help="train a GPT with per-layer/per-head attention control")
    add_train_arguments(p)
    p.set_defaults(func=_train)
    p = sub.add_parser("prepare", help="write train.bin/val.bin token memmaps")
    add_prepare_arguments(p)
    p.set_defaults(func=_prepare)
    from stableflash.diagnose.cli import add_commands
    add_commands(sub)
    return parser


def _negative_specials(argv: list[str]) -> list[str]:
    """`explain-add inf -inf`: argparse takes "-inf" and "-nan" for options; a leading space keeps them values
    (float() ignores it)."""
    return [f" {a}" if a.lower() in ("-inf", "-infinity", "-nan") else a for a in argv]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["explain-add"]:
        argv = _negative_specials(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, ImportError, MemoryError) as error:  # one line, not a traceback
        if isinstance(error, ImportError) and error.name == "torch":
            error = _torch_missing(error)
        print(f"stableflash {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
