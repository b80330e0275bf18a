"""The `trajflow` command. Each area registers its own subcommands; imports stay light until one runs."""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> what it adds: storage (runs), backends (serve, backend serve), flows (train, eval)
_COMMAND_MODULES = ("flows.commands", "backends.serving.cli", "backends.art.cli", "storage.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajflow", description="Train LLM agents with GRPO in durable Prefect flows.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # an area not installed in this checkout
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
