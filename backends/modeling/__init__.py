"""What the engine and the trainer share: loading a base model, float32 logits."""
