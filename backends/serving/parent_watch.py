"""A server a run started ends when that run's process is gone (``trajflow serve --parent-pid PID``).

The flow starts its embedded server as a child in a session of its own (``managed_process.py``), so a SIGKILL of the
flow would leave the server running, holding its GPU memory, while the resumed flow starts another. Rule: the parent
gives its pid; once ``os.getppid()`` differs from it, the parent is gone (the child was re-parented to init or a
subreaper; also when that happened before the watch began) and it stops: before the server listens, exit at once (`ORPHANED_EXIT`); after, the server's
graceful shutdown, with an exit after `grace_s` should it hang. Polled every `poll_s`, in a daemon thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

ORPHANED_EXIT = 75  # EX_TEMPFAIL, as the training ranks' (tasks/support/distributed_training.py)


class ParentWatch:
    """Watches the parent from construction on; `stop_with` names the graceful stop once the server runs."""

    def __init__(self, parent: int, poll_s: float = 0.5, grace_s: float = 30):
        self.parent = parent
        self.poll_s, self.grace_s = poll_s, grace_s
        self._graceful: Callable[[], None] | None = None
        threading.Thread(target=self._watch, name="trajflow-parent-watch", daemon=True).start()

    def stop_with(self, graceful: Callable[[], None]) -> None:
        self._graceful = graceful

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(self.poll_s)
        print(f"trajflow serve: the process that started it (pid {self.parent}) is gone: stopping", file=sys.stderr,
              flush=True)
        if self._graceful is not None:
            self._graceful()
            time.sleep(self.grace_s)
        os._exit(ORPHANED_EXIT)
