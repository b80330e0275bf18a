"""Training kernels: fused LoRA linear, lean RMSNorm/SwiGLU ops, torch.compile'd math."""
