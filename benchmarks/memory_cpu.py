"""Peak resident memory of the main job on the CPU: the whole process tree, sampled, attributed to flow stages.

The training flow runs as ``python -m flows.train CONFIG --json`` in a fresh storage folder (by default the main job,
``configs/default.yaml``). Every ``--interval`` seconds (0.1) the resident set sizes of the flow's process and of
every process it started (Prefect's temporary server, torchrun ranks if any) are summed:

    rss_total(t) = sum over the process tree at t of RSS(process)

(shared pages counted once per process that maps them, as ``ps`` does). Each sample is attributed to the stage that
was running at its time, from the run's log file: every Prefect task logs "Finished in state ..." when it ends, so
the stage of a sample is the first task that finished after it (``startup``: before the flow run began, i.e.
imports and Prefect's temporary server; ``setup+publish`` for step 0's first task, which also loads the trainer
and starts the engine; ``shutdown``: after the last task). Per stage, the peak of ``rss_total`` over its samples.

Results go to ``--out`` (``.json`` + ``.md``): ``summary.main_job_peak_rss_gib`` (this run), the per-stage peaks,
the largest single process, validation reward at the first and last steps, wall time. ``--label before`` stores
the run under ``before`` instead (e.g. the code before a change: ``--code DIR`` runs another checkout); an existing
file's other label is kept, so a before and an after run sit side by side.

    .venv/bin/python benchmarks/memory_cpu.py                                   # the main job, this checkout
    .venv/bin/python benchmarks/memory_cpu.py --label before --code /tmp/main  # the code before, same config
    .venv/bin/python benchmarks/memory_cpu.py --set steps=1 --out /tmp/mem     # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
_FINISHED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ task run '(.+?)': Finished in state (\w+)")
_BEGAN = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ flow run .*Beginning flow run")
_TASK_SUFFIX = re.compile(r"-[0-9a-f]{3}$")


class TreeSampler:
    """Samples the summed RSS of a process and all its descendants every `interval` s, in a thread."""

    def __init__(self, pid: int, interval: float):
        self.root, self.interval = psutil.Process(pid), interval
        self.samples: list[tuple[float, int, int, int]] = []  # (time, total rss, processes, largest rss)
        self.process_peaks: dict[int, tuple[int, str]] = {}  # pid -> (peak rss, command)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total, largest = 0, 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                largest = max(largest, rss)
                if rss > self.process_peaks.get(p.pid, (0, ""))[0]:
                    self.process_peaks[p.pid] = (rss, self.process_peaks.get(p.pid, (0, ""))[1] or _command(p))
            self.samples.append((now, total, len(procs), largest))
            self._stop.wait(self.interval)


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:160]
    except psutil.Error:
        return "?"


def _log_time(date: str, millis: str) -> float:
    return time.mktime(time.strptime(date, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def stage_events(log_text: str) -> tuple[float | None, list[tuple[float, str]]]:
    """(flow start, [(finish time, stage label)]) from a run's log file; labels are 'stage@step'."""
    began, events, step, first = None, [], 0, True
    for line in log_text.splitlines():
        if began is None and (m := _BEGAN.match(line)):
            began = _log_time(m.group(1), m.group(2))
        elif m := _FINISHED.match(line):
            name = _TASK_SUFFIX.sub("", m.group(3))
            if name.startswith("rollouts"):
                name = "rollouts"
            if name == "sample-scenarios":
                step += 1
            label = "setup+publish" if first else name
            first = False
            events.append((_log_time(m.group(1), m.group(2)), f"{label}@{step}"))
    return began, events


def attribute(samples, began: float | None, events: list[tuple[float, str]]) -> list[str]:
    """The stage label of each sample (see the module docstring)."""
    labels, i = [], 0
    for t, *_ in samples:
        if began is not None and t < began:
            labels.append("startup")
            continue
        while i < len(events) and events[i][0] < t:
            i += 1
        labels.append(events[i][1] if i < len(events) else "shutdown")
    return labels


STAGE_ORDER = ("startup", "setup+publish", "evaluate", "sample-scenarios", "rollouts", "score", "train", "publish",
               "shutdown")


def per_stage(samples, labels) -> dict[str, dict]:
    """{stage: {peak_rss_gib, at_step, seconds}}: the peak over every step's instance of the stage, the step where it
    was reached, and the time spent in the stage over the run."""
    out: dict[str, dict] = {}
    for i, ((t, total, *_), label) in enumerate(zip(samples, labels)):
        stage, _, step = label.partition("@")
        gib = total / GIB
        entry = out.setdefault(stage, {"peak_rss_gib": -1.0, "at_step": None, "seconds": 0.0})
        if gib > entry["peak_rss_gib"]:
            entry.update(peak_rss_gib=round(gib, 3), at_step=int(step) if step else None)
        if i:
            entry["seconds"] += t - samples[i - 1][0]
    order = {name: k for k, name in enumerate(STAGE_ORDER)}
    return {k: {**v, "seconds": round(v["seconds"], 1)} for k, v in sorted(out.items(), key=lambda kv: order.get(kv[0], 99))}


def read_rewards(storage: Path, project: str, run: str) -> dict:
    sys.path.insert(0, str(REPO))
    from storage.store import RunStore

    manifests = RunStore(str(storage), project, run).manifests()
    val = {s: m.metrics["val/reward"] for s, m in manifests.items() if "val/reward" in m.metrics}
    train = {s: m.metrics["train/reward"] for s, m in manifests.items() if "train/reward" in m.metrics}
    peaks = {s: m.metrics["train/peak_memory_gib"] for s, m in manifests.items() if "train/peak_memory_gib" in m.metrics}
    return {"val_reward": val, "train_reward": train, "trainer_reported_peak_gib": peaks,
            "steps": sorted(manifests)}


def run_job(args) -> dict:
    code = Path(args.code).resolve()
    with tempfile.TemporaryDirectory(prefix="memory-cpu-") as tmp:
        storage, logs = Path(tmp) / "runs", Path(tmp) / "logs"
        overrides = [f"storage={storage}", *args.overrides]
        cmd = [sys.executable, "-m", "flows.train", args.config, "--json"]
        for o in overrides:
            cmd += ["--set", o]
        env = {**os.environ, "PYTHONPATH": str(code), "TRAJFLOW_LOG_DIR": str(logs),
               "PREFECT_HOME": str(Path(tmp) / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        for item in args.env:
            key, _, value = item.partition("=")
            env[key] = value
        load_before = os.getloadavg()
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sampler = TreeSampler(proc.pid, args.interval).start()
        out, err = proc.communicate()
        sampler.stop()
        wall = time.time() - started
        if proc.returncode != 0:
            raise SystemExit(f"the flow failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        project, _, run = result["run"].partition("/")
        log_files = list(logs.rglob("*.log"))
        log_text = log_files[0].read_text() if log_files else ""
        rewards = read_rewards(storage, project, run)
    began, events = stage_events(log_text)
    labels = attribute(sampler.samples, began, events)
    stages = per_stage(sampler.samples, labels)
    peak_i = max(range(len(sampler.samples)), key=lambda i: sampler.samples[i][1])
    top = sorted(sampler.process_peaks.values(), reverse=True)[:4]
    return {
        "peak_rss_gib": round(sampler.samples[peak_i][1] / GIB, 3),
        "peak_stage": labels[peak_i],
        "largest_process_peak_rss_gib": round(max(s[3] for s in sampler.samples) / GIB, 3),
        "per_stage": stages,
        "processes": [{"peak_rss_gib": round(rss / GIB, 3), "command": cmd} for rss, cmd in top],
        "wall_s": round(wall, 1),
        "samples": len(sampler.samples),
        "interval_s": args.interval,
        "load_average_before": load_before,
        "command": " ".join(cmd).replace(str(storage), "<tmp>/runs"),
        "env": args.env,
        "code": str(code),
        "git": _git(code),
        **rewards,
        "series": [[round(t - started, 2), round(total / GIB, 3), label]
                   for (t, total, *_), label in zip(sampler.samples[:: args.keep_every], labels[:: args.keep_every])],
    }


def _git(code: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    import torch
    import transformers

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}


def run_briefs(doc: dict) -> dict:
    def brief(r: dict | None) -> dict | None:
        if r is None:
            return None
        steps = r.get("steps") or [0]
        val = {int(k): v for k, v in r.get("val_reward", {}).items()}
        return {"peak_rss_gib": r["peak_rss_gib"], "peak_stage": r["peak_stage"],
                "largest_process_peak_rss_gib": r["largest_process_peak_rss_gib"],
                "per_stage_peak_rss_gib": {k: v["peak_rss_gib"] for k, v in r["per_stage"].items()},
                "per_stage_seconds": {k: v.get("seconds") for k, v in r["per_stage"].items()},
                "wall_s": r["wall_s"], "val_reward_first": val.get(min(val)) if val else None,
                "val_reward_last": val.get(max(val)) if val else None, "steps": max(steps)}

    after, before = brief(doc.get("after")), brief(doc.get("before"))
    return {"after": after, "before": before,
            "definition": "peak over the run of the summed RSS of the flow's process tree, sampled every interval_s; "
                          "per_stage: the peak within each stage (from the log's task-finish times)"}


def summarised(doc: dict) -> dict:
    """`doc` with the issue's figure first (``summary``: exactly ``main_job_peak_rss_gib``), then ``details`` (both
    runs in brief), then the runs."""
    runs = {k: v for k, v in doc.items() if k not in ("summary", "details")}
    details = run_briefs(runs)
    peak = details["after"]["peak_rss_gib"] if details["after"] else None
    return {"summary": {"main_job_peak_rss_gib": peak}, "details": details, **runs}


def write_markdown(doc: dict, path: Path) -> None:
    s = doc["details"]
    lines = ["# Peak resident memory of the main job on the CPU (`benchmarks/memory_cpu.py`)", "",
             "Summed RSS of the flow's whole process tree (the flow process, Prefect's temporary server, any "
             "child), sampled every 0.1 s; each sample attributed to the stage running at that time (from the "
             "run's log: each Prefect task's finish time).", ""]
    runs = [(label, doc.get(label), s.get(label)) for label in ("before", "after")]
    lines += ["| | " + " | ".join(label for label, r, _ in runs if r) + " |",
              "|---|" + "---|" * sum(1 for _, r, _ in runs if r)]
    present = [(label, r, b) for label, r, b in runs if r]
    rows = [("peak RSS, whole tree (GiB)", lambda r, b: f"**{b['peak_rss_gib']:.2f}**"),
            ("stage at the peak", lambda r, b: f"`{b['peak_stage']}`"),
            ("largest single process (GiB)", lambda r, b: f"{b['largest_process_peak_rss_gib']:.2f}"),
            ("wall time", lambda r, b: f"{b['wall_s']:.0f} s"),
            ("val reward first -> last step", lambda r, b: f"{b['val_reward_first']:.3f} -> {b['val_reward_last']:.3f}"
             if b["val_reward_first"] is not None else "-"),
            ("code", lambda r, b: r.get("note") or f"`{r.get('git')}`")]
    stages = [k for k in STAGE_ORDER if any(k in b["per_stage_peak_rss_gib"] for _, _, b in present)]
    for stage in stages:
        rows.append((f"`{stage}`: peak GiB (seconds in it)",
                     lambda r, b, stage=stage: f"{b['per_stage_peak_rss_gib'][stage]:.2f} "
                     f"({b['per_stage_seconds'].get(stage) if b['per_stage_seconds'].get(stage) is not None else '?'} s)"
                     if stage in b["per_stage_peak_rss_gib"] else "-"))
    for name, fmt in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(r, b) for _, r, b in present) + " |")
    lines += ["", "Commands: " + "; ".join(f"{label}: `{r['command']}`" + (f" env {r['env']}" if r["env"] else "")
                                           for label, r, _ in present), ""]
    for label, r, _ in present:
        lines += [f"Environment ({label}): " + ", ".join(f"{k} {v}" for k, v in r["environment"].items()), ""]
    lines += doc.get("notes", [])
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/default.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment of the job")
    parser.add_argument("--code", default=str(REPO), help="the checkout whose code runs (default: this one)")
    parser.add_argument("--label", choices=("after", "before"), default="after")
    parser.add_argument("--note", default=None, help="what the code is, stored with the run (e.g. 'main at 6dd7167')")
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--keep-every", type=int, default=10, help="keep every Nth sample in the stored series")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/memory-cpu"), help="path without suffix")
    args = parser.parse_args()

    out = Path(args.out)
    doc = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    run = run_job(args)
    run["environment"] = environment()
    run["note"] = args.note
    doc[args.label] = run
    doc = summarised(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    write_markdown(doc, out.with_suffix(".md"))
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
