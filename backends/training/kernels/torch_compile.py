"""Small math kernels through torch.compile, with the eager function as the fallback.

``kernel(fn, compile)`` returns ``fn`` itself, or a process-wide compiled version (dynamic shapes, so one
compile serves every sequence length). If compiling or running a compiled kernel fails once (no Triton or C
compiler on the machine, say), every kernel runs eagerly from then on, with one warning: the formulas are
the same, only fused into fewer passes. Out-of-memory errors are not swallowed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

_COMPILED: dict[Callable, Callable] = {}
_FAILED: list[str] = []


def _guarded(fn: Callable) -> Callable:
    compiled = torch.compile(fn, dynamic=True)

    def run(*args):
        if not _FAILED:
            try:
                return compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - the same math runs eagerly; a real error re-raises there
                _FAILED.append(f"{type(exc).__name__}: {exc}"[:300])
                warnings.warn(f"torch.compile of {fn.__name__} failed, running every kernel eagerly: {_FAILED[0]}",
                              RuntimeWarning, stacklevel=2)
        return fn(*args)

    return run


def kernel(fn: Callable, compile: bool) -> Callable:
    """``fn``, or its compiled version (made once per process) when ``compile``."""
    if not compile:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = _guarded(fn)
    return _COMPILED[fn]


def failure() -> str | None:
    """Why compiled kernels were abandoned in this process, or None."""
    return _FAILED[0] if _FAILED else None


def reset() -> None:
    """Forget compiled kernels and failures (tests)."""
    _COMPILED.clear()
    _FAILED.clear()
