"""What the flow commands accept, for `trajflow train|eval|deploy|config show` and `python -m flows.train|evaluate`.

Standard library only, so building the `trajflow` parser imports no flow. It is a module of its own because
flows/cli.py imports the flows (lazily, to run them): were the parsers in flows/cli.py, a flow's ``__main__`` block
would import flows/cli.py back and close an import circle.
"""

from __future__ import annotations

import argparse

CONFIG_HELP = ("The config keys, their values and what each one trades off: `trajflow config show [CONFIG] "
               "[--set ...]` prints the effective config as YAML, each field's description as a comment.")


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="YAML RunConfig (defaults when omitted)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, dotted for nested ones (repeatable): --set steps=3")


def _console_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="also show Prefect's own log lines and library warnings on the console "
                        "(they always go to the run's log file and the Prefect UI)")


def train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """CONFIG, --set, --json, --verbose; `parser` is `trajflow train`'s subparser, or None (`python -m flows.train`)."""
    parser = parser or argparse.ArgumentParser(prog="python -m flows.train", description="Train an agent with GRPO.")
    parser.epilog = CONFIG_HELP
    _config_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="end with one JSON object (run, storage, step, metrics, paths) instead of the summary")
    _console_arguments(parser)
    return parser


def eval_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """CONFIG, --set, --policy, --verbose; `parser` is `trajflow eval`'s subparser, or None (`-m flows.evaluate`)."""
    parser = parser or argparse.ArgumentParser(prog="python -m flows.evaluate", description="Evaluate policies.")
    parser.epilog = CONFIG_HELP
    _config_arguments(parser)
    parser.add_argument("--policy", dest="policies", action="append", default=[], metavar="NAME",
                        help="policy to evaluate: base, <run>@<step>, or url=<base_url>,model=<name> (repeatable)")
    _console_arguments(parser)
    return parser


def sft_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """CONFIG, --set, --verbose of `trajflow sft` (flows/sft.py); None: `python -m flows.sft`."""
    parser = parser or argparse.ArgumentParser(prog="python -m flows.sft")
    parser.description = ("Run only the supervised warm start of CONFIG (its `sft` section): train step 0 on the "
                          "demonstrations, resuming a killed one; `trajflow train` then publishes it and goes on.")
    parser.epilog = CONFIG_HELP
    _config_arguments(parser)
    _console_arguments(parser)
    return parser


def config_show_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """CONFIG and --set of `trajflow config show`."""
    parser.description = ("Print the effective config (CONFIG, or the defaults, with --set applied) as YAML, each "
                          "field's description as a comment. The output is itself a valid config file.")
    _config_arguments(parser)
    return parser


def deploy_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--file, --home, --gpu-slots, --silent-after-s of `trajflow deploy` (flows/deploy.py)."""
    parser.description = ("Set up a Prefect server for trajflow: work pools, the deployments of prefect.yaml (incl. "
                          "the trigger that runs a crashed training run again) and the automation that marks a run "
                          "whose heartbeats stopped Crashed. Safe to run again.")
    parser.add_argument("--file", default=None, help="the prefect.yaml to deploy (default: the checkout's)")
    parser.add_argument("--home", default=None,
                        help="the checkout's path on the worker hosts (default: $TRAJFLOW_HOME, else --file's folder)")
    parser.add_argument("--gpu-slots", type=int, default=1, metavar="N",
                        help="GPU updates at a time, when the `gpu` concurrency limit does not exist yet (default 1)")
    parser.add_argument("--silent-after-s", type=float, default=None, metavar="S",
                        help="mark a run Crashed after S s without a heartbeat (default: 3 heartbeat intervals)")
    return parser


def demos_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """AGENT, --split, --count, --seed, --out of `trajflow demos` (flows/demos.py)."""
    parser.description = ("Play the agent's train scenarios with its scripted expert and write the conversations as "
                          "OpenAI chat-format JSONL (messages, tools, metadata) for SFT, each checked with the "
                          "agent's own reward.")
    parser.add_argument("agent", metavar="AGENT", help="research or tictactoe")
    parser.add_argument("--split", default="train",
                        help="only train is accepted: val and test stay unseen by training")
    parser.add_argument("--count", type=int, default=None,
                        help="conversations to write (default: the whole train split)")
    parser.add_argument("--seed", type=int, default=0, help="orders the train scenarios and breaks the expert's ties")
    parser.add_argument("--out", required=True, help="the JSONL file to write (its folder must exist)")
    return parser
