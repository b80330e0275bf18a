"""Greedy decoding verified against drafts (backends/training/draft_verification.py) on a real tiny-random model:
the same tokens as one forward per token (float32, CPU), in the forwards the rule predicts."""

import pytest
import torch

from backends.modeling.logits import logits_fp32
from backends.training.config import TrainerConfig
from backends.training.draft_verification import lookup_chunk, next_chunk
from backends.training.packing import make_micro_batch
from backends.training.token_rows import TrainingRow
from backends.training.trainer import GRPOTrainer

pytestmark = pytest.mark.usefixtures("single_thread")
N = 16


@pytest.fixture(scope="module")
def trainer(tiny_model_path, random_adapter):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(seed=0))
    set_peft_model_state_dict(trainer.model, load_file(random_adapter[0] / "adapter_model.safetensors"))
    return trainer


def _one_forward_per_token(trainer, prompt, n):
    """Reference: the whole sequence through the training forward, no cache, one argmax per forward."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            mb = make_micro_batch([TrainingRow(ids, [False] * len(ids), [0.0] * len(ids), source="ref")], "cpu")
            ids.append(int(logits_fp32(trainer._hidden(mb)[-1:], trainer._lm.lm_head.weight).argmax(-1)))
    return ids[len(prompt):]


PROMPTS = ([5, 17, 42, 7, 99, 3], [300, 2, 77], [11, 250, 13, 400, 8, 91, 35, 64, 120, 7, 7, 19],
           [8, 9, 10, 11] * 6)  # repeats: what the context lookup proposes


@pytest.mark.parametrize("prompt", PROMPTS)
def test_drafts_give_the_tokens_of_one_forward_per_token_in_fewer_forwards(trainer, prompt):
    ref = _one_forward_per_token(trainer, prompt, N)
    assert len(set(ref)) > 1
    wrong = lambda t: (t + 1) % trainer.vocab_size  # noqa: E731
    cases = {  # drafts -> forwards: one per verified chunk, one per token decided without a draft
        "none": ([], N),
        "full match": ([ref], 1),
        "longer than needed": ([ref + [1, 2, 3]], 1),
        "partly (7 right, then wrong)": ([ref[:7] + [wrong(ref[7])] + ref[8:]], 1 + (N - 8)),
        "not at all": ([[wrong(ref[0])] + ref[1:]], N),
        "ends early (EOS)": ([ref[:4]], 1 + (N - 5)),
        # the longer draft is verified first (same first token), fails after 5; the other continues the 6 decided
        "two drafts": ([ref[:5] + [wrong(ref[5])] * 15, ref], 2),
        "unrelated tokens and empty": ([[wrong(t) for t in ref], []], N),
    }
    for name, (drafts, forwards) in cases.items():
        tokens, taken = trainer.greedy_tokens(prompt, N, drafts)
        assert (tokens, taken) == (ref, forwards), name
        tokens, taken = trainer.greedy_tokens(prompt, N, drafts, lookup=True)  # the context's repeats too
        assert tokens == ref and taken <= forwards, name
    tokens, logprobs = trainer.greedy_continuation(prompt, N, [ref[:9]])
    assert tokens == ref and logprobs == trainer.sequence_logprobs(prompt, ref)
    assert trainer.model.training  # left as it was


def test_the_draft_verified_first_proposes_the_commonest_next_token_then_the_longest():
    drafts = [[1, 2], [1, 3, 4, 5], [1, 3], [9, 9, 9, 9, 9]]
    assert next_chunk(drafts, [1], 10) == [3, 4, 5]  # 3 twice, 2 once: the longest of the 3s
    assert next_chunk(drafts, [], 2) == [1, 3]  # 1 three times
    assert next_chunk(drafts, [1, 3, 4, 5], 10) == [] and next_chunk(drafts, [7], 10) == []
    assert next_chunk(drafts, [1], 0) == []


def test_the_context_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_its_longest_tail():
    assert lookup_chunk([1, 2, 3, 4, 2, 3, 5, 6, 1, 2, 3], 2) == [4, 2]  # 1 2 3 before 4 2 (2 3: before 5 6)
    assert lookup_chunk([2, 3, 5, 6, 2, 3, 7, 2, 3], 2) == [7, 2]  # the latest 2 3
    assert lookup_chunk([1, 2, 3, 4, 7, 2, 3], 5) == [4, 7, 2, 3]  # 2 3 once before
    assert lookup_chunk([4, 8, 9, 5, 4], 3) == [8, 9, 5]  # only the last token occurs earlier
    assert lookup_chunk([1, 2, 3], 4) == [] and lookup_chunk([5], 4) == [] and lookup_chunk([], 4) == []
