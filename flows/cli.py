"""The `trajflow` command: `train` and `eval` run the flows, `sft` a config's supervised warm start, `deploy` sets up a
Prefect server, `config show` prints a config, `demos` writes an example agent's expert demonstrations; other areas add
their own.

Building the parser stays light (argparse only): a flow, and everything it imports, loads when its command runs.
`python -m flows.train` and `python -m flows.evaluate` take the same arguments (flows/arguments.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flows.arguments import config_show_parser, demos_parser, deploy_parser, eval_parser, sft_parser, train_parser

# module -> what it adds: backends (serve, backend serve), storage (runs, fork)
_COMMAND_MODULES = ("backends.serving.cli", "backends.art.cli", "storage.cli", "storage.fork_cli")


def _run_train(args: argparse.Namespace) -> int:
    from flows.train import run_command

    return run_command(args)


def _run_eval(args: argparse.Namespace) -> int:
    from flows.evaluate import run_command

    return run_command(args)


def _run_sft(args: argparse.Namespace) -> int:
    from flows.sft import run_command

    return run_command(args)


def _run_deploy(args: argparse.Namespace) -> int:
    from flows.deploy import run_command

    return run_command(args)


def _run_config_show(args: argparse.Namespace) -> int:
    from flows.config_show import run_command

    return run_command(args)


def _run_demos(args: argparse.Namespace) -> int:
    from flows.demos import run_command

    return run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajflow",
                                     description="Train LLM agents with GRPO in durable Prefect flows.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_parser(sub.add_parser("train", help="train an agent (resumes a stored run)")).set_defaults(func=_run_train)
    sft_parser(sub.add_parser("sft", help="only the supervised warm start (step 0) of a config with sft")
               ).set_defaults(func=_run_sft)
    eval_parser(sub.add_parser("eval", help="evaluate policies on the validation split")).set_defaults(func=_run_eval)
    deploy_parser(sub.add_parser("deploy", help="set up a Prefect server: pools, deployments, crash automations")
                  ).set_defaults(func=_run_deploy)
    config = sub.add_parser("config", help="show the effective config with each field's description",
                            description="Work with RunConfig files.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    config_show_parser(config_sub.add_parser("show", help="print the effective config as commented YAML")
                       ).set_defaults(func=_run_config_show)
    demos_parser(sub.add_parser("demos", help="write a scripted expert's demonstrations (train split) as chat JSONL "
                                "for SFT")).set_defaults(func=_run_demos)
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
