"""The frozen base product of the fused LoRA ops in FP8 (``TrainerConfig.fp8_base``): y = x W^T and dx = g W.

The fused ops (``fused_lora``, ``lean_ops``) compute y = x W^T + b + z (sB)^T and dx = g W + gz A. With fp8_base on,
only the two base products (the frozen W, most of a layer's FLOPs) run as Hopper FP8 GEMMs with rowwise scales; the
LoRA terms, dA and dB stay in the compute dtype exactly as before (from the bf16 x, z and g):

    forward:   x_q, s_x = q(x)            (per token: s_x = amax(|x_t|) / 448, x_q = e4m3(x_t / s_x); s_x [T, 1])
               y ~= (x_q W_r^T) * s_x * s_r,     W_r = e4m3(W_o / s_r,o), s_r,o = amax(|W_o,:|) / 448   ([1, out])
    backward:  g_q, s_g = q(g)            (per token, over the out features)
               dx ~= (g_q W_c) * s_g * s_c,      W_c = e4m3(W_:,i / s_c,i), s_c,i = amax(|W_:,i|) / 448  ([1, in])

each a ``torch._scaled_mm(a, b, scale_a=[M, 1], scale_b=[1, N])`` with float32 scales, a row-major and b
column-major: W_r is kept as [out, in] row-major (its ``.t()`` is the column-major [in, out] the forward needs) and
W_c as [in, out] row-major (its ``.t()``, the backward's [out, in], column-major).

Choices:

1. W is frozen (LoRA), so both copies are made ONCE, at set-up (``quantize_model``): two fp8 copies of a module's
   weight take the bytes of its bf16 weight (2 x 1 byte per element); at the Qwen2.5-1.5B shape (28 layers of q, k,
   v, o, gate, up and down, 46.8M weights a layer) 2.62 GB more on the device. The bf16 W stays: peft's own forward
   (the adapter disabled: the KL reference), merges, ``state_dict``, the probe and every no-grad pass read it, and
   where the base model is shared with an engine of the process (``backends.modeling.shared_weights``) it is not the
   trainer's to free. A weight written in place after set-up (peft's ``merge_adapter``, say) moves its version
   counter: that module runs its bf16 product again (``Fp8Weight.fits``), never a stale copy.
2. Two copies, not one transposed: a rowwise scale runs along the product's output dimension, so the forward needs W
   scaled per output row and the backward (contraction over ``out``) per input column; one copy scaled per row
   would need its scales inside the contraction, which rowwise ``_scaled_mm`` cannot apply.
3. Activations and grads are quantized per token on the fly (``quantize_rows``, one torch.compile'd kernel on CUDA
   through ``torch_compile.kernel``: amax, scale, divide, cast in one pass), once per tensor: q, k and v read the same
   x, as do gate and up, so the scope keeps the last quantized tensor (held, so its storage is not reused; stamped
   with its version) and the next product that reads it takes the same x_q: per layer and micro-batch 4 forward
   quantizations instead of 7. Grads use e4m3 (3 mantissa bits), not e5m2 (2): a per-token scale already spans the
   range across tokens that e5m2's wider exponent is usually chosen for, and within a token e4m3's finer steps halve
   the rounding error.
4. Only where the trainer opens the scope (``Fp8Scope.scope``: ``GRPOTrainer``'s training micro-batches and its
   warm-up): the KL passes (policy and reference alike), ``sequence_logprobs`` / ``greedy_tokens`` (the publish
   probe compares them with the bf16 server) and any evaluation run the bf16 weights. The choice is made at the
   forward and kept for its backward; the step's logprobs, so ``mismatch_kl`` and the ratio stats, are the fp8 ones.
5. Not with ``fold_lora_b``: a folded module's W lives in [W | (sB)_c], one bf16 GEMM for both terms, which cannot
   be split into an fp8 part; modules on the fp8 path are not folded (``TrainerConfig.enabled``) and a folded
   module is never quantized.
6. Where ``_scaled_mm`` cannot run a module it stays bf16: a dimension not a multiple of 16 (the GEMM's alignment),
   or a compute dtype other than bf16 on CUDA (rowwise scaling writes bf16 there; the CPU also writes float32, which
   the tests use). A bias is added after the scaled product (one pass over y; only q, k and v have one in Qwen2.5).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from backends.training.kernels.torch_compile import kernel

E4M3_MAX = 448.0
ALIGN = 16  # _scaled_mm needs K and N multiples of 16


def available(device: torch.device) -> str | None:
    """None where rowwise ``torch._scaled_mm`` can run on ``device``, else why not (names the device)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"fp8_base 'on' needs torch._scaled_mm, which this torch ({torch.__version__}) lacks on {device}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"fp8_base 'on' needs an FP8 GEMM (CUDA compute capability 8.9+, Ada/Hopper); {device} "
                    f"({torch.cuda.get_device_name(device)}) is {major}.{minor}")
    elif device.type != "cpu":
        return f"fp8_base 'on' runs on CUDA (sm89+) and the CPU, not on {device}"
    return None


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_q, s): each row of 2-D ``t`` in e4m3 and its float32 scale [rows, 1], s = amax(|row|) / 448, t ~= t_q s."""
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


@dataclass
class Fp8Weight:
    """A frozen weight W [out, in] quantized once: ``rows`` (e4m3 [out, in], per output row ``row_scale`` [1, out])
    for y = x W^T, ``cols`` (e4m3 [in, out] = W^T, per input column ``col_scale`` [1, in]) for dx = g W; ``stamp``:
    the weight's storage and version when quantized."""

    rows: torch.Tensor
    row_scale: torch.Tensor
    cols: torch.Tensor
    col_scale: torch.Tensor
    stamp: tuple = field(default=(), repr=False)

    @classmethod
    def of(cls, weight: torch.Tensor) -> Fp8Weight:
        w = weight.detach()
        rows, row_scale = quantize_rows(w)
        # elementwise ops keep their input's strides: W^T made contiguous first, so cols is [in, out] row-major
        cols, col_scale = quantize_rows(w.t().contiguous())
        return cls(rows.contiguous(), row_scale.t().contiguous(), cols, col_scale.t().contiguous(),
                   (w.data_ptr(), weight._version))

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the tensor, unchanged, that these copies were made from."""
        return (weight.data_ptr(), weight._version) == self.stamp

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.row_scale, self.cols, self.col_scale))


def fp8_product(xq: tuple[torch.Tensor, torch.Tensor], fp8: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """y ~= x W^T from per-token (x_q, s_x) and the per-row copy."""
    return torch._scaled_mm(xq[0], fp8.rows.t(), scale_a=xq[1], scale_b=fp8.row_scale, out_dtype=out_dtype)


def fp8_input_grad(gq: tuple[torch.Tensor, torch.Tensor], fp8: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """dx ~= g W from per-token (g_q, s_g) and the per-column copy."""
    return torch._scaled_mm(gq[0], fp8.cols.t(), scale_a=gq[1], scale_b=fp8.col_scale, out_dtype=out_dtype)


class Fp8Scope:
    """Where the fused ops take their base products in FP8: only while ``scope()`` is open. Counts the forwards
    that ran fp8 (``fp8_forwards``), those of quantized modules that ran bf16 (``bf16_forwards``), and the
    per-token quantizations made (``quantizations``) and reused (``reuses``)."""

    def __init__(self, compile: bool = False) -> None:
        self.compile = compile
        self._open = False
        self._last: tuple | None = None  # (tensor, its stamp, (t_q, s)): the last tensor quantized
        self.fp8_forwards = self.bf16_forwards = self.quantizations = self.reuses = 0

    @contextlib.contextmanager
    def scope(self):
        was, self._open = self._open, True
        try:
            yield self
        finally:
            self._open, self._last = was, None

    def quantized(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(t_q, s) of 2-D ``t`` per row, reused when ``t`` views the memory last quantized, unchanged since."""
        # each op makes its own view of x (reshape): the memory, its layout and its version counter (shared by views,
        # moved by every in-place write) identify the values; the last tensor is held, so its memory is not reused
        stamp = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version)
        last = self._last
        if last is not None and last[1] == stamp:
            self.reuses += 1
            return last[2]
        # _scaled_mm's operand a is row-major; the kernel keeps its input's strides
        q = kernel(quantize_rows, self.compile)(t.contiguous())
        self._last = (t, stamp, q)
        self.quantizations += 1
        return q

    def use(self, fp8: Fp8Weight | None, weight: torch.Tensor, dtype: torch.dtype) -> Fp8Use | None:
        """The copies a forward of a module with ``fp8`` (its ``Fp8Weight`` or None) computing in ``dtype`` takes, or
        None: bf16 (scope closed, no copies, a weight changed since, or a dtype the device's FP8 GEMM cannot write)."""
        if fp8 is None:
            return None
        if not self._open or not fp8.fits(weight) or (weight.device.type == "cuda" and dtype != torch.bfloat16):
            self.bf16_forwards += 1
            return None
        self.fp8_forwards += 1
        return Fp8Use(fp8, self)


@dataclass(frozen=True)
class Fp8Use:
    """One module's fp8 copies, chosen for a forward and kept for its backward, and the scope that quantizes."""

    weight: Fp8Weight
    scope: Fp8Scope


def base_product(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8Use | None) -> torch.Tensor:
    """y = x W^T + b: in FP8 where ``fp8`` is given, else in x's dtype."""
    if fp8 is None:
        return x2 @ w.t() if bias is None else torch.addmm(bias, x2, w.t())
    y = fp8_product(fp8.scope.quantized(x2), fp8.weight, x2.dtype)
    return y if bias is None else y.add_(bias)


def base_input_grad(g: torch.Tensor, w: torch.Tensor, fp8: Fp8Use | None, into: torch.Tensor | None = None):
    """g W, added into ``into`` when given: in FP8 where ``fp8`` is given."""
    if fp8 is None:
        return g @ w if into is None else into.addmm_(g, w)
    dx = fp8_input_grad(fp8.scope.quantized(g), fp8.weight, g.dtype)
    return dx if into is None else into.add_(dx)


def fp8_of(linear) -> Fp8Weight | None:
    return getattr(linear, "_trajflow_fp8", None)


def quantizable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0


def quantize_model(model, parts_of) -> int:
    """Quantize the frozen base weight of every patched LoRA linear of ``model`` that is fusable (``parts_of``:
    ``fused_lora.fusable_parts``), not folded and ``quantizable``; the copies are kept as the base linear's
    ``_trajflow_fp8``. Returns how many."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "_trajflow_peft_forward"):
            continue
        parts = parts_of(module)
        if parts is None or parts.fold is not None or not quantizable(parts.weight):
            continue
        module.base_layer._trajflow_fp8 = Fp8Weight.of(parts.weight)
        count += 1
    return count


def copies_nbytes(model) -> int:
    """Bytes of every module's fp8 copies (what fp8_base adds to the trainer's memory)."""
    return sum(f.nbytes() for m in model.modules() if (f := fp8_of(m)) is not None)
