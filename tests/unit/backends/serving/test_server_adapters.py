"""LoRA adapters on the embedded server: load from a folder or a file:// URI, per-row mixing, names, unload."""

from __future__ import annotations

import asyncio
import shutil

import openai
import pytest
import torch

from backends.serving.inference_client import InferenceClient, InferenceError
from tests.fixtures_server import API_KEY
from tests.unit.backends.serving.test_server import MESSAGES, teacher_forced_logprobs


async def _ask(client, model, seed=21, **kw):
    return await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, seed=seed,
                                                logprobs=True, extra_body={"ignore_eos": True}, **kw)


def _lps(reply):
    return torch.tensor([c.logprob for c in reply.choices[0].logprobs.content])


async def test_adapter_changes_outputs_and_unloading_restores_them(client, tiny_server, tiny_hf, random_adapter):
    folder, peft_model = random_adapter
    dialect = InferenceClient(tiny_server.base_url, api_key=API_KEY)
    base_before = await _ask(client, "tiny-random")
    await dialect.load_adapter("pol@1", str(folder))
    assert "pol@1" in await dialect.models()
    # base and adapter rows in one batch
    base_mid, tuned, tuned_bare = await asyncio.gather(_ask(client, "tiny-random"), _ask(client, "pol@1"),
                                                       _ask(client, "pol"))
    assert base_mid.choices[0].token_ids == base_before.choices[0].token_ids
    torch.testing.assert_close(_lps(base_mid), _lps(base_before))
    assert tuned.choices[0].token_ids != base_before.choices[0].token_ids
    assert tuned_bare.choices[0].token_ids == tuned.choices[0].token_ids  # bare name: highest loaded step
    # the adapter's logprobs are the peft model's
    reference = teacher_forced_logprobs(peft_model, tuned.prompt_token_ids, tuned.choices[0].token_ids)
    torch.testing.assert_close(_lps(tuned), reference, atol=1e-4, rtol=1e-4)
    base_ref = teacher_forced_logprobs(tiny_hf[0], tuned.prompt_token_ids, tuned.choices[0].token_ids)
    assert (base_ref - _lps(tuned)).abs().max() > 1e-2

    await dialect.unload_adapter("pol@1")
    assert "pol@1" not in await dialect.models()
    with pytest.raises(openai.NotFoundError):
        await _ask(client, "pol@1")
    with pytest.raises(openai.NotFoundError):
        await _ask(client, "pol")
    after = await _ask(client, "tiny-random")
    assert after.choices[0].token_ids == base_before.choices[0].token_ids
    torch.testing.assert_close(_lps(after), _lps(base_before))


async def test_load_from_file_uri_and_bare_name_means_highest_step(client, tiny_server, random_adapter, tmp_path):
    folder, _ = random_adapter
    copy = tmp_path / "policy" / "step-00003"
    shutil.copytree(folder, copy)
    dialect = InferenceClient(tiny_server.base_url, api_key=API_KEY)
    await dialect.load_adapter("uri@3", copy.as_uri())
    await dialect.load_adapter("uri@1", str(folder))
    await dialect.load_adapter("uri@1", str(folder))  # same name, same path: idempotent
    try:
        from_uri = await _ask(client, "uri@3")
        from_dir = await _ask(client, "uri@1")
        assert from_uri.choices[0].token_ids == from_dir.choices[0].token_ids
        shutil.rmtree(copy)  # the served copy is the fetched one in the cache, not the source
        bare = await _ask(client, "uri")
        assert bare.choices[0].token_ids == from_uri.choices[0].token_ids
        assert bare.model == "uri"
    finally:
        await dialect.unload_adapter("uri@3")
        await dialect.unload_adapter("uri@1")


async def test_more_adapters_than_device_slots_still_serve_correctly(client, tiny_server, random_adapter):
    folder, _ = random_adapter
    dialect = InferenceClient(tiny_server.base_url, api_key=API_KEY)
    slots = tiny_server.engine.config.max_loras
    names = [f"many@{i}" for i in range(slots + 2)]
    for name in names:
        await dialect.load_adapter(name, str(folder))
    try:
        replies = await asyncio.gather(*[_ask(client, name) for name in names])
        first = replies[0].choices[0].token_ids
        assert all(r.choices[0].token_ids == first for r in replies)
    finally:
        for name in names:
            await dialect.unload_adapter(name)


def test_loading_another_path_under_a_loaded_name_is_400(tiny_server, random_adapter, tmp_path):
    """Needs a loaded adapter, so it is not a catalogue row (test_bad_inputs_server.py has the stateless ones)."""
    import httpx

    folder, _ = random_adapter
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = tiny_server.base_url

    def load(name, path):
        return httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers)

    ok = load("x@1", str(folder))
    assert ok.status_code == 200 and "Success" in ok.text
    try:
        clash = load("x@1", str(other))
        assert clash.status_code == 400 and "already loaded" in clash.json()["error"]["message"]
    finally:
        httpx.post(url + "/unload_lora_adapter", json={"lora_name": "x@1"}, headers=headers)


async def test_inference_client_health_and_wait(tiny_server):
    dialect = InferenceClient(tiny_server.base_url, api_key=API_KEY)
    assert await dialect.health()
    await dialect.wait_healthy(5)
    wrong_key = InferenceClient(tiny_server.base_url, api_key="wrong")
    assert await wrong_key.health()  # /health needs no key (as vLLM's); everything under /v1 does
    with pytest.raises(InferenceError) as e:
        await wrong_key.models()
    assert e.value.status == 401
    dead = InferenceClient("http://127.0.0.1:9/v1", timeout=1)
    assert not await dead.health()
    with pytest.raises(TimeoutError):
        await dead.wait_healthy(0.5)
    assert (await dialect.models())[0] == "tiny-random"
    assert dialect.health_sync() and not dead.health_sync()  # blocking, from inside a running loop


def _reload(server, name: str, path: str) -> None:
    import httpx

    reply = httpx.post(server.base_url + "/load_lora_adapter", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"lora_name": name, "lora_path": path, "load_inplace": True}, timeout=60)
    assert reply.status_code == 200, reply.text


def _replace_files(source, target) -> None:
    for file in source.iterdir():
        if file.is_file():
            shutil.copyfile(file, target / file.name)


async def test_reloading_a_uri_after_its_files_changed_serves_the_new_weights(client, tiny_server, random_adapter,
                                                                              distinct_adapters, tmp_path):
    # both r=8 on every module: the same adapter_config.json, safetensors of the same size, other weights
    (first, first_peft), (second, second_peft) = random_adapter, distinct_adapters[2]
    folder = tmp_path / "published"
    shutil.copytree(first, folder)
    try:
        _reload(tiny_server, "moving@1", folder.as_uri())
        before = await _ask(client, "moving@1")
        torch.testing.assert_close(_lps(before), teacher_forced_logprobs(
            first_peft, before.prompt_token_ids, before.choices[0].token_ids), atol=1e-4, rtol=1e-4)
        _replace_files(second, folder)
        _reload(tiny_server, "moving@1", folder.as_uri())
        after = await _ask(client, "moving@1")
        torch.testing.assert_close(_lps(after), teacher_forced_logprobs(
            second_peft, after.prompt_token_ids, after.choices[0].token_ids), atol=1e-4, rtol=1e-4)
    finally:
        await InferenceClient(tiny_server.base_url, api_key=API_KEY).unload_adapter("moving@1")


def test_reloading_an_s3_uri_after_its_objects_changed_serves_the_new_weights(tiny_model_path, s3_client, s3_bucket,
                                                                              random_adapter, distinct_adapters):
    from backends.inference.engine import SamplingParams
    from backends.serving.app import start_server

    prefix = "runs/proj/run/steps/00001/adapter"

    def upload(folder):
        for file in folder.iterdir():
            if file.is_file():
                s3_client.put_object(Bucket=s3_bucket, Key=f"{prefix}/{file.name}", Body=file.read_bytes())

    uri = f"s3://{s3_bucket}/{prefix}"
    params = SamplingParams(max_tokens=8, seed=5, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    with start_server("tiny-random", api_key=API_KEY, adapter_roots=[f"s3://{s3_bucket}/runs"]) as server:
        for folder, peft_model in (random_adapter, distinct_adapters[2]):
            upload(folder)
            _reload(server, "s3moving@1", uri)
            (completion,) = server.engine.generate_sync(prompt, params, "s3moving@1", timeout=60)
            torch.testing.assert_close(torch.tensor(completion.logprobs), teacher_forced_logprobs(
                peft_model, prompt, completion.token_ids), atol=1e-4, rtol=1e-4)
