"""pytest's log capture against loggers created by another thread (`tests.log_capture_lock`).

An engine thread compiling its decode step imports inductor modules, each creating its logger, while pytest enters
the next phase of a test: without the lock, pytest's walk of the loggers raised ``RuntimeError: dictionary changed
size during iteration`` (test_lora_slots' compiled variant, once in CI).
"""

from __future__ import annotations

import logging
import sys
import threading

from _pytest.logging import catching_logs

GROUP = "tests.log_capture_lock"  # the parent of the loggers this test creates


def test_loggers_created_by_another_thread_never_break_pytests_log_capture():
    handler = logging.NullHandler()
    created: list[str] = []
    stop = threading.Event()

    def create_loggers():
        while not stop.is_set() and len(created) < 5_000:
            created.append(f"{GROUP}.thread{len(created)}")
            logging.getLogger(created[-1])

    interval = sys.getswitchinterval()
    # a thread switch every microsecond: the walk of the loggers is cut by the other thread many times per entry
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=create_loggers)
    thread.start()
    try:
        walks = 0
        while walks < 300 or len(created) < 1_000:  # walks with the other thread creating loggers beside them
            with catching_logs(handler):
                walks += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        with logging._lock:  # these loggers would lengthen every later phase's walk
            table = logging.root.manager.loggerDict
            for name in [n for n in table if n.startswith(GROUP)]:
                del table[name]
