"""The result file of ``benchmarks/multi_gpu.py``: parts merged into one JSON, the summary recomputed from them.

Rule: the file holds ``parts`` (``train``, ``rollout``, ``step``), each with its own date, command, environment
(hardware, versions), spec, budget and ``details``; a run replaces the parts it ran and keeps the others, then the
top-level ``summary`` (the issue's 8 keys) and ``composed`` are recomputed from the parts present, a key whose part
has not run being null. Choice: one file per machine, filled by several commands (one part each fits a 9-minute
command); a smoke (CPU) run and a GPU run never merge, and a file that is not such a result is refused, never
overwritten. Needs only the standard library, so the merge is testable without torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PARTS = ("train", "rollout", "step")
SUMMARY_KEYS = ("train_tok_s_1gpu", "train_tok_s_2gpu", "train_scaling_2gpu", "rollout_tok_s_1replica",
                "rollout_tok_s_2replicas", "rollout_scaling_2replicas", "step_wall_s_shared_1gpu",
                "step_wall_s_split_2gpu")
TARGETS = {"train_scaling_2gpu": 1.85, "rollout_scaling_2replicas": 1.8}


class ResultFileError(ValueError):
    """The --out file cannot take this run's parts (unreadable, not this benchmark's, smoke vs GPU)."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(parts: dict) -> dict:
    """The issue's 8 keys from the parts present; null where the part has not run."""
    s = dict.fromkeys(SUMMARY_KEYS)
    if "train" in parts:
        t = parts["train"]["details"]["train"]
        s["train_tok_s_1gpu"], s["train_tok_s_2gpu"] = t["1"]["tok_s"], t["2"]["tok_s"]
        s["train_scaling_2gpu"] = t["2"]["tok_s"] / t["1"]["tok_s"]
    if "rollout" in parts:
        r = parts["rollout"]["details"]["rollout"]
        s["rollout_tok_s_1replica"], s["rollout_tok_s_2replicas"] = r["1"]["tok_s"], r["2"]["tok_s"]
        s["rollout_scaling_2replicas"] = r["2"]["tok_s"] / r["1"]["tok_s"]
    if "step" in parts:
        st = parts["step"]["details"]["steps"]
        s["step_wall_s_shared_1gpu"] = _mean([row["step_s"] for row in st["shared"]["steps"]])
        s["step_wall_s_split_2gpu"] = _mean([row["step_s"] for row in st["split"]["steps"]])
    return s


def composed(parts: dict, summary: dict) -> dict:
    """Both GPUs for each stage in turn, at the flow-step load: the shared step's rollout time over the measured
    2-replica scaling, its update time over the measured 2-GPU scaling, its publish time as is; null until all three
    parts have run."""
    both = None
    if "step" in parts and summary["rollout_scaling_2replicas"] and summary["train_scaling_2gpu"]:
        both = _mean([r["rollouts_s"] / summary["rollout_scaling_2replicas"] + r["train_s"]
                      / summary["train_scaling_2gpu"] + r["publish_s"]
                      for r in parts["step"]["details"]["steps"]["shared"]["steps"]])
    return {"step_wall_s_both_2gpu_composed": both}


def load(out: Path, smoke: bool) -> dict:
    """The parts already in `out` ({} when it does not exist); ResultFileError when it cannot take this run's."""
    if not out.exists():
        return {}
    try:
        doc = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultFileError(f"--out {out}: not readable as JSON ({exc}); choose another --out") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("parts"), dict) or set(doc["parts"]) - set(PARTS):
        raise ResultFileError(f"--out {out}: not a multi_gpu.py result with 'parts' ({', '.join(PARTS)}); "
                              "choose another --out")
    if doc.get("smoke") is not smoke:
        raise ResultFileError(f"--out {out}: holds a {'smoke' if doc.get('smoke') else 'GPU'} run, this is a "
                              f"{'smoke' if smoke else 'GPU'} run; they do not merge, choose another --out")
    return doc["parts"]


def merge(existing: dict, new: dict, smoke: bool, updated: str) -> dict:
    """The result document: `existing` parts with `new` ones added or replacing theirs, summary recomputed."""
    parts = {name: new.get(name, existing.get(name)) for name in PARTS if name in new or name in existing}
    summary = summarize(parts)
    return {"summary": summary, "targets": TARGETS, "composed": composed(parts, summary), "smoke": smoke,
            "updated": updated, "parts": parts}


def _fmt(value) -> str:
    return "not run yet" if value is None else f"{value:.4g}"


def markdown(doc: dict) -> str:
    title = f"# Two GPUs of one host ({'smoke: CPU, tiny shape' if doc['smoke'] else 'GPU'}; updated {doc['updated']})"
    lines = [title, "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in doc["summary"].items()]
    both = doc["composed"]["step_wall_s_both_2gpu_composed"]
    both = "not run yet" if both is None else f"{both:.4g} s"
    lines += ["", f"Targets: {json.dumps(doc['targets'])}. Step wall, both GPUs per stage in turn (composed from "
              + f"the three parts): {both}.", ""]
    for name, part in doc["parts"].items():
        ran = f"{part['date']}, {part['wall_s']:.0f} s, budget {part['budget_s']:.0f} s"
        lines += [f"## {name}", "", f"Command: `{part['command']}` ({ran})", "",
                  f"Timed (of planned): {json.dumps(part['timed'])}", ""]
        if name == "train":
            d = part["details"]
            lines += [f"Largest LoRA weight difference, 1 vs 2 GPUs after the same {d['lora_compared_after_steps']} "
                      + f"steps: {d['train_ddp_max_abs_diff_lora']:.3g}.", ""]
        lines += [f"Environment: {json.dumps(part['environment'])}", "", f"Spec: {json.dumps(part['spec'])}", ""]
    return "\n".join(lines)


def write(out: Path, doc: dict) -> None:
    """The JSON and the .md beside it, each replaced whole (a killed run leaves the previous file intact)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out, json.dumps(doc, indent=2) + "\n"), (out.with_suffix(".md"), markdown(doc))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
