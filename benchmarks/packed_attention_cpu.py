"""On the CPU, the packed rows' attention as one SDPA call per row (the trainer's ``rows`` path) or as ONE SDPA call
per layer with a block-diagonal causal mask: which is faster at the main job's shape.

The main job (`make run`: configs/default.yaml) trains SmolLM2-135M with 6 groups x 6 rows of the arithmetic agent's
lengths (~38 prompt + 1-16 completion tokens, ~1.7k tokens per step) in 512-token micro-batches. Two measurements,
on random weights of SmolLM2-135M's shape in fp32 (the CPU's dtype), with the rows of `benchmarks/train_stage.py`:

1. ``layer``: one layer's attention, forward + backward, on q/k/v of the first micro-batch's real row lengths (9
   query heads, 3 key/value heads, head dim 64): ``rows`` (transformers' SDPA per row, then the cat, as
   ``backends/training/packed_attention.py`` runs it) vs ``mask`` (one SDPA call, the [L, L] block-diagonal causal
   mask built once). Milliseconds of process CPU time per call (min and median of repeats: CPU time, not wall
   time, because the machine is shared and wall time counts the other processes' turns).
2. ``decoder``: the trainer's decoder forward + backward (LoRA gradients; no vocabulary projection, which is the
   same for both and the largest part of an update) over all micro-batches of the main job's step, the trainer's
   attention function replaced by one that runs ``mask`` when asked (registered over ``trajflow_varlen``).
3. ``update``: `GRPOTrainer.train_step` on those rows, the same switch.

In 2 and 3 the two alternate round by round (the order flipping each round) and the first round is a warm-up; seconds
of process CPU time and of wall time. ``--threads 1`` keeps a loaded machine's other processes from stretching the
CPU time of a thread that waits for its partner.

Also the largest difference of the trained tokens' logprobs between the two on the first micro-batch.

    .venv/bin/python benchmarks/packed_attention_cpu.py --out benchmarks/results/packed-attention-cpu.json
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_stage import SMOLLM2_135M, arithmetic_groups  # noqa: E402

VARIANTS = ("rows", "mask")


def block_causal_mask(lengths, device="cpu") -> torch.Tensor:
    """[L, L] bool, True where query t may attend to key s: the same row and s <= t."""
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    pos = torch.arange(row.numel(), device=device)
    return (row[:, None] == row[None, :]) & (pos[:, None] >= pos[None, :])


def masked_attention(query, key, value, mask, scale=None) -> torch.Tensor:
    """[1, H, L, D] -> [1, L, H, D]: one SDPA call over the whole micro-batch."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2)


class MaskSwitch:
    """The trainer's attention function, or ``masked_attention`` while ``use_mask`` is set (the mask of a
    micro-batch is built once and kept for its layers)."""

    def __init__(self) -> None:
        from backends.training import packed_attention

        self.inner, self.use_mask, self._mask = packed_attention._varlen_attention, False, (None, None)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        packed = kwargs.get("trajflow_packed")
        if not self.use_mask or packed is None:
            return self.inner(module, query, key, value, attention_mask, **kwargs)
        if self._mask[0] is not packed.spans:
            self._mask = (packed.spans, block_causal_mask(packed.spans.lengths, query.device))
        return masked_attention(query, key, value, self._mask[1], kwargs.get("scaling")), None


def layer_times(lengths, repeats: int, calls: int) -> dict:
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    heads, kv_heads, dim = SMOLLM2_135M["num_attention_heads"], SMOLLM2_135M["num_key_value_heads"], 64
    n = sum(lengths)
    q = torch.randn(1, heads, n, dim, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, dim, requires_grad=True) for _ in range(2))
    upstream = torch.randn(1, n, heads, dim)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    mask = block_causal_mask(lengths)

    def rows():
        outs, start = [], 0
        for length in lengths:
            end = start + length
            outs.append(sdpa_attention_forward(module, q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                               None, is_causal=True)[0])
            start = end
        return torch.cat(outs, dim=1)

    fns = {"rows": rows, "mask": lambda: masked_attention(q, k, v, mask)}
    with torch.no_grad():
        diff = float((fns["rows"]() - fns["mask"]()).abs().max())
    cpu_ms: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.process_time()
            for _ in range(calls):
                q.grad = k.grad = v.grad = None
                fn().backward(upstream)
            cpu_ms[name].append(round((time.process_time() - started) / calls * 1000, 3))
    return {"tokens": n, "rows": len(lengths), "max_output_diff": diff, "cpu_ms": cpu_ms,
            "cpu_ms_min": {k_: min(v_) for k_, v_ in cpu_ms.items()},
            "cpu_ms_median": {k_: statistics.median(v_) for k_, v_ in cpu_ms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed decoder rounds, one pass per variant each")
    ap.add_argument("--layer-repeats", type=int, default=7)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--update-rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from backends.modeling.loading import build_tiny_tokenizer
    from backends.training.config import TrainerConfig
    from backends.training.packed_attention import VARLEN
    from backends.training.token_rows import build_rows
    from backends.training.trainer import GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = {**SMOLLM2_135M, "num_hidden_layers": args.layers}
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).eval()
    cfg = TrainerConfig(learning_rate=2e-4, lora_rank=8, lora_alpha=16, seed=0)  # configs/default.yaml's trainer
    trainer = GRPOTrainer("bench", cfg, device="cpu", model=model, tokenizer=build_tiny_tokenizer())
    switch = MaskSwitch()
    AttentionInterface.register(VARLEN, switch)
    groups = arithmetic_groups(1, args.groups, args.group_size, shape["vocab_size"], 38, 16)
    rows, _ = build_rows(groups, max_row_tokens=cfg.max_row_tokens, overlong=cfg.overlong)
    batches = trainer._micro_batches(rows)

    layer = layer_times(list(batches[0].spans.lengths), args.layer_repeats, calls=10)
    print(json.dumps({"layer": layer}), flush=True)

    logprobs = {}
    with torch.no_grad():
        for variant in VARIANTS:
            switch.use_mask = variant == "mask"
            logprobs[variant] = trainer._token_logprobs(batches[0])[0]
    max_diff = float((logprobs["rows"] - logprobs["mask"]).abs().max())

    def decoder_pass():
        for mb in batches:
            trainer._hidden(mb).square().mean().backward()
        trainer.optimizer.zero_grad(set_to_none=True)

    def update():
        trainer.train_step(groups)

    timed: dict[str, dict[str, dict[str, list[float]]]] = {}
    trainer.model.train()
    for what, fn, rounds in (("decoder", decoder_pass, args.rounds), ("update", update, args.update_rounds)):
        timed[what] = {"cpu_s": {v: [] for v in VARIANTS}, "wall_s": {v: [] for v in VARIANTS}}
        for rnd in range(rounds + 1):
            for variant in (VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]):
                switch.use_mask = variant == "mask"
                cpu0, wall0 = time.process_time(), time.perf_counter()
                fn()
                cpu, wall = round(time.process_time() - cpu0, 3), round(time.perf_counter() - wall0, 3)
                if rnd:
                    timed[what]["cpu_s"][variant].append(cpu)
                    timed[what]["wall_s"][variant].append(wall)
                print(json.dumps({what: rnd, "variant": variant, "cpu_s": cpu, "wall_s": wall}), flush=True)

    summary = {"tokens_per_step": sum(b.tokens for b in batches), "micro_batches": len(batches),
               "rows_per_step": len(rows), "layer_cpu_ms_min": layer["cpu_ms_min"],
               "max_logprob_diff_rows_vs_mask": max_diff}
    for what, clocks in timed.items():
        for clock, by_variant in clocks.items():
            if all(by_variant.values()):
                summary[f"{what}_{clock}_min"] = {v: min(t) for v, t in by_variant.items()}
                summary[f"{what}_{clock}_median"] = {v: statistics.median(t) for v, t in by_variant.items()}
    out = {"summary": summary, "layer": layer, **timed,
           "command": "python benchmarks/packed_attention_cpu.py " + " ".join(sys.argv[1:]), "config": vars(args),
           "model_shape": shape,
           "environment": {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                           "load_average": list(os.getloadavg()), "machine": platform.machine()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
