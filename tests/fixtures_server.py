"""Server fixtures: the embedded server on tiny-random (with an API key), and LoRA adapters made with peft."""

from __future__ import annotations

import asyncio
import time

import pytest

API_KEY = "test-key-123"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_ANSWER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


async def wait_until(condition, timeout: float, what: str) -> None:
    """Wait for `condition()` to hold, checking every 10 ms; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_path):
    """(model, tokenizer) of tiny-random, for teacher-forced reference passes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora(model, seed: int, r: int = 8, modules=ALL_MODULES):
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(modules))
    return get_peft_model(copy.deepcopy(model), config)


def _randomised(peft_model, std: float = 0.5):
    """`peft_model` with random nonzero lora_B (peft starts B at zero, which would leave the model unchanged)."""
    import torch

    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return peft_model.eval()


@pytest.fixture(scope="session")
def random_adapter(tiny_hf, tmp_path_factory):
    """(folder, peft model) of a LoRA with nonzero random B: it changes the model's outputs."""
    peft_model = _randomised(_lora(tiny_hf[0], seed=1))
    folder = tmp_path_factory.mktemp("adapter-random")
    peft_model.save_pretrained(folder)
    return folder, peft_model


# (seed, rank, target modules) of `distinct_adapters`: different weights, ranks (a slot reused by a smaller rank
# must not keep the larger one's columns) and modules (nor the modules the new adapter leaves out).
DISTINCT = [(11, 16, ALL_MODULES), (12, 4, ("q_proj", "v_proj")), (13, 8, ALL_MODULES),
            (14, 2, ("gate_proj", "down_proj")), (15, 8, ("k_proj", "o_proj", "up_proj"))]


@pytest.fixture(scope="session")
def distinct_adapters(tiny_hf, tmp_path_factory):
    """[(folder, peft model)] of five LoRAs that differ in weights, rank and target modules."""
    out = []
    for seed, r, modules in DISTINCT:
        peft_model = _randomised(_lora(tiny_hf[0], seed=seed, r=r, modules=modules))
        folder = tmp_path_factory.mktemp(f"adapter-{seed}")
        peft_model.save_pretrained(folder)
        out.append((folder, peft_model))
    return out


@pytest.fixture(scope="session")
def tool_model_path(tiny_hf, tmp_path_factory):
    """tiny-random fine-tuned (~80 Adam steps, about a second) to answer TOOL_QUESTION with TOOLS by calling
    get_weather(Paris): a real model whose real output is a tool call. (A LoRA does not learn it as quickly.)"""
    import copy

    import torch

    from backends.modeling.loading import TOOL_CHAT_TEMPLATE

    base, tok = tiny_hf
    prompt = tok.apply_chat_template(TOOL_QUESTION, tools=TOOLS, chat_template=TOOL_CHAT_TEMPLATE,
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    target = tok(TOOL_ANSWER + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([list(prompt) + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    torch.manual_seed(0)
    model = copy.deepcopy(base).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    folder = tmp_path_factory.mktemp("tiny-tools")
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> str:
    """The session's pytest temporary folder: where the test adapters live, allowed as an adapter root."""
    return str(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tool_server(tool_model_path, adapter_root):
    from backends.serving.app import start_server

    handle = start_server(str(tool_model_path), served_name="tiny-tools", api_key=API_KEY,
                          adapter_roots=[adapter_root])
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_path, adapter_root):
    """The embedded server on tiny-random at 127.0.0.1:<free port>, requiring API_KEY; adapters load from the
    trajflow cache and the session's temporary folders."""
    from backends.serving.app import start_server

    handle = start_server("tiny-random", api_key=API_KEY, adapter_roots=[adapter_root])
    yield handle
    handle.stop()


@pytest.fixture
def client(tiny_server):
    """A real openai.AsyncOpenAI client for tiny_server (no retries)."""
    import openai

    return openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


CLIENT_KEEP_ALIVE_S = 5.0  # httpx's default keepalive_expiry, which the openai client keeps


class HeldConnection:
    """One raw keep-alive connection to a server: `get(path)` sends a request on it and reads the answer;
    `closed_by_server()` says whether the server has closed it (a FIN waiting to be read)."""

    def __init__(self, url: str):
        import socket
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)

    def get(self, path: str) -> bytes:
        """The status line of the answer to GET `path` (its body read and dropped)."""
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the connection instead of answering"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length:")))
        while len(body) < length:
            body += self.sock.recv(65536)
        return head.split(b"\r\n")[0]

    def closed_by_server(self) -> bool:
        import socket

        self.sock.setblocking(False)
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        finally:
            self.sock.setblocking(True)

    def close(self) -> None:
        self.sock.close()


def assert_keeps_idle_connections(url: str, idle_s: float = CLIENT_KEEP_ALIVE_S + 0.5) -> None:
    """A connection left idle for longer than clients keep theirs is still open and answers: a server that closes
    first races a client reusing the connection at that moment (its request is answered by a reset)."""
    conn = HeldConnection(url)
    try:
        assert conn.get("/health") == b"HTTP/1.1 200 OK"
        time.sleep(idle_s)
        assert not conn.closed_by_server(), f"the server closed a connection idle for {idle_s} s"
        assert conn.get("/health") == b"HTTP/1.1 200 OK"
    finally:
        conn.close()
