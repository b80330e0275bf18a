"""Token sampling for the engine: raw logprobs, temperature, top-p, and seeded draws that do not depend on the batch.

Choices made here:

- **Logprobs are raw.** The logprob we return for a sampled token is ``log_softmax(logits)[token]`` of the model's
  unprocessed logits (temperature 1, no top-p), like vLLM's default ``logprobs_mode="raw_logprobs"``; that is what
  the trainer recomputes with a teacher-forced forward pass.
- **One uniform per token, from a counter-based hash.** Sequence ``c`` draws its ``i``-th token with
  ``u = splitmix64(splitmix64(seed_c) xor i) >> 40) / 2**24`` (24 bits, exact in float32, ``0 <= u < 1``) and takes
  the token where the cumulative distribution first exceeds ``u * total`` (inverse-CDF sampling, cumulative sums in
  float64). A seed therefore fixes the tokens whatever else shares the batch (up to float differences in the logits
  themselves) and nothing here needs a per-request ``torch.Generator``, so the step is one CUDA graph. Drawing the
  token from ``softmax(logits / T)`` this way is exact multinomial sampling.
- **top-p** keeps the smallest prefix of tokens (by descending probability) whose mass reaches ``top_p``: token ``i``
  is kept when the mass strictly before it is ``< top_p``. The most likely token is always kept, also when a tiny
  ``top_p`` rounds to 0 in float32 (nothing would be kept, and the draw would fall on the last token). A row with
  ``top_p = 1`` draws from the unsorted distribution also when other rows of its batch use top-p: the same uniform
  falls on another token of the sorted order, and a row's token must not depend on what shares its batch (nor on
  whether a finished sequence's discarded row still does, `EngineConfig.overlap_decode`).
- **temperature below** ``SAMPLING_EPS = 1e-5`` (vLLM's ``_SAMPLING_EPS``; 0 included) means greedy:
  ``argmax(logits)``. Dividing float32 logits by a smaller temperature overflows to inf (a subnormal one such as
  1e-39 gives NaN probabilities), while at 1e-5 the distribution is already one-hot for any logit gap above ~1e-3.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
SAMPLING_EPS = 1e-5


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser over 64-bit integers (Steele, Lea, Flood 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """Draw number `index` of the stream `seed`, in [0, 1 - 2**-24]."""
    return (splitmix64(splitmix64(seed & MASK64) ^ (index & MASK64)) >> 40) / float(1 << 24)


def choice_seed(seed: int, choice: int) -> int:
    """Seed of choice `choice` of a request seeded with `seed` (choice 0 keeps the request's seed)."""
    return seed & MASK64 if choice == 0 else splitmix64((seed & MASK64) ^ splitmix64(choice))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits [B, V] float32; temperature [B] (< SAMPLING_EPS means greedy); uniforms [B] float64 in [0, 1);
    top_p [B] or None (None means 1 for every row, and skips the sort).
    Returns (tokens [B] int64, raw logprob of each token [B] float32, raw logprobs [B, V] float32).
    """
    raw = torch.log_softmax(logits, dim=-1)
    greedy = temperature < SAMPLING_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
    vocab = logits.shape[-1]
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    if top_p is not None:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p.unsqueeze(1)
        keep[:, 0] = True
        cdf = (sorted_p * keep).double().cumsum(dim=-1)
        target = (uniforms * cdf[:, -1]).unsqueeze(1)
        pick = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
        tokens = torch.where(top_p >= 1, tokens, sorted_idx.gather(1, pick).squeeze(1))
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    token_logprobs = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, token_logprobs, raw
