"""POST /v1/completions on the embedded server through the real openai client: token-id and text prompts,
adapters, completions-format logprobs checked against a teacher-forced forward, streaming, and bad input."""

from __future__ import annotations

import openai
import pytest
import torch

from backends.serving.inference_client import InferenceClient
from tests.fixtures_server import API_KEY
from tests.unit.backends.serving.test_server import teacher_forced_logprobs

PROBE = {"return_token_ids": True, "ignore_eos": True}


def _prompt(tok) -> list[int]:
    return tok("What is 2 + 3? The answer is", add_special_tokens=False)["input_ids"]


async def test_token_id_prompt_greedy_with_completions_logprobs(client, tiny_hf):
    model, tok = tiny_hf
    prompt = _prompt(tok)
    r = await client.completions.create(model="tiny-random", prompt=prompt, max_tokens=12, temperature=0,
                                        logprobs=2, extra_body=PROBE)
    assert r.object == "text_completion" and len(r.choices) == 1
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == prompt
    assert len(ids) == 12 and choice.finish_reason == "length"  # ignore_eos: all 12 tokens
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 12
    assert choice.text == tok.decode(ids, skip_special_tokens=True)
    lp = choice.logprobs
    reference = teacher_forced_logprobs(model, prompt, ids)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), reference, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # greedy: every token is the argmax of the model's own next-token distribution
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
    assert logits.argmax(-1).tolist() == ids
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    first = lp.top_logprobs[0]
    assert list(first)[0] == lp.tokens[0] and 1 <= len(first) <= 3  # the sampled token, then the top 2
    assert max(first.values()) == pytest.approx(lp.token_logprobs[0])  # greedy: it is the best


async def test_text_prompt_equals_its_token_ids_and_tokens_as_ids(client, tiny_hf):
    _, tok = tiny_hf
    text = "What is 2 + 3? The answer is"
    by_text, by_ids = [await client.completions.create(
        model="tiny-random", prompt=p, max_tokens=6, temperature=0, logprobs=0,
        extra_body={**PROBE, "return_tokens_as_token_ids": True}) for p in (text, _prompt(tok))]
    assert by_text.choices[0].model_extra["prompt_token_ids"] == _prompt(tok)  # tiny-random adds no BOS
    ids = by_ids.choices[0].model_extra["token_ids"]
    assert by_text.choices[0].model_extra["token_ids"] == ids
    assert by_text.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert [list(d) for d in by_ids.choices[0].logprobs.top_logprobs] == [[f"token_id:{t}"] for t in ids]


async def test_adapter_by_name_changes_the_answer_and_matches_peft(client, tiny_server, tiny_hf, random_adapter):
    _, tok = tiny_hf
    folder, peft_model = random_adapter
    dialect = InferenceClient(tiny_server.base_url, API_KEY)
    await dialect.load_adapter("cmpl@1", str(folder))
    try:
        prompt = _prompt(tok)
        base, tuned = [await client.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0,
                                                       logprobs=1, extra_body=PROBE)
                       for m in ("tiny-random", "cmpl@1")]
        ids = tuned.choices[0].model_extra["token_ids"]
        assert tuned.model == "cmpl@1" and ids != base.choices[0].model_extra["token_ids"]
        reference = teacher_forced_logprobs(peft_model, prompt, ids)
        torch.testing.assert_close(torch.tensor(tuned.choices[0].logprobs.token_logprobs), reference,
                                   atol=1e-4, rtol=1e-4)
    finally:
        await dialect.unload_adapter("cmpl@1")


async def test_several_prompts_n_and_streaming(client, tiny_hf):
    _, tok = tiny_hf
    prompts = [_prompt(tok), tok("def add(a, b):", add_special_tokens=False)["input_ids"]]
    r = await client.completions.create(model="tiny-random", prompt=prompts, n=2, max_tokens=5, seed=3,
                                        extra_body=PROBE)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert r.usage.completion_tokens == 20
    same = await client.completions.create(model="tiny-random", prompt=prompts[1], n=2, max_tokens=5, seed=3,
                                           extra_body=PROBE)
    assert [c.model_extra["token_ids"] for c in same.choices] == [c.model_extra["token_ids"] for c in r.choices[2:]]
    stream = await client.completions.create(model="tiny-random", prompt=prompts[1], n=2, max_tokens=5, seed=3,
                                             stream=True, stream_options={"include_usage": True}, extra_body=PROBE)
    texts, finish, usage = {}, {}, None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in same.choices}
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 10


# Bad completions bodies (empty prompts, ids outside the vocabulary, echo, ...): rows of test_bad_inputs_server.py.


async def test_completions_need_the_key(tiny_server):
    bad = openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="tiny-random", prompt=[1, 2], max_tokens=2)
    await bad.close()
