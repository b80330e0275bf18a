"""LoRA's B product folded into the base GEMM (``TrainerConfig.fold_lora_b``): one K = in + r product, no y pass.

The fused LoRA op (``fused_lora``) computes, in the compute dtype c, z = x A_c^T and y = x W^T + b + z (sB)_c^T, the
second product an ``addmm_`` that reads and writes all of y for a K = r product. Folded, per module (or per group of
modules that read the same x, the SwiGLU MLP's gate and up; R = the group's summed rank, each module's (sB)_c in its
own r of the R columns, zeros in the others):

    forward:   z = x [A_1; ...]_c^T  ([T, R]),   xz = [x | z]  ([T, in + R]),   y_i = xz W_ext,i^T + b_i,
               W_ext,i = [W_i | 0 .. (s_i B_i)_c .. 0]  ([out_i, in + R])
    backward:  [dx_base | dz] = sum_i g_i W_ext,i  (one GEMM per module gives g_i W_i and g_i (s_i B_i)_c),
               dx = dx_base + dz [A_1; ...]_c,   dA_i = dz_i^T x,   dB_i = s_i g_i^T z_i

The separate K = r ``addmm_`` over y and the backward's separate g (sB)_c product (a read of g) go away, at the cost
of writing xz, a copy of x plus R columns. The saved activation is xz instead of x and z: the same bytes.

Choices:

- W_ext is not a per-step copy of W: ``fold_linears`` moves each folded module's frozen weight once into a
  [out, in + R] buffer whose first ``in`` columns ARE the weight (the module's ``weight`` is a Parameter over that
  view, requires_grad False; peft's disabled-adapter path and anything that reads ``weight`` see the plain
  [out, in] matrix). Its other columns hold (sB)_c, written by ``FoldedWeight.extended`` from the very tensor the
  unfolded op would multiply by, which ``lora_cast_cache`` makes once per optimizer step inside a step's scope
  (re-made after ``optimizer.step`` and ``load_state_dict``: their in-place writes move the version counters) and
  per call outside one; the columns are rewritten whenever that tensor is a new one, so they are never stale.
- Folding pays where the y pass saved exceeds the xz copy paid: sum of out_i > in + R (``pays``). At the
  Qwen2.5-1.5B shape (hidden 1536, intermediate 8960, r 16) only the MLP's gate and up do (2 x 8960 > 1536 + 32);
  q, o (1536 -> 1536), k, v (-> 256) and down (8960 -> 1536) do not (``fold_lora_a`` folds k, v and down on the
  input-gradient side). 'auto' folds only those; 'on' folds every
  fusable module (the CPU tests' way to cover each form).
- q, k and v grouped by ``group_qkv`` live in that op's one stacked buffer (``fold_linears`` with ``into``: their
  folds are its row blocks) and are never folded again here, whatever this switch says.
- Gate and up fold as one group only inside the fused SwiGLU op (``memory_efficient_ops``); without it each folds
  alone, and each keeps its own xz: one more copy of x per layer kept for backward than the unfolded ops, which
  share x.
- The buffer's dtype is the weight's: a call whose compute dtype differs, whose adapter's rank is not the one the
  buffer was built for, or whose module's weight no longer lives in the buffer (``Module.to`` and the like give it
  a tensor of its own) runs the unfolded op on the module's weight (same function).
- The trainer's base weights are shared (``backends.modeling.shared_weights``): a folded weight moves out of the
  shared storage, and the kept first load is pointed at the buffer's view too (``shared_weights.moved``), so a
  process with a trainer alone holds it once and an engine started later reads the same view. An engine started
  before keeps the old storage (left untouched): the memory of the folded modules' weights once more.

Bytes moved per micro-batch that folding saves (+) and pays (-), computed by ``saved_bytes`` (not timed), for the
Qwen2.5-1.5B shape (hidden 1536, intermediate 8960, q 12 x 128, k and v 2 x 128, r 16) in bf16 at 16,384 tokens, per
layer; each y pass is a read and a write of y, the g reads are the backward's g (sB)_c products, the copy reads x and
writes xz:

    group (in -> outs)            y passes    g reads    xz copy       net    x 28 layers   folded under 'auto'
    gate + up (1536 -> 2 x 8960)  +1,174.4     +587.2     -101.7  +1,659.9 MB    +46.5 GB    yes
    q, o (1536 -> 1536), each       +100.7      +50.3     -101.2     +49.8 MB     +1.4 GB    no (out < in + r)
    k, v (1536 -> 256), each         +16.8       +8.4     -101.2     -76.0 MB     -2.1 GB    no
    down (8960 -> 1536)             +100.7      +50.3     -587.7    -436.7 MB    -12.2 GB    no

The 'auto' rule (out > in + r) weighs one pass over y against the copy; counted in full as above (y read and written,
g read, x read and xz written) the break-even is 3 out > 2 in + R, by which q and o would also come out ahead, by
~50 MB a layer each (~6% of gate and up's saving together). They stay unfolded under 'auto' until the device says
that margin survives the copy's launch and the wider GEMM input ('on' folds them, with k, v and down). Whether the
~46 GB a 16k-token micro-batch no longer moves (~10 ms at the H200's 4.8 TB/s, were those passes at full bandwidth)
shows as step time is for the device to measure (``benchmarks/training_fresh_process.py``: ``fold-off`` and
``fold-everywhere`` against the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.modeling import shared_weights


@dataclass
class FoldedWeight:
    """A frozen base weight living in the first ``in_features`` columns of ``buffer`` ([out, in + width]); this
    module's (sB)_c goes in columns ``in_features + offset`` .. ``+ rank``, the rest of the tail is zero."""

    buffer: torch.Tensor
    in_features: int
    offset: int
    rank: int
    width: int
    # the (sB)_c last written into the tail, held so that its id is never reused: the same tensor again means the
    # tail is current (cast copies are made inside the ops and never written in place)
    _written: torch.Tensor | None = field(default=None, repr=False)

    @property
    def tail(self) -> torch.Tensor:
        start = self.in_features + self.offset
        return self.buffer[:, start:start + self.rank]

    def fits(self, weight: torch.Tensor, sb: torch.Tensor) -> bool:
        """Whether a call can run folded: ``weight`` still lives in the buffer (nothing gave the module another
        tensor since) and ``sb`` has the buffer's dtype and this module's rank."""
        buffer = self.buffer  # the cheap comparisons first: each call of a folded op asks
        return (weight.data_ptr() == buffer.data_ptr() and sb.dtype == buffer.dtype
                and sb.shape == (buffer.shape[0], self.rank) and weight.device == buffer.device)

    def extended(self, sb: torch.Tensor) -> torch.Tensor:
        """W_ext = [W | .. (sB)_c ..], the tail rewritten unless ``sb`` is the tensor last written."""
        if self._written is not sb:
            self.tail.copy_(sb)
            self._written = sb
        return self.buffer


def runs_folded(folds, weights, sbs) -> bool:
    """Whether modules run as one folded group: folded together in this order (offsets 0, r_1, r_1 + r_2, ...) and
    every call fits (``FoldedWeight.fits``); one module is a group of one."""
    offset = 0  # a plain loop: the folded ops ask per call, and the comprehensions' frames cost more than the checks
    for f in folds:
        if f is None or f.offset != offset:
            return False
        offset += f.rank
    for f, w, sb in zip(folds, weights, sbs):
        if f.width != offset or not f.fits(w, sb):
            return False
    return True


def pays(outs: list[int], in_features: int, ranks: list[int]) -> bool:
    """Whether folding a group that reads one x saves more bytes than it moves: sum(out_i) > in + R."""
    return sum(outs) > in_features + sum(ranks)


def move_into(module: torch.nn.Module, name: str, view: torch.Tensor) -> None:
    """Make ``module.<name>`` a frozen Parameter over ``view`` (a slice of a wider buffer) holding its values, the
    kept first load pointed at it too (``shared_weights.moved``): the module's own tensor is then no longer held."""
    old = getattr(module, name)
    view.copy_(old.detach())
    setattr(module, name, torch.nn.Parameter(view, requires_grad=False))
    shared_weights.moved(old, getattr(module, name))


def fold_linears(linears: list[torch.nn.Linear], ranks: list[int], into: torch.Tensor | None = None
                 ) -> list[FoldedWeight]:
    """Move each frozen ``weight`` of a group of linears that read the same x into its own [out, in + R] buffer, the
    module's ``weight`` becoming a Parameter over the buffer's first ``in`` columns; with ``into`` (a
    [sum(out), in + R] buffer, ``stacked_buffer``) the buffers are its row blocks, in order. Returns the folds, also
    kept as each linear's ``_trajflow_fold``."""
    width, folds, offset = sum(ranks), [], 0
    outs = [linear.weight.shape[0] for linear in linears]
    buffers = (into.split(outs) if into is not None else
               [torch.zeros(o, linear.weight.shape[1] + width, dtype=linear.weight.dtype, device=linear.weight.device)
                for o, linear in zip(outs, linears)])
    for linear, rank, buffer in zip(linears, ranks, buffers):
        in_features = linear.weight.shape[1]
        move_into(linear, "weight", buffer[:, :in_features])
        linear._trajflow_fold = FoldedWeight(buffer, in_features, offset, rank, width)
        folds.append(linear._trajflow_fold)
        offset += rank
    return folds


def stacked_buffer(linears: list[torch.nn.Linear], ranks: list[int]) -> torch.Tensor:
    """The zeros of one [sum(out), in + R] buffer for linears that read the same x (``fold_linears``' ``into``)."""
    w = linears[0].weight
    return torch.zeros(sum(linear.weight.shape[0] for linear in linears), w.shape[1] + sum(ranks), dtype=w.dtype,
                       device=w.device)


def folded_of(linear) -> FoldedWeight | None:
    return getattr(linear, "_trajflow_fold", None)


def _groups(model) -> list[list]:
    """The peft LoRA linears the fused ops run, grouped by the x they read: a fused SwiGLU MLP's gate and up, its
    down, then every other patched LoRA linear alone."""
    groups, seen = [], set()
    for module in model.modules():
        if getattr(module, "_trajflow_fuse_lora", False):
            groups += [[module.gate_proj, module.up_proj], [module.down_proj]]
            seen.update(id(m) for m in (module.gate_proj, module.up_proj, module.down_proj))
    groups += [[m] for m in model.modules() if hasattr(m, "_trajflow_peft_forward") and id(m) not in seen]
    return groups


def fold_model(model, parts_of, only_where_it_pays: bool) -> int:
    """Fold the base weights of the fused LoRA linears of ``model``, group by group (``_groups``), where every
    member is fusable (``parts_of``: ``fused_lora.fusable_parts``) and, with ``only_where_it_pays``, where the group
    ``pays``; returns how many linears were folded."""
    count = 0
    for group in _groups(model):
        parts = [parts_of(layer) for layer in group]
        if any(p is None or p.fold is not None for p in parts) or len({p.weight.shape[1] for p in parts}) != 1:
            continue
        if len(group) > 1 and any(p.bias is not None for p in parts):  # the fused MLP op runs bias-free ones only
            continue
        outs, ranks = [p.weight.shape[0] for p in parts], [p.lora_a.shape[0] for p in parts]
        if only_where_it_pays and not pays(outs, parts[0].weight.shape[1], ranks):
            continue
        fold_linears([layer.base_layer for layer in group], ranks)
        count += len(group)
    return count


def fold_input(x2: torch.Tensor, a_cat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xz, z): z = x A^T for the group's stacked A ([R, in]), xz = [x | z]."""
    z = x2 @ a_cat.t()
    return torch.cat([x2, z], dim=1), z


def folded_product(xz: torch.Tensor, w_ext: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = xz W_ext^T + b."""
    return xz @ w_ext.t() if bias is None else torch.addmm(bias, xz, w_ext.t())


def folded_input_grad(grads, w_exts, in_features: int, a_cat: torch.Tensor):
    """(dx, dz) = (dx_base + dz A, dz) from [dx_base | dz] = sum_i g_i W_ext,i; dx is a view of one [T, in + R]
    buffer, dz its last R columns (dx is not copied out: a contiguous copy would move [T, in] once more)."""
    dxz = grads[0] @ w_exts[0]
    for g, w in zip(grads[1:], w_exts[1:]):
        dxz.addmm_(g, w)
    dz = dxz[:, in_features:]
    return dxz[:, :in_features].addmm_(dz, a_cat), dz


def saved_bytes(tokens: int, in_features: int, outs: list[int], ranks: list[int], element: int = 2) -> dict:
    """Bytes per micro-batch that folding one group saves (+) and pays (-), by pass (the docstring's table): the
    y passes (a read and a write of each y) and the reads of each g that the folded products absorb, against the
    copy that makes xz (a read of x, a write of xz)."""
    forward_y = sum(2 * tokens * o * element for o in outs)
    backward_g = sum(tokens * o * element for o in outs)
    xz_copy = tokens * (2 * in_features + sum(ranks)) * element
    return {"forward_y_passes": forward_y, "backward_g_reads": backward_g, "xz_copy": -xz_copy,
            "net": forward_y + backward_g - xz_copy}
