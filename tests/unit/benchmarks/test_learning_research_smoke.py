"""benchmarks/learning_research_gpu.py end to end on the CPU with tiny-random: base eval, SFT, a GRPO step, the
evaluations, and its three outputs (the summary keys the issue asks for, the report, the plot), in a subprocess as the
lead runs it on the GPU.

tiny-random's byte-level tokenizer (512 ids) makes a research demonstration ~1,800 tokens, past its 1,024-token context,
so the smoke trains on the committed demonstrations with the tool descriptions dropped and the tool results cut
short: the same conversations, shorter; what SFT makes of real ones is the GPU run's business.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.paths import REPO


def _shortened(lines: list[dict]) -> list[dict]:
    """Tools without descriptions, tool results cut to 40 characters."""
    out = []
    for line in lines:
        tools = [{"type": "function", "function": {"name": t["function"]["name"], "parameters": {
            "type": "object", "properties": {k: {"type": "string"} for k in t["function"]["parameters"]["properties"]}}}}
            for t in line["tools"]]
        messages = [{**m, "content": m["content"][:40]} if m["role"] == "tool" else m for m in line["messages"]]
        out.append({**line, "tools": tools, "messages": messages})
    return out


def test_research_learning_curve_smoke(tmp_path):
    demos = [json.loads(x) for x in (REPO / "configs/demos/research-train.jsonl").read_text().splitlines()[:4]]
    short = tmp_path / "demos.jsonl"
    short.write_text("".join(json.dumps(line) + "\n" for line in _shortened(demos)))
    out = tmp_path / "research"
    cmd = [sys.executable, "benchmarks/learning_research_gpu.py", "--model", "tiny-random", "--max-seq-len", "1024",
           "--steps", "1", "--eval-every", "1", "--seeds", "0", "--group-size", "2", "--groups-per-step", "1",
           "--eval-samples", "1", "--val-size", "2", "--demos", str(short), "--sft-epochs", "1",
           "--agent-option", "max_turns=2", "--agent-option", "max_tokens=8", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert list(result["summary"]) == ["val_reward_base", "val_reward_sft", "val_reward_rl",
                                       "rl_over_sft_min_seed_delta", "tool_call_validity", "seeds"]
    assert result["summary"]["seeds"] == [0]
    (job,) = result["jobs"]
    assert job["demos"] == 4 and job["sft"]["sft/conversations"] == 4.0 and job["steps_done"] == 1
    assert [e["stage"] for e in job["evals"]] == ["sft", "rl"] and [e["step"] for e in job["evals"]] == [0, 1]
    assert result["summary"]["val_reward_rl"] == job["stages"]["rl"]["reward"] == job["evals"][-1]["reward"]
    per_seed = result["per_seed"][0]
    assert set(per_seed) >= {"base", "sft", "rl"} and "tool_calls" in per_seed["rl"]
    assert "| 0 | sft |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
