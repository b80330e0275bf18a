"""``trajflow runs [ROOT] [--json]``: the runs under a storage root, their committed steps and latest metrics.

Imports nothing heavy at module import; the store is loaded when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_ROOT_ENV = "TRAJFLOW_STORAGE"
MAX_METRICS = 6


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``runs`` sub-command to the ``trajflow`` CLI."""
    p = subparsers.add_parser(
        "runs",
        help="list runs and their committed steps",
        description="List the runs under a storage root (a folder or s3://bucket/prefix) with their committed "
        "steps and the metrics of the latest step.",
    )
    p.add_argument("root", nargs="?", default=None, help=f"storage root (default: ${DEFAULT_ROOT_ENV} or ./runs)")
    p.add_argument("--json", action="store_true", help="print a JSON list of {project, run, steps, metrics}")
    p.set_defaults(func=run_command)


def compress_steps(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ",".join(parts)


# Shown first when present; the rest follow alphabetically.
KEY_METRICS = ("train/reward", "val/reward", "train/loss", "train/grad_norm", "time/step_s")


def _metrics_text(metrics: dict[str, float]) -> str:
    keys = [k for k in KEY_METRICS if k in metrics] + sorted(k for k in metrics if k not in KEY_METRICS)
    items = [f"{k}={metrics[k]:.4g}" for k in keys]
    return " ".join(items[:MAX_METRICS]) + (f" (+{len(items) - MAX_METRICS} more)" if len(items) > MAX_METRICS else "")


# A run of `steps: 6` commits steps 0-6: seven steps, six updates. Said under the table, where the count is.
STEP_ZERO_NOTE = "step 0 is the untrained policy; UPDATES counts the committed GRPO updates after it"


def format_table(runs) -> str:
    header = ("PROJECT", "RUN", "UPDATES", "COMMITTED", "LAST", "METRICS (last step)")
    rows = [
        (
            r.project,
            r.run,
            str(sum(1 for s in r.steps if s > 0)),
            compress_steps(r.steps) or "-",
            "-" if r.latest_step is None else str(r.latest_step),
            _metrics_text(r.metrics) or "-",
        )
        for r in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths)), row[-1]]).rstrip() for row in [header, *rows]]
    return "\n".join([*lines, STEP_ZERO_NOTE])


def run_command(args: argparse.Namespace) -> int:
    from storage.errors import StorageError
    from storage.runs import list_runs

    root = args.root or os.environ.get(DEFAULT_ROOT_ENV) or "./runs"
    try:
        runs = list_runs(root)
    except StorageError as exc:
        print(f"trajflow runs: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{"project": r.project, "run": r.run, "steps": r.steps, "metrics": r.metrics} for r in runs]))
    elif not runs:
        print(f"no runs under {root}")
    else:
        print(format_table(runs))
    return 0
