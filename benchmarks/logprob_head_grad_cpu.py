"""The trained tokens' logprobs and the loss' gradient into the hidden states, on the CPU, two ways
(``trainer.logprob_grad_in_forward``): the recomputing op (``logprobs.chunked_logprobs``, the policy loss, backward:
every chunk's [chunk, V] logits made twice) against the head's gradient taken in the forward
(``logprob_grad_in_forward.logprobs_with_head_grad``, logits made once). CISPO with a TIS cap, float32, the two
interleaved rep by rep from the same inputs; wall time of forward + backward, median and min, and the largest
difference of dL/dh between the two.

    .venv/bin/python benchmarks/logprob_head_grad_cpu.py --out benchmarks/results/logprob-head-grad-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.training.logprob_grad_in_forward import logprobs_with_head_grad  # noqa: E402
from backends.training.logprobs import chunked_logprobs  # noqa: E402
from backends.training.losses import policy_loss, weighted_token_losses  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    n = args.tokens
    hidden0 = torch.randn(n, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    targets = torch.randint(args.vocab, (n,), generator=g)
    per_token = (torch.full((n,), -11.9), torch.randn(n, generator=g), torch.full((n,), 1.0 / n),
                 torch.zeros(n, dtype=torch.long))
    options = dict(loss="cispo", eps=0.2, eps_high=0.28, tis_cap=2.0, n_rows=1)

    def recomputing():
        h = hidden0.clone().requires_grad_()
        logp, _ = chunked_logprobs(h, weight, targets, args.chunk)
        policy_loss(logp, *per_token, **options).loss.backward()
        return h.grad

    def in_forward():
        h = hidden0.clone().requires_grad_()

        def token_loss(logp, sl):
            return weighted_token_losses(logp, *(t[sl] for t in per_token), **options)[0].sum()

        head = logprobs_with_head_grad(h, weight, targets, token_loss, args.chunk)
        head.attach(policy_loss(head.logp, *per_token, **options).loss).backward()
        return h.grad

    ways = {"recomputing": recomputing, "in_forward": in_forward}
    times = {name: [] for name in ways}
    grads = {}
    for _ in range(args.reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            grads[name] = fn()
            times[name].append(time.perf_counter() - t0)
    result = {name: {"median_s": round(statistics.median(ts), 2), "min_s": round(min(ts), 2),
                     "times_s": [round(t, 2) for t in ts]} for name, ts in times.items()}
    summary = {"recomputing_median_s": result["recomputing"]["median_s"],
               "in_forward_median_s": result["in_forward"]["median_s"],
               "max_abs_dh_diff": float((grads["recomputing"] - grads["in_forward"]).abs().max())}
    report = {"summary": summary, "ways": result, "config": vars(args),
              "env": {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "python": platform.python_version(),
                      "load_average": os.getloadavg(), "command": " ".join(sys.argv)}}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
