"""The embedded server's own CPU cost per token and per request, on the CPU, with the model replaced by a stand-in.

Why: on the H200 the engine alone gives ~13,000 tok/s at 64 concurrent sequences, through HTTP 7,700-8,300
(`benchmarks/results/inference-vllm-h200.md`): the difference is host work between the engine and the client.
That work is CPU work, so it can be measured (and cut) without a GPU: the engine stand-in
(`benchmarks/engine_standin.py`) keeps the real engine's host side and sleeps a GPU-like time per step instead of
running the model, so what is left to measure is the server's own cost.

What runs:

- The server: ``trajflow serve`` (`flows.cli serve`: the same uvicorn, app, tokenizer pool and engine thread) in a
  subprocess, through `benchmarks/standin_server.py`, which swaps in the stand-in and adds ``/bench/stats``.
  Model folder: a tiny random Qwen2 with a real tokenizer (SmolLM2's 49,152-token BPE by default, `--tokenizer
  tiny` for tiny-random's), and a random rank-16 LoRA loaded through ``/v1/load_lora_adapter`` as ``policy@1``.
- The client: `benchmarks/inference_vllm.py`'s own closed loop (httpx.AsyncClient, ``/v1/completions`` with token-id
  prompts, a seed per request, ``logprobs: 0``, ``return_token_ids``, ``return_tokens_as_token_ids``,
  ``ignore_eos``), in this process.
- Loads: c = 64 and c = 256 closed-loop clients with 128 prompt + 128 new tokens, and the GRPO shape (64 prompts of
  512 tokens, n = 16); each after a warm-up wave.
- Reference without HTTP: the same stand-in engine in this process, driven by `Engine.generate` from one event loop
  at the same concurrency (what the H200's 13,000 tok/s "in-process" figure is to its HTTP figure).

Reported per load: output tok/s over HTTP, in-process, and the stand-in's ceiling (back-to-back decode steps of the
load's batch, no host work); the server's CPU seconds per 1,000 output tokens (whole process, and by thread: event
loop, engine thread, tokenizer pool, others); the event loop's lag (how late a 5 ms timer wakes); the engine's
host time per decode step (its decode-loop wall time minus the stand-in's device time: bookkeeping plus waits for
the GIL, as far as they are not hidden behind a step: `--overlap-decode on`); the mean rows per decode step (how
full the batch is kept); the client's CPU seconds (it shares the machine).

    python benchmarks/serving_overhead.py --out benchmarks/results/serving-overhead-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_standin import StandInTiming, install
from benchmarks.inference import hardware, random_lora, versions
from benchmarks.inference_vllm import (
    ADAPTER,
    SERVED,
    EmbeddedServer,
    Load,
    chosen_settings,
    closed_loop,
    log_tail,
    parse_settings,
    prompt_ids,
    quantiles,
)

MAX_BATCH = 256
MAX_SEQ_LEN = 1024


def loads(quick: bool) -> list[Load]:
    if quick:
        return [Load("c64", 64, 128, 128, 128), Load("c256", 256, 256, 128, 128)]
    return [Load("c64", 64, 256, 128, 128), Load("c256", 256, 512, 128, 128),
            Load("grpo", 64, 64, 512, 128, n=16, warmup_requests=16)]


def build_folder(root: Path, tokenizer: str) -> tuple[Path, Path, dict]:
    """(model folder, adapter folder, facts): tiny random Qwen2 weights with the chosen real tokenizer."""
    from transformers import AutoTokenizer

    from backends.modeling.loading import build_tiny_model, build_tiny_tokenizer, ensure_smollm2

    tok = build_tiny_tokenizer() if tokenizer == "tiny" else AutoTokenizer.from_pretrained(ensure_smollm2())
    model = build_tiny_model(tok)
    folder, adapter = root / f"standin-{tokenizer}", root / "policy-lora"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    random_lora(model, 16, adapter)
    return folder, adapter, {"tokenizer": tokenizer, "tokenizer_vocab": len(tok), "lora_rank": 16}


def start_server(folder: Path, timing: StandInTiming, log: Path, keep_alive_s: float | None = None,
                 http: str | None = None, overlap_decode: str | None = None,
                 engine: dict[str, str] | None = None) -> EmbeddedServer:
    """`benchmarks/standin_server.py` (i.e. `trajflow serve` over the stand-in) in a subprocess."""
    extra = [x for k, v in asdict(timing).items() for x in ("--" + k.replace("_", "-"), str(v))]
    if overlap_decode is not None:
        extra += ["--overlap-decode", overlap_decode]
    if keep_alive_s is not None:
        extra += ["--keep-alive-s", str(keep_alive_s)]
    if http is not None:
        extra += ["--http", http]
    return EmbeddedServer(folder, "cpu", MAX_BATCH, MAX_SEQ_LEN, log,
                          launcher=("-m", "benchmarks.standin_server", *extra, "--"), engine=engine)


def client_cpu() -> float:
    t = os.times()
    return t.user + t.system


def derived(before: dict, after: dict, tokens: int, requests: int, wall: float, timing: StandInTiming,
            batch: int) -> dict:
    """The server-side figures of one timed pass from two `/bench/stats` snapshots."""
    per_k = 1000.0 / max(tokens, 1)
    roles = {k: round((after["threads_cpu_s"].get(k, 0.0) - before["threads_cpu_s"].get(k, 0.0)) * per_k, 4)
             for k in after["threads_cpu_s"]}
    cpu = after["process_cpu_s"] - before["process_cpu_s"]
    steps = after["engine"]["decode_steps"] - before["engine"]["decode_steps"]
    step_s = after["engine"]["decode_seconds"] - before["engine"]["decode_seconds"]
    s = after["standin"]  # reset at the start of the pass
    return {
        "server_cpu_s_per_1k_tokens": round(cpu * per_k, 4),
        "server_cpu_s_per_1k_tokens_by_thread": roles,
        "server_cpu_ms_per_request": round(1000 * cpu / max(requests, 1), 3),
        "server_cpu_utilisation": round(cpu / wall, 3),
        "gc": {"collections": [a - b for a, b in zip(after["gc"]["collections"], before["gc"]["collections"])],
               "seconds": [round(a - b, 4) for a, b in zip(after["gc"]["seconds"], before["gc"]["seconds"])]},
        "event_loop_lag": after["lag"],
        "decode_steps": steps,
        "mean_rows_per_step": round(s["decode_rows"] / max(s["decode_steps"], 1), 1),
        "engine_host_ms_per_step": round(1000 * (step_s - s["decode_device_s"]) / max(steps, 1), 3),
        "engine_wait_ms_per_step": round(1000 * s["decode_wait_s"] / max(steps, 1), 3),
        "prefills": s["prefills"],
        "wall_fractions": {"decode_model": round(s["decode_device_s"] / wall, 3),
                           "prefill_model": round(s["prefill_device_s"] / wall, 3),
                           "decode_host": round((step_s - s["decode_device_s"]) / wall, 3),
                           "rest": round(1 - (step_s + s["prefill_device_s"]) / wall, 3)},
        "ceiling_tok_s": round(timing.ceiling_tok_s(batch), 1),
    }


class Profiler:
    """py-spy (all threads, raw collapsed stacks) on a process for the duration of a `with` block."""

    def __init__(self, py_spy: str | None, pid: int, out: Path | None, gil: bool = False):
        self.cmd = None if not (py_spy and out) else [py_spy, "record", "--pid", str(pid), "--threads", "--rate",
                                                       "250", "--format", "raw", "--output", str(out)]
        if self.cmd and gil:
            self.cmd.append("--gil")  # only the samples of the thread holding the GIL

    def __enter__(self):
        self.process = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) \
            if self.cmd else None
        time.sleep(0.5 if self.cmd else 0)  # py-spy attaches
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(30)


async def http_pass(url: str, load: Load, vocab: int, timing: StandInTiming, profiler: Profiler) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await closed_loop(url, load, "warmup", load.warmup_requests or load.concurrency, vocab, True, False)
        await http.post("/bench/reset")
        before = (await http.get("/bench/stats")).json()
        with profiler:
            c0 = client_cpu()
            latencies, _, tokens, wall = await closed_loop(url, load, "timed", load.requests, vocab, True, False)
            c1 = client_cpu()
        after = (await http.get("/bench/stats")).json()
    row = {"tokens_per_s": round(tokens / wall, 1), "output_tokens": tokens, "wall_s": round(wall, 3),
           "latency_s": quantiles(latencies), "client_cpu_s_per_1k_tokens": round((c1 - c0) * 1000 / tokens, 4)}
    row.update(derived(before, after, tokens, load.requests, wall, timing, min(MAX_BATCH, load.concurrency * load.n)))
    row["server"] = {"loop": after["loop"], "switch_interval_s": after["switch_interval_s"]}
    return row


async def inprocess_pass(engine, load: Load, vocab: int) -> dict:
    """The same closed loop straight into `Engine.generate` (no HTTP, no JSON, no tokenizer pool)."""
    from backends.inference.engine import SamplingParams

    async def run(phase: str, total: int) -> tuple[int, float]:
        queue, produced = list(range(total)), 0

        async def worker():
            nonlocal produced
            while queue:
                i = queue.pop(0)
                params = SamplingParams(max_tokens=load.new_tokens, seed=i, ignore_eos=True)
                out = await engine.generate(prompt_ids(load.name, phase, i, load.prompt_tokens, vocab), params,
                                            ADAPTER, load.n)
                produced += sum(len(c.token_ids) for c in out)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(min(load.concurrency, total))])
        return produced, time.perf_counter() - t0

    await run("warmup", load.warmup_requests or load.concurrency)
    counters = engine.standin["counters"]
    counters.reset()
    before, c0 = dict(engine.stats), client_cpu()
    tokens, wall = await run("timed", load.requests)
    cpu = client_cpu() - c0
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    step_s = engine.stats["decode_seconds"] - before["decode_seconds"]
    return {"tokens_per_s": round(tokens / wall, 1), "output_tokens": tokens, "wall_s": round(wall, 3),
            "process_cpu_s_per_1k_tokens": round(cpu * 1000 / tokens, 4),
            "engine_host_ms_per_step": round(1000 * (step_s - counters.decode_device_s) / max(steps, 1), 3),
            "engine_wait_ms_per_step": round(1000 * counters.decode_wait_s / max(steps, 1), 3),
            "mean_rows_per_step": round(counters.decode_rows / max(counters.decode_steps, 1), 1),
            "prefills": counters.prefills}


def exception_chain(e: BaseException) -> list[BaseException]:
    out = []
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def markdown(report: dict) -> str:
    text = _markdown(report)
    if report.get("baseline"):
        config = {**report["config"], "overlap_decode": report["baseline"].get("config", {}).get("overlap_decode")}
        base = {**report["baseline"], "config": config, "versions": report["versions"], "notes": []}
        text += "\n## Baseline: " + base["label"] + "\n\n" + _markdown(base).split("\n", 2)[2]
    return text


def _markdown(report: dict) -> str:
    t = report["config"]["timing"]
    lines = [f"# Embedded server overhead on the CPU (engine stand-in): {report['label']}", "",
             f"`{report['command']}`  ", f"{report['date']}; " + ", ".join(f"{k} {v}" for k, v in
                                                                         report["versions"].items() if v), "",
             (f"Machine: {report['hardware'].get('cpu_model')}, {report['hardware']['cpu_count']} cores, load "
             f"average at start {report['hardware']['load_average_at_start']} (shared with other work)."), "",
             "Summary: " + ", ".join(f"{k} = {v}" for k, v in report["summary"].items()), "",
             (f"Stand-in (`benchmarks/engine_standin.py`, benchmarks only): decode step {t['decode_base_ms']} + "
              f"{t['decode_per_row_ms']} x rows ms, prefill {t['prefill_base_ms']} + {t['prefill_per_token_ms']} x "
              f"padded tokens ms, waited for with the GIL released (decode steps queued like a CUDA stream); "
              f"overlap_decode {report['config'].get('overlap_decode') or 'default (off on the CPU)'}; the engine's "
              f"host side is real."), "",
             ("| load | c x n | HTTP tok/s | in-process tok/s | ceiling tok/s | server CPU s / 1k tok | by thread "
              "(loop / engine / pool / other) | CPU ms / request | loop lag p50 / p99 / max ms | engine host ms / "
              "step | rows / step | prefills | wall: decode / prefill / engine host / rest | latency p50 / p95 s |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['load']} | {r['concurrency']} x {r['n']} | failed: {r['error'][:300]} |"
                         + " |" * 11)
            continue
        h, p = r["http"], r.get("inprocess", {})
        by = h["server_cpu_s_per_1k_tokens_by_thread"]
        lag, lat = h["event_loop_lag"], h["latency_s"]
        lines.append(
            f"| {r['load']} | {r['concurrency']} x {r['n']} | {h['tokens_per_s']} | {p.get('tokens_per_s')} | "
            f"{h['ceiling_tok_s']} | {h['server_cpu_s_per_1k_tokens']} | {by.get('event_loop', 0)} / "
            f"{by.get('engine', 0)} / {by.get('tokenizer_pool', 0)} / "
            f"{round(by.get('other', 0) + by.get('native', 0), 4)} | {h['server_cpu_ms_per_request']} | "
            f"{lag.get('p50_ms')} / {lag.get('p99_ms')} / {lag.get('max_ms')} | {h['engine_host_ms_per_step']} | "
            f"{h['mean_rows_per_step']} | {h['prefills']} | {' / '.join(str(v) for v in h['wall_fractions'].values())} | "
            f"{lat.get('p50')} / {lat.get('p95')} |")
    repeats = report.get("c256_repeats") or []
    if repeats:
        failed = [r for r in repeats if not r["ok"]]
        lines += ["", f"c=256 x 1024 requests, {len(repeats)} runs: {len(failed)} failed"
                      + "".join(f"; {r['error'][:300]} after {r['after_s']} s" for r in failed)
                      + "; tok/s of the others: " + ", ".join(str(r["tokens_per_s"]) for r in repeats if r["ok"]), ""]
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    for name, err in report.get("errors", {}).items():
        lines += ["", f"{name} failed:", "", "```", err[-3000:], "```"]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> dict:
    def pick(load: str, *keys):
        row = next((r for r in rows if r["load"] == load and "error" not in r), None)
        for k in keys:
            row = (row or {}).get(k)
        return row

    s = {}
    for load in ("c64", "c256", "grpo"):
        s[f"http_tok_s_{load}"] = pick(load, "http", "tokens_per_s")
        s[f"inprocess_tok_s_{load}"] = pick(load, "inprocess", "tokens_per_s")
        s[f"server_cpu_s_per_1k_tokens_{load}"] = pick(load, "http", "server_cpu_s_per_1k_tokens")
        s[f"loop_lag_p99_ms_{load}"] = pick(load, "http", "event_loop_lag", "p99_ms")
    s["c256_error"] = pick("c256", "error") if any(r["load"] == "c256" and "error" in r for r in rows) else None
    return s


def compare(before: dict, after: dict) -> dict:
    """This run's summary with the baseline's beside it (`before_<key>`) and after/before ratios of tok/s."""
    out = dict(after)
    for key, value in before.items():
        out[f"before_{key}"] = value
        if key.startswith("http_tok_s_") and value and after.get(key):
            out[f"after_over_before_{key.removeprefix('http_tok_s_')}"] = round(after[key] / value, 3)
    return out


def repeats_summary(repeats: list[dict]) -> dict:
    return {"c256x1024_runs": len(repeats), "c256x1024_failed": sum(not r["ok"] for r in repeats)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results (a .md beside it)")
    ap.add_argument("--label", default="", help="what this run measures (e.g. 'before', 'after')")
    ap.add_argument("--tokenizer", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--quick", action="store_true", help="c64 and c256 only, fewer requests")
    ap.add_argument("--loads", default=None, help="comma-separated subset of the loads (c64,c256,grpo)")
    ap.add_argument("--no-inprocess", action="store_true", help="skip the in-process reference")
    ap.add_argument("--c256-repeats", type=int, default=0, help="then run c=256 x 1024 requests this many times "
                                                                  "and record every failure (the ReadError)")
    ap.add_argument("--keep-alive-s", type=float, default=None, help="the server's keep-alive timeout instead of its "
                                                                      "own (5 was uvicorn's default)")
    ap.add_argument("--http", choices=("h11", "httptools"), default=None, help="uvicorn's HTTP parser in the server "
                                                                                "(default: httptools when installed)")
    ap.add_argument("--overlap-decode", choices=("on", "off"), default=None, help="the engine's overlap_decode, "
                                                                                   "server and in-process (default: "
                                                                                   "the engine's: off on the CPU)")
    ap.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                    help="another engine setting, server and in-process (`trajflow serve --engine`; repeatable)")
    ap.add_argument("--baseline", type=Path, default=None, help="a run of this script on other code (e.g. main): its "
                                                                 "table and summary are shown beside this run's")
    ap.add_argument("--py-spy", default=None, help="py-spy executable: profile the server during each timed pass")
    ap.add_argument("--profile-client", action="store_true", help="with --py-spy: profile this process instead")
    ap.add_argument("--profile-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    for name, value in asdict(StandInTiming()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=value)
    args = ap.parse_args(argv)
    timing = StandInTiming(**{k: getattr(args, k) for k in asdict(StandInTiming())})
    chosen = [x for x in loads(args.quick) if not args.loads or x.name in args.loads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serving-overhead-"))
    folder, adapter, facts = build_folder(work, args.tokenizer)
    vocab = facts["tokenizer_vocab"]
    rows: list[dict] = []
    report = {"benchmark": "benchmarks/serving_overhead.py", "label": args.label,
              "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware("cpu"), "versions": versions(),
              "config": {**facts, "timing": asdict(timing), "max_batch_size": MAX_BATCH, "max_seq_len": MAX_SEQ_LEN,
                         "loads": [asdict(x) for x in chosen]},
              "summary": {}, "results": rows, "errors": {},
              "notes": [("The engine stand-in is a benchmark part (benchmarks/engine_standin.py), never in the "
                        "product: the model computation is a sleep, everything else is the real server."),
                        ("Server CPU s / 1k tok: CPU time of the whole server process (all threads) per 1,000 output "
                        "tokens; the engine thread's share is there in-process too."),
                        ("Wall fractions of the timed pass: the stand-in's decode device time, its prefill device "
                        "time, the engine's decode-loop time beyond the device's (host work not hidden behind a "
                        "step; all of it when decode steps do not overlap), and the rest (admission, idle waiting "
                        "for requests). Engine host ms / step is that decode-loop excess per step; the JSON's "
                        "engine_wait_ms_per_step is how long the engine thread blocked on a step's output."),
                        ("Ceiling: back-to-back decode steps of the load's batch with no host work; in-process: "
                        "Engine.generate from one event loop in the benchmark's process, no HTTP.")]}
    for name in ("httpx", "uvloop", "httptools", "orjson"):
        try:
            from importlib.metadata import version

            report["versions"][name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            report["versions"][name] = None

    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    if baseline:
        report["baseline"] = {k: baseline[k] for k in ("label", "command", "date", "summary", "results",
                                                       "c256_repeats", "hardware", "config") if k in baseline}

    def write() -> None:
        report["summary"] = {**summary(rows), **repeats_summary(report.get("c256_repeats") or [])}
        if baseline:
            report["summary"] = compare(baseline["summary"], report["summary"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))

    settings = parse_settings(",".join(args.engine))
    server = start_server(folder, timing, work / "server.log", args.keep_alive_s, args.http, args.overlap_decode,
                          settings)
    report["config"]["keep_alive_s"], report["config"]["http"] = args.keep_alive_s, args.http
    report["config"]["engine_settings"] = settings
    report["config"]["overlap_decode"] = args.overlap_decode
    report["config"]["server_command"] = server.command
    try:
        server.wait_healthy(300)
        from backends.serving.inference_client import InferenceClient

        asyncio.run(InferenceClient(server.url).load_adapter(ADAPTER, str(adapter)))
        for load in chosen:
            row = {"load": load.name, "concurrency": load.concurrency, "n": load.n, "requests": load.requests,
                   "prompt_tokens": load.prompt_tokens, "new_tokens": load.new_tokens}
            try:
                pid = os.getpid() if args.profile_client else server.process.pid
                stacks = args.out.parent / f"{args.out.stem}-{load.name}-{'client' if args.profile_client else 'server'}.txt"
                row["http"] = asyncio.run(http_pass(server.url, load, vocab, timing, Profiler(args.py_spy, pid, stacks, args.profile_gil)))
            except Exception as e:  # noqa: BLE001 - record it (the c=256 ReadError is a finding), go on
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                row["server_log_tail"] = log_tail(server.log, 20)
            rows.append(row)
            print(json.dumps(row), flush=True)
            write()
        report["c256_repeats"] = repeats = []
        for i in range(args.c256_repeats):
            load = Load("c256x1024", 256, 1024, 128, 128)
            t0 = time.perf_counter()
            try:
                _, _, tokens, wall = asyncio.run(closed_loop(server.url, load, f"repeat{i}", load.requests, vocab,
                                                             True, False))
                repeats.append({"ok": True, "tokens_per_s": round(tokens / wall, 1)})
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                repeats.append({"ok": False, "after_s": round(time.perf_counter() - t0, 1),
                                "error": " <- ".join(f"{type(x).__module__}.{type(x).__name__}({x})"
                                                     for x in exception_chain(e))})
            print(json.dumps(repeats[-1]), flush=True)
            write()
    finally:
        server.stop()
    if not args.no_inprocess:
        from backends.inference.engine import Engine, EngineConfig

        engine = Engine.from_pretrained(str(folder), served_name=SERVED,
                                        config=EngineConfig(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ_LEN,
                                                            overlap_decode=None if args.overlap_decode is None
                                                            else args.overlap_decode == "on",
                                                            **chosen_settings(settings)))
        install(engine, timing)
        try:
            engine.load_adapter(ADAPTER, str(adapter))
            for row, load in zip(rows, chosen):
                row["inprocess"] = asyncio.run(inprocess_pass(engine, load, vocab))
                print(json.dumps({"load": load.name, "inprocess": row["inprocess"]}), flush=True)
                write()
        finally:
            engine.shutdown()
    write()
    print(markdown(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
