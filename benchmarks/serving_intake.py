"""The embedded server's per-request intake cost on the CPU, with the model replaced by the engine stand-in: TTFT when
64 requests arrive at once, c=64 throughput, and where each request's time goes inside the server.

What runs: ``trajflow serve`` over the stand-in (`benchmarks/standin_server.py`, as in `serving_overhead.py`), set as
the H200 run of issue 13 was: a decode step of 1.4 + 0.0085 x rows ms (1.94 ms at 64 rows, the merged + compiled
step measured there), overlapped decode steps and ``admission_wait_steps`` = 4 (the engine's CUDA defaults). The
client is `benchmarks/load_client.py` in ``--client-processes`` processes. Each round, after a warm-up wave:

- **arrival**: one wave of 64 streamed requests sent at once (fresh prompts): TTFT = send -> first chunk with a
  token, as `inference_vllm.py`'s streaming pass measures it;
- **c64**: 256 non-streamed requests from 64 closed-loop workers: output tok/s, latency.

For both, the server's own timeline of every request (`benchmarks/intake_clock.py`: arrival -> handed to the engine
-> prefill start/end -> engine done -> last byte written), as median milliseconds per phase; and the server's CPU
seconds per request. ``--repeat`` rounds; the summary gives medians over rounds.

    python benchmarks/serving_intake.py --repeat 3 --out /tmp/intake.json [--label after]
    python benchmarks/serving_intake.py --table RUN.json ...   # one markdown row per run, and medians per label
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_standin import StandInTiming
from benchmarks.intake_clock import summary as timeline
from benchmarks.load_client import ADAPTER, Load, closed_loop, default_processes, quantiles

H200_MERGED = StandInTiming(decode_base_ms=1.4)
CUDA_DEFAULTS = {"admission_wait_steps": "4"}


async def one_pass(url: str, load: Load, phase: str, total: int, vocab: int, stream: bool, processes: int,
                   profile: Path | None = None) -> dict:
    """One pass; with `profile`, the server's event loop under cProfile during it (stats written there)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await http.get("/bench/intake")  # forget the records of what ran before
        before = (await http.get("/bench/stats")).json()
        if profile:
            await http.post("/bench/profile", params={"path": str(profile)})
        latencies, ttfts, tokens, wall = await closed_loop(url, load, phase, total, vocab, True, stream, processes)
        if profile:
            await http.post("/bench/profile", params={"path": str(profile)})
        after = (await http.get("/bench/stats")).json()
        records = (await http.get("/bench/intake")).json()
    cpu = after["process_cpu_s"] - before["process_cpu_s"]
    return {"tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 4), "latency_s": quantiles(latencies),
            "ttft_s": quantiles(ttfts), "server_cpu_ms_per_request": round(1000 * cpu / total, 3),
            "server": timeline(records)}


COLUMNS = (("TTFT p50 s (64 at once)", ("ttft_p50_s_arrival64",)), ("c64 tok/s", ("tok_s_c64",)),
           ("c64 latency p50 s", ("latency_p50_s_c64",)),
           ("server CPU ms / request", ("server_cpu_ms_per_request_c64",)),
           ("wave: parse / admission wait / prefill / to first write ms",
            tuple(("arrival_server_median_ms", k) for k in ("parse", "admission_wait", "prefill", "first_write"))),
           ("c64: parse / admission wait / prefill / answer ms",
            tuple(("c64_server_median_ms", k) for k in ("parse", "admission_wait", "prefill", "answer"))))


def table(reports: list[dict]) -> str:
    """Markdown: one row per run (its medians over rounds), then the median of the runs of each label."""
    def cell(summary: dict, keys) -> str:
        values = []
        for key in keys:
            v = summary
            for k in key if isinstance(key, tuple) else (key,):
                v = (v or {}).get(k)
            values.append("-" if v is None else f"{v:g}")
        return " / ".join(values)

    def median_summary(group: list[dict]) -> dict:
        out: dict = {}
        for _, keys in COLUMNS:
            for key in keys:
                path = key if isinstance(key, tuple) else (key,)
                values = []
                for r in group:
                    v = r["summary"]
                    for k in path:
                        v = (v or {}).get(k)
                    if v is not None:
                        values.append(v)
                target = out
                for k in path[:-1]:
                    target = target.setdefault(k, {})
                target[path[-1]] = round(statistics.median(values), 4) if values else None
        return out

    head = "| run | " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [head, "|---" * (len(COLUMNS) + 1) + "|"]
    for r in reports:
        lines.append(f"| {r['label']} ({r['date'][11:16]}) | " + " | ".join(cell(r["summary"], k) for _, k in COLUMNS)
                     + " |")
    for label in dict.fromkeys(r["label"] for r in reports):
        group = [r for r in reports if r["label"] == label]
        med = median_summary(group)
        lines.append(f"| **{label}: median of {len(group)}** | " + " | ".join(cell(med, k) for _, k in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", type=Path, nargs="+", default=None, help="print a markdown table of these runs, exit")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--client-processes", type=int, default=None, help="default: load_client.default_processes")
    ap.add_argument("--profile", type=Path, default=None, help="folder: cProfile the server's event loop in the last "
                                                                "round (arrival.prof, c64.prof)")
    ap.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                    help="engine settings beside the CUDA defaults set here (repeatable)")
    args = ap.parse_args(argv)
    if args.table:
        print(table([json.loads(p.read_text()) for p in args.table]))
        return 0
    if args.out is None:
        ap.error("--out is required")
    from backends.serving.inference_client import InferenceClient
    from benchmarks.inference import hardware, versions
    from benchmarks.inference_vllm import parse_settings
    from benchmarks.serving_overhead import build_folder, start_server

    settings = {**CUDA_DEFAULTS, **parse_settings(",".join(args.engine))}
    load = Load("c64", 64, 256, 128, 128)
    processes = args.client_processes or default_processes(load.concurrency)
    work = Path(tempfile.mkdtemp(prefix="serving-intake-"))
    folder, adapter, facts = build_folder(work, "smollm2")
    vocab = facts["tokenizer_vocab"]
    server = start_server(folder, H200_MERGED, work / "server.log", overlap_decode="on", engine=settings)
    rounds = []
    try:
        server.wait_healthy(300)
        asyncio.run(InferenceClient(server.url).load_adapter(ADAPTER, str(adapter)))
        asyncio.run(closed_loop(server.url, load, "warmup", load.concurrency, vocab, True, False, processes))
        for i in range(args.repeat):
            profile = args.profile if args.profile and i == args.repeat - 1 else None
            if profile:
                profile.mkdir(parents=True, exist_ok=True)
            arrival = asyncio.run(one_pass(server.url, load, f"arrival{i}", load.concurrency, vocab, True, processes,
                                           profile and profile.resolve() / "arrival.prof"))
            c64 = asyncio.run(one_pass(server.url, load, f"timed{i}", load.requests, vocab, False, processes,
                                       profile and profile.resolve() / "c64.prof"))
            rounds.append({"arrival": arrival, "c64": c64})
            print(json.dumps({"round": i, "ttft_p50_s": arrival["ttft_s"]["p50"], "c64_tok_s": c64["tokens_per_s"],
                              "arrival_server_ms": arrival["server"]["median_ms"],
                              "c64_server_ms": c64["server"]["median_ms"]}), flush=True)
    finally:
        server.stop()

    def med(*keys):
        values = []
        for r in rounds:
            v = r
            for k in keys:
                v = v.get(k, {}) if isinstance(v, dict) else None
            if isinstance(v, (int, float)):
                values.append(v)
        return round(statistics.median(values), 4) if values else None

    phases = [name for name in rounds[0]["c64"]["server"]["median_ms"]] if rounds else []
    report = {"benchmark": "benchmarks/serving_intake.py", "label": args.label,
              "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware("cpu"), "versions": versions(),
              "config": {**facts, "timing": asdict(H200_MERGED), "engine_settings": settings, "overlap_decode": "on",
                         "client_processes": processes, "load": asdict(load)},
              "summary": {"ttft_p50_s_arrival64": med("arrival", "ttft_s", "p50"),
                          "ttft_p95_s_arrival64": med("arrival", "ttft_s", "p95"),
                          "tok_s_c64": med("c64", "tokens_per_s"), "latency_p50_s_c64": med("c64", "latency_s", "p50"),
                          "server_cpu_ms_per_request_c64": med("c64", "server_cpu_ms_per_request"),
                          "arrival_server_median_ms": {p: med("arrival", "server", "median_ms", p) for p in phases},
                          "c64_server_median_ms": {p: med("c64", "server", "median_ms", p) for p in phases},
                          "arrival_spread_ms": {k: med("arrival", "server", f"{k}_spread_ms")
                                                for k in ("arrival", "admit", "first_write")},
                          "arrival_admissions": med("arrival", "server", "admissions")},
              "rounds": rounds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
