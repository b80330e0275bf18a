"""Greedy decoding verified against drafts: the same argmax tokens as one decoder step per token, in fewer forwards.

Rule: with tokens t_1..t_n decided, a draft that starts with them proposes its next tokens c_1..c_k; ONE forward of
the undecided input followed by c_1..c_k (the KV cache holds the rest) gives the argmax a_0..a_k after each position.
The longest prefix with c_i == a_(i-1) is accepted, then a_j, the argmax at the first mismatch (or after the last
draft token): exactly the tokens that k+1 single steps would have chosen, since each a_i sees the same context as the
step that would decide it. The cache is then cut back to the accepted context. No draft continuing the decided
tokens: one ordinary step (k = 0).

Choice of draft: among those continuing the decided tokens, the one proposing the most common next token (ties: the
longest). Drafts are sampled answers to the same prompt, whose commonest token is the likeliest to be the argmax.
Agreement with single steps is exact in exact arithmetic; in floating point a chunked forward and a single step may
round differently, which changes an argmax only on a near-tie.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence


def next_chunk(drafts: Sequence[Sequence[int]], decided: list[int], limit: int) -> list[int]:
    """At most `limit` draft tokens after `decided`, from the draft chosen by the rule above; [] when none continues."""
    n = len(decided)
    matching = [d for d in drafts if len(d) > n and list(d[:n]) == decided]
    if not matching or limit < 1:
        return []
    votes = Counter(d[n] for d in matching)
    best = max(matching, key=lambda d: (votes[d[n]], len(d)))
    return list(best[n:n + limit])


def lookup_chunk(context: list[int], limit: int, longest: int = 3) -> list[int]:
    """At most `limit` tokens that followed the latest earlier occurrence of `context`'s last n tokens, for n from
    `longest` down to 1; [] when none occurs earlier."""
    for n in range(min(longest, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + limit]
    return []


def verified_greedy(decode: Callable[[list[int], int, int], list[int]], prompt_ids: list[int], max_tokens: int,
                    drafts: Sequence[Sequence[int]] = (), lookup: bool = False) -> tuple[list[int], int]:
    """`max_tokens` greedy tokens after `prompt_ids`, and the number of forwards taken.

    ``decode(ids, keep, last)`` cuts the cache back to its first `keep` tokens, runs `ids` through the model with it
    (they are appended to it) and returns the argmax token after each of the last `last` of `ids`."""
    tokens: list[int] = []
    pending, cached, forwards = list(prompt_ids), 0, 0
    while len(tokens) < max_tokens:
        # one token fewer than missing: the argmax after the last draft token is the final one
        limit = max_tokens - len(tokens) - 1
        chunk = next_chunk(drafts, tokens, limit)
        if not chunk and lookup and limit > 0:
            chunk = lookup_chunk(list(prompt_ids) + tokens, limit)
        argmax = decode(pending + chunk, cached, len(chunk) + 1)
        forwards += 1
        accepted = 0
        while accepted < len(chunk) and argmax[accepted] == chunk[accepted]:
            accepted += 1
        cached += len(pending) + accepted  # the rejected draft tokens' cache entries are cut at the next call
        tokens += chunk[:accepted] + [argmax[accepted]]
        pending = [tokens[-1]]
    return tokens, forwards
