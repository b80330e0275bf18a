"""GPU check of ragged cuDNN attention (ONE cuDNN call per layer over a packed micro-batch's rows, the path PyTorch's
jagged nested tensors take: ``aten._cudnn_attention_forward`` with ``cum_seq_q = cum_seq_k`` = the rows' offsets,
backward by autograd's formula for the op) against the packed attention's two CUDA paths
(``backends/training/packed_attention.py``), on the trainer benchmark's attention shape (Qwen2.5-1.5B: 12 query
heads, 2 key/value heads, head dim 128, bf16):

- ``varlen``: ONE FlashAttention-2 varlen call per layer (``packed_attention._flash_varlen``);
- ``rows-cudnn-b512``: one cuDNN SDPA call per row, rows zero-padded to a multiple of 512 (``_varlen_attention`` on
  the ``rows`` path, as 'auto' runs micro-batches whose rows all have >= 2048 tokens);
- ``ragged``: the candidate: cuDNN's kernel with varlen's one call and no padding.

Result on the H200 (torch 2.11.0+cu130, cuDNN 9.19, ``results/ragged-attention-h200.json``): the ragged forward
matches the float32 reference as closely as the others (relative L2 0.002), its backward does not (dq, dk, dv up to
1e38: garbage), and forward + backward took 105-153 ms per layer against 5-6 ms on the rows path; one run of an
earlier version of this script hit an illegal memory access in it. Not usable on that build: nothing in the trainer
selects it. PyTorch's own ``varlen_attn`` keeps its cuDNN branch switched off in these versions, and cuDNN >= 9.24
takes cumulative lengths directly (pytorch/pytorch#194906): run this again on a newer torch before trying it.

1. **Same numbers.** Per micro-batch, the output and dq, dk, dv for one random output gradient, against a float32
   reference (per row SDPA, math kernel, float32 copies of the same bf16 inputs; computed last, its scores take ~10
   GB at 14k tokens): max |diff| and relative L2 error ``||x - x32|| / ||x32||`` per tensor. A method passes where
   every relative error is <= 1.5x varlen's + 1e-3 (both round bf16 inputs through fp32 accumulation; a wrong span,
   a lost causal mask or a mis-mapped GQA head gives O(1) relative error).
2. **Time.** Per micro-batch and method: the first call (forward + backward, synchronised: includes any cuDNN plan
   built for a new shape) and the median of ``--repeat`` further calls timed with CUDA events; the host time of one
   forward + backward launch is in ``host_ms`` (wall until the launches return, before the GPU finishes).

Micro-batches: rows of the trainer benchmark's lengths (2k-16k tokens, as first-fit packs them into 24,576-token
micro-batches), one with short rows mixed in (what 'auto' sends to varlen), one row alone, and a small one.

    python benchmarks/ragged_attention_check.py --out $OUT/ragged-attention-h200.json   # H200, < 1 min
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.training.packed_attention import (PackedAttention, RowSpans, _flash_varlen,  # noqa: E402
                                               _varlen_attention, sdpa_backends)

HEADS, KV_HEADS, DIM = 12, 2, 128
MICRO_BATCHES = {
    "long-3": [14_211, 6_020, 4_305],
    "long-4": [8_911, 7_340, 5_102, 2_990],
    "mixed-short": [12_007, 8_433, 1_730, 911, 604, 377],
    "one-16k": [16_384],
    "small": [300, 700, 1_000],
}
REL_FACTOR, REL_SLACK = 1.5, 1e-3


class _Module:
    """What transformers' ``sdpa_attention_forward`` reads from an attention module."""

    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS
    training = True


def _inputs(lengths, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn(total, HEADS, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, grad


def _as_query_layout(x):
    """[T, H, D] -> [1, H, T, D], a transposed view: the layout q_proj + rope hand the attention function."""
    return x[None].transpose(1, 2)


def run_varlen(q, k, v, spans):
    return _flash_varlen(_as_query_layout(q), _as_query_layout(k), _as_query_layout(v), spans, None)[0]


def run_rows(q, k, v, spans):
    packed = PackedAttention(spans, "rows", sdpa_backends("cudnn"), 512)
    out, _ = _varlen_attention(_Module(), _as_query_layout(q), _as_query_layout(k), _as_query_layout(v), None,
                               trajflow_packed=packed, dropout=0.0, scaling=DIM ** -0.5)
    return out[0]


def run_ragged(q, k, v, spans):
    """[T, H, D] q, [T, Hkv, D] k and v -> [T, H, D]; key/value heads as they are (this build takes them)."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, spans.cu_seqlens, spans.cu_seqlens, spans.max_len,
                                                   spans.max_len, True, 0.0, True, False, scale=DIM ** -0.5)[0]


METHODS = {"varlen": run_varlen, "rows-cudnn-b512": run_rows, "ragged": run_ragged}


def reference(q, k, v, grad, lengths):
    """Per-row float32 SDPA (math kernel): out, dq, dk, dv."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for qr, kr, vr in zip(q32.split(lengths), k32.split(lengths), v32.split(lengths)):
            rep = HEADS // KV_HEADS
            kr, vr = (x.repeat_interleave(rep, dim=1) for x in (kr, vr))
            o = torch.nn.functional.scaled_dot_product_attention(
                qr.transpose(0, 1)[None], kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], is_causal=True)
            outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad.float())
    return [out.detach(), q32.grad, k32.grad, v32.grad]


def forward_backward(fn, q, k, v, grad, spans):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, spans)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def errors(got, want):
    names = ("out", "dq", "dk", "dv")
    return {n: {"max_abs": float((g.float() - w).abs().max()),
                "rel_l2": float((g.float() - w).norm() / w.norm().clamp_min(1e-30))} for n, g, w in zip(names, got, want)}


def timed(fn, q, k, v, grad, spans, repeat):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    forward_backward(fn, q, k, v, grad, spans)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    times, hosts = [], []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        start.record()
        forward_backward(fn, q, k, v, grad, spans)
        end.record()
        hosts.append((time.perf_counter() - h0) * 1e3)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"first_ms": round(first_ms, 2), "median_ms": round(statistics.median(times), 3),
            "min_ms": round(min(times), 3), "host_ms": round(statistics.median(hosts), 3)}


def attention_tflops(lengths, ms):
    """Causal attention forward + backward FLOPs: per row 4 * H * D * n^2 / 2 forward, x3.5 with the backward
    (FlashAttention's count: the backward recomputes the scores), over the time."""
    flops = sum(4 * HEADS * DIM * n * n / 2 for n in lengths) * 3.5
    return round(flops / (ms * 1e-3) / 1e12, 1)


def check(name, lengths, methods, repeat):
    spans = RowSpans.of(lengths, "cuda")
    q, k, v, grad = _inputs(lengths, seed=len(lengths) * 7919 + sum(lengths))
    result = {"lengths": list(lengths), "tokens": sum(lengths), "methods": {}}
    got = {}
    for method, fn in methods.items():
        try:
            got[method] = [x.cpu() for x in forward_backward(fn, q, k, v, grad, spans)]
        except Exception as exc:  # a method this build refuses: recorded, the others still run
            result["methods"][method] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            continue
        entry = timed(fn, q, k, v, grad, spans, repeat)
        entry["tflops"] = attention_tflops(lengths, entry["median_ms"])
        result["methods"][method] = entry
    # the float32 reference last: its scores take ~10 GB at 14k tokens
    want = [x.cpu() for x in reference(q, k, v, grad, list(lengths))]
    for method, tensors in got.items():
        result["methods"][method]["errors"] = errors(tensors, want)
    base = result["methods"].get("varlen", {}).get("errors")
    for method, entry in result["methods"].items():
        if "errors" in entry and base:
            entry["passed"] = all(entry["errors"][t]["rel_l2"] <= REL_FACTOR * base[t]["rel_l2"] + REL_SLACK
                                  for t in base)
    del q, k, v, grad, want
    torch.cuda.empty_cache()
    return name, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--micro-batches", default=",".join(MICRO_BATCHES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ragged_attention_check needs a CUDA GPU (cuDNN attention does not run on the CPU)")
    methods = {m: METHODS[m] for m in args.methods.split(",")}
    results = dict(check(name, MICRO_BATCHES[name], methods, args.repeat) for name in args.micro_batches.split(","))
    summary = {}
    for method in methods:
        entries = [r["methods"].get(method, {}) for r in results.values()]
        summary[method] = {"passed": all(e.get("passed") for e in entries),
                           "ms_by_micro_batch": {n: r["methods"].get(method, {}).get("median_ms")
                                                 for n, r in results.items()},
                           "first_ms_by_micro_batch": {n: r["methods"].get(method, {}).get("first_ms")
                                                       for n, r in results.items()},
                           "errors": [e["error"] for e in entries if "error" in e][:1]}
    record = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
                      "command": " ".join(sys.argv)},
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": "bfloat16"},
              "summary": summary, "micro_batches": results}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
