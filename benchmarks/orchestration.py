"""Per-step overhead of orchestration and storage: everything but generation and the optimizer.

The training flow runs for real (Prefect tasks with persisted results, run store, Parquet groups,
checkpoint upload, publish, commit, artifacts) against an instant stub policy server, with the
tiny-random model as the trainer, for 8 groups x 8 rollouts per step. Per step:

    overhead = time/step_s - train/update_s           (the stub makes generation ~free)

reported for local storage and S3 (moto server on 127.0.0.1), and compared with the step time of
the main job (SmolLM2-135M on this CPU) if ``--realistic-step-s`` is given or found in a stored run.

    .venv/bin/python benchmarks/orchestration.py --steps 4 --out benchmarks/results/orchestration.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_flow(root: str, policy_url: str, steps: int, env: dict) -> float:
    cmd = [sys.executable, "-m", "flows.train", "configs/tiny.yaml", "--set", f"storage={root}",
           "--set", "run=orchestration", "--set", f"steps={steps}", "--set", "groups_per_step=8",
           "--set", "group_size=8", "--set", "inference.backend=url", "--set", f"inference.url={policy_url}",
           "--set", "inference.probe_tolerance=1000000", "--set", "rollouts.concurrency=64",
           "--set", "retention.best_metric=null"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"flow failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def step_overheads(root: str) -> list[dict]:
    from storage.store import RunStore

    store = RunStore(root, "ci", "orchestration")
    rows = []
    for step in store.committed_steps():
        if step == 0:
            continue
        m = store.read_manifest(step).metrics
        rows.append({"step": step, "step_s": m["time/step_s"], "update_s": m.get("train/update_s", 0.0),
                     "overhead_s": m["time/step_s"] - m.get("train/update_s", 0.0),
                     **{k: v for k, v in m.items() if k.startswith("time/")}})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/orchestration.json")
    parser.add_argument("--realistic-step-s", type=float, default=None,
                        help="wall time of a realistic step to compare with (e.g. the main job's)")
    args = parser.parse_args()

    from benchmarks.stub_policy import StubPolicyServer

    stub = StubPolicyServer()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    results: dict = {"config": {"groups_per_step": 8, "group_size": 8, "steps": args.steps,
                                "trainer_model": "tiny-random", "policy": "instant stub server"}}
    with tempfile.TemporaryDirectory() as tmp:
        env_local = {**env, "PREFECT_HOME": f"{tmp}/home-local"}
        wall = run_flow(f"{tmp}/runs", stub.base_url, args.steps, env_local)
        results["local"] = {"wall_s": wall, "steps": step_overheads(f"{tmp}/runs")}

        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        env_s3 = {**env, "PREFECT_HOME": f"{tmp}/home-s3", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
                  "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
        import boto3

        boto3.client("s3", endpoint_url=env_s3["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket="bench-runs")
        os.environ.update({k: v for k, v in env_s3.items() if k.startswith("AWS_")})
        wall = run_flow("s3://bench-runs/runs", stub.base_url, args.steps, env_s3)
        results["s3"] = {"wall_s": wall, "steps": step_overheads("s3://bench-runs/runs")}
        moto.stop()
    stub.stop()
    for kind in ("local", "s3"):
        steady = [r["overhead_s"] for r in results[kind]["steps"][1:]] or [r["overhead_s"] for r in results[kind]["steps"]]
        results[kind]["overhead_median_s"] = statistics.median(steady)
        if args.realistic_step_s:
            results[kind]["overhead_share_of_realistic_step"] = statistics.median(steady) / args.realistic_step_s
    import prefect
    import torch
    import transformers

    results["environment"] = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                              "load_average_after": os.getloadavg(),
                              "prefect": prefect.__version__, "torch": torch.__version__,
                              "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}
    results["realistic_step_s"] = args.realistic_step_s
    results["command"] = "python benchmarks/orchestration.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k]["overhead_median_s"] for k in ("local", "s3")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
