"""Which requests share a prefill row: those with the same prompt and the same adapter.

Requests ``i`` and ``j`` share a row when ``prompt_i == prompt_j`` (token for token) and ``adapter_i == adapter_j``.
The row is computed once, in the slot of its first request (that request's first choice); the engine copies its KV
prefix ``[0, len(prompt))`` into every other slot of the row, as it does for the n choices of one request, and
samples each sequence's first token from the row's logits with that sequence's own seed, temperature and top-p. A
GRPO group of 16 rollouts sent as 16 ``n=1`` requests with one prompt is one row, not 16.

Two reaches:

- **One admission** (`share_rows`): the requests prefilled together are grouped by (adapter, prompt).
- **Live rows** (`LivePrompts`): a row's logits are kept while a sequence that holds its prefix runs, so a request
  admitted later with that prompt and adapter (the rest of a group that arrived a step later) copies the prefix from
  that sequence's slot and samples from the kept logits: no forward at all. A running sequence never writes the
  positions of its prompt again, so its slot's prefix stays what the prefill wrote until the slot is freed.

Choices:

1. **Adapter = LoRA slot** (-1 for the base model). While a request runs, its slot names one adapter: it holds a
   reference on the slot, and a slot with references is never rewritten.
2. **Exact equality only.** A prompt that extends another one (a later turn of the same conversation) gets its own
   row: starting a prefill at an offset over cached keys is another forward (`decoder.DecoderRunner.prefill` runs
   from position 0, attending only to the tokens it is given).
3. **Kept logits cost memory**: one float32 row of the vocabulary per distinct live prompt (600 KB for a 152k
   vocabulary), freed with the last sequence that holds the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Key = tuple[int, tuple[int, ...]]  # (adapter, prompt)


@dataclass(frozen=True)
class SharedRows:
    """`firsts[k]`: the index of the request that heads row k, `keys[k]` its (adapter, prompt) or None (not to be
    shared with later admissions); `rows[i]`: the row of request i."""

    firsts: list[int]
    rows: list[int]
    keys: list[Key | None]


def share_rows(prompts: Sequence[Sequence[int]], adapters: Sequence[int]) -> SharedRows:
    """One row per distinct (adapter, prompt), in order of first appearance."""
    seen: dict[Key, int] = {}
    firsts: list[int] = []
    rows: list[int] = []
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        row = seen.setdefault((adapter, tuple(prompt)), len(firsts))
        if row == len(firsts):
            firsts.append(i)
        rows.append(row)
    return SharedRows(firsts, rows, list(seen))


def one_row_each(prompts: Sequence[Sequence[int]], adapters: Sequence[int]) -> SharedRows:
    """Every request its own row, none kept for later admissions: the engine without sharing, which tests and
    benchmarks compare against."""
    rows = list(range(len(prompts)))
    return SharedRows(rows, list(rows), [None] * len(rows))


class LivePrompts:
    """Rows that running sequences hold: (adapter, prompt) -> the row's logits and the sequences whose slots hold its
    KV prefix (the holders; each is released when its slot is freed)."""

    def __init__(self) -> None:
        self._rows: dict[Key, tuple[Any, dict[int, Any]]] = {}
        self._key_of: dict[int, Key] = {}

    def find(self, key: Key) -> tuple[Any, Any] | None:
        """(logits, a holder) of the live row `key`, or None."""
        entry = self._rows.get(key)
        return None if entry is None else (entry[0], next(iter(entry[1].values())))

    def hold(self, key: Key, logits: Any, holders: Sequence[Any]) -> None:
        """`holders` hold row `key`, whose logits are `logits` (kept only if the row is not live yet)."""
        entry = self._rows.setdefault(key, (logits, {}))
        for holder in holders:
            entry[1][id(holder)] = holder
            self._key_of[id(holder)] = key

    def release(self, holder: Any) -> None:
        """`holder`'s slot is freed; the row goes with its last holder."""
        key = self._key_of.pop(id(holder), None)
        if key is None:
            return
        holders = self._rows[key][1]
        del holders[id(holder)]
        if not holders:
            del self._rows[key]

    def __len__(self) -> int:
        return len(self._rows)
