"""Overlapped decode (`EngineConfig.overlap_decode`) on a real device: same completions as the serial loop, and what
it gains, in one process.

What runs, in this order:

1. The model of `benchmarks/inference_vllm.py` (`build_model_folder`): Qwen2.5-0.5B's shape with random bf16 weights,
   tiny-random's tokenizer and a random rank-16 LoRA served as ``policy@1``; with ``--smoke`` tiny-random's shape on
   the CPU (rank 4).
2. Two fresh engines in this process, overlap off and on (nothing else differs; on CUDA both replay CUDA graphs).
   The check: a seeded mix of requests (`request_mix`) with different max_tokens, stop token ids and stop strings
   (placed where a probe run on the serial engine shows the model emits them), n > 1, top logprobs, top-p < 1,
   greedy rows, LoRA and base rows, run on each engine twice: arriving in waves, each wave submitted while the
   earlier ones decode (so the fresh overlapped engine captures new graph buckets, batch and attention length,
   between overlapped steps; counted), then all in one admission. Compared per completion: token ids and finish
   reasons (must be equal; the count of differing completions and the first differing position are reported),
   top-logprob ids, and the max |logprob difference|. On CUDA a step's batch bucket depends on arrival and on the
   overlapped step's extra rows, and bf16 rounds differently per bucket: logprobs differ a little, and a token may
   flip where a draw falls on a boundary; that is reported, not failed. On the CPU (eager, fp32) tokens must match.
   A third run, ``same_batches``, holds what CUDA can be held to: a mix whose sequences all end on length at the
   same step (no extra rows, so both engines replay the same graphs on the same rows) must give the very same
   tokens and logprobs on any device (the verdict line says whether it did).
3. Throughput, in-process (`Engine.generate` from one event loop, no HTTP), rounds of overlap off then on on the
   same two engines after one warm-up pass each (graph captures): c=64 closed-loop clients with 128 prompt + 128
   new tokens; the GRPO shape (64 prompts of 512 tokens at once, n = 16, 128 new); and the decode loop's period at
   batch 1 (``stats['decode_seconds'] / stats['decode_steps']`` over one request of 128 + 256 tokens: overlapped,
   that is the loop's period, the device's step hidden behind the host's work or the other way round). Medians over
   the rounds.

Writes ``--out`` (JSON: the check, every round, a ``summary``, hardware, versions, the command). Exits 1 when a
completion differs in tokens or finish reason on the CPU, or when a part failed.

H200, about 2 minutes. The image lacks pydantic (the engine's config): carry the three parts of `.whl-flow`
(`benchmarks/gpu/gather_wheels.py --list benchmarks/gpu/wheels-flow.txt --out .whl-flow`) and install them first:
    for p in .whl-flow/part-*; do python3 benchmarks/gpu/install_part.py $p --target /tmp/site; done
    PYTHONPATH=/tmp/site python3 benchmarks/overlap_check.py --out $OUT/overlap-check-h200.json
CPU check (tiny model, a few seconds; tests/unit/benchmarks/test_overlap_check.py runs it):
    python benchmarks/overlap_check.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.inference import closed_loop, hardware, versions
from benchmarks.inference_vllm import ADAPTER, SERVED, Load, build_model_folder, prompt_ids

SUMMARY_KEYS = ("equal_completions", "max_logprob_diff", "equal_completions_same_batches",
                "max_logprob_diff_same_batches", "tok_s_c64_off", "tok_s_c64_on", "tok_s_grpo_off", "tok_s_grpo_on",
                "decode_ms_batch1_off", "decode_ms_batch1_on")


def sizes(smoke: bool) -> dict:
    """Engine and workload sizes: the H200 run's, or the CPU smoke's."""
    if smoke:
        return {"max_batch": 16, "max_seq_len": 256, "lora_rank": 4, "mix_requests": 16, "mix_max_tokens": 24,
                "same_length_tokens": 20,
                "waves": 3, "loads": [Load("c64", 4, 8, 16, 8), Load("grpo", 4, 4, 32, 8, n=4)],
                "batch1": Load("batch1", 1, 1, 16, 16)}
    return {"max_batch": 256, "max_seq_len": 1024, "lora_rank": 16, "mix_requests": 48, "mix_max_tokens": 300,
            "same_length_tokens": 200,
            "waves": 4, "loads": [Load("c64", 64, 256, 128, 128), Load("grpo", 64, 64, 512, 128, n=16,
                                                                           warmup_requests=16)],
            "batch1": Load("batch1", 1, 1, 128, 256)}


# -- the check ---------------------------------------------------------------------------------------------------------
MIXED_KINDS = ("length", "stop_token", "stop_string", "n3_top_p_top_logprobs", "greedy_n2_top_logprobs", "eos",
               "one_token", "top_p_stop_token")
# every sequence ends on length at the same step: no overlapped extra rows, the same batches with overlap off and on
SAME_LENGTH_KINDS = ("length", "n3_top_p_top_logprobs", "greedy_n2_top_logprobs", "top_p")


def request_mix(engine, vocab: int, count: int, max_tokens: int, same_length: bool = False) -> list[dict]:
    """`count` seeded requests cycling through `MIXED_KINDS` (`SAME_LENGTH_KINDS`, all `max_tokens` long, with
    `same_length`), LoRA on every other one, prompts of 3-40 tokens: {prompt, params, model, n, kind}.

    Stops come from a probe of the same request (without stops) on `engine`: a stop token id drawn from its tokens,
    a stop string cut from its text. Tiny-random's tokenizer decodes only ids < 512, so on the 0.5B shape's
    151,936-token vocab a random model's text has a character every ~300 tokens: the stop-string requests run to
    `max_tokens` (most of them get some text), and one whose probe has none gets no stop string."""
    from backends.inference.engine import SamplingParams

    rng = random.Random(int(same_length))
    kinds = SAME_LENGTH_KINDS if same_length else MIXED_KINDS
    mix = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        longest = max_tokens if same_length else {"one_token": 1, "stop_string": max_tokens}.get(
            kind, rng.randint(2, max_tokens))
        p = SamplingParams(max_tokens=longest, seed=1000 + i, ignore_eos=kind != "eos")
        n = {"n3_top_p_top_logprobs": 3, "greedy_n2_top_logprobs": 2}.get(kind, 1)
        if kind == "n3_top_p_top_logprobs":
            p.temperature, p.top_p, p.top_logprobs = 0.8, 0.9, 2
        elif kind == "greedy_n2_top_logprobs":
            p.temperature, p.top_logprobs = 0.0, 3
        elif kind.startswith("top_p"):
            p.top_p = 0.5
        prompt = prompt_ids("same" if same_length else "mix", "check", i, rng.randint(3, 40), vocab)
        mix.append({"prompt": prompt, "params": p, "model": ADAPTER if i % 2 else None, "n": n, "kind": kind})
    probes = [(i, r) for i, r in enumerate(mix) if "stop" in r["kind"]]

    async def probe_all():
        return await asyncio.gather(*[engine.generate(r["prompt"], r["params"], r["model"]) for _, r in probes])

    for (_, r), (got,) in zip(probes, asyncio.run(probe_all())):
        if "token" in r["kind"] and len(got.token_ids) > 1:
            r["params"].stop_token_ids = [got.token_ids[rng.randrange(1, len(got.token_ids))]]
        text = got.text.strip()
        if r["kind"] == "stop_string" and text:
            at = rng.randrange(len(text) // 2, len(text))
            r["params"].stop = [text[at: at + 2]]
    return mix


async def arrive(engine, mix: list[dict], waves: int) -> list:
    """Submit `mix` in `waves` parts: the first in one admission (the engine's lock held while they queue), each
    later one once the engine has run 3 more decode steps (admitted mid-decode) or has nothing left to run; the
    completions, in `mix` order."""
    parts = [mix[w::waves] for w in range(waves)]
    jobs = {}
    for w, part in enumerate(parts):
        steps = engine.stats["decode_steps"]
        while w and engine.stats["decode_steps"] <= steps + 2 and not all(j.done() for j in jobs.values()):
            await asyncio.sleep(0.0005)
        with engine._cv:
            for r in part:
                jobs[id(r)] = asyncio.ensure_future(engine.generate(r["prompt"], r["params"], r["model"], r["n"]))
            await asyncio.sleep(0)
    return await asyncio.wait_for(asyncio.gather(*[jobs[id(r)] for r in mix]), 600)


def compare(mix: list[dict], off: list, on: list) -> dict:
    """Completions of the serial (`off`) and overlapped (`on`) engine: what differs, and where first."""
    differing, first, max_diff, top_ids_differ, reasons = 0, None, 0.0, 0, {}
    for i, (r, a_all, b_all) in enumerate(zip(mix, off, on)):
        for choice, (a, b) in enumerate(zip(a_all, b_all)):
            reason = f"{a.finish_reason}:{type(a.stop_reason).__name__}"  # stop:int a token, stop:str a string
            reasons[reason] = reasons.get(reason, 0) + 1
            same = min(len(a.token_ids), len(b.token_ids))
            at = next((t for t in range(same) if a.token_ids[t] != b.token_ids[t]), same)
            if (a.token_ids, a.finish_reason, a.stop_reason) != (b.token_ids, b.finish_reason, b.stop_reason):
                differing += 1
                if first is None:
                    # a draw that rounding moved across a boundary of the vocab-order CDF picks a neighbouring id
                    first = {"request": i, "kind": r["kind"], "choice": choice, "token_index": at, **{
                        name: {"tokens": len(c.token_ids), "finish": c.finish_reason,
                               "token_there": c.token_ids[at] if at < len(c.token_ids) else None,
                               "logprob_there": c.logprobs[at] if at < len(c.token_ids) else None}
                        for name, c in (("off", a), ("on", b))}}
            max_diff = max([max_diff, *(abs(x - y) for x, y in zip(a.logprobs[:at], b.logprobs[:at]))])
            ids = [[[t for t, _ in top] for top in (c.top_logprobs or [])[:at]] for c in (a, b)]
            top_ids_differ += ids[0] != ids[1]
    return {"completions": sum(len(x) for x in off), "differing_completions": differing, "first_difference": first,
            "max_logprob_diff": max_diff, "differing_top_logprob_ids": top_ids_differ, "finish_reasons": reasons}


def count_captures_in_flight(engine) -> dict:
    """Count the graph captures `engine` makes while a decode step of its is in flight (overlapped: step t+1's graph
    captured while step t runs); {"in_flight": count}, kept up to date."""
    counts = {"in_flight": 0}
    capture = engine.step._capture

    def counted(key):
        counts["in_flight"] += engine._inflight is not None
        return capture(key)

    engine.step._capture = counted
    return counts


def check(engines: dict, mix: list[dict], same_length: list[dict], waves: int) -> dict:
    """`mix` on each engine in waves and in one admission, `same_length` in one admission; compared off vs on."""
    out = {}
    in_flight = {overlap: count_captures_in_flight(engine) for overlap, engine in engines.items()}
    # waves first: fresh graphs captured mid-run
    for name, requests, parts in (("waves", mix, waves), ("one_admission", mix, 1), ("same_batches", same_length, 1)):
        runs, captures = {}, {}
        for overlap, engine in engines.items():
            before, before_in_flight = engine.step.captures, in_flight[overlap]["in_flight"]
            runs[overlap] = asyncio.run(arrive(engine, requests, parts))
            captures["on" if overlap else "off"] = engine.step.captures - before
            captures[f"{'on' if overlap else 'off'}_with_a_step_in_flight"] = (in_flight[overlap]["in_flight"] -
                                                                               before_in_flight)
        out[name] = {**compare(requests, runs[False], runs[True]), "waves": parts, "graph_captures": captures}
        print(json.dumps({"check": name, **out[name]}), flush=True)
    return out


# -- throughput --------------------------------------------------------------------------------------------------------
def closed_loop_pass(engine, load: Load, vocab: int, phase: str, total: int) -> dict:
    """`load.concurrency` clients in a closed loop straight into `Engine.generate`, `total` requests."""
    from backends.inference.engine import SamplingParams

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=load.new_tokens, seed=i, ignore_eos=True)
        out = await engine.generate(prompt_ids(load.name, phase, i, load.prompt_tokens, vocab), params, ADAPTER,
                                    load.n)
        return sum(len(c.token_ids) for c in out)

    steps, seconds, captures = engine.stats["decode_steps"], engine.stats["decode_seconds"], engine.step.captures
    _, tokens, wall = asyncio.run(closed_loop(load.concurrency, total, one))
    steps = engine.stats["decode_steps"] - steps
    return {"tokens_per_s": round(tokens / wall, 1), "output_tokens": tokens, "wall_s": round(wall, 3),
            "decode_steps": steps, "rows_per_step": round(tokens / max(steps, 1), 1),
            "graph_captures": engine.step.captures - captures,  # a timed pass should have none: the warm-up made them
            "decode_loop_ms_per_step": round(1000 * (engine.stats["decode_seconds"] - seconds) / max(steps, 1), 4)}


def measure(engine, loads: list[Load], batch1: Load, vocab: int, phase: str) -> dict:
    """One pass of every load, and the batch-1 decode loop period, on `engine`."""
    row = {load.name: closed_loop_pass(engine, load, vocab, phase, load.requests if phase != "warmup" else
                                       load.warmup_requests or load.concurrency) for load in loads}
    row["batch1"] = closed_loop_pass(engine, batch1, vocab, phase, 1)
    row["batch1"]["decode_ms"] = row["batch1"]["decode_loop_ms_per_step"]
    return row


def summary(checked: dict, rounds: list[dict]) -> dict:
    def median(overlap: str, load: str, key: str):
        values = [r[load][key] for r in rounds if r["overlap"] == overlap and load in r]
        return round(statistics.median(values), 4) if values else None

    s = {"equal_completions": all(c["differing_completions"] == 0 for c in checked.values()) if checked else None,
         "max_logprob_diff": max((c["max_logprob_diff"] for c in checked.values()), default=None)}
    same = checked.get("same_batches", {})
    s["equal_completions_same_batches"] = same.get("differing_completions", -1) == 0 if same else None
    s["max_logprob_diff_same_batches"] = same.get("max_logprob_diff")
    for overlap in ("off", "on"):
        s[f"tok_s_c64_{overlap}"] = median(overlap, "c64", "tokens_per_s")
        s[f"tok_s_grpo_{overlap}"] = median(overlap, "grpo", "tokens_per_s")
        s[f"decode_ms_batch1_{overlap}"] = median(overlap, "batch1", "decode_ms")
    return {k: s[k] for k in SUMMARY_KEYS}


def verdict(checked: dict, device: str) -> str:
    """One line on the check: what differs, and whether that is a failure on this device."""
    if not checked:
        return "the check did not run"
    parts = [f"{name}: {c['differing_completions']} of {c['completions']} completions differ, max |logprob diff| "
             f"{c['max_logprob_diff']:.3g}" for name, c in checked.items()]
    same = checked.get("same_batches", {})
    if device.startswith("cuda"):
        parts.append("same_batches must be exact (same graphs, same numbers): " +
                     ("it is" if same.get("differing_completions") == 0 and same.get("max_logprob_diff") == 0
                      else "IT IS NOT: overlapped decoding computed something else"))
        parts.append("waves / one_admission: bf16 rounds differently per batch bucket, so logprob differences and "
                     "tokens flipped at a draw's boundary (first_difference: neighbouring ids) are expected there")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small workloads")
    ap.add_argument("--out", type=Path, help="JSON results; default: a temporary folder with --smoke")
    ap.add_argument("--device", default=None, help="default cuda; cpu with --smoke")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds, each overlap off then on")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    device = args.device or ("cpu" if args.smoke else "cuda")
    if args.out is None:
        if not args.smoke:
            ap.error("--out is required without --smoke")
        args.out = Path(tempfile.mkdtemp(prefix="overlap-check-")) / "overlap-check-smoke.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    size = sizes(args.smoke)

    import torch

    try:
        from backends.inference.engine import Engine, EngineConfig
    except ModuleNotFoundError as e:  # the H200 image has no pydantic: say how to get it before building anything
        print(f"{e}: install benchmarks/gpu/wheels-flow.txt's parts and put them on PYTHONPATH (see --help)",
              file=sys.stderr)
        return 2

    folder, adapter, facts = build_model_folder(Path(tempfile.mkdtemp(prefix="overlap-check-")), args.smoke,
                                                size["lora_rank"])
    vocab = facts["tokenizer_vocab"]
    report = {
        "benchmark": "benchmarks/overlap_check.py", "command": " ".join(["python", "benchmarks/overlap_check.py",
                                                                *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware(device), "versions": versions(),
        "config": {**facts, "device": device, "max_batch_size": size["max_batch"], "max_seq_len": size["max_seq_len"],
                   "mix_requests": size["mix_requests"], "mix_max_tokens": size["mix_max_tokens"],
                   "waves": size["waves"], "loads": [asdict(x) for x in [*size["loads"], size["batch1"]]],
                   "rounds": args.rounds},
        "summary": {}, "check": {}, "rounds": [], "warmup": {}, "engines": {}, "errors": {}, "timings_s": {},
        "notes": ["Throughput: Engine.generate from one event loop in this process (no HTTP), LoRA policy@1, "
                  "seeded, ignore_eos; medians over the rounds (each round overlap off, then on, same prompts).",
                  "decode_ms (batch 1): stats decode_seconds / decode_steps of one request; overlapped, the "
                  "decode loop's period.",
                  "On CUDA a step's batch bucket depends on arrival and on the overlapped step's extra rows, and bf16 "
                  "rounds differently per bucket: logprob differences, and rare token flips where a draw falls on a "
                  "boundary, are reported, not failed. On the CPU tokens must match. The same_batches check (every "
                  "sequence ends on length at one step: the same graphs on the same rows) must be exact anywhere."]}

    def write(partial: bool = True) -> None:
        report["summary"] = summary(report["check"], report["rounds"])
        report["partial"] = partial
        report["timings_s"]["total"] = round(time.monotonic() - t_start, 1)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    engines = {}
    try:
        t0 = time.monotonic()
        for overlap in (False, True):
            engines[overlap] = Engine.from_pretrained(
                str(folder), device=device, served_name=SERVED, config=EngineConfig(
                    max_batch_size=size["max_batch"], max_seq_len=size["max_seq_len"], overlap_decode=overlap))
            engines[overlap].load_adapter(ADAPTER, str(adapter))
        report["engines"] = {("on" if o else "off"): {"overlap": e.overlap, "cuda_graphs": e.step.graphs,
                                                      "dtype": str(e.dtype)} for o, e in engines.items()}
        report["timings_s"]["engines"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        mix = request_mix(engines[False], vocab, size["mix_requests"], size["mix_max_tokens"])
        same_length = request_mix(engines[False], vocab, size["mix_requests"], size["same_length_tokens"], True)
        for name, requests in (("mix", mix), ("same_length_mix", same_length)):
            report["config"][name] = [{"kind": r["kind"], "prompt_tokens": len(r["prompt"]), "n": r["n"],
                                       "lora": r["model"] is not None, **asdict(r["params"])} for r in requests]
        report["check"] = check(engines, mix, same_length, size["waves"])
        report["timings_s"]["check"] = round(time.monotonic() - t0, 1)
        write()
        t0 = time.monotonic()
        for overlap, engine in engines.items():
            report["warmup"]["on" if overlap else "off"] = measure(engine, size["loads"], size["batch1"], vocab,
                                                                   "warmup")
        report["timings_s"]["warmup"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        for k in range(args.rounds):
            for overlap, engine in engines.items():
                row = {"round": k, "overlap": "on" if overlap else "off",
                       **measure(engine, size["loads"], size["batch1"], vocab, f"timed{k}")}
                report["rounds"].append(row)
                print(json.dumps(row), flush=True)
                write()
        report["timings_s"]["rounds"] = round(time.monotonic() - t0, 1)
        report["engines"].update({("on" if o else "off") + "_stats": dict(e.stats, graph_captures=e.step.captures)
                                  for o, e in engines.items()})
    except Exception as e:  # noqa: BLE001 - keep what was measured, say what failed
        import traceback

        report["errors"]["run"] = traceback.format_exc()[-6000:]
        print(f"failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
        engines.clear()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["verdict"] = verdict(report["check"], device)
    write(partial=False)
    print(json.dumps({"summary": report["summary"], "verdict": report["verdict"], "timings_s": report["timings_s"]},
                     indent=2))
    print(f"wrote {args.out}")
    tokens_differ = not device.startswith("cuda") and report["summary"]["equal_completions"] is False
    return 1 if tokens_differ or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
