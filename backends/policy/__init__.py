"""One policy lifecycle for the flow and LocalBackend: step-0 setup, checkpoints, publish + probe."""
