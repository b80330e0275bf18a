"""`trajflow demos AGENT --split train [--count N] [--seed S] --out FILE`: an expert's demonstrations as JSONL.

The lines are :func:`agents.examples.demonstrations.demonstrations`' (train split only, each scored again by the
agent's own reward). A mistake (an agent without an expert, another split, a count below 1 or above the train split,
an output folder that does not exist) is one line and exit code 2, found before the expert plays; the file is
written only once every line has passed.
"""

from __future__ import annotations

import argparse
import sys

from agents.examples.demonstrations import DemoError, check_out, check_request, demonstrations, write_demonstrations


def run_command(args: argparse.Namespace) -> int:
    try:
        check_request(args.agent, args.split, args.count)
        check_out(args.out)
        lines = demonstrations(args.agent, split=args.split, count=args.count, seed=args.seed)
        path = write_demonstrations(args.out, lines)
    except DemoError as exc:
        print(f"trajflow demos: error: {exc}", file=sys.stderr)
        return 2
    rewards = [line["metadata"]["reward"] for line in lines]
    print(f"wrote {len(lines)} {args.agent} demonstrations ({args.split} split, seed {args.seed}) to {path}; "
          f"agent reward min {min(rewards):g}, mean {sum(rewards) / len(rewards):.3f}")
    return 0
