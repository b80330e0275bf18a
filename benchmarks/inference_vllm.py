"""The embedded server against vLLM, through HTTP, one client code, one run: same model folder, same LoRA adapter.

What is measured, and how:

- Model: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV heads, vocab 151,936, 494M parameters) with
  random bf16 weights and tiny-random's tokenizer, saved once as a Hugging Face folder that both servers load;
  a random rank-16 peft adapter on all seven projections (nonzero B), loaded into each server at run time through
  ``POST /v1/load_lora_adapter`` as ``policy@1``. Every request names ``policy@1``.
- Servers run one at a time, each in its own process: the embedded one as ``trajflow serve`` (``python -m
  flows.cli serve``), vLLM through our launcher (`backends.serving.vllm.VLLMServer`, i.e. ``vllm serve`` with the
  flags the flow uses). The client is `benchmarks/load_client.py` (``httpx.AsyncClient``) in processes of its own,
  so no server shares its GIL: one per 16 concurrent requests by default (``--client-processes``), as one Python
  process cannot drive 64 without becoming the bound (its ceiling: `benchmarks/client_ceiling.py`; on the CPU of
  `benchmarks/results/serving-intake-cpu.md` a single process alone added 0.11-0.19 s to the TTFT of 64 requests
  sent at once). The same client code runs for both systems.
- Requests: ``POST /v1/completions`` with exact token-id prompts (random ids, distinct for every request and phase,
  the same for both systems; no prefix is shared between requests, so vLLM's prefix cache can only share a prompt
  among the n samples of one request), temperature 1, a seed per request (trajflow's rollouts send one),
  ``ignore_eos`` and ``min_tokens`` = ``max_tokens`` so every sample has exactly N new tokens (checked), the sampled
  token's logprob (``logprobs: 0``, raw) and ``return_token_ids``, as trajflow's rollouts ask.
- Loads: c clients in a closed loop (each sends its next request when its previous one is answered) at
  c = 1, 8, 64, 256 with 128 prompt + 128 new tokens; and a GRPO-shaped load: 64 prompts of 512 tokens sent at once,
  n = 16 samples each, 128 new tokens.
- Per load: a warm-up wave (not timed; the embedded engine captures its CUDA graphs there), the timed pass without
  streaming (output tok/s = completion tokens / (first send -> last answer); latency per request, mean/p50/p95),
  then a streaming pass on fresh prompts (one wave of c requests; the 64 requests of the GRPO load) for TTFT = send
  -> first SSE chunk that carries a token (``token_ids``); both ``--repeat`` times, the table showing the median
  pass of each (the JSON keeps every pass: ``passes``, ``stream_passes``). Both servers stream token by token (the
  embedded one per engine step: `backends.serving.stream_chunks`).
- With ``--vllm-unseeded`` vLLM also runs c=64 and the GRPO load without seeds (vLLM samples seeded requests
  through per-request generators), to show what the seeds cost it.
- Decode step of the embedded engine at batch 1, in this process: an `Engine` on the same folder and adapter runs
  one request at a time (128 + 128 tokens); reported are the engine's own per-step wall time
  (``stats['decode_seconds'] / stats['decode_steps']``: host bookkeeping, the replayed CUDA graph and reading the
  sampled token back) and, on CUDA, the CUDA-event time of the graph replay alone (benchmarks/inference.py).

GPU (vLLM importable; see README, "GPU machines"):
    python benchmarks/inference_vllm.py --out benchmarks/results/inference-vllm-h200.json
GPU, the embedded server alone (c = 1/8/64/256, the GRPO load, the decode step; writes OUT.json and OUT.md, the
server's log in --logs), with the flow's wheels on PYTHONPATH (benchmarks/gpu/wheels-flow.txt: fastapi, uvicorn,
orjson, and openai's httpx2: parts 02 and 03 of its `gather_wheels.py` output at least; with vLLM's set, add orjson):
    python benchmarks/inference_vllm.py --systems embedded --budget-s 400 --out $OUT/inference-embedded-h200.json \
        --logs $OUT
Several engine configurations in one call, each with its loads and decode step (the first one is the summary's):
    python benchmarks/inference_vllm.py --systems embedded --embedded-config merged_single_adapter=true,\
compile_decode=true --embedded-config '' --out $OUT/inference-embedded-merged-h200.json --logs $OUT
A short call that re-measures c=64 and the GRPO load only, three passes each, without the decode step:
    python benchmarks/inference_vllm.py --systems embedded --loads c64,grpo --repeat 3 --skip-decode-step \
        --embedded-config merged_single_adapter=true,compile_decode=true --out $OUT/intake-h200.json --logs $OUT
CPU check without vLLM (embedded server only, tiny model, a few requests):
    python benchmarks/inference_vllm.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.inference import QWEN05_SHAPE, decode_kernel_profile, graph_step_times, hardware, random_lora, versions
from benchmarks.load_client import ADAPTER, Load, closed_loop, default_processes, prompt_ids, quantiles
from backends.serving.managed_process import free_port, log_tail

SERVED = "base"
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": True}
SUMMARY_KEYS = ("vllm_tok_s_c64", "embedded_tok_s_c64", "embedded_over_vllm_c64", "vllm_tok_s_grpo",
                "embedded_tok_s_grpo", "embedded_over_vllm_grpo", "embedded_decode_ms_batch1")


def device_loads() -> list[Load]:
    return [Load("c1", 1, 8, 128, 128), Load("c8", 8, 64, 128, 128), Load("c64", 64, 256, 128, 128),
            Load("c256", 256, 512, 128, 128), Load("grpo", 64, 64, 512, 128, n=16, warmup_requests=16)]


def smoke_loads() -> list[Load]:
    return [Load("c1", 1, 2, 16, 8), Load("c4", 4, 8, 16, 8), Load("grpo", 4, 4, 32, 8, n=4)]


# -- the model folder both servers load ------------------------------------------------------------------------------
def build_model_folder(root: Path, smoke: bool, lora_rank: int) -> tuple[Path, Path, dict]:
    """Save (model folder, adapter folder, facts): random bf16 weights + tiny tokenizer, and a random peft LoRA."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from backends.modeling.loading import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    shape = dict(TINY_SHAPE, vocab_size=len(tok)) if smoke else dict(QWEN05_SHAPE)
    cfg = Qwen2Config(**shape, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    folder, adapter = root / ("tiny-qwen-random" if smoke else "qwen2.5-0.5b-random"), root / "policy-lora"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    random_lora(model, lora_rank, adapter)  # wraps `model` in place: after the base folder is saved
    return folder, adapter, {"model": folder.name, "parameters": parameters, "weight_bytes": weight_bytes,
                             "shape": shape, "tokenizer_vocab": len(tok), "lora_rank": lora_rank,
                             "lora_targets": "q,k,v,o,gate,up,down"}


# -- servers ---------------------------------------------------------------------------------------------------------
class EmbeddedServer:
    """`trajflow serve` in a subprocess (its own interpreter and GIL); `launcher` replaces ``-m flows.cli`` (the
    serving-overhead benchmark's stand-in wrapper takes the same `serve` arguments after its own)."""

    def __init__(self, folder: Path, device: str, max_batch: int, max_seq_len: int, log: Path,
                 launcher: tuple[str, ...] = ("-m", "flows.cli"), engine: dict[str, str] | None = None):
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, *launcher, "serve", "--model", str(folder), "--device", device,
               "--port", str(self.port), "--served-name", SERVED, "--max-batch-size", str(max_batch),
               "--max-seq-len", str(max_seq_len), "--max-loras", "4",
               "--adapter-root", str(folder.parent),  # the run's folder holds the model and the adapter
               *[arg for k, v in (engine or {}).items() for arg in ("--engine", f"{k}={v}")]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.command = " ".join(cmd)
        with open(log, "ab") as out:
            self.process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"trajflow serve exited with {self.process.returncode}:\n{log_tail(self.log, 30)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"trajflow serve not healthy within {timeout} s:\n{log_tail(self.log, 30)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def vllm_wrapper(folder: Path) -> Path:
    """An executable that runs `vllm` with this interpreter: installed with --target, vLLM's own `bin/vllm` has
    whatever shebang the installing pip wrote, and the launcher takes one executable, not an argv prefix."""
    path = folder / "vllm"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vllm.entrypoints.cli.main "$@"\n')
    path.chmod(0o755)
    return path


def start_vllm(folder: Path, work: Path, log: Path, max_seq_len: int, memory: float, timeout: float,
               executable: str | None):
    """`vllm serve` through backends/serving/vllm.py; returns (server, argv)."""
    from backends.serving.vllm import VLLMConfig, VLLMServer, build_command

    cfg = VLLMConfig(model=str(folder), served_model_name=SERVED, port=0, max_lora_rank=16, max_loras=4,
                     gpu_memory_utilization=memory, max_model_len=max_seq_len, dtype="bfloat16",
                     executable=executable or str(vllm_wrapper(work)), log_path=str(log),
                     startup_timeout_s=timeout)
    server = VLLMServer(cfg)
    server.start()
    return server, build_command(cfg, server.port)


# -- the client ------------------------------------------------------------------------------------------------------
@dataclass
class Passes:
    """How a load is measured: `repeat` timed passes (and as many streamed ones), in `client_processes` client
    processes (None: `load_client.default_processes` of the load's concurrency)."""

    repeat: int = 1
    client_processes: int | None = None


def median_pass(passes: list[dict], key) -> dict:
    """The pass whose `key` is the median (the lower middle one of an even count)."""
    return sorted(passes, key=key)[(len(passes) - 1) // 2]


async def measure(system: str, base_url: str, loads: list[Load], vocab: int, seeded: bool, record,
                  passes: Passes = Passes()) -> None:
    """Warm-up, timed passes and streaming passes of each load; `record(row)` is called after each load.

    The row's figures are the median pass's (output tok/s for the timed passes, TTFT p50 for the streamed ones);
    every pass is kept in ``passes`` and ``stream_passes``. Each pass sends fresh prompts."""
    for load in loads:
        processes = passes.client_processes or default_processes(load.concurrency)
        row = {"system": system, "load": load.name, "concurrency": load.concurrency, "n": load.n,
               "prompt_tokens": load.prompt_tokens, "new_tokens": load.new_tokens, "seeded": seeded,
               "client_processes": processes}
        try:
            await closed_loop(base_url, load, "warmup", load.warmup_requests or load.concurrency, vocab, seeded,
                              False, processes)
            timed, streamed = [], []
            n_ttft = load.ttft_requests or (load.requests if load.name == "grpo" else load.concurrency)
            for i in range(passes.repeat):
                suffix = str(i) if i else ""
                lat, _, tokens, wall = await closed_loop(base_url, load, "timed" + suffix, load.requests, vocab,
                                                         seeded, False, processes)
                timed.append({"requests": load.requests, "output_tokens": tokens, "wall_s": round(wall, 3),
                              "tokens_per_s": round(tokens / wall, 1), "latency_s": quantiles(lat)})
                lat_s, ttft, tokens_s, wall_s = await closed_loop(base_url, load, "stream" + suffix, n_ttft, vocab,
                                                                  seeded, True, processes)
                streamed.append({"stream_requests": n_ttft, "stream_tokens_per_s": round(tokens_s / wall_s, 1),
                                 "ttft_s": quantiles(ttft), "stream_latency_s": quantiles(lat_s)})
            row.update(median_pass(timed, lambda p: p["tokens_per_s"]))
            row.update(median_pass(streamed, lambda p: p["ttft_s"].get("p50", 0.0)))
            if passes.repeat > 1:
                row.update(passes=timed, stream_passes=streamed)
        except Exception as e:  # noqa: BLE001 - record the failure, go on with the next load
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        record(row)
        print(json.dumps(row), flush=True)


def parse_settings(text: str) -> dict[str, str]:
    """'compile_decode=on,admission_wait_steps=0' -> {'compile_decode': 'on', ...} ('' -> the defaults), values as
    `trajflow serve --engine` reads them."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    bad = [k for k, sep, _ in pairs if not sep or not k.strip()]
    if bad:
        raise ValueError(f"--embedded-config {text!r}: expected FIELD=VALUE,...")
    return {k.strip(): v.strip() for k, _, v in pairs}


def chosen_settings(settings: dict[str, str] | None) -> dict[str, str]:
    """The settings an in-process `EngineConfig` takes: those not left to their device default ('auto')."""
    from backends.serving.cli import engine_value

    return {k: v for k, v in (settings or {}).items() if engine_value(v) is not None}


def label(settings: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


# -- the embedded engine's decode step -------------------------------------------------------------------------------
def embedded_decode_step(folder: Path, adapter: Path, device: str, load: Load, max_batch: int, max_seq_len: int,
                         vocab: int, repeats: int, engine_settings: dict[str, str] | None = None) -> dict:
    """Per-step wall time at batch 1 from the engine's counters, and the graph replay time alone on CUDA."""
    import torch

    from backends.inference.engine import Engine, EngineConfig, SamplingParams

    config = EngineConfig(max_batch_size=max_batch, max_seq_len=max_seq_len, **chosen_settings(engine_settings))
    engine = Engine.from_pretrained(str(folder), device=device, served_name=SERVED, config=config)
    try:
        engine.load_adapter(ADAPTER, str(adapter))
        params = [SamplingParams(max_tokens=load.new_tokens, seed=i, ignore_eos=True) for i in range(repeats + 2)]
        prompts = [prompt_ids("decode-step", "timed", i, load.prompt_tokens, vocab) for i in range(repeats + 2)]
        for i in range(2):  # warm-up: graph capture for this (batch, length) bucket
            engine.generate_sync(prompts[i], params[i], ADAPTER)
        before = dict(engine.stats)
        for i in range(2, repeats + 2):
            engine.generate_sync(prompts[i], params[i], ADAPTER)
        steps = engine.stats["decode_steps"] - before["decode_steps"]
        seconds = engine.stats["decode_seconds"] - before["decode_seconds"]
        out = {"method": "Engine in this process, one request at a time (batch 1), LoRA policy@1; "
                         "stats decode_seconds / decode_steps", "requests": repeats, "decode_steps": steps,
               "step_ms": round(1000 * seconds / max(steps, 1), 4), "cuda_graphs": engine.step.graphs}
        if device.startswith("cuda"):
            span = engine.step.bucket(1, load.prompt_tokens + load.new_tokens)[1]
            out["graph_replay_ms"] = graph_step_times(engine, span, lora=True)
            out["graph_replay_attention_length"] = span
            for lora in (True, False):
                try:
                    out[f"profile_{'lora' if lora else 'base'}"] = decode_kernel_profile(engine, span, lora=lora)
                except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the run's figures
                    out[f"profile_{'lora' if lora else 'base'}"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


# -- the report ------------------------------------------------------------------------------------------------------
def summary(rows: list[dict], decode: dict | None) -> dict:
    def tok_s(system: str, load: str):
        return next((r.get("tokens_per_s") for r in rows
                     if r["system"] == system and r["load"] == load and r["seeded"]), None)

    s = {"vllm_tok_s_c64": tok_s("vllm", "c64"), "embedded_tok_s_c64": tok_s("embedded", "c64"),
         "embedded_over_vllm_c64": None, "vllm_tok_s_grpo": tok_s("vllm", "grpo"),
         "embedded_tok_s_grpo": tok_s("embedded", "grpo"), "embedded_over_vllm_grpo": None,
         "embedded_decode_ms_batch1": (decode or {}).get("step_ms")}
    for load in ("c64", "grpo"):
        e, v = s[f"embedded_tok_s_{load}"], s[f"vllm_tok_s_{load}"]
        if e and v:
            s[f"embedded_over_vllm_{load}"] = round(e / v, 3)
    return s


def markdown(report: dict) -> str:
    cfg, hw = report["config"], report["hardware"]
    lines = [(f"# Embedded server vs vLLM through HTTP: {cfg['model']} + rank-{cfg['lora_rank']} LoRA on "
             f"{hw.get('gpu', hw.get('cpu_model', hw.get('cpu')))}"), "",
             f"`{report['command']}`  ", f"{report['date']}; " + ", ".join(
                 f"{k} {v}" for k, v in report["versions"].items() if v) + ("" if not report.get("partial") else
                                                                         "; **partial: the run stopped early**"),
             "", "Summary: " + ", ".join(f"{k} = {v}" for k, v in report["summary"].items()), "",
             ("| system | load | c | requests x n | prompt + new | output tok/s | latency p50 s | p95 s | "
             "TTFT p50 s | TTFT p95 s | streamed tok/s |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        name = r["system"] + ("" if r.get("seeded", True) else " (unseeded)")
        if "error" in r:
            lines.append(f"| {name} | {r['load']} | {r['concurrency']} | | | failed: {r['error'][:200]} | | | | | |")
            continue
        lat, ttft = r.get("latency_s", {}), r.get("ttft_s", {})
        lines.append(f"| {name} | {r['load']} | {r['concurrency']} | {r.get('requests')} x {r['n']} | "
                     f"{r['prompt_tokens']} + {r['new_tokens']} | {r.get('tokens_per_s')} | {lat.get('p50')} | "
                     f"{lat.get('p95')} | {ttft.get('p50')} | {ttft.get('p95')} | {r.get('stream_tokens_per_s')} |")
    d = report.get("embedded_decode_step")
    if d:
        lines += ["", f"Embedded decode step at batch 1 ({d['method']}): {d['step_ms']} ms per step over "
                      f"{d['decode_steps']} steps" + (f"; CUDA-graph replay alone (attention length "
                                                      f"{d['graph_replay_attention_length']}): "
                                                      + ", ".join(f"batch {b}: {ms} ms" for b, ms in
                                                                  d["graph_replay_ms"].items())
                                                      if "graph_replay_ms" in d else "") + "."]
    processes = sorted({r["client_processes"] for r in report["results"] if "client_processes" in r})
    if processes:
        repeat = report["config"].get("passes", {}).get("repeat", 1)
        lines.append(f"- Client (`benchmarks/load_client.py`): {' / '.join(map(str, processes))} process(es) per pass; "
                     f"{repeat} timed and {repeat} streamed pass(es) per load, the median shown (all in the JSON).")
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    for name, err in report.get("errors", {}).items():
        lines += ["", f"{name} failed:", "", "```", err[-3000:], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, embedded server only, tiny model, a few requests")
    ap.add_argument("--out", type=Path, help="JSON results (a .md beside it); default: a temporary folder with --smoke")
    ap.add_argument("--device", default=None, help="embedded engine device (default cuda; cpu with --smoke)")
    ap.add_argument("--systems", default=None, help="comma-separated: embedded,vllm (default both; embedded with "
                                                    "--smoke)")
    ap.add_argument("--embedded-max-batch", type=int, default=256, help="the embedded engine's max_batch_size "
                                                                        "(its default is 64; 256 covers c=256)")
    ap.add_argument("--embedded-config", action="append", default=None, metavar="FIELD=VALUE,...",
                    help="engine settings of one embedded run (`trajflow serve --engine`; '' for the defaults); "
                         "repeatable: each runs the loads and the decode step, the first is the summary's")
    ap.add_argument("--max-seq-len", type=int, default=None, help="context of both servers (2048; 256 with --smoke)")
    ap.add_argument("--vllm-memory", type=float, default=0.8, help="vLLM --gpu-memory-utilization")
    ap.add_argument("--vllm-unseeded", action="store_true", help="also run vLLM at c64 and grpo without seeds")
    ap.add_argument("--vllm-executable", default=None, help="the `vllm` command (default: `python -m vllm."
                                                             "entrypoints.cli.main` with this interpreter)")
    ap.add_argument("--loads", default=None, help="comma-separated subset of the loads by name (c1,c8,c64,c256,grpo; "
                                                  "c1,c4,grpo with --smoke); default all")
    ap.add_argument("--repeat", type=int, default=1, help="timed (and streamed) passes per load; the table shows the "
                                                          "median pass, the JSON keeps every pass")
    ap.add_argument("--client-processes", type=int, default=None,
                    help="client processes per pass (default: one per 16 concurrent requests, at most 8: "
                         "benchmarks/load_client.py)")
    ap.add_argument("--skip-decode-step", action="store_true",
                    help="do not measure the embedded decode step at batch 1 (its summary key is then null)")
    ap.add_argument("--budget-s", type=float, default=570, help="stop starting new work after this many seconds")
    ap.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs (default: beside --out)")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    device = args.device or ("cpu" if args.smoke else "cuda")
    systems = (args.systems or ("embedded" if args.smoke else "embedded,vllm")).split(",")
    if args.out is None:
        if not args.smoke:
            ap.error("--out is required without --smoke")
        args.out = Path(tempfile.mkdtemp(prefix="inference-vllm-smoke-")) / "inference-vllm-smoke.json"
    logs = args.logs or args.out.parent
    logs.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    loads = smoke_loads() if args.smoke else device_loads()
    if args.loads:
        wanted = args.loads.split(",")
        unknown = sorted(set(wanted) - {x.name for x in loads})
        if unknown:
            ap.error(f"--loads: unknown {', '.join(unknown)} (known: {', '.join(x.name for x in loads)})")
        loads = [x for x in loads if x.name in wanted]
    if args.repeat < 1 or (args.client_processes is not None and args.client_processes < 1):
        ap.error("--repeat and --client-processes must be at least 1")
    passes = Passes(args.repeat, args.client_processes)
    try:
        embedded_configs = [parse_settings(text) for text in (args.embedded_config or [""])]
    except ValueError as e:
        ap.error(str(e))
    args.max_seq_len = args.max_seq_len or (256 if args.smoke else 2048)
    work = Path(tempfile.mkdtemp(prefix="inference-vllm-"))

    folder, adapter, model_facts = build_model_folder(work, args.smoke, 4 if args.smoke else 16)
    vocab = model_facts["tokenizer_vocab"]
    rows: list[dict] = []
    report = {
        "benchmark": "benchmarks/inference_vllm.py", "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware(device), "versions": versions(),
        "config": {**model_facts, "device": device, "dtype": "bfloat16" if device.startswith("cuda") else
                   "float32 (CPU)", "loads": [asdict(x) for x in loads], "passes": asdict(passes),
                   "client": "benchmarks/load_client.py", "temperature": 1.0, "logprobs": 0,
                   "seeded": True, "prompt": "exact token ids, /v1/completions", "max_seq_len": args.max_seq_len,
                   "embedded": {"max_batch_size": args.embedded_max_batch, "max_loras": 4,
                                "engine_settings": embedded_configs},
                   "vllm": {"gpu_memory_utilization": args.vllm_memory, "max_lora_rank": 16, "max_loras": 4}},
        "summary": {}, "results": rows, "errors": {}, "timings_s": {},
        "notes": ["Both servers stream token by token (the embedded one per engine step).",
                  "Output tok/s, latency: non-streaming pass (what rollouts use); TTFT: the streaming pass."],
    }
    for name in ("httpx", "vllm"):
        try:
            from importlib.metadata import version

            report["versions"][name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            report["versions"][name] = None
    decode: dict | None = None

    def write(partial: bool = True) -> None:
        report["summary"] = summary(rows, decode)
        report["partial"] = partial
        report["timings_s"]["total"] = round(time.monotonic() - t_start, 1)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))

    def phase(name: str, t0: float) -> None:
        report["timings_s"][name] = round(time.monotonic() - t0, 1)
        write()

    for i, settings in enumerate(embedded_configs if "embedded" in systems else []):
        if i and args.budget_s - (time.monotonic() - t_start) < 120:
            report["errors"][f"embedded ({label(settings)})"] = "skipped: out of --budget-s"
            continue
        # the first configuration is the one the summary quotes; the others are rows named by their settings
        name = "embedded" if i == 0 else f"embedded ({label(settings)})"
        suffix = "" if i == 0 else f"_{i}"
        t0 = time.monotonic()
        server = EmbeddedServer(folder, device, args.embedded_max_batch, args.max_seq_len,
                                logs / f"embedded{suffix}.log", engine=settings)
        report["config"]["embedded"]["command" + suffix] = server.command
        try:
            server.wait_healthy(600)
            from backends.serving.inference_client import InferenceClient

            asyncio.run(InferenceClient(server.url).load_adapter(ADAPTER, str(adapter)))
            report["timings_s"][f"embedded_start{suffix}"] = round(time.monotonic() - t0, 1)
            asyncio.run(measure(name, server.url, loads, vocab, True, rows.append, passes))
        except Exception as e:  # noqa: BLE001
            report["errors"][name] = f"{type(e).__name__}: {e}\n{log_tail(server.log, 30)}"
        finally:
            server.stop()
        phase(f"embedded{suffix}", t0)
        if args.skip_decode_step:
            continue
        t0 = time.monotonic()
        try:
            step = embedded_decode_step(folder, adapter, device, loads[0], args.embedded_max_batch,
                                        args.max_seq_len, vocab, repeats=2 if args.smoke else 5,
                                        engine_settings=settings)
            if i == 0:
                decode = report["embedded_decode_step"] = step
            else:
                report.setdefault("embedded_variants_decode_step", {})[label(settings)] = step
        except Exception as e:  # noqa: BLE001
            report["errors"][f"{name} decode step"] = f"{type(e).__name__}: {e}"
        phase(f"embedded_decode_step{suffix}", t0)

    if "vllm" in systems:
        t0 = time.monotonic()
        left = args.budget_s - (time.monotonic() - t_start)
        server = None
        try:
            server, argv_ = start_vllm(folder, work, logs / "vllm.log", args.max_seq_len, args.vllm_memory,
                                       timeout=max(60.0, left - 120), executable=args.vllm_executable)
            report["config"]["vllm"]["command"] = " ".join(argv_)
            report["timings_s"]["vllm_start"] = round(time.monotonic() - t0, 1)
            write()
            from backends.serving.inference_client import InferenceClient

            asyncio.run(InferenceClient(server.url).load_adapter(ADAPTER, str(adapter)))
            asyncio.run(measure("vllm", server.url, loads, vocab, True, rows.append, passes))
            if args.vllm_unseeded and args.budget_s - (time.monotonic() - t_start) > 45:
                unseeded = [x for x in loads if x.name in ("c64", "grpo")]
                asyncio.run(measure("vllm", server.url, unseeded, vocab, False, rows.append, passes))
        except Exception as e:  # noqa: BLE001
            report["errors"]["vllm"] = f"{type(e).__name__}: {e}"[-6000:]
        finally:
            if server is not None:
                server.stop()
        phase("vllm", t0)

    write(partial=False)
    print(markdown(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
