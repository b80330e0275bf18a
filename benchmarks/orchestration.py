"""Per-step overhead of orchestration and storage: everything but generation and the optimizer.

The training flow runs for real (Prefect tasks with persisted results, run store, Parquet groups,
checkpoint upload, publish, commit, artifacts) against an instant stub policy server, with the
tiny-random trainer, for 8 groups x 8 rollouts per step (``--groups``, ``--group-size``). Per step:

    overhead   = time/step_s - train/update_s     (the stub makes generation ~free; what the issue's figures measure)
    commit_gap = (commit time of step s - commit time of step s-1) - train/update_s
                                                   (also counts the commit, retention and artifacts after the stages)

Median over the steps after the first, for local storage and S3 (moto server on 127.0.0.1), for the synchronous
loop (``pipeline.max_off_policy_steps=0``, the figures in ``summary``) and for the async pipeline at k=1, where
the next step's rollouts run while the current one trains. On a machine shared with other work the per-step
figures swing by seconds, so runs are pooled: ``--baseline FILE...`` are runs of the code before (e.g. the previous
commit's script, run alternately with this one), kept under ``before`` with the median over all their steps;
``--also FILE...`` are earlier runs of this code, pooled with this run into ``summary`` (medians over every steady
step of every run; ``*_min`` the least, the figure least disturbed by other work). The file written earlier to
``--out`` is kept under ``before`` too. ``--profile DIR`` runs each flow under cProfile (``DIR/<storage>-k<k>.prof``).
``--stub-latency-s`` makes each chat completion of the stub wait (asleep), so that steps last as long as on a GPU
(Prefect's task engine remembers for 5 s that a tag has no concurrency limit: a longer step asks again).
``--modes`` picks which of the four flows run (``local``, ``local_k1``, ``s3``, ``s3_k1``; all by default).

    .venv/bin/python benchmarks/orchestration.py --steps 5 --out benchmarks/results/orchestration.json
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
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("local", "local_k1", "s3", "s3_k1")


def run_flow(root: str, run: str, policy_url: str, steps: int, env: dict, k: int, profile: str | None,
             groups: int, group_size: int) -> float:
    cmd = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else []), "-m", "flows.train",
           "configs/tiny.yaml", "--set", f"storage={root}", "--set", f"run={run}", "--set", f"steps={steps}",
           "--set", f"groups_per_step={groups}", "--set", f"group_size={group_size}", "--set", "inference.backend=url",
           "--set", f"inference.url={policy_url}", "--set", "inference.probe_tolerance=1000000",
           "--set", "rollouts.concurrency=64", "--set", "retention.best_metric=null",
           "--set", f"pipeline.max_off_policy_steps={k}"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"flow failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def _commit_time(manifest) -> float:
    return datetime.fromisoformat(manifest.created_at.replace("Z", "+00:00")).timestamp()


def step_overheads(root: str, run: str) -> list[dict]:
    from storage.store import RunStore

    manifests = RunStore(root, "ci", run).manifests()
    rows = []
    for step, manifest in manifests.items():
        if step == 0:
            continue
        m = manifest.metrics
        update = m.get("train/update_s", 0.0)
        gap = _commit_time(manifest) - _commit_time(manifests[step - 1])
        rows.append({"step": step, "step_s": m["time/step_s"], "update_s": update,
                     "overhead_s": m["time/step_s"] - update, "commit_gap_s": gap - update,
                     **{k: v for k, v in m.items() if k.startswith("time/")}})
    return rows


def summarize(rows: list[dict]) -> dict:
    steady = rows[1:] or rows
    return {"overhead_median_s": statistics.median(r["overhead_s"] for r in steady),
            "commit_gap_median_s": statistics.median(r["commit_gap_s"] for r in steady)}


def measure(kind: str, root: str, stub, steps: int, env: dict, k: int, profile_dir: str | None,
            shape: tuple[int, int]) -> dict:
    run = f"orchestration-k{k}"
    profile = f"{profile_dir}/{kind}-k{k}.prof" if profile_dir else None
    wall = run_flow(root, run, stub.base_url, steps, env, k, profile, *shape)
    rows = step_overheads(root, run)
    print(f"{kind} k={k}: {summarize(rows)}", flush=True)
    return {"wall_s": wall, "steps": rows, **summarize(rows)}


def pooled(runs: list[dict], kinds: tuple[str, ...]) -> dict:
    """Medians (and minima) per storage kind over the steady steps (2..) of every run; `runs` of the old format
    (no commit gaps) give only overhead figures."""
    out: dict = {"runs_pooled": len(runs)}
    for kind in kinds:
        rows = [r for run in runs if kind in run for r in run[kind]["steps"][1:]]
        for field, key in (("overhead_s", "overhead_s"), ("commit_gap_s", "commit_gap_s"),
                           ("train_orchestration_s", "time/train_orchestration_s")):
            values = [r[key] for r in rows if key in r]
            if values:
                out[f"{field}_{kind}"] = statistics.median(values)
                out[f"{field}_{kind}_min"] = min(values)
    return out


def _moto_storage(env: dict, tmp: str):
    """A moto S3 server on 127.0.0.1 with the bucket ``bench-runs``: (server, the flow's environment for it)."""
    import boto3
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    env_s3 = {**env, "PREFECT_HOME": f"{tmp}/home-s3", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
              "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=env_s3["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket="bench-runs")
    os.environ.update({k: v for k, v in env_s3.items() if k.startswith("AWS_")})
    return moto, env_s3


SUMMARY_KEYS = ("overhead_s_local", "overhead_s_s3")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8, help="groups per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group")
    parser.add_argument("--stub-latency-s", type=float, default=0.0, help="each chat completion waits this long")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES, help="the flows to run")
    parser.add_argument("--out", default="benchmarks/results/orchestration.json")
    parser.add_argument("--baseline", nargs="*", default=[], help="runs of the code before, pooled under before")
    parser.add_argument("--also", nargs="*", default=[], help="earlier runs of this code, pooled into summary")
    parser.add_argument("--profile", default=None, metavar="DIR", help="write a cProfile of each flow run here")
    parser.add_argument("--realistic-step-s", type=float, default=None,
                        help="wall time of a realistic step to compare with (e.g. the main job's)")
    args = parser.parse_args()

    from benchmarks.stub_policy import StubPolicyServer

    before = {}
    if Path(args.out).exists():
        previous = json.loads(Path(args.out).read_text())
        before["previous_file"] = ({**previous["summary"], **previous.get("details", {})} if "summary" in previous else {
            "overhead_s_local": previous["local"]["overhead_median_s"], "overhead_s_s3": previous["s3"]["overhead_median_s"],
            "date": previous["environment"]["date"], "load_average_after": previous["environment"]["load_average_after"]})
    if args.baseline:
        bases = [json.loads(Path(f).read_text()) for f in args.baseline]
        before["baseline"] = {**pooled(bases, ("local", "s3")), "runs": bases}
    stub = StubPolicyServer(latency_s=args.stub_latency_s)
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    shape = (args.groups, args.group_size)
    results: dict = {"config": {"groups_per_step": args.groups, "group_size": args.group_size, "steps": args.steps,
                                "trainer_model": "tiny-random", "policy": "instant stub server",
                                "stub_latency_s": args.stub_latency_s}}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        env_local = {**env, "PREFECT_HOME": f"{tmp}/home-local"}
        for mode, k in (("local", 0), ("local_k1", 1)):
            if mode in args.modes:
                results[mode] = measure("local", f"{tmp}/runs", stub, args.steps, env_local, k, args.profile, shape)
        if {"s3", "s3_k1"}.isdisjoint(args.modes):
            moto = None
        else:
            moto = _moto_storage(env, tmp)
        for mode, k in (("s3", 0), ("s3_k1", 1)):
            if mode in args.modes:
                results[mode] = measure("s3", "s3://bench-runs/runs", stub, args.steps, moto[1], k, args.profile, shape)
        if moto is not None:
            moto[0].stop()
    stub.stop()

    if args.realistic_step_s:
        for kind in set(("local", "s3")) & set(results):
            results[kind]["overhead_share_of_realistic_step"] = results[kind]["overhead_median_s"] / args.realistic_step_s
    import prefect
    import torch
    import transformers

    results["environment"] = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                              "load_average_before": load_before, "load_average_after": os.getloadavg(),
                              "prefect": prefect.__version__, "torch": torch.__version__,
                              "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}
    others = [json.loads(Path(f).read_text()) for f in args.also]
    figures = {
        **pooled([results, *others], ("local", "s3", "local_k1", "s3_k1")),
        "definition": "medians over steps 2.. of every pooled run of time/step_s - train/update_s (overhead_s_*), of "
                      "commit-to-commit time minus train/update_s (commit_gap_s_*), of time/train_orchestration_s (the train "
                      "stage minus the train task's body); *_min: the least; k1: "
                      "pipeline.max_off_policy_steps=1",
    }
    results["also"] = others
    results["before"] = before
    results["realistic_step_s"] = args.realistic_step_s
    results["command"] = "python benchmarks/orchestration.py " + " ".join(sys.argv[1:])
    # the figures in "summary", the others (minima, commit gaps, k=1, pooled runs) in "details"
    summary_first = {"summary": {k: figures.get(k) for k in SUMMARY_KEYS},
                     "details": {k: v for k, v in figures.items() if k not in SUMMARY_KEYS}, **results}
    Path(args.out).write_text(json.dumps(summary_first, indent=2))
    print(json.dumps(summary_first["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
