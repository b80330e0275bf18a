"""TrainerConfig: every knob of the GRPO update, each with the trade-off it makes.

One pydantic model so the flow's parameters render as a form and a checkpoint records exactly what
produced it. Defaults follow ART where ART's choice is sound (CISPO, sequence-mean, std scaling)
and fix its gaps (one optimizer step per call with real gradient accumulation, exact resume).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# Per-loss clip defaults (epsilon, epsilon_high) used when the fields are left at None.
# CISPO: ART's [0, 5] importance-weight clip; PPO: DAPO's clip-higher; GSPO: the GSPO paper's values.
DEFAULT_EPSILONS: dict[str, tuple[float, float]] = {
    "cispo": (1.0, 4.0),
    "ppo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}

# micro_batch_tokens when unset, per device (see the field).
DEFAULT_MICRO_BATCH_TOKENS: dict[str, int] = {"cuda": 8192, "cpu": 512}

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def switch_from_bool(value):
    """An 'auto'/'on'/'off' switch given as a bool (YAML and `--set` read a bare on/off as one): True/False mean
    'on'/'off'; anything else is left for the field's own check."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


# Every auto/on/off field: `--set trainer.fused_lora=off` arrives as False and means "off".
Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(switch_from_bool)]


class TrainerConfig(BaseModel):
    """How one GRPO step turns scored trajectory groups into the next LoRA adapter."""

    model_config = ConfigDict(extra="forbid")

    # --- optimisation -------------------------------------------------------------------------
    learning_rate: float = Field(
        default=1e-5, gt=0,
        description="AdamW peak learning rate. LoRA tolerates 1e-5..1e-4; higher learns faster but drifts "
        "further from the sampler per step (more clipping, larger logprob mismatch).",
    )
    weight_decay: float = Field(
        default=0.0, ge=0,
        description="AdamW decoupled weight decay on the LoRA weights. ART forces 0.1 for RL; 0 keeps the "
        "adapter's magnitude purely reward-driven, >0 pulls it back toward the base model.",
    )
    adam_betas: tuple[float, float] = Field(
        default=(0.9, 0.99),
        description="AdamW (beta1, beta2). A lower beta2 (0.99 rather than 0.999) adapts faster to the "
        "non-stationary RL gradient at the cost of noisier second-moment estimates.",
    )
    adam_eps: float = Field(default=1e-8, gt=0,
                            description="AdamW epsilon; larger damps updates of rarely-used weights.")
    grad_clip: float | None = Field(
        default=1.0, gt=0,
        description="Clip the global gradient norm to this value (None: no clipping, norm still reported). "
        "Small values (ART uses 0.1) make steps steadier but slower to learn.",
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        default="constant",
        description="Learning-rate shape after warmup. 'constant' suits open-ended RL (no known end); "
        "'cosine'/'linear' decay to `min_lr_ratio*learning_rate` at total_steps and need total_steps.",
    )
    warmup_steps: int = Field(
        default=0, ge=0,
        description="Optimizer steps of linear warmup from 0 to learning_rate. Protects a fresh Adam state "
        "from large first updates; each warmup step learns less.",
    )
    total_steps: int | None = Field(
        default=None, ge=1,
        description="Length of the schedule in optimizer steps (required for cosine/linear). Steps beyond it "
        "stay at the final learning rate.",
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1,
        description="Final learning rate of a decaying schedule, as a fraction of learning_rate.",
    )
    seed: int = Field(
        default=0,
        description="Seeds the LoRA initialisation and the trainer's RNG (dropout). Same seed + same data = "
        "same adapter bytes on CPU.",
    )

    # --- LoRA -----------------------------------------------------------------------------------
    lora_rank: int = Field(
        default=8, ge=1, le=512,
        description="LoRA rank r (at most 512, the largest vLLM and the embedded engine serve). Higher can learn more "
        "per step but costs memory and compute and overfits small reward signals more easily.")
    lora_alpha: float = Field(
        default=16, gt=0,
        description="LoRA alpha; the update is scaled by alpha/r. Changing r without alpha changes the effective step "
        "size.")
    lora_dropout: float = Field(
        default=0.0, ge=0, lt=1,
        description="Dropout on the LoRA input. >0 regularises but makes the trainer's logprobs stochastic "
        "(a noisier importance ratio) and costs an extra activation copy per adapted layer.",
    )
    target_modules: Literal["all-linear"] | list[str] = Field(
        default="all-linear",
        description="Which linear layers get adapters: 'all-linear' (every projection except the output "
        "head, best quality) or a list of module names (e.g. attention only: cheaper, learns less).",
    )

    # --- objective --------------------------------------------------------------------------------
    loss: Literal["cispo", "ppo", "gspo"] = Field(
        default="cispo",
        description="Policy objective. 'cispo': `-sg(clip(ratio)) * A * logp`, every token keeps a gradient "
        "(ART's default). 'ppo': `-min(ratio*A, clip(ratio)*A)`, tokens outside the trust region get none. "
        "'gspo': PPO clip on the per-row geometric-mean ratio, steadier for long rows.",
    )
    epsilon: float | None = Field(
        default=None, ge=0,
        description="Lower clip width: ratio is clipped at 1-epsilon. None uses the loss's default "
        "(cispo 1.0, ppo 0.2, gspo 3e-4). Wider trusts stale/mismatched samples more.",
    )
    epsilon_high: float | None = Field(
        default=None, ge=0,
        description="Upper clip width: ratio is clipped at 1+epsilon_high. None uses the loss's default "
        "(cispo 4.0, ppo 0.28, gspo 4e-4). A higher upper bound (DAPO clip-higher) keeps exploration alive.",
    )
    aggregation: Literal["sequence_mean", "token_mean", "dr_grpo"] = Field(
        default="sequence_mean",
        description="How token losses sum to the step loss. 'sequence_mean': every trajectory weighs the "
        "same whatever its length (ART, original GRPO). 'token_mean': every trained token weighs the same "
        "(DAPO): long trajectories dominate. 'dr_grpo': token sum over a constant (dr_grpo_norm) per "
        "trajectory, no length bias in either direction; this is also the token-sum aggregation.",
    )
    dr_grpo_norm: int | None = Field(
        default=None, ge=1,
        description="Dr.GRPO's constant normaliser (tokens per trajectory). None uses max_row_tokens.",
    )
    scale_rewards: bool = Field(
        default=True,
        description="Divide group-centred rewards by the group's std (GRPO). Off (Dr.GRPO) keeps the reward "
        "scale, so groups with tiny reward differences get tiny updates instead of amplified noise.",
    )
    kl_coef: float = Field(
        default=0.0, ge=0,
        description="KL-shaped advantages against the reference policy (the base model = adapter switched "
        "off, no second model): `A_t += kl_coef * (mean(k) - k_t)`, `k_t = logp - logp_ref`. >0 keeps the "
        "policy near the base model; costs two extra no-grad forward passes per step.",
    )
    tis_cap: float | None = Field(
        default=None, gt=0,
        description="Truncated importance sampling: weight each token by min(pi_old/pi_sampler, tis_cap) "
        "with pi_old recomputed by the trainer, and take the objective's ratio against pi_old. Corrects "
        "train/inference numeric mismatch; None trusts the sampler's logprobs as pi_old.",
    )
    temperature: float = Field(
        default=1.0, gt=0,
        description="Sampling temperature of the rollouts. The trainer divides logits by it so its logprobs "
        "match what the sampler reported; a wrong value biases every importance ratio.",
    )

    # --- rows and batching --------------------------------------------------------------------------
    max_row_tokens: int = Field(
        default=8192, ge=2,
        description="Longest training row (prompt + completions + tool text). Longer rows are dropped or "
        "truncated (see overlong); a larger limit trains on long agents at more memory per micro-batch.",
    )
    overlong: Literal["drop", "truncate"] = Field(
        default="drop",
        description="Rows over max_row_tokens: 'drop' (ART; the reward may depend on the lost tail) or "
        "'truncate' (keep the first max_row_tokens; tokens after the cut get no gradient).",
    )
    micro_batch_tokens: int | None = Field(
        default=None, ge=2,
        description="Token budget of one forward/backward. Rows are packed without padding up to this many "
        "tokens (a longer row goes alone); gradients accumulate over all micro-batches into ONE optimizer "
        "step. Bigger is faster until memory runs out. None: 8192 on CUDA, 512 on the CPU, where the "
        "activations share host memory with everything else (SmolLM2-135M in float32 saves ~1.2 MB per token: "
        "8192 tokens would take ~10 GB; benchmarks/results/memory-cpu.md).",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute decoder layers in the backward pass instead of storing activations: much "
        "less memory per token, about a third more compute.",
    )
    checkpoint_layer_fraction: float = Field(
        default=1.0, gt=0, le=1,
        description="With gradient_checkpointing, the fraction of decoder layers that are recomputed (evenly "
        "spread). Lower trades memory back for speed. On an H200, 1.5B model, 16k-token micro-batches, GPU "
        "defaults, rows repeated from a warm-up: no checkpointing 41.2k tokens/s at 29.8 GiB, 0.25 38.0k at "
        "24.9 GiB (benchmarks/results/training-h200.md; new rows every step: 35.0k without checkpointing).",
    )
    memory_efficient_ops: Switch = Field(
        default="auto",
        description="Swap RMSNorm and SwiGLU (Llama/Qwen-style modules) for autograd functions that store "
        "only their inputs and recompute the rest in backward; with fused_lora the whole LoRA MLP becomes one "
        "op that stores half of stock's activations. Elementwise math compiled on CUDA; peft backend only. "
        "'auto': on for CUDA, off on CPU (CPU numerics stay identical to stock). See "
        "benchmarks/results/training-h200.md for tokens/s and peak memory with and without.",
    )
    fused_rope: Switch = Field(
        default="auto",
        description="Rotate q and k by the rotary embedding in ONE autograd op per attention layer (Llama, Qwen2, "
        "Qwen3, Mistral; backends/training/kernels/fused_rope.py): `q' = q cos + R(q) sin`, `R(x) = cat(-x2, x1)`, in "
        "float32, rounded once, on CUDA a Triton kernel (kernels/rope_triton.py: one launch for q and k each way, JIT-"
        "compiled in the warm-up; on the H200 0.093 ms each way against torch.compile's 0.219 / 0.237 ms, the same "
        "bits, and 50,030 / 50,205 tokens/s steady against 49,011 in one call); backward `g cos - R(g sin)`, "
        "keeping only cos and sin. Stock transformers runs 5 "
        "elementwise ops per tensor forward and 8 backward (a layer's 50 computing ops forward + backward become 24 on "
        "the CPU, the op counted as one kernel). Same function up to bf16 rounding (bit-identical "
        "in float32). An error at set-up if transformers' apply_rotary_pos_emb changed its signature or formula. "
        "peft backend only. 'auto': on wherever memory_efficient_ops is (on the H200 43,788 tokens/s steady against "
        "42,433 off in one call, +3.2%; benchmarks/results/training-h200.md).",
    )
    fused_lora: Switch = Field(
        default="auto",
        description="Run each LoRA linear as one fused op (scaling folded into B, the adds into the matrix "
        "products) instead of peft's four extra full-width passes; same function up to rounding, peft "
        "backend only. 'auto': on for CUDA, off on CPU (keeps CPU numerics identical to peft's). H200, 1.5B, "
        "16k-token micro-batches, no checkpointing: 35.7k vs 33.0k tokens/s (benchmarks/results/training-h200.md).",
    )
    cache_lora_casts: Switch = Field(
        default="auto",
        description="With fused_lora: make the compute-dtype copies of each LoRA A and `s*B` once per optimizer step "
        "(at the step's first micro-batch) instead of at every micro-batch (backends/training/kernels/"
        "lora_cast_cache.py: 3 small kernels per LoRA module and micro-batch less, for one bf16 copy of the adapter "
        "held during the step). Copies are keyed by the parameters' version counters and dropped at the end of "
        "the step, so a changed weight is never read stale. 'auto': on wherever fused_lora is.",
    )
    accumulate_lora_grads: Switch = Field(
        default="auto",
        description="With fused_lora: add each micro-batch's LoRA weight gradients straight into the float32 "
        ".grad in the matrix product's epilogue (addmm with a float32 output where torch has it, CUDA bf16) "
        "instead of returning bf16 products that are cast, scaled and added by autograd "
        "(backends/training/kernels/lora_grad_accumulation.py: per LoRA module and micro-batch 2 GEMMs instead "
        "of 2 GEMMs + 5 small kernels; the product is no longer rounded to bf16 before the sum). Gradient hooks "
        "on the LoRA parameters do not fire. 'auto': on wherever fused_lora is.",
    )
    fold_lora_b: Switch = Field(
        default="auto",
        description="With fused_lora: compute a LoRA linear as ONE product `[x | z] [W | (sB)_c]^T` (`z = x A^T`) "
        "instead of `x W^T` plus a rank-r `addmm_` that reads and writes all of y, and in backward get `g W` and "
        "`g (sB)_c` from one product (`backends/training/kernels/fold_lora_b.py`). Pays where the output is wider "
        "than the input: it writes `[x | z]` (a copy of x) to save a pass over y; each folded module's frozen weight "
        "moves once into an `[out, in + r]` buffer whose first columns are the weight (one copy: an engine started "
        "later reads it there; an engine started before keeps its own while the trainer lives). Same function up to "
        "rounding. 'auto': on CUDA, "
        "only modules where the y pass saved exceeds the copy paid (out > in + r: the MLP's gate and up at the 1.5B "
        "shape); 'on': every fusable module, CPU included; 'off': none. Off for every module while `fp8_base` is on "
        "(an fp8 base product and a folded bf16 one cannot share a GEMM).",
    )
    fold_lora_a: Switch = Field(
        default="auto",
        description="With fused_lora: compute a LoRA linear's input gradient as ONE product `[g | gz] [W ; A_c]` "
        "(`gz = g (sB)_c`, K = out + r) instead of `g W` plus a rank-r `addmm_` that reads and writes all of dx "
        "(`backends/training/kernels/fold_lora_a.py`); the forward is unchanged. Pays where the input is wider than "
        "the output: it writes `[g | gz]` (a copy of g) to save a pass over dx, net `2 T (in - out)` elements per "
        "module and micro-batch; each folded module's frozen weight moves once into an `[out + r, in]` buffer whose "
        "first rows are the weight (one copy, as for `fold_lora_b`). Same function up to rounding. 'on': modules "
        "where in > out + r (the MLP's down and k, v at the 1.5B shape: ~27.5 GB less moved per 24k-token "
        "micro-batch), never one `fold_lora_b` or `group_qkv` folded; 'auto': the same on CUDA (on the H200, "
        "24k-token micro-batches, one call: 46,916 tokens/s steady against 46,551 off, every step 0.4-1.3% faster, "
        "the same 39.0 GiB; benchmarks/results/training-h200.md); 'off': none. Off while `fp8_base` is on (an fp8 "
        "base product cannot take A's rows).",
    )
    low_rank_first: Switch = Field(
        default="auto",
        description="With fused_lora: an unfolded LoRA linear takes its sums in the other order, the rank-r product "
        "first and the base GEMM adding into it: `t = z (sB)_c^T + b; y = t + x W^T` (`t.addmm_(x, W^T)`) and in "
        "backward `t = gz A_c; dx = t + g W`, instead of the base product first and a rank-r `addmm_` (K = r) that "
        "reads and writes all of y or dx (`backends/training/kernels/fused_lora.py`). The same bytes on paper; the "
        "read of the output moves from a thin K = r product, far below memory bandwidth, into the epilogue of the "
        "compute-bound base GEMM (beta = 1). At the 1.5B shape with the CUDA defaults it reorders the forward of q, k, "
        "v, o, down and the input gradients of q, o (gate and up are folded by `fold_lora_b`; down, k, v's input "
        "gradients by `fold_lora_a`). Same function up to rounding. A module whose base product runs in FP8 "
        "(`fp8_base`: no C input) and the up projection's input gradient (added into gate's) keep today's order; with "
        "fp8_base on, only the modules left bf16 are reordered. 'auto': on on CUDA (on the H200, 24k-token "
        "micro-batches, one call: 47,605 tokens/s steady against 47,221 without it, steps 1-6 0-1.8% faster, step 0 3% "
        "slower, the same 39.0 GiB; benchmarks/results/training-h200.md); 'on': the CPU too; 'off': never.",
    )
    fused_swiglu_lora: Switch = Field(
        default="auto",
        description="With memory_efficient_ops and fused_lora: the lean SwiGLU MLP's backward elementwise kernel "
        "takes its rank-r products over [N, I] on the tiles it holds (Triton, `backends/training/kernels/"
        "swiglu_lora_triton.py`): dL/dg, dL/du and the sums behind dA_down, dB_gate, dB_up from one kernel that never "
        "writes h (the write of h and the reads of h, dL/dg, dL/du less: ~1.8 GB per layer and 24k-token "
        "micro-batch at the 1.5B shape; on the H200 0.78-0.93 ms against 1.01-1.06 ms unfused, "
        "`benchmarks/swiglu_lora_sweep.py`; the step 0.7% faster: 49,489 against 49,151 tokens/s steady in one "
        "call). Deterministic (per-split partials, no atomics); same function up to "
        "rounding. Runs where it can (CUDA, triton, bf16/fp16, one rank for the three, a power of two >= 16, down "
        "not folded by `fold_lora_b`, no fp8 module, all LoRA masters trained), else the torch path. The trainer's "
        "warm-up runs it, so its JIT compile happens there. 'auto': on CUDA.",
    )
    group_qkv: Switch = Field(
        default="off",
        description="With fused_lora: an attention layer's q, k and v projections, which read the same x, as ONE "
        "LoRA product: `z = x [A_q; A_k; A_v]^T`, `[q | k | v] = [x | z] W_qkv^T + b` with `W_qkv` the three "
        "weights stacked, each row block's `(sB)_c` in its own r of the 3r extra columns; backward `[dx | dz] = "
        "[g_q | g_k | g_v] W_qkv`, one GEMM (`backends/training/kernels/group_qkv.py`). q, k and v take 4 kernels "
        "forward instead of 9 and 9 backward instead of 17 (a packed attention layer with the CUDA defaults: 41 -> 28 "
        "aten ops on the CPU), one wide GEMM for three (k and v are 256 wide at the 1.5B shape), for a step that is "
        "host-bound in its launches; the cost is one copy of g (`[g_q | g_k | g_v]`) and of x (`[x | z]`) per layer. "
        "The three frozen weights and biases move once into one buffer (no second copy). Same function up to "
        "rounding; where a call cannot run grouped (adapter disabled, another dtype) each module runs alone. "
        "Llama, Qwen2, Qwen3, Mistral attention only; q, k, v are then never folded by `fold_lora_b`; off while "
        "`fp8_base` is on. 'auto': off: on the H200 (16k-token micro-batches, fresh processes) 43,506 tokens/s steady "
        "and 41,490 first in process against 42,660 / 42,074 off in the same call, within the steps' spread "
        "(benchmarks/results/training-h200.md).",
    )
    fp8_base: Switch = Field(
        default="off",
        description="With `fused_lora`: the frozen base products of every fusable LoRA linear (`x W^T` forward, `g W` "
        "backward) as FP8 GEMMs (`torch._scaled_mm`, e4m3, rowwise scales: x and g per token on the fly, W per output "
        "row and per input column, quantized once at set-up; `backends/training/kernels/fp8_base.py`). Hopper runs "
        "FP8 GEMMs at up to ~2x bf16, and these products are most of a step's FLOPs; the cost is the base product's "
        "accuracy (a few percent relative error per GEMM; `train/mismatch_kl` and the ratio stats show the trainer's "
        "logprobs against the sampler's) and two fp8 copies of the base weights (the bf16 weights' bytes once more). "
        "The LoRA terms and their gradients stay bf16; only the training forward/backward uses fp8: the KL reference "
        "and policy passes, the publish probe and any evaluation use the bf16 weights. `fold_lora_b` is off while this "
        "is on. 'on': needs `torch._scaled_mm` on the device (CUDA compute capability 8.9+ with dtype bfloat16, or "
        "the CPU) and `fused_lora`, else an error at set-up. 'auto': off. Measured on the H200 at the 1.5B shape "
        "(`benchmarks/results/training-h200.md`, run `fp8+warm-up`): 35.8k against the defaults' 43.8k tokens/s, "
        "33.0 GiB, trained tokens' logprobs 0.23 from bf16 on average: slower and inexact there.",
    )
    recompute_norm: Switch = Field(
        default="auto",
        description="With memory_efficient_ops and fused_lora: the fused LoRA ops that read an RMSNorm's output "
        "(q, k, v after input_layernorm, the MLP after post_attention_layernorm) keep the norm's own input x and "
        "rstd instead of its output `n = w * (x * rstd)`, and recompute n in backward with the forward's kernel "
        "(`backends/training/kernels/recompute_norm.py`): two [tokens, hidden] tensors per decoder layer less "
        "(a folded op keeps its rank-sized z instead of `[n | z]`), for one elementwise pass per norm in backward (its "
        "readers share it). "
        "Loss and gradients identical to 'off' (the same bits, compared on the CPU and on an H200). Qwen2.5-1.5B "
        "shape, bf16: 6,144 bytes per token and layer less (counted on the CPU: 61,624 -> 55,480; "
        "benchmarks/results/norm-recompute-cpu.md); on the H200 the peak of 16k-token micro-batches 30.2 -> 27.6 GiB "
        "for 2.3% of tokens/s (44,106 vs 45,132 steady, same call; then one pass per reading op, four a layer), "
        "and 24k-token micro-batches fit in 39.0 GiB (42.9 off) at 46,136 tokens/s steady, 45,873 first in process "
        "(benchmarks/results/training-h200.md). "
        "'auto': on wherever memory_efficient_ops and fused_lora both are (CUDA); never with fp8_base (its steps were "
        "not the same bits on the H200).",
    )
    chain_input_grads: Switch = Field(
        default="auto",
        description="With recompute_norm: the fused LoRA ops that read one RMSNorm output (q, k and v) sum their "
        "input gradients inside their GEMMs instead of returning three to autograd, which adds them in two passes "
        "over [tokens, hidden]: the first backward writes its dL/dn, each later one adds into it with beta = 1, and "
        "the norm's backward takes the sum (`backends/training/kernels/chain_input_grads.py`). Same function up to "
        "rounding; a reader whose output does not reach the loss adds nothing. 'auto': off (on the H200, 24k-token "
        "micro-batches, one call: 49,489 tokens/s steady with it against 49,545 without, its first steps 0.2-3% "
        "slower; benchmarks/results/training-h200.md); 'on': wherever recompute_norm is.",
    )
    compile_logprobs: Switch = Field(
        default="auto",
        description="torch.compile the per-chunk softmax statistics and gradient of the logprob projection "
        "(fused kernels that read each logits chunk once instead of several float32 passes); same formulas, "
        "equal up to reduction order. The first step pays the compile (~8 s on an H200); if compiling fails "
        "the eager code runs, with a warning. 'auto': on for CUDA, off on CPU (where compiling costs more "
        "than it saves on small models).",
    )
    warm_up: Switch = Field(
        default="auto",
        description="At set-up, run forward + backward on two synthetic packed micro-batches and drop the "
        "gradients (GRPOTrainer.warm_up: no step; adapter, optimizer and RNG untouched), so compiling the "
        "torch.compile'd kernels happens before the first step instead of inside it; with padded rows ('cudnn', "
        "'auto''s long micro-batches) also one attention forward + backward per padded length, so cuDNN's plans "
        "exist before step 0. 'auto': on for CUDA.",
    )
    compile_cache: Switch = Field(
        default="auto",
        description="Carry the torch.compile'd kernels' compiled code between processes through the run's storage "
        "(`compile-cache/<key>.bin`; backends/training/compile_cache.py): at set-up, before the warm-up, load the "
        "entry made for this torch, Triton, device, dtype, model and kernel settings; after the warm-up (or the "
        "first step without one) save this process's once, where no valid entry exists. A fresh machine's process "
        "then reads its compiles from the local cache instead of compiling (on the H200, a fresh process with empty "
        "local caches: 43.3 s from start to the first step done without the stored entry, 28.4 s with it; another "
        "lease 50.1 and 31.9 s; benchmarks/results/training-h200.md). A missing, corrupt or "
        "unwritable entry costs only the compile, with a warning. Only where the trainer is given a store (the "
        "flow's runs, LocalBackend). 'auto': on for CUDA, where the kernels are compiled.",
    )
    attention_kernel: Literal["auto", "varlen", "flash", "sdpa-default", "cudnn"] = Field(
        default="auto",
        description="Kernel of the packed rows' causal attention on CUDA (backends/training/packed_attention.py). "
        "'varlen': ONE FlashAttention varlen call per layer over all rows of a micro-batch "
        "(torch.nn.attention.varlen, torch >= 2.10, bf16/fp16; an error where it cannot run). 'flash': one SDPA "
        "call per row, PyTorch's FlashAttention-2 first, memory-efficient attention next, cuDNN and math last. "
        "'sdpa-default': one SDPA call per row in PyTorch's own order, which picks cuDNN attention on Hopper; "
        "cuDNN builds an execution plan for every new sequence length (~1.8 ms of host time per call, and GRPO "
        "rows are new lengths every step): benchmarks/results/training-h200.md. 'cudnn': one SDPA call per row, "
        "cuDNN first (then flash, efficient, math), each row zero-padded at its end to a multiple of "
        "attention_bucket so its plan is reused, and every bucket's plan built by the warm-up (exact: causal "
        "attention, the padding's outputs dropped). 'auto': where 'varlen' can run, chosen per micro-batch: 'cudnn' "
        "(bucketed rows) when the rows' quadratic mean length is at least long_row_tokens, 'varlen' otherwise "
        "(backends/training/attention_choice.py; per-row calls cost on short rows, cuDNN wins on long ones: "
        "its measurement as 'auto' on the H200 is still to do); 'flash' where varlen cannot run. The CPU "
        "ignores the kernel choice: one SDPA call per row (one call per layer with a block-diagonal mask was 3.7x "
        "slower per layer, the update 1.16x: benchmarks/results/packed-attention-cpu.md); 'cudnn' pads there too.",
    )
    attention_bucket: int = Field(
        default=512, ge=1,
        description="With attention_kernel 'cudnn', each packed row's attention runs on its length rounded up to "
        "a multiple of this: larger buckets mean fewer cuDNN plans to build in the warm-up (one attention "
        "forward + backward per multiple up to the micro-batch budget; a 16k budget at 512: 32, at 256: 64) but "
        "more attention over padding (up to bucket - 1 tokens a row). 1: no padding. Also the bucket of 'auto''s "
        "long micro-batches (long_row_tokens). Other kernels ignore it.",
    )
    long_row_tokens: int = Field(
        default=2048, ge=1,
        description="With attention_kernel 'auto' on CUDA (where varlen can run): a micro-batch whose rows' "
        "quadratic mean length sqrt(sum n^2 / rows) is at least this runs the 'cudnn' path (one SDPA call per row, "
        "cuDNN first, rows padded to attention_bucket), any other the 'varlen' one: what cuDNN saves grows with "
        "each row's n^2, what the per-row calls cost with their number (backends/training/attention_choice.py). "
        "On the H200, cuDNN's attention forward + backward was 1.5-1.8x faster than varlen on rows of 2k-16k "
        "tokens (also with a few short rows among them), while per-row calls made the update 7x slower on ~40-token "
        "rows (benchmarks/results/training-h200.md, varlen-h200.md, ragged-attention-h200.json). 2048: padding "
        "then adds at most 2b/T + (b/T)^2 = 56% to a long micro-batch's attention FLOPs at b = 512, below cuDNN's "
        "gain. Lower it to send more micro-batches to cuDNN, raise it to keep varlen.",
    )
    logprob_grad_in_forward: Switch = Field(
        default="auto",
        description="For a separable loss (cispo, ppo: each token's loss reads its own logprob alone), compute the "
        "loss' gradient through the output head in the logprob forward, chunk by chunk while the logits are there "
        "(backends/training/logprob_grad_in_forward.py): the backward no longer recomputes each chunk's [chunk, V] "
        "logits, and dL/dh is kept instead of h (the same size). The same loss, stats and gradients (float32: the "
        "same bits on the CPU tests). gspo keeps the recomputing backward whatever this says. 'auto': on the CPU "
        "(where the saved product dominates: 5.1 against 6.6 s for the op at a 151,936-token vocabulary, "
        "benchmarks/results/logprob-head-grad-cpu.json), off on CUDA (on the H200, 24k-token micro-batches, one "
        "call: 49,489 tokens/s steady with it against 49,541 without, its first steps 0-3% slower: the chunk's loss "
        "and its autograd, 44 times a micro-batch, cost what the product saved; benchmarks/results/training-h200.md).",
    )
    logprob_chunk: int = Field(
        default=1024, ge=1,
        description="Tokens per chunk when projecting hidden states onto the vocabulary: logits exist for "
        "one chunk at a time (chunk x vocab floats), never for the whole micro-batch.",
    )

    # --- runtime ----------------------------------------------------------------------------------------
    backend: Literal["auto", "peft", "unsloth"] = Field(
        default="auto",
        description="'peft': transformers + peft with trajflow's packing and lean/fused ops. 'unsloth': load "
        "through Unsloth (CUDA only; error if missing; one row per micro-batch). 'auto': Unsloth when importable "
        "on CUDA, else peft. The loss is the same either way. H200, 1.5B, 16k-token rows: peft 36-41k tokens/s "
        "at 25-30 GiB; Unsloth 25-35k at 29 GiB, or 19.8k at 5.5 GiB with its offloaded checkpointing "
        "(benchmarks/results/training-unsloth-h200.md): choose 'peft' for speed, 'unsloth' for memory.",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        default="auto",
        description="Base-model dtype. 'auto': bfloat16 on CUDA, float32 on CPU (CPU bf16 is slow and "
        "lossy). LoRA weights and optimizer state stay float32 either way.",
    )

    # Settings that may not change, from the most baked-in out. Each set contains the one before it.
    # The adapter's shape: saved LoRA weights load only into a model wrapped with the same rank, alpha and targets
    # (a trainer checkpoint is refused under others).
    ADAPTER_SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ("lora_rank", "lora_alpha", "target_modules")
    # What a run's adapter IS: the shape plus what makes its bytes reproducible (LoRA init and dropout seed, dropout
    # rate). A run refuses to resume under other values; any other trainer setting (a new learning rate, another
    # machine's batching or checkpointing) may change, and the flow logs it.
    IDENTITY_FIELDS: ClassVar[tuple[str, ...]] = ADAPTER_SHAPE_FIELDS + ("lora_dropout", "seed")
    # Baked into a live trainer when it is built (the model's dtype and loader, checkpointed layers, swapped modules):
    # GRPOTrainer.update_config refuses to change them; a new trainer takes them.
    CONSTRUCTION_FIELDS: ClassVar[tuple[str, ...]] = IDENTITY_FIELDS + (
        "backend", "dtype", "gradient_checkpointing", "checkpoint_layer_fraction", "memory_efficient_ops", "fused_lora",
        "accumulate_lora_grads", "fold_lora_b", "fold_lora_a", "group_qkv", "fp8_base", "fused_rope", "recompute_norm",
        "low_rank_first", "chain_input_grads", "fused_swiglu_lora")

    # What the compiled kernels' code depends on among the settings: the compile cache's key (compile_cache).
    COMPILE_FIELDS: ClassVar[tuple[str, ...]] = tuple(f for f in CONSTRUCTION_FIELDS if f != "seed") + (
        "cache_lora_casts", "compile_logprobs", "logprob_chunk", "temperature", "logprob_grad_in_forward")

    # Switches of the fused LoRA op's work around its products: nothing without fused_lora.
    FUSED_LORA_SWITCHES: ClassVar[tuple[str, ...]] = ("cache_lora_casts", "accumulate_lora_grads")

    @classmethod
    def identity_changes(cls, stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
        """``"field: stored -> current"`` for each IDENTITY_FIELDS entry that `stored` (a saved config's JSON) has
        and `current` differs in; a field the stored config lacks (written by an older version) is no change."""
        return [f"{k}: {stored[k]!r} -> {current.get(k)!r}" for k in cls.IDENTITY_FIELDS
                if k in stored and stored[k] != current.get(k)]

    @model_validator(mode="after")
    def _schedule_has_length(self) -> TrainerConfig:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps")
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules is an empty list; use 'all-linear' or name modules")
        return self

    def enabled(self, switch: str, on_cuda: bool) -> bool:
        """An 'auto'/'on'/'off' speed switch resolved for a device: 'on', or 'auto' on CUDA; chain_input_grads only
        with recompute_norm (the readers' sum lives on what they share). The fused LoRA op's own
        switches (``FUSED_LORA_SWITCHES``) act only with fused_lora, and their 'auto' follows it; fold_lora_b and
        fold_lora_a act only with fused_lora too, their 'auto' on CUDA, and never with fp8_base; fp8_base and group_qkv
        only with fused_lora, and only when 'on' ('auto' is off until measured), group_qkv never with fp8_base;
        low_rank_first only with fused_lora, its 'auto' on CUDA, with fp8_base too (its fp8 modules keep their order
        in the op itself);
        recompute_norm only with memory_efficient_ops and fused_lora, its 'auto' on CUDA, never with fp8_base;
        fused_swiglu_lora only with memory_efficient_ops and fused_lora, its 'auto' on CUDA; chain_input_grads only
        when 'on' (its 'auto' is off: measured no faster); logprob_grad_in_forward's 'auto' on the CPU only."""
        mode = getattr(self, switch)
        if switch == "fused_swiglu_lora" and not (self.enabled("memory_efficient_ops", on_cuda)
                                                  and self.enabled("fused_lora", on_cuda)):
            return False
        if switch == "chain_input_grads" and not self.enabled("recompute_norm", on_cuda):
            return False
        if switch == "recompute_norm" and not (self.enabled("memory_efficient_ops", on_cuda)
                                               and self.enabled("fused_lora", on_cuda)
                                               and not self.enabled("fp8_base", on_cuda)):
            return False
        if switch in self.FUSED_LORA_SWITCHES:
            return self.enabled("fused_lora", on_cuda) and mode != "off"
        if switch == "low_rank_first":
            return self.enabled("fused_lora", on_cuda) and (mode == "on" or (mode == "auto" and on_cuda))
        if switch in ("fp8_base", "group_qkv"):
            return (mode == "on" and self.enabled("fused_lora", on_cuda)
                    and (switch != "group_qkv" or not self.enabled("fp8_base", on_cuda)))
        if switch in ("fold_lora_b", "fold_lora_a") and (not self.enabled("fused_lora", on_cuda)
                                                         or self.enabled("fp8_base", on_cuda)):
            return False
        if switch == "logprob_grad_in_forward":
            return mode == "on" or (mode == "auto" and not on_cuda)
        if switch == "chain_input_grads":
            return mode == "on"
        return mode == "on" or (mode == "auto" and on_cuda)

    def micro_batch_budget(self, on_cuda: bool) -> int:
        """``micro_batch_tokens``, or its default for the device when it is None."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return DEFAULT_MICRO_BATCH_TOKENS["cuda" if on_cuda else "cpu"]

    def clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with the per-loss defaults filled in."""
        low, high = DEFAULT_EPSILONS[self.loss]
        eps = low if self.epsilon is None else self.epsilon
        eps_high = (high if self.epsilon is None else eps) if self.epsilon_high is None else self.epsilon_high
        return eps, eps_high
