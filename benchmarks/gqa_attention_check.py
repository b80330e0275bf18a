"""Per-row causal attention at the Qwen2.5-1.5B head layout (12 query heads, 2 key/value heads, dim 128, bf16):
cuDNN and FlashAttention with ``enable_gqa`` against key/value expanded to 12 heads first, forward + backward.

Why: a backward that accumulates dK/dV per key/value head has 2 heads x (n / block) units of work, under one wave of
an H200's 132 SMs for rows up to ~8k tokens at 128-token blocks; expanded, 12 heads' worth (plus a sum over each group
of 6). Kept only if it pays: the expanded K/V would also be what SDPA saves for backward (+10 x 128 x 2 x 2 bytes per
token and layer) unless re-expanded in backward.

Result on the H200 (``results/gqa-attention-h200.json``, cuDNN 9.19): expanded is slower at every length, forward +
backward 0.49 against 0.40 ms at 1k tokens, 1.77 against 1.62 at 8k, 5.50 against 5.09 at 16k; FlashAttention's
backend 1.8-1.9x cuDNN's at 8k-16k either way. The trainer keeps cuDNN with ``enable_gqa``.

    python3 benchmarks/gqa_attention_check.py --out $OUT/gqa-attention-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.cuda_timing import median_ms  # noqa: E402

HEADS, KV_HEADS, DIM = 12, 2, 128
LENGTHS = (1024, 2048, 4096, 8192, 12288, 16384)


def row_timings(n: int) -> dict:
    """ms of one row of n tokens, both ways, on each backend; q/k/v in q_proj's [1, n, H, D] memory layout."""
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, n, h, DIM, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    upstream = torch.randn(1, HEADS, n, DIM, device=dev, dtype=dt)
    group = HEADS // KV_HEADS
    ways = {
        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "expanded": lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                                           v.repeat_interleave(group, 1), is_causal=True),
    }
    row = {"n": n}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([backend]):
            for way, attend in ways.items():
                try:
                    row[f"{name}_{way}_fwd_bwd_ms"] = median_ms(lambda: attend().backward(upstream))
                    with torch.no_grad():
                        row[f"{name}_{way}_fwd_ms"] = median_ms(attend)
                except RuntimeError as exc:  # a backend that refuses the layout is a result too
                    row[f"{name}_{way}_error"] = str(exc)[:160]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "rows": []}
    for n in LENGTHS:
        report["rows"].append(row_timings(n))
        print(report["rows"][-1], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
