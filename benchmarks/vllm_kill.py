"""vLLM killed mid-step, for real: the rollouts task fails naming vLLM, its retry restarts vLLM, the run finishes.

One ``trajflow train`` with ``inference.backend: vllm``. ``--kill-delay-s`` after step ``--kill-at`` has stored its
scenarios (``steps/<K>/scenarios.json``: its rollouts start right after), every process of the vLLM the flow launched
gets SIGKILL (its process group: the API server and its engine core; found before the wait, so the kill itself is
immediate). Then the flow is left alone until it exits. A step's rollouts on the H200 take ~1.7 s (256 at once) and
its group files are written as the groups finish, nearly together, so waiting for the first group file kills too late.
Recorded (JSON + md): when the kill came, how many groups were stored then, when a new vLLM was spawned, when step
K committed, the flow's exit code, the committed steps, step K's ``rollouts/reused_groups``, and the flow's log
lines that name the failure and the restart.

On the H200 (vLLM's wheels in /tmp/site, the flow's in /tmp/fsite; ``benchmarks/gpu/install_part.py``):

    PYTHONPATH=/tmp/fsite:$PWD python3 benchmarks/vllm_kill.py --out $OUT/vllm-kill-h200 \\
        --set 'inference.vllm_command=[python3, -m, vllm.entrypoints.cli.main]' \\
        --set 'inference.vllm_env={PYTHONPATH: /tmp/site}'

CPU check of this script (``--smoke``): tiny-random on the CPU, and for "vLLM" a wrapper that takes ``vllm serve``'s
flags and runs ``trajflow serve`` (the embedded server speaks vLLM's dialect), so the same kill and restart path runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# `vllm serve MODEL --flags` -> `trajflow serve` (CPU check only): the flags the launcher passes that trajflow serve
# has, renamed; the rest (LoRA rank, tool parser, logprobs mode, memory share, dtype) are vLLM's own and dropped.
VLLM_SHAPED_SERVE = textwrap.dedent('''
    import os, sys
    argv, out = sys.argv[2:], []
    model, rest = argv[0], argv[1:]
    rename = {"--host": "--host", "--port": "--port", "--served-model-name": "--served-name",
              "--max-loras": "--max-loras", "--max-model-len": "--max-seq-len"}
    i = 0
    while i < len(rest):
        flag = rest[i]
        takes_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
        if flag in rename:
            out += [rename[flag], rest[i + 1]]
        i += 2 if takes_value else 1
    if os.environ.get("VLLM_API_KEY"):
        os.environ["TRAJFLOW_API_KEY"] = os.environ["VLLM_API_KEY"]
    os.execv(sys.executable, [sys.executable, "-m", "flows.cli", "serve", "--model", model, "--device", "cpu",
                              "--adapter-root", os.environ["KILL_CHECK_ADAPTER_ROOT"], *out])
''')


def descendants(root: int) -> dict[int, str]:
    """{pid: command line} of every live process below `root` (from /proc)."""
    parent, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = cmdline.get(child, "")
                frontier.append(child)
    return found


def vllm_leaders(flow_pid: int) -> list[int]:
    """Process-group leaders among the flow's descendants that run `... serve ...` (the launcher starts vLLM in a
    session of its own, so its group holds the API server and the engine core)."""
    out = []
    for pid, cmd in descendants(flow_pid).items():
        try:
            if " serve " in f" {cmd} " and os.getpgid(pid) == pid:
                out.append(pid)
        except ProcessLookupError:
            continue
    return sorted(out)


def flow_command(args, storage: Path) -> list[str]:
    sets = {"storage": str(storage), "project": "trajflow", "run": "vllm-kill", "steps": args.steps, "eval_at_start": "false",
            "eval_every": 0, "inference.backend": "vllm", "groups_per_step": args.groups, "group_size": args.group_size,
            "rollouts.concurrency": args.concurrency or args.groups * args.group_size}
    if args.smoke:
        sets.update({"base_model": "tiny-random", "inference.device": "cpu", "training.device": "cpu",
                     "trainer.lora_rank": 4, "trainer.lora_alpha": 8, "eval_scenarios": 4,
                     "inference.max_model_len": 1024})
    cmd = [sys.executable, "-m", "flows.cli", "train", args.config]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd + [item for extra in args.set for item in ("--set", extra)]


def run_check(args, work: Path) -> dict:
    from storage.store import RunStore
    from tasks.support.run_logs import LOG_DIR_ENV, log_file_for

    storage = work / "runs"
    os.environ[LOG_DIR_ENV] = str(work / "logs")  # the flow's and vLLM's logs of this check alone (run_logs.py)
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "VLLM_NO_USAGE_STATS": "1"}
    extra = []
    if args.smoke:
        wrapper = work / "vllm"
        wrapper.write_text(f"#!{sys.executable}\n" + VLLM_SHAPED_SERVE)
        wrapper.chmod(0o755)
        env["KILL_CHECK_ADAPTER_ROOT"] = str(storage)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        extra = ["--set", f"inference.vllm_command=[{wrapper}]"]
    cmd = flow_command(args, storage) + extra
    log_path = work / "flow.log"
    store = RunStore(str(storage), "trajflow", "vllm-kill")
    step_dir = storage / "trajflow" / "vllm-kill" / "steps" / f"{args.kill_at:05d}"
    groups_dir = step_dir / "groups"
    events: dict = {"command": " ".join(cmd[1:]), "kill_at": args.kill_at}
    started = time.time()
    with open(log_path, "w") as log:
        flow = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            leaders = []
            while flow.poll() is None and not (step_dir / "scenarios.json").exists():
                if time.time() - started > args.timeout_s:
                    raise SystemExit(f"step {args.kill_at} sampled nothing within {args.timeout_s} s; log: {log_path}")
                if not leaders and (args.kill_at - 1) in store.committed_steps():
                    leaders = vllm_leaders(flow.pid)  # vLLM is up once the step before has committed
                time.sleep(0.01)
            if flow.poll() is not None:
                raise SystemExit(f"the flow exited ({flow.returncode}) before step {args.kill_at}'s rollouts; "
                                 f"log tail:\n{log_path.read_text()[-3000:]}")
            leaders = leaders or vllm_leaders(flow.pid)
            if not leaders:
                raise SystemExit("found no `serve` process group under the flow to kill")
            time.sleep(args.kill_delay_s)
            for pid in leaders:
                os.killpg(pid, signal.SIGKILL)
            events.update(kill_s=time.time() - started, killed_groups=leaders,
                          groups_stored_at_kill=len(list(groups_dir.glob("*.parquet"))))
            while flow.poll() is None:
                now = time.time() - started
                if "respawn_s" not in events and [p for p in vllm_leaders(flow.pid) if p not in leaders]:
                    events["respawn_s"] = now
                if "commit_s" not in events and args.kill_at in store.committed_steps():
                    events["commit_s"] = now
                if now > args.timeout_s:
                    flow.kill()
                    raise SystemExit(f"the flow did not finish within {args.timeout_s} s; log: {log_path}")
                time.sleep(0.2)
        finally:
            if flow.poll() is None:
                flow.kill()
    events.update(rc=flow.returncode, wall_s=time.time() - started)
    manifests = store.manifests()
    events["committed_steps"] = sorted(manifests)
    metrics = manifests[args.kill_at].metrics if args.kill_at in manifests else {}
    events["reused_groups_at_kill_step"] = metrics.get("rollouts/reused_groups")
    events["step_metrics_at_kill_step"] = {k: v for k, v in metrics.items() if k.startswith(("time/", "rollouts/"))}
    flow_log = log_file_for("trajflow", "vllm-kill")  # the flow's own log: task states included
    lines = (flow_log if flow_log.is_file() else log_path).read_text(errors="replace").splitlines()
    task = f"'rollouts-step-{args.kill_at}'"
    events["rollouts_task_states"] = [line.split(task, 1)[1].strip(" :-")[:200] for line in lines if task in line]
    events["log_lines"] = [line[:400] for line in lines
                           if any(w in line.lower() for w in ("vllm", "retry", "restart", "exit code", "crashed"))][-40:]
    return events


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    header = ("| recovered | rollouts task failed | flow exit code | killed at s | groups stored at kill | new vLLM spawned "
              "at s | step committed at s | groups reused | committed steps |")
    row = (f"| {s['recovered']} | {s['rollouts_task_failed']} | {s['rc']} | {s['kill_s']} | "
           f"{s['groups_stored_at_kill']} of {s['groups_per_step']} | {s['respawn_s']} | {s['commit_s']} | "
           f"{s['reused_groups']} | {s['committed_steps']} |")
    lines = [f"# vLLM killed mid-step ({result['date']})", "", f"    {result['argv']}", "",
             f"Flow: `{result['events']['command']}`", "", header, "|---|---|---:|---:|---:|---:|---:|---:|---|", row, "",
             f"States of step {result['events']['kill_at']}'s rollouts task: {result['events']['rollouts_task_states']}", "",
             "The flow's log lines that name vLLM, a retry or a restart:", "", "```",
             *result["events"]["log_lines"], "```", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="results path without suffix (.json and .md are written)")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=2, help="the step whose rollouts the kill interrupts")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=None, help="rollouts in flight (default: all of a step)")
    ap.add_argument("--kill-delay-s", type=float, default=0.5, help="from step K's scenarios to the kill")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--set", action="append", default=[], help="more run-config overrides (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-random, trajflow serve wrapped as vllm")
    args = ap.parse_args(argv)
    if args.smoke:
        # one group in flight at a time, so the kill lands while the step's later groups are still to come
        args.config, args.groups, args.group_size, args.concurrency = "configs/tiny.yaml", 6, 4, 4
        args.kill_delay_s = 0.0
    if not 1 <= args.kill_at <= args.steps:
        ap.error(f"--kill-at must be a step of the run (1..{args.steps})")
    with tempfile.TemporaryDirectory(prefix="vllm-kill-") as tmp:
        events = run_check(args, Path(tmp))
    recovered = events["rc"] == 0 and events["committed_steps"][-1:] == [args.steps]
    # the step's rollouts task failed (and was retried) rather than finishing before the kill
    mid_rollouts = any("Completed" not in state for state in events["rollouts_task_states"])
    summary = {"recovered": recovered, "rc": events["rc"], "kill_s": round(events["kill_s"], 1),
               "groups_stored_at_kill": events["groups_stored_at_kill"], "groups_per_step": args.groups,
               "rollouts_task_failed": mid_rollouts, "respawn_s": round(events["respawn_s"], 1) if "respawn_s" in events else None,
               "commit_s": round(events["commit_s"], 1) if "commit_s" in events else None,
               "reused_groups": events["reused_groups_at_kill_step"], "committed_steps": events["committed_steps"]}
    result = {"summary": summary, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "argv": " ".join(["python", *sys.argv]), "smoke": args.smoke, "events": events}
    out = args.out or Path(tempfile.gettempdir()) / "vllm-kill-smoke"
    write_report(result, out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0 if recovered else 1


if __name__ == "__main__":
    sys.exit(main())
