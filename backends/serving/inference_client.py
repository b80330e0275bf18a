"""Client for the management side of the inference dialect, identical for the embedded server and vLLM.

``base_url`` is the OpenAI base URL (``http://host:port/v1``; a URL without ``/v1`` works too). ``/health`` is
read from the server root, everything else under ``/v1``. Adapter loading posts vLLM's
``{"lora_name", "lora_path"}``; ``lora_path`` must be readable by the *server* (vLLM needs a local folder on its
host; the embedded server also accepts storage URIs). Errors raise `InferenceError` with the server's message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx

from agents.client import shared_ssl_context


class InferenceError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


def _message(reply: httpx.Response) -> str:
    try:
        body = reply.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except ValueError:
        return reply.text


class InferenceClient:
    """health / models / load_adapter / unload_adapter / wait_healthy, async; `health_sync` for blocking callers."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60):
        url = base_url.rstrip("/")
        self.root = url[: -len("/v1")] if url.endswith("/v1") else url
        self.base_url = self.root + "/v1"
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self._headers, verify=shared_ssl_context()) as http:
            return await http.request(method, path, **kw)

    async def health(self) -> bool:
        """True when GET /health answers 200 (False on any error). /health needs no key (vLLM's rule), so a wrong key
        shows only in the other calls."""
        try:
            return (await self._request("GET", self.root + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> list[str]:
        """Ids from GET /v1/models: the base model and every loaded adapter."""
        reply = await self._request("GET", self.base_url + "/models")
        if reply.status_code != 200:
            raise InferenceError(reply.status_code, _message(reply))
        return [m["id"] for m in reply.json()["data"]]

    async def load_adapter(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter; idempotent for the same (name, path)."""
        reply = await self._request("POST", self.base_url + "/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": path})
        if reply.status_code != 200:
            raise InferenceError(reply.status_code, _message(reply))

    async def unload_adapter(self, name: str) -> None:
        """POST /v1/unload_lora_adapter."""
        reply = await self._request("POST", self.base_url + "/unload_lora_adapter", json={"lora_name": name})
        if reply.status_code != 200:
            raise InferenceError(reply.status_code, _message(reply))

    async def wait_healthy(self, deadline_s: float) -> None:
        """Poll /health until it answers 200; TimeoutError after `deadline_s` seconds."""
        end = time.monotonic() + deadline_s
        delay = 0.05
        while not await self.health():
            if time.monotonic() >= end:
                raise TimeoutError(f"{self.root}/health did not answer 200 within {deadline_s} s")
            await asyncio.sleep(min(delay, max(0.0, end - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def health_sync(self) -> bool:
        """`health` for blocking code (the vLLM launcher); inside a running event loop it runs on a helper thread."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.health())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self.health()).result()
