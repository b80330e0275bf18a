"""CPU time of a rollout's client side in the flow process, per model call: what the trainer's GIL competes with.

The arithmetic agent's rollouts (configs/default.yaml's agent: one chat call each, 16 completion tokens) run as the
rollout task runs them (``rollout_context`` with the rollout's seed identity, 64 at once) against the instant stub
policy (``benchmarks/stub_policy.py``) in a separate process, so the process's CPU time is all client side: the agent,
the ``openai`` client, the policy transport, the aiohttp pool, answer parsing and the trajectory. Per run:

    cpu_ms_per_call    = process CPU time over the timed rollouts / chat calls made
    cpu_ms_per_rollout = process CPU time / rollouts

Clients measured, each in a fresh process, alternating over ``--rounds`` (the machine may be shared):

- ``policy_client``: ``agents.client.policy_client``, what rollouts use;
- ``openai_create``: openai's own ``AsyncOpenAI`` over the same transports (policy + aiohttp pool): the client as
  it was before ``agents/chat_create.py``, with the transport's orjson;
- ``before``: ``policy_client`` of another checkout (``--before DIR``, e.g. ``git archive`` of an earlier commit).

``--profile`` runs one more ``policy_client`` pass (and an ``openai_create`` one) under cProfile and keeps the self
time per area (openai's parameter transform, its response models, httpx, aiohttp, our transport, the trajectory...).

    .venv/bin/python benchmarks/rollout_client_cpu.py --before /tmp/base --profile \\
        --out benchmarks/results/rollout-client-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = 64
PROMPT_TOKENS, COMPLETION_TOKENS = 100, 16  # the arithmetic prompt (system, three worked examples, question)

# Self time per area, first match wins (paths as cProfile reports them).
AREAS = (
    ("openai parameter transform", ("openai/_utils/_transform", "openai/_utils/_typing", "typing.py")),
    ("openai response models", ("openai/_models", "openai/_response", "openai/_legacy_response", "pydantic")),
    ("openai client (request, retries)", ("openai/",)),
    ("httpx / httpx2", ("httpx/", "httpx2/", "http/cookiejar", "urllib/")),
    ("aiohttp", ("aiohttp/", "yarl/", "multidict/")),
    ("policy transport + JSON", ("agents/client.py", "agents/json_codec.py", "agents/aiohttp_transport.py",
                                 "agents/chat_create.py", "json/", "orjson")),
    ("trajectory + agent", ("agents/",)),
    ("asyncio", ("asyncio/",)),
)


def start_stub() -> tuple[subprocess.Popen, str]:
    code = ("import sys, time; sys.path.insert(0, %r); from benchmarks.stub_policy import StubPolicyServer; "
            "s = StubPolicyServer(tokens=%d, prompt_tokens=%d); print(s.base_url, flush=True); time.sleep(1e6)"
            % (str(REPO), COMPLETION_TOKENS, PROMPT_TOKENS))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def measure(base_url: str, client_kind: str, rollouts: int, profile: str | None) -> dict:
    """In this process (its sys.path picks the code): run `rollouts` arithmetic rollouts, return CPU per call."""
    import httpx
    from openai import AsyncOpenAI

    from agents.aiohttp_transport import AiohttpTransport
    from agents.client import PolicyTransport, policy_client, rollout_context, rollout_seed_material, shared_ssl_context
    from agents.examples.arithmetic import ArithmeticAgent

    agent = ArithmeticAgent()
    scenarios = agent.scenarios("train", 0)

    async def run() -> dict:
        if client_kind == "openai_create":
            transport = PolicyTransport(AiohttpTransport(1024, shared_ssl_context()))
            client = AsyncOpenAI(base_url=base_url, api_key="EMPTY",
                                 http_client=httpx.AsyncClient(transport=transport, verify=shared_ssl_context()))
        else:
            client = policy_client(base_url)
        sem = asyncio.Semaphore(CONCURRENCY)
        calls = 0

        async def one(i: int):
            nonlocal calls
            scenario = scenarios[i % len(scenarios)]
            async with sem:
                with rollout_context(rollout_seed_material("bench", 1, scenario.id, i)) as ctx:
                    traj = await agent.rollout(client, "stub@1", scenario)
                calls += ctx.calls
                return traj

        await asyncio.gather(*(one(i) for i in range(CONCURRENCY)))  # connections and caches warm
        calls = 0
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        cpu, wall = time.process_time(), time.perf_counter()
        trajs = await asyncio.gather(*(one(i) for i in range(rollouts)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        await client.close()
        assert all(t.messages_and_choices[-1].trainable for t in trajs)
        return {"rollouts": rollouts, "calls": calls, "cpu_s": round(cpu, 4), "wall_s": round(wall, 4),
                "cpu_ms_per_call": round(1000 * cpu / calls, 4), "cpu_ms_per_rollout": round(1000 * cpu / rollouts, 4)}

    return asyncio.run(run())


def areas(profile_path: str) -> dict:
    """Self time per area (AREAS) as a share of the profiled total; a builtin's time (``isinstance``, a dict method)
    goes to the areas of its callers, in proportion to the time each caller spent in it."""
    import pstats

    stats = pstats.Stats(profile_path).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}

    def area(filename: str) -> str | None:
        if filename == "~" or filename.startswith("<"):
            return None
        return next((name for name, keys in AREAS if any(k in filename for k in keys)), "other")

    totals: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, callers) in stats.items():
        own = area(filename)
        if own is not None:
            totals[own] = totals.get(own, 0.0) + tottime
            continue
        spread = sum(tt for _, _, tt, _ in callers.values()) or 1.0
        for (caller_file, _, _), (_, _, tt, _) in callers.items():
            name = area(caller_file) or "other"
            totals[name] = totals.get(name, 0.0) + tottime * tt / spread
    whole = sum(totals.values()) or 1.0
    return {k: round(v / whole, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def child(args) -> None:
    sys.path.insert(0, args.code or str(REPO))
    print(json.dumps(measure(args.url, args.client, args.rollouts, args.profile_to)))


def run_child(url: str, kind: str, code: str | None, rollouts: int, profile: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--url", url, "--client", kind, "--rollouts", str(rollouts),
           *(["--code", code] if code else []), *(["--profile-to", profile] if profile else [])]
    env = {**os.environ, "PYTHONPATH": code or str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code or REPO, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("openai", "httpx", "aiohttp", "pydantic", "orjson")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2048, help="timed rollouts per run (one call each)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each client, alternating")
    parser.add_argument("--before", help="a checkout of earlier code whose policy_client is measured as 'before'")
    parser.add_argument("--before-label", default="", help="what --before is (e.g. its commit), kept in the JSON")
    parser.add_argument("--profile", action="store_true", help="one profiled run per client: self time per area")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--client", default="policy_client", help=argparse.SUPPRESS)
    parser.add_argument("--code", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    started = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_average": os.getloadavg()}
    stub, url = start_stub()
    kinds = [("policy_client", None), ("openai_create", None)] + ([("before", args.before)] if args.before else [])
    runs: dict[str, list[dict]] = {k: [] for k, _ in kinds}
    try:
        for _ in range(args.rounds):
            for kind, code in kinds:
                client = "policy_client" if kind == "before" else kind
                runs[kind].append(run_child(url, client, code, args.rollouts))
                print(kind, runs[kind][-1], flush=True)
        profiles = {}
        if args.profile:
            import tempfile

            for kind in ("policy_client", "openai_create"):
                path = os.path.join(tempfile.mkdtemp(), f"{kind}.prof")
                run_child(url, kind, None, args.rollouts, profile=path)
                profiles[kind] = areas(path)
    finally:
        stub.kill()

    summary = {kind: {"cpu_ms_per_call_median": statistics.median(r["cpu_ms_per_call"] for r in rs),
                      "cpu_ms_per_call_min": min(r["cpu_ms_per_call"] for r in rs),
                      "cpu_ms_per_rollout_median": statistics.median(r["cpu_ms_per_rollout"] for r in rs)}
               for kind, rs in runs.items()}
    result = {"benchmark": "rollout_client_cpu", "agent": "arithmetic", "concurrency": CONCURRENCY,
              "prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "rollouts_per_run": args.rollouts,
              "rounds": args.rounds, "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                                 "cpus": os.cpu_count(), **started},
              "before": {"path": args.before, "label": args.before_label} if args.before else None,
              "versions": versions(), "summary": summary, "self_time_share": profiles, "runs": runs}
    print(json.dumps(summary, indent=2))
    if profiles:
        print(json.dumps(profiles, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
