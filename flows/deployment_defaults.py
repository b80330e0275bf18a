"""A partial config given to a deployment run fills in from the deployment's own config.

Prefect merges a run's parameters over its deployment's one level deep: ``prefect deployment run train/nightly
-p config='{"steps": 60}'`` replaces the whole ``config`` parameter, so the nightly run would lose its run name,
its evaluation schedule and its GPU placement, silently falling back to RunConfig's defaults. The rule here: the
fields the caller set (pydantic's ``model_fields_set``, section by section) go over the deployment's ``config``;
everything else comes from the deployment. A full config (the UI form sends one) is unchanged by it, and a flow
called directly (no deployment) is left alone.
"""

from __future__ import annotations

import copy
from typing import Any

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from pydantic import BaseModel

from tasks.run_config import RunConfig


def overlay(base: dict[str, Any], given: BaseModel) -> dict[str, Any]:
    """`base` (a config dict) with the fields set in `given` written over it, nested sections merged field by field."""
    merged = copy.deepcopy(base)
    dumped = given.model_dump(mode="json")
    for name in given.model_fields_set:
        value = getattr(given, name)
        if isinstance(value, BaseModel) and isinstance(merged.get(name), dict):
            merged[name] = overlay(merged[name], value)
        else:
            merged[name] = dumped[name]
    return merged


def with_deployment_defaults(config: RunConfig) -> RunConfig:
    """`config` over its deployment's ``config`` parameter when this flow run comes from a deployment, else itself."""
    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context is not None and context.flow_run else None
    if deployment_id is None:
        return config
    with get_client(sync_client=True) as client:
        defaults = (client.read_deployment(deployment_id).parameters or {}).get("config")
    if not isinstance(defaults, dict):
        return config
    return RunConfig.model_validate(overlay(defaults, config))
