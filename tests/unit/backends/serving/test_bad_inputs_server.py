"""Every bad request we know of against the embedded server, as one table: request -> HTTP status and error text.

Each row is sent over real HTTP to the embedded server on tiny-random (`tests.fixtures_server.tiny_server`, with an
API key); the answer must be the status with an OpenAI-shaped error whose message matches, nothing may be left
loaded, and the server must stay healthy. A new bad input we learn of gets a row here.

Bad requests that need more than one request or their own server are tested next to what they exercise:
a wrong or missing key (test_server.py::test_the_key_guards_every_route_but_health), another path under a loaded
adapter's name (test_server_adapters.py), an unknown model through the openai client (test_server.py), URLs that
must not be fetched and S3 prefixes (test_adapter_sources.py), a configured body cap and clients that disconnect
(test_server_availability.py), non-finite weights written past the load check (inference/test_lora_slots.py).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures_server import API_KEY
from tests.unit.backends.serving.test_server import MESSAGES

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@dataclass(frozen=True)
class Chunked:
    """A body sent with Transfer-Encoding: chunked (no Content-Length), `size` bytes in 64 KiB pieces."""

    size: int


@dataclass(frozen=True)
class Bad:
    """One bad request: POST `body` to `path`; `body` is JSON (dict/list/str), raw bytes, Chunked, or a function of
    the adapter folders (`Adapters`). Expected: `status`, and an error message that `message` (a regex) matches."""

    id: str
    path: str
    body: Any
    status: int
    message: str


def chat(**fields) -> dict:
    return {"model": "tiny-random", "messages": MESSAGES, "max_tokens": 2, **fields}


def complete(**fields) -> dict:
    return {"model": "tiny-random", "prompt": [1, 2], "max_tokens": 2, **fields}


def raw_chat(fragment: str) -> bytes:
    """A chat body with `fragment` (raw JSON text) as its last field."""
    return ('{"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            + fragment + "}").encode()


def load(variant: str, name: str = "bad@1") -> Callable[[Adapters], dict]:
    return lambda adapters: {"lora_name": name, "lora_path": str(adapters.folder(variant))}


def named(name: str) -> Callable[[Adapters], dict]:
    return lambda adapters: {"lora_name": name, "lora_path": str(adapters.source)}


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


CASES = [
    # -- bodies (request_bodies) ---------------------------------------------------------------------------------
    *[Bad(f"body-not-json{path.replace('/', '-')}", path, b"{not json", 400, "not valid JSON")
      for path in (CHAT, COMPLETIONS, LOAD, UNLOAD)],
    Bad("body-not-utf8", CHAT, b"\xff\xfe{}", 400, "not valid JSON"),
    *[Bad(f"body-json-array{path.replace('/', '-')}", path, [{"lora_name": "x", "lora_path": "y"}], 400,
          "must be a JSON object") for path in (CHAT, COMPLETIONS, LOAD, UNLOAD)],
    Bad("body-json-string", CHAT, "hello", 400, "must be a JSON object"),
    Bad("body-too-large", CHAT, b" " * (5 * 2**20), 413, "larger than this server's limit of 4194304 bytes"),
    Bad("body-too-large-chunked", CHAT, Chunked(5 * 2**20), 413, "larger than this server's limit"),
    Bad("body-too-large-adapter-route", LOAD, b" " * (5 * 2**20), 413, "larger than this server's limit"),
    Bad("body-100k-deep", CHAT, deep(100_000), 400, "nests deeper than 64 levels"),
    Bad("body-100k-deep-adapter-route", LOAD, deep(100_000), 400, "nests deeper than 64 levels"),
    Bad("body-65-deep", CHAT, chat(messages=[{"role": "user", "content": "hi", "x": json.loads(deep(63))}]), 400,
        "nests deeper than 64 levels"),
    Bad("body-lone-surrogate-in-content", CHAT, chat(messages=[{"role": "user", "content": "a\ud800b"}]), 400,
        "lone UTF-16 surrogate"),
    Bad("body-lone-surrogate-in-key", CHAT, chat(**{"\udfff": 1}), 400, "lone UTF-16 surrogate"),
    Bad("body-lone-surrogate-in-prompt", COMPLETIONS, complete(prompt="\ud83d"), 400, "lone UTF-16 surrogate"),
    Bad("body-lone-surrogate-in-lora-name", LOAD, {"lora_name": "\ud800", "lora_path": "/x"}, 400,
        "lone UTF-16 surrogate"),
    # -- chat messages ---------------------------------------------------------------------------------------------
    Bad("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    Bad("messages-unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    Bad("messages-no-content", CHAT, chat(messages=[{"role": "user"}]), 400, "content is required"),
    Bad("messages-number-content", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400, "content must be"),
    Bad("messages-image-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "text parts"),
    Bad("messages-not-objects", CHAT, chat(messages=["hi"]), 400, "messages"),
    Bad("messages-tool-calls-not-a-list", CHAT, chat(messages=[{"role": "assistant", "content": None,
                                                                "tool_calls": "f()"}]), 400, "tool_calls"),
    # -- chat parameters (OpenAI's types, no coercion) --------------------------------------------------------------
    Bad("n-string", CHAT, chat(n="2"), 400, "n: Input should be a valid integer"),
    Bad("n-float", CHAT, chat(n=2.0), 400, "n: Input should be a valid integer"),
    Bad("n-zero", CHAT, chat(n=0), 400, "n: Input should be greater than or equal to 1"),
    Bad("max-tokens-string", CHAT, chat(max_tokens="5"), 400, "max_tokens: Input should be a valid integer"),
    Bad("temperature-string", CHAT, chat(temperature="0.5"), 400, "temperature: Input should be a valid number"),
    Bad("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature"),
    Bad("temperature-nan", CHAT, raw_chat('"temperature": NaN'), 400, "temperature"),
    Bad("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    Bad("seed-string", CHAT, chat(seed="7"), 400, "seed: Input should be a valid integer"),
    Bad("logprobs-string", CHAT, chat(logprobs="yes"), 400, "logprobs: Input should be a valid boolean"),
    Bad("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs requires logprobs"),
    Bad("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    Bad("stop-token-id-negative", CHAT, chat(stop_token_ids=[-1]), 400, "token id -1 is outside the vocabulary"),
    Bad("stop-token-id-beyond-vocab", CHAT, chat(stop_token_ids=[5, 10**6]), 400,
        "token id 1000000 is outside the vocabulary"),
    Bad("stop-token-id-string", CHAT, chat(stop_token_ids=["5"]), 400, "stop_token_ids"),
    Bad("frequency-penalty", CHAT, chat(frequency_penalty=0.5), 400, "not supported by the embedded engine"),
    Bad("top-k", CHAT, chat(top_k=5), 400, "not supported by the embedded engine: top_k"),
    Bad("prompt-longer-than-context", CHAT, chat(messages=[{"role": "user", "content": "word " * 2000}]), 400,
        "maximum context length"),
    Bad("max-tokens-beyond-context", CHAT, chat(max_tokens=1024), 400, "maximum context length"),
    Bad("unknown-model", CHAT, chat(model="no-such-model"), 404, "no-such-model.*tiny-random"),
    # -- tools -----------------------------------------------------------------------------------------------------
    Bad("tool-choice-unknown", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    Bad("tool-choice-without-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice requires tools"),
    Bad("tool-choice-names-no-tool", CHAT, chat(tools=[TOOL], tool_choice={"type": "function",
                                                                         "function": {"name": "g"}}), 400, "'g'"),
    Bad("tool-not-an-object", CHAT, chat(tools=["f"]), 400, "tools.0: Input should be a valid dictionary"),
    Bad("tool-without-name", CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, r"tools\[0\] must be"),
    Bad("tool-parameters-string", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "city: str"}}]), 400, r"tools\[0\].function.parameters must be a JSON Schema"),
    Bad("tool-parameters-array-schema", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]), 400, r"parameters must be a JSON Schema object"),
    # -- completions -----------------------------------------------------------------------------------------------
    Bad("prompt-empty-string", COMPLETIONS, complete(prompt=""), 400, "prompt is empty"),
    Bad("prompt-empty-list", COMPLETIONS, complete(prompt=[]), 400, "prompt must be a non-empty"),
    Bad("prompt-id-beyond-vocab", COMPLETIONS, complete(prompt=[1, 2, 10**6]), 400,
        "token id 1000000 at position 2 is outside the vocabulary"),
    Bad("prompt-id-negative", COMPLETIONS, complete(prompt=[1, -3]), 400, "token id -3 at position 1"),
    Bad("prompt-mixed-list", COMPLETIONS, complete(prompt=["ok", [1, "x"]]), 400,
        r"prompt\[1\] must be a string or a list of integer token ids"),
    Bad("prompt-missing", COMPLETIONS, {"model": "tiny-random"}, 400, "prompt: Field required"),
    Bad("completions-unknown-model", COMPLETIONS, complete(model="nope@3"), 404, "nope@3"),
    Bad("completions-echo", COMPLETIONS, complete(echo=True), 400, "not supported by the embedded engine: echo"),
    Bad("completions-max-tokens-zero", COMPLETIONS, complete(max_tokens=0), 400, "max_tokens"),
    Bad("completions-max-tokens-beyond-context", COMPLETIONS, complete(max_tokens=10**6), 400,
        "maximum context length"),
    Bad("completions-n-string", COMPLETIONS, complete(n="2"), 400, "n: Input should be a valid integer"),
    Bad("completions-logprobs-bool", COMPLETIONS, complete(logprobs=True), 400, "logprobs"),
    Bad("completions-stop-token-id-beyond-vocab", COMPLETIONS, complete(stop_token_ids=[10**6]), 400,
        "outside the vocabulary"),
    # -- adapter names and fields (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) -----------------------------
    Bad("adapter-fields-missing", LOAD, {"lora_name": "bad@1"}, 400, "lora_name and lora_path"),
    Bad("adapter-fields-not-strings", LOAD, {"lora_name": 1, "lora_path": ["x"]}, 400, "lora_name and lora_path"),
    Bad("adapter-load-inplace-string", LOAD, lambda a: {**named("bad@1")(a), "load_inplace": "yes"}, 400,
        "load_inplace must be true or false"),
    Bad("adapter-name-base-model", LOAD, named("tiny-random"), 400, "base model's name"),
    *[Bad(f"adapter-name-{label}", LOAD, named(name), 400, "lora_name")
      for label, name in (("empty", ""), ("space", "a b"), ("slash", "runs/x@1"), ("dotdot", "..@1"),
                          ("dotdot-inside", "a..b"), ("nul", "x\x00y"), ("newline", "x\ny"), ("backslash", "a\\b"),
                          ("too-long", "x" * 201))],
    Bad("unload-unknown", UNLOAD, {"lora_name": "never"}, 404, "'never' cannot be found"),
    Bad("unload-name-missing", UNLOAD, {}, 400, "lora_name"),
    # -- adapters whose files are wrong ------------------------------------------------------------------------------
    *[Bad(f"adapter-{variant.replace('_', '-')}", LOAD, load(variant), 400, message) for variant, message in (
        ("nan_weights", "lora_A holds NaN or infinite"),
        ("inf_weights", "lora_B .* holds NaN or infinite"),
        ("nan_alpha", "lora_alpha must be a finite number"),
        ("huge_alpha", "lora_B .* (NaN or infinite|range)"),
        ("string_alpha", "lora_alpha must be a finite number, got '16'"),
        ("string_r", "r must be an integer, got '8'"),
        ("float_r", "r must be an integer, got 8.5"),
        ("bool_r", "r must be an integer, got True"),
        ("zero_r", r"rank r=0 outside 1\.\.64"),
        ("config_not_json", "unreadable adapter_config.json"),
        ("weights_corrupt", "unreadable adapter_model.safetensors"),
        ("pickle_only", "pickle .bin files are not read"),
        ("dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("missing", "no adapter_config.json"),
    )],
    Bad("adapter-file-uri-missing", LOAD, lambda a: {"lora_name": "bad@1",
                                                      "lora_path": (a.root / "nowhere").as_uri()}, 400,
        "adapter_config.json not found"),
    # -- where adapters may come from (adapter_sources; test_adapter_sources.py checks nothing is fetched) ----------
    *[Bad(f"adapter-scheme-{scheme}", LOAD, {"lora_name": "bad@1", "lora_path": url}, 400,
          f"scheme '{scheme}' is not allowed")
      for scheme, url in (("http", "http://169.254.169.254/latest/meta-data"), ("https", "https://example.com/a"),
                          ("ftp", "ftp://example.com/a"), ("memory", "memory://a"), ("gs", "gs://bucket/a"))],
    Bad("adapter-chained-url", LOAD, {"lora_name": "bad@1", "lora_path": "simplecache::s3://bucket/a"}, 400,
        "chained URLs"),
    Bad("adapter-local-outside-roots", LOAD, {"lora_name": "bad@1", "lora_path": "/etc"}, 400,
        "outside this server's adapter roots"),
    Bad("adapter-file-uri-outside-roots", LOAD, {"lora_name": "bad@1", "lora_path": "file:///etc"}, 400,
        "outside this server's adapter roots"),
    Bad("adapter-file-uri-other-host", LOAD, {"lora_name": "bad@1", "lora_path": "file://example.com/etc"}, 400,
        "must name this machine"),
    Bad("adapter-dotdot-escapes-root", LOAD,
        lambda adapters: {"lora_name": "bad@1", "lora_path": str(adapters.root) + "/../../../../../../etc"}, 400,
        "outside this server's adapter roots"),
    Bad("adapter-s3-without-storage-root", LOAD, {"lora_name": "bad@1", "lora_path": "s3://bucket/runs/a"}, 400,
        "outside this server's adapter roots"),
    Bad("adapter-nul-in-path", LOAD, {"lora_name": "bad@1", "lora_path": "/tmp/a\x00b"}, 400,
        "control characters"),
]


class Adapters:
    """Adapter folders made from `random_adapter` with one thing broken each (`folder(variant)`)."""

    def __init__(self, source: Path, root: Path):
        self.source, self.root = source, root

    def folder(self, variant: str) -> Path:
        target = self.root / variant
        if variant == "missing" or target.exists():
            return target
        shutil.copytree(self.source, target)
        config_file = target / "adapter_config.json"
        config = json.loads(config_file.read_text())
        getattr(self, "_" + variant)(config, target)
        config_file.write_text("{not json" if config.pop("__raw__", False) else json.dumps(config))
        return target

    @staticmethod
    def _tensors(target: Path, change) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(target / "adapter_model.safetensors"))
        change(tensors)
        save_file(tensors, str(target / "adapter_model.safetensors"))

    def _nan_weights(self, config, target):
        def change(tensors):
            key = next(k for k in sorted(tensors) if "lora_A" in k)
            tensors[key][0, 0] = float("nan")
        self._tensors(target, change)

    def _inf_weights(self, config, target):
        def change(tensors):
            key = next(k for k in sorted(tensors) if "lora_B" in k)
            tensors[key][0, 0] = float("inf")
        self._tensors(target, change)

    def _nan_alpha(self, config, target):
        config["lora_alpha"] = float("nan")

    def _huge_alpha(self, config, target):
        config["lora_alpha"] = 1e300  # finite, but not once B is scaled by it in float32

    def _dora(self, config, target):
        config["use_dora"] = True

    def _string_alpha(self, config, target):
        config["lora_alpha"] = "16"

    def _string_r(self, config, target):
        config["r"] = "8"

    def _float_r(self, config, target):
        config["r"] = 8.5

    def _bool_r(self, config, target):
        config["r"] = True

    def _zero_r(self, config, target):
        config["r"] = 0

    def _modules_to_save(self, config, target):
        config["modules_to_save"] = ["lm_head"]

    def _config_not_json(self, config, target):
        config["__raw__"] = True  # folder() writes the file; replaced below

    def _weights_corrupt(self, config, target):
        (target / "adapter_model.safetensors").write_bytes(b"\x00" * 100)

    def _pickle_only(self, config, target):
        (target / "adapter_model.safetensors").rename(target / "adapter_model.bin")


@pytest.fixture(scope="session")
def adapters(random_adapter, tmp_path_factory) -> Adapters:
    return Adapters(random_adapter[0], tmp_path_factory.mktemp("bad-adapters"))


def _pieces(size: int) -> Iterator[bytes]:
    for start in range(0, size, 65536):
        yield b" " * min(65536, size - start)


def _send(server, case: Bad, adapters: Adapters) -> httpx.Response:
    body = case.body(adapters) if callable(case.body) else case.body
    headers = {**AUTH, "Content-Type": "application/json"}
    if isinstance(body, Chunked):
        content = _pieces(body.size)
    elif isinstance(body, bytes):
        content = body
    else:
        content = json.dumps(body).encode()
    return httpx.post(server.url + case.path, content=content, headers=headers, timeout=60)


def _served(server) -> set[str]:
    return {m["id"] for m in httpx.get(server.base_url + "/models", headers=AUTH).json()["data"]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_request_is_refused_with_a_message(tiny_server, adapters, case):
    before = _served(tiny_server)
    reply = _send(tiny_server, case, adapters)
    added = _served(tiny_server) - before
    for name in added:  # keep the next rows independent of a row that got through
        httpx.post(tiny_server.base_url + "/unload_lora_adapter", json={"lora_name": name}, headers=AUTH)
    assert reply.status_code == case.status, reply.text
    error = reply.json()["error"]
    assert re.search(case.message, error["message"]), error
    assert error["code"] == case.status
    assert not added
    assert httpx.get(tiny_server.url + "/health", timeout=10).status_code == 200
