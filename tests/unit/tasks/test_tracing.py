"""Langfuse tracing with the real SDK: in-memory span exporter, and a local sink for scores and OTLP traces."""

import gzip
import json
import os
import subprocess
import sys
import uuid

import pytest

from agents import SampledTurn, Trajectory
from tasks.support.tracing import Tracer, get_tracer, rollout_trace_id
from tests.fixtures_judge import LocalHTTPServer, Reply
from tests.paths import REPO

SECRET = "sk-lf-never-export-this-0123456789"


class LangfuseSink(LocalHTTPServer):
    """Answers the Langfuse endpoints the SDK posts to: scores (202) and OTLP traces (200)."""

    def handle(self, request):
        if request["path"].startswith("/api/public/scores"):
            return Reply(202, {"message": "Accepted"})
        if request["path"].startswith("/api/public/otel/v1/traces"):
            return Reply(200, raw=b"")
        return Reply(404, {"error": "not found"})

    def scores(self):
        return [s for r in self.requests if r["path"].startswith("/api/public/scores") for s in (r["json"] or [])]


@pytest.fixture
def sink():
    server = LangfuseSink()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def make_tracer(sink):
    """A tracer from an environment with keys; spans go to an in-memory exporter unless ``otlp=True``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    made = []

    def make(otlp: bool = False):
        exporter = None if otlp else InMemorySpanExporter()
        env = {"LANGFUSE_PUBLIC_KEY": f"pk-lf-test-{uuid.uuid4().hex}",  # SDK resources are per public key
               "LANGFUSE_SECRET_KEY": SECRET, "LANGFUSE_BASE_URL": sink.url}
        kwargs = {"tracer_provider": TracerProvider()} | ({} if otlp else {"span_exporter": exporter})
        tracer = Tracer.from_env(env, **kwargs)
        made.append(tracer)
        return tracer, exporter, env

    yield make
    for tracer in made:
        tracer.shutdown()


def rollout(tracer, index, attempt=0, reward=1.0):
    turn = SampledTurn(message={"role": "assistant", "content": "4"}, prompt_token_ids=[11, 12], token_ids=[424242],
                       logprobs=[-0.987654])
    with tracer.rollout_trace("run-a", 7, "sum-1", index, attempt=attempt, input={"question": "2+2?"}) as trace:
        trace.generation("policy.chat", "agent@7", input=[{"role": "user", "content": "2+2?"}], output=turn,
                         usage={"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}, latency_s=0.25)
        traj = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}, turn], reward=reward,
                          metrics={"judge_score": 0.8, "independent_reward": 1.0, "reward/correct": 1.0, "turns": 1},
                          logs=["judge m: score 0.800 - right answer"])
        trace.update(output={"reward": reward})
    return trace, traj


def test_disabled_without_keys_sends_nothing(sink, monkeypatch):
    monkeypatch.setenv("LANGFUSE_BASE_URL", sink.url)
    tracer = Tracer.from_env({"LANGFUSE_BASE_URL": sink.url, "LANGFUSE_PUBLIC_KEY": "pk-only"})
    assert not tracer.enabled and repr(tracer) == "Tracer(enabled=False)"
    trace, traj = rollout(tracer, 0)
    assert trace.trace_id == rollout_trace_id("run-a", 7, "sum-1", 0) and not trace.enabled
    trace.score("reward", 1.0)
    tracer.score(trace.trace_id, "reward", 1.0)
    tracer.score_trajectory(trace.trace_id, traj)
    tracer.generation("x", "m", trace_id=trace.trace_id)
    tracer.flush()
    assert sink.requests == []
    assert not get_tracer().enabled  # conftest removes the keys from the environment


def test_disabled_tracer_never_imports_langfuse():
    code = ("import sys; from tasks.support.tracing import get_tracer; t = get_tracer()\n"
            "with t.rollout_trace('r', 0, 's', 0) as tr: tr.generation('g', 'm', input='x', output='y')\n"
            "t.score(tr.trace_id, 'reward', 1.0); t.flush(); print(t.enabled, 'langfuse' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANGFUSE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_one_trace_per_rollout_stable_across_a_retry(make_tracer):
    from langfuse import Langfuse

    tracer, exporter, _ = make_tracer()
    first, _ = rollout(tracer, 0)
    second, _ = rollout(tracer, 1)
    retry, _ = rollout(tracer, 0, attempt=1)
    tracer.flush()
    assert retry.trace_id == first.trace_id != second.trace_id
    assert first.trace_id == Langfuse.create_trace_id(seed="trajflow/run-a/step-7/sum-1/0")
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "rollout"]
    assert len(roots) == 3 and len(spans) == 6
    assert {format(s.context.trace_id, "032x") for s in spans} == {first.trace_id, second.trace_id}
    attempts = sorted(s.attributes["langfuse.observation.metadata.attempt"] for s in roots
                      if format(s.context.trace_id, "032x") == first.trace_id)
    assert attempts == ['"0"', '"1"']
    gen = next(s for s in spans if s.name == "policy.chat")
    attrs = gen.attributes
    assert attrs["langfuse.observation.type"] == "generation"
    assert attrs["langfuse.observation.model.name"] == "agent@7"
    assert json.loads(attrs["langfuse.observation.usage_details"]) == {"input": 12, "output": 1, "total": 13}
    assert json.loads(attrs["langfuse.observation.output"]) == {"role": "assistant", "content": "4"}
    assert attrs["langfuse.observation.metadata.latency_s"] == "0.25"
    assert gen.parent is not None and gen.parent.span_id == roots[0].context.span_id


def test_scores_reach_the_scores_endpoint_with_stable_ids(make_tracer, sink):
    tracer, _, _ = make_tracer()
    trace, traj = rollout(tracer, 0)
    tracer.score_trajectory(trace.trace_id, traj)
    tracer.flush()
    again, _ = rollout(tracer, 0, attempt=1)
    again.score("reward", 1.0)
    tracer.flush()
    scores = sink.scores()
    assert {s["traceId"] for s in scores} == {trace.trace_id}
    assert sorted(s["name"] for s in scores) == ["independent_reward", "judge_score", "reward", "reward", "reward/correct"]
    rewards = [s for s in scores if s["name"] == "reward"]
    assert rewards[0]["id"] == rewards[1]["id"] and rewards[0]["value"] == 1.0
    judge = next(s for s in scores if s["name"] == "judge_score")
    assert judge["value"] == 0.8 and judge["comment"] == "judge m: score 0.800 - right answer"


def test_keys_never_leave_in_spans_or_payloads(make_tracer, sink):
    tracer, exporter, env = make_tracer()
    with tracer.rollout_trace("run-a", 1, "s", 0, input={"note": f"key is {SECRET}"}, metadata={"k": SECRET}) as trace:
        trace.generation("policy.chat", "agent@1", input=[{"role": "user", "content": SECRET}], output={"x": 1})
    trace.score("reward", 0.5, comment=f"leaked {SECRET}")
    tracer.flush()
    exported = json.dumps([{k: v if isinstance(v, str) else repr(v) for k, v in s.attributes.items()}
                           for s in exporter.get_finished_spans()])
    sent = json.dumps([r["json"] for r in sink.requests]) + "".join(r["path"] for r in sink.requests)
    for blob in (exported, sent):
        assert SECRET not in blob and env["LANGFUSE_PUBLIC_KEY"] not in blob
    assert "[redacted]" in exported and "[redacted]" in sent
    assert SECRET not in repr(tracer)


TOKEN_KEYS = ("token_ids", "prompt_token_ids", "logprobs", "top_logprobs")


async def test_sampled_turns_leave_without_token_ids_and_logprobs(make_tracer, sink, tiny_server):
    """Real sampled turns (the embedded server through the policy client, logprobs and top_logprobs on) in
    every form a rollout may hand the tracer: the openai Choice, its dict, the whole response, the
    trajectory's JSON with its SampledTurn dicts. Their token data must be stripped before anything leaves."""
    from agents.client import policy_client
    from tests.fixtures_server import API_KEY

    client = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        response = await client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "2+2?"}], max_tokens=6, seed=3,
            logprobs=True, top_logprobs=2)
    finally:
        await client.close()
    choice = response.choices[0]
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}, choice], reward=1.0)
    turn = traj.messages_and_choices[-1]
    payloads = {"choice": choice, "choice dict": choice.model_dump(), "response": response,
                "trajectory": traj.to_json_dict(), "sampled turns": traj.to_json_dict()["messages_and_choices"]}
    for name, payload in payloads.items():  # the token data is really in what is sent
        text = json.dumps(payload, default=lambda o: o.model_dump())
        assert all(key in text for key in ("token_ids", "logprobs")), name
    assert turn.token_ids and turn.prompt_token_ids and len(turn.logprobs) == len(turn.token_ids)

    tracer, exporter, _ = make_tracer()
    with tracer.rollout_trace("run-a", 2, "sum", 0, input=payloads["sampled turns"]) as trace:
        for name, payload in payloads.items():
            trace.generation(name, "tiny-random", input=payload, output=payload)
        trace.update(output=payloads["trajectory"], metadata={"last": payloads["choice dict"]})
    tracer.generation("outside", "tiny-random", trace_id=trace.trace_id, input=payloads["response"])
    tracer.flush()
    spans = exporter.get_finished_spans()
    assert len(spans) == 1 + len(payloads) + 1
    exported = json.dumps([dict(s.attributes) for s in spans])
    sent = json.dumps([r["json"] for r in sink.requests])
    assert "2+2?" in exported  # the messages themselves do leave
    for blob in (exported, sent):
        for key in TOKEN_KEYS:
            assert key not in blob, key
        for value in turn.logprobs:
            assert repr(value) not in blob


def test_spans_reach_the_otlp_endpoint(make_tracer, sink):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    tracer, _, _ = make_tracer(otlp=True)
    a, _ = rollout(tracer, 0)
    b, _ = rollout(tracer, 0, attempt=1)
    tracer.flush()
    posts = [r for r in sink.requests if r["path"].startswith("/api/public/otel/v1/traces")]
    assert posts, [r["path"] for r in sink.requests]
    trace_ids, names = set(), []
    for post in posts:
        raw = post["raw"]
        if post["headers"].get("content-encoding") == "gzip":
            raw = gzip.decompress(raw)
        req = ExportTraceServiceRequest.FromString(raw)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    trace_ids.add(span.trace_id.hex())
                    names.append(span.name)
    assert trace_ids == {a.trace_id} and sorted(names) == ["policy.chat", "policy.chat", "rollout", "rollout"]
    assert all(SECRET.encode() not in p["raw"] for p in posts)
