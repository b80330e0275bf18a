"""Which devices of this machine a run's inference replicas and training ranks use.

A device setting D and a count N (``inference.device`` / ``inference.replicas``, ``training.device`` /
``training.gpus``) name N consecutive devices: from GPU K for D = ``cuda:K`` (``cuda``: K = 0; ``auto``: K = 0 when
this process sees a GPU), or the CPU N times. So one machine's GPUs are placed by configuration alone:

- shared (the default): inference and training both on ``cuda:0``; each stage waits for the other's memory;
- split: ``inference.device: cuda:0``, ``training.device: cuda:1`` (``training.gpus: N-1`` for the rest);
- both stages on all GPUs: ``inference.replicas: N`` from ``cuda:0`` and ``training.gpus: N`` from ``cuda:0``, the
  stages taking turns.

With ``training.mode: deployment`` the training GPUs are the worker's, not this machine's, and are not checked here.
"""

from __future__ import annotations

from tasks.run_config import RunConfig


def visible_gpus(config: RunConfig | None = None) -> int:
    """How many GPUs this process sees; 0 without importing torch when `config` names no CUDA device ('auto' always
    resolves, so only an explicit 'cuda...' can name a GPU that is not there)."""
    if config is not None and not any(d.startswith("cuda") for d in (config.inference.device, config.training.device)):
        return 0
    import torch

    return torch.cuda.device_count()


def devices(device: str, count: int, gpus_visible: int) -> list[str]:
    """The `count` devices setting `device` names (module docstring), given how many GPUs this process sees."""
    if device == "cpu" or (device == "auto" and gpus_visible == 0):
        return ["cpu"] * count
    first = int(device.partition(":")[2] or 0)
    return [f"cuda:{first + i}" for i in range(count)]


def cuda_visible(placed: list[str], visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that must see the GPUs `placed` ('cuda:K', this process's numbering)
    as its cuda:0, cuda:1, ...: K through this process's own CUDA_VISIBLE_DEVICES (`visible`) when it has one."""
    wanted = [int(d.partition(":")[2] or 0) for d in placed]
    if visible is None or not visible.strip():
        return ",".join(str(k) for k in wanted)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if max(wanted) >= len(ids):
        raise ValueError(f"{', '.join(placed)}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(ids)} GPU(s)")
    return ",".join(ids[k] for k in wanted)


def placement(config: RunConfig, gpus_visible: int) -> dict[str, list[str]]:
    """{'inference': a device per replica (empty when the server is not ours), 'training': a device per rank (empty
    when the update runs as a deployment elsewhere)}."""
    inf, training = config.inference, config.training
    return {
        "inference": devices(inf.device, inf.replicas, gpus_visible) if inf.backend != "url" else [],
        "training": devices(training.device, training.gpus, gpus_visible) if training.mode != "deployment" else [],
    }


def placement_problems(config: RunConfig, gpus_visible: int) -> list[str]:
    """One line per device the config names that this machine does not have."""
    problems = []
    names = {"inference": ("inference.device", config.inference.device, "inference.replicas", config.inference.replicas),
             "training": ("training.device", config.training.device, "training.gpus", config.training.gpus)}
    for stage, placed in placement(config, gpus_visible).items():
        missing = [d for d in placed if d.startswith("cuda") and int(d.partition(":")[2]) >= gpus_visible]
        if missing:
            field, device, count_field, count = names[stage]
            what = f"{field} {device}" + (f" with {count_field}={count}" if count > 1 else "")
            problems.append(f"{what} needs {', '.join(placed)}, but this machine shows {gpus_visible} GPU(s)")
    return problems


def describe(config: RunConfig, gpus_visible: int) -> str:
    """'inference cuda:0, training cuda:1 (split)': for the log line a run starts with."""
    placed = placement(config, gpus_visible)
    shared = set(placed["inference"]) & set(placed["training"]) - {"cpu"}
    kind = "shared" if shared else "split" if placed["inference"] and placed["training"] else "one stage here"
    parts = [f"{stage} {', '.join(ds)}" for stage, ds in placed.items() if ds]
    return f"{'; '.join(parts) or 'nothing on this machine'} ({kind})"
