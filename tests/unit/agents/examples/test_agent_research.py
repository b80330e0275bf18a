"""Research agent: generated corpus and search, reward on hand-written tool conversations, HTTP rollouts
through every bad-input path (unknown tool, bad JSON, bad arguments, no tool call, hanging and failing tools)."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest

from agents import Trajectory
from agents.examples.research import SYSTEM_PROMPT, TOOL_SCHEMAS, ResearchAgent, answer_correct, normalise
from agents.examples.research_corpus import build_corpus


@pytest.fixture
def agent() -> ResearchAgent:
    return ResearchAgent()


@pytest.fixture
def scenario(agent):
    return next(s for s in agent.scenarios("val", 0) if s.payload["kind"] == "born_city")


def test_corpus_is_deterministic_and_each_answer_has_one_source():
    corpus = build_corpus(0)
    assert len(corpus.documents) == 200 and len(corpus.questions) == 40 * 3 + 160 * 5
    assert build_corpus.__wrapped__(0) == corpus  # rebuilt from scratch: equal
    assert build_corpus(1).documents != corpus.documents
    titles = [d.title for d in corpus.documents.values()]
    assert len(set(titles)) == len(titles)
    for q in corpus.questions:
        doc = corpus.documents[q.doc_id]
        entity = doc.title.split(": ", 1)[1]
        assert entity in q.question and q.answer in doc.text
        g, snip = normalise(q.answer), normalise(doc.snippet)
        assert not any(snip[i:i + len(g)] == g for i in range(len(snip))), (q, doc.snippet)  # the answer needs a read
    with pytest.raises(ValueError, match="at most 2000 documents"):
        build_corpus(0, 500, 10)


def test_search_finds_the_entity_and_read_returns_text():
    corpus = build_corpus(0)
    for q in corpus.questions[::37]:
        assert corpus.search(q.question, 5)[0]["doc_id"] == q.doc_id, q
    hits = corpus.search("Lena", 5)
    assert len(hits) == 5 and all("Lena" in h["title"] for h in hits)
    assert corpus.search("", 5) == [] and corpus.search("zzzz qqqq", 5) == []
    assert corpus.read(" doc-0003 ").id == "doc-0003" and corpus.read("doc-9999") is None


def test_scenarios_split_by_source_document(agent):
    splits = {sp: agent.scenarios(sp, seed=0) for sp in ("train", "val", "test")}
    docs = {sp: {s.payload["doc_id"] for s in v} for sp, v in splits.items()}
    assert not docs["train"] & docs["val"] and not docs["train"] & docs["test"] and not docs["val"] & docs["test"]
    assert sum(len(v) for v in splits.values()) == 920 and 100 <= len(splits["val"]) <= 250
    assert [s.id for s in agent.scenarios("val", 0)] == [s.id for s in ResearchAgent().scenarios("val", 0)]
    assert [s.id for s in agent.scenarios("val", 1)] != [s.id for s in splits["val"]]


@pytest.mark.parametrize("given, ok", [
    ("Leeds", True), ("They were born in Leeds.", True), ("leeds!", True), ("Leedsville", False),
    ("Oslo, Lisbon, Leeds, Porto, Lyon, Graz, Quito, Split, Bergen, Izmir", False), ("", False), (None, False),
])
def test_answer_correct(given, ok):
    assert answer_correct(given, "Leeds") is ok
    assert normalise("Head of Logistics!") == ["head", "of", "logistics"]


def call(name, args, id_="c"):
    raw = args if isinstance(args, str) else json.dumps(args)
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": id_, "type": "function", "function": {"name": name, "arguments": raw}}]}


def text(content):
    return {"role": "assistant", "content": content}


def convo(scenario, *turns):
    head = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": scenario.payload["question"]}]
    out = list(head)
    for t in turns:
        out += [t, {"role": "tool", "tool_call_id": "c", "content": "..."}]
    return Trajectory(messages_and_choices=out, tools=TOOL_SCHEMAS)


def test_reward_on_hand_written_conversations(agent, scenario):
    gold, doc = scenario.payload["answer"], scenario.payload["doc_id"]
    r = lambda *turns: round(agent.reward(scenario, convo(scenario, *turns)), 6)  # noqa: E731
    assert r(call("search", {"query": "x"}), call("read", {"doc_id": doc}), call("answer", {"text": gold, "doc_id": doc})) == 1.0
    assert r(call("answer", {"text": f"In {gold}.", "doc_id": "doc-0001"})) == 1.0           # right answer, wrong cite
    assert r(call("read", {"doc_id": doc}), call("answer", {"text": "Atlantis", "doc_id": doc})) == 0.25
    assert r(call("read", {"doc_id": doc})) == 0.25                                          # found it, never answered
    assert r(call("answer", {"text": "Atlantis", "doc_id": doc})) == 0.0                     # cited, never read
    assert r(call("browse", {"url": "x"}), call("answer", {"text": gold, "doc_id": doc})) == 0.9   # unknown tool
    assert r(call("search", '{"query": "x'), call("answer", {"text": gold, "doc_id": doc})) == 0.9  # bad JSON
    assert r(call("answer", {"text": gold}), call("answer", {"text": gold, "doc_id": doc})) == 0.9  # missing doc_id
    assert r(text('<tool_call>{"name": "read", "arguments": {"doc_id": </tool_call>')) == -0.1     # bad JSON in text
    assert r(text('<tool_call>{"name": "read", "arguments": {"doc_id": "%s"}}</tool_call>' % doc)) == 0.25
    assert r(text("Leeds?"), text("I think so"), text("hmm")) == -0.3                         # no tool calls
    assert r(*[call("nope", {})] * 6) == -0.5                                                # penalty is capped
    late = [call("search", {"query": "x"})] * 6 + [call("answer", {"text": gold, "doc_id": doc})]
    assert r(*late) == 0.0                                                                   # answer after max_turns
    assert r(call("answer", {"text": "Atlantis", "doc_id": doc}), call("answer", {"text": gold, "doc_id": doc})) == 0.0


def test_config_errors():
    with pytest.raises(pydantic.ValidationError, match="max_turns"):
        ResearchAgent(max_turns=0)
    with pytest.raises(pydantic.ValidationError, match="serach_k"):
        ResearchAgent(serach_k=3)
    with pytest.raises(ValueError, match="leave some documents for training"):
        ResearchAgent(val_fraction=0.6, test_fraction=0.5)


def _responder(script):
    """Replies keyed by turn number (count of assistant messages already in the request)."""
    def respond(body):
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        return script[turn]
    return respond


async def test_rollout_search_read_answer_over_http(agent, scenario, scripted_server, scripted_client):
    gold, doc = scenario.payload["answer"], scenario.payload["doc_id"]
    name = scenario.payload["question"].removeprefix("In which city was ").removesuffix(" born?")
    scripted_server.responder = _responder([
        {"tool_calls": [("search", {"query": name})]},
        {"tool_calls": [("read", {"doc_id": doc})]},
        {"content": "Found it.", "tool_calls": [("answer", {"text": gold, "doc_id": doc})]},
    ])
    traj = await agent.rollout(scripted_client, "agent@2", scenario)
    assert traj.reward == 1.0 == agent.reward(scenario, traj)
    m = traj.metrics
    assert (m["correct"], m["found_doc"], m["cited_doc"], m["turns"], m["searches"], m["reads"]) == (1, 1, 1, 3, 1, 1)
    assert m["format_errors"] == 0 and m["tool_timeouts"] == 0 and (m["tool_calls"], m["valid_tool_calls"]) == (3, 3)
    first, second, third = scripted_server.requests
    assert first["tools"] == TOOL_SCHEMAS and first["temperature"] == 1.0 and first["max_tokens"] == 96
    search_result = json.loads(second["messages"][-1]["content"])
    assert second["messages"][-1]["role"] == "tool" and search_result[0]["doc_id"] == doc
    assert third["messages"][-1]["tool_call_id"] == "call_0_read" and gold in third["messages"][-1]["content"]
    assert all(t.trainable for t in traj.sampled_turns()) and len(traj.sampled_turns()) == 3


async def test_rollout_malformed_calls_are_penalised_not_raised(agent, scenario, scripted_server, scripted_client):
    gold, doc = scenario.payload["answer"], scenario.payload["doc_id"]
    scripted_server.responder = _responder([
        {"tool_calls": [("browse", {"url": "http://x"})]},
        {"tool_calls": [("read", '{"doc_id": "doc-')]},
        {"content": '<tool_call>{"name": "read", "arguments": {"doc_id": 12}}</tool_call>'},
        "I am not sure, maybe Lisbon?",
        {"tool_calls": [("answer", {"text": gold, "doc_id": doc})]},
    ])
    traj = await agent.rollout(scripted_client, "agent@2", scenario)
    m = traj.metrics
    assert (m["unknown_tool"], m["bad_json"], m["bad_arguments"], m["no_tool_call"]) == (1, 1, 1, 1)
    assert (m["tool_calls"], m["valid_tool_calls"]) == (4, 1)  # the prose turn is no call; the answer is valid
    assert m["correct"] == 1 and round(traj.reward, 6) == 0.6 == round(agent.reward(scenario, traj), 6)
    reqs = scripted_server.requests
    assert reqs[1]["messages"][-1]["content"].startswith("Error: unknown tool 'browse'")
    assert "not valid JSON" in reqs[2]["messages"][-1]["content"]
    assert reqs[3]["messages"][-1] == {"role": "user", "content": "<tool_response>\nError: read: bad arguments "
                                       "(doc_id should be string); got '{\"doc_id\": 12}'\n</tool_response>"}
    assert reqs[4]["messages"][-1]["content"].startswith("Please call one of the tools")
    assert any("unknown_tool" in line for line in traj.logs) and any("no tool call" in line for line in traj.logs)


async def test_rollout_without_tool_calls_stops_at_max_turns(scenario, scripted_server, scripted_client):
    agent = ResearchAgent(max_turns=3)
    scripted_server.responder = lambda body: "Leeds"
    traj = await agent.rollout(scripted_client, "agent@2", scenario)
    assert len(scripted_server.requests) == 3 and traj.metrics["answered"] == 0
    assert round(traj.reward, 6) == -0.3 == round(agent.reward(scenario, traj), 6)


class HangingReadAgent(ResearchAgent):
    """read() hangs (async, cancelled at the timeout); search() raises."""

    def tool_functions(self):
        fns = super().tool_functions()

        async def read(doc_id: str) -> str:
            await asyncio.sleep(30)
            return "never"

        def search(query: str) -> str:
            raise ConnectionError("search backend down")

        return {**fns, "read": read, "search": search}


async def test_hanging_and_failing_tools_are_recorded_outcomes(scenario, scripted_server, scripted_client):
    agent = HangingReadAgent(tool_timeout_s=0.2)
    doc, gold = scenario.payload["doc_id"], scenario.payload["answer"]
    scripted_server.responder = _responder([
        {"tool_calls": [("search", {"query": "x"})]},
        {"tool_calls": [("read", {"doc_id": doc})]},
        {"tool_calls": [("answer", {"text": "no idea", "doc_id": doc})]},
    ])
    traj = await agent.rollout(scripted_client, "agent@2", scenario)
    assert traj.metrics["tool_timeouts"] == 1 and traj.metrics["tool_errors"] == 1
    assert traj.metrics["format_errors"] == 0 and traj.error is None
    assert traj.metrics["valid_tool_calls"] == traj.metrics["tool_calls"] == 3  # the tools' faults, not the model's
    assert traj.reward == 0.25 == agent.reward(scenario, traj)  # asked for the right document: partial credit
    reqs = scripted_server.requests
    assert reqs[1]["messages"][-1]["content"] == "Error: ConnectionError: search backend down"
    assert reqs[2]["messages"][-1]["content"] == "Error: tool timed out after 0.2 s"
    assert gold not in json.dumps(reqs[2]["messages"])


async def test_rollout_on_embedded_tiny_random_server(agent, tiny_server):
    from agents.client import policy_client
    from tests.fixtures_server import API_KEY

    small = ResearchAgent(max_turns=2, max_tokens=24)
    client = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        for s in small.scenarios("val", seed=0)[:2]:
            traj = await small.rollout(client, "tiny-random", s)
            assert -0.5 <= traj.reward <= 1.0 and traj.reward == pytest.approx(small.reward(s, traj))
            assert traj.metrics["turns"] == 2 and traj.error is None and traj.tools == TOOL_SCHEMAS
    finally:
        await client.close()
