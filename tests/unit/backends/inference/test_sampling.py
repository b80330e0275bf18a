"""Seeded sampling does not depend on what shares the batch: a row without top-p draws the same token whether or not
another row of its batch uses top-p (the sorted path used to give it another token for the same uniform)."""

from __future__ import annotations

import torch

from backends.inference.sampling import sample


def test_a_row_without_top_p_draws_the_same_token_beside_a_top_p_row():
    torch.manual_seed(0)
    logits = torch.randn(2, 500)
    temperature = torch.ones(2)
    draws = []
    for u in torch.linspace(0.01, 0.99, 25, dtype=torch.float64):
        uniforms = torch.stack((u, u))
        alone, _, _ = sample(logits[:1], temperature[:1], uniforms[:1])
        beside, _, _ = sample(logits, temperature, uniforms, top_p=torch.tensor([1.0, 0.5]))
        draws.append((alone.item(), beside[0].item()))
    assert all(a == b for a, b in draws), draws
    # and top-p still applies to the row that asked for it: only tokens of its top half of the mass
    probs = torch.softmax(logits[1], dim=-1)
    sorted_p, order = probs.sort(descending=True)
    kept = set(order[(sorted_p.cumsum(0) - sorted_p) < 0.5].tolist())
    for u in torch.linspace(0.01, 0.99, 25, dtype=torch.float64):
        tokens, _, _ = sample(logits, temperature, torch.stack((u, u)), top_p=torch.tensor([1.0, 0.5]))
        assert tokens[1].item() in kept
