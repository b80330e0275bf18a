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
The per-layer maths is in `layer_math` (functions of plain tensors); `DecoderRunner`'s other switches (LoRA's A in
the base GEMM, torch.compile of a decode step's layers, one cache write for k and v) cut kernels further, same maths.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backends.inference.kv_cache import SlotKVCache
from backends.inference.layer_compile import LayerFunctions
from backends.inference.layer_math import Proj, rms_norm, signed_sin
from backends.inference.lora_slots import GROUPS, LoraSlots, RowMasks
from backends.inference.merged_weights import MergedWeights
from backends.modeling.logits import logits_fp32

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def _linear_of(module):
    return getattr(module, "base_layer", module)  # peft wraps nn.Linear; the base layer holds the frozen weight


class ProjGroup:
    """Projections reading the same input, as one fused matmul or one matmul each; with `append_a`, the one matmul
    also computes the LoRA A columns of every slot (lora_slots, "Fused A")."""

    def __init__(self, linears: list, fuse: bool):
        self.out_sizes = tuple(lin.weight.shape[0] for lin in linears)
        self.out = sum(self.out_sizes)
        self.a_rows = 0
        self.parts = None
        if len(linears) == 1:
            lin = linears[0]
            self._set(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
        elif fuse:
            biases = [lin.bias for lin in linears]
            self._set(torch.cat([lin.weight.detach() for lin in linears]),
                      None if all(b is None for b in biases) else torch.cat(
                          [b.detach() if b is not None else lin.weight.new_zeros(lin.weight.shape[0])
                           for b, lin in zip(biases, linears)]))
        else:
            self.weight = self.bias = None
            self.parts = tuple((lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
                               for lin in linears)

    def _set(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self._base = (weight[: self.out], None if bias is None else bias[: self.out])

    def append_a(self, cols: int) -> torch.Tensor:
        """Make the weight ``[W ; 0]`` with `cols` zero rows (a copy; the model's own weights stay as they are) and
        return those rows as A's [in, cols] view. Called again, it replaces the previous rows."""
        if self.parts is not None:
            raise ValueError("LoRA A can only be fused into a group computed as one matmul")
        self._set(*self.with_a_rows(cols))
        self.a_rows = cols
        return self.weight[self.out :].t()

    def with_a_rows(self, cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the base projection with `cols` zero rows appended (new tensors)."""
        w, b = self._base
        with torch.inference_mode(False):  # ordinary tensors, like the weights they extend (compiled code's guards)
            return (torch.cat([w, w.new_zeros(cols, w.shape[1])]),
                    None if b is None else torch.cat([b, b.new_zeros(cols)]))

    def operands(self, lora=None) -> Proj:
        """The group's `Proj` with LoRA term `lora` (None: no row uses an adapter, and the A rows are not computed)."""
        if self.parts is not None:
            return Proj(None, None, self.parts, self.out_sizes, lora)
        if lora is not None and lora.A is None:
            return Proj(self.weight, self.bias, None, self.out_sizes, lora)
        return Proj(*self._base, None, self.out_sizes, lora)


class _Layer:
    def __init__(self, hf_layer, fuse: bool):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.norm1 = (hf_layer.input_layernorm.weight.detach(), _eps(hf_layer.input_layernorm))
        self.norm2 = (hf_layer.post_attention_layernorm.weight.detach(), _eps(hf_layer.post_attention_layernorm))
        self.qk_norms = (((attn.q_norm.weight.detach(), _eps(attn.q_norm)), (attn.k_norm.weight.detach(),
                                                                              _eps(attn.k_norm)))
                         if hasattr(attn, "q_norm") else None)
        self.groups = {name: ProjGroup([_linear_of(getattr(attn if name in ("qkv", "o") else mlp, m))
                                        for m in members], fuse)
                       for name, members in GROUPS.items()}
        self.act = mlp.act_fn


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


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
    """Prefill and decode for one model on one device, with a slot KV cache and LoRA slots.

    Switches (all give the same maths): `fuse` q/k/v and gate/up into one matmul each; `fuse_lora_a` (implies
    `fuse`) appends LoRA's A to each group's weight, one GEMM for both (lora_slots, "Fused A"); `compile` runs a
    decode step's per-layer functions through torch.compile (`layer_compile`); `joint_kv_write` (default: with
    `compile`, where the stacking of k and v fuses into the RoPE kernel) writes a decode step's k and v to the cache
    with one indexed write instead of two; `merged` keeps a copy of the projections with one slot's adapter merged
    in (`merged_weights`) for decode steps whose rows all use it.
    """

    def __init__(self, model, max_len: int, kv: SlotKVCache, lora: LoraSlots, fuse: bool, fuse_lora_a: bool = False,
                 compile: bool = False, joint_kv_write: bool | None = None, merged: bool = False):
        model = unwrap_causal_lm(model)
        info = describe(model)
        self.num_heads, self.num_kv_heads, self.head_dim = info["num_heads"], info["num_kv_heads"], info["head_dim"]
        self.embed = model.model.embed_tokens.weight.detach()
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.layers = [_Layer(layer, fuse or fuse_lora_a) for layer in model.model.layers]
        self.act = self.layers[0].act  # one object for every layer: compiled code is specialised on it
        self.final_norm = (model.model.norm.weight.detach(), _eps(model.model.norm))
        self.lm_head = model.lm_head.weight.detach()
        positions = torch.arange(max_len, device=self.device).unsqueeze(0)
        with torch.no_grad():
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(dummy, positions)
        self.cos = cos[0].to(self.dtype)  # [max_len, head_dim]
        self.sin = signed_sin(sin[0].to(self.dtype))  # pre-signed for rope()
        self.kv, self.lora = kv, lora
        self.joint_kv_write = compile if joint_kv_write is None else joint_kv_write
        self.fns = LayerFunctions(compile)
        self.warm_up_seconds = 0.0
        if fuse_lora_a:
            lora.bind_a(lambda layer, group, cols: self.layers[layer].groups[group].append_a(cols))
        self.merged = MergedWeights([layer.groups for layer in self.layers], lora) if merged else None

    def _operands(self, layer: int, rows: RowMasks | int | None) -> Callable[[str], Proj]:
        """Layer `layer`'s `Proj` per group, with the LoRA term of `rows` (`LoraSlots.terms`; None: no LoRA)."""
        return lambda group: self.layers[layer].groups[group].operands(
            None if rows is None else self.lora.terms(layer, group, rows))

    def _layer(self, i: int, x: torch.Tensor, residual, operands: Callable[[str], Proj], cos, sin, attend, fns,
               shape=None, stack_kv=False):
        """Layer `i` on the residual stream `x` (+ `residual`, the previous layer's MLP output); `operands(group)`
        gives each projection group's `Proj`, `attend(q, kv)` the attention output [N, heads * head_dim].
        Returns (x, this layer's MLP output)."""
        layer = self.layers[i]
        x, q, kv = fns.before_attention(x, residual, layer.norm1, operands("qkv"), layer.qk_norms, cos, sin,
                                        self.num_heads, self.num_kv_heads, shape, stack_kv)
        return fns.after_attention(x, attend(q, kv), operands("o"), layer.norm2, operands("gate_up"),
                                   operands("down"), self.act)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return logits_fp32(rms_norm(x, self.final_norm), self.lm_head)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                lora_rows: torch.Tensor | None, lora_slots: int | None = None, single_slot: int | None = None,
                merged: bool = False) -> torch.Tensor:
        """tokens [n, T] (right-padded), lengths [n], slots [n], lora_rows [n] (-1: base) -> logits [n, V] float32.
        `single_slot` and `merged` as in `decode` (`merged`: the merged weights must already hold `single_slot`)."""
        n, T = tokens.shape
        masks = single_slot
        if single_slot is None and lora_rows is not None:
            masks = self.lora.row_masks(lora_rows.repeat_interleave(T), lora_slots)
        x = F.embedding(tokens, self.embed).view(n * T, -1)
        cos, sin = self.cos[:T].unsqueeze(1), self.sin[:T].unsqueeze(1)  # [T, 1, D] against [n, T, H, D]
        residual = None
        for i in range(len(self.layers)):
            def attend(q, kv, i=i):
                q, k, v = q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [n, H, T, D]
                self.kv.keys(i)[slots, :, :T] = k
                self.kv.values(i)[slots, :, :T] = v
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   enable_gqa=self.num_heads != self.num_kv_heads)
                return o.transpose(1, 2).reshape(n * T, self.num_heads * self.head_dim)

            operands = self.merged.operands(i) if merged else self._operands(i, masks)
            x, residual = self._layer(i, x, residual, operands, cos, sin, attend, LayerFunctions.EAGER, (n, T))
        last = (x + residual).view(n, T, -1)[torch.arange(n, device=x.device), lengths - 1]
        return self._logits(last)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, length: int, lora_rows: torch.Tensor | None,
               lora_slots: int | None = None, single_slot: int | None = None, merged: bool = False) -> torch.Tensor:
        """tokens [B], pos [B] for slots 0..B-1, attending to cache positions < `length` -> logits [B, V] float32.
        With `single_slot`, every row reads that LoRA slot (no row masks; `lora_rows` is not read). With `merged`,
        every row reads the merged weights as they are (`merged_weights`; no LoRA term, `lora_rows` not read)."""
        B = tokens.shape[0]
        if merged:
            operands = self.merged.operands
        elif single_slot is not None:
            operands = functools.partial(self._operands, rows=single_slot)
        else:
            operands = functools.partial(self._operands, rows=None if lora_rows is None else
                                         self.lora.row_masks(lora_rows, lora_slots))
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [B, 1, D] against [B, H, D]
        visible = torch.arange(length, device=x.device).unsqueeze(0) <= pos.unsqueeze(1)
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=x.device).masked_fill_(
            ~visible, torch.finfo(self.dtype).min).view(B, 1, 1, length)
        rows = torch.arange(B, device=x.device)
        group = self.num_heads // self.num_kv_heads

        def attend(i: int, q: torch.Tensor, kv) -> torch.Tensor:
            if isinstance(kv, tuple):
                self.kv.keys(i)[rows, :, pos] = kv[0]
                self.kv.values(i)[rows, :, pos] = kv[1]
            else:
                self.kv.write(i, rows, pos, kv)
            qg = q.reshape(B, self.num_kv_heads, group, self.head_dim)  # the heads sharing a kv head, as "queries"
            o = F.scaled_dot_product_attention(qg, self.kv.keys(i)[:B, :, :length], self.kv.values(i)[:B, :, :length],
                                               attn_mask=bias)
            return o.reshape(B, self.num_heads * self.head_dim)

        fns = self.fns.active()
        residual = None
        if fns is not LayerFunctions.EAGER:  # layer 0 adds zeros too: one compiled variant fewer
            residual = self._zero_residual(x, operands(0)("down"))
        for i in range(len(self.layers)):
            x, residual = self._layer(i, x, residual, operands(i), cos, sin,
                                      lambda q, kv, i=i: attend(i, q, kv), fns, stack_kv=self.joint_kv_write)
        return self._logits(x + residual)

    def warm_up(self) -> float:
        """Compile the decode step's layer functions now (`layer_compile`, choice 4), through two layers (the first
        one's residual is zeros, the others' the MLP output) at batch 1 and batch 2 (after which the batch size is
        symbolic), without LoRA and, once adapters are resident, with the LoRA stacks as they are (masked, and one
        slot: slot 0's; the first one-slot step on another slot compiles both functions again at its batch kind,
        after which dynamo takes the slot's column offset as symbolic). Layer 0's weights, zero inputs, no cache
        write. Returns the seconds it took (0 when not compiling)."""
        if not self.fns.compile or self.fns.failure is not None:
            return 0.0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for lora in ("none", "masked", "one_slot") if self.lora.rank else ("none",):
                for batch in (1, 2):
                    x = torch.zeros(batch, self.embed.shape[1], dtype=self.dtype, device=self.device)
                    pos = torch.zeros(batch, dtype=torch.long, device=self.device)
                    # every row on slot 0
                    masks = {"none": None, "masked": self.lora.row_masks(pos), "one_slot": 0}[lora]
                    operands = self._operands(0, masks)
                    residual = self._zero_residual(x, operands("down"))
                    attn = torch.zeros(batch, self.num_heads * self.head_dim, dtype=self.dtype, device=self.device)
                    for _ in range(2):
                        x, residual = self._layer(0, x, residual, operands, self.cos[pos].unsqueeze(1),
                                                  self.sin[pos].unsqueeze(1), lambda q, kv, a=attn: a,
                                                  self.fns.active(), stack_kv=self.joint_kv_write)
        seconds = time.perf_counter() - t0
        self.warm_up_seconds += seconds
        return seconds

    @staticmethod
    def _zero_residual(x: torch.Tensor, down: Proj) -> torch.Tensor:
        """Zeros laid out as the MLP's output will be (a view into the wider output of a fused-A GEMM), so that the
        first layer runs the same compiled code as the others."""
        rows = x.shape[1] if down.weight is None else down.weight.shape[0]
        return x.new_zeros(x.shape[0], rows)[:, : x.shape[1]]
