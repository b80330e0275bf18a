"""``trajflow fork SRC_RUN[@STEP] NEW_RUN [--project P] [--from-project Q] [--storage URL]``: start a run from a step.

The new run starts from that step's adapter, optimizer state and data cursor (the latest step with its checkpoint
when no @STEP is given), records where it came from in its ``run.json``, and shares no file with the source
(storage/fork.py). ``trajflow train CONFIG --set run=NEW_RUN`` (or a script's ``TrainableModel(name=NEW_RUN)``)
continues it. A mistake (bad name, no such step, a pruned step, a new run that already trained, a run in use) is one
line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_ROOT_ENV = "TRAJFLOW_STORAGE"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fork", help="start a new run from a committed step of another",
        description="Copy one committed step of a run (adapter, optimizer state, data cursor) into a new run, which "
        "then trains on from it.")
    p.add_argument("source", metavar="SRC_RUN[@STEP]", help="the run to fork, and its step (default: its latest "
                   "step that still has its checkpoint)")
    p.add_argument("new_run", metavar="NEW_RUN", help="name of the new run")
    p.add_argument("--project", default="trajflow", help="project of the new run (and of the source, unless "
                   "--from-project)")
    p.add_argument("--from-project", default=None, help="project of the source run (default: --project)")
    p.add_argument("--storage", default=None, help=f"storage root, a folder or s3://bucket/prefix (default: "
                   f"${DEFAULT_ROOT_ENV} or ./runs)")
    p.set_defaults(func=run_command)


def parse_source(text: str) -> tuple[str, int | None]:
    """``run@7`` -> ("run", 7); ``run`` -> ("run", None); ValueError for a step that is no number."""
    run, sep, step = text.partition("@")
    if not sep:
        return run, None
    if not step.isdigit():
        raise ValueError(f"SRC_RUN[@STEP]: the step after '@' must be a number, got {step!r}")
    return run, int(step)


def run_command(args: argparse.Namespace) -> int:
    from storage.errors import StorageError
    from storage.fork import fork_run
    from storage.lease import RunLease
    from storage.store import RunStore

    root = args.storage or os.environ.get(DEFAULT_ROOT_ENV) or "./runs"
    try:
        run, step = parse_source(args.source)
        source = RunStore(root, args.from_project or args.project, run)
        dest = RunStore(root, args.project, args.new_run)
        lease = RunLease(dest, "trajflow fork").acquire()
        try:
            result = fork_run(source, dest, step=step)
        finally:
            lease.release()
    except (ValueError, StorageError) as exc:
        print(f"trajflow fork: error: {exc}", file=sys.stderr)
        return 2
    print(f"forked {source.project}/{source.run}@{result.step} into {dest.project}/{dest.run} ({result.run_url}), "
          f"at step {result.step}; train on with `trajflow train CONFIG --set project={dest.project} "
          f"--set run={dest.run}`")
    return 0
