"""How `trajflow train` ends: a short summary of where the run is and what to run next, or one JSON object.

The summary names the run's folder, the train reward of the last step and the validation reward of the first and
last evaluated steps, the reward curve, the run's log file, the flow run's Prefect UI page when there is a UI, and
the next commands, built from the user's own CONFIG and --set arguments (so they address the same run):
evaluate the last step against the base model, serve its adapter (start the server, then load the adapter into
it: the adapter's model name is ``<run>@<step>``), train further. A run that was already at its
last step says so in one line. ``--json`` prints the machine-readable form instead (`json_result`).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from storage.layout import ADAPTER_DIR, REWARD_CURVE
from storage.store import RunStore
from tasks.run_config import RunConfig
from tasks.support.reporting import step_history


def _base_arguments(args: argparse.Namespace) -> list[str]:
    """CONFIG and the --set arguments of this command, `steps` left out: what addresses the same run."""
    out = [args.config] if args.config else []
    for override in args.overrides:
        if override.split("=", 1)[0].strip() != "steps":
            out += ["--set", override]
    return out


def next_commands(config: RunConfig, args: argparse.Namespace, store: RunStore, step: int) -> dict[str, str]:
    """{what: shell command} for evaluating step `step`, serving its adapter and training the run further."""
    base = _base_arguments(args)
    load = json.dumps({"lora_name": config.policy(step), "lora_path": f"{store.step_url(step)}/{ADAPTER_DIR}"})
    return {
        "evaluate": shlex.join(["trajflow", "eval", *base, "--policy", "base", "--policy", f"@{step}"]),
        # the run's folder as an adapter root: the server loads adapters only from its roots
        "serve it": shlex.join(["trajflow", "serve", "--model", config.base_model, "--port", "8000",
                                "--adapter-root", store.url]),
        "then load it": shlex.join(["curl", "-s", "http://127.0.0.1:8000/v1/load_lora_adapter", "-H",
                                    "Content-Type: application/json", "-d", load]),
        "train further": shlex.join(["trajflow", "train", *base, "--set", f"steps={step + max(config.steps, 1)}"]),
    }


def _reward_text(history: list[dict[str, Any]]) -> str:
    parts = []
    trained = [r for r in history if "train/reward" in r]
    if trained:
        parts.append(f"train {trained[-1]['train/reward']:.3f} at step {trained[-1]['step']}")
    evaluated = [r for r in history if "val/reward" in r]
    if len(evaluated) > 1:
        first, last = evaluated[0], evaluated[-1]
        parts.append(f"validation {first['val/reward']:.3f} (step {first['step']}) -> {last['val/reward']:.3f} "
                     f"(step {last['step']})")
    elif evaluated:
        parts.append(f"validation {evaluated[0]['val/reward']:.3f} at step {evaluated[0]['step']}")
    return "; ".join(parts) or "none yet (step 0 is the untrained policy)"


def train_summary(config: RunConfig, args: argparse.Namespace, result: dict[str, Any], log_file: Path | None) -> str:
    """The lines `trajflow train` ends with (see the module docstring)."""
    store = RunStore(config.storage, config.project, config.run)
    step = result["step"]
    commands = next_commands(config, args, store, step)
    name = f"{config.project}/{config.run}"
    if result.get("resumed_from") == step:
        return (f"{name}: already at step {step}; nothing to do; to train further: {commands['train further']}\n"
                f"  {'stored in':<15}{store.url}")
    rows = [
        ("stored in", store.url),
        ("reward", _reward_text(step_history(store))),
        ("reward curve", f"{store.url}/{REWARD_CURVE}"),
        ("log", str(log_file) if log_file else None),
        ("Prefect UI", result.get("flow_run_url")),
    ]
    first = result.get("resumed_from")
    done = f"steps {(first or 0) + 1}-{step}" if step > (first or 0) + 1 else f"step {step}"
    zero = "the SFT'd policy" if config.sft is not None else "the untrained policy"
    lines = [f"{name}: at step {step}; this run trained {done} (step 0 is {zero})" if step else
             f"{name}: at step 0, {zero}"]
    lines += [f"  {label:<15}{value}" for label, value in rows if value]
    lines.append("next:")
    lines += [f"  {label:<15}{command}" for label, command in commands.items()]
    return "\n".join(lines)


def json_result(config: RunConfig, result: dict[str, Any], log_file: Path | None) -> str:
    """The machine-readable end of `trajflow train --json`: one line."""
    store = RunStore(config.storage, config.project, config.run)
    return json.dumps({"run": f"{config.project}/{config.run}", "storage": config.storage, "run_url": store.url,
                       "reward_curve": f"{store.url}/{REWARD_CURVE}", "log": str(log_file) if log_file else None,
                       **result}, default=str)
