"""The load client's ceiling: `benchmarks/load_client.py` against a server that answers at once
(`benchmarks/instant_server.py`), at c=64 with 128 prompt + 128 new tokens, non-streamed and streamed, in 1 or more
client processes.

The instant server replays answers recorded from the embedded server (over the engine stand-in, the SmolLM2
tokenizer: the same bytes a real pass reads), so what limits a pass is the client: its tok/s is the most any server
can show with that client, and its TTFT when 64 requests are sent at once is what the client alone adds to a
server's. Passes as `benchmarks/inference_vllm.py` makes them: the non-streamed pass is `requests` requests from 64
closed-loop workers, the streamed pass one wave of 64.

    python benchmarks/client_ceiling.py --processes 1,2,4 --repeat 3 --out benchmarks/results/client-ceiling-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_standin import StandInTiming
from benchmarks.load_client import ADAPTER, Load, body_for, closed_loop, quantiles


def record(folder: Path, adapter: Path, vocab: int, load: Load, work: Path) -> tuple[Path, Path]:
    """One non-streamed and one streamed answer of the embedded server (stand-in engine), saved as bytes."""
    import httpx

    from backends.serving.inference_client import InferenceClient
    from benchmarks.serving_overhead import start_server

    server = start_server(folder, StandInTiming(), work / "server.log")
    try:
        server.wait_healthy(300)
        asyncio.run(InferenceClient(server.url).load_adapter(ADAPTER, str(adapter)))
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answer = http.post("/v1/completions", json=body_for(load, "record", 0, vocab, True, False)).content
            stream = http.post("/v1/completions", json=body_for(load, "record", 1, vocab, True, True)).content
    finally:
        server.stop()
    paths = work / "answer.json", work / "stream.sse"
    paths[0].write_bytes(answer)
    paths[1].write_bytes(stream)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--processes", default="1,2,4", help="client process counts to measure")
    ap.add_argument("--repeat", type=int, default=3, help="passes per process count and kind (median reported)")
    ap.add_argument("--requests", type=int, default=256)
    args = ap.parse_args(argv)
    from benchmarks.inference import hardware, versions
    from backends.serving.managed_process import free_port
    from benchmarks.serving_overhead import build_folder

    work = Path(tempfile.mkdtemp(prefix="client-ceiling-"))
    folder, adapter, facts = build_folder(work, "smollm2")
    vocab = facts["tokenizer_vocab"]
    load = Load("c64", 64, args.requests, 128, 128)
    answer, stream = record(folder, adapter, vocab, load, work)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.instant_server", "--port", str(port), "--answer",
                               str(answer), "--stream", str(stream)], cwd=REPO)
    rows = []
    try:
        time.sleep(1.0)
        for processes in [int(x) for x in args.processes.split(",")]:
            for kind in ("plain", "stream"):
                total = load.requests if kind == "plain" else load.concurrency
                passes = []
                for i in range(args.repeat):
                    latencies, ttfts, tokens, wall = asyncio.run(closed_loop(
                        url, load, f"{kind}{i}", total, vocab, True, kind == "stream", processes))
                    passes.append({"tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 4),
                                   "latency_s": quantiles(latencies), "ttft_s": quantiles(ttfts)})
                row = {"processes": processes, "kind": kind, "requests": total, "passes": passes,
                       "median_tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes)}
                if kind == "stream":
                    row["median_ttft_p50_s"] = statistics.median(p["ttft_s"]["p50"] for p in passes)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "passes"}), flush=True)
    finally:
        server.terminate()
        server.wait(10)
    report = {"benchmark": "benchmarks/client_ceiling.py",
              "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware("cpu"), "versions": versions(),
              "load": {"concurrency": load.concurrency, "prompt_tokens": load.prompt_tokens,
                       "new_tokens": load.new_tokens, "answer_bytes": answer.stat().st_size,
                       "stream_bytes": stream.stat().st_size},
              "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
