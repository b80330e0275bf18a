"""The embedded engine's settings (`EngineConfig`): sizes, and the switches of its speed paths with their measured
effect. Light to import (pydantic only), so a run's config can check them without loading torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """Sizes and switches of the embedded engine (defaults depend on the device where marked)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(64, ge=1, le=4096, description=(
        "Sequences decoded together (KV-cache slots). Higher raises throughput under load; costs KV memory "
        "(allocated up front on CUDA, as used on the CPU) and a little per-step latency."))
    max_seq_len: int | None = Field(None, ge=16, description=(
        "Longest prompt + completion, in tokens. Default: the model's context, capped at 4096 on the CPU and 8192 "
        "on CUDA. Longer costs KV memory on CUDA."))
    max_loras: int = Field(4, ge=1, le=64, description=(
        "Adapters resident on the device, i.e. how many one batch can mix (vLLM's --max-loras). More slots cost "
        "a little compute for every LoRA row; a request whose adapter finds no free slot waits."))
    max_cpu_loras: int = Field(16, ge=1, description=(
        "Registered adapters whose weights stay in host memory; others are re-read from their local copy."))
    max_lora_rank: int = Field(64, ge=1, le=512, description="Largest LoRA rank accepted (vLLM's --max-lora-rank).")
    prefill_token_budget: int | None = Field(None, ge=1, description=(
        "Padded prompt tokens prefilled together in one iteration (default 4096 CPU / 16384 CUDA). Larger admits "
        "bursts faster; smaller keeps running sequences' step latency even."))
    admission_wait_steps: int | None = Field(None, ge=0, le=1024, description=(
        "While sequences decode, waiting requests are admitted (one prefill, which pauses every running sequence for "
        "a forward) once the oldest of them has waited this many decode steps, or at once when nothing is decoding "
        "or they fill the free slots or the prefill budget; 0 admits at the next step. Requests that arrive a few at "
        "a time (closed-loop clients send the next request when an answer is back) then share one prefill instead of "
        "pausing the batch once each; the price is up to this many steps of a newcomer's time to first token (the "
        "idea of vLLM V0's scheduler delay factor). Default: 4 on CUDA (a few ms there), 0 on the CPU, where a decode "
        "step costs tens of ms and a prefill's cost grows with its tokens."))
    cuda_graphs: bool | None = Field(None, description=(
        "Replay decode steps from CUDA graphs (default: on for CUDA). Removes per-kernel launch overhead; costs a "
        "capture (~0.1-1 s) per new (batch, length) bucket."))
    fuse_projections: bool | None = Field(None, description=(
        "Run q/k/v and gate/up as one matmul each (default: on for CUDA). Fewer kernels; copies those weights."))
    fuse_lora_a: bool | None = Field(None, description=(
        "Compute LoRA's A in the base matmul of each projection group (its columns appended to the weight; implies "
        "fuse_projections). One kernel fewer per group and layer in every LoRA step; copies the o/down weights "
        "too. Default: on for CUDA (H200, 0.5B, rank 16: decode step 2.51 -> 2.08 ms at batch 1, same logprobs; "
        "benchmarks/results/engine-decode-h200.md)."))
    compile_decode: bool | None = Field(None, description=(
        "torch.compile (Inductor) a decode step's per-layer pointwise work, inside the CUDA graph: fewer kernels "
        "per step. Compiles at engine start (seconds to a minute; cached on disk for the next start); runs eagerly "
        "if compiling fails. Default: off (H200, 0.5B: 2.08 -> 1.90 ms at batch 1 with fuse_lora_a, but 5.7 s of "
        "compiles at start and logprobs that differ from the eager step by up to 0.105 in bf16, which the publish "
        "probe's tolerance would have to absorb)."))
    overlap_decode: bool | None = Field(None, description=(
        "Launch decode step t+1 before the host bookkeeping of step t (its tokens go from step t's output to step "
        "t+1's input on the device), so the device computes while the host accepts; a sequence that stops at step t "
        "computes one discarded row in step t+1. Same completions as without. Admitting new requests waits for the "
        "step in flight. Default: on where decode steps are CUDA graphs on CUDA, off on the CPU (there the device is "
        "the same cores: nothing to overlap)."))
    single_slot_lora: bool = Field(True, description=(
        "A decode step whose rows all use one adapter (a GRPO step: every row on the current policy) reads only that "
        "LoRA slot's columns: no per-row masks and no select (masked_fill_) per projection group, so 4 kernels fewer "
        "per layer plus the step's 4 mask kernels (~100 of ~664 per step on the 24-layer 0.5B shape); costs one more "
        "CUDA graph per (batch, length) bucket and slot in use. A prefill whose rows all use one adapter reads its "
        "slot alone the same way. Mixed steps (several adapters, or base rows) keep the masked path. Same logprobs up to float rounding (the LoRA GEMMs sum over one slot's columns instead of "
        "all of them). H200, 0.5B, rank 16: 662 -> 562 kernels, 2.07 -> 1.91 ms at batch 1, 4.42 -> 4.04 ms at batch "
        "256, same logprobs (benchmarks/results/engine-decode-single-slot-h200.md)."))
    merged_single_adapter: bool = Field(False, description=(
        "A decode step whose rows all use one adapter runs the base model's no-LoRA forward on a copy of the "
        "projection weights with that adapter merged in, W' = dtype(W + B A * scale) (`merged_weights`): no LoRA "
        "kernels at all, so it should cost what the no-LoRA step does (H200, 0.5B, batch 1: 1.61 ms, 1.34 ms with "
        "compile_decode, against 1.91 ms for the one-slot LoRA step; merged: 1.65 ms, 1.35 ms with compile_decode, "
        "benchmarks/results/engine-decode-merged-h200.md). The copy is rebuilt "
        "in place when a step needs another slot or a new adapter in its slot (once per policy update in GRPO; "
        "stats merge_rebuilds, merge_seconds); one more CUDA graph per bucket, whatever the slot. Costs the memory "
        "of the LoRA'd projections once more (all seven of every layer: 0.72 GB in bf16 for the 0.5B shape), and "
        "one rounding more: W' is rounded to the serving dtype where the LoRA path rounds x W and x A (float32: "
        "logprobs within 1e-6 on tiny-random; bf16: within 0.016; the H200 at batch 1: up to 0.13). A prefill whose "
        "rows all use one adapter runs on the copy too (rebuilt for it if need be), so a request's numbers do not "
        "depend on what ran before it; mixed steps and base rows keep the LoRA paths. Off by default: the copy is most of the model's weights at any size."))
    adapter_cache_dir: str | None = Field(None, description=(
        "Where adapters fetched from storage URIs are copied (default: <trajflow cache>/adapters)."))
