"""Every bad request we know of against the embedded server, as one table: request -> HTTP status and error text.

Each row is sent over real HTTP to the embedded server on tiny-random (`tests.fixtures_server.tiny_server`, with an
API key); the answer must be the status with an OpenAI-shaped error whose message matches, and the server must
stay healthy afterwards. A new bad input we learn of gets a row here.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from tests.fixtures_server import API_KEY
from tests.unit.backends.serving.test_server import MESSAGES

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass(frozen=True)
class Bad:
    """One bad request: `body` is JSON (dict/list), raw bytes, or a function of the adapter folders (`Adapters`)."""

    id: str
    path: str
    body: Any
    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)


def chat(**fields) -> dict:
    return {"model": "tiny-random", "messages": MESSAGES, "max_tokens": 2, **fields}


def load(variant: str, name: str = "bad@1") -> Callable[["Adapters"], dict]:
    return lambda adapters: {"lora_name": name, "lora_path": str(adapters.folder(variant))}


CASES = [
    # -- adapters whose files are wrong (POST /v1/load_lora_adapter) -------------------------------------------------
    Bad("adapter-nan-weights", "/v1/load_lora_adapter", load("nan_weights"), 400, "lora_A holds NaN or infinite"),
    Bad("adapter-inf-weights", "/v1/load_lora_adapter", load("inf_weights"), 400, "lora_B .* holds NaN or infinite"),
    Bad("adapter-nan-alpha", "/v1/load_lora_adapter", load("nan_alpha"), 400, "lora_alpha must be a finite number"),
    Bad("adapter-huge-alpha", "/v1/load_lora_adapter", load("huge_alpha"), 400, "lora_B .* (NaN or infinite|range)"),
    Bad("adapter-dora", "/v1/load_lora_adapter", load("dora"), 400, "DoRA"),
    Bad("adapter-missing-folder", "/v1/load_lora_adapter", load("missing"), 400, "no adapter_config.json"),
    # -- where adapters may come from (adapter_sources; test_adapter_sources.py checks nothing is fetched) --------
    *[Bad(f"adapter-scheme-{scheme}", "/v1/load_lora_adapter", {"lora_name": "bad@1", "lora_path": url}, 400,
          f"scheme '{scheme}' is not allowed")
      for scheme, url in (("http", "http://169.254.169.254/latest/meta-data"), ("https", "https://example.com/a"),
                          ("ftp", "ftp://example.com/a"), ("memory", "memory://a"), ("gs", "gs://bucket/a"))],
    Bad("adapter-chained-url", "/v1/load_lora_adapter",
        {"lora_name": "bad@1", "lora_path": "simplecache::s3://bucket/a"}, 400, "chained URLs"),
    Bad("adapter-local-outside-roots", "/v1/load_lora_adapter", {"lora_name": "bad@1", "lora_path": "/etc"}, 400,
        "outside this server's adapter roots"),
    Bad("adapter-file-uri-outside-roots", "/v1/load_lora_adapter", {"lora_name": "bad@1", "lora_path": "file:///etc"},
        400, "outside this server's adapter roots"),
    Bad("adapter-file-uri-other-host", "/v1/load_lora_adapter",
        {"lora_name": "bad@1", "lora_path": "file://example.com/etc"}, 400, "must name this machine"),
    Bad("adapter-dotdot-escapes-root", "/v1/load_lora_adapter",
        lambda adapters: {"lora_name": "bad@1", "lora_path": str(adapters.root) + "/../../../../../../etc"}, 400,
        "outside this server's adapter roots"),
    Bad("adapter-s3-without-storage-root", "/v1/load_lora_adapter",
        {"lora_name": "bad@1", "lora_path": "s3://bucket/runs/a"}, 400, "outside this server's adapter roots"),
    Bad("adapter-nul-in-path", "/v1/load_lora_adapter", {"lora_name": "bad@1", "lora_path": "/tmp/a\x00b"}, 400,
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
        edit = getattr(self, "_" + variant)
        edit(config, target)
        config_file.write_text(json.dumps(config))
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


@pytest.fixture(scope="session")
def adapters(random_adapter, tmp_path_factory) -> Adapters:
    return Adapters(random_adapter[0], tmp_path_factory.mktemp("bad-adapters"))


async def _send(server, case: Bad, adapters: Adapters) -> httpx.Response:
    body = case.body(adapters) if callable(case.body) else case.body
    headers = {**AUTH, **case.headers}
    async with httpx.AsyncClient(timeout=60) as http:
        if isinstance(body, bytes):
            return await http.post(server.url + case.path, content=body,
                                   headers={"Content-Type": "application/json", **headers})
        return await http.post(server.url + case.path, json=body, headers=headers)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
async def test_bad_request_is_refused_with_a_message(tiny_server, adapters, case):
    reply = await _send(tiny_server, case, adapters)
    if reply.status_code == 200 and case.path == "/v1/load_lora_adapter":  # keep the next rows independent
        httpx.post(tiny_server.base_url + "/unload_lora_adapter", json={"lora_name": "bad@1"}, headers=AUTH)
    assert reply.status_code == case.status, reply.text
    error = reply.json()["error"]
    assert re.search(case.message, error["message"]), error
    assert error["code"] == case.status
    assert httpx.get(tiny_server.url + "/health", headers=AUTH, timeout=10).status_code == 200
    assert "bad@1" not in [m["id"] for m in httpx.get(tiny_server.base_url + "/models", headers=AUTH).json()["data"]]
