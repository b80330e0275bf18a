"""The committed demonstration files (configs/demos/): what `trajflow demos` writes today, byte for byte, small enough
for the repository, and holding no val or test problem."""

from __future__ import annotations

import json

import pytest

from agents.examples.demonstrations import demonstrations, to_jsonl
from agents.registry import get_agent
from tests.paths import REPO

FILES = {"research": ("configs/demos/research-train.jsonl", 256), "tictactoe": ("configs/demos/tictactoe-train.jsonl", 256)}
SMALL = ("research", "configs/demos/research-train-16.jsonl", 16)  # configs/research.yaml's, for the CPU


@pytest.mark.parametrize("agent, path, count", [(a, *FILES[a]) for a in sorted(FILES)] + [SMALL])
def test_regenerating_gives_the_committed_bytes(agent, path, count):
    committed = (REPO / path).read_bytes()
    assert len(committed) < 1_000_000
    assert to_jsonl(demonstrations(agent, count=count, seed=0)).encode() == committed, (
        f"regenerate with: trajflow demos {agent} --split train --count {count} --seed 0 --out {path}")


@pytest.mark.parametrize("agent", sorted(FILES))
def test_no_demonstration_holds_a_val_or_test_problem(agent):  # the small file is a prefix of the research one
    lines = [json.loads(x) for x in (REPO / FILES[agent][0]).read_text().splitlines()]
    a = get_agent(agent)
    held_out = [s for split in ("val", "test") for s in a.scenarios(split, 0)]
    train_ids = {s.id for s in a.scenarios("train", 0)}
    assert len(lines) == FILES[agent][1]
    assert {line["metadata"]["split"] for line in lines} == {"train"}
    assert {line["metadata"]["scenario_id"] for line in lines} <= train_ids
    text = "\n".join(m["content"] or "" for line in lines for m in line["messages"] if m["role"] == "user")
    if agent == "research":  # no held-out question is asked, and no held-out question's source document is read
        assert not [s.payload["question"] for s in held_out if s.payload["question"] in text]
        read = {json.loads(c["function"]["arguments"])["doc_id"] for line in lines for m in line["messages"]
                for c in m.get("tool_calls") or [] if c["function"]["name"] == "read"}
        assert read and not read & {s.payload["doc_id"] for s in held_out}
    else:  # no held-out game: a game is its opponent's seed, and none of the file's is a held-out game's
        train = {s.id: s for s in a.scenarios("train", 0)}
        seeds = {train[line["metadata"]["scenario_id"]].payload["seed"] for line in lines}
        assert len(seeds) == len(lines) and not seeds & {s.payload["seed"] for s in held_out}


def test_the_research_config_trains_on_the_small_file():
    from tasks.run_config import load_config

    config = load_config("configs/research.yaml")
    assert (config.agent, config.sft.data) == ("research", SMALL[1])
    assert (REPO / "configs/demos/research-train.jsonl").read_text().startswith((REPO / SMALL[1]).read_text())
