"""Where a profiled step's wall time goes that no kernel uses, from the torch profiler's Chrome trace of that step
(``prof.export_chrome_trace``; its ``traceEvents``).

1. Device: busy = |U [ts, ts + dur)| over every kernel, copy and fill of every stream (overlapping streams count
   once), idle = wall - busy, with wall the step's span (the ``STEP`` range the caller wraps the step in; without it,
   the trace's first to last event). Every idle gap over ``gap_ms`` is counted; the largest are listed with where
   they fall (before the first kernel, inside or between the trainer's phases: ``backends/training/step_phases.py``,
   after the last kernel) and what the host did: the ranges open on the step's thread when the gap began, and the
   op that launched the kernel ending it, with how late that launch came (> 0: the GPU waited for the host to
   launch; <= 0: the kernel was queued before the gap began, so it waited on something else).
2. CUDA time by category (``CATEGORY_RULES`` on the kernel's name, first match; a GEMM is LoRA-sized when an input
   of the op that launched it has a dimension <= ``lora_dim``, which needs ``record_shapes``, else it stays
   ``gemm``), and the top kernels by total time with their counts.
3. Host: per thread, the time inside torch ops (their union), inside kernel launches and inside synchronisations;
   per micro-batch, its wall, launches and the time no thread was inside a torch op (Python and the C++ between
   ops). The step thread's own CPU seconds come from the caller (``time.thread_time``), not from the trace; they
   include the time it spun inside a synchronisation (CUDA spins before it yields), which ``sync_ms`` bounds.

A trace without device events (a CPU-only profile) gets its host figures and says so instead of the device ones.

Simplifications:
1. Every device event counts wherever it ran: a one-GPU step. Events of other processes are not in the trace.
2. A kernel's launching op is the op whose ``External id`` the kernel carries (the profiler's link); a kernel
   without one is classified by its name alone.
3. The host ranges at a gap's start are looked up on the step's thread (the one that carries ``STEP``, else the one
   with the most time in ops): the autograd engine's thread runs backward's launches while that thread waits in
   ``backward()``, so both the step thread's ranges and the launching thread's op are given.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from backends.training.step_phases import MICRO_BATCH, PHASES, PREPARE, UPDATE

STEP = "benchmark.train_step"  # the range a caller wraps the profiled step in
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_RANGE_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")

# (category, substrings of the lower-cased kernel name), first match wins: attention before GEMM (cuDNN's attention
# kernels carry sm90/wgmma too), the grad norm's and AdamW's multi-tensor kernels before elementwise.
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention backward", ("flash_bwd", "bprop", "fmha_cutlassb", "attention_backward", "attn_bwd")),
    ("attention forward", ("flash_fwd", "fprop", "fmha", "attention_forward", "attn_fwd", "sdpa")),
    ("optimizer + grad norm", ("adam", "multi_tensor_apply", "lpnorm", "foreach")),
    ("logprob + loss", ("logsumexp", "softmax", "gather", "nll", "cross_entropy")),
    ("norm", ("rsqrt", "rms", "layer_norm", "layernorm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")),
    ("elementwise + reduction", ("elementwise", "reduce", "triton_", "vectorized", "index", "scatter", "cat",
                                 "copy", "fill", "where", "arange", "sum", "mul", "add")),
)


@dataclass(frozen=True)
class Span:
    """One complete ("X") event of the trace, times in microseconds."""

    start: float
    end: float
    name: str
    cat: str
    tid: object
    args: dict = field(default_factory=dict, compare=False, hash=False)


def spans(events: list[dict]) -> list[Span]:
    """The complete events, sorted by start, an enclosing one before those it encloses."""
    return sorted((Span(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")),
                        str(e.get("cat", "")), e.get("tid"), e.get("args") or {})
                   for e in events if e.get("ph") == "X" and "ts" in e), key=lambda s: (s.start, -s.end))


def union(intervals) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering exactly the given ones."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def covered(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def kernel_category(name: str, cat: str = "kernel", input_dims=None, lora_dim: int = 64) -> str:
    """The category of one device event (``CATEGORY_RULES``); a GEMM with its op's ``input_dims`` splits into
    ``gemm lora`` (an input dimension <= ``lora_dim``) and ``gemm base``."""
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    low = name.lower()
    found = next((c for c, keys in CATEGORY_RULES if any(k in low for k in keys)), "other")
    if found == "gemm" and input_dims:
        dims = [d for shape in input_dims if isinstance(shape, list) and len(shape) >= 2 for d in shape[-2:]]
        if dims:
            return "gemm lora" if min(dims) <= lora_dim else "gemm base"
    return found


@dataclass(frozen=True)
class Phase:
    start: float
    end: float
    label: str  # "prepare", "micro-batch k", "update"


def phases(host: list[Span], tid) -> list[Phase]:
    """The trainer's phase ranges on thread ``tid``, in order, micro-batches numbered from 0."""
    out, k = [], 0
    for s in host:
        if s.tid != tid or s.name not in PHASES:
            continue
        if s.name == MICRO_BATCH:
            label, k = f"micro-batch {k}", k + 1
        else:
            label = {PREPARE: "prepare", UPDATE: "update"}[s.name]
        out.append(Phase(s.start, s.end, label))
    return out


def phase_at(ranges: list[Phase], t: float) -> str | None:
    i = bisect.bisect_right([p.start for p in ranges], t) - 1
    return ranges[i].label if i >= 0 and t <= ranges[i].end else None


def position(before: str | None, after: str | None, first: bool, last: bool) -> str:
    """Where a gap falls, from the phases that launched the kernels on either side of it."""
    if first:
        return "before the first kernel"
    if last:
        return "after the last kernel"
    if before is None or after is None:
        return "inside the step"
    if "update" in (before, after):
        return "around the optimizer step"
    if before == after:
        return f"inside {before}"
    if before.startswith("micro-batch") and after.startswith("micro-batch"):
        return "between micro-batches"
    return f"between {before} and {after}"


def ranges_at(host: list[Span], tid, t: float, innermost: int = 6) -> list[str]:
    """Names of the ranges open on thread ``tid`` at ``t``, outermost first: every annotation (the step and its
    phases), then the ``innermost`` others (ops, runtime calls, with ``with_stack`` Python functions)."""
    open_ = [s for s in host if s.tid == tid and s.start <= t < s.end and s.cat in HOST_RANGE_CATEGORIES]
    others = [s.name for s in open_ if s.cat != "user_annotation"]
    return [s.name for s in open_ if s.cat == "user_annotation"] + others[-innermost:]


def step_thread(host: list[Span]):
    marked = next((s.tid for s in host if s.name == STEP), None)
    if marked is not None:
        return marked
    busy = Counter()
    for s in host:
        if s.cat == "cpu_op":
            busy[s.tid] += s.end - s.start
    return busy.most_common(1)[0][0] if busy else None


def summarise(events: list[dict], gap_ms: float = 0.2, top: int = 10, top_kernels: int = 15, lora_dim: int = 64,
              step_thread_cpu_s: float | None = None) -> dict:
    """The three parts of the module docstring for one profiled step's trace events."""
    every = spans(events)
    device = [s for s in every if s.cat in DEVICE_CATEGORIES]
    host = [s for s in every if s.cat not in DEVICE_CATEGORIES and not s.cat.startswith("gpu_")]
    tid = step_thread(host)
    marker = next((s for s in host if s.name == STEP), None)
    if marker is not None:
        window = (marker.start, marker.end)
    elif every:
        window = (every[0].start, max(s.end for s in every))
    else:
        window = (0.0, 0.0)
    step_phases = phases(host, tid)
    out = {"wall_ms": round((window[1] - window[0]) / 1e3, 3), "step_marker": marker is not None,
           "phases": [p.label for p in step_phases if not p.label.startswith("micro-batch")]
           + [f"{sum(p.label.startswith('micro-batch') for p in step_phases)} micro-batches"]}
    if device:
        out["device"] = _device(device, host, tid, window, step_phases, gap_ms, top)
        out["cuda_by_category"], out["top_kernels"] = _categories(device, host, lora_dim, top_kernels)
    else:
        out["device"] = "no device events in the trace (a CPU-only profile): GPU busy and idle time not measured"
    out["host"] = _host(host, tid, step_phases, step_thread_cpu_s)
    return out


def _launchers(host: list[Span]) -> tuple[dict, dict]:
    """(launch event by correlation id, torch op by External id)."""
    launches = {s.args["correlation"]: s for s in host
                if s.cat in ("cuda_runtime", "cuda_driver") and "correlation" in s.args}
    ops = {s.args["External id"]: s for s in host if s.cat == "cpu_op" and "External id" in s.args}
    return launches, ops


def _device(device: list[Span], host: list[Span], tid, window, step_phases, gap_ms: float, top: int) -> dict:
    launches, ops = _launchers(host)
    clipped = [(max(s.start, window[0]), min(s.end, window[1])) for s in device]
    busy = covered([(a, b) for a, b in clipped if b > a])
    # walk the kernels in start order: a gap opens where the next one starts after everything before it ended
    gaps, last_end, last = [], window[0], None
    for s in device:  # already in start order
        if s.start > last_end:
            gaps.append((last_end, s.start, last, s))
        if last is None or s.end >= last_end:
            last_end, last = max(last_end, s.end), s
    if last_end < window[1]:
        gaps.append((last_end, window[1], last, None))
    long = [g for g in gaps if (g[1] - g[0]) / 1e3 > gap_ms]

    def phase_of(kernel: Span | None) -> str | None:
        launch = launches.get(kernel.args.get("correlation")) if kernel is not None else None
        return phase_at(step_phases, launch.start) if launch is not None else None

    where = Counter()
    for start, end, before, after in long:
        where[position(phase_of(before), phase_of(after), before is None, after is None)] += (end - start) / 1e3
    listed = []
    for start, end, before, after in sorted(long, key=lambda g: g[0] - g[1])[:top]:
        row = {"ms": round((end - start) / 1e3, 3), "at_ms": round((start - window[0]) / 1e3, 3),
               "where": position(phase_of(before), phase_of(after), before is None, after is None),
               "host_at_start": ranges_at(host, tid, start)}
        launch = launches.get(after.args.get("correlation")) if after is not None else None
        if launch is not None:
            op = ops.get(after.args.get("External id"))
            row.update(next_kernel=after.name[:100], launched_by=op.name if op is not None else launch.name,
                       launch_thread="step" if launch.tid == tid else "other",
                       launch_ranges=ranges_at(host, launch.tid, launch.start, innermost=4)[-4:],
                       launch_late_ms=round((launch.start - start) / 1e3, 3))
        listed.append(row)
    wall = window[1] - window[0]
    return {"busy_ms": round(busy / 1e3, 3), "idle_ms": round((wall - busy) / 1e3, 3),
            "busy_percent": round(100 * busy / wall, 1) if wall > 0 else None,
            f"gaps_over_{gap_ms}ms": len(long), "gaps_total_ms": round(sum(g[1] - g[0] for g in long) / 1e3, 3),
            "all_gaps_ms": round(sum(g[1] - g[0] for g in gaps) / 1e3, 3),
            "gap_ms_by_where": {k: round(v, 3) for k, v in where.most_common()}, "largest_gaps": listed}


def _categories(device: list[Span], host: list[Span], lora_dim: int, top_kernels: int) -> tuple[dict, list]:
    _, ops = _launchers(host)
    by_cat, by_name = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0, ""])
    for s in device:
        op = ops.get(s.args.get("External id"))
        category = kernel_category(s.name, s.cat, op.args.get("Input Dims") if op is not None else None, lora_dim)
        by_cat[category][0] += s.end - s.start
        by_cat[category][1] += 1
        entry = by_name[s.name]
        entry[0] += s.end - s.start
        entry[1] += 1
        entry[2] = category
    cats = {k: {"ms": round(v[0] / 1e3, 3), "count": v[1]} for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0])}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    return cats, [{"kernel": k[:120], "category": c, "ms": round(t / 1e3, 3), "count": n} for k, (t, n, c) in ranked]


def _host(host: list[Span], tid, step_phases: list[Phase], step_thread_cpu_s: float | None) -> dict:
    threads = {}
    for t in sorted({s.tid for s in host}, key=str):
        mine = [s for s in host if s.tid == t]
        ops = [(s.start, s.end) for s in mine if s.cat == "cpu_op"]
        if not ops:
            continue
        launch = [s for s in mine if s.cat in ("cuda_runtime", "cuda_driver") and "Launch" in s.name]
        syncs = [s for s in mine if "Synchronize" in s.name]
        threads["step" if t == tid else str(t)] = {
            "in_ops_ms": round(covered(ops) / 1e3, 3),
            "launches": len(launch), "launch_ms": round(sum(s.end - s.start for s in launch) / 1e3, 3),
            "syncs": len(syncs), "sync_ms": round(sum(s.end - s.start for s in syncs) / 1e3, 3)}
    every_op = [(s.start, s.end) for s in host if s.cat == "cpu_op"]
    launches = [s for s in host if s.cat in ("cuda_runtime", "cuda_driver") and "Launch" in s.name]
    per_phase = []
    for p in step_phases:
        inside = [(max(a, p.start), min(b, p.end)) for a, b in every_op if b > p.start and a < p.end]
        mine = [s for s in launches if p.start <= s.start < p.end]
        per_phase.append({"phase": p.label, "wall_ms": round((p.end - p.start) / 1e3, 3),
                          "outside_ops_ms": round((p.end - p.start - covered(inside)) / 1e3, 3),
                          "launches": len(mine), "launch_ms": round(sum(s.end - s.start for s in mine) / 1e3, 3)})
    out = {"threads": threads, "phases": per_phase}
    if step_thread_cpu_s is not None:
        out["step_thread_cpu_s"] = round(step_thread_cpu_s, 4)
    return out


def trace_events(prof) -> list[dict]:
    """The ``traceEvents`` of a finished ``torch.profiler.profile`` (through its Chrome trace export)."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json", prefix="step-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
