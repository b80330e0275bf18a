"""Device-resident LoRA adapters, several per batch, each row of a batch using its own (or none).

For a projection group (``qkv``, ``o``, ``gate_up``, ``down``; a group is the projections that read the same input)
with ``M`` members, the adapters in slots ``0..S-1`` are stacked into two matrices, columns ordered
(slot, member, rank), ranks zero-padded to a common ``R``:

    A_g: [in, S*M*R]            B_g: [S*M*R, out_1 + … + out_M]   (scale = lora_alpha / r folded into B_g)
    h = where(mask, x @ A_g, 0),   mask[row, col] = (col belongs to the slot of row's adapter)  (a masked_fill_)
    delta(x) = h @ B_g,            added to the base output by one GEMM (``y.addmm_(h, B_g)``)

so a mixed batch costs two small matmuls and one select per group and no gathers, and the shapes stay static
(CUDA-graph friendly): three kernels a group, where the base projection has one, so at batch 1 (where a decode step
is kernel launches, not arithmetic) they are what a LoRA step costs. Eagerly (CPU) only the columns of slots up to the highest slot in use are touched. ``R`` starts at the
first adapter's rank rounded up to a power of two and grows (the stacks are reallocated, and ``generation`` changes
so captured graphs are dropped) when a larger one arrives.

Fused A (``bind_a``, the decoder's ``fuse_lora_a``): ``A_g`` is stored as extra rows of the group's base weight,
``W_ext = [W ; A_g^T]`` ([out + S*M*R, in]), so one GEMM gives ``[y | x @ A_g]`` and a LoRA group costs two kernels
(the select and ``addmm_``) beyond its base GEMM instead of three. The rows are reserved for every slot whatever is
resident, and ``A`` is then a view into ``W_ext``; the maths and the isolation argument below are unchanged.

Isolation: a row's output must not depend on the other rows' adapters. Selecting (``where``/``masked_fill``) rather than
multiplying by a 0/1 mask keeps another slot's NaN or inf in ``x @ A_g`` out of ``h`` (``0 * NaN`` is NaN). A row
without an adapter has no column selected, so its ``h`` is all zeros and its delta exactly zero. ``h @ B_g`` still
sums over every slot's rows of ``B_g`` (with zeros in ``h``), so a non-finite ``B_g`` would reach rows of other
adapters (and rows without one): an adapter is therefore written into a slot only when its A and scaled B are finite
in the serving dtype (`adapters.read_adapter` refuses the others at load).

Slots: ``max_loras`` of them; an adapter is placed in a slot when a request for it is admitted, stays there while
requests use it, and the least recently used unused slot is reused when another adapter needs room (vLLM's
``--max-loras`` meaning: how many adapters one batch can mix). A request whose adapter finds no free slot waits.

One slot (``terms(layer, group, slot)``): when every row reads the adapter in slot ``s`` (a GRPO decode step, all
its rows on the current policy), the select is the identity on slot ``s``'s columns ``c_s = s*M*R .. (s+1)*M*R`` and
zeros elsewhere, so

    delta(x) = (x @ A_g[:, c_s]) @ B_g[c_s]

with no mask and no ``masked_fill_``: two kernels a group, or one beyond the base GEMM with fused A (``h`` is then a
column slice of the GEMM's output). The other slots' columns are not read, so isolation holds trivially. The sum over
``R*M`` instead of ``S*M*R`` terms (the others zeros) can round differently from the masked form where the GEMM
blocks differently; with slot 0 and eager masks over slots < 1 the shapes, and so the numbers, are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from backends.inference.adapters import AdapterError, HostAdapter

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoraTerms(NamedTuple):
    """What one group needs for its LoRA term over some rows: `A` [in, cols] (None when fused into the base GEMM),
    `B` [cols, out], `off` [rows, cols] (the columns each row does not read; None when every row reads all `cols`:
    one slot), `start`: where the term's columns begin among the A columns of a fused GEMM's output."""

    A: torch.Tensor | None
    B: torch.Tensor
    off: torch.Tensor | None
    start: int = 0


def add_lora_(y: torch.Tensor, h: torch.Tensor, terms: LoraTerms) -> torch.Tensor:
    """``y += where(off, 0, h) @ B`` in place, with ``h = x @ A``: the select and the one GEMM of the module
    docstring (``h`` is overwritten); ``y += h @ B`` for one slot."""
    return y.addmm_(h if terms.off is None else h.masked_fill_(terms.off, 0), terms.B)


def lora_delta(x: torch.Tensor, terms: LoraTerms) -> torch.Tensor:
    """``where(off, 0, x @ A) @ B`` (``x @ A @ B`` for one slot) as a tensor of its own, for groups whose members are
    separate matmuls."""
    h = x @ terms.A
    return (h if terms.off is None else h.masked_fill_(terms.off, 0)) @ terms.B


class RowMasks(NamedTuple):
    """Which LoRA columns each row does NOT read: `off[M]`, [rows, slots*M*R] bool, per member count M (all of them
    for a row without an adapter). Inverted once per step so each group clears them with one masked_fill_ (a
    ``where`` with a scalar would also launch a fill kernel for the scalar)."""

    off: dict[int, torch.Tensor]


class LoraSlots:
    """`num_slots` adapters on `device`, for a model of `num_layers` layers with `layout` (module -> (in, out))."""

    def __init__(self, layout: dict[str, tuple[int, int]], num_layers: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device):
        self.layout, self.num_layers, self.num_slots = layout, num_layers, num_slots
        self.dtype, self.device = dtype, device
        self.rank = 0
        self.generation = 0
        self.A: list[dict[str, torch.Tensor]] = []
        self.B: list[dict[str, torch.Tensor]] = []
        self._col_slot: dict[int, torch.Tensor] = {}
        self._uid: list[int | None] = [None] * num_slots
        # fills[s]: a number new each time slot s's device columns are written (an adapter placed there, or the
        # stacks reallocated), so a copy derived from the slot (`merged_weights`) knows when it is stale
        self.fills = [0] * num_slots
        self._fill_count = 0
        self._host: list[HostAdapter | None] = [None] * num_slots
        self._refs = [0] * num_slots
        self._used = [0] * num_slots
        self._tick = 0
        self._dead: set[int] = set()
        self._provide_a: Callable[[int, str, int], torch.Tensor] | None = None

    # -- slot bookkeeping (engine thread only) -------------------------------------------------------------------
    def acquire(self, uid: int, load: Callable[[], HostAdapter]) -> int | None:
        """Slot holding adapter `uid` (placed now if needed), with a reference taken; None if every slot is busy."""
        self._tick += 1
        if uid in self._uid:
            slot = self._uid.index(uid)
        else:
            free = [s for s in range(self.num_slots) if self._refs[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self._uid[s] is not None, self._used[s], s))
            self._write(slot, uid, load())
        self._refs[slot] += 1
        self._used[slot] = self._tick
        return slot

    def release(self, slot: int) -> None:
        """Drop one reference to `slot`; an unloaded adapter leaves the slot when its last user finishes."""
        self._refs[slot] -= 1
        if self._refs[slot] == 0 and self._uid[slot] in self._dead:
            self._dead.discard(self._uid[slot])
            self._uid[slot] = self._host[slot] = None

    def forget(self, uid: int) -> None:
        """Adapter `uid` was unloaded: free its slot now, or once the requests using it finish."""
        if uid in self._uid:
            slot = self._uid.index(uid)
            if self._refs[slot] == 0:
                self._uid[slot] = self._host[slot] = None
            else:
                self._dead.add(uid)

    def resident(self) -> list[int]:
        return [u for u in self._uid if u is not None]

    # -- device stacks --------------------------------------------------------------------------------------------
    def bind_a(self, provide: Callable[[int, str, int], torch.Tensor]) -> None:
        """Keep A inside the base weights (module docstring, "Fused A"): `provide(layer, group, cols)` returns a
        zeroed [in, cols] view of rows appended to that group's weight, and is called again whenever the stacks are
        reallocated."""
        self._provide_a = provide
        if self.rank:
            self._allocate(self.rank)

    @property
    def fused_a(self) -> bool:
        return self._provide_a is not None

    def _allocate(self, rank: int) -> None:
        self.rank = rank
        self.A, self.B = [], []
        for layer in range(self.num_layers):
            a_layer, b_layer = {}, {}
            for group, members in GROUPS.items():
                fan_in = self.layout[members[0]][0]
                fan_out = sum(self.layout[m][1] for m in members)
                cols = self.num_slots * len(members) * rank
                a_layer[group] = (self._provide_a(layer, group, cols) if self._provide_a is not None else
                                  torch.zeros(fan_in, cols, dtype=self.dtype, device=self.device))
                b_layer[group] = torch.zeros(cols, fan_out, dtype=self.dtype, device=self.device)
            self.A.append(a_layer)
            self.B.append(b_layer)
        self._col_slot = {
            m: torch.arange(self.num_slots * m * rank, device=self.device) // (m * rank)
            for m in {len(v) for v in GROUPS.values()}
        }
        self.generation += 1
        for slot, host in enumerate(self._host):
            if host is not None:
                self._fill(slot, host)

    def _write(self, slot: int, uid: int, host: HostAdapter) -> None:
        self._check_finite(host)
        need = 1 << max(0, (host.rank - 1).bit_length())
        self._uid[slot], self._host[slot] = uid, host
        if need > self.rank:
            self._allocate(need)  # refills every resident slot, this one included
        else:
            self._fill(slot, host)

    def _check_finite(self, host: HostAdapter) -> None:
        """Refuse weights that are not finite in the slot dtype (module docstring: they would reach other rows)."""
        for (layer, module), (a, b) in host.weights.items():
            for tensor in (a, b * host.scale):
                if not bool(torch.isfinite(tensor.to(self.dtype)).all()):
                    raise AdapterError(f"adapter weights of layer {layer} {module} are not finite in {self.dtype}")

    @torch.no_grad()
    def _fill(self, slot: int, host: HostAdapter) -> None:
        self._fill_count += 1
        self.fills[slot] = self._fill_count
        R = self.rank
        for layer in range(self.num_layers):
            for group, members in GROUPS.items():
                M = len(members)
                a, b = self.A[layer][group], self.B[layer][group]
                base = slot * M * R
                a[:, base : base + M * R] = 0
                b[base : base + M * R] = 0
                offset = 0
                for m, module in enumerate(members):
                    fan_out = self.layout[module][1]
                    ab = host.weights.get((layer, module))
                    if ab is not None:
                        r = ab[0].shape[0]
                        start = base + m * R
                        a[:, start : start + r] = ab[0].t().to(self.device, self.dtype)
                        b[start : start + r, offset : offset + fan_out] = (ab[1] * host.scale).t().to(
                            self.device, self.dtype)
                    offset += fan_out

    # -- forward --------------------------------------------------------------------------------------------------
    def row_masks(self, row_slot: torch.Tensor, num_slots: int | None = None) -> RowMasks:
        """The masks of rows whose adapters sit in `row_slot` (-1: none), over the first `num_slots` slots (all of
        them when A is fused: the base GEMM computes every slot's columns)."""
        n = self.num_slots if num_slots is None or self.fused_a else num_slots
        off = {m: cs[: n * m * self.rank].unsqueeze(0) != row_slot.unsqueeze(1) for m, cs in self._col_slot.items()}
        return RowMasks(off)

    def _slot_columns(self, group: str, slot: int) -> slice:
        width = len(GROUPS[group]) * self.rank
        return slice(slot * width, (slot + 1) * width)

    def slot_factors(self, layer: int, group: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [in, M*R], B [M*R, out_1+…+out_M]) of the adapter in `slot` for `group` at `layer` (views; scale
        folded into B): that adapter's delta of the group's weight is ``(A @ B).T``."""
        cols = self._slot_columns(group, slot)
        return self.A[layer][group][:, cols], self.B[layer][group][cols]

    def terms(self, layer: int, group: str, rows: RowMasks | int) -> LoraTerms:
        """`group`'s LoRA operands at `layer` for the rows of `rows`: their masks, or the one slot they all read
        (module docstring, "One slot")."""
        if isinstance(rows, int):
            cols = self._slot_columns(group, rows)
            A = None if self.fused_a else self.A[layer][group][:, cols]
            return LoraTerms(A, self.B[layer][group][cols], None, cols.start)
        off = rows.off[len(GROUPS[group])]
        cols = off.shape[1]
        A = None if self.fused_a else self.A[layer][group][:, :cols]
        return LoraTerms(A, self.B[layer][group][:cols], off)
