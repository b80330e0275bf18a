"""The line a script prints when it registers a run: where the run lives and which step it is at.

A re-run of a finished ART loop (``for step in range(await model.get_step(), N)``) trains nothing; this line
says why, instead of the script ending silently.
"""

from __future__ import annotations

import sys


def registered_line(label: str, url: str, step: int) -> str:
    if step == 0:
        return f"{label}: at step 0 (the untrained policy) in {url}"
    return (f"{label}: already at step {step} in {url}; the next update trains step {step + 1} "
            f"(a loop `range(await model.get_step(), N)` has nothing to do unless N > {step})")


def print_registered(label: str, url: str, step: int) -> None:
    print(registered_line(label, url, step), file=sys.stderr, flush=True)
