"""The trainer's Unsloth path against its peft path on a GPU: same weights, same adapter init, same rows, same loss.

The model is the Qwen2.5-1.5B shape of ``benchmarks/training.py`` (random weights, bf16), saved once with
``save_pretrained`` plus the tiny offline tokenizer (Unsloth's loader wants a folder with a tokenizer; its
512-token vocabulary is smaller than the model's, which is harmless: rows are token ids). Each variant
runs in its own Python process, because importing Unsloth patches transformers and peft for the
whole process:

- ``peft/checkpoint-25%``: GRPOTrainer backend='peft' with the GPU defaults of its speed settings
  ('auto': lean ops, fused LoRA, compiled logprob chunk math) at the issue's shape (LoRA r16 alpha 32
  all-linear, 16384 tokens per micro-batch, rows packed, 25% of layers checkpointed). It runs first and
  saves its freshly initialised LoRA weights; every later variant loads them, so step 0 starts from the
  same adapter on both paths.
- ``peft/fp32-probe``: float32 weights and plain peft/PyTorch ops, only the probe below (no step): the
  reference both bf16 paths' logprobs are measured against.
- ``unsloth/no-checkpointing``: backend='unsloth' (``FastLanguageModel`` loader, Unsloth's patched
  decoder, attention and LoRA-MLP kernels; one row per micro-batch, no packing), no checkpointing.
- ``unsloth/checkpoint-unsloth``: the same with Unsloth's 'unsloth' gradient checkpointing (every layer,
  activations offloaded to CPU memory).

In an Unsloth process ``import unsloth`` runs before transformers/peft are imported (Unsloth's advice),
then the trainer loads the model through ``backends.training.unsloth_loader``. Per variant: a throwaway trainer
runs ``--process-warmup-steps`` steps first (the first trainer of a process ran slower for several
steps in ``benchmarks/results/training-h200.md``), then the measured trainer reports the logprobs of a
fixed 2048-token row (``sequence_logprobs``, eval mode), runs ``--warmup-steps`` untimed steps (step 0
is the correctness probe: fresh shared adapter, same rows) and ``--steps`` timed ones. On the same
weights, adapter and rows, step 0's loss and gradient norm and the probe logprobs should agree between
the paths up to bf16 rounding and kernel order; the float32 probe says how far each path is from exact.

tokens/s and MFU follow ``benchmarks/training.py`` (real row tokens per wall-clock second of whole
steps; MFU = 6 N tokens/s / 989 TFLOP/s, N the base model's parameters).

    python benchmarks/training_unsloth.py --out benchmarks/results/training-unsloth-h200.json
    python benchmarks/training_unsloth.py --smoke   # CPU, tiny shape: peft runs, Unsloth fails clearly
"""

from __future__ import annotations

import os

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):
    os.environ.setdefault(_var, "1")  # nothing outside the machine is reachable, nor should be

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

INIT_ADAPTER = "init_adapter.safetensors"
PROBE_TOKENS = 2048
COMMON = dict(lora_rank=16, lora_alpha=32, target_modules="all-linear", learning_rate=1e-5, seed=0)
FP32_PROBE = "peft/fp32-probe"
VARIANTS = {
    "peft/checkpoint-25%": dict(backend="peft", gradient_checkpointing=True, checkpoint_layer_fraction=0.25),
    # reference for the probe only: float32 weights and math, plain peft/PyTorch ops, no optimizer step
    FP32_PROBE: dict(backend="peft", dtype="float32", fused_lora="off", compile_logprobs="off",
                     memory_efficient_ops="off"),
    "unsloth/no-checkpointing": dict(backend="unsloth", gradient_checkpointing=False),
    "unsloth/checkpoint-unsloth": dict(backend="unsloth", gradient_checkpointing=True),
}
PACKAGES = ("torch", "transformers", "peft", "triton", "accelerate", "unsloth", "unsloth_zoo", "bitsandbytes", "trl",
            "datasets", "torchao", "cut_cross_entropy", "xformers", "flash_attn", "pydantic")


def versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def shape_of(smoke: bool) -> tuple[dict, int, int]:
    """(model shape, shortest row, longest row)."""
    from benchmarks.training import QWEN25_15B, TINY

    return (TINY, 128, 1024) if smoke else (QWEN25_15B, 2048, 16384)


def write_model(folder: Path, smoke: bool) -> None:
    """The benchmark model (random weights, seed 0) and the tiny tokenizer, as a from_pretrained folder."""
    import torch

    from backends.modeling.loading import build_tiny_tokenizer
    from benchmarks.training import build_model

    shape, _, _ = shape_of(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    model = build_model(shape, "cpu" if smoke else "cuda", dtype)
    model.config.dtype = dtype
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    del model


def probe_row(vocab: int) -> tuple[list[int], list[int]]:
    import random

    rng = random.Random(7)
    ids = [rng.randrange(vocab) for _ in range(PROBE_TOKENS)]
    return ids[: PROBE_TOKENS // 2], ids[PROBE_TOKENS // 2:]


def describe(trainer) -> dict:
    """What the loaded model actually runs: forward functions, checkpointing flags, LoRA dtypes."""
    decoder = trainer._lm.get_decoder()
    layer = decoder.layers[0]
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]

    def qual(fn) -> str:
        return getattr(fn, "__qualname__", type(fn).__name__)

    return {
        "backend": trainer.backend,
        "packed": trainer.packed,
        "fused_lora_layers": trainer.fused_lora_layers,
        "model_class": type(trainer._lm).__name__,
        "decoder_forward": qual(decoder.forward),
        "layer_forward": qual(layer.forward),
        "attention_forward": qual(layer.self_attn.forward),
        "mlp_forward": qual(layer.mlp.forward),
        "apply_qkv": qual(getattr(layer.self_attn, "apply_qkv", None)),
        "decoder_gradient_checkpointing": getattr(decoder, "gradient_checkpointing", None),
        "layers_checkpointed": sum(bool(getattr(m, "gradient_checkpointing", False)) for m in decoder.layers),
        "unsloth_gradient_checkpointing": str(getattr(trainer.model, "_unsloth_gradient_checkpointing", None)),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_dtypes": sorted({str(p.dtype) for p in trainable}),
        "base_dtype": str(trainer._lm.get_input_embeddings().weight.dtype),
    }


def share_adapter(trainer, folder: Path) -> dict:
    """The first variant saves its initial LoRA weights; later ones load them (same adapter at step 0)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    path = folder / INIT_ADAPTER
    if not path.exists():
        state = {k: v.detach().float().cpu().contiguous() for k, v in get_peft_model_state_dict(trainer.model).items()}
        save_file(state, str(path))
        return {"init_adapter": "saved", "tensors": len(state)}
    weights = load_file(str(path))
    res = set_peft_model_state_dict(trainer.model, weights)
    unexpected = list(getattr(res, "unexpected_keys", []) or [])
    missing = [k for k in (getattr(res, "missing_keys", []) or []) if "lora_" in k]
    if unexpected or missing:
        raise ValueError(f"shared adapter does not fit: unexpected {unexpected[:3]}, missing {missing[:3]}")
    return {"init_adapter": "loaded", "tensors": len(weights)}


def worker(args) -> None:
    """One variant in this process; its results go to ``args.part`` after every step."""
    spec = VARIANTS[args.worker]
    part = Path(args.part)
    result = {"name": args.worker, "status": "running", "config": {}, "steps": [], "info": {}}

    def save() -> None:
        part.write_text(json.dumps(result, indent=1, default=str))

    try:
        t0 = time.perf_counter()
        if spec["backend"] == "unsloth":
            if importlib.util.find_spec("unsloth") is None:
                raise SystemExit("unsloth is not installed in this Python: the Unsloth variants cannot run "
                                 "(pip install unsloth on a CUDA machine)")
            import unsloth  # noqa: F401 - before transformers/peft: Unsloth patches them on import

            result["info"]["import_order"] = "unsloth imported before transformers/peft"
            result["info"]["unsloth_import_s"] = round(time.perf_counter() - t0, 1)
        else:
            result["info"]["import_order"] = "unsloth not imported"
        import torch

        from backends.training.config import TrainerConfig
        from backends.training.trainer import GRPOTrainer
        from benchmarks.training import _alloc_stats, _reset_peak, _sync, synthetic_groups

        device = "cpu" if args.smoke else "cuda"
        shape, min_len, max_len = shape_of(args.smoke)
        cfg = dict(COMMON, **spec, max_row_tokens=max_len,
                   micro_batch_tokens=1024 if args.smoke else args.micro_batch_tokens)
        result["config"] = cfg
        save()
        step_tokens = 6000 if args.smoke else args.step_tokens
        probe_only = args.worker == FP32_PROBE
        if args.process_warmup_steps and not probe_only:  # a throwaway trainer first: see the module docstring
            t1 = time.perf_counter()
            warm = GRPOTrainer(args.model_dir, TrainerConfig(**cfg), device=device)
            for k in range(args.process_warmup_steps):
                warm.train_step(synthetic_groups(k, shape["vocab_size"], step_tokens, min_len, max_len))
            del warm
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            result["info"]["process_warmup_s"] = round(time.perf_counter() - t1, 1)
            print(f"  {args.worker}: process warm-up {result['info']['process_warmup_s']} s", flush=True)
        t1 = time.perf_counter()
        trainer = GRPOTrainer(args.model_dir, TrainerConfig(**cfg), device=device)
        result["info"]["load_s"] = round(time.perf_counter() - t1, 1)
        result["info"].update(share_adapter(trainer, Path(args.model_dir)))
        result["info"].update(describe(trainer))
        prompt, completion = probe_row(shape["vocab_size"])
        result["probe_logprobs"] = [round(x, 5) for x in trainer.sequence_logprobs(prompt, completion)]
        save()
        for k in range(0 if probe_only else args.warmup_steps + args.steps):
            data = synthetic_groups(k, shape["vocab_size"], step_tokens, min_len, max_len)
            _reset_peak(device)
            _sync(device)
            t = time.perf_counter()
            m = trainer.train_step(data)
            _sync(device)
            m["wall_s"] = time.perf_counter() - t
            m["timed"] = k >= args.warmup_steps
            m.update(_alloc_stats(device))
            result["steps"].append(m)
            save()
            print(f"  {args.worker} step {k}: {m['tokens']:.0f} tok in {m['wall_s']:.2f}s = "
                  f"{m['tokens'] / m['wall_s']:.0f} tok/s, peak {m['peak_memory_gib']:.1f} GiB, loss {m['loss']:.6f}, "
                  f"grad norm {m['grad_norm']:.6f}, {m['micro_batches']:.0f} micro-batches", flush=True)
        if device == "cuda":
            result["info"]["process_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["status"] = "ok"
    except BaseException as exc:  # noqa: BLE001 - recorded for the parent, then re-raised as an exit code
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
        save()
        print(f"  {args.worker} FAILED: {result['error'][:500]}", flush=True)
        raise SystemExit(1) from None
    save()


def run_variant(name: str, args, folder: Path, timeout: float) -> dict:
    part = folder / (name.replace("/", "_") + ".json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--part", str(part),
           "--model-dir", str(folder), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
           "--step-tokens", str(args.step_tokens), "--process-warmup-steps", str(args.process_warmup_steps), "--micro-batch-tokens", str(args.micro_batch_tokens)]
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, cwd=ROOT)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    res = json.loads(part.read_text()) if part.exists() else {"name": name, "status": "error", "steps": []}
    if code == "timeout":
        res["status"], res["error"] = "timeout", f"killed after {timeout:.0f} s ({len(res['steps'])} steps done)"
    elif code != 0 and res.get("status") != "error":
        res["status"], res["error"] = "error", f"worker exited with {code} (crash: see the log)"
    return res


def summarise_variant(res: dict, n_params: int) -> dict:
    from benchmarks.training import summarise

    row = {"name": res["name"], "status": res["status"]}
    timed = [s for s in res["steps"] if s.get("timed")]
    if res["steps"]:
        row["first_step_loss"] = res["steps"][0]["loss"]
        row["first_step_grad_norm"] = res["steps"][0]["grad_norm"]
        row["step_wall_s"] = [round(s["wall_s"], 2) for s in res["steps"]]
    if timed:
        row.update(summarise({"name": res["name"], "steps": [res["steps"][0]] + timed}, n_params))
        row["timed_steps"] = len(timed)
        row["micro_batches_per_step"] = timed[0]["micro_batches"]
    if "error" in res:
        row["error"] = res["error"][:300]
    return row


def _probe_diff(a: list[float] | None, b: list[float] | None) -> dict | None:
    if not a or not b or len(a) != len(b):
        return None
    d = [abs(x - y) for x, y in zip(a, b)]
    return {"max": max(d), "mean": sum(d) / len(d), "tokens": len(d)}


def compare(runs: list[dict], summary: list[dict]) -> dict:
    """Each variant against the bf16 peft variant (step-0 loss and grad norm, probe logprobs, speed) and
    every variant's probe logprobs against the float32 reference."""
    base = next((r for r in runs if r["name"].startswith("peft") and r["name"] != FP32_PROBE), None)
    base_row = next((s for s in summary if base is not None and s["name"] == base["name"]), {})
    ref = next((r for r in runs if r["name"] == FP32_PROBE), {})
    out = {}
    for run, row in zip(runs, summary):
        c = {}
        if run["name"] != FP32_PROBE and (diff := _probe_diff(ref.get("probe_logprobs"), run.get("probe_logprobs"))):
            c["probe_logprob_abs_diff_vs_fp32"] = diff
        if base is not None and run is not base and base.get("steps") and run.get("steps"):
            for key in ("loss", "grad_norm"):
                a, b = base["steps"][0][key], run["steps"][0][key]
                c[f"step0_{key}"] = {"peft": a, "this": b, "abs_diff": abs(a - b),
                                     "rel_diff": abs(a - b) / max(abs(a), 1e-12)}
            if diff := _probe_diff(base.get("probe_logprobs"), run.get("probe_logprobs")):
                c["probe_logprob_abs_diff_vs_peft"] = diff
            if "tokens_per_s" in row and "tokens_per_s" in base_row:
                c["tokens_per_s_ratio_vs_peft"] = round(row["tokens_per_s"] / base_row["tokens_per_s"], 3)
        if c:
            out[run["name"]] = c
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (step 0 is the probe)")
    ap.add_argument("--process-warmup-steps", type=int, default=2, help="steps of a throwaway trainer before "
                    "the measured one, in each variant's process (0: none)")
    ap.add_argument("--step-tokens", type=int, default=98304, help="row tokens per optimizer step")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--only", default="", help="comma list of variants, in order (default: all of " + ", ".join(VARIANTS).replace("%", "%%") + ")")
    ap.add_argument("--deadline-s", type=float, default=380.0, help="wall-clock budget of the whole run; a "
                    "variant still running then is killed and recorded as a timeout")
    ap.add_argument("--variant-timeout-s", type=float, default=180.0, help="wall-clock cap of one variant")
    ap.add_argument("--model-dir", default=None, help="reuse or create the model folder here (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, to check the script")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    start = time.perf_counter()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    import torch

    from benchmarks.training import build_model

    env = {"python": platform.python_version(), "packages": versions(),
           "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
           "command": "python " + " ".join(sys.argv)}
    print(f"env {json.dumps(env)}", flush=True)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU machine")
    if importlib.util.find_spec("unsloth") is None and any(VARIANTS[n]["backend"] == "unsloth" for n in names):
        print("WARNING: unsloth is not installed: the Unsloth variants will fail (recorded)", flush=True)
    shape, _, _ = shape_of(args.smoke)
    n_params = sum(p.numel() for p in build_model(shape, "meta", torch.bfloat16).parameters())
    tmp = tempfile.TemporaryDirectory(prefix="trajflow-unsloth-") if args.model_dir is None else None
    folder = Path(args.model_dir or tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").exists():
        t = time.perf_counter()
        write_model(folder, args.smoke)
        env["model_write_s"] = round(time.perf_counter() - t, 1)
        if not args.smoke:
            torch.cuda.empty_cache()
    (folder / INIT_ADAPTER).unlink(missing_ok=True)  # the first variant of this run sets the shared init
    runs, summary = [], []
    for name in names:
        left = args.deadline_s - (time.perf_counter() - start)
        print(f"== {name} ({left:.0f} s left)", flush=True)
        if left < 20:
            res = {"name": name, "status": "skipped", "error": "deadline reached before it started", "steps": []}
        else:
            res = run_variant(name, args, folder, min(left, args.variant_timeout_s))
        runs.append(res)
        summary.append(summarise_variant(res, n_params))
        print(f"   -> {json.dumps(summary[-1])}", flush=True)
        result = {"env": env, "n_params": n_params, "summary": summary, "comparison": compare(runs, summary),
                  "runs": runs}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"summary": summary, "comparison": compare(runs, summary)}, indent=1), flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
