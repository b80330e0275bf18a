"""The GRPO update: GRPOTrainer, TrainerConfig, rows, advantages, losses, packing, logprobs, checkpoints,
Unsloth. Never imports inference."""
