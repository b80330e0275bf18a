"""Synchronous loop vs the async pipeline (pipeline.max_off_policy_steps = 1, 2): throughput and learning, per seed.

Each run is the real training flow (``python -m flows.train``: Prefect, embedded inference server on the GPU,
local storage), one after another so no two runs share the GPU. The update runs where ``training.mode: auto`` puts
it (unless ``--set training.mode=...``): in the flow's process at k=0, in a trainer process of its own at k >= 1 on a
GPU (recorded per run as ``trainer_process``, from the flow's log, and in the .md). With
``--embedded-process`` every run sets ``inference.embedded_process=true``: the server runs as a process of its own, so
its Python and the trainer's stop sharing one interpreter lock (recorded in each run, the details and the .md; one
runs folder per mode). Per run:

- steps per hour = (N - 1) / (commit time of step N - commit time of step 1) x 3600 (from the manifests; step 1
  is left out: it pays the kernel compiles and the first loads, the same for every k);
- GPU idle share = share of ``nvidia-smi`` utilization samples (every 200 ms, from step 1's commit to step N's)
  at or below 5%; and the mean utilization;
- validation reward (the agent's own, ``eval_scenarios`` fixed val problems) every ``eval_every`` steps, with its
  wall time since step 0's commit.

Per k (mean and standard deviation over seeds): steps per hour, GPU idle share, the validation reward at the last
step (equal steps) and at equal wall time (the latest evaluation each run had reached when the fastest k finished
its last step). The target of the issue: >= 1.5x steps per hour at k=1 with the validation reward at equal steps
within two standard deviations of the synchronous run's.

The config is ``configs/default.yaml`` (SmolLM2-135M, arithmetic) with 16 groups x 16 rollouts per step, so that
sampling takes about as long as training on an H200 (``--groups``, ``--group-size`` change it); the first run
prints its time/rollouts_s and time/train_s per step to check. Runs are resumable across calls: each finished run
is kept as ``<out>-runs/k<k>-seed<s>.json`` and skipped later, and ``--budget-s`` stops starting new runs after
that long, so the whole grid fits in calls of ten minutes; the report (``<out>.json`` with a top-level
``summary`` of the issue's figures, ``SUMMARY_KEYS``, and the others in ``details``; ``<out>.md``; ``<out>.png``:
validation reward vs wall time and vs step) is written once every run
is there (or with ``--report`` from what is there). ``--runs-dir`` keeps the finished runs elsewhere (a folder that
outlives the calls, when ``--out`` does not).

    # the H200 (flow wheels installed as in benchmarks/results/flow-h200.md), repeated until it says "report written":
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/async_pipeline.py --budget-s 500 --runs-dir /tmp/async-h200-runs \
        --out benchmarks/results/async-h200
    # CPU check that it runs end to end (tiny-random, 3 steps, one seed; no GPU figures):
    .venv/bin/python benchmarks/async_pipeline.py --smoke --out /tmp/async-smoke

``--ks`` and ``--seeds`` pick the runs of one invocation, so seeds can run as processes side by side on one GPU (each
with its own Prefect server; ``--no-report`` on each, then one ``--report``). Their steps per hour and GPU idle
share are then those of a GPU the runs share: compare only runs measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backends.serving.managed_process import free_port  # noqa: E402 - after the path

IDLE_UTILIZATION = 5  # percent: a sample at or below it counts as idle
SAMPLE_S = 0.2


class GpuSampler:
    """``nvidia-smi`` utilization samples (percent, with their time) in a background thread; none without it."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "--id=0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), float(out.strip().splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=10)

    def between(self, start: float, end: float) -> dict:
        window = [u for t, u in self.samples if start <= t <= end]
        if not window:
            return {"gpu_idle_share": None, "gpu_utilization_mean": None, "gpu_samples": 0}
        return {"gpu_idle_share": sum(1 for u in window if u <= IDLE_UTILIZATION) / len(window),
                "gpu_utilization_mean": statistics.fmean(window), "gpu_samples": len(window)}


class PrefectServer:
    """One local Prefect API for every run (each flow would otherwise start its own ephemeral one, ~15 s)."""

    def __init__(self, home: Path):
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "DO_NOT_TRACK": "1"}
        self.proc = None

    def __enter__(self) -> PrefectServer:
        import httpx

        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port)], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"prefect server exited with {self.proc.returncode}")
            time.sleep(0.5)
        raise SystemExit("prefect server did not answer within 120 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _commit_time(manifest) -> float:
    return datetime.fromisoformat(manifest.created_at.replace("Z", "+00:00")).timestamp()


def flow_args(args, k: int, seed: int, storage: str) -> list[str]:
    sets = {"storage": storage, "project": "trajflow", "run": f"async-k{k}-seed{seed}", "seed": seed, "steps": args.steps,
            "groups_per_step": args.groups, "group_size": args.group_size, "eval_every": args.eval_every,
            "eval_at_start": "true", "pipeline.max_off_policy_steps": k,
            "rollouts.concurrency": args.groups * args.group_size}
    if args.embedded_process:
        sets["inference.embedded_process"] = "true"
    if args.smoke:
        sets.update({"agent": "arithmetic", "base_model": "tiny-random", "eval_scenarios": 4,
                     "inference.device": "cpu", "training.device": "cpu", "trainer.lora_rank": 4,
                     "trainer.lora_alpha": 8})
    out = [args.config]
    for key, value in sets.items():
        out += ["--set", f"{key}={value}"]
    return out + [item for extra in args.set for item in ("--set", extra)]


TRAINER_PROCESS_LINE = "trainer process started"  # logged by tasks/support/trainer_process.py


def one_run(args, k: int, seed: int, storage: str, api: PrefectServer) -> dict:
    """Train one (k, seed) run to the end; its per-step metrics, timings and GPU samples."""
    from storage.store import RunStore

    cmd = [sys.executable, "-m", "flows.train", *flow_args(args, k, seed, storage)]
    env = {**api.env, "PREFECT_API_URL": api.url}
    started = time.time()
    with GpuSampler() as gpu:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"k={k} seed={seed} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    manifests = RunStore(storage, "trajflow", f"async-k{k}-seed{seed}").manifests()
    t0, t1, tn = (_commit_time(manifests[s]) for s in (0, 1, args.steps))
    steps = [{"step": s, "since_step0_s": _commit_time(m) - t0,
              **{key: v for key, v in m.metrics.items()
                 if key.startswith(("time/", "val/reward", "train/reward", "pipeline/", "train/ratio",
                                    "train/mismatch_kl", "train/clip_fraction", "train/probe_forwards"))
                 or (key.startswith("train/") and key.endswith("_s"))}}
             for s, m in manifests.items()]
    return {"k": k, "seed": seed, "environment": environment(), "embedded_process": args.embedded_process,
            "trainer_process": TRAINER_PROCESS_LINE in proc.stdout + proc.stderr, "wall_s": time.time() - started,
            "steps": steps,
            "steps_per_hour": (args.steps - 1) / (tn - t1) * 3600,
            **gpu.between(t1, tn), "gpu_sampler": gpu.available, "command": " ".join(cmd[1:])}


def environment() -> dict:
    """The machine this process runs on: a run records it, so a report written elsewhere names where it ran."""
    import torch

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def runs_environment(runs: list[dict]) -> dict:
    """The machine the runs ran on (the latest date among them); this machine's for runs that did not record one.

    Runs from different machines in one report are refused: their steps per hour do not compare.
    """
    recorded = [r["environment"] for r in runs if "environment" in r]
    if not recorded:
        return environment()
    machines = {tuple((k, v) for k, v in sorted(e.items()) if k != "date") for e in recorded}
    if len(machines) > 1 or len(recorded) < len(runs):
        raise SystemExit("the runs folder mixes runs from different machines (or with and without a recorded "
                         "machine): one folder per machine")
    return {**recorded[0], "date": max(e["date"] for e in recorded)}


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _val_at(run: dict, wall_s: float | None = None) -> float | None:
    """The run's validation reward at its last evaluation (or the last one done by `wall_s` after step 0)."""
    evals = [s for s in run["steps"] if "val/reward" in s and (wall_s is None or s["since_step0_s"] <= wall_s)]
    return evals[-1]["val/reward"] if evals else None


def report(args, runs: list[dict], out: Path) -> dict:
    ks = sorted({r["k"] for r in runs})
    by_k = {k: [r for r in runs if r["k"] == k] for k in ks}
    equal_wall = min(max(s["since_step0_s"] for s in r["steps"]) for r in runs)  # when the fastest run finished
    per_k = {}
    for k, group in by_k.items():
        sph, sph_sd = _mean_sd([r["steps_per_hour"] for r in group])
        idle, _ = _mean_sd([r["gpu_idle_share"] for r in group])
        util, _ = _mean_sd([r["gpu_utilization_mean"] for r in group])
        val, val_sd = _mean_sd([_val_at(r) for r in group])
        val_wall, val_wall_sd = _mean_sd([_val_at(r, equal_wall) for r in group])
        rollouts, train = (_mean_sd([s.get(f"time/{n}_s") for r in group for s in r["steps"][2:]])[0]
                           for n in ("rollouts", "train"))
        where = {"trainer process" if r.get("trainer_process") else "flow process" for r in group}
        per_k[k] = {"seeds": sorted(r["seed"] for r in group), "update_in": " / ".join(sorted(where)),
                    "steps_per_hour": sph, "steps_per_hour_sd": sph_sd,
                    "gpu_idle_share": idle, "gpu_utilization_mean": util, "val_reward": val, "val_reward_sd": val_sd,
                    "val_reward_at_equal_wall": val_wall, "val_reward_at_equal_wall_sd": val_wall_sd,
                    "rollouts_wait_s_mean": rollouts, "train_s_mean": train,
                    "staleness_max": max((s.get("pipeline/staleness_max", 0.0) for r in group for s in r["steps"]),
                                         default=None)}
    names = {0: "sync", 1: "k1", 2: "k2"}
    summary: dict = {"seeds": sorted({r["seed"] for r in runs}), "steps": args.steps,
                     "equal_wall_s": equal_wall, "smoke": args.smoke,
                     "embedded_process": _one_server_mode(runs)}
    for k, stats in per_k.items():
        name = names.get(k, f"k{k}")
        summary[f"steps_per_hour_{name}"] = stats["steps_per_hour"]
        summary[f"val_reward_{name}"] = stats["val_reward"]
        summary[f"val_reward_sd_{name}"] = stats["val_reward_sd"]
        summary[f"val_reward_at_equal_wall_{name}"] = stats["val_reward_at_equal_wall"]
        summary[f"gpu_idle_share_{name}"] = stats["gpu_idle_share"]
        if k and 0 in per_k and per_k[0]["steps_per_hour"]:
            summary[f"async_speedup_{name}"] = stats["steps_per_hour"] / per_k[0]["steps_per_hour"]
            sd = per_k[0]["val_reward_sd"] or 0.0
            summary[f"val_reward_within_2sd_{name}"] = (stats["val_reward"] is not None and
                                                       abs(stats["val_reward"] - per_k[0]["val_reward"]) <= 2 * sd)
    if "async_speedup_k1" in summary:
        summary["target_met_k1"] = summary["async_speedup_k1"] >= 1.5 and summary["val_reward_within_2sd_k1"]
    result = {"summary": {k: summary[k] for k in SUMMARY_KEYS if k in summary},
              "details": {k: v for k, v in summary.items() if k not in SUMMARY_KEYS}, "per_k": {str(k): v for k, v in per_k.items()}, "runs": runs,
              "config": {"base": args.config, "groups_per_step": args.groups, "group_size": args.group_size,
                         "steps": args.steps, "eval_every": args.eval_every, "sets": args.set,
                         "embedded_process": summary["embedded_process"]},
              "environment": runs_environment(runs),
              "command": "python benchmarks/async_pipeline.py " + " ".join(sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".png").write_bytes(_plot(by_k, names))
    out.with_suffix(".md").write_text(_markdown(result, names))
    return result


# The figures; the rest of the report's figures (sd, equal-wall reward, idle share, k=2, ...) go in "details".
SUMMARY_KEYS = ("steps_per_hour_sync", "steps_per_hour_k1", "async_speedup_k1", "val_reward_sync", "val_reward_k1",
                "seeds")


def _one_server_mode(runs: list[dict]) -> bool:
    """Whether the runs had the server in its own process; runs of both kinds in one report are refused."""
    modes = {bool(r.get("embedded_process", False)) for r in runs}
    if len(modes) > 1:
        raise SystemExit("the runs folder mixes runs with and without --embedded-process: one folder per mode")
    return modes.pop() if modes else False


def _plot(by_k: dict, names: dict) -> bytes:
    """Validation reward vs wall time since step 0 (left) and vs step (right), one line per run."""
    from tasks.support.reporting import chart_png

    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]

    def draw(axes) -> None:
        by_time, by_step = axes
        for i, (k, group) in enumerate(by_k.items()):
            for j, run in enumerate(group):
                evals = [s for s in run["steps"] if "val/reward" in s]
                label = names.get(k, f"k{k}") if j == 0 else None
                rewards = [s["val/reward"] for s in evals]
                style = {"color": colours[i % 4], "alpha": 0.7, "label": label}
                by_time.plot([s["since_step0_s"] / 60 for s in evals], rewards, "o-", **style)
                by_step.plot([s["step"] for s in evals], rewards, "o-", **style)
        by_time.set(xlabel="wall time since step 0 (min)", ylabel="val reward", title="val reward vs wall time")
        by_step.set(xlabel="step", ylabel="val reward", title="val reward vs step")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()

    return chart_png(draw, figsize=(11, 4), ncols=2)


def _fmt(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _markdown(result: dict, names: dict) -> str:
    s, env = {**result["summary"], **result["details"]}, result["environment"]
    lines = [f"# Synchronous loop vs async pipeline ({env['date']})", "",
             f"    {result['command']}", "",
             f"Machine: {env['cuda'] or 'no GPU'}, {env['cpus']} CPUs, Python {env['python']}, torch {env['torch']}. "
             f"Config: `{result['config']['base']}`, {result['config']['groups_per_step']} groups x "
             f"{result['config']['group_size']} rollouts per step, {result['config']['steps']} steps, evaluation every "
             f"{result['config']['eval_every']} steps; seeds {s['seeds']}; inference server "
             f"{'in its own process' if s['embedded_process'] else 'on a thread of the flow'}." + (" SMOKE RUN (CPU, tiny-random): the "
                                                                              "figures say nothing." if s["smoke"] else ""),
             "", "| k | steps/hour | speedup | GPU idle share | GPU util mean | val reward at step N (mean ± sd) | "
                 "val reward at equal wall time | rollouts wait s/step | train s/step | max staleness | update in |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k, v in result["per_k"].items():
        name = names.get(int(k), f"k{k}")
        speed = s.get(f"async_speedup_{name}", 1.0 if k == "0" else None)
        lines.append(f"| {k} ({name}) | {_fmt(v['steps_per_hour'], 1)} ± {_fmt(v['steps_per_hour_sd'], 1)} | "
                     f"{_fmt(speed, 2)} | {_fmt(v['gpu_idle_share'])} | {_fmt(v['gpu_utilization_mean'], 1)} | "
                     f"{_fmt(v['val_reward'])} ± {_fmt(v['val_reward_sd'])} | {_fmt(v['val_reward_at_equal_wall'])} | "
                     f"{_fmt(v['rollouts_wait_s_mean'], 2)} | {_fmt(v['train_s_mean'], 2)} | {_fmt(v['staleness_max'], 0)} | "
                     f"{v.get('update_in', 'n/a')} |")
    lines += ["", f"Equal wall time: {s['equal_wall_s']:.0f} s after step 0 (when the fastest run finished). "
              f"Target (k=1: >= 1.5x steps per hour, val reward at equal steps within 2 sd of sync): "
              f"{s.get('target_met_k1', 'not measured')}.", "",
              "Steps per hour leave out step 1 (kernel compiles, first loads). GPU idle share: nvidia-smi utilization "
              f"samples every {SAMPLE_S} s at or below {IDLE_UTILIZATION}%, between step 1's commit and the last. "
              "Reward curves: the .png beside this file."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/async-h200", help="path without suffix")
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="more RunConfig overrides, key=value")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new run after this many seconds")
    parser.add_argument("--runs-dir", default=None, help="where finished runs are kept (default: <out>-runs)")
    parser.add_argument("--report", action="store_true", help="write the report from the runs there are")
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny-random, 3 steps, 2x2 rollouts, seed 0")
    parser.add_argument("--embedded-process", action="store_true",
                        help="every run with inference.embedded_process=true (the server in its own process)")
    parser.add_argument("--no-report", action="store_true",
                        help="only the runs, no report (for invocations running side by side; then one --report)")
    args = parser.parse_args()
    if args.smoke:
        args.config, args.steps, args.groups, args.group_size, args.eval_every = "configs/tiny.yaml", 3, 2, 2, 1
        args.seeds = [0] if args.seeds == [0, 1, 2] else args.seeds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir or f"{args.out}-runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    todo = [(k, s) for s in args.seeds for k in args.ks if not (runs_dir / f"k{k}-seed{s}.json").exists()]
    done = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("k*-seed*.json"))]
    if any(bool(r.get("embedded_process", False)) != args.embedded_process for r in done):
        raise SystemExit(f"{runs_dir} holds runs {'without' if args.embedded_process else 'with'} --embedded-process: "
                         "give this mode a --runs-dir of its own")
    with tempfile.TemporaryDirectory(prefix="trajflow-async-") as tmp:
        if todo and not args.report:
            with PrefectServer(Path(tmp) / "prefect-home") as api:
                for k, seed in todo:
                    if args.budget_s is not None and time.time() - started > args.budget_s:
                        print(f"budget spent; {len(todo)} runs left: run the same command again", flush=True)
                        break
                    run = one_run(args, k, seed, f"{tmp}/runs", api)
                    (runs_dir / f"k{k}-seed{seed}.json").write_text(json.dumps(run, indent=2))
                    todo = todo[1:]
                    print(f"k={k} seed={seed}: {run['steps_per_hour']:.1f} steps/hour, idle share "
                          f"{_fmt(run['gpu_idle_share'])}, val {_fmt(_val_at(run))}", flush=True)
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("k*-seed*.json"))]
    if (todo and not args.report) or args.no_report:
        return 0
    result = report(args, runs, out)
    print(json.dumps(result["summary"], indent=2))
    print(f"report written: {out.with_suffix('.json')}, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
