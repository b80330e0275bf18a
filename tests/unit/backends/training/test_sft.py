"""SFT trains the trainer's own adapter in place: the loss goes down on a few demonstrations, the GRPO state is left
fresh, and the saved adapter is what the engine then serves.

The tiny model's logits are nearly uniform (weights drawn with std 0.02), too flat for an adapter to move far in a few
steps, so its tied embedding matrix is scaled x4 first (as in test_trainer_learning.py), saved as a model folder that
the trainer and the engine both load."""

from __future__ import annotations

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.sft import run_sft
from backends.training.trainer import GRPOTrainer
from tests.fixtures_sft import ARITHMETIC, TOOL_CONVERSATION

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def sharp_model_path(tiny_model_path, tmp_path_factory):
    from backends.modeling.loading import load_model

    model, tok, _ = load_model(str(tiny_model_path))
    model.get_input_embeddings().weight.data.mul_(4.0)
    folder = tmp_path_factory.mktemp("tiny-sharp")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_loss_goes_down_and_the_engine_serves_the_sfted_adapter(sharp_model_path, tmp_path):
    from backends.inference.engine import Engine, EngineConfig, SamplingParams
    from backends.serving.chat import ChatRequest, render_prompt

    trainer = GRPOTrainer(str(sharp_model_path), TrainerConfig(seed=0))
    events = []
    metrics = run_sft(trainer, [TOOL_CONVERSATION, *ARITHMETIC], epochs=6, learning_rate=3e-2, batch_size=2,
                      on_progress=events.append)
    losses = metrics["loss_per_epoch"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    assert metrics["sft/loss"] == losses[-1] and metrics["sft/loss_epoch_1"] == losses[0]
    assert metrics["sft/optimizer_steps"] == metrics["sft/steps_run"] == 12  # 6 epochs x ceil(4 / 2)
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2, 3, 4, 5, 6]
    assert metrics["sft/conversations"] == 4 and metrics["sft/skipped"] == 0
    assert 0 < metrics["sft/trained_tokens"] < metrics["sft/tokens"]
    # the GRPO side is untouched: no GRPO step taken, its optimizer has no state yet
    assert trainer.step == 0 and not trainer.optimizer.state

    # the checkpoint's adapter, loaded by the engine, continues a demonstration's prompt as the trainer does
    trainer.save_checkpoint(tmp_path / "ckpt")
    messages, tools = TOOL_CONVERSATION["messages"], TOOL_CONVERSATION["tools"]
    prompt = render_prompt(trainer.tokenizer, ChatRequest(model="m", messages=messages[:2], tools=tools))
    tokens, logprobs = trainer.greedy_continuation(prompt, 8)
    engine = Engine.from_pretrained(str(sharp_model_path), config=EngineConfig(max_batch_size=2, max_loras=1))
    try:
        engine.load_adapter("sft", str(tmp_path / "ckpt" / "adapter"))
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        (served,) = engine.generate_sync(prompt, greedy, model="sft", timeout=120)
        (base,) = engine.generate_sync(prompt, greedy, timeout=120)
    finally:
        engine.shutdown()
    assert served.token_ids == tokens
    assert served.logprobs == pytest.approx(logprobs, abs=1e-3)
    assert served.logprobs != pytest.approx(base.logprobs, abs=1e-2)  # not the base model


def test_trajectories_and_conversations_train_alike(tiny_model_path):
    from agents.trajectory import SampledTurn, Trajectory

    messages = ARITHMETIC[0]["messages"]
    sampled = SampledTurn(message=messages[1], token_ids=[1, 2], logprobs=[-1.0, -1.0])  # its message is what counts
    traj = Trajectory(messages_and_choices=[messages[0], sampled])
    results = []
    for items in ([traj], [ARITHMETIC[0]]):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(seed=0))
        run_sft(trainer, items, epochs=1, learning_rate=1e-2)
        results.append({k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k})
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    assert any(v.abs().sum() > 0 for v in results[0].values())


@pytest.mark.parametrize("switch", [dict(fused_rope="on"), dict(fold_lora_b="on"), dict(fp8_base="on"),
                                    dict(group_qkv="on"), dict(recompute_norm="on"), dict(fold_lora_a="on"),
                                    dict(low_rank_first="on")],
                         ids=["fused_rope", "fold_lora_b", "fp8_base", "group_qkv", "recompute_norm", "fold_lora_a",
                              "low_rank_first"])
def test_sft_the_reference_pass_and_peft_merges_with_each_switch_on(tiny_model_path, switch):
    """SFT takes the same steps with each of the day's switches on as with all off (its steps run outside the FP8
    scope: bf16 products, like the KL passes); with the adapter disabled (the KL reference) the model is the plain
    base model; peft's merge_adapter gives the adapter's logits and unmerge_adapter gives them back. The trainers load
    their own weights: a merge writes the base weights in place, which the shared ones must never be."""
    from backends.modeling.loading import load_model

    base = dict(seed=0, fused_lora="on", memory_efficient_ops="on", fused_rope="off", fold_lora_b="off")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain, _, _ = load_model(str(tiny_model_path))
    with torch.no_grad():
        want_base = plain(input_ids=ids).logits
    runs = {}
    for name, cfg in (("off", base), ("on", {**base, **switch})):
        own, tok, _ = load_model(str(tiny_model_path))
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg), model=own, tokenizer=tok)
        run_sft(trainer, ARITHMETIC, epochs=2, learning_rate=1e-2)
        trainer.model.eval()
        with torch.no_grad():
            adapted = trainer.model(input_ids=ids).logits
            with trainer.model.disable_adapter():
                torch.testing.assert_close(trainer.model(input_ids=ids).logits, want_base, rtol=1e-5, atol=1e-5)
            trainer.model.merge_adapter()
            torch.testing.assert_close(trainer.model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)
            trainer.model.unmerge_adapter()
            torch.testing.assert_close(trainer.model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)
        runs[name] = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k}
        del trainer
    assert any(v.abs().sum() > 0 for v in runs["on"].values())
    for k, v in runs["off"].items():
        torch.testing.assert_close(runs["on"][k], v, rtol=1e-3, atol=1e-4)
