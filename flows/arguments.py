"""What the flow commands accept and how they log, for `trajflow train|eval` and `python -m flows.train|evaluate`.

Standard library only, so building the `trajflow` parser imports no flow. It is a module of its own because
flows/cli.py imports the flows (lazily, to run them): were the parsers in flows/cli.py, a flow's ``__main__`` block
would import flows/cli.py back and close an import circle.
"""

from __future__ import annotations

import argparse
import logging


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="YAML RunConfig (defaults when omitted)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, dotted for nested ones (repeatable): --set steps=3")


def train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """CONFIG and --set; `parser` is `trajflow train`'s subparser, or None for `python -m flows.train`'s own."""
    parser = parser or argparse.ArgumentParser(prog="python -m flows.train", description="Train an agent with GRPO.")
    _config_arguments(parser)
    return parser


def eval_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """CONFIG, --set and --policy; `parser` is `trajflow eval`'s subparser, or None for `python -m flows.evaluate`'s."""
    parser = parser or argparse.ArgumentParser(prog="python -m flows.evaluate", description="Evaluate policies.")
    _config_arguments(parser)
    parser.add_argument("--policy", dest="policies", action="append", default=[], metavar="NAME",
                        help="policy to evaluate: base, <run>@<step>, or url=<base_url>,model=<name> (repeatable)")
    return parser


def log_to_terminal() -> None:
    """Show trajflow's progress lines in the terminal (environment defaults: see flows/__init__.py)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s trajflow: %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("trajflow")
    if not logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
