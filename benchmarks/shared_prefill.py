"""Shared prefill (`backends.inference.prompt_sharing`): GRPO groups sent as n=1 requests, with and without sharing.

Workload: G groups of K requests, every request of a group with the group's prompt (~P tokens), all admitted in one
prefill (the prefill token budget is raised to hold them: the engine's budget counts every request's prompt, shared
or not), each with its own seed. Two modes in one process, alternated: ``shared`` (the engine as it is) and
``one-row-each`` (`prompt_sharing.one_row_each` in place of `share_rows`: what the engine did before). Per mode, the
median over --reps of:

- ``prefill_ms``: wall time of the admission with ``max_tokens=1`` (every request's one token is sampled from the
  prefill's logits, so this is the prefill, the KV copies and the sampling);
- ``end_to_end_ms``: wall time of the same requests with ``max_tokens=--new-tokens``;
- the engine's counters per run (prefills, prefill_tokens, shared_prefill_requests), and whether both modes gave
  the same tokens (same seeds).

CPU:  python benchmarks/shared_prefill.py --device cpu --model smollm2-135m --lora-rank 16 --prompt-tokens 256
      --groups 2 --group-size 8
GPU:  python benchmarks/shared_prefill.py --device cuda --model qwen2.5-0.5b-random --lora-rank 16 --prompt-tokens 1024
      --groups 4 --group-size 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.inference import hardware, load_served, prompts_for, random_lora, versions  # noqa: E402

COUNTERS = ("prefills", "prefill_tokens", "shared_prefill_requests")


def admit_together(engine, requests, model: str | None, timeout: float = 600) -> tuple[list, float]:
    """(completions per request, wall seconds) of `requests` [(prompt, params)] submitted in one admission: the
    engine's lock is held while they queue, so its thread sees them all at once."""
    results: list = [None] * len(requests)
    left = [len(requests)]
    done = threading.Event()

    def finished(i: int, result) -> None:  # called on the engine thread only
        results[i] = result
        left[0] -= 1
        if left[0] == 0:
            done.set()

    with engine._cv:
        for i, (prompt, params) in enumerate(requests):
            engine.submit(prompt, params, model, 1, on_done=lambda r, i=i: finished(i, r))
        t0 = time.perf_counter()
    if not done.wait(timeout):
        raise TimeoutError("the requests did not finish")
    wall = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random, qwen2.5-0.5b-random")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=0, help="serve a random LoRA of this rank as policy@1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON results file (default: print only)")
    args = ap.parse_args(argv)

    from backends.inference import engine as engine_module
    from backends.inference.engine import Engine, EngineConfig, SamplingParams
    from backends.inference.prompt_sharing import one_row_each, share_rows

    model, tok, name = load_served(args.model, args.device)
    total = args.groups * args.group_size
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for m in prompts_for(tok, args.groups, args.prompt_tokens)]
    budget = total * max(len(p) for p in prompts)
    engine = Engine(model, tok, name, EngineConfig(max_batch_size=max(total, 8), prefill_token_budget=budget))
    served = None
    if args.lora_rank:
        folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
        random_lora(model, args.lora_rank, folder)
        engine.load_adapter("policy@1", str(folder))
        served = "policy@1"

    def requests(new_tokens: int) -> list:
        return [(prompts[g], SamplingParams(max_tokens=new_tokens, seed=1000 * g + k, ignore_eos=True))
                for g in range(args.groups) for k in range(args.group_size)]

    modes = {"shared": share_rows, "one-row-each": one_row_each}
    times: dict[str, dict[str, list[float]]] = {m: {"prefill_ms": [], "end_to_end_ms": []} for m in modes}
    counters, tokens = {}, {}
    try:
        admit_together(engine, requests(args.new_tokens), served)  # warm-up: allocations, CUDA graph captures
        for _ in range(args.reps):
            for mode, rows in modes.items():
                engine_module.share_rows = rows
                before = {k: engine.stats[k] for k in COUNTERS}
                _, wall = admit_together(engine, requests(1), served)
                counters[mode] = {k: engine.stats[k] - before[k] for k in COUNTERS}
                times[mode]["prefill_ms"].append(wall * 1e3)
                done, wall = admit_together(engine, requests(args.new_tokens), served)
                times[mode]["end_to_end_ms"].append(wall * 1e3)
                tokens[mode] = [c[0].token_ids for c in done]
    finally:
        engine_module.share_rows = share_rows
        engine.shutdown()
    report = {
        "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "workload": {"model": name, "device": args.device, "lora_rank": args.lora_rank, "groups": args.groups,
                     "group_size": args.group_size, "prompt_tokens": [len(p) for p in prompts],
                     "new_tokens": args.new_tokens, "reps": args.reps},
        "results": {m: {**{k: round(statistics.median(v), 2) for k, v in times[m].items()},
                        "runs_ms": {k: [round(x, 2) for x in v] for k, v in times[m].items()},
                        "per_run": counters[m]} for m in modes},
        "same_tokens": tokens["shared"] == tokens["one-row-each"],
        "hardware": hardware(args.device), "versions": versions(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
