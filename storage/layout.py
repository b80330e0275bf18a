"""The run layout, in one place.

```
<root>/<project>/<run>/run.json                    the run's config
<root>/<project>/<run>/steps/<NNNNN>/...           the step's files (trajectories, adapter/, trainer/, ...)
<root>/<project>/<run>/steps/<NNNNN>/manifest.json written last; without it the step does not exist
<root>/<project>/<run>/<relpath>                   run-level files (e.g. judge-cache/<hash>.json)
```
Step numbers have five digits (00000-99999).
"""

from __future__ import annotations

from storage.names import InvalidNameError, safe_relpath

RUN_CONFIG = "run.json"
STEPS_DIR = "steps"
MANIFEST = "manifest.json"
MAX_STEP = 99_999


def check_step(step: int) -> int:
    """A step number: an int in [0, 99999]."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return step


def step_dir(step: int) -> str:
    """``steps/00007``, relative to the run."""
    return f"{STEPS_DIR}/{check_step(step):05d}"


def parse_step_dir(name: str) -> int | None:
    """The step number of a folder name under ``steps/`` (``"00007"`` -> 7), None for anything else."""
    return int(name) if len(name) == 5 and name.isdigit() else None


def file_rel(step: int | None, relpath: str) -> str:
    """Path relative to the run of a user file; refuses the names the store itself manages."""
    safe_relpath(relpath)
    if step is None:
        if relpath == RUN_CONFIG or relpath == STEPS_DIR or relpath.startswith(STEPS_DIR + "/"):
            raise InvalidNameError(
                f"invalid run-level path {relpath!r}: {RUN_CONFIG!r} and {STEPS_DIR + '/'!r} are managed by the store"
            )
        return relpath
    if relpath == MANIFEST:
        raise InvalidNameError(f"invalid step path {relpath!r}: {MANIFEST!r} is written only by commit()")
    return f"{step_dir(step)}/{relpath}"


def manifest_rel(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"
