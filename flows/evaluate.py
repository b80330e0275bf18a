"""The evaluation flow: `trajflow eval CONFIG --policy NAME ...` compares policies on the validation split.

A policy is ``base`` (the base model), ``<run>@<step>`` (an adapter of this run, loaded from storage),
``@<step>`` (shorthand for this run), or ``url=<base_url>,model=<name>`` (any OpenAI-compatible model).
Results: a table and a bar chart as Prefect artifacts, and ``evaluations/<timestamp>.json`` + ``.png`` in the run's storage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

from prefect import flow

from backends.policy.publish import ensure_loaded
from flows.arguments import eval_parser
from flows.command import run_flow_command
from flows.console import announce_flow_run
from flows.preflight import USAGE_EXIT, CommandError
from storage.layout import evaluation_dir, evaluation_file, scored_file
from tasks.rollouts import run_groups
from tasks.run_config import RunConfig
from tasks.scenarios import val_scenarios
from tasks.scoring import score_groups_fn
from tasks.support.progress import flush_progress
from tasks.support.reporting import chart_png, png_markdown
from tasks.support.runtime import close_runtime, get_runtime

log = logging.getLogger("trajflow")


def parse_policy(spec: str, config: RunConfig) -> dict[str, Any]:
    """Turn a --policy argument into {label, kind, model, step?, url?}."""
    if spec == "base":
        return {"label": "base", "kind": "base"}
    if spec.startswith("url="):
        parts = dict(p.split("=", 1) for p in spec.split(",") if "=" in p)
        if "model" not in parts:
            raise ValueError(f"--policy {spec!r}: a url policy needs model=<name>")
        return {"label": parts["model"], "kind": "url", "url": parts["url"], "model": parts["model"]}
    name, sep, step = spec.rpartition("@")
    if not sep or not step.isdigit():
        raise ValueError(f"--policy {spec!r}: expected base, <run>@<step>, @<step> or url=...,model=...")
    if name and name != config.run:
        raise ValueError(f"--policy {spec!r}: only adapters of run {config.run!r} can be loaded by this config")
    return {"label": config.policy(int(step)), "kind": "adapter", "step": int(step)}


def _bar_chart(results: list[dict[str, Any]]) -> bytes:
    """Mean validation reward per policy, one bar each, as a PNG."""

    def draw(ax) -> None:
        ax.bar([r["policy"] for r in results], [r["val/reward"] for r in results], color="#4a7fb5")
        ax.set_ylabel("mean validation reward")
        ax.set_title("evaluation")
        for label in ax.get_xticklabels():
            label.set(rotation=20, ha="right")

    return chart_png(draw, figsize=(max(4, 1.2 * len(results)), 3.5))


async def _evaluate_one(config: RunConfig, policy: dict[str, Any], stamp: str) -> dict[str, Any]:
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    model = policy.get("model")
    if policy["kind"] == "base":
        served = await rt.inference_client().models()
        model = next(m for m in served if "@" not in m)
    elif policy["kind"] == "adapter":
        for inference in rt.inference_clients():  # the rollouts may go to any replica
            model, _ = await ensure_loaded(rt.store, inference, config.project, config.run, policy["step"])
    scenarios = val_scenarios(config)
    area = evaluation_dir(stamp, policy["label"])
    rollouts = await run_groups(config, 0, scenarios, model, area, 1, f"eval {policy['label']}", storage_step=None)
    scored = await asyncio.to_thread(score_groups_fn, config, None, scenarios, rollouts,
                                     out=scored_file(area), prefix="val", use_judge=False)
    return {"policy": policy["label"], **scored["metrics"]}


@flow(name="evaluate", log_prints=True)
def evaluate(config: RunConfig, policies: list[str]) -> list[dict[str, Any]]:
    """Evaluate each policy on the first `eval_scenarios` validation scenarios; returns one row per policy."""
    parsed = [parse_policy(p, config) for p in policies]
    announce_flow_run()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    results = []
    try:
        for policy in parsed:
            if policy["kind"] == "url":
                cfg = config.model_copy(update={"inference": config.inference.model_copy(
                    update={"backend": "url", "url": policy["url"]})})
                results.append(asyncio.run(_evaluate_one(cfg, policy, stamp)))
                close_runtime(cfg)
            else:
                results.append(asyncio.run(_evaluate_one(config, policy, stamp)))
            log.info("%s: val/reward=%.4f", results[-1]["policy"], results[-1]["val/reward"])
        store = get_runtime(config).store  # this process's resources for the run (tasks/support/runtime.py)
        store.put_json(None, evaluation_file(stamp, "json"), results)
        png = _bar_chart(results)
        store.put_bytes(None, evaluation_file(stamp, "png"), png)
        try:
            from prefect.artifacts import create_markdown_artifact, create_table_artifact

            create_table_artifact([{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
                                   for r in results], description="validation reward per policy")
            create_markdown_artifact(png_markdown("evaluation", png), description="validation reward per policy")
        except Exception:  # noqa: BLE001 - artifacts are a view only
            pass
        return results
    finally:
        flush_progress()  # the progress artifacts still queued reach the API before the flow run ends
        close_runtime(config)


def run_command(args: argparse.Namespace) -> int:
    """`trajflow eval` and `python -m flows.evaluate`: evaluate each --policy (default: base), print the rows."""
    policies = args.policies or ["base"]

    def check(config: RunConfig) -> None:
        for spec in policies:
            try:
                parse_policy(spec, config)
            except ValueError as exc:
                raise CommandError(str(exc), USAGE_EXIT) from None

    def body(config: RunConfig, log_file) -> str:
        return json.dumps(evaluate(config, policies), default=str, indent=2)

    return run_flow_command("trajflow eval", args, body, check)


if __name__ == "__main__":
    sys.exit(run_command(eval_parser().parse_args()))
