"""Where the flow commands' log lines go: trajflow's on the console, everything in the run's log file and the UI.

- Console: the ``trajflow`` logger's lines (progress, one line per step). Prefect's own records (``prefect.*``: a
  "Task run ... Finished" line per task, the temporary server's start and stop) and library warnings stay off
  it, as do Hugging Face's progress bars, unless ``--verbose``.
- The run's log file, ``$TRAJFLOW_LOG_DIR/<project>/<run>.log`` (default: ``flow-logs/`` in trajflow's cache
  folder, ``$TRAJFLOW_CACHE`` or ``~/.cache/trajflow``; ``tasks/support/run_logs.py``): all of it, Prefect's lines and tracebacks included,
  appended by every command on that run. It is a local file because a run's storage may be S3.
- The Prefect UI: Prefect's records as always, and trajflow's lines: inside a flow run the ``trajflow`` logger
  gets Prefect's API handler (``send_trajflow_logs_to_prefect``), also on a worker that never ran these commands.

With PREFECT_API_URL pointing to a server, ``flow_run_link`` gives the running flow's page in the UI; Prefect's
temporary server has no UI and stops with the command, so then there is none.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.formatters import PrefectFormatter
from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler
from prefect.utilities.urls import url_for

from tasks.support.run_logs import LOG_DIR_ENV, log_file_for  # noqa: F401 - the commands import them here

log = logging.getLogger("trajflow")

_QUIET_SOURCES = ("prefect", "py.warnings")  # logger names kept off the console unless --verbose
_CONSOLE_FORMAT = logging.Formatter("%(asctime)s %(levelname)s trajflow: %(message)s", "%H:%M:%S")
_FILE_FORMAT = PrefectFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                flow_run_fmt="%(asctime)s %(levelname)s flow run %(flow_run_name)r: %(message)s",
                                task_run_fmt="%(asctime)s %(levelname)s task run %(task_run_name)r: %(message)s")


class _Installed:
    """Marks what this module installs (handlers, a filter), so a second command in one process replaces it."""


class _TerminalHandler(logging.StreamHandler, _Installed):
    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(_CONSOLE_FORMAT)


class _RunLogFile(logging.FileHandler, _Installed):
    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8")
        self.setFormatter(_FILE_FORMAT)


class _QuietFilter(logging.Filter, _Installed):
    """Keeps the records of Prefect's loggers and of captured warnings off Prefect's console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(_QUIET_SOURCES)


def _prefect_console_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]


def _remove_own(logger: logging.Logger) -> None:
    for handler in [h for h in logger.handlers if isinstance(h, _Installed)]:
        logger.removeHandler(handler)
        handler.close()


def setup_console(verbose: bool = False, log_file: Path | None = None, command: str = "") -> None:
    """Route this process's log lines as the module docstring says; `command` heads the log file's new section."""
    reset_console()
    trajflow, root = logging.getLogger("trajflow"), logging.getLogger()
    trajflow.addHandler(_TerminalHandler())
    trajflow.setLevel(logging.INFO)
    trajflow.propagate = False  # its lines reach the console once, through its own handler
    if not verbose:
        for handler in _prefect_console_handlers():
            handler.addFilter(_QuietFilter())
    logging.captureWarnings(not verbose)
    if not verbose:
        _hide_progress_bars()
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = _RunLogFile(log_file)
        trajflow.addHandler(file_handler)
        root.addHandler(file_handler)
        file_handler.stream.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {command} (pid {os.getpid()})\n")


def reset_console() -> None:
    """Take out what `setup_console` installed (handlers, filter, warnings capture): before a new set-up, and in tests.

    A command leaves its set-up in place until the process ends: Prefect's temporary server logs its stop at exit,
    and that line belongs in the log file, not on the console.
    """
    trajflow = logging.getLogger("trajflow")
    _remove_own(trajflow)
    _remove_own(logging.getLogger())
    for handler in _prefect_console_handlers():
        for own in [f for f in handler.filters if isinstance(f, _Installed)]:
            handler.removeFilter(own)
    logging.captureWarnings(False)


def _hide_progress_bars() -> None:
    """Hugging Face's download/loading bars: noise on a console that shows progress lines of its own."""
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        disable_progress_bars()
        transformers_logging.disable_progress_bar()
    except ImportError:
        pass


def log_failure(exc: BaseException) -> None:
    """Write `exc`'s traceback to the run's log file only (the console gets one line from the command)."""
    for handler in logging.getLogger("trajflow").handlers:
        if isinstance(handler, _RunLogFile):
            record = logging.LogRecord("trajflow", logging.ERROR, __file__, 0, "command failed", None,
                                       (type(exc), exc, exc.__traceback__))
            handler.handle(record)


class _InRunAPIHandler(APILogHandler):
    """Prefect's API handler, silent outside a run (trajflow also logs from servers' threads and after the flow)."""

    def emit(self, record: logging.LogRecord) -> None:
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            super().emit(record)


def send_trajflow_logs_to_prefect() -> None:
    """Inside a flow run: the ``trajflow`` logger's lines also go to the run's logs in the Prefect UI."""
    trajflow = logging.getLogger("trajflow")
    if not any(isinstance(h, _InRunAPIHandler) for h in trajflow.handlers):
        trajflow.addHandler(_InRunAPIHandler())
    if trajflow.level == logging.NOTSET or trajflow.level > logging.INFO:
        trajflow.setLevel(logging.INFO)  # on a worker, which never ran setup_console


def flow_run_link() -> str | None:
    """The running flow's page in the Prefect UI, or None (no flow run, or no UI: Prefect's temporary server)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return None
    return url_for("flow-run", obj_id=context.flow_run.id)


def announce_flow_run() -> str | None:
    """At a flow's start: trajflow's lines go to the UI too, and the console shows the run's UI page, if any."""
    send_trajflow_logs_to_prefect()
    link = flow_run_link()
    if link:
        log.info("Prefect UI: %s", link)
    return link
