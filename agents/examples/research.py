"""A tool-using research agent in the spirit of ART-E: answer questions over a local document corpus.

The corpus is a generated company directory (:mod:`agents.examples.research_corpus`, 200 documents by default).
Each scenario is one question whose answer sits in exactly one document. The model gets three tools:

- ``search(query)`` -> JSON list of up to ``search_k`` ``{doc_id, title, snippet}`` (BM25);
- ``read(doc_id)`` -> the document's text (or an error text for an unknown id);
- ``answer(text, doc_id)`` -> ends the episode with a short answer and the id of its source document.

The episode also ends after ``max_turns`` model turns. Each tool call runs under ``tool_timeout_s``
(:class:`agents.tools.ToolBox`); a turn may hold several calls, run in order (calls after ``answer`` are
ignored). A turn without any tool call is answered with a reminder to use the tools.

Reward::

    base    = 1.0   if the answer is right
            = 0.25  otherwise, if a valid read(doc_id) of the source document was made (found_doc;
                    a read that timed out still counts: the model asked for the right document)
            = 0.0   otherwise (including never answering)
    penalty = 0.1 per malformed call (bad JSON, unknown tool, bad arguments) and per turn without a tool
              call, at most 0.5
    reward  = base - penalty                       (range -0.5 .. 1.0)

An answer is right when the gold answer appears, as whole words and ignoring case and punctuation, in
an answer of at most ``len(gold words) + 8`` words (so "They were born in Lisbon." counts, a list of
every city does not). Tool timeouts and tool exceptions are the environment's fault: recorded
(``tool_timeouts``, ``tool_errors``), not penalised. :meth:`ResearchAgent.reward` recomputes all of this
from the stored conversation, without running any tool.

Metrics, besides the reward's parts: ``tool_calls`` counts every call the model wrote up to the answer, malformed
ones included, ``valid_tool_calls`` the well-formed ones (a known tool, arguments a JSON object that fits its
schema; a timed-out or failing tool was still a valid call). Over many episodes the tool-call validity is
sum(valid_tool_calls) / sum(tool_calls) (``tool_call_validity`` in :func:`agents.group_metrics.summarize`); a turn
without any call is no call at all and counts in ``no_tool_call`` instead.

Baseline: SmolLM2-135M-Instruct never calls a tool here (16 val questions, greedy and sampled, ``max_turns=3``:
every turn is prose, reward -0.3 each; ``benchmarks/results/agent_baselines.md``), so it gets no learning
signal from this agent. It exercises the tool path end to end and is meant for tool-calling models
(Qwen2.5 and up, behind vLLM with ``--tool-call-parser hermes``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict, Field

from agents.agent import ConfiguredAgent
from agents.examples.research_corpus import Corpus, build_corpus
from agents.examples.turn_sampling import ContextExhausted, ordered, sample_turn, split_of
from agents.scenario import Scenario, Split
from agents.tools import MODEL_ERROR_KINDS, ToolBox, ToolCall, function_tool, tool_result_message
from agents.trajectory import Trajectory

SYSTEM_PROMPT = (
    "You answer questions about a company directory. Use the tools: search(query) finds documents, "
    "read(doc_id) shows a document, answer(text, doc_id) gives your final short answer and the id of the "
    "document it came from. Always call exactly one tool per turn."
)
NUDGE = "Please call one of the tools: search, read or answer."

TOOL_SCHEMAS = [
    function_tool("search", "Search the directory; returns document ids, titles and snippets.",
                  {"query": {"type": "string", "description": "keywords, e.g. a person's or company's name"}}),
    function_tool("read", "Read one document by its id.",
                  {"doc_id": {"type": "string", "description": "a document id such as doc-0042"}}),
    function_tool("answer", "Give the final answer; this ends the task.",
                  {"text": {"type": "string", "description": "the short answer"},
                   "doc_id": {"type": "string", "description": "id of the document holding the answer"}}),
]


def normalise(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def holds_phrase(text: str, phrase: str) -> bool:
    """The words of ``phrase`` appear contiguously among the words of ``text`` (see :func:`normalise`)."""
    g, a = normalise(phrase), normalise(text)
    return bool(g) and any(a[i:i + len(g)] == g for i in range(len(a) - len(g) + 1))


def answer_correct(given: str | None, gold: str) -> bool:
    """Gold's words appear contiguously in the given answer, which has at most len(gold) + 8 words."""
    if not isinstance(given, str):
        return False
    return len(normalise(given)) <= len(normalise(gold)) + 8 and holds_phrase(given, gold)


class ResearchConfig(BaseModel):
    """Settings of the research agent."""

    model_config = ConfigDict(extra="forbid")

    corpus_seed: int = Field(default=0, description="seed of the generated directory (documents and questions)")
    n_companies: int = Field(default=40, ge=1, le=200, description="companies in the directory")
    people_per_company: int = Field(default=4, ge=0, le=10, description="staff profiles per company; "
                                    "documents = companies x (1 + people_per_company)")
    val_fraction: float = Field(default=0.2, ge=0, lt=1, description="share of source documents whose "
                                "questions are validation (split by document, so val facts are never trained on)")
    test_fraction: float = Field(default=0.1, ge=0, lt=1, description="share of source documents held out for test")
    max_turns: int = Field(default=6, ge=1, le=30, description="model turns before the episode stops unanswered")
    search_k: int = Field(default=5, ge=1, le=20, description="results per search")
    tool_timeout_s: float = Field(default=5.0, gt=0, description="limit of each tool call")
    max_tokens: int = Field(default=96, ge=8, description="completion budget per turn")
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature of rollouts")
    found_doc_reward: float = Field(default=0.25, ge=0, lt=1, description="partial credit for reading the "
                                    "source document when the answer is wrong or missing")
    format_penalty: float = Field(default=0.1, ge=0, description="penalty per malformed call or tool-less turn")
    max_penalty: float = Field(default=0.5, ge=0, description="cap on the total format penalty")


@dataclass
class Episode:
    """What a conversation did, as far as the reward is concerned."""

    answered: bool = False
    answer_text: str | None = None
    answer_doc: str | None = None
    read_docs: list[str] = field(default_factory=list)
    searches: int = 0
    turns: int = 0
    no_tool_call: int = 0
    tool_calls: int = 0
    errors: Counter = field(default_factory=Counter)

    @property
    def malformed_calls(self) -> int:
        return sum(self.errors[k] for k in MODEL_ERROR_KINDS)

    @property
    def format_errors(self) -> int:
        return self.no_tool_call + self.malformed_calls


class ResearchAgent(ConfiguredAgent):
    """Answers directory questions with search/read/answer tools; see the module docstring."""

    name = "research"
    system_prompt = SYSTEM_PROMPT

    config_class = ResearchConfig

    def __init__(self, config: ResearchConfig | None = None, **options: Any):
        super().__init__(config, **options)
        if self.settings.val_fraction + self.settings.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave some documents for training")

    @property
    def corpus(self) -> Corpus:
        s = self.settings
        return build_corpus(s.corpus_seed, s.n_companies, s.people_per_company)

    def scenarios(self, split: Split, seed: int) -> list[Scenario]:
        s = self.settings
        out = [Scenario(id=q.id, split=split, payload={"question": q.question, "answer": q.answer,
                                                       "doc_id": q.doc_id, "kind": q.kind})
               for q in self.corpus.questions
               if split_of(f"research/{s.corpus_seed}/{q.doc_id}", s.val_fraction, s.test_fraction) == split]
        return ordered(out, seed)

    # ---- tools ---------------------------------------------------------------------------------
    def tool_functions(self) -> dict[str, Callable[..., Any]]:
        """The tool implementations (override to wrap or replace one)."""
        corpus, k = self.corpus, self.settings.search_k

        def search(query: str) -> str:
            return json.dumps(corpus.search(query, k))

        def read(doc_id: str) -> str:
            doc = corpus.read(doc_id)
            return f"{doc.title}\n{doc.text}" if doc else f"Error: no document with id {doc_id!r}"

        def answer(text: str, doc_id: str) -> str:
            return "Answer recorded."

        return {"search": search, "read": read, "answer": answer}

    def toolbox(self) -> ToolBox:
        return ToolBox(self.tool_functions(), TOOL_SCHEMAS, timeout_s=self.settings.tool_timeout_s)

    # ---- grading -------------------------------------------------------------------------------
    @staticmethod
    def _note(ep: Episode, call: ToolCall) -> bool:
        """Record one parsed call in the episode; True when it is the final answer."""
        ep.tool_calls += 1
        if not call.ok:
            ep.errors[call.error_kind] += 1
            return False
        args = call.arguments or {}
        if call.name == "search":
            ep.searches += 1
        elif call.name == "read":
            ep.read_docs.append(str(args["doc_id"]).strip())
        elif call.name == "answer":
            ep.answered, ep.answer_text, ep.answer_doc = True, args["text"], str(args["doc_id"]).strip()
            return True
        return False

    def replay(self, messages: list[dict[str, Any]]) -> Episode:
        """Re-read a conversation's tool calls (nothing is executed) up to the answer or ``max_turns``."""
        box, ep = self.toolbox(), Episode()
        for m in messages:
            if m.get("role") != "assistant" or ep.answered or ep.turns >= self.settings.max_turns:
                continue
            ep.turns += 1
            calls = box.calls(m)
            if not calls:
                ep.no_tool_call += 1
            for call in calls:
                if self._note(ep, call):
                    break
        return ep

    def grade(self, scenario: Scenario, ep: Episode) -> dict[str, float]:
        """Reward components: ``base`` (answer / found document) and ``format_penalty`` (<= 0)."""
        s, gold_doc = self.settings, scenario.payload["doc_id"]
        correct = ep.answered and answer_correct(ep.answer_text, scenario.payload["answer"])
        base = 1.0 if correct else (s.found_doc_reward if gold_doc in ep.read_docs else 0.0)
        return {"base": base, "format_penalty": -round(min(s.max_penalty, s.format_penalty * ep.format_errors), 6)}

    def reward(self, scenario: Scenario, trajectory: Trajectory) -> float:
        """Recomputed from the stored conversation; see the module docstring for the formula."""
        return sum(self.grade(scenario, self.replay(trajectory.messages())).values())

    # ---- rollout -------------------------------------------------------------------------------
    async def rollout(self, client: AsyncOpenAI, policy: str, scenario: Scenario) -> Trajectory:
        s, box, ep = self.settings, self.toolbox(), Episode()
        traj = Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT},
                                                {"role": "user", "content": scenario.payload["question"]}],
                          tools=TOOL_SCHEMAS,
                          metadata={"agent": self.name, "scenario_id": scenario.id, "kind": scenario.payload["kind"]})
        timeouts = tool_errors = context_exhausted = 0
        while not ep.answered and ep.turns < s.max_turns:
            try:
                turn = await sample_turn(client, policy, traj, max_tokens=s.max_tokens, temperature=s.temperature,
                                         tools=TOOL_SCHEMAS)
            except ContextExhausted as exc:
                context_exhausted = 1
                traj.log(f"turn {ep.turns + 1}: episode ends, the conversation outgrew the context ({exc})")
                break
            ep.turns += 1
            calls = box.calls(turn.message)
            if not calls:
                ep.no_tool_call += 1
                traj.log(f"turn {ep.turns}: no tool call in {str(turn.message.get('content'))[:120]!r}")
                traj.messages_and_choices.append({"role": "user", "content": NUDGE})
                continue
            for call in calls:
                result = await box.run(call)
                if result.error_kind == "timeout":
                    timeouts += 1
                elif result.error_kind == "tool_error":
                    tool_errors += 1
                if not result.ok:
                    traj.log(f"turn {ep.turns}: {call.name or '?'} -> {result.error_kind}: {result.content[:200]}")
                traj.messages_and_choices.append(tool_result_message(call, result.content))
                if self._note(ep, call):
                    break
        parts = self.grade(scenario, ep)
        traj.reward = sum(parts.values())
        correct = ep.answered and answer_correct(ep.answer_text, scenario.payload["answer"])
        traj.metrics.update(
            correct=int(correct), answered=int(ep.answered), found_doc=int(scenario.payload["doc_id"] in ep.read_docs),
            cited_doc=int(ep.answer_doc == scenario.payload["doc_id"]), turns=ep.turns, searches=ep.searches,
            reads=len(ep.read_docs), tool_calls=ep.tool_calls, valid_tool_calls=ep.tool_calls - ep.malformed_calls,
            format_errors=ep.format_errors, no_tool_call=ep.no_tool_call,
            bad_json=ep.errors["bad_json"], unknown_tool=ep.errors["unknown_tool"],
            bad_arguments=ep.errors["bad_arguments"], tool_timeouts=timeouts, tool_errors=tool_errors,
            context_exhausted=context_exhausted)
        traj.log(f"{scenario.id}: answered={ep.answered} {ep.answer_text!r} (gold {scenario.payload['answer']!r}) "
                 f"reward {traj.reward:.2f} = {parts}")
        return traj
