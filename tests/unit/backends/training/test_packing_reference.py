"""``make_micro_batch`` (whole-row array work) gives exactly what the straightforward per-token packing below gives:
every tensor equal in dtype, values and order (floats bit for bit, so -0.0 stays -0.0), and the same error for a row
whose first token is trained."""

import random

import numpy as np
import pytest
import torch

from backends.training.packing import make_micro_batch
from backends.training.token_rows import TrainingRow


def reference_micro_batch(rows):
    """The per-token packing: Python lists, then one ``torch.tensor`` per dtype."""
    ids, pos, pred, tgt, lps, adv, wts, ridx = [], [], [], [], [], [], [], []
    for k, row in enumerate(rows):
        offset = len(ids)
        if row.loss_mask and row.loss_mask[0]:
            raise ValueError(f"{row.source}: the first token of a row cannot be trained (no context before it)")
        for t, trained in enumerate(row.loss_mask):
            if trained:
                pred.append(offset + t - 1)
                tgt.append(row.token_ids[t])
                lps.append(row.sampler_logprobs[t])
        n = sum(row.loss_mask)
        adv += [row.advantage] * n
        wts += [row.weight] * n
        ridx += [k] * n
        ids += row.token_ids
        pos += range(len(row))
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r))
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    as_float = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return dict(input_ids=as_long(ids)[None], position_ids=as_long(pos)[None], pred_index=as_long(pred),
                targets=as_long(tgt), row_index=as_long(ridx), sampler_logprobs=as_float(lps),
                advantages=as_float(adv), weights=as_float(wts), cu=as_long(offsets).to(torch.int32),
                lengths=tuple(len(r) for r in rows), max_len=max((len(r) for r in rows), default=0))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_micro_batch(rows):
    want = reference_micro_batch(rows)
    got = make_micro_batch(rows, "cpu")
    for name in ("input_ids", "position_ids", "pred_index", "targets", "row_index", "sampler_logprobs", "advantages",
                 "weights"):
        a, b = getattr(got, name), want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), name
    assert got.spans.lengths == want["lengths"] and got.spans.max_len == want["max_len"]
    assert got.spans.cu_seqlens.dtype == torch.int32 and torch.equal(got.spans.cu_seqlens, want["cu"])
    assert all(type(n) is int for n in (*got.spans.lengths, got.spans.max_len))
    assert got.rows == list(rows)


def _random_row(rng: random.Random, n: int, kind: str) -> TrainingRow:
    ids = [rng.randrange(151936) for _ in range(n)]
    if kind == "runs":  # context, then sampled turns and tool results, as build_rows makes them
        mask, trained = [], False
        while len(mask) < n:
            mask += [trained and len(mask) > 0] * rng.randint(1, 40)
            trained = not trained
        mask = mask[:n]
    elif kind == "isolated":  # single trained tokens between untrained ones
        mask = [t % 2 == 1 for t in range(n)]
    elif kind == "untrained":
        mask = [False] * n
    else:
        mask = [False] + [True] * (n - 1)
    # values that round to float32 in different ways, signed zeros and tiny numbers; untrained positions 0.0
    specials = [-0.0, 0.0, 1e-45, -1e-40, 3.4028235e38, -2.0**-149, 0.1, -1 / 3]
    lps = [(rng.choice(specials) if rng.random() < 0.3 else -rng.expovariate(0.3)) if m else 0.0 for m in mask]
    return TrainingRow(ids, mask, lps, advantage=rng.choice([-0.0, 1 / 3, -2.5e-8, 7.0]),
                       weight=rng.choice([1 / 7, 1e-9, 0.0]), source=f"row {kind} {n}")


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_equal_the_per_token_packing(seed):
    rng = random.Random(seed)
    kinds = ["runs", "isolated", "untrained", "all-but-first"]
    rows = [_random_row(rng, rng.randint(1, 300), rng.choice(kinds)) for _ in range(rng.randint(1, 7))]
    assert_same_micro_batch(rows)
    assert_same_micro_batch(rows[:1])


def test_edge_shapes_equal_the_per_token_packing():
    assert_same_micro_batch([])
    empty = TrainingRow([], [], [], source="empty")
    one = TrainingRow([5], [False], [0.0], source="one")
    pair = TrainingRow([5, 6], [False, True], [-0.0], advantage=-0.0, weight=0.5, source="pair")
    pair.sampler_logprobs = [0.0, -0.0]
    assert_same_micro_batch([empty, one, pair, empty])
    assert_same_micro_batch([TrainingRow([1, 2, 3], [False, True, True], [0.0, -1.0, -2.0], advantage=1, weight=1)])


def test_masks_of_numpy_bools_and_ints_pack_alike():
    rows = [TrainingRow([1, 2, 3, 4], [np.False_, np.True_, np.False_, np.True_], [0.0, -1.0, 0.0, -2.0]),
            TrainingRow([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], advantage=2.0, weight=0.5)]
    assert_same_micro_batch(rows)


def test_a_trained_first_token_is_the_same_error():
    rows = [TrainingRow([1, 2], [False, True], [0.0, -1.0], source="fine"),
            TrainingRow([3, 4], [True, False], [-1.0, 0.0], source="bad row")]
    with pytest.raises(ValueError) as want:
        reference_micro_batch(rows)
    with pytest.raises(ValueError) as got:
        make_micro_batch(rows, "cpu")
    assert str(got.value) == str(want.value) == ("bad row: the first token of a row cannot be trained "
                                                 "(no context before it)")
