"""What the flow commands check before Prefect starts, and how a user's mistake ends a command: one line each.

Prefect's temporary server takes about 10 s to start, and a mistake found inside the flow is printed by Prefect
and again by Python. So the commands check, in this order and once each:

1. the config loads: one line per problem (tasks/config_errors.py), exit code 2, as argparse does for usage;
2. the storage root can hold runs: a local folder is created if missing and a file is written into it and removed,
   so the cause is the operating system's own ("permission denied", "is a file, not a folder", "read-only file
   system"); a URL root is opened through the store and, on S3, its bucket is checked. Exit code 1;
3. a stored run of the same name was made with the same settings that define a run (``check_run_identity``),
   exit code 2, its demonstrations (``sft.data``) read and parse, each bad line named, and are those its step 0
   was trained on (exit code 2), and no other live process holds the run's lease (storage/lease.py), exit code 1;
4. a PREFECT_API_URL that is set answers Prefect's health check (else Prefect would retry, then fail mid-start).
   Exit code 1;
5. (in ``check_run``) the GPUs the config places inference and training on exist here
   (``tasks/support/placement.py``), exit code 2, before a model loads onto a device that is not there.

``run_guarded`` prints a ``CommandError`` as ``<prog>: error: <line>`` lines on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable

from storage.errors import StorageError
from storage.fs import Location, normalize_root
from storage.lease import RunLease
from storage.store import RunStore
from tasks.config_errors import ConfigError
from tasks.run_config import RunConfig, check_run_identity, load_config
from tasks.support.placement import placement_problems, visible_gpus

USAGE_EXIT = 2


class CommandError(Exception):
    """A mistake the command reports as `lines` (no traceback), exiting with `code`."""

    def __init__(self, lines: list[str] | str, code: int = 1):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        self.code = code
        super().__init__("; ".join(self.lines))


def run_guarded(prog: str, body: Callable[[], int]) -> int:
    """`body()`'s exit code, or a CommandError's lines on stderr and its code."""
    try:
        return body()
    except CommandError as exc:
        for line in exc.lines:
            print(f"{prog}: error: {line}", file=sys.stderr)
        return exc.code


def load_for_command(args: argparse.Namespace) -> RunConfig:
    """The config of `args` (CONFIG and --set); a mistake is a CommandError with exit code 2."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise CommandError(exc.problems, USAGE_EXIT) from None


def _first_existing(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _local_problem(folder: str) -> str | None:
    """Why runs cannot be written under the local `folder` (None when they can); creates it when missing."""
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        return f"{_first_existing(folder)} is a file, not a folder"
    except OSError as exc:
        return f"cannot create {folder} in {_first_existing(folder)}: {exc.strerror or exc}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".trajflow-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror or exc}"
    return None


def check_storage(root: str) -> None:
    """Raise a CommandError naming the cause when the storage root `root` cannot hold runs."""
    try:
        url = normalize_root(root)
    except StorageError as exc:
        raise CommandError(str(exc)) from None
    if "://" not in url or url.startswith("file://"):
        folder = url.removeprefix("file://")
        problem = _local_problem(folder)
        if problem:
            raise CommandError(f"storage {root!r} cannot hold runs: {problem}")
        return
    try:
        Location(url).root_exists()
    except StorageError as exc:
        raise CommandError(f"storage {root!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - an fsspec protocol that fails in its own way
        raise CommandError(f"storage {root!r} cannot be opened: {type(exc).__name__}: {exc}") from None


def check_run(config: RunConfig) -> None:
    """Raise a CommandError when the stored run was made with other settings that define it (exit code 2) or
    another live process holds it (exit code 1)."""
    from tasks.sft import check_sft_identity, load_demonstrations  # here: it imports torch, which `deploy` needs not

    try:
        store = RunStore(config.storage, config.project, config.run)
        check_run_identity(store.read_run_config(), config)
        if config.sft is not None:
            load_demonstrations(config)  # a bad line or a missing file is said now, in one line
        check_sft_identity(config, store)
        lease = RunLease(store, "trajflow train")
        holder = lease.blocker()
    except StorageError as exc:
        raise CommandError(str(exc)) from None
    except ValueError as exc:
        raise CommandError(str(exc), USAGE_EXIT) from None
    if holder is not None:
        raise CommandError(lease.held_message(holder))
    problems = placement_problems(config, visible_gpus(config))
    if problems:
        raise CommandError(problems, USAGE_EXIT)


def check_prefect_api() -> None:
    """Raise a CommandError when PREFECT_API_URL is set but no Prefect server answers there."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return  # Prefect starts a temporary server of its own
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        raise CommandError(f"PREFECT_API_URL is {url} but no Prefect server answers there ({error}); start one "
                           "(prefect server start) or unset PREFECT_API_URL to let the command start a temporary one")
