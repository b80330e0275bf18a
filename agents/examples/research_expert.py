"""The research agent's scripted expert: search for the question's entity, read its document, answer from it.

It knows the generated corpus (:mod:`agents.examples.research_corpus`) and the questions it is given, nothing else.
One tool call per turn, as the agent's system prompt asks:

1. ``search(query=<entity>)``: the person's or company's name, taken from the title of the question's source
   document ("Staff profile: Mara Quill" -> "Mara Quill"); the name, not the whole question, because that is the
   query a reader of the question would write and the one a model can learn to copy out of the question.
2. ``read(doc_id)``: the search result whose title is the source document's title. The expert reads it from the
   tool result the agent returned, so a search that does not find the document stops the demonstration with an
   error instead of reading a document it was never shown.
3. ``answer(text=<gold answer>, doc_id)``: after checking that the document text it was shown holds the answer.

The expert is built with the scenarios it may answer (the train split, see :mod:`agents.examples.demonstrations`);
a question outside them is an :class:`ExpertError`, so it cannot write a demonstration of a val or test question.
"""

from __future__ import annotations

import json
from typing import Any

from agents.examples.research import ResearchAgent, holds_phrase
from agents.examples.scripted_policy import ExpertError, assistant_turns, tool_call_message
from agents.scenario import Scenario


class ResearchExpert:
    """Plays :class:`ResearchAgent` conversations on the questions of ``scenarios``; see the module docstring."""

    def __init__(self, agent: ResearchAgent, scenarios: list[Scenario]):
        self.corpus = agent.corpus
        self.known = {s.payload["question"]: s for s in scenarios}
        if len(self.known) != len(scenarios):
            raise ExpertError("two scenarios ask the same question: the expert could not tell them apart")

    def scenario_of(self, messages: list[dict[str, Any]]) -> Scenario:
        question = next((m.get("content") for m in messages if m.get("role") == "user"), None)
        if question not in self.known:
            raise ExpertError(f"the expert does not know the question {str(question)[:120]!r}: it plays only the "
                              "scenarios it was given (the train split)")
        return self.known[question]

    def act(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        payload = self.scenario_of(messages).payload
        source = self.corpus.documents[payload["doc_id"]]
        turn = assistant_turns(messages)
        if turn == 0:
            return tool_call_message(turn, "search", {"query": source.title.split(": ", 1)[1]})
        shown = messages[-1].get("content") or ""
        if turn == 1:
            hits = json.loads(shown)
            found = [h["doc_id"] for h in hits if h["title"] == source.title]
            if not found:
                raise ExpertError(f"search did not find {source.title!r} for {payload['question']!r}: {shown[:200]}")
            return tool_call_message(turn, "read", {"doc_id": found[0]})
        if turn == 2:
            gold = payload["answer"]
            if not holds_phrase(shown, gold):
                raise ExpertError(f"the document read for {payload['question']!r} does not hold {gold!r}")
            return tool_call_message(turn, "answer", {"text": gold, "doc_id": source.id})
        raise ExpertError(f"the conversation went on after the answer (turn {turn + 1})")
