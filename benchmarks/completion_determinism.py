"""Plain and streamed answers of one multi-prompt text completion, compared exactly, many times over: how often the
embedded server gives different logprobs to the same request (the engine's rows batched differently between the two
runs move their float32 rounding).

Each round sends ``POST /v1/completions`` with --prompts token-id prompts, n = --n, seed and logprobs fixed, once
plain and once streamed, to ``trajflow serve``'s app in this process (`start_server`, tiny-random: offline); a round
counts as a mismatch when any choice's token ids or logprobs differ. ``--busy K`` runs K spinning processes beside
it (on a small CPU, the engine thread then runs at other times relative to the server's submissions). Prints one JSON
line: rounds, mismatches, the first mismatch's largest logprob difference, seconds.

CPU:  python benchmarks/completion_determinism.py --device cpu --rounds 200 --busy 1
GPU:  python benchmarks/completion_determinism.py --device cuda --rounds 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spin() -> None:
    while True:
        pass


async def one_round(client, body: dict) -> float | None:
    """None when the streamed answer equals the plain one; else the largest logprob difference (inf: other tokens)."""
    plain = await client.completions.create(**body)
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    async for chunk in await client.completions.create(**body, stream=True):
        for c in chunk.choices:
            ids.setdefault(c.index, []).extend((c.model_extra or {}).get("token_ids") or [])
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    worst = None
    for c in plain.choices:
        if ids[c.index] != c.model_extra["token_ids"]:
            return float("inf")
        if lps[c.index] != c.logprobs.token_logprobs:
            diff = max(abs(a - b) for a, b in zip(lps[c.index], c.logprobs.token_logprobs))
            worst = max(worst or 0.0, diff)
    return worst


async def run(base_url: str, args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    body = dict(model="tiny-random", prompt=[[5 + 3 * i, 6 + 3 * i, 7 + 3 * i, 8] for i in range(args.prompts)],
                n=args.n, max_tokens=args.max_tokens, seed=4, logprobs=2)
    t0 = time.perf_counter()
    diffs = [await one_round(client, body) for _ in range(args.rounds)]
    found = [d for d in diffs if d is not None]
    await client.close()
    return {"rounds": args.rounds, "mismatches": len(found), "first_max_logprob_diff": found[0] if found else None,
            "seconds": round(time.perf_counter() - t0, 1), "device": args.device, "busy": args.busy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=30)
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the server")
    args = ap.parse_args(argv)
    from backends.serving.app import start_server

    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    handle = start_server("tiny-random", device=args.device)
    try:
        print(json.dumps(asyncio.run(run(handle.base_url, args))))
    finally:
        handle.stop()
        for p in spinners:
            p.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
