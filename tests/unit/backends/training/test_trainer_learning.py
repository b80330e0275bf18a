"""The trainer learns: a tiny model rewarded for a behaviour produces more of it within a few CPU steps.

Behaviour: emit tokens from a target set S (the half of the vocabulary whose embedding points along a
fixed random direction). Reward = fraction of sampled tokens in S. Rollouts are sampled with the
trainer's own model through ``generate`` (real logprobs from the raw logits, as a server reports).

The tiny model's logits are nearly uniform (weights drawn with std 0.02, entropy ~ln|V|), too flat for
any adapter to move in a few steps, so its (tied) embedding matrix is scaled x4 first; the model is
otherwise the tiny-random model. We assert the increase of the mean reward, not any timing.
"""

import pytest
import torch

from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup
from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import chat_prompt_ids

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS, GROUPS, GROUP_SIZE, LENGTH = 8, 4, 8, 4


def _sample(trainer, prompt, n, seed):
    tok = trainer.tokenizer
    torch.manual_seed(seed)
    trainer.model.eval()
    with torch.no_grad():
        out = trainer.model.generate(
            input_ids=torch.tensor([prompt] * n), do_sample=True, top_k=0, top_p=1.0, max_new_tokens=LENGTH,
            min_new_tokens=LENGTH, output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
        )
    seqs = out.sequences[:, len(prompt):]
    lps = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(2, seqs[..., None]).squeeze(-1)
    return seqs.tolist(), lps.tolist()


def test_reward_goes_up(tiny_model_path):
    from backends.modeling.loading import load_model

    model, tok, _ = load_model(str(tiny_model_path))
    emb = model.get_input_embeddings().weight.data
    emb.mul_(4.0)
    direction = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    target = set(torch.nonzero(emb @ direction > 0).flatten().tolist())
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(learning_rate=1e-2, seed=0), model=model, tokenizer=tok)
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": "Say something."}])

    def reward(ids):
        return sum(t in target for t in ids) / len(ids)

    def mean_reward():
        seqs, _ = _sample(trainer, prompt, 64, seed=1234)
        return sum(map(reward, seqs)) / len(seqs)

    before = mean_reward()
    for step in range(STEPS):
        groups = []
        for g in range(GROUPS):
            seqs, lps = _sample(trainer, prompt, GROUP_SIZE, seed=1000 * step + g)
            groups.append(TrajectoryGroup([
                Trajectory(messages_and_choices=[SampledTurn(message={"role": "assistant", "content": ""},
                                                             prompt_token_ids=prompt, token_ids=s, logprobs=lp)],
                           reward=reward(s))
                for s, lp in zip(seqs, lps)
            ]))
        metrics = trainer.train_step(groups)
        assert metrics["mismatch_kl"] < 1e-5  # on-policy: sampler and trainer agree
    after = mean_reward()
    assert trainer.step == STEPS
    assert after > before + 0.08, (before, after)
