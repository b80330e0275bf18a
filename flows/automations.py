"""The automations `trajflow deploy` keeps on the Prefect server, as code, and how they are written there.

1. ``trajflow: crash runs whose heartbeats stopped`` (Prefect's "detect zombie flows" recipe for self-hosted
   servers): a flow run tagged ``trajflow`` (every run of our deployments) that sent a heartbeat and then, within
   ``silent_after_s``, neither another heartbeat nor a final state is set ``Crashed``. Other flows on the same
   server are not touched: their heartbeat interval is not ours to know. A run whose machine vanished (a spot instance reclaimed with no notice, a
   lost node) stays ``Running`` forever otherwise; once ``Crashed``, the `recover` deployment's trigger
   (prefect.yaml) runs it again.
2. The `recover` trigger itself is declared in prefect.yaml next to its deployment (Prefect creates it at
   `prefect deploy`); it is not repeated here.

Rule for ``silent_after_s``: three heartbeat intervals (three missed beats), the interval being the largest
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` the deployments set (Prefect's default, 180 s, for one that sets none).
Shorter than one interval would crash live runs.

Choice: an automation is found by its name and replaced in place (same id), so running the command again changes
nothing and a changed setting is applied; automations of other names are never touched.
"""

from __future__ import annotations

from datetime import timedelta

ZOMBIE_AUTOMATION = "trajflow: crash runs whose heartbeats stopped"
RUN_TAG = "trajflow"  # every deployment in prefect.yaml has it; its flow runs inherit it
MISSED_HEARTBEATS = 3
_FINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                 "prefect.flow-run.Crashed")


def zombie_automation(silent_after_s: float):
    """The automation that marks a flow run ``Crashed`` when its heartbeats stop for `silent_after_s` seconds."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=ZOMBIE_AUTOMATION,
        description=(f"A flow run silent for {silent_after_s:g} s after a heartbeat (its machine is gone) is marked "
                     "Crashed; training runs are then run again by the `recover` deployment. Set by trajflow deploy."),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *_FINAL_EVENTS},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag",
                                                 "prefect.resource.id": f"prefect.tag.{RUN_TAG}"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silent_after_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {silent_after_s:g} s: its machine is gone "
                                            "(marked by trajflow deploy's automation)")],
    )


def upsert_automation(automation) -> str:
    """Create `automation`, or replace the one of the same name; returns "created", "updated" or "unchanged"."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    # owner_resource is read-only on the server: an update carrying it (even as null) is refused with a 422
    wanted = AutomationCore(**automation.model_dump(exclude={"id", "owner_resource"}))
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(name=automation.name)
        if not existing:
            client.create_automation(automation=wanted)
            return "created"
        first, *extra = existing
        for duplicate in extra:  # two commands raced: keep one
            client.delete_automation(duplicate.id)
        current = AutomationCore(**first.model_dump(exclude={"id", "owner_resource"}))
        # python mode keeps the trigger's sets (expect, after, for_each) as sets: JSON mode lists them in hash order,
        # which differs between processes, so an unchanged automation could compare unequal
        if current.model_dump() == wanted.model_dump():
            return "unchanged"
        client.update_automation(automation_id=first.id, automation=wanted)
        return "updated"
