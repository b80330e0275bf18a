"""The run lease (storage/lease.py) on a local folder and on S3 (moto): one writer per run, taken over once its
holder stopped renewing or died on this host."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from storage.layout import RUN_LEASE
from storage.lease import TTL_ENV, RunLease, RunLeaseHeldError, RunLeaseLostError, lease_ttl
from storage.names import InvalidNameError
from storage.store import RunStore


def _foreign(raw_storage, **fields) -> dict:
    """Write a lease record of another process directly into storage; returns it."""
    now = time.time()
    record = {"owner": "elsewhere:1:abc", "host": "elsewhere", "pid": 1, "purpose": "trajflow train",
              "acquired_at": now - 60, "renewed_at": now - 10, "expires_at": now + 250, **fields}
    raw_storage.write(f"proj/run-1/{RUN_LEASE}", json.dumps(record).encode())
    return record


@pytest.fixture
def store(store_root):
    return RunStore(store_root, "proj", "run-1")


def test_one_holder_at_a_time_and_the_refusal_names_it(store):
    first = RunLease(store, "trajflow train", ttl_s=60).acquire()
    try:
        second = RunLease(store, "LocalBackend", ttl_s=60)
        with pytest.raises(RunLeaseHeldError) as err:
            second.acquire()
        text = str(err.value)
        assert "proj/run-1" in text and "trajflow train" in text and f"host {socket.gethostname()}" in text
        assert "expires" in text and "UTC" in text and TTL_ENV in text
        assert second.blocker() is not None and first.blocker() is None
    finally:
        first.release()
    assert store.list_files(None) == [] and first.holder() is None  # released: deleted
    with RunLease(store, "LocalBackend", ttl_s=60) as again:
        assert again.holder().purpose == "LocalBackend"


def test_an_expired_lease_is_taken_over_a_live_one_is_not(store, raw_storage, caplog):
    _foreign(raw_storage)
    with pytest.raises(RunLeaseHeldError, match="host elsewhere"):
        RunLease(store, "trajflow train", ttl_s=60).acquire()
    _foreign(raw_storage, expires_at=time.time() - 1)  # its holder stopped renewing: preempted
    lease = RunLease(store, "trajflow train", ttl_s=60).acquire()
    try:
        assert lease.holder().owner == lease.owner
        assert "taking over the lease" in caplog.text and "expired" in caplog.text
    finally:
        lease.release()


def test_a_dead_holder_on_this_host_is_taken_over_before_its_expiry(store, raw_storage):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    _foreign(raw_storage, host=socket.gethostname(), pid=int(proc.stdout))  # killed and gone
    with RunLease(store, "trajflow train", ttl_s=60) as lease:
        assert lease.holder().owner == lease.owner


def test_a_torn_lease_file_locks_nobody_out(store, raw_storage):
    raw_storage.write(f"proj/run-1/{RUN_LEASE}", b'{"owner": "x", "ho')
    with RunLease(store, "trajflow train", ttl_s=60) as lease:
        assert lease.holder().owner == lease.owner


def test_renewal_keeps_it_alive(store):
    lease = RunLease(store, "trajflow train", ttl_s=0.4).acquire()
    try:
        first_expiry = lease.holder().expires_at
        time.sleep(1.0)  # > ttl: without renewal it would have expired
        assert lease.holder().expires_at > first_expiry
        with pytest.raises(RunLeaseHeldError):
            RunLease(store, "other", ttl_s=0.4).acquire()
        lease.check()
    finally:
        lease.release()


def test_a_takeover_is_noticed_before_the_next_commit(store, raw_storage):
    lease = RunLease(store, "trajflow train", ttl_s=60).acquire()
    try:
        lease.check(fresh=True)
        _foreign(raw_storage)  # another process took it (as if this one had stalled past the TTL)
        with pytest.raises(RunLeaseLostError, match="lost its lease"):
            lease.check(fresh=True)
        with pytest.raises(RunLeaseLostError):
            lease.check()  # stays lost
    finally:
        lease.release()
    assert lease.holder().owner == "elsewhere:1:abc"  # release deletes only its own lease


def test_the_renewing_thread_notices_a_takeover(store, raw_storage):
    lease = RunLease(store, "trajflow train", ttl_s=0.4).acquire()
    try:
        deadline = time.monotonic() + 10
        while True:  # a renewal in flight may overwrite the foreign record once (module docstring, item 1): again
            _foreign(raw_storage)
            time.sleep(0.5)
            try:
                lease.check()
            except RunLeaseLostError:
                break
            assert time.monotonic() < deadline, "the renewing thread never noticed the other owner"
    finally:
        lease.release()


def test_of_processes_starting_at_once_exactly_one_gets_the_lease(store):
    leases = [RunLease(store, f"p{i}", ttl_s=60) for i in range(6)]
    won, refused = [], []
    barrier = threading.Barrier(len(leases))

    def take(lease):
        barrier.wait()
        try:
            won.append(lease.acquire())
        except RunLeaseHeldError:
            refused.append(lease)

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(won) == 1 and len(refused) == 5
    finally:
        for lease in won:
            lease.release()


def test_the_lease_file_is_the_stores_own(store):
    with pytest.raises(InvalidNameError, match="managed by the store"):
        store.put_bytes(None, RUN_LEASE, b"{}")
    with RunLease(store, "trajflow train", ttl_s=60):
        store.put_bytes(None, "notes.txt", b"x")
        assert store.list_files(None) == ["notes.txt"]


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_bad_ttl_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(TTL_ENV, value)
    with pytest.raises(ValueError, match=TTL_ENV):
        lease_ttl()
