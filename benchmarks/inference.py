"""Inference throughput and latency: the embedded engine against one `generate` per request, in the same run.

Workload at concurrency c: c clients in a closed loop (each sends its next request when the previous one is
answered), prompts of ~P tokens, exactly N new tokens per request (EOS ignored, as in vLLM's benchmarks), sampling at
temperature 1 with logprobs returned. Reported per row: output tokens/s over the phase (first send -> last answer)
and request latency (mean, p50, p95).

- ``engine``: the embedded server over HTTP with the real ``openai`` client (``--transport http``), or the same
  engine called in-process (``--transport direct``, for machines without fastapi/openai).
- ``baseline``: Hugging Face ``generate`` (sampling, ``output_logits`` for the logprobs), one request at a time
  behind a lock. Serial by construction, so its throughput does not depend on c; rows marked ``derived`` give the
  c=64 latency as c x the measured mean service time instead of running 64 serial requests.

CPU:  python benchmarks/inference.py --device cpu --model smollm2-135m --prompt-tokens 64 --new-tokens 32
GPU:  python benchmarks/inference.py --device cuda --model qwen2.5-0.5b-random --lora-rank 16 --new-tokens 128
(``qwen2.5-0.5b-random`` is Qwen2.5-0.5B's shape with random bf16 weights: hidden 896, 24 layers, 14 query / 2 KV
heads of 64, MLP 4864, vocab 151,936, tied embeddings, 494M parameters; ``--lora-rank`` serves a random LoRA on all
seven projections as ``policy@1`` and runs the baseline on the same unmerged peft model.)
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
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN05_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                    tie_word_embeddings=True, rms_norm_eps=1e-6)
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet


def build_random_qwen(device: str):
    """(model, tokenizer, name): Qwen2.5-0.5B-shaped random weights in bf16; tiny-random's tokenizer (ids < 512)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from backends.modeling.loading import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = Qwen2Config(**QWEN05_SHAPE, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok, "qwen2.5-0.5b-random"


def load_served(model: str, device: str):
    """(model, tokenizer, name) of `model`: ``qwen2.5-0.5b-random`` (`build_random_qwen`) or what `load_model` loads."""
    if model == "qwen2.5-0.5b-random":
        return build_random_qwen(device)
    from backends.modeling.loading import load_model

    hf_model, tok, spec = load_model(model, device=device)
    return hf_model, tok, spec.name


def random_lora(model, rank: int, folder: Path):
    """Wrap `model` with a peft LoRA (all 7 projections, nonzero random B) saved to `folder`; returns the peft model."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    peft_model.save_pretrained(folder)
    return peft_model.eval()


def prompts_for(tok, count: int, target_tokens: int) -> list[list[dict]]:
    """`count` distinct chat prompts whose rendered length is about `target_tokens`."""
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()
    out = []
    for i in range(count):
        n = 4
        while True:
            text = f"Request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(n))
            msgs = [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            if len(ids["input_ids"]) >= target_tokens or n > 4 * target_tokens:
                break
            n += 1
        out.append(msgs)
    return out


def summarise(kind: str, c: int, latencies: list[float], tokens: int, wall: float, **extra) -> dict:
    lat = sorted(latencies)
    return {"system": kind, "concurrency": c, "requests": len(lat), "output_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "latency_mean_s": round(statistics.fmean(lat), 3), "latency_p50_s": round(lat[len(lat) // 2], 3),
            "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3), **extra}


async def closed_loop(c: int, total: int, one) -> tuple[list[float], int, float]:
    """c workers sending `total` requests; `one(i)` returns the number of output tokens of request i."""
    queue = list(range(total))
    latencies: list[float] = []
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop(0)
            t0 = time.perf_counter()
            produced = await one(i)  # (not `tokens += await ...`: that reads `tokens` before awaiting)
            tokens += produced
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(min(c, total))])
    return latencies, tokens, time.perf_counter() - start


def baseline_runner(model, tok, device: str, new_tokens: int):
    """One HF generate per request (sampling, logprobs from output_logits), serialised by a lock."""
    import torch

    lock = threading.Lock()

    def generate(messages, seed: int) -> int:
        with lock:
            enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                          return_tensors="pt").to(device)
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                                     temperature=1.0, top_p=1.0, top_k=0, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
                new = out.sequences[0, enc["input_ids"].shape[1]:]
                logits = torch.stack(out.logits, 1)[0].float()
                _ = logits.log_softmax(-1).gather(1, new.unsqueeze(1)).squeeze(1).tolist()
            return int(new.numel())

    return generate


def versions() -> dict:
    import torch
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("peft", "fastapi", "uvicorn", "openai"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            v[name] = None
    return v


def hardware(device: str) -> dict:
    import torch

    hw = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
          "load_average_at_start": os.getloadavg()}
    try:
        hw["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                               if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.startswith("cuda"):
        hw["gpu"] = torch.cuda.get_device_name(0)
        try:
            hw["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                          capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return hw


def graph_step_times(engine, length: int, lora: bool) -> dict:
    """CUDA-event time of one captured decode step at batch 1 and the largest bucket (engine idle). With `lora`
    every row is on LoRA slot 0 and the step takes the path the engine takes for such a batch (`Engine._lora_path`:
    the slot alone with ``single_slot_lora``, the merged weights with ``merged_single_adapter``)."""
    import torch

    out = {}
    step = engine.step
    single, merged = engine._lora_path(0) if lora else (None, False)
    if merged:
        engine.runner.merged.hold(0)
    for batch in (1, engine.max_batch):
        host = step.host.numpy()
        host[:] = 0
        host[2, :] = 0 if lora else -1
        host[3, :] = 1
        host[4, :] = 1
        for _ in range(3):
            step.run(batch, length, lora, False, single_slot=single, merged=merged)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 50
        start.record()
        for _ in range(reps):
            step.dev.copy_(step.host, non_blocking=True)
            graph = step._graphs[(batch, length, lora, False, single, merged)][0]
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[str(batch)] = round(start.elapsed_time(end) / reps, 4)
    return out


def decode_kernel_profile(engine, length: int, lora: bool, top: int = 12, single_slot: int | None = None,
                          merged: bool = False) -> dict:
    """What one decode step at batch 1 launches: the same step as the graph (``DecodeStep._body``), run eagerly under
    torch.profiler. Kernels per step and their summed device time; the ops launching the most kernels. A captured
    graph replays these kernels back to back, so at batch 1 its time is about kernels x (launch gap + kernel time).
    `single_slot`: the step's rows all on that LoRA slot (`lora_slots` "One slot"), None for the masked path;
    `merged`: the step on the merged weights as they are (no LoRA term; `merged_weights`)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    step = engine.step
    host = step.host.numpy()
    host[:] = 0
    host[2, :] = 0 if lora else -1
    host[3, :] = 1
    host[4, :] = 1
    step.dev.copy_(step.host)
    body = (lambda: step._body(1, length, False, False, merged=True)) if merged else (
        lambda: step._body(1, length, lora, False, single_slot))
    for _ in range(3):
        body()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            body()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.Counter(e.name for e in kernels)
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels) / reps
    return {"kernels_per_step": round(len(kernels) / reps, 1), "kernel_time_ms": round(kernel_us / 1000, 4),
            "kernels_per_layer": round(len(kernels) / reps / len(engine.runner.layers), 2),
            "top_kernels_per_step": {name[:90]: round(n / reps, 1) for name, n in by_name.most_common(top)}}


def correctness_check(device: str) -> dict:
    """On `device` (CUDA graphs on there): tiny-random fp32 with a random LoRA, base and adapter rows mixed in one
    batch, n=2; the engine's logprobs against a teacher-forced HF/peft forward, and seeded tokens alone vs in a crowd."""
    import copy

    import torch

    from backends.inference.engine import Engine, SamplingParams
    from backends.modeling.loading import load_model

    model, tok, _ = load_model("tiny-random", device=device, dtype=torch.float32)
    engine = Engine(model, tok, "tiny-random")
    folder = Path(tempfile.mkdtemp(prefix="check-lora-"))
    peft_model = random_lora(copy.deepcopy(model), 8, folder)
    engine.load_adapter("pol@1", str(folder))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"])
    params = SamplingParams(max_tokens=48, seed=3, ignore_eos=True)

    async def both():
        return await asyncio.gather(engine.generate(prompt, params, "tiny-random", n=2),
                                    engine.generate(prompt, params, "pol@1", n=2),
                                    *[engine.generate(prompt[: 10 + i], params, "pol@1") for i in range(5)])

    base, tuned, *_ = asyncio.run(both())
    alone = engine.generate_sync(prompt, params, "pol@1", n=2)
    worst = 0.0
    for ref_model, completions in ((model, base), (peft_model, tuned)):
        for c in completions:
            with torch.no_grad():
                logits = ref_model(input_ids=torch.tensor([prompt + c.token_ids], device=device)).logits[0].float()
            ref = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(
                1, torch.tensor(c.token_ids, device=device).unsqueeze(1)).squeeze(1).cpu()
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    result = {"max_abs_logprob_diff_vs_hf": worst, "cuda_graphs": engine.step.graphs,
              "seeded_tokens_equal_alone_vs_crowd": [a.token_ids for a in alone] == [c.token_ids for c in tuned],
              "adapter_changes_tokens": base[0].token_ids != tuned[0].token_ids}
    engine.shutdown()
    print("check:", json.dumps(result), flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random, qwen2.5-0.5b-random")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lora-rank", type=int, default=0, help="serve a random LoRA of this rank as policy@1")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--requests", default="1:4,8:16,64:64", help="engine requests per concurrency")
    ap.add_argument("--baseline-requests", default="1:2,8:8", help="baseline requests per concurrency (others: "
                                                                     "derived from the measured service time)")
    ap.add_argument("--also-base", action="store_true", help="with --lora-rank, also run the engine on the base")
    ap.add_argument("--transport", choices=["http", "direct"], default="http")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU), for both systems")
    ap.add_argument("--check", action="store_true", help="first check the engine against HF on tiny-random")
    ap.add_argument("--out", required=True, help="JSON results file (a .md summary is written beside it)")
    args = ap.parse_args(argv)

    import torch

    from backends.inference.engine import Engine, EngineConfig, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)

    check = correctness_check(args.device) if args.check else None
    t_setup = time.perf_counter()
    model, tok, name = load_served(args.model, args.device)
    engine = Engine(model, tok, name, EngineConfig(max_batch_size=args.max_batch_size))
    served = name
    baseline_model = model
    if args.lora_rank:
        folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
        baseline_model = random_lora(model, args.lora_rank, folder)  # engine keeps the base weights it read
        engine.load_adapter("policy@1", str(folder))
        served = "policy@1"
    setup_s = time.perf_counter() - t_setup
    n_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)

    requests = {int(k): int(v) for k, v in (x.split(":") for x in args.requests.split(","))}
    base_requests = {int(k): int(v) for k, v in (x.split(":") for x in args.baseline_requests.split(","))}
    all_prompts = prompts_for(tok, max(requests.values()), args.prompt_tokens)
    prompt_lens = [len(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for m in all_prompts]

    handle = None
    transport = args.transport
    if transport == "http":
        try:
            import openai

            from backends.serving.app import start_server
        except ImportError as e:
            print(f"http transport unavailable ({e}); measuring the engine in-process", file=sys.stderr)
            transport = "direct"
    if transport == "http":
        handle = start_server(name, engine=engine)
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key="none", max_retries=0, timeout=600)

    def engine_call(model_name: str):
        async def one(i: int) -> int:
            msgs = all_prompts[i % len(all_prompts)]
            if transport == "http":
                r = await client.chat.completions.create(
                    model=model_name, messages=msgs, max_tokens=args.new_tokens, temperature=1.0, seed=i,
                    logprobs=True, extra_body={"ignore_eos": True})
                assert len(r.choices[0].logprobs.content) == args.new_tokens
                return len(r.choices[0].token_ids)
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
            (c,) = await engine.generate(list(ids), SamplingParams(max_tokens=args.new_tokens, seed=i,
                                                                   ignore_eos=True), model_name)
            assert len(c.logprobs) == args.new_tokens
            return len(c.token_ids)
        return one

    results = []

    async def run_all():
        # warm-up: captures graphs / warms allocators for each concurrency level, not timed
        for c in args.concurrency:
            await closed_loop(c, c, engine_call(served))
        systems = [("engine", served)] + ([("engine-base", name)] if args.lora_rank and args.also_base else [])
        for label, model_name in systems:
            for c in args.concurrency:
                before = dict(engine.stats)
                lat, toks, wall = await closed_loop(c, requests.get(c, c), engine_call(model_name))
                steps = engine.stats["decode_steps"] - before["decode_steps"]
                step_ms = 1000 * (engine.stats["decode_seconds"] - before["decode_seconds"]) / max(steps, 1)
                results.append(summarise(label, c, lat, toks, wall, model=model_name, transport=transport,
                                         decode_steps=steps, mean_decode_step_ms=round(step_ms, 3)))
                print(json.dumps(results[-1]), flush=True)
        gen = baseline_runner(baseline_model, tok, args.device, args.new_tokens)
        service = []
        for c in args.concurrency:
            if c not in base_requests:
                continue
            lat, toks, wall = await closed_loop(
                c, base_requests[c], lambda i: asyncio.to_thread(gen, all_prompts[i % len(all_prompts)], i))
            service.append(wall / base_requests[c])
            results.append(summarise("baseline", c, lat, toks, wall, model=served, transport="in-process"))
            print(json.dumps(results[-1]), flush=True)
        s = statistics.fmean(service)
        for c in args.concurrency:
            if c in base_requests:
                continue
            results.append({"system": "baseline", "concurrency": c, "derived": True, "requests": c,
                            "tokens_per_s": round(args.new_tokens / s, 1),
                            "latency_mean_s": round(s * c, 3),
                            "note": "serial server: throughput as measured; latency = c x mean service time "
                                    f"({s:.3f} s) for a closed loop of c clients"})
            print(json.dumps(results[-1]), flush=True)

    asyncio.run(run_all())
    if handle is not None:
        handle.stop()

    report = {
        "benchmark": "benchmarks/inference.py", "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware(args.device), "versions": versions(),
        "config": {"model": name, "served": served, "device": args.device, "dtype": str(engine.dtype),
                   "parameters": n_params, "weight_bytes": weight_bytes, "lora_rank": args.lora_rank,
                   "prompt_tokens_mean": round(statistics.fmean(prompt_lens), 1), "new_tokens": args.new_tokens,
                   "temperature": 1.0, "logprobs": True, "engine": engine.config.model_dump(),
                   "cuda_graphs": engine.step.graphs, "transport": transport, "setup_s": round(setup_s, 1),
                   "torch_threads": torch.get_num_threads()},
        "results": results,
    }
    if check is not None:
        report["check"] = check
    if args.device.startswith("cuda"):
        span = engine.step.bucket(1, max(prompt_lens) + args.new_tokens)[1]
        steps = graph_step_times(engine, span, bool(args.lora_rank))
        kv_per_token = 2 * engine.kv.data.shape[0] * engine.kv.data.shape[3] * engine.kv.data.shape[5] * 2
        report["decode_step"] = {
            "graph_replay_ms": steps, "attention_length": span,
            "bandwidth_limit_ms_weights": round(1000 * weight_bytes / HBM_BYTES_PER_S, 4),
            "bandwidth_limit_ms_weights_plus_kv_at_max_batch": round(
                1000 * (weight_bytes + engine.max_batch * span * kv_per_token) / HBM_BYTES_PER_S, 4),
            "captured_graphs": engine.step.captures,
        }
        report["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    engine.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    cfg, hw = report["config"], report["hardware"]
    lines = [f"# Inference benchmark: {cfg['served']} on {hw.get('gpu', hw.get('cpu_model', hw['cpu']))}", "",
             f"`{report['command']}`  ", f"{report['date']}; versions: " + ", ".join(
                 f"{k} {v}" for k, v in report["versions"].items() if v), "",
             f"Model {cfg['model']} ({cfg['parameters'] / 1e6:.0f}M parameters, {cfg['dtype']}), LoRA rank "
             f"{cfg['lora_rank'] or '-'}, prompts ~{cfg['prompt_tokens_mean']} tokens, {cfg['new_tokens']} new "
             f"tokens, temperature 1, logprobs on; engine via {cfg['transport']}, CUDA graphs "
             f"{'on' if cfg['cuda_graphs'] else 'off'}; torch threads {cfg.get('torch_threads')}; CPU load average at "
             f"start {tuple(round(x, 2) for x in hw['load_average_at_start'])}.",
             "", "| system | concurrency | requests | output tok/s | latency mean s | p50 s | p95 s | decode step ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['system']}{' (derived)' if r.get('derived') else ''} | {r['concurrency']} | "
                     f"{r['requests']} | {r['tokens_per_s']} | {r['latency_mean_s']} | {r.get('latency_p50_s', '')} | "
                     f"{r.get('latency_p95_s', '')} | {r.get('mean_decode_step_ms', '')} |")
    if "check" in report:
        lines += ["", f"Correctness on this device (tiny-random fp32, base + LoRA rows mixed, n=2): {report['check']}"]
    if "decode_step" in report:
        d = report["decode_step"]
        lines += ["", f"Decode step (CUDA-graph replay, attention length {d['attention_length']}): "
                      + ", ".join(f"batch {b}: {ms} ms" for b, ms in d["graph_replay_ms"].items())
                      + f"; bandwidth limit {d['bandwidth_limit_ms_weights']} ms for the weights alone, "
                        f"{d['bandwidth_limit_ms_weights_plus_kv_at_max_batch']} ms with the KV cache at the "
                        f"largest batch (4.8 TB/s)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
