"""The embedded engine's decode step, one variant of the forward at a time, in one process (issue 13, part 3).

For each variant of `DecoderRunner` (switches that keep the maths: LoRA's A fused into the base GEMM, the per-layer
functions through torch.compile, k and v written to the cache in one call) and of the step (``single_slot``: every
row's LoRA term read from its one slot, no row masks or select: `EngineConfig.single_slot_lora`; ``merged``: that
step on the base weights with the adapter merged in, no LoRA kernels: `EngineConfig.merged_single_adapter`), on the
Qwen2.5-0.5B shape with random bf16 weights and a rank-16 LoRA on all seven projections (every row on the adapter,
4 LoRA slots):

- the CUDA-graph replay time of one decode step (forward + sampling) at batch 1, 64 and 256, attention length 256
  (CUDA events over 50 replays, after 3), and at batch 1 without LoRA;
- the set-up it costs: the runner's warm-up (the compiles), the capture of each graph (first step of a bucket), and
  for merged variants one rebuild of the merged weights (device time, CUDA events; the first step includes one);
- the kernels one step launches at batch 1 (torch.profiler over the same step run eagerly, `decode_kernel_profile`);
- how far its logprobs are from the first variant's (the same inputs; float rounding only).

GPU (the lead's H200; ~2-4 min):
    python benchmarks/engine_decode.py --out benchmarks/results/engine-decode-h200.json
CPU smoke (tiny-random, eager, no graphs; checks the script runs):
    python benchmarks/engine_decode.py --smoke
Writes the JSON (top-level "summary": decode_ms_batch1 etc., one entry per variant) and a .md beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.inference import build_random_qwen, decode_kernel_profile, hardware, random_lora, versions

# name -> DecoderRunner switches (and `single_slot`, the step's: every row on slot 0 without masks); "before" is the
# path as it was (fused q/k/v and gate/up); "fused_a" today's CUDA default, "single_slot" that with one-slot steps;
# "merged" those steps on merged weights, "merged_compile" that as an engine with compile_decode runs it
VARIANTS = {
    "before": dict(fuse_lora_a=False, compile=False, joint_kv_write=False),
    "fused_a": dict(fuse_lora_a=True, compile=False, joint_kv_write=False),
    "joint_kv": dict(fuse_lora_a=False, compile=False, joint_kv_write=True),
    "compile": dict(fuse_lora_a=False, compile=True, joint_kv_write=False),
    "compile_joint_kv": dict(fuse_lora_a=False, compile=True, joint_kv_write=True),
    "all": dict(fuse_lora_a=True, compile=True, joint_kv_write=True),
    "single_slot": dict(fuse_lora_a=True, compile=False, joint_kv_write=False, single_slot=True),
    "merged": dict(fuse_lora_a=True, compile=False, joint_kv_write=False, single_slot=True, merged=True),
    "merged_compile": dict(fuse_lora_a=True, compile=True, joint_kv_write=True, single_slot=True, merged=True),
}
LENGTH = 256
POSITION = 200  # every row decodes its token 200: attention length bucket 256


def build_variant(model, info: dict, host_adapter, switches: dict, max_batch: int, max_len: int, slots: int,
                  graphs: bool):
    """(runner, step, set-up seconds) with the adapter placed in slot 0."""
    import torch

    from backends.inference.cuda_graphs import DecodeStep
    from backends.inference.decoder import DecoderRunner
    from backends.inference.kv_cache import SlotKVCache
    from backends.inference.lora_slots import LoraSlots

    dtype, device = model.get_input_embeddings().weight.dtype, model.get_input_embeddings().weight.device
    kv = SlotKVCache(info["num_layers"], max_batch, info["num_kv_heads"], max_len, info["head_dim"], dtype, device)
    lora = LoraSlots(info["layout"], info["num_layers"], slots, dtype, device)
    switches = {k: v for k, v in switches.items() if k != "single_slot"}
    runner = DecoderRunner(model, max_len, kv, lora, fuse=True, **switches)
    with torch.inference_mode():
        assert lora.acquire(1, lambda: host_adapter) == 0
        warm = runner.warm_up()  # with and without LoRA, as an engine does at start and at its first adapter
    return runner, DecodeStep(runner, max_batch, max_len, graphs), warm


def fill(step, batch: int, lora: bool) -> None:
    host = step.host.numpy()
    host[:] = 0
    host[0, :batch] = [(7 * i + 3) % 500 for i in range(batch)]
    host[1, :batch] = POSITION
    host[2, :] = 0 if lora else -1
    host[3, :] = 1.0
    host[4, :] = 1.0
    host[5, :] = 0.5


def measure(step, batch: int, lora: bool, cuda: bool, reps: int, single_slot: int | None = None,
            merged: bool = False) -> dict:
    """First step of the bucket (its capture on CUDA), then the mean step time over `reps`; `single_slot`: the one
    LoRA slot of every row (no masks), None for the masked path; `merged`: that slot's adapter merged into the
    weights."""
    import torch

    single_slot = single_slot if lora else None
    merged = merged and single_slot is not None
    fill(step, batch, lora)
    length = min(LENGTH, step.max_len) if cuda else POSITION + 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    _, raw = step.run(batch, length, lora, False, single_slot=single_slot, merged=merged)
    sync()
    first_s = time.perf_counter() - t0
    raw = raw.float().clone()
    for _ in range(3):
        step.run(batch, length, lora, False, single_slot=single_slot, merged=merged)
    sync()
    if cuda:  # the key `DecodeStep.launch` files the graph under (a merged step runs the no-LoRA forward)
        key = (batch, length, False, False, None, True) if merged else (batch, length, lora, False, single_slot, False)
        graph = step._graphs[key][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step.dev.copy_(step.host, non_blocking=True)
            graph.replay()
        end.record()
        sync()
        ms = start.elapsed_time(end) / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            step.run(batch, length, lora, False, single_slot=single_slot)
        ms = 1000 * (time.perf_counter() - t0) / reps
    return {"step_ms": round(ms, 4), "first_step_s": round(first_s, 3), "raw": raw}


def rebuild_ms(runner, cuda: bool) -> float:
    """One rebuild of the merged weights (slot 0's adapter), forced: device time on CUDA, wall time on the CPU."""
    import torch

    runner.merged.held = None
    if not cuda:
        t0 = time.perf_counter()
        runner.merged.hold(0)
        return round(1000 * (time.perf_counter() - t0), 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    runner.merged.hold(0)
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end), 3)


def run_variant(name: str, model, info, host_adapter, args, cuda: bool, reference: dict) -> dict:
    import torch

    t0 = time.perf_counter()
    runner, step, warm = build_variant(model, info, host_adapter, VARIANTS[name], args.max_batch, args.max_len,
                                       4, graphs=cuda)
    single = 0 if VARIANTS[name].get("single_slot") else None  # the adapter sits in slot 0
    merged = bool(VARIANTS[name].get("merged"))
    out = {"switches": VARIANTS[name], "build_and_warm_up_s": round(time.perf_counter() - t0, 2),
           "warm_up_s": round(warm, 2)}
    try:
        with torch.inference_mode():
            for batch in args.batches:
                m = measure(step, batch, True, cuda, args.reps, single, merged)
                raw = m.pop("raw")
                if batch in reference:
                    m["max_abs_logprob_diff_vs_first"] = round(float((raw - reference[batch]).abs().max()), 5)
                else:
                    reference[batch] = raw
                out[f"batch_{batch}"] = m
            m = measure(step, 1, False, cuda, args.reps)
            m.pop("raw")
            out["batch_1_no_lora"] = m
            if cuda:
                shim = types.SimpleNamespace(step=step, runner=runner)
                try:
                    out["profile_batch_1"] = decode_kernel_profile(shim, LENGTH, lora=True, single_slot=single,
                                                                   merged=merged)
                except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the timings
                    out["profile_batch_1"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            if merged:
                out["merge_rebuild_ms"] = rebuild_ms(runner, cuda)
        out["compiles"] = runner.fns.compiles
        out["compile_backend_s"] = round(runner.fns.compile_seconds, 2)
        out["compile_failure"] = runner.fns.failure
        out["graph_captures"] = step.captures
    finally:
        step.clear()
        runner.kv.close()
        del runner, step
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def summary(results: dict, batches: list[int]) -> dict:
    s = {}
    for batch in batches:
        s[f"decode_ms_batch{batch}"] = {n: r[f"batch_{batch}"]["step_ms"] for n, r in results.items()
                                        if f"batch_{batch}" in r}
    s["decode_ms_batch1_no_lora"] = {n: r["batch_1_no_lora"]["step_ms"] for n, r in results.items()
                                     if "batch_1_no_lora" in r}
    s["kernels_per_step_batch1"] = {n: r["profile_batch_1"].get("kernels_per_step") for n, r in results.items()
                                    if "profile_batch_1" in r}
    s["warm_up_s"] = {n: r["warm_up_s"] for n, r in results.items() if "warm_up_s" in r}
    best = min(s["decode_ms_batch1"].items(), key=lambda kv: kv[1], default=(None, None))
    s["best_batch1"] = {"variant": best[0], "ms": best[1]}
    return s


def markdown(report: dict) -> str:
    res, batches = report["variants"], report["batches"]
    lines = [f"# Embedded engine decode step per variant: {report['model']} + rank-16 LoRA on "
             f"{report['hardware'].get('gpu', report['hardware'].get('cpu'))}", "",
             f"`{report['command']}`  ", f"{report['date']}; " + ", ".join(f"{k} {v}" for k, v in
                                                                           report["versions"].items() if v), "",
             "| variant | " + " | ".join(f"batch {b} ms" for b in batches) + " | batch 1 no LoRA ms | kernels/step "
             "(b1) | warm-up s | first step s (b1, capture) | max logprob diff vs before (b1) | merge rebuild ms | "
             "compile failure |",
             "|---" * (len(batches) + 8) + "|"]
    for name, r in res.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} |")
            continue
        b1 = r.get("batch_1", {})
        lines.append("| " + " | ".join([name] + [str(r.get(f"batch_{b}", {}).get("step_ms")) for b in batches] + [
            str(r.get("batch_1_no_lora", {}).get("step_ms")), str(r.get("profile_batch_1", {}).get("kernels_per_step")),
            str(r.get("warm_up_s")), str(b1.get("first_step_s")), str(b1.get("max_abs_logprob_diff_vs_first", "-")),
            str(r.get("merge_rebuild_ms", "-")), str(r.get("compile_failure") or "-")]) + " |")
    lines += ["", "Step: CUDA-graph replay of forward + sampling (CUDA events), attention length 256, every row on the "
                  "adapter (4 LoRA slots). Warm-up: `DecoderRunner.warm_up` (the compiles); first step: the "
                  "bucket's warm-up runs and graph capture (and, merged, a rebuild of the merged weights). Merge "
                  "rebuild: one forced rebuild of the merged weights, device time.", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-random, eager steps, batch 1 and 4")
    ap.add_argument("--out", type=Path, help="JSON results (a .md beside it); default: a temporary folder")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=420, help="start no new variant after this many seconds")
    args = ap.parse_args(argv)
    from backends.inference.adapters import read_adapter
    from backends.inference.decoder import describe

    t_start = time.monotonic()
    cuda = not args.smoke
    args.batches = [1, 4] if args.smoke else [1, 64, 256]
    args.max_batch, args.max_len = max(args.batches), (256 if args.smoke else 512)
    args.reps = min(args.reps, 3) if args.smoke else args.reps
    args.out = args.out or Path(tempfile.mkdtemp(prefix="engine-decode-")) / "engine-decode.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from backends.modeling.loading import load_model

        model, _, spec = load_model("tiny-random")
        name = spec.name
    else:
        model, _, name = build_random_qwen("cuda")
    info = describe(model)
    folder = Path(tempfile.mkdtemp(prefix="engine-decode-lora-"))
    peft_model = random_lora(model, 16, folder)
    model = peft_model.get_base_model()  # the runner reads base weights only (a peft wrapper is unwrapped anyway)
    host_adapter = read_adapter(folder, info["layout"], info["num_layers"], 64, model.get_input_embeddings().weight.dtype)
    report = {"what": __doc__.split("\n")[0], "model": name, "batches": args.batches,
              "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "hardware": hardware("cuda" if cuda else "cpu"), "versions": versions(), "variants": {}}
    reference: dict = {}
    for variant in args.variants.split(","):
        if time.monotonic() - t_start > args.budget_s:
            report["variants"][variant] = {"error": "skipped: --budget-s reached"}
            continue
        try:
            report["variants"][variant] = run_variant(variant, model, info, host_adapter, args, cuda, reference)
        except Exception as exc:  # noqa: BLE001 - record it, go on with the next variant
            report["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(variant, json.dumps(report["variants"][variant])[:600], flush=True)
        report["summary"] = summary({k: v for k, v in report["variants"].items() if "error" not in v}, args.batches)
        report["wall_s"] = round(time.monotonic() - t_start, 1)
        args.out.write_text(json.dumps({"summary": report.pop("summary"), **report}, indent=1))
        report["summary"] = json.loads(args.out.read_text())["summary"]
        args.out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
