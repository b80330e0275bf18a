"""The engine's forward pass: Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) over the slot KV cache.

It reads the weights of an already-loaded Hugging Face model (no copy, unless projections are fused; a peft-wrapped
model is unwrapped and only its base weights are used) and runs two functions:

- ``prefill(tokens [n, T], lengths, slots, lora_rows)``: the prompts of n new sequences, right-padded, from
  position 0; causal attention, so padding never reaches a real token. Writes the keys/values of positions ``0..T-1``
  of each slot and returns the logits at each prompt's last token.
- ``decode(tokens [B], pos [B], length, lora_rows)``: one token for rows ``0..B-1`` (= slots ``0..B-1``) at their own
  positions; attention over cache positions ``0..pos`` of each slot (``length`` bounds the positions read).

The maths is Hugging Face's (same RMSNorm, rotary tables from the model's own rotary module, same attention scale),
so logits match ``model(...)`` up to float rounding; the tests check logprobs against a teacher-forced HF forward.
Fusing q/k/v and gate/up into one matmul each (``fuse=True``, the default on CUDA) copies those weights once and
halves the kernel count of a decode step; on the CPU kernel launches are cheap and the copy is not worth the memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.inference.kv_cache import SlotKVCache
from backends.inference.lora_slots import GROUPS, LoraSlots
from backends.modeling.logits import logits_fp32

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def _linear_of(module):
    return getattr(module, "base_layer", module)  # peft wraps nn.Linear; the base layer holds the frozen weight


class ProjGroup:
    """Projections reading the same input, as one fused matmul or one matmul each."""

    def __init__(self, linears: list, fuse: bool):
        self.out_sizes = [lin.weight.shape[0] for lin in linears]
        self.fused = fuse and len(linears) > 1
        if self.fused:
            self.weight = torch.cat([lin.weight.detach() for lin in linears])
            biases = [lin.bias for lin in linears]
            self.bias = None if all(b is None for b in biases) else torch.cat(
                [b.detach() if b is not None else lin.weight.new_zeros(lin.weight.shape[0])
                 for b, lin in zip(biases, linears)])
        else:
            self.parts = [(lin.weight.detach(), None if lin.bias is None else lin.bias.detach()) for lin in linears]

    @property
    def one_matmul(self) -> bool:
        """Whether the group's output is one tensor [N, out_1 + … + out_M] (fused, or a single member)."""
        return self.fused or len(self.parts) == 1

    def output(self, x: torch.Tensor, add_lora=None) -> torch.Tensor:
        """[N, out_1 + … + out_M] of a one-matmul group; `add_lora(y)` adds the LoRA delta in place."""
        y = F.linear(x, self.weight, self.bias) if self.fused else F.linear(x, *self.parts[0])
        return y if add_lora is None else add_lora(y)

    def __call__(self, x: torch.Tensor, add_lora=None, delta=None) -> list[torch.Tensor]:
        """Outputs of each member for rows `x` [N, in]; LoRA as `add_lora(y)` (one-matmul groups) or `delta()`."""
        if self.one_matmul:
            return list(self.output(x, add_lora).split(self.out_sizes, dim=-1))
        outs = [F.linear(x, w, b) for w, b in self.parts]
        if delta is not None:
            outs = [o + d for o, d in zip(outs, delta().split(self.out_sizes, dim=-1))]
        return outs


class _Layer:
    def __init__(self, hf_layer, fuse: bool):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.norm1 = (hf_layer.input_layernorm.weight.detach(), _eps(hf_layer.input_layernorm))
        self.norm2 = (hf_layer.post_attention_layernorm.weight.detach(), _eps(hf_layer.post_attention_layernorm))
        self.q_norm = (attn.q_norm.weight.detach(), _eps(attn.q_norm)) if hasattr(attn, "q_norm") else None
        self.k_norm = (attn.k_norm.weight.detach(), _eps(attn.k_norm)) if hasattr(attn, "k_norm") else None
        self.groups = {name: ProjGroup([_linear_of(getattr(attn if name in ("qkv", "o") else mlp, m))
                                        for m in members], fuse)
                       for name, members in GROUPS.items()}
        self.act = mlp.act_fn


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rms_norm(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
    """Hugging Face's RMSNorm: weight * (x / sqrt(mean(x^2) + eps)) computed in float32, cast back before the weight.
    On CUDA, torch's fused kernel (one launch instead of six; the weight is applied before the final rounding)."""
    weight, eps = weight_eps
    if x.is_cuda:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(D/2, -1) * signed_sin(sin)``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = cat(-x2, x1)`` written as a roll
    times a pre-signed sin: three kernels (mul, roll, addcmul) where the literal form takes five."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def unwrap_causal_lm(model):
    """The plain transformers CausalLM under a peft wrapper, if any."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def describe(model) -> dict:
    """Shape facts the engine needs; raises ValueError for architectures this forward does not implement."""
    model = unwrap_causal_lm(model)
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the embedded engine implements {', '.join(SUPPORTED_MODEL_TYPES)} decoders, "
                         f"not {cfg.model_type!r}; serve this model with vLLM")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    context = int(getattr(cfg, "max_position_embeddings", 2048))
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    uses_window = "sliding_attention" in layer_types or (cfg.model_type == "mistral" and window)
    if uses_window and window:
        context = min(context, int(window))  # within the window, sliding attention equals full attention
    first = model.model.layers[0]
    layout = {}
    for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = _linear_of(getattr(first.self_attn, module))
        layout[module] = (lin.weight.shape[1], lin.weight.shape[0])
    for module in ("gate_proj", "up_proj", "down_proj"):
        lin = _linear_of(getattr(first.mlp, module))
        layout[module] = (lin.weight.shape[1], lin.weight.shape[0])
    return {"num_layers": len(model.model.layers), "num_heads": heads, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "context": context, "layout": layout, "vocab": model.lm_head.weight.shape[0]}


class DecoderRunner:
    """Prefill and decode for one model on one device, with a slot KV cache and LoRA slots."""

    def __init__(self, model, max_len: int, kv: SlotKVCache, lora: LoraSlots, fuse: bool):
        model = unwrap_causal_lm(model)
        info = describe(model)
        self.num_heads, self.num_kv_heads, self.head_dim = info["num_heads"], info["num_kv_heads"], info["head_dim"]
        self.embed = model.model.embed_tokens.weight.detach()
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.layers = [_Layer(layer, fuse) for layer in model.model.layers]
        self.final_norm = (model.model.norm.weight.detach(), _eps(model.model.norm))
        self.lm_head = model.lm_head.weight.detach()
        positions = torch.arange(max_len, device=self.device).unsqueeze(0)
        with torch.no_grad():
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(dummy, positions)
        self.cos = cos[0].to(self.dtype)  # [max_len, head_dim]
        self.sin = signed_sin(sin[0].to(self.dtype))  # pre-signed for rope()
        self.kv, self.lora = kv, lora

    def _lora_args(self, layer: int, group: str, x: torch.Tensor, masks) -> dict:
        """How `group` takes its LoRA term for rows `x`: added in place by one GEMM, or as a delta (unfused)."""
        if masks is None:
            return {}
        return {"add_lora": lambda y: self.lora.add_delta_(layer, group, x, masks, y),
                "delta": lambda: self.lora.delta(layer, group, x, masks)}

    def _project(self, layer: int, group: str, x: torch.Tensor, masks) -> list[torch.Tensor]:
        return self.layers[layer].groups[group](x, **self._lora_args(layer, group, x, masks))

    def _mlp(self, i: int, x: torch.Tensor, masks) -> torch.Tensor:
        layer = self.layers[i]
        h = rms_norm(x, layer.norm2)
        gate, up = self._project(i, "gate_up", h, masks)
        (down,) = self._project(i, "down", layer.act(gate) * up, masks)
        return x + down

    def _qkv(self, i: int, h: torch.Tensor, masks, shape: tuple[int, ...], cos: torch.Tensor, sin: torch.Tensor):
        """q, k (rotated) and v as [*shape, heads, head_dim]; cos/sin broadcast against that."""
        layer = self.layers[i]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        group = layer.groups["qkv"]
        lora = self._lora_args(i, "qkv", h, masks)
        if group.fused and layer.q_norm is None:
            # q and k are adjacent columns of the fused output: rotate them with one set of kernels
            y = group.output(h, lora.get("add_lora"))
            qk = rope(y[..., : (heads + kv_heads) * d].view(*shape, heads + kv_heads, d), cos, sin)
            return qk[..., :heads, :], qk[..., heads:, :], y[..., (heads + kv_heads) * d :].view(*shape, kv_heads, d)
        q, k, v = group(h, **lora)
        q, k, v = q.view(*shape, heads, d), k.view(*shape, kv_heads, d), v.view(*shape, kv_heads, d)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm), rms_norm(k, layer.k_norm)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return logits_fp32(rms_norm(x, self.final_norm), self.lm_head)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                lora_rows: torch.Tensor | None, lora_slots: int | None = None) -> torch.Tensor:
        """tokens [n, T] (right-padded), lengths [n], slots [n], lora_rows [n] (-1: base) -> logits [n, V] float32."""
        n, T = tokens.shape
        masks = None
        if lora_rows is not None:
            masks = self.lora.row_masks(lora_rows.repeat_interleave(T), lora_slots)
        x = F.embedding(tokens, self.embed).view(n * T, -1)
        cos, sin = self.cos[:T].unsqueeze(1), self.sin[:T].unsqueeze(1)  # [T, 1, D] against [n, T, H, D]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.norm1)
            q, k, v = self._qkv(i, h, masks, (n, T), cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, H, T, D]
            self.kv.keys(i)[slots, :, :T] = k
            self.kv.values(i)[slots, :, :T] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            o = o.transpose(1, 2).reshape(n * T, self.num_heads * self.head_dim)
            (o,) = self._project(i, "o", o, masks)
            x = self._mlp(i, x + o, masks)
        last = x.view(n, T, -1)[torch.arange(n, device=x.device), lengths - 1]
        return self._logits(last)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, length: int, lora_rows: torch.Tensor | None,
               lora_slots: int | None = None) -> torch.Tensor:
        """tokens [B], pos [B] for slots 0..B-1, attending to cache positions < `length` -> logits [B, V] float32."""
        B = tokens.shape[0]
        masks = None if lora_rows is None else self.lora.row_masks(lora_rows, lora_slots)
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [B, 1, D] against [B, H, D]
        visible = torch.arange(length, device=x.device).unsqueeze(0) <= pos.unsqueeze(1)
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=x.device).masked_fill_(
            ~visible, torch.finfo(self.dtype).min).view(B, 1, 1, length)
        rows = torch.arange(B, device=x.device)
        group = self.num_heads // self.num_kv_heads
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.norm1)
            q, k, v = self._qkv(i, h, masks, (B,), cos, sin)
            keys, values = self.kv.keys(i), self.kv.values(i)
            keys[rows, :, pos] = k
            values[rows, :, pos] = v
            qg = q.view(B, self.num_kv_heads, group, self.head_dim)  # the heads sharing a kv head, as "queries"
            o = F.scaled_dot_product_attention(qg, keys[:B, :, :length], values[:B, :, :length], attn_mask=bias)
            (o,) = self._project(i, "o", o.reshape(B, self.num_heads * self.head_dim), masks)
            x = self._mlp(i, x + o, masks)
        return self._logits(x)
