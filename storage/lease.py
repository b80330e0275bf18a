"""One writer per run: a lease in the run's storage (``lease.json``) naming the process that writes the run, and until when.

Rule: a process that trains a run (the training flow, a LocalBackend) holds the run's lease from start to end and
renews it every ``ttl / 4`` seconds from a background thread; a lease not renewed for ``ttl`` seconds has expired.
Another process may take the lease only when

1. there is none: it is created exclusively (a hard link locally, ``If-None-Match: *`` on S3), so of two processes
   starting at once one wins;
2. it expired: its holder was preempted or killed and stopped renewing;
3. its holder is a process of this host that no longer runs: a run killed and restarted on the same machine does
   not wait for the expiry.

Otherwise :class:`RunLeaseHeldError` names the holder and when its lease expires. The TTL is ``TRAJFLOW_LEASE_TTL_S``
(default 300 s): long against storage hiccups and clock skew, short enough that a preempted run restarts elsewhere
within minutes.

Simplifications:

1. Taking over an expired lease overwrites it and reads it back (fsspec has no compare-and-swap for a replace): of
   two takers in the same instant both may read their own record. The loser sees the other's record at its next
   renewal, and :meth:`RunLease.check`, called before each stage and each commit, stops it.
2. Expiry compares the holder's wall clock with the reader's: their skew must stay well below the TTL.
3. A renewal that fails on a storage error is retried at the next interval; the lease is lost only when another
   owner's record is found.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Self

from pydantic import BaseModel, Field, ValidationError

from storage.errors import AlreadyExistsError, NotFoundError, StorageError
from storage.fs import Location
from storage.layout import RUN_LEASE

log = logging.getLogger("trajflow.storage")

TTL_ENV = "TRAJFLOW_LEASE_TTL_S"
DEFAULT_TTL_S = 300.0


class RunLeaseHeldError(StorageError):
    """Another live process holds the run's lease; the message names it and when its lease expires."""


class RunLeaseLostError(StorageError):
    """This process's lease was taken over (it stopped renewing for longer than the TTL): it must stop writing."""


def lease_ttl() -> float:
    """The lease TTL in seconds: ``TRAJFLOW_LEASE_TTL_S``, else DEFAULT_TTL_S."""
    raw = os.environ.get(TTL_ENV, "").strip()
    if not raw:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = float("nan")
    if not ttl > 0 or ttl == float("inf"):
        raise ValueError(f"{TTL_ENV}={raw!r}: expected a number of seconds > 0")
    return ttl


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def process_gone(pid: int) -> bool:
    """True when no process `pid` exists on this host (one owned by another user still exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class LeaseRecord(BaseModel):
    """The content of ``lease.json``. Times are Unix seconds."""

    owner: str = Field(description="unique id of the holding lease object: host:pid:random")
    host: str = Field(description="host name of the holder")
    pid: int = Field(description="process id of the holder on its host")
    purpose: str = Field(description="what holds the run, e.g. 'trajflow train'")
    acquired_at: float
    renewed_at: float
    expires_at: float

    def describe(self, now: float) -> str:
        """``trajflow train (pid 12, host gpu-1), lease renewed 3 s ago, expires 2025-01-01 10:00:00 UTC (in 297 s)``."""
        left = self.expires_at - now
        expiry = f"in {left:.0f} s" if left >= 0 else f"{-left:.0f} s ago"
        return (f"{self.purpose} (pid {self.pid}, host {self.host}), lease renewed {max(now - self.renewed_at, 0):.0f} s "
                f"ago, expires {_utc(self.expires_at)} ({expiry})")

    def takeover_reason(self, now: float) -> str | None:
        """Why another process may take this lease (expired, or its holder on this host is gone); None if it may not."""
        if self.expires_at <= now:
            return f"it expired at {_utc(self.expires_at)}"
        if self.host == socket.gethostname() and process_gone(self.pid):
            return f"its holder, pid {self.pid} on this host, no longer runs"
        return None


class RunLease:
    """The lease of one run for this process. ``acquire()`` (or ``with``) takes it and starts renewing; ``release()``."""

    def __init__(self, store, purpose: str, ttl_s: float | None = None):
        self.label = f"{store.project}/{store.run}"
        self.url = store.url
        self.purpose = purpose
        self.ttl_s = float(ttl_s) if ttl_s is not None else lease_ttl()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._loc = Location(store.url, store.storage_options)
        self._acquired_at: float | None = None
        self._lost: RunLeaseLostError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io = threading.Lock()  # renewals (thread) and checks (caller) must not interleave their read-then-write

    # ---- reading -------------------------------------------------------------------------------
    def _read(self) -> tuple[bool, LeaseRecord | None]:
        """(whether ``lease.json`` exists, its record or None when unreadable: a torn record locks nobody out)."""
        try:
            data = self._loc.read_bytes(RUN_LEASE, small=True)
        except NotFoundError:
            return False, None
        try:
            return True, LeaseRecord.model_validate(json.loads(data))
        except (ValueError, ValidationError) as exc:
            log.warning("ignoring the unreadable lease %s: %s", self._loc.url_of(RUN_LEASE), str(exc).splitlines()[0])
            return True, None

    def holder(self) -> LeaseRecord | None:
        """The stored lease, or None when there is none or it is unreadable."""
        return self._read()[1]

    def blocker(self, now: float | None = None) -> LeaseRecord | None:
        """The lease that keeps this process from taking the run (held by another live owner), else None."""
        current = self.holder()
        now = time.time() if now is None else now
        if current is None or current.owner == self.owner or current.takeover_reason(now):
            return None
        return current

    def held_message(self, record: LeaseRecord, now: float | None = None) -> str:
        now = time.time() if now is None else now
        return (f"run {self.label} ({self.url}) is in use by {record.describe(now)}; one process writes a run at a "
                f"time. Stop that process, or wait until its lease expires if it was preempted "
                f"({TTL_ENV} sets the lease's length)")

    # ---- taking, renewing, releasing -------------------------------------------------------------
    def _record(self, now: float) -> LeaseRecord:
        return LeaseRecord(owner=self.owner, host=socket.gethostname(), pid=os.getpid(), purpose=self.purpose,
                           acquired_at=self._acquired_at or now, renewed_at=now, expires_at=now + self.ttl_s)

    def _write(self, now: float, exclusive: bool = False) -> None:
        self._loc.write_bytes(RUN_LEASE, self._record(now).model_dump_json().encode(), exclusive=exclusive)

    def acquire(self) -> RunLease:
        """Take the lease (rules in the module docstring) and start renewing it; RunLeaseHeldError if held."""
        with self._io:
            for _ in range(3):
                now = time.time()
                exists, current = self._read()
                if not exists:
                    try:
                        self._write(now, exclusive=True)
                    except AlreadyExistsError:
                        continue  # another process created it first: look at its record
                else:
                    if current is not None and current.owner != self.owner:
                        reason = current.takeover_reason(now)
                        if reason is None:
                            raise RunLeaseHeldError(self.held_message(current, now))
                        log.warning("run %s: taking over the lease of %s: %s", self.label, current.describe(now),
                                    reason)
                    self._write(now)
                # read back after a create too: a store whose conditional PUT is not atomic with its existence
                # check (moto's threaded server is one) can let two creates succeed; the record that stayed wins
                stored = self.holder()
                if stored is not None and stored.owner != self.owner:
                    raise RunLeaseHeldError(self.held_message(stored))
                break
            else:
                raise RunLeaseHeldError(f"run {self.label} ({self.url}): the lease changed hands three times while "
                                        "this process tried to take it; another process is starting on this run")
            self._acquired_at = self._acquired_at or now
        self._lost = None
        self._start_renewing()
        return self

    def renew(self) -> None:
        """Extend the lease by the TTL; RunLeaseLostError if another owner holds it now."""
        with self._io:
            current = self.holder()
            if current is not None and current.owner != self.owner:
                self._lost = RunLeaseLostError(
                    f"run {self.label}: this process ({self.purpose}) lost its lease to {current.describe(time.time())}; "
                    "it stopped renewing for longer than the lease's length, so it stops writing")
                raise self._lost
            self._write(time.time())

    def check(self, fresh: bool = False) -> None:
        """Raise RunLeaseLostError if the lease was lost. ``fresh``: renew now (before a commit) instead of trusting
        the last renewal."""
        if self._lost is not None:
            raise self._lost
        if fresh:
            self.renew()

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this process's. Never raises (called in `finally`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        try:
            with self._io:
                current = self.holder()
                if current is not None and current.owner == self.owner:
                    self._loc.delete([RUN_LEASE])
        except Exception as exc:  # noqa: BLE001 - also at interpreter exit, where storage clients may be gone
            log.warning("run %s: could not release its lease (it expires by itself): %s", self.label, exc)

    def _start_renewing(self) -> None:
        if self._thread is not None:
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease {self.label}", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        interval = max(self.ttl_s / 4, 0.05)
        while not self._stop.wait(interval):
            try:
                self.renew()
            except RunLeaseLostError as exc:
                log.error("%s", exc)
                return
            except StorageError as exc:
                log.warning("run %s: lease renewal failed (retried in %.0f s): %s", self.label, interval, exc)

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
