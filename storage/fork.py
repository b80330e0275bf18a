"""Forking a run: a new run that starts from one committed step of another, sharing nothing with it.

Rule: the new run's first committed step is the source's step N, copied whole: every file of the step (the adapter,
the trainer's optimizer, scheduler and RNG state, ``training.json`` with its probe record, the step's trajectories),
each read back against the source manifest's sha256 before it is written. Its ``run.json`` is the source's with the
new project, name and storage, plus ``forked_from`` {storage, project, run, step, the source manifest's time}; the
same record is in the new step's manifest ``extra``. The data cursor is the step number (scenarios and
``iterate_dataset`` batches derive from (seed, step)), so the fork trains next on what the source trained on after
step N.

Choices:

1. Copy, not reference: the fork owns its bytes, so the source's retention, a deletion or a later commit of the source
   can never change or remove what the fork runs on. A step's adapter and optimizer state are the only heavy part, so
   a fork costs one step's size.
2. The step to fork must still hold its adapter and trainer state (retention prunes both of old steps); asked for a
   step without them the error names the steps that have them. With ``not_after_step`` (ART's rule) the latest such
   step at or before it is taken.
3. The new run must be empty (no committed step), or fresh: only step 0 committed, its own untrained policy, which is
   what a registered ART model has before its first update. Steps before N are not copied; their history stays in the
   source, which ``forked_from`` names.
4. Write order: the step's files, then ``run.json``, then the manifest, last: a fork killed midway has committed
   nothing and can simply be run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage.errors import NotFoundError
from storage.layout import ADAPTER_DIR, TRAINER_STATE_DIR
from storage.manifest import StepManifest, now_iso
from storage.store import RunStore

RESUMABLE = (f"{ADAPTER_DIR}/", f"{TRAINER_STATE_DIR}/")


class ForkError(ValueError):
    """The fork cannot be made as asked (no such step, pruned, the new run not empty); the message says why."""


@dataclass(frozen=True)
class ForkResult:
    step: int
    run_url: str
    forked_from: dict[str, Any]


def _resumable(manifest: StepManifest) -> bool:
    return all(any(f.startswith(prefix) for f in manifest.files) for prefix in RESUMABLE)


def pick_step(source: RunStore, step: int | None = None, not_after_step: int | None = None) -> int:
    """`step` itself, or the latest resumable committed step (at or before `not_after_step`); ForkError if none."""
    manifests = source.manifests()
    if not manifests:
        raise ForkError(f"run {source.project}/{source.run} in {source.root} has no committed step to fork from")
    resumable = [s for s, m in manifests.items() if _resumable(m)]
    if step is not None:
        if step not in manifests:
            raise ForkError(f"step {step} of {source.project}/{source.run} is not committed; committed steps: "
                            f"{sorted(manifests)}")
        if step not in resumable:
            raise ForkError(f"step {step} of {source.project}/{source.run} no longer has its adapter and trainer "
                            f"state (pruned by retention); steps that have them: {resumable}")
        return step
    candidates = [s for s in resumable if not_after_step is None or s <= not_after_step]
    if not candidates:
        bound = "" if not_after_step is None else f" at or before step {not_after_step}"
        raise ForkError(f"run {source.project}/{source.run} has no step{bound} with its adapter and trainer state; "
                        f"steps that have them: {resumable}")
    return candidates[-1]


def check_destination(dest: RunStore, step: int) -> None:
    """Refuse a destination that has trained (anything committed beyond its own step 0)."""
    committed = dest.committed_steps()
    if not committed:
        return
    if committed == [0] and step > 0:
        return
    raise ForkError(f"run {dest.project}/{dest.run} already has committed steps {committed}: a fork needs a new run "
                    f"name (or a run registered but not yet trained, when forking a step after 0)")


def fork_run(source: RunStore, dest: RunStore, step: int | None = None, not_after_step: int | None = None) -> ForkResult:
    """Make `dest` start from a step of `source` (module docstring); the caller holds `dest`'s lease."""
    if (source.root, source.project, source.run) == (dest.root, dest.project, dest.run):
        raise ForkError(f"cannot fork run {source.project}/{source.run} into itself")
    chosen = pick_step(source, step, not_after_step)
    check_destination(dest, chosen)
    manifest = source.read_manifest(chosen)
    provenance = {"storage": source.root, "project": source.project, "run": source.run, "step": chosen,
                  "source_committed_at": manifest.created_at, "forked_at": now_iso()}
    for rel in source.list_files(chosen):
        try:
            data = source.get_bytes(chosen, rel, verify=True)
        except NotFoundError as exc:  # retention pruned the source meanwhile: nothing of the fork is committed
            raise ForkError(f"step {chosen} of {source.project}/{source.run} changed while being copied ({exc}); "
                            "fork again") from None
        dest.put_bytes(chosen, rel, data)
    record = {**(dest.read_run_config() or source.read_run_config() or {}),
              "project": dest.project, "run": dest.run, "storage": dest.root, "forked_from": provenance}
    dest.write_run_config(record)
    extra = {**manifest.extra, "policy": f"{dest.run}@{chosen}", "forked_from": provenance}
    dest.commit(chosen, manifest.metrics, extra=extra)
    return ForkResult(step=chosen, run_url=dest.url, forked_from=provenance)
