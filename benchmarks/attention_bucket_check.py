"""What ``attention_bucket`` costs and saves on a GPU: the trainer's own per-row cuDNN attention path
(``packed_attention._varlen_attention`` on the ``rows`` path, rows zero-padded to a multiple of the bucket) over the
trainer benchmark's rows, at several buckets, forward + backward, one decoder layer at the Qwen2.5-1.5B attention
shape (12 query heads, 2 key/value heads, head dim 128, bf16).

Why: padding a row of n tokens by p < b adds about 2p/n to its causal attention FLOPs; on the benchmark's rows (2k-16k
tokens) b = 512 adds 5.4% to the step's attention (~36% of the step's GPU time), b = 128 1.2%. A finer bucket means
more cuDNN plans to build (the warm-up builds one forward + backward per multiple of b up to the micro-batch budget).

- ``ms_per_step``: per bucket, the sum over a step's micro-batches (the trainer's ``plan_bins`` at 24,576 tokens) of
  the median of ``--repeat`` timed forward + backward calls, times 28 layers, averaged over steps 4-9 of
  ``training_fresh_process.py``'s rows; bucket 1 (exact lengths, a plan per length) is the lower bound.
- ``plan_s_per_length``: the warm-up's plan building (``build_row_plans``) timed for the lengths a bucket adds to the
  coarser ones before it (512 first, so its plans are built cold), per new length; ``warm_up_plans_s`` that times the
  bucket's full count (what its warm-up would pay).

- ``--profile``: instead, the CUDA kernels (name, count, ms) of one profiled forward + backward of step 4's first
  micro-batch at bucket 512 and at the rows' own lengths: what the padding adds beside the attention kernels.

Result on the H200 (``results/attention-bucket-h200.json``): 957 / 928 / 919 / 928 ms a step at 512 / 256 / 128 / 64,
835 unpadded, warm-up plans 9.0 / 14.0 / 24.6 / 54.7 s. Each call is timed alone, so part of the gap to the unpadded
rows is the host launching the padding's ops (``--profile``, ``-kernels-h200.json``: 6.67 against 6.28 ms of kernels
for that micro-batch's layer; 6.56 after the padding was written once, ``-kernels-padfix-h200.json``).

    python3 benchmarks/attention_bucket_check.py --out $OUT/attention-bucket-h200.json
    python3 benchmarks/attention_bucket_check.py --profile --out $OUT/attention-bucket-kernels-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cuda_timing import median_ms  # noqa: E402
from benchmarks.training import QWEN25_15B, synthetic_groups  # noqa: E402
from backends.training.packed_attention import (PackedAttention, RowSpans, _varlen_attention, bucketed,  # noqa: E402
                                                build_row_plans, sdpa_backends)
from backends.training.packing import plan_bins  # noqa: E402
from backends.training.token_rows import build_rows  # noqa: E402

BUCKETS = (512, 256, 128, 64)
BUDGET, STEP_TOKENS, MIN_LEN, MAX_LEN = 24576, 98304, 2048, 16384
STEPS = range(4, 10)


def attention_module():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    cfg = Qwen2Config(**QWEN25_15B, attn_implementation="sdpa")
    return Qwen2Attention(cfg, layer_idx=0).to("cuda", torch.bfloat16).train()


def micro_batches() -> dict[int, list[list[int]]]:
    """Row lengths of each micro-batch of each step, as the trainer packs them."""
    out = {}
    for k in STEPS:
        lengths = [len(r) for r in build_rows(synthetic_groups(k, QWEN25_15B["vocab_size"], STEP_TOKENS, MIN_LEN,
                                                               MAX_LEN), max_row_tokens=MAX_LEN)[0]]
        out[k] = [[lengths[i] for i in b] for b in plan_bins(lengths, BUDGET)]
    return out


def micro_batch_call(module, lengths: list[int], bucket: int):
    """A callable: one forward + backward of a micro-batch's attention on the rows path at ``bucket``."""
    heads, kv, dim = 12, 2, 128
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, h, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (heads, kv, kv))
    packed = PackedAttention(RowSpans.of(lengths, torch.device("cuda")), "rows", sdpa_backends("cudnn"), bucket)
    upstream = torch.randn(1, total, heads, dim, device="cuda", dtype=torch.bfloat16)

    def run():
        out, _ = _varlen_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                   trajflow_packed=packed, dropout=0.0, scaling=module.scaling)
        out.backward(upstream)

    return run


def kernel_table(module, lengths: list[int], bucket: int) -> list[dict]:
    """The CUDA kernels of one profiled forward + backward (after two unprofiled ones): name, count, total ms."""
    run = micro_batch_call(module, lengths, bucket)
    run(), run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:120], "count": e.count, "ms": round(e.device_time_total / 1e3, 3)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:25]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="only the kernels of step 4's first micro-batch, per bucket")
    args = ap.parse_args()
    torch.manual_seed(0)
    module = attention_module()
    layers = QWEN25_15B["num_hidden_layers"]
    steps = micro_batches()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "budget": BUDGET, "steps": {k: v for k, v in steps.items()},
              "buckets": {}}
    if args.profile:
        first = steps[STEPS[0]][0]
        report["kernels"] = {b: kernel_table(module, first, b) for b in (512, 1)}
        Path(args.out).write_text(json.dumps(report, indent=1))
        return
    built: set[int] = set()
    for b in BUCKETS + (1,):
        row = {}
        if b > 1:
            lengths = list(range(b, bucketed(BUDGET, b) + 1, b))
            new = [m for m in lengths if m not in built]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            build_row_plans(module, new, sdpa_backends("cudnn"), b, torch.bfloat16)
            torch.cuda.synchronize()
            per = (time.perf_counter() - t0) / max(1, len(new))
            built.update(new)
            row.update(plan_lengths=len(lengths), new_lengths=len(new), plan_s_per_length=round(per, 4),
                       warm_up_plans_s=round(per * len(lengths), 2))
        per_step = {k: layers * sum(median_ms(micro_batch_call(module, mb, b), reps=args.repeat) for mb in mbs)
                    for k, mbs in steps.items()}
        row["ms_per_step_by_step"] = {k: round(v, 2) for k, v in per_step.items()}
        row["ms_per_step"] = round(statistics.mean(per_step.values()), 2)
        report["buckets"][str(b)] = row
        print(b, row, flush=True)
    base = report["buckets"]["512"]["ms_per_step"]
    report["summary"] = {b: {"ms_per_step": r["ms_per_step"], "warm_up_plans_s": r.get("warm_up_plans_s"),
                             "saved_ms_per_step_vs_512": round(base - r["ms_per_step"], 2)}
                         for b, r in report["buckets"].items()}
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
