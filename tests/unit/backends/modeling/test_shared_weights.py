"""One copy of the base weights per process: the engine and the trainer share them (backends/modeling/shared_weights)."""

from __future__ import annotations

import gc

import pytest
import torch

from backends.inference.engine import Engine, EngineConfig, SamplingParams
from backends.modeling.loading import load_model, resolve_model
from backends.modeling.shared_weights import _SOURCES
from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import synthetic_group


def _base_weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """The trainer's frozen base tensors by their name in the plain model (peft's `base_layer.` taken out)."""
    return {name.replace("base_layer.", ""): p for name, p in trainer.model.get_base_model().named_parameters()
            if "lora_" not in name}


def _greedy(engine: Engine, prompt: list[int]):
    (done,) = engine.generate_sync(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), timeout=60)
    return done.token_ids, done.logprobs


@pytest.mark.parametrize("first", ["engine", "trainer"])  # LocalBackend starts the engine first, the flow the trainer
def test_engine_and_trainer_share_base_weights_and_training_leaves_them_alone(tiny_model_path, first):
    config = TrainerConfig(learning_rate=1e-2, lora_rank=4, lora_alpha=8)
    if first == "trainer":
        trainer = GRPOTrainer("tiny-random", config)
    engine = Engine.from_pretrained("tiny-random", config=EngineConfig(max_batch_size=2, max_loras=1))
    try:
        if first == "engine":
            trainer = GRPOTrainer("tiny-random", config)
        served, trained = dict(engine.model.named_parameters()), _base_weights(trainer)
        assert set(served) == set(trained)
        assert all(served[n].data_ptr() == trained[n].data_ptr() for n in served), "a second copy of the weights"
        assert engine.runner.embed.data_ptr() == trained["model.embed_tokens.weight"].data_ptr()
        assert trainer._lm.config is not engine.model.config  # the trainer's attention setting is its own
        before = {n: p.detach().clone() for n, p in served.items()}
        prompt = [5, 6, 7, 8]
        greedy_before = _greedy(engine, prompt)
        lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}

        metrics = trainer.train_step([synthetic_group([0.0, 1.0, 0.0, 1.0])])

        assert metrics["no_trainable_rows"] == 0 and metrics["grad_norm"] > 0
        assert any(not torch.equal(p, lora_before[n]) for n, p in trainer.model.named_parameters() if n in lora_before)
        assert all(torch.equal(p, before[n]) for n, p in served.items()), "training wrote a base weight"
        assert _greedy(engine, prompt) == greedy_before  # the engine serves the base model as before
    finally:
        engine.shutdown()


def test_shared_weights_are_one_copy_while_used_and_freed_with_the_last_user(tiny_model_path):
    dtype = torch.float64  # a key no other test of this process loads
    key = (str(resolve_model("tiny-random").path.resolve()), "cpu", str(dtype))
    a, _, _ = load_model("tiny-random", dtype=dtype, shared=True)
    b, _, _ = load_model("tiny-random", dtype=dtype, shared=True)
    own, _, _ = load_model("tiny-random", dtype=dtype)
    assert a is not b and a.model is not b.model
    pairs = list(zip(a.parameters(), b.parameters(), own.parameters()))
    assert all(x.data_ptr() == y.data_ptr() and x.data_ptr() != z.data_ptr() for x, y, z in pairs)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied weights stay tied in a twin
    b.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    assert a.model.layers[0].self_attn.q_proj.weight.requires_grad  # each twin's own Parameter objects
    del a
    gc.collect()
    assert key in _SOURCES  # b still uses them
    del b, pairs
    gc.collect()
    assert key not in _SOURCES


def _storage_bytes(*models) -> int:
    """Bytes of the distinct storages that `models`' parameters and buffers live in."""
    storages = {}
    for model in models:
        for t in [*model.parameters(), *model.buffers()]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("fold", ["fold_lora_b", "fold_lora_a"])
def test_a_trainer_that_folds_keeps_one_copy_of_the_folded_weights_and_a_later_engine_reads_it(tiny_model_path, fold):
    """fold_lora_b moves gate and up (every fusable linear under 'on') into [out, in + r] buffers, fold_lora_a down, k
    and v into [out + r, in] ones. The pristine first load that shared_weights keeps for later twins must point there
    too: otherwise a process with a trainer alone (the flow's GPU worker) holds those weights twice. An engine started
    afterwards serves the same weights from them."""
    gc.collect()  # the other fold's trainer and engine gone: this trainer's load is the first again
    dtype = torch.bfloat16  # a key of its own on the CPU: the engines of other tests hold float32 twins
    key = (str(resolve_model("tiny-random").path.resolve()), "cpu", str(dtype))
    reference, _, _ = load_model("tiny-random", dtype=dtype)
    trainer = GRPOTrainer("tiny-random", TrainerConfig(lora_rank=4, lora_alpha=8, dtype="bfloat16", fused_lora="on",
                                                       memory_efficient_ops="on", **{fold: "on"}))
    assert trainer.folded_lora_layers + trainer.row_folded_lora_layers > 0
    source = _SOURCES[key]
    assert _storage_bytes(source, trainer.model) == _storage_bytes(trainer.model), "the folded weights, twice"
    engine = Engine.from_pretrained("tiny-random", dtype=dtype, config=EngineConfig(max_batch_size=2, max_loras=1))
    try:
        served, plain = dict(engine.model.named_parameters()), dict(reference.named_parameters())
        assert all(torch.equal(served[n], plain[n]) for n in plain)
        trained = _base_weights(trainer)
        assert all(served[n].data_ptr() == trained[n].data_ptr() for n in served)  # one copy for both
        tokens, _ = _greedy(engine, [5, 6, 7, 8])
        trainer.train_step([synthetic_group([0.0, 1.0, 0.0, 1.0])])
        assert all(torch.equal(served[n], plain[n]) for n in plain), "training wrote a served weight"
        assert _greedy(engine, [5, 6, 7, 8])[0] == tokens
    finally:
        engine.shutdown()


def test_an_engine_started_before_a_folding_trainer_keeps_the_one_copy_after_the_trainer_goes(tiny_model_path):
    """LocalBackend's order: the engine holds the weights first, so the folded ones exist twice while the trainer
    lives (its buffers, the engine's originals); once the trainer is gone, only the engine's copy is left."""
    dtype = torch.float16  # a key of its own
    engine = Engine.from_pretrained("tiny-random", dtype=dtype, config=EngineConfig(max_batch_size=2, max_loras=1))
    try:
        source = _SOURCES[(str(resolve_model("tiny-random").path.resolve()), "cpu", str(dtype))]
        alone = _storage_bytes(source, engine.model)
        trainer = GRPOTrainer("tiny-random", TrainerConfig(lora_rank=4, lora_alpha=8, fused_lora="on",
                                                           memory_efficient_ops="on", fold_lora_b="on"),
                              model=load_model("tiny-random", dtype=dtype, shared=True)[0],
                              tokenizer=engine.tokenizer)
        assert trainer.folded_lora_layers > 0
        assert _storage_bytes(source, engine.model) == alone  # the engine and the source: the old storage
        del trainer
        gc.collect()
        assert _storage_bytes(source, engine.model) == alone
    finally:
        engine.shutdown()
