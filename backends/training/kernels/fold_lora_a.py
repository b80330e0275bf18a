"""LoRA's A folded into the base input-gradient GEMM (``TrainerConfig.fold_lora_a``): one K = out + r product.

The fused LoRA op (``fused_lora``) computes a LoRA linear's input gradient, in the compute dtype c, as

    gz = g (sB)_c,   dx = g W + gz A_c

the second term an ``addmm_`` that reads and writes all of dx ([T, in]) for a K = r product. Folded on the row side:

    [g | gz] = [g | g (sB)_c]  ([T, out + r]),   dx = [g | gz] W_row,   W_row = [W ; A_c]  ([out + r, in]),
    dA = gz^T x,   dB = s g^T z  (unchanged; gz is the last r columns of [g | gz])

one GEMM of K = out + r gives both terms; the forward is untouched (x W^T reads W where it lives). The dx pass goes
away, at the cost of writing [g | gz], a copy of g plus r columns (gz is written there by its own product, not moved).

Choices:

- W_row is not a per-step copy of W: ``fold_rows`` moves each folded module's frozen weight once into an
  [out + r, in] buffer whose first ``out`` rows ARE the weight (a contiguous view: the module's ``weight`` is a
  Parameter over it, requires_grad False; peft's disabled-adapter path, merges, the forward's x W^T and anything that
  reads ``weight`` see the plain [out, in] matrix, zero extra bytes). Its last r rows hold A_c, written by
  ``RowFoldedWeight.extended`` in backward from the very tensor the unfolded op would multiply by, which
  ``lora_cast_cache`` makes once per optimizer step inside a step's scope and per call outside one; the rows are
  rewritten whenever that tensor is a new one, so they are never stale. Where the compute dtype is the master's
  (fp32), A_c is the master itself, updated in place: rewritten at every call.
- Folding pays where the dx pass saved exceeds the g copy paid. Counted in full per micro-batch (``saved_bytes``):
  the dx pass is a read and a write of [T, in]; the copy a read of g and a write of [T, out]; gz's product and the
  GEMM's reads of g and gz cost the same either way: net 2 T (in - out) elements. ``pays`` asks in > out + r, the r
  rows of A_c the GEMM reads once more and a margin over the break-even for the copy's launch. At the Qwen2.5-1.5B
  shape (hidden 1536, intermediate 8960, k and v 2 x 128, r 16) the MLP's down (8960 -> 1536) and k, v (1536 -> 256)
  pay; q, o (1536 -> 1536) do not, nor gate and up (1536 -> 8960, which ``fold_lora_b`` folds on the output side).
  'on' folds the paying modules only, and so does 'auto' on CUDA: on the H200 (24k-token micro-batches, one call)
  46,916 tokens/s steady against 46,551 off, every step 0.4-1.3% faster (benchmarks/results/training-h200.md).
- One fold per module: a module folded by ``fold_lora_b`` (its weight in a [W | (sB)_c] buffer, including q, k and v
  grouped by ``group_qkv``, whose stacked buffer is such a fold) is never row-folded; the trainer folds rows after
  both. Off while ``fp8_base`` is on (the row-folded GEMM is a bf16 product; an fp8 base product cannot absorb A_c).
- The buffer's dtype is the weight's: a call whose compute dtype differs, whose adapter's rank is not the one the
  buffer was built for, or whose module's weight no longer lives in the buffer (``Module.to`` and the like give it a
  tensor of its own) runs the unfolded backward on the module's weight (same function).
- The trainer's base weights are shared (``backends.modeling.shared_weights``): ``fold_lora_b.move_into`` points the
  kept first load at the buffer's view, as for the column fold.

Bytes per micro-batch that folding saves (+) and pays (-), computed by ``saved_bytes`` (not timed), for the Qwen2.5-1.5B
shape in bf16 at 24,576 tokens, per layer:

    module (in -> out)       dx pass     g copy        net    x 28 layers   folded under 'on'
    down (8960 -> 1536)     +880.8 MB   -151.0 MB  +729.8 MB    +20.4 GB    yes
    k, v (1536 -> 256), each +151.0 MB   -25.2 MB  +125.8 MB     +3.5 GB    yes
    q, o (1536 -> 1536), each +151.0 MB  -151.0 MB     +0.0 MB     +0.0 GB    no (in <= out + r)
    gate, up (1536 -> 8960)  +151.0 MB  -880.8 MB  -729.8 MB    -20.4 GB    no

~27.5 GB a 24k-token micro-batch no longer moves (~6 ms at the H200's 4.8 TB/s, were those passes at full
bandwidth; the profile's K = 16 ``addmm_`` run far below it, 214 ms of a 2.36 s step over all modules); measured
by ``benchmarks/training_fresh_process.py``'s runs ``mb24k`` (on) and ``mb24k-fold-a-off``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.training.kernels.fold_lora_b import move_into


@dataclass
class RowFoldedWeight:
    """A frozen base weight living in the first ``out_features`` rows of ``buffer`` ([out + rank, in]); A_c goes in
    the last ``rank`` rows."""

    buffer: torch.Tensor
    out_features: int
    rank: int
    # the A_c last written into the rows, held so that its id is never reused: the same tensor again means the rows
    # are current (cast copies are made inside the ops and never written in place)
    _written: torch.Tensor | None = field(default=None, repr=False)

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer[self.out_features:]

    def fits(self, weight: torch.Tensor, a: torch.Tensor) -> bool:
        """Whether a call can run folded: ``weight`` still lives in the buffer and ``a`` has the buffer's dtype, this
        module's rank and the weight's input width."""
        buffer = self.buffer
        return (weight.data_ptr() == buffer.data_ptr() and a.dtype == buffer.dtype
                and a.shape == (self.rank, buffer.shape[1]) and weight.device == buffer.device)

    def extended(self, a: torch.Tensor) -> torch.Tensor:
        """W_row = [W ; A_c], the rows rewritten unless ``a`` is the cast copy last written. An ``a`` that requires
        grad is the master itself (the compute dtype is the master's, so no copy was made), which the optimizer writes
        in place: always rewritten (r x in elements; not the bf16 path)."""
        if self._written is not a or a.requires_grad:
            self.rows.copy_(a)
            self._written = a
        return self.buffer


def row_fold_of(linear) -> RowFoldedWeight | None:
    return getattr(linear, "_trajflow_row_fold", None)


def runs_row_folded(fold: RowFoldedWeight | None, weight: torch.Tensor, a: torch.Tensor) -> RowFoldedWeight | None:
    """``fold`` where a call fits it (``RowFoldedWeight.fits``), else None: the unfolded backward."""
    return fold if fold is not None and fold.fits(weight, a) else None


def pays(out_features: int, in_features: int, rank: int) -> bool:
    """Whether folding A into a module's input-gradient GEMM saves more bytes than it moves: in > out + r."""
    return in_features > out_features + rank


def fold_rows(linear: torch.nn.Linear, rank: int) -> RowFoldedWeight:
    """Move the frozen ``weight`` of ``linear`` into a zeroed [out + rank, in] buffer, the module's ``weight``
    becoming a Parameter over its first ``out`` rows; returns the fold, also kept as ``_trajflow_row_fold``."""
    w = linear.weight
    buffer = torch.zeros(w.shape[0] + rank, w.shape[1], dtype=w.dtype, device=w.device)
    move_into(linear, "weight", buffer[:w.shape[0]])
    linear._trajflow_row_fold = RowFoldedWeight(buffer, w.shape[0], rank)
    return linear._trajflow_row_fold


def fold_model_rows(model, parts_of) -> int:
    """Row-fold the base weight of every fused LoRA linear of ``model`` that is fusable (``parts_of``:
    ``fused_lora.fusable_parts``), neither folded by ``fold_lora_b`` nor row-folded already, and ``pays``; returns how
    many linears were folded."""
    count = 0
    for layer in [m for m in model.modules() if hasattr(m, "_trajflow_peft_forward")]:
        parts = parts_of(layer)
        if parts is None or parts.fold is not None or row_fold_of(layer.base_layer) is not None:
            continue
        rank = parts.lora_a.shape[0]
        if pays(*parts.weight.shape, rank):
            fold_rows(layer.base_layer, rank)
            count += 1
    return count


def folded_a_input_grad(g: torch.Tensor, sb: torch.Tensor, fold: RowFoldedWeight, a: torch.Tensor,
                        into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, gz): [g | gz] with gz = g (sB)_c written into its last r columns, dx = [g | gz] [W ; A_c] (one GEMM,
    added into ``into`` when given: ``into`` returned); gz is a view of the [T, out + r] buffer."""
    out = fold.out_features
    ggz = torch.empty(g.shape[0], out + fold.rank, dtype=g.dtype, device=g.device)
    ggz[:, :out].copy_(g)
    gz = torch.mm(g, sb, out=ggz[:, out:])
    w_row = fold.extended(a)
    return (ggz @ w_row if into is None else into.addmm_(ggz, w_row)), gz


def saved_bytes(tokens: int, in_features: int, out_features: int, rank: int, element: int = 2) -> dict:
    """Bytes per micro-batch that row-folding one module saves (+) and pays (-), by pass (the docstring's table): the
    dx pass (a read and a write of dx) against the g copy (a read of g, a write of [T, out] into [g | gz])."""
    dx_pass = 2 * tokens * in_features * element
    g_copy = 2 * tokens * out_features * element
    return {"dx_pass": dx_pass, "g_copy": -g_copy, "net": dx_pass - g_copy}
