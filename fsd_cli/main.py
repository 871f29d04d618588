"""The ``fsd`` command line.

Each sub-command lives in its own ``fsd_cli/<name>.py`` module exposing
``register(subparsers) -> None``, which adds its parser and sets ``func`` to a handler taking the
parsed args and returning an exit code. Heavy imports (torch, Ray) happen inside the handlers, so
``fsd sim`` never pays for them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

COMMANDS = ("generate", "models", "sim", "calibrate", "serve", "demo", "trace")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsd", description="Fuzzy Speculative Decoding runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        module = f"fsd_cli.{name}"
        if importlib.util.find_spec(module) is None:
            continue
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # No model hub at run time: a stray hub look-up hangs instead of failing fast.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"fsd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
