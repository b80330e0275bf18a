"""How a flow command runs: checks before Prefect starts, then the console and log file, then the flow, one ending.

`trajflow train` and `trajflow eval` (and their ``python -m flows.*`` forms) share it: the config and the storage
are checked first (flows/preflight.py), the run's log file and the quiet console are set up (flows/console.py),
and a failure of the flow ends the command in two lines (what failed, where its traceback is) instead of
Prefect's traceback followed by Python's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from flows.console import log_failure, log_file_for, setup_console
from flows.preflight import (
    CommandError,
    check_prefect_api,
    check_storage,
    load_for_command,
    run_guarded,
)
from tasks.run_config import RunConfig


def run_flow_command(prog: str, args: argparse.Namespace, body: Callable[[RunConfig, Path], str],
                     check: Callable[[RunConfig], None] | None = None) -> int:
    """Run `body(config, log_file)` (which calls the flow) and print what it returns; the exit code.

    `check(config)` adds the command's own checks (after the storage's); it raises CommandError.
    """

    def run() -> int:
        config = load_for_command(args)
        check_storage(config.storage)
        if check is not None:
            check(config)
        check_prefect_api()
        log_file = log_file_for(config.project, config.run)
        setup_console(args.verbose, log_file, f"{prog}: {config.project}/{config.run}")
        try:
            ending = body(config, log_file)
        except Exception as exc:  # noqa: BLE001 - any failure of the flow ends the command the same way
            log_failure(exc)
            raise CommandError([f"{type(exc).__name__}: {exc}", f"the traceback is in {log_file}"]) from None
        print(ending)
        return 0

    return run_guarded(prog, run)
