"""The embedded engine: continuous batching, KV cache, LoRA slots, CUDA graphs, sampling, adapter reading."""
