"""pytest's log capture walks `logging`'s table of loggers under `logging`'s own lock.

At the start of every setup, call and teardown phase pytest's logging plugin (9.1 and later) enters
``catching_logs``, whose ``__enter__`` runs ``for logger in root_logger.manager.loggerDict.values(): ...`` to attach
its handler to non-propagating loggers, without taking ``logging._lock``. Every write to that dict
(``logging.Manager.getLogger``: ``self.loggerDict[name] = rv`` and the placeholders of ``_fixupParents``) is made
under ``logging._lock``, and so is logging's own walk of it (``Manager._clear_cache``). A thread that creates a
logger meanwhile (an engine thread whose first ``torch.compile`` imports some 100 inductor modules, each running
``logging.getLogger(__name__)``, while pytest moves from a fixture's setup to the test's call) makes the walk raise
``RuntimeError: dictionary changed size during iteration`` inside ``__enter__``.

Choice: wrap ``catching_logs.__enter__`` in ``logging._lock`` (an RLock: the handler and level calls inside take it
again). A logger created meanwhile by another thread waits for the walk, a fraction of a millisecond per phase.
Waiting for background work in each fixture instead would leave every other thread of the suite (servers, tokenizer
pools, engines compiling on first use) free to race the same walk.
"""

from __future__ import annotations

import logging

from _pytest.logging import catching_logs

_unlocked_enter = catching_logs.__enter__


def _locked_enter(self):
    with logging._lock:
        return _unlocked_enter(self)


catching_logs.__enter__ = _locked_enter
