"""What the ART backends refuse, by kind, so `trajflow backend serve` answers each with its status.

- ``ValueError`` (bad settings, names, groups): 400.
- :class:`NotRegisteredError`: 404.
- :class:`RunBusyError`, and a run whose lease another process holds (``storage.lease.RunLeaseHeldError``): 409.
"""

from __future__ import annotations


class NotRegisteredError(LookupError):
    """The model was not registered with this backend (or its registration failed)."""


class RunBusyError(RuntimeError):
    """Another request is writing this run (registering, training, logging, pruning): one at a time per run."""
