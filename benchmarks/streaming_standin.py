"""Streamed against non-streamed answers of the embedded server on the CPU, the model replaced by the engine stand-in
(`benchmarks/engine_standin.py`): HTTP c=64, 128 prompt + 128 new tokens, ``/v1/completions``.

The same server, client and stand-in as `benchmarks/serving_overhead.py` (its `build_folder` and `start_server`,
`benchmarks/inference_vllm.py`'s closed loop); after a warm-up wave, passes of 128 requests alternate non-streamed,
streamed, non-streamed, streamed. Printed per pass: output tok/s, latency, and for streamed passes TTFT (send -> the
first chunk that carries a token).

    python benchmarks/streaming_standin.py [REPO]   # REPO: the checkout whose server runs (default: this one)
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_standin import StandInTiming
from benchmarks.inference_vllm import ADAPTER, Load, closed_loop, quantiles
from benchmarks.serving_overhead import build_folder, start_server


def main() -> None:
    from backends.serving.inference_client import InferenceClient

    work = Path(tempfile.mkdtemp(prefix="streaming-standin-"))
    folder, adapter, facts = build_folder(work, "smollm2")
    vocab = facts["tokenizer_vocab"]
    server = start_server(folder, StandInTiming(), work / "server.log")
    try:
        server.wait_healthy(300)
        asyncio.run(InferenceClient(server.url).load_adapter(ADAPTER, str(adapter)))
        load = Load("c64", 64, 128, 128, 128)
        asyncio.run(closed_loop(server.url, load, "warmup", load.concurrency, vocab, True, False))
        for i, stream in enumerate((False, True, False, True)):
            latency, ttft, tokens, wall = asyncio.run(closed_loop(server.url, load, f"pass{i}", load.requests, vocab,
                                                                  True, stream))
            print(json.dumps({"stream": stream, "tokens_per_s": round(tokens / wall, 1),
                              "latency_s": quantiles(latency), "ttft_s": quantiles(ttft) if ttft else None}),
                  flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
