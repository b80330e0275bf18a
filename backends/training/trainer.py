"""GRPOTrainer: scored trajectory groups in, one LoRA optimizer step out.

One ``train_step(groups)`` call is exactly one optimizer step:

1. rows from the exact sampled tokens (``token_rows.build_rows``), group advantages, counts of what was
   left out; no trainable row at all -> metrics with ``no_trainable_rows=1`` and NO step;
2. aggregation weights fixed for the whole step (``losses.assign_aggregation_weights``), so the
   micro-batch gradients add up to the full-batch gradient;
3. rows packed without padding into micro-batches of ``micro_batch_tokens`` (``packing``; 512 on the CPU by default,
   where each micro-batch's freed activations go back to the OS before the next: ``backends.modeling.host_memory``);
4. optional KL shaping: a no-grad pass with the adapter on and one with it off (peft's
   ``disable_adapter()``: the base model is the reference, no second copy in memory);
5. per micro-batch: its packing (step 3 plans the bins; each is packed just before its forward, while the GPU still
   runs the previous micro-batch's backward), decoder hidden states, chunked logprobs of the trained tokens only, the
   loss, backward (gradients accumulate); nothing waits for the device until the last micro-batch and the gradient
   norm are launched, when the norm and every micro-batch's metrics are read in one transfer
   (tests/unit/backends/training/test_host_syncs.py);
6. gradient norm (clipped), AdamW step (with CUDA's fused AdamW queued before the host reads the metrics, skipped on
   the device where the loss or the norm is not finite: ``guarded_step``), LR schedule step.

Each phase is a profiler range (``step_phases``: prepare, one per micro-batch, update), so a profile places every
kernel and every idle gap of the GPU in one (``benchmarks/profile_gaps.py``).

Data-parallel (a rank of a torchrun job, ``backends/training/distributed.py``): steps 1-2 see every row, step 3
packs only this rank's share, and the LoRA gradients and the step's sums are summed over the ranks before step 6,
so every rank takes the one-process step.

The model is transformers + peft LoRA (or Unsloth's loader on CUDA, same loss). LoRA weights and
the optimizer state are float32; the base model is bf16 on CUDA (under autocast) and fp32 on CPU, its weights
shared with an engine of the same process (``backends.modeling.shared_weights``).
On CUDA, by default, each LoRA linear runs as one fused op, the LoRA SwiGLU MLP and RMSNorm as lean
ops with compiled elementwise kernels, and the logprob chunk math is compiled
(``TrainerConfig.fused_lora``, ``memory_efficient_ops``, ``compile_logprobs``); the fused ops make their bf16 copies
of the LoRA weights once per step and add their weight gradients straight into the fp32 ``.grad``
(``cache_lora_casts``, ``accumulate_lora_grads``), and where a projection's output is wider than its input, fold
LoRA's B product into the base product (``fold_lora_b``), where its input is wider LoRA's A into the base
input-gradient product (``fold_lora_a``), run an unfolded LoRA linear's rank-r product first with the base GEMM adding
into it (``low_rank_first``), keep an RMSNorm's inputs instead of its output where they read it (``recompute_norm``),
and take the LoRA SwiGLU MLP's rank-r sums in its backward elementwise kernel (``fused_swiglu_lora``). Opt-in, an
attention layer's q, k and v run as one LoRA product (``group_qkv``), the ops that read one norm output sum their input
gradients in their GEMMs (``chain_input_grads``), and the frozen base products of the training forward and backward
run as FP8 GEMMs (``fp8_base``): only inside ``fp8_scope``, which the step enters around its training micro-batches
(and the warm-up), never around the KL passes, ``sequence_logprobs`` or ``greedy_tokens``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import random
import resource
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from agents.trajectory import TrajectoryGroup
from backends.modeling.host_memory import release_freed_memory
from backends.modeling.intra_op_threads import single_thread_on_cpu
from backends.modeling.logits import logits_fp32
from backends.training.advantages import kl_shaping
from backends.training.checkpoint import check_compatible, read_checkpoint, restore_rng, write_checkpoint
from backends.training.compile_cache import ArtifactStore, CompileCache, key_fields
from backends.training import distributed
from backends.training.config import TrainerConfig
from backends.training.draft_verification import verified_greedy
from backends.training.guarded_step import guards, queue_guarded_step
from backends.training.kernels.fold_lora_a import fold_model_rows
from backends.training.kernels.fold_lora_b import fold_model
from backends.training.kernels.fp8_base import Fp8Scope, available, copies_nbytes, quantize_model
from backends.training.kernels.fused_lora import LoraRuntime, fusable_parts, patch_lora
from backends.training.kernels.group_qkv import group_model
from backends.training.kernels.lora_cast_cache import CastCache
from backends.training.kernels import fused_rope
from backends.training.kernels.lean_ops import patch_model
from backends.training.logprobs import chunked_logprobs
from backends.training.logprob_grad_in_forward import logprobs_with_head_grad
from backends.training.losses import (
    SEPARABLE_LOSSES,
    LossResult,
    assign_aggregation_weights,
    policy_loss,
    weighted_token_losses,
)
from backends.training.attention_choice import AttentionChoice
from backends.training.packed_attention import (PackedAttention, build_row_plans, install_varlen_attention,
                                               packed_forward, prepared_mask)
from backends.training.packing import MicroBatch, make_micro_batch, plan_bins
from backends.training.step_phases import MICRO_BATCH, PREPARE, UPDATE, phase
from backends.training.token_rows import TrainingRow, build_rows
from backends.training.unsloth_loader import choose_backend, load_with_unsloth

log = logging.getLogger("trajflow")


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def lr_factor(config: TrainerConfig, taken: int) -> float:
    """Multiplier of learning_rate for the optimizer step after ``taken`` steps: linear warmup, then the schedule."""
    if config.warmup_steps and taken < config.warmup_steps:
        return (taken + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, max(0.0, (taken - config.warmup_steps) / span))
    low = config.min_lr_ratio
    if config.lr_schedule == "cosine":
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
    return low + (1 - low) * (1 - progress)


class _StepStats:
    """Sums over micro-batches, turned into the step's metrics."""

    def __init__(self) -> None:
        self.loss = self.tokens = self.clipped = self.ratio_sum = self.k3 = self.absdiff = 0.0
        self.tis = self.entropy = 0.0
        self.ratio_min, self.ratio_max = math.inf, -math.inf
        self.micro_batches = 0

    @staticmethod
    def read(done, extra: Sequence[torch.Tensor] = ()) -> tuple[list[dict[str, float]], list[float]]:
        """Each micro-batch's loss, entropy sum and ``LossResult`` sums (``done``: (res, entropy_sum) pairs) and the
        scalars ``extra``, read from the device in ONE transfer for the whole step."""
        if not done and not extra:  # data-parallel: a rank with no rows this step
            return [], []
        names = ("loss", "entropy", *LossResult.NAMES)
        flat = torch.cat([torch.cat([res.loss.detach().float().reshape(1), entropy_sum.float().reshape(1),
                                     res.stats.float()]) for res, entropy_sum in done]
                         + [t.detach().float().reshape(1) for t in extra]).tolist()
        n = len(names)
        return [dict(zip(names, flat[k * n:(k + 1) * n])) for k in range(len(done))], flat[len(done) * n:]

    def add(self, values: dict[str, float], tokens: int) -> None:
        """One micro-batch's values (``read``) and trained-token count."""
        self.loss += values["loss"]
        self.tokens += tokens
        self.clipped += values["clipped"]
        self.ratio_sum += values["ratio_sum"]
        self.ratio_min = min(self.ratio_min, values["ratio_min"])
        self.ratio_max = max(self.ratio_max, values["ratio_max"])
        self.k3 += values["mismatch_k3_sum"]
        self.absdiff += values["mismatch_abs_sum"]
        self.tis += values["tis_weight_sum"]
        self.entropy += values["entropy"]
        self.micro_batches += 1

    def all_reduce(self, params) -> None:
        """Data-parallel: sum the LoRA gradients of `params` and these sums over the ranks, so every rank holds the
        step's gradient and totals."""
        names = ("loss", "tokens", "clipped", "ratio_sum", "k3", "absdiff", "tis", "entropy", "micro_batches")
        sums, (neg_min, top) = distributed.all_reduce_step(
            params, [getattr(self, n) for n in names], [-self.ratio_min, self.ratio_max])
        for name, value in zip(names, sums):
            setattr(self, name, value)
        self.tokens, self.micro_batches = int(self.tokens), int(self.micro_batches)
        self.ratio_min, self.ratio_max = -neg_min, top

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        return {
            "loss": self.loss,
            "entropy": self.entropy / n,
            "clip_fraction": self.clipped / n,
            "ratio_mean": self.ratio_sum / n,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
            "mismatch_kl": self.k3 / n,
            "mismatch_abs_diff": self.absdiff / n,
            "tis_weight_mean": self.tis / n,
        }


class GRPOTrainer:
    """LoRA GRPO trainer over exact-token rows; see the module docstring for one step's anatomy."""

    def __init__(self, base_model: str, config: TrainerConfig | None = None, device: str = "cpu", model=None,
                 tokenizer=None, compile_cache: ArtifactStore | None = None):
        """``compile_cache``: where compiled kernels persist between processes (the run's storage:
        ``storage.compile_cache.StoreCompileCache``); None keeps only the local inductor caches. Used where
        ``TrainerConfig.compile_cache`` is on."""
        from peft import LoraConfig, PeftModel, get_peft_model

        self.config = config = config or TrainerConfig()
        self.base_model = str(base_model)
        self.device = torch.device(device)
        self.dtype = _dtype(config.dtype, device)
        self.backend = choose_backend(config.backend, device)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        if self.backend == "unsloth":
            from backends.modeling.loading import resolve_model

            self.model, self.tokenizer = load_with_unsloth(str(resolve_model(base_model).path), config, self.dtype)
        else:
            if model is None:
                from backends.modeling.loading import load_model

                # the base weights an engine of this process holds, if any: peft leaves them untouched
                model, tokenizer, _ = load_model(base_model, device=device, dtype=self.dtype, shared=True)
            elif tokenizer is None:
                raise ValueError("pass the tokenizer together with the model")
            if not isinstance(model, PeftModel):
                lora = LoraConfig(
                    r=config.lora_rank,
                    lora_alpha=config.lora_alpha,
                    lora_dropout=config.lora_dropout,
                    target_modules=config.target_modules,
                    bias="none",
                    task_type="CAUSAL_LM",
                )
                model = get_peft_model(model, lora)
            self.model, self.tokenizer = model, tokenizer
        self._lm = self.model.get_base_model()
        self._lm.config.use_cache = False
        self.packed = self.backend == "peft" and install_varlen_attention(self._lm)
        self._choose_attention(config)
        on_cuda, peft_path = self.device.type == "cuda", self.backend == "peft"
        fused, lean = config.enabled("fused_lora", on_cuda), config.enabled("memory_efficient_ops", on_cuda)
        # the fused ops' cast copies, reused inside a step's scope (lora_casts_scope) only
        self.lora_casts = CastCache()
        # where the quantized base weights run in FP8: the training micro-batches' scope (fp8_scope) only
        self.fp8 = self._fp8_scope(config, fused and peft_path)
        # the fused ops that read a norm's output keep the norm's inputs instead (recompute_norm)
        self.recompute_norm = peft_path and config.enabled("recompute_norm", on_cuda)
        # and sum their input gradients in their GEMMs, the norm's backward taking the sum (chain_input_grads)
        self.chain_input_grads = self.recompute_norm and config.enabled("chain_input_grads", on_cuda)
        runtime = LoraRuntime(self.lora_casts, config.enabled("accumulate_lora_grads", on_cuda), self.fp8,
                              config.enabled("low_rank_first", on_cuda), self.chain_input_grads,
                              config.enabled("fused_swiglu_lora", on_cuda))
        self.patched_ops = (patch_model(self._lm, compile=on_cuda, fuse_lora=fused, runtime=runtime,
                                        recompute_norm=self.recompute_norm) if lean and peft_path else {})
        self.fused_rope_layers = (fused_rope.patch_model(self._lm, compile=on_cuda)
                                  if peft_path and fused_rope.enabled(config.fused_rope, lean) else 0)
        self.fused_lora_layers = patch_lora(self.model, runtime) if fused and peft_path else 0
        # before folding: grouped q, k, v hold their own buffer, so fold_model leaves them alone
        self.grouped_qkv_layers = (group_model(self._lm, fusable_parts)
                                   if fused and peft_path and config.enabled("group_qkv", on_cuda) else 0)
        self.folded_lora_layers = (fold_model(self._lm, fusable_parts, only_where_it_pays=config.fold_lora_b == "auto")
                                   if peft_path and config.enabled("fold_lora_b", on_cuda) else 0)
        # after both: a module folded on the output side (or grouped) is never row-folded
        self.row_folded_lora_layers = (fold_model_rows(self._lm, fusable_parts)
                                       if peft_path and config.enabled("fold_lora_a", on_cuda) else 0)
        self.fp8_lora_layers = quantize_model(self._lm, fusable_parts) if self.fp8 is not None else 0
        if self.fp8 is not None:
            log.info("fp8_base: %d LoRA linears' base weights quantized, %.2f GB of fp8 copies", self.fp8_lora_layers,
                     copies_nbytes(self._lm) / 1e9)
        if self.device.type == "cuda" and self.dtype != torch.float32:
            for m in self.model.modules():  # autocast runs LoRA in bf16: no per-layer fp32 copies of inputs
                if hasattr(m, "cast_input_dtype_enabled"):
                    m.cast_input_dtype_enabled = False
        if config.gradient_checkpointing and self.backend == "peft":
            self._enable_checkpointing(config.checkpoint_layer_fraction)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable (LoRA) parameters")
        for p in params:  # master weights in fp32 whatever the base dtype
            if p.dtype != torch.float32:
                p.data = p.data.float()
        self._params = params
        distributed.broadcast_parameters(params)  # data-parallel: every rank starts from rank 0's adapter
        self.optimizer = torch.optim.AdamW(
            params, lr=config.learning_rate, betas=tuple(config.adam_betas), eps=config.adam_eps,
            weight_decay=config.weight_decay, **({"fused": True} if self.device.type == "cuda" else {}),
        )

        def schedule(taken: int) -> float:
            return lr_factor(self.config, taken)

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.step = 0
        self.metrics_history: list[dict[str, float]] = []
        self.vocab_size = int(self._lm.get_output_embeddings().weight.shape[0])
        self.warm_up_runs: dict[str, int] = {}
        self.compile_cache = self._load_compile_cache(config, compile_cache)
        self.warm_up_s = self.warm_up() if config.enabled("warm_up", self.device.type == "cuda") else 0.0

    def _load_compile_cache(self, config: TrainerConfig, store: ArtifactStore | None) -> CompileCache | None:
        """The compile cache of this trainer's key in ``store``, its entry loaded (``compile_cache``); None where the
        switch is off or there is no store."""
        if store is None or not config.enabled("compile_cache", self.device.type == "cuda"):
            return None
        settings = {k: getattr(config, k) for k in TrainerConfig.COMPILE_FIELDS}
        cache = CompileCache(store, key_fields(self.device, self.dtype, settings, self._lm.config.to_dict()))
        cache.load()
        return cache

    def _save_compile_cache(self) -> None:
        """After the first compiles (the warm-up, or the first step without one): rank 0 stores them once."""
        if self.compile_cache is None:
            return
        self.compile_cache.save(write=distributed.world()[0] == 0)
        self.warm_up_runs.update(self.compile_cache.runs)

    def _fp8_scope(self, config: TrainerConfig, fused_peft: bool) -> Fp8Scope | None:
        """The FP8 scope where ``fp8_base`` is on, else None; 'on' where it cannot run is an error naming why."""
        if config.fp8_base != "on":
            return None
        if not fused_peft:
            raise ValueError(f"fp8_base 'on' needs the fused LoRA ops (fused_lora 'on', or 'auto' on CUDA, and the "
                             f"peft backend); got fused_lora={config.fused_lora!r}, backend {self.backend!r} on "
                             f"{self.device}")
        reason = available(self.device)
        if reason is None and self.device.type == "cuda" and self.dtype != torch.bfloat16:
            reason = (f"fp8_base 'on' needs dtype bfloat16 on {self.device} (rowwise FP8 GEMMs write bf16), "
                      f"not {self.dtype}")
        if reason is not None:
            raise RuntimeError(reason)
        return Fp8Scope(compile=self.device.type == "cuda")

    def fp8_scope(self):
        """Where the quantized base weights run as FP8 GEMMs (``fp8_base``): the training micro-batches' forwards and
        backwards; everything outside it (KL passes, probe, evaluation) reads the bf16 weights."""
        return self.fp8.scope() if self.fp8 is not None else contextlib.nullcontext()

    def update_config(self, **overrides) -> TrainerConfig:
        """Change settings for the following steps (learning rate, loss, clip, aggregation, KL, batching...).

        The optimizer's hyper-parameters and the schedule's base rate follow; ``TrainerConfig.CONSTRUCTION_FIELDS``
        (adapter shape, seed, dtype, backend, checkpointing, swapped modules) cannot change on a live trainer: error.
        """
        new = TrainerConfig.model_validate({**self.config.model_dump(), **overrides})
        fixed = [f"{k}: {getattr(self.config, k)!r} -> {getattr(new, k)!r}"
                 for k in TrainerConfig.CONSTRUCTION_FIELDS if getattr(new, k) != getattr(self.config, k)]
        if fixed:
            raise ValueError("cannot change on a live trainer (start a new one): " + "; ".join(fixed))
        self._choose_attention(new)
        self.config = new
        self.scheduler.base_lrs = [new.learning_rate for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group.update(initial_lr=new.learning_rate, lr=new.learning_rate * lr_factor(new, self.step),
                         weight_decay=new.weight_decay, betas=tuple(new.adam_betas), eps=new.adam_eps)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        return new

    # --- model plumbing -------------------------------------------------------------------------------
    def _enable_checkpointing(self, fraction: float) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        if hasattr(self._lm, "activation_checkpointing_enable"):  # transformers >= 5.2x
            self._lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self._lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = [m for m in self._lm.modules() if isinstance(m, GradientCheckpointingLayer)]
        for i, layer in enumerate(layers):  # evenly spread: layer i is recomputed when floor() steps
            layer.gradient_checkpointing = math.floor((i + 1) * fraction) > math.floor(i * fraction)

    def _choose_attention(self, config: TrainerConfig) -> None:
        """The packed forwards' attention (``attention_choice.AttentionChoice``: a mode per micro-batch for 'auto' on
        CUDA, one mode otherwise); an ``attention_kernel`` that cannot run here is a ValueError."""
        self.attention = AttentionChoice.of(config.attention_kernel, self.device, self.dtype, config.attention_bucket,
                                            config.long_row_tokens) if self.packed else None

    @property
    def attention_path(self) -> str | None:
        """The attention path(s) of a packed forward, in words (None: not packed)."""
        return self.attention.describe() if self.attention is not None else None

    def _packed_attention(self, mb: MicroBatch) -> PackedAttention:
        return self.attention.packed(mb.spans)

    def _autocast(self):
        if self.device.type == "cuda" and self.dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.dtype)
        return contextlib.nullcontext()

    def _hidden(self, mb: MicroBatch) -> torch.Tensor:
        decoder = self._lm.get_decoder()
        kwargs = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
        packing = contextlib.nullcontext()
        if self.packed:
            kwargs["trajflow_packed"] = self._packed_attention(mb)
            kwargs["attention_mask"] = prepared_mask(self.device)
            packing = packed_forward()
        with packing, self._autocast():
            out = decoder(**kwargs)
        return out[0][0]

    @property
    def micro_batch_tokens(self) -> int:
        """The token budget of a micro-batch: ``TrainerConfig.micro_batch_tokens`` or its default for this device."""
        return self.config.micro_batch_budget(self.device.type == "cuda")

    def _token_logprobs(self, mb: MicroBatch, temperature: float | None = None, token_loss=None):
        """(logp, entropy) of the micro-batch's trained tokens under the current model, the logits divided by
        `temperature` (None: the sampler's, ``TrainerConfig.temperature``). With ``token_loss`` (a separable loss'
        share of the tokens of a slice, given their logp) a ``HeadGradInForward`` instead: logp and entropy detached,
        the loss' gradient through the output head already computed (``logprob_grad_in_forward.py``)."""
        if self.device.type == "cpu":  # the previous micro-batch's activations, freed, go back to the OS first
            release_freed_memory()
        hidden = self._hidden(mb).index_select(0, mb.pred_index)
        weight = self._lm.get_output_embeddings().weight
        temperature = self.config.temperature if temperature is None else temperature
        compile = self.config.enabled("compile_logprobs", self.device.type == "cuda")
        if token_loss is not None:
            return logprobs_with_head_grad(hidden, weight, mb.targets, token_loss, self.config.logprob_chunk,
                                           temperature, compile)
        return chunked_logprobs(hidden, weight, mb.targets, self.config.logprob_chunk, temperature, compile=compile)

    def lora_casts_scope(self):
        """Where the fused LoRA ops reuse their weights' compute-dtype copies (``cache_lora_casts``): one step's
        forwards, between two optimizer steps (also ``sft.py``'s steps); no optimizer step may run inside."""
        if self.fused_lora_layers and self.config.enabled("cache_lora_casts", self.device.type == "cuda"):
            return self.lora_casts.scope()
        return contextlib.nullcontext()

    def _micro_batch_step(self, mb: MicroBatch, eps: float, eps_high: float):
        """Forward, loss and backward of one micro-batch, gradients accumulating; returns (LossResult, entropy sum),
        both still on the device: nothing here waits for the GPU (tests/unit/backends/training/test_host_syncs.py)."""
        res, entropy = self._micro_batch_loss(mb, eps, eps_high)
        res.loss.backward()
        return res, entropy.sum()

    def head_grad_in_forward(self) -> bool:
        """Whether the step's loss gradient through the output head is computed in the logprob forward: the switch
        ``logprob_grad_in_forward`` resolved, and only for a separable loss (``losses.SEPARABLE_LOSSES``)."""
        on_cuda = self.device.type == "cuda"
        return self.config.loss in SEPARABLE_LOSSES and self.config.enabled("logprob_grad_in_forward", on_cuda)

    def _micro_batch_loss(self, mb: MicroBatch, eps: float, eps_high: float) -> tuple[LossResult, torch.Tensor]:
        """(LossResult, entropy [N]) of one micro-batch, its loss ready to backward; the same values and gradients
        whichever way ``head_grad_in_forward`` says."""
        cfg = self.config
        options = dict(loss=cfg.loss, eps=eps, eps_high=eps_high, tis_cap=cfg.tis_cap, n_rows=len(mb.rows))
        per_token = (mb.sampler_logprobs, mb.advantages, mb.weights, mb.row_index)
        if not self.head_grad_in_forward():
            logp, entropy = self._token_logprobs(mb)
            return policy_loss(logp, *per_token, **options), entropy

        def token_loss(logp: torch.Tensor, sl: slice) -> torch.Tensor:
            return weighted_token_losses(logp, *(t[sl] for t in per_token), **options)[0].sum()

        head = self._token_logprobs(mb, token_loss=token_loss)
        res = policy_loss(head.logp, *per_token, **options)
        res.loss = head.attach(res.loss)
        return res, head.entropy

    def _check_vocabulary(self, rows: Sequence[TrainingRow]) -> None:
        for r in rows:
            top = max(r.token_ids)
            if top >= self.vocab_size:
                raise ValueError(f"{r.source}: token id {top} is outside the model's vocabulary ({self.vocab_size})")

    def _micro_batches(self, rows: Sequence[TrainingRow], budget: int | None = None) -> list[MicroBatch]:
        self._check_vocabulary(rows)
        bins = plan_bins([len(r) for r in rows], budget or self.micro_batch_tokens, pack=self.packed)
        return [self._pack(rows, b) for b in bins]

    def _pack(self, rows: Sequence[TrainingRow], bin_: Sequence[int]) -> MicroBatch:
        """The micro-batch of ``rows[i]`` for i in one bin of ``plan_bins``, on the trainer's device."""
        return make_micro_batch([rows[i] for i in bin_], self.device)

    def _shape_advantages(self, batches: list[MicroBatch]) -> float:
        """KL-shaped advantages: policy vs reference (adapter off) on every trained token; returns mean(k)."""
        was_training = self.model.training
        self.model.eval()
        kls = []
        with torch.no_grad():
            for mb in batches:
                policy, _ = self._token_logprobs(mb)
                with self.model.disable_adapter():
                    ref, _ = self._token_logprobs(mb)
                kls.append(policy - ref)
        self.model.train(was_training)
        reduce = None if distributed.world()[1] == 1 else (lambda v: distributed.all_reduce_sum(v, self.device))
        deltas, mean_k = kl_shaping(kls, self.config.kl_coef, reduce)
        for mb, d in zip(batches, deltas):
            mb.advantages = mb.advantages + d.float()
        return mean_k

    # --- for other objectives over the same rows (backends/training/sft.py) ------------------------------------
    def micro_batches(self, rows: Sequence[TrainingRow], budget: int | None = None) -> list[MicroBatch]:
        """`rows` packed into micro-batches of at most `budget` tokens (None: ``micro_batch_tokens``) on the
        trainer's device; a token id outside the vocabulary is an error naming its row."""
        return self._micro_batches(rows, budget)

    def token_logprobs(self, mb: MicroBatch, temperature: float | None = None) -> torch.Tensor:
        """The current model's logprob of each trained token of `mb` (with gradients); see `_token_logprobs`."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._token_logprobs(mb, temperature)[0]

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The LoRA weights (float32 master copies) the optimizer updates."""
        return self._params

    @property
    def causal_lm(self):
        """The transformers model under the adapter (its config, generation config)."""
        return self._lm

    # --- the step --------------------------------------------------------------------------------------
    def train_step(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """ONE optimizer step over every trainable row of ``groups``; returns the step's metrics."""
        # On cuda:K, K > 0 (inference on another GPU of the machine), compiled kernels and streams follow the current
        # device, which is cuda:0 in a thread that never chose one.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            try:
                return self._train_step(groups)
            finally:
                if self.device.type == "cpu":  # the step's activations, freed, go back to the OS for the next stages
                    release_freed_memory()

    def _train_step(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        cfg = self.config
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with phase(PREPARE):
            rows, stats = build_rows(groups, max_row_tokens=cfg.max_row_tokens, overlong=cfg.overlong,
                                     scale_rewards=cfg.scale_rewards)
            metrics = stats.as_metrics()
            if not rows:
                metrics.update(no_trainable_rows=1.0, step=float(self.step), trained_tokens=0.0, tokens=0.0)
                return metrics
            assign_aggregation_weights(rows, cfg.aggregation, cfg.dr_grpo_norm or cfg.max_row_tokens)
            self._check_vocabulary(rows)  # every rank judges every row: a bad one stops all of them alike
            rank, world_size = distributed.world()
            if world_size > 1:  # data-parallel: this rank's share of the rows (backends/training/distributed.py)
                rows_here = [rows[i] for i in distributed.split_rows([len(r) for r in rows], world_size)[rank]]
            else:
                rows_here = rows
            bins = plan_bins([len(r) for r in rows_here], self.micro_batch_tokens, pack=self.packed)
        eps, eps_high = cfg.clip_range()
        acc = _StepStats()
        batches: list[MicroBatch] = []
        with self.lora_casts_scope():
            if cfg.kl_coef > 0:  # the reference passes run over every micro-batch first: all packed now
                batches = [self._pack(rows_here, b) for b in bins]
                metrics["kl_policy_ref"] = self._shape_advantages(batches)
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            done = []
            with self.fp8_scope():  # its logprobs, so mismatch_kl and the ratio stats, come from the fp8 forward
                for k, b in enumerate(bins):
                    with phase(MICRO_BATCH):
                        if k == len(batches):  # packed while the GPU still runs the previous micro-batch's backward
                            batches.append(self._pack(rows_here, b))
                        done.append(self._micro_batch_step(batches[k], eps, eps_high))
        with phase(UPDATE):
            # one process: the gradient norm (and its clipping) is queued behind the last backward and read with the
            # metrics, so the host waits for the device once; data-parallel sums the gradients over the ranks first
            norm = torch.nn.utils.clip_grad_norm_(self._params, cfg.grad_clip or math.inf) if world_size == 1 else None
            lr = self.scheduler.get_last_lr()[0]
            # a fused optimizer's update is queued too, skipped on the device where the loss or the norm is not
            # finite (guarded_step): the GPU goes on from the last backward to the update without waiting for the read
            queued = norm is not None and guards(self.optimizer)
            if queued:
                queue_guarded_step(self.optimizer, [res.loss for res, _ in done], norm)
            values, extra = _StepStats.read(done, [] if norm is None else [norm])  # no sync between micro-batches
            bad = next((mb for mb, v in zip(batches, values) if not math.isfinite(v["loss"])), None)
            for (res, _), v in zip(done, values):
                acc.add(v, res.tokens)
            if world_size > 1:
                acc.all_reduce(self._params)
            if not math.isfinite(acc.loss):
                self.optimizer.zero_grad(set_to_none=True)
                where = f"the micro-batch of: {bad.sources()}" if bad is not None else "another rank's rows"
                raise FloatingPointError(f"non-finite loss ({acc.loss}) in {where}")
            grad_norm = extra[0] if norm is not None else float(
                torch.nn.utils.clip_grad_norm_(self._params, cfg.grad_clip or math.inf))
            if not math.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(f"non-finite gradient norm ({grad_norm}); no optimizer step was taken")
            if not queued:
                self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        self._save_compile_cache()  # a no-op after the warm-up's
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        peak = self._peak_memory_gib()  # data-parallel: this rank's
        elapsed = time.perf_counter() - start
        tokens = sum(len(r) for r in rows)
        metrics.update(acc.metrics())
        metrics.update(
            no_trainable_rows=0.0,
            step=float(self.step),
            grad_norm=grad_norm,
            learning_rate=lr,
            tokens=float(tokens),
            trained_tokens=float(acc.tokens),
            micro_batches=float(acc.micro_batches),
            step_time_s=elapsed,
            tokens_per_s=tokens / elapsed,
            peak_memory_gib=peak,
        )
        if world_size > 1:
            metrics["data_parallel_ranks"] = float(world_size)
        self.metrics_history.append(metrics)
        return metrics

    def warm_up(self, micro_batches: int = 2) -> float:
        """Run forward + backward on synthetic packed micro-batches, then drop the gradients: no optimizer step, the
        adapter, optimizer, scheduler, step count and RNG streams are untouched. Returns the seconds it took.

        What the first real step of a process would otherwise pay happens here, during set-up: compiling the
        torch.compile'd kernels (dynamic shapes: one compile serves every length), the attention and GEMM kernels'
        first launches, and the caching allocator growing to a full micro-batch. The rows are a full micro-batch
        then a smaller one, each split into rows of different lengths (``_warm_up_lengths``), token ids ``i % vocab``
        (no random draw); their lengths pick their attention mode as a step's would.

        Padded rows (a bucketed mode: 'cudnn', or 'auto''s long micro-batches on CUDA) then get their cuDNN plans: for
        every padded length a row within the budget can run at (``AttentionChoice.padded_lengths``: b, 2b, ...,
        ``bucketed(micro_batch_tokens, b)``; for 'auto' none where ``long_row_tokens`` is over the budget) ONE attention
        forward + backward through the first decoder layer's attention (``packed_attention.build_row_plans``; every
        layer has the same shapes), so every plan, forward and backward, a row within the budget can need exists before
        step 0, for the attention's cost alone. Not built: a longer row's (it goes alone) and those of forwards without
        gradient (no softmax statistics: another plan). The CPU has no plans but runs them too where asked (``warm_up:
        on``), as the GPU would. ``warm_up_runs`` says what ran.
        """
        start = time.perf_counter()
        budget = self.micro_batch_tokens
        runs = {"micro_batches": 0, "tokens": 0, "bucket": 1, "bucket_lengths": 0}
        was_training = self.model.training
        self.model.train()
        with self.fp8_scope():  # the training forwards' kernels, the fp8 quantization's compile included
            for lengths in self._warm_up_lengths(micro_batches):
                for mb in self._micro_batches([self._warm_up_row(n) for n in lengths]):
                    res, _ = self._micro_batch_loss(mb, 0.2, 0.2)
                    (res.loss * 0.0).backward()
                    runs["micro_batches"] += 1
                    runs["tokens"] += mb.tokens
        mode, padded = self.attention.padded_lengths(budget) if self.attention is not None else (None, [])
        if padded:
            with self._autocast():
                build_row_plans(self._attention_module(), padded, mode.sdpa_backends, mode.bucket, self.dtype)
            runs.update(bucket=mode.bucket, bucket_lengths=len(padded), from_length=padded[0])
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train(was_training)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warm_up_runs = runs
        self._save_compile_cache()
        seconds = time.perf_counter() - start
        log.info("trainer warm-up: %d micro-batches, %d tokens, %d padded row lengths (bucket %d), %.1f s",
                 runs["micro_batches"], runs["tokens"], runs["bucket_lengths"], runs["bucket"], seconds)
        return seconds

    def _warm_up_lengths(self, micro_batches: int) -> list[list[int]]:
        """Row lengths of the warm-up's generic micro-batches: micro-batch k holds ``budget / (k + 1)`` tokens in
        rows of 1/2, 1/3 and 1/6 of it. With two attention modes ('auto' on CUDA, ``long_row_tokens`` T within the
        budget) the first is cut into rows of T (the last takes the rest) and the others into rows of T - 1 (the
        last takes the rest, under T), so each mode runs once through the whole model, the long one (padded rows,
        more memory) at full size."""
        budget = self.micro_batch_tokens
        long = self.attention.long_row_tokens if self.attention is not None and self.attention.long else None
        sets = []
        for k in range(micro_batches):
            total = max(16, budget // (k + 1))
            lengths = [total // 2, total // 3, total - total // 2 - total // 3]
            if long is not None and long <= budget:
                if k == 0:  # rows of T, the last taking the rest: long
                    rows, rest = divmod(total, long)
                    lengths = [long] * (rows - 1) + [long + rest]
                else:  # rows of T - 1, the rest a row of its own: every row, so the quadratic mean, under T
                    short = max(1, long - 1)
                    rows, rest = divmod(total, short)
                    lengths = [short] * rows + ([rest] if rest else [])
            sets.append(lengths)
        return sets

    def _attention_module(self) -> torch.nn.Module:
        """The first decoder layer's attention module (its config, head_dim, scaling)."""
        return next(m for m in self._lm.modules() if hasattr(m, "q_proj") and hasattr(m, "head_dim"))

    def _warm_up_row(self, n: int) -> TrainingRow:
        """A synthetic row of ``n`` tokens: ids ``(7i + 3) % vocab``, the first quarter (at least one token)
        untrained."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(n)]
        mask = [i >= max(1, n // 4) for i in range(n)]
        return TrainingRow(ids, mask, [0.0] * n, advantage=0.0, weight=1.0 / n, source="warm-up")

    def _peak_memory_gib(self) -> float:
        """Peak memory of this step so far: CUDA's allocator peak, or on the CPU the process's peak resident memory
        (ru_maxrss is in KiB on Linux)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def sequence_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """The current policy's logprob of each completion token after the prompt (eval mode, no grad; one intra-op
        thread on the CPU: backends/modeling/intra_op_threads.py)."""
        if not prompt_ids or not completion_ids:
            raise ValueError("sequence_logprobs needs a non-empty prompt and completion")
        ids = list(prompt_ids) + list(completion_ids)
        mask = [False] * len(prompt_ids) + [True] * len(completion_ids)
        row = TrainingRow(ids, mask, [0.0] * len(ids), source="sequence_logprobs")
        (mb,) = self._micro_batches([row])
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), single_thread_on_cpu(self.device):
                logp, _ = self._token_logprobs(mb)
        finally:
            self.model.train(was_training)
        return logp.tolist()

    def greedy_continuation(self, prompt_ids: list[int], max_tokens: int,
                            drafts: Sequence[Sequence[int]] = ()) -> tuple[list[int], list[float]]:
        """The current policy's greedy continuation of `prompt_ids` (`greedy_tokens`) and each token's logprob as
        `sequence_logprobs` gives it (one scoring pass)."""
        tokens, _ = self.greedy_tokens(prompt_ids, max_tokens, drafts)
        return tokens, self.sequence_logprobs(prompt_ids, tokens)

    def greedy_tokens(self, prompt_ids: list[int], max_tokens: int, drafts: Sequence[Sequence[int]] = (),
                      lookup: bool = False) -> tuple[list[int], int]:
        """`max_tokens` argmax tokens of the float32 logits after `prompt_ids` (EOS does not stop it) and the number
        of decoder forwards taken. The same modules as training, decoded with a KV cache; `drafts` (token lists that
        may continue the prompt, e.g. sampled answers to it) and with `lookup` the context's own repeats are verified
        a chunk per forward (backends/training/draft_verification.py), else one forward per token. One intra-op thread on the CPU, as
        `sequence_logprobs`."""
        if not prompt_ids or max_tokens < 1:
            raise ValueError("greedy_continuation needs a non-empty prompt and max_tokens >= 1")
        from transformers import DynamicCache

        decoder, weight = self._lm.get_decoder(), self._lm.get_output_embeddings().weight
        cache_arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
        cache, held = DynamicCache(), [0]

        def decode(ids: list[int], keep: int, last: int) -> list[int]:
            if held[0] > keep:  # a negative count removes that many tokens in every transformers version
                cache.crop(keep - held[0])
            hidden = decoder(input_ids=torch.tensor([ids], device=self.device), use_cache=True,
                             **{cache_arg: cache})[0][0, -last:]
            held[0] = keep + len(ids)
            return logits_fp32(hidden, weight).argmax(-1).tolist()

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast(), single_thread_on_cpu(self.device):
                return verified_greedy(decode, list(prompt_ids), max_tokens, drafts, lookup)
        finally:
            self.model.train(was_training)

    # --- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> None:
        """``path/adapter`` (peft safetensors) and ``path/trainer`` (optimizer, scheduler, RNG, step, config, metrics)."""
        meta = {"format": 1, "step": self.step, "base_model": self.base_model, "backend": self.backend,
                "config": self.config.model_dump(mode="json")}
        write_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, meta=meta,
                         metrics=self.metrics_history)

    def load_checkpoint(self, path: str | Path) -> None:
        """Continue exactly from a checkpoint: adapter, optimizer, scheduler, RNG, step and metrics; the learning
        rate, schedule and optimizer hyper-parameters then follow this trainer's config (the checkpoint's
        scheduler state would otherwise keep the old base rate)."""
        from peft import set_peft_model_state_dict

        weights, state, meta, metrics = read_checkpoint(path)
        check_compatible(meta.get("config", {}), self.config.model_dump(mode="json"), path)
        result = set_peft_model_state_dict(self.model, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        missing = [k for k in (getattr(result, "missing_keys", []) or []) if "lora_" in k]
        if unexpected or missing:
            raise ValueError(f"checkpoint {path} does not fit this model: unexpected {unexpected[:5]}, "
                             f"missing {missing[:5]}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        self.step = int(meta["step"])
        self.metrics_history = list(metrics)
        self.update_config()  # this trainer's settings, not the checkpoint's (identical if unchanged)
