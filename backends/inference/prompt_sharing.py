"""Which requests of one admission share a prefill row: those with the same prompt and the same adapter.

Requests ``i`` and ``j`` of an admission get one row when ``prompt_i == prompt_j`` (token for token) and
``adapter_i == adapter_j``. The row is computed once, in the slot of the group's first request (its first choice);
the engine copies its KV prefix ``[0, len(prompt))`` into every other slot of the group, as it does for the n choices
of one request, and samples each sequence's first token from the row's logits with that sequence's own seed,
temperature and top-p. A GRPO group of 16 rollouts sent as 16 ``n=1`` requests with one prompt is one row, not 16.

Choices:

1. **Adapter = LoRA slot** (-1 for the base model). Within one admission a slot names one adapter: every admitted
   request holds a reference on its slot, and a slot with references is never rewritten.
2. **Exact equality only.** A prompt that extends another one (a later turn of the same conversation) gets its own
   row: starting a prefill at an offset over cached keys is another forward (`decoder.DecoderRunner.prefill` runs
   from position 0, attending only to the tokens it is given).
3. **One admission only.** A request admitted later with the prompt of a running sequence is prefilled again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedRows:
    """`firsts[k]`: the index of the request whose prefill computes row k; `rows[i]`: the row of request i."""

    firsts: list[int]
    rows: list[int]


def share_rows(prompts: Sequence[Sequence[int]], adapters: Sequence[int]) -> SharedRows:
    """One row per distinct (adapter, prompt), in order of first appearance."""
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    firsts: list[int] = []
    rows: list[int] = []
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        row = seen.setdefault((adapter, tuple(prompt)), len(firsts))
        if row == len(firsts):
            firsts.append(i)
        rows.append(row)
    return SharedRows(firsts, rows)


def one_row_each(prompts: Sequence[Sequence[int]], adapters: Sequence[int]) -> SharedRows:
    """Every request its own row: the engine without sharing, which tests and benchmarks compare against."""
    rows = list(range(len(prompts)))
    return SharedRows(rows, list(rows))
