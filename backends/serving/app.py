"""The embedded OpenAI-compatible HTTP server (FastAPI) over an `Engine`, in vLLM's dialect.

Routes: ``POST /v1/chat/completions`` (`backends.serving.chat` has the request/response rules), ``POST /v1/completions``
(text or token-id prompts, `completions` has the rules), ``GET /v1/models``,
``GET /health``, ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}``,
``POST /v1/unload_lora_adapter {"lora_name"}``. Errors are OpenAI-shaped, ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad input (malformed messages, prompt longer than the context, unsupported parameters, an
adapter path outside the adapter roots), 401 without the API key, 404 for an unknown model (the message lists the
names that exist), 413 for a body over the size cap (`request_bodies`), 500 for engine failures.

- **Key.** With ``api_key`` set, every route but ``GET /health`` needs ``Authorization: Bearer <key>`` (vLLM's
  rule: a load balancer's health check carries no key, and the answer tells nothing).
- **The event loop does only small work.** Bodies are parsed, validated, templated and tokenized in one job, and
  responses built and encoded to bytes in another (`request_bodies`, `tokenizer_pool`, `response_bytes`). A job
  runs on a worker thread when it may be large (a chat body, whose template's cost the body's size does not bound; a
  completions body over `INLINE_BODY_BYTES`; an answer of more than `INLINE_ANSWER_TOKENS` tokens), so no request
  can hold up another or ``/health`` for long; a small one runs on the loop, with the loop's own tokenizer copy: a
  worker job costs two thread hops (~80 us on an idle CPU, up to a GIL switch interval each under load) and a loop
  wake-up, more than the work itself (a 128-token-id completions body: ~0.1 ms to parse and check; an answer of
  128 tokens with logprobs: ~0.1 ms to build and encode), and when 64 requests arrive at once the hops queue
  behind each other (`benchmarks/serving_intake.py`). Streamed chunks are built on the loop likewise, being small
  (a decode of a few tokens' window, one JSON object per choice) and frequent: with the stand-in engine at HTTP
  c=64 on this CPU (`benchmarks/streaming_standin.py`), streamed answers gave 8.1-9.6k tok/s through the pool (4
  passes) against 8.3-13.4k on the loop (6 passes; non-streamed: 9.6-13.5k).
- **Streams are sent as tokens are decoded.** With ``stream: true`` the engine hands over each step's tokens
  (`Engine.stream_all`, through the same one-wake-up-per-step hand-off as finished requests); the answer's headers
  and first chunks go out with the first tokens (an error before them is an ordinary HTTP error), then one write per
  batch of steps (`stream_chunks` has the chunk rules; `token_streams` reads the stream in batches). An error after
  the first chunk is sent as an ``{"error": ...}`` event before ``[DONE]``.
- **A request's prompts start together.** The prompts (times n) of a text completion go to the engine in one
  submission (`Engine.submit_all`), streamed or not, so they are admitted and batched together: on an idle engine
  the same request gives the same batches, and the same float32 logprobs, every time.
- **A client that goes away cancels its request.** While a completion runs, the handler also listens for the
  client's disconnect; when it comes first, the request's sequences are aborted in the engine, mid-stream too
  (their KV and LoRA slots are freed at the engine's next iteration).

`start_server` runs uvicorn in a background thread bound to 127.0.0.1 by default; port 0 picks a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass

import fastapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.inference.adapters import AdapterError, UnknownModel
from backends.inference.engine import Engine, EngineConfig, EngineStopped, RequestError
from backends.serving import completions as text_completions
from backends.serving.adapter_sources import AdapterSources
from backends.serving.chat import parse_request, render_prompt, response_json, sampling_params
from backends.serving.exposure import check_exposure
from backends.serving.request_bodies import (DEFAULT_MAX_BODY_BYTES, BadBody, BodyTooLarge, parse_json, read_body,
                                             read_json)
from backends.serving.response_bytes import json_bytes, sse_events
from backends.serving.stream_chunks import ChatChunks, ChunkStream, CompletionChunks
from backends.serving.token_streams import TokenStreams
from backends.serving.token_text import TokenText
from backends.serving.tokenizer_pool import TokenizerPool

log = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
OPEN_PATHS = ("/health",)
INLINE_BODY_BYTES = 8 * 1024  # a completions body parsed and checked on the loop up to this (~1 ms: module docstring)
INLINE_ANSWER_TOKENS = 512  # build + encode an answer on the loop up to this many completion tokens (~0.4 ms)


@dataclass
class Opened:
    """A streamed answer whose first tokens have come: the streams, their chunk builder, the first chunks' bytes."""

    streams: TokenStreams
    chunks: ChunkStream
    first: bytes


def _json_object(raw: bytes) -> dict:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": None,
                                   "code": status}}, status_code=status)


class KeyCheck:
    """ASGI middleware: requests to any path but OPEN_PATHS need ``Authorization: Bearer <api_key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                reply = error_response(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')")
                return await reply(scope, receive, send)
        return await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(request: fastapi.Request) -> None:
    """Return when the client goes away (the body has been read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: fastapi.Request, work):
    """Await `work` (a coroutine); if the client disconnects first, cancel it (which aborts its engine requests)
    and raise ClientGone."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (server shutdown): so is the work
        job.cancel()
        raise
    finally:
        watch.cancel()
    if not job.done():
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
        raise ClientGone()
    return job.result()


def create_app(engine: Engine, api_key: str | None = None, adapter_sources: AdapterSources | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> fastapi.FastAPI:
    """The FastAPI app serving `engine`; with `api_key`, requests need `Authorization: Bearer <api_key>`.
    `/v1/load_lora_adapter` reads only under `adapter_sources` (default: the trajflow cache); bodies are capped at
    `max_body_bytes`."""
    sources = adapter_sources or AdapterSources.default()
    app = fastapi.FastAPI(title="trajflow embedded inference", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(KeyCheck, api_key=api_key)
    names = TokenText(engine.tokenizer, engine.vocab)
    pool = app.state.tokenizers = TokenizerPool(engine.tokenizer)
    pool.executor.submit(names.warm)  # every id's text decoded once, before the first responses need them
    loop_tokenizer = copy.deepcopy(engine.tokenizer)  # the event loop's own: streamed chunks are built there

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"{type(exc).__name__}: {exc}")

    async def _object(request: fastapi.Request) -> dict:
        body = await read_json(request, max_body_bytes, pool.executor)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "the engine is not running")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = [{"id": engine.name, "object": "model", "created": created, "owned_by": "trajflow",
                 "root": engine.name, "parent": None, "max_model_len": engine.max_seq_len}]
        for entry in engine.adapters.entries():
            data.append({"id": entry.name, "object": "model", "created": created, "owned_by": "trajflow",
                         "root": entry.source, "parent": engine.name, "max_model_len": engine.max_seq_len})
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: fastapi.Request):
        try:
            body = await _object(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not isinstance(path, str):
                return error_response(400, "lora_name and lora_path (strings) are required")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                return error_response(400, f"load_inplace must be true or false, got {inplace!r}")
            sources.check(path)
            await asyncio.to_thread(engine.load_adapter, name, path, inplace)
        except BodyTooLarge as e:
            return error_response(413, str(e))
        except (AdapterError, BadBody, RequestError) as e:
            return error_response(400, str(e))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: fastapi.Request):
        try:
            body = await _object(request)
            name = body.get("lora_name")
            if not isinstance(name, str):
                return error_response(400, "lora_name (a string) is required")
            engine.unload_adapter(name)
        except BodyTooLarge as e:
            return error_response(413, str(e))
        except (BadBody, RequestError) as e:
            return error_response(400, str(e))
        except UnknownModel as e:
            return error_response(404, f"The lora adapter '{name}' cannot be found. Loaded: "
                                       f"{', '.join(e.available)}")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _answer(request: fastapi.Request, work):
        """Read the body, then run `work(raw body)` -> (request, encoded answer) with the dialect's error mapping,
        cancelled when the client disconnects; stream if asked."""
        try:
            raw = await read_body(request, max_body_bytes)
            req, body = await until_disconnect(request, work(raw))
        except BodyTooLarge as e:
            return error_response(413, str(e))
        except (BadBody, RequestError) as e:
            return error_response(400, str(e))
        except UnknownModel as e:
            return error_response(404, str(e))
        except EngineStopped as e:
            return error_response(503, str(e))
        except ClientGone:
            log.info("%s %s: the client disconnected; its request was cancelled", request.method, request.url.path)
            return error_response(499, "the client disconnected")
        if not req.stream:
            return Response(body, media_type="application/json")
        return StreamingResponse(_events(request, body), media_type="text/event-stream")

    async def _events(request: fastapi.Request, opened: Opened):
        """The rest of a stream after its first chunks; the client's disconnect aborts it."""
        streams, chunks = opened.streams, opened.chunks
        watch = asyncio.ensure_future(_disconnected(request))
        watch.add_done_callback(lambda w: w.cancelled() or streams.interrupt(ClientGone()))
        try:
            yield opened.first
            while (batch := await streams.take()) is not None:
                yield chunks.encode(loop_tokenizer, batch)
            yield chunks.end()
        except ClientGone:
            log.info("%s %s: the client disconnected; its stream was cancelled", request.method, request.url.path)
        except Exception as e:  # noqa: BLE001 - the status line is sent: the error goes into the stream
            log.exception("stream failed")
            yield sse_events([{"error": {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError",
                                         "param": None, "code": 500}}], done=True)
        finally:
            watch.cancel()
            streams.close()

    async def _open(stream, chunks: ChunkStream) -> Opened:
        """Start a streamed answer (`Engine.stream_all`): wait for its first tokens (errors before them are HTTP
        errors)."""
        opened = TokenStreams(stream)
        try:
            batch = await opened.take()
        except BaseException:
            opened.close()
            raise
        return Opened(opened, chunks, sse_events(chunks.opening()) + chunks.encode(loop_tokenizer, batch))

    async def _job(small: bool, fn, *args):
        """``fn(tokenizer, *args)``: on the loop with its tokenizer when `small`, else a worker job (module
        docstring)."""
        return fn(loop_tokenizer, *args) if small else await pool.run(fn, *args)

    def _chat_prompt(tokenizer, raw: bytes):
        req = parse_request(_json_object(raw))
        engine.adapters.resolve(req.model)  # 404 before the template work
        return req, render_prompt(tokenizer, req)

    def _chat_answer(_tokenizer, req, prompt, completions) -> bytes:
        return json_bytes(response_json(req, prompt, completions, names))

    async def _chat(raw: bytes):
        req, prompt = await pool.run(_chat_prompt, raw)  # a chat template's cost is not bounded by the body's size
        if req.stream:
            stream = engine.stream_all([prompt], sampling_params(req), req.model, req.n)
            return req, await _open(stream, ChatChunks(req, prompt, names))
        completions = await engine.generate(prompt, sampling_params(req), req.model, req.n)
        return req, await _job(_small_answer([completions]), _chat_answer, req, prompt, completions)

    def _completion_prompts(tokenizer, raw: bytes):
        req = text_completions.parse_completion_request(_json_object(raw))
        engine.adapters.resolve(req.model)
        return req, text_completions.completion_prompts(tokenizer, req, engine.vocab)

    def _completion_answer(_tokenizer, req, prompts, results) -> bytes:
        return json_bytes(text_completions.response_json(req, prompts, results, names))

    async def _complete(raw: bytes):
        req, prompts = await _job(len(raw) <= INLINE_BODY_BYTES, _completion_prompts, raw)
        params = req.sampling_params()
        # one submission for all prompts: they start together (module docstring); one failing aborts the others
        if req.stream:
            return req, await _open(engine.stream_all(prompts, params, req.model, req.n),
                                    CompletionChunks(req, prompts, names))
        results = await engine.generate_all(prompts, params, req.model, req.n)
        return req, await _job(_small_answer(results), _completion_answer, req, prompts, results)

    def _small_answer(results: list[list]) -> bool:
        return sum(len(c.token_ids) for completions in results for c in completions) <= INLINE_ANSWER_TOKENS

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await _answer(request, _chat)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await _answer(request, _complete)

    return app


@dataclass
class ServerHandle:
    """A running in-process server. `stop()` shuts uvicorn down (and the engine, if the server created it)."""

    url: str
    api_key: str | None
    engine: Engine
    _server: object
    _thread: threading.Thread
    _owns_engine: bool

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 30) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._server.config.app.state.tokenizers.shutdown()
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


KEEP_ALIVE_S = 75


def server_config(app, log_level: str, access_log: bool = True):
    """uvicorn's settings for the embedded server (`trajflow serve` and `start_server` alike).

    An idle keep-alive connection is kept `KEEP_ALIVE_S` seconds (uvicorn's default is 5): longer than clients keep
    theirs (httpx and the openai client: 5 s), so the client always closes first. A server that closes first races
    a client that reuses the connection at that moment; the request meets a closed socket and the client gets a
    reset (``httpx.ReadError``). A busy client (256 concurrent requests, its loop seconds behind) reads answers late
    and so reuses connections that the server has seen idle for 5 s: that was the ReadError at c=256
    (`benchmarks/results/serving-overhead-cpu.md`)."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                          timeout_keep_alive=KEEP_ALIVE_S)


def freeze_heap() -> None:
    """Take every object alive now out of the cyclic garbage collector's view (`gc.freeze`), once the server's
    long-lived objects (model, tokenizer, engine, libraries) exist.

    A full collection walks every tracked object with the GIL held, so every thread stops, the engine's included:
    in `benchmarks/serving_overhead.py` one took 0.22 s in a 1.6 s pass at c=64. Frozen objects are skipped. They are
    never collected either, which is why this runs once, at start (vLLM does the same after its engine starts)."""
    gc.collect()
    gc.freeze()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port): connections made before uvicorn runs wait in the backlog rather than
    being refused, so a client may connect as soon as the address is printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def start_server(model: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 device: str = "cpu", max_loras: int = 4, served_name: str | None = None,
                 engine: Engine | None = None, config: EngineConfig | None = None,
                 startup_timeout: float = 60, adapter_roots: list[str] | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ServerHandle:
    """Serve `model` (or the given `engine`) from a background thread; returns once /health answers.
    `adapter_roots` are where adapters may be loaded from besides the trajflow cache (`adapter_sources`)."""
    import httpx
    import uvicorn

    check_exposure(host, api_key)
    sources = AdapterSources.default(adapter_roots)
    owns = engine is None
    if engine is None:
        cfg = (config or EngineConfig()).model_copy(update={"max_loras": max_loras})
        engine = Engine.from_pretrained(model, device=device, served_name=served_name, config=cfg)
    app = create_app(engine, api_key, sources, max_body_bytes)
    freeze_heap()
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, "warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://{'[' + host + ']' if ':' in host else host}:{bound_port}"
    handle = ServerHandle(url, api_key, engine, server, thread, owns)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + startup_timeout
    while True:
        try:
            if httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if not thread.is_alive() or time.monotonic() > deadline:
            handle.stop(5)
            raise RuntimeError(f"the embedded server at {url} did not become healthy within {startup_timeout} s")
        time.sleep(0.05)
