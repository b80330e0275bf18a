"""The recovery records of a run: ``recoveries/<flow run id>.json``, one per crashed flow run of a deployment.

A record says what the `recover` flow (flows/recover.py) decided for one crash: run the deployment again (when,
as which flow run) or stop. They live with the run, so the retry budget survives a new Prefect server, a new
machine and a redeploy, and `trajflow runs` users can read a run's crash history next to its steps.

Choices: one file per crashed flow run, named by its id, so looking at a crash twice (a duplicate event, a retried
`recover` run) finds the earlier decision instead of spending the budget again; the order of the records is
their ``crashed_at`` time, not their names.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from storage.errors import NotFoundError
from storage.layout import RECOVERIES_DIR, recovery_file
from storage.store import RunStore

log = logging.getLogger("trajflow.storage")


class RecoveryRecord(BaseModel):
    """What was done about one crashed flow run. Times are Unix seconds."""

    flow_run_id: str = Field(description="the crashed flow run")
    flow_run_name: str = ""
    deployment: str = Field(description="its deployment, <flow>/<deployment>")
    crashed_at: float = Field(description="when its Crashed state was set")
    message: str = Field("", description="the Crashed state's message (why Prefect says it crashed)")
    committed_step: int | None = Field(description="the run's last committed step when the crash was handled")
    attempt: int = Field(description="crashes in a row without a new committed step, this one included")
    decision: Literal["rerun", "stopped"]
    reason: str = ""
    delay_s: float = 0.0
    new_flow_run_id: str | None = None
    new_flow_run_name: str | None = None
    scheduled_for: float | None = None


def read_recovery(store: RunStore, flow_run_id: str) -> RecoveryRecord | None:
    """The record of `flow_run_id`, or None when that crash was not handled yet."""
    try:
        return RecoveryRecord.model_validate(store.get_json(None, recovery_file(flow_run_id)))
    except NotFoundError:
        return None


def write_recovery(store: RunStore, record: RecoveryRecord) -> None:
    store.put_json(None, recovery_file(record.flow_run_id), record.model_dump(mode="json"))


def recovery_history(store: RunStore) -> list[RecoveryRecord]:
    """Every readable record of the run, oldest crash first (an unreadable one is skipped with a warning)."""
    records = []
    for rel in store.list_files(None, RECOVERIES_DIR + "/"):
        try:
            records.append(RecoveryRecord.model_validate(store.get_json(None, rel)))
        except (ValidationError, ValueError) as exc:
            log.warning("skipping the unreadable recovery record %s: %s", rel, str(exc).splitlines()[0])
    return sorted(records, key=lambda r: r.crashed_at)
