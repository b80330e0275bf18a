"""Recovery from preemption with no human: kill to the first new durable write, and the work redone, for three kills.

Runs the end-to-end test tests/integration/test_preempt_recovery_e2e.py (a real `prefect server start`, `trajflow
deploy`, process workers, a tiny run mid-rollout killed three ways) one scenario at a time, with the deployed
back-off of `recover/on-crash` (10 s), and writes what it measured:

    recovery_s = (mtime of the first file the recovered run writes under steps/) - (time of the kill)
    groups_resampled = stored groups rewritten + rollout requests beyond those of the groups not yet stored,
                       in groups

What the test shortens against production, and what each adds there, is recorded under "config": the worker
poll (1 s here, Prefect's default 10 s: up to +9 s per hop, two hops: the recover run and the new run) and the
zombie window (45 s here, 90 s deployed: up to +45 s for a lost machine). On a lost machine of another host the
new run also waits for the run's lease to expire (TRAJFLOW_LEASE_TTL_S, 300 s after its last renewal); here the
test's machines share a host, where a dead holder frees the lease at once.

    .venv/bin/python benchmarks/preemption.py --out benchmarks/results/preemption.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = "tests/integration/test_preempt_recovery_e2e.py"
DEPLOYED_BACKOFF_S = 10.0
PHASES = (("crash_marked_s", "crash marked"), ("recovered_run_started_s", "new run started"),
          ("recovery_s", "first durable write"))


def _versions() -> dict:
    import prefect
    import torch

    return {"python": platform.python_version(), "prefect": prefect.__version__, "torch": torch.__version__}


def _hardware() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.machine())
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()}


def _plot(scenarios: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    colors = ("#c44e52", "#dd8452", "#55a868")
    for row, (key, result) in enumerate(scenarios.items()):
        start = 0.0
        for (field, label), color in zip(PHASES, colors):
            end = result[field]
            ax.barh(row, end - start, left=start, color=color, label=label if row == 0 else None)
            start = end
        ax.text(start + 0.5, row, f"{start:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(scenarios)), [k.replace("_", " ") for k in scenarios])
    ax.set_xlabel("seconds after the kill")
    ax.set_title("Preempted mid-rollout: from the kill to the recovered run's first write", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/preemption.json"))
    args = parser.parse_args()
    hardware = _hardware()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "scenarios.json"
        env = {**os.environ, "TRAJFLOW_PREEMPTION_RESULTS": str(raw), "TRAJFLOW_PREEMPT_SERIAL": "1",
               "TRAJFLOW_PREEMPT_BACKOFF_S": str(DEPLOYED_BACKOFF_S)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST]
        started = time.time()
        done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not raw.exists():
            print(done.stdout[-4000:], done.stderr[-2000:], file=sys.stderr)
            return 1
        scenarios = json.loads(raw.read_text())
    summary = {
        "recovery_s_worker_alive": scenarios["worker_alive"]["recovery_s"],
        "recovery_s_machine_lost": scenarios["machine_lost"]["recovery_s"],
        "recovery_s_sigterm": scenarios["sigterm"]["recovery_s"],
        "groups_resampled": sum(s["groups_resampled"] for s in scenarios.values()),
        "runs_completed": sum(1 for s in scenarios.values() if s["completed"]),
    }
    result = {
        "summary": summary,
        "scenarios": scenarios,
        "config": {
            "run": "tiny-random, echo agent, 2 steps x 3 groups x 2 rollouts; killed with group 0 of step 1 stored and "
                   "group 1 in flight",
            "recover_backoff_s": DEPLOYED_BACKOFF_S, "recover_attempts": 3,
            "worker_poll_s": 1, "worker_poll_s_production": 10,
            "heartbeat_s": 30, "silent_after_s": 45, "silent_after_s_production": 90,
            "lease_ttl_s": 300, "scenarios_run": "one at a time",
        },
        "command": "python benchmarks/preemption.py --out " + os.path.relpath(args.out, REPO),
        "test": TEST,
        "wall_s": round(time.time() - started, 1),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": {**hardware, "load_average_at_end": os.getloadavg()},
        "versions": _versions(),
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(scenarios, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
