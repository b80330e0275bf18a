"""One policy lifecycle for the Prefect flow and LocalBackend.

``checkpoints``: step 0, one GRPO update per step, and loading a step back into a trainer, all through the
run's storage. ``probe``: the record the trainer writes with each checkpoint and the checks that prove a
server answers with that step's adapter. ``publish``: download (hash-checked), hot-load as ``<run>@<step>``,
probe, unload what is no longer needed.
"""
