"""The TRL side-by-side benchmark feeds TRL exactly our trained tokens, in TRL's padding scheme."""

import torch

from backends.training.token_rows import TrainingRow
from benchmarks.training_fresh_process import lora_aware_flops
from benchmarks.training_trl import trl_batches, trl_inputs


def _row(n_prompt: int, mask: list[bool], adv: float) -> TrainingRow:
    ids = list(range(1, n_prompt + len(mask) + 1))
    loss_mask = [False] * n_prompt + mask
    return TrainingRow(ids, loss_mask, [-0.5 if m else 0.0 for m in loss_mask], advantage=adv)


def test_rows_split_at_the_first_trained_token_with_our_mask_as_tool_mask():
    rows = [_row(3, [True, True, False, True], 1.0), _row(1, [True, False], -1.0)]
    x = trl_inputs(rows, pad_id=0, device="cpu", num_items=4)
    assert x["prompt_ids"].tolist() == [[1, 2, 3], [0, 0, 1]]  # left-padded
    assert x["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert x["completion_ids"].tolist() == [[4, 5, 6, 7], [2, 3, 0, 0]]  # right-padded
    assert x["completion_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert x["tool_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    trained = (x["completion_mask"] * x["tool_mask"]).sum()
    assert int(trained) == sum(r.trained_tokens for r in rows) == int(x["num_items_in_batch"])
    assert torch.equal(x["old_per_token_logps"] != 0, (x["completion_mask"] * x["tool_mask"]).bool())
    assert x["advantages"].tolist() == [1.0, -1.0]


def test_micro_batches_count_padding_against_the_budget():
    rows = [_row(2, [True] * 6, 0.0), _row(6, [True] * 2, 0.0), _row(1, [True], 0.0)]
    # widths: rows 0+1 pad to (6 + 6) x 2 = 24 > 16 -> apart; rows 1+2 pad to (6 + 2) x 2 = 16 -> together
    assert [[len(r) for r in b] for b in trl_batches(rows, 16)] == [[8], [8, 2]]


def test_lora_aware_flops_count_causal_attention_per_row():
    shape = {"num_hidden_layers": 2, "hidden_size": 4}
    # 4N per token + 3 x (4 x layers x hidden x L^2 / 2) + 6 x LoRA params per token
    assert lora_aware_flops(10, 1, shape, [3, 5]) == 4 * 10 * 8 + 3 * (32 * 9 / 2 + 32 * 25 / 2) + 6 * 8
