"""The optional Unsloth path: load the base model and its LoRA through Unsloth on CUDA.

Used when ``TrainerConfig.backend`` is 'unsloth', or 'auto' on a CUDA machine where ``unsloth`` imports.
Only loading differs: the trainer computes the same chunked logprobs and the same loss from the
decoder's hidden states. Unsloth replaces the attention forward, so rows are not packed on this path
(one row per micro-batch, no padding either). The adapter is saved by peft, in the same format.

Run on an H200 with unsloth 2026.10.9 (``benchmarks/results/training-unsloth-h200.md``): same step-0
gradient norm as the peft path to 0.15%, logprobs as close to float32 as peft's; not faster than the
peft path's defaults, but 5.5 GiB peak for 16k-token rows with Unsloth's offloaded checkpointing.
"""

from __future__ import annotations

import importlib.util

from backends.training.config import LORA_MODULES, TrainerConfig


def unsloth_importable() -> bool:
    return importlib.util.find_spec("unsloth") is not None


def choose_backend(requested: str, device: str) -> str:
    """'peft' or 'unsloth' for a requested backend on a device; error if Unsloth was demanded but cannot run."""
    on_cuda = str(device).startswith("cuda")
    if requested == "peft":
        return "peft"
    if requested == "unsloth":
        if not on_cuda:
            raise ValueError(f"backend='unsloth' needs a CUDA device, got {device!r}")
        if not unsloth_importable():
            raise ValueError("backend='unsloth' but the unsloth package is not installed (pip install unsloth)")
        return "unsloth"
    return "unsloth" if on_cuda and unsloth_importable() else "peft"


def load_with_unsloth(model_path: str, config: TrainerConfig, dtype):
    """(peft model, tokenizer) loaded by Unsloth, bf16 (no 4-bit: trainer numerics match the server's)."""
    from unsloth import FastLanguageModel  # noqa: PLC0415 - optional, CUDA only

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(model_path),
        max_seq_length=max(config.max_row_tokens, config.micro_batch_budget(on_cuda=True)),
        dtype=dtype,
        load_in_4bit=False,
    )
    targets = LORA_MODULES if config.target_modules == "all-linear" else list(config.target_modules)
    model = FastLanguageModel.get_peft_model(
        model,
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
        use_gradient_checkpointing="unsloth" if config.gradient_checkpointing else False,
        random_state=config.seed,
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
