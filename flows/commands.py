"""`trajflow train` and `trajflow eval`: argument parsing only; the work is in the flows."""

from __future__ import annotations

import argparse
import json
import logging


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML RunConfig (defaults when omitted)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, dotted for nested ones (repeatable): --set steps=3")


def _setup_logging() -> None:
    """Show trajflow's progress lines in the terminal (environment defaults: see flows/__init__.py)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s trajflow: %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("trajflow")
    if not logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def build_train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m flows.train", description="Train an agent with GRPO.")
    _common(parser)
    parser.set_defaults(func=run_train)
    return parser


def run_train(args: argparse.Namespace) -> int:
    _setup_logging()
    from tasks.run_config import load_config

    config = load_config(args.config, args.overrides)
    from flows.train import train

    result = train(config)
    print(json.dumps({"run": f"{config.project}/{config.run}", "storage": config.storage, **result}, default=str))
    return 0


def build_eval_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m flows.evaluate", description="Evaluate policies.")
    _common(parser)
    parser.add_argument("--policy", dest="policies", action="append", default=[], metavar="NAME",
                        help="policy to evaluate: base, <run>@<step>, or url=<base_url>,model=<name> (repeatable)")
    parser.set_defaults(func=run_eval)
    return parser


def run_eval(args: argparse.Namespace) -> int:
    _setup_logging()
    from tasks.run_config import load_config

    config = load_config(args.config, args.overrides)
    from flows.evaluate import evaluate

    print(json.dumps(evaluate(config, args.policies or ["base"]), default=str, indent=2))
    return 0


def register(subparsers) -> None:
    build_train_parser(subparsers.add_parser("train", help="train an agent (resumes a stored run)"))
    build_eval_parser(subparsers.add_parser("eval", help="evaluate policies on the validation split"))
