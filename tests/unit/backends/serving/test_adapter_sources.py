"""Where /v1/load_lora_adapter may read from (`backends.serving.adapter_sources`): no URL a caller chooses is
fetched, local folders only under the adapter roots (the trajflow cache by default), s3:// under a configured prefix.
The single bad paths are rows of the catalogue (test_bad_inputs_server.py); these tests need their own servers."""

from __future__ import annotations

import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from backends.modeling.loading import cache_root
from backends.serving.app import start_server
from tests.fixtures_server import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _load(server, name: str, path: str, headers=None) -> httpx.Response:
    return httpx.post(server.base_url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers=headers or {}, timeout=60)


@pytest.fixture
def recording_http_server():
    """A plain HTTP server on 127.0.0.1 that records every path asked of it (and serves nothing)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(404)
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_http_lora_path_is_refused_before_any_request(tiny_server, recording_http_server, scheme):
    url, seen = recording_http_server
    target = url.replace("http", scheme, 1) + "/adapters/evil"
    reply = _load(tiny_server, "ssrf@1", target, AUTH)
    assert reply.status_code == 400
    assert f"scheme '{scheme}' is not allowed" in reply.json()["error"]["message"]
    assert seen == []


@pytest.fixture(scope="module")
def default_server(tiny_model_path):
    """A server started the way the flow and LocalBackend start theirs: no key, loopback, default adapter roots."""
    handle = start_server("tiny-random")
    yield handle
    handle.stop()


def test_default_roots_admit_the_cache_where_publish_puts_adapters_and_nothing_else(
        default_server, random_adapter, tmp_path):
    folder = random_adapter[0]
    cached = cache_root() / "adapters" / "proj" / "run-sources" / "00001"  # backends.policy.publish.local_adapter
    shutil.copytree(folder, cached, dirs_exist_ok=True)
    try:
        assert _load(default_server, "cached@1", str(cached)).status_code == 200
        assert _load(default_server, "cached-uri@1", cached.as_uri()).status_code == 200
        outside = tmp_path / "elsewhere"
        shutil.copytree(folder, outside)
        link = cached.parent / "link-out"
        link.symlink_to(outside, target_is_directory=True)
        for path in (str(outside), outside.as_uri(), str(link), str(cached / ".." / ".." / ".." / ".." / ".." / "x")):
            reply = _load(default_server, "outside@1", path)
            assert reply.status_code == 400 and "outside this server's adapter roots" in reply.text, path
    finally:
        shutil.rmtree(cached.parent)
        for name in ("cached@1", "cached-uri@1"):
            httpx.post(default_server.base_url + "/unload_lora_adapter", json={"lora_name": name})


def test_an_unkeyed_server_stays_on_loopback(tiny_model_path):
    with pytest.raises(ValueError, match="needs an API key"):
        start_server("tiny-random", host="0.0.0.0")


def _upload(s3_client, bucket: str, prefix: str, folder: Path) -> None:
    for file in folder.iterdir():
        if file.is_file():
            s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{file.name}", Body=file.read_bytes())


def test_s3_adapters_load_only_under_a_configured_prefix(tiny_model_path, s3_client, s3_bucket, random_adapter):
    _upload(s3_client, s3_bucket, "runs/proj/run/steps/00001/adapter", random_adapter[0])
    _upload(s3_client, s3_bucket, "private/adapter", random_adapter[0])
    with start_server("tiny-random", api_key=API_KEY, adapter_roots=[f"s3://{s3_bucket}/runs"]) as server:
        ok = _load(server, "s3@1", f"s3://{s3_bucket}/runs/proj/run/steps/00001/adapter", AUTH)
        assert ok.status_code == 200, ok.text
        for path, reason in ((f"s3://{s3_bucket}/private/adapter", "outside this server's adapter roots"),
                             (f"s3://{s3_bucket}/runs-other/adapter", "outside this server's adapter roots"),
                             (f"s3://{s3_bucket}/runs/../private/adapter", "'..'"),
                             (f"s3://another-{s3_bucket}/runs/proj", "outside this server's adapter roots")):
            reply = _load(server, "s3-bad@1", path, AUTH)
            assert reply.status_code == 400 and reason in reply.json()["error"]["message"], (path, reply.text)
