"""The fused LoRA ops' compute-dtype copies made once per optimizer step (kernels/lora_cast_cache.py): reused across a
step's micro-batches, re-made after every optimizer step and checkpoint load, never stale."""

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.lora_cast_cache import CastCache, cast_lora
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import record_gradients, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
# rows of 6-8 tokens, 8-token micro-batches: several micro-batches a step
FUSED = dict(fused_lora="on", micro_batch_tokens=8, learning_rate=1e-2)


def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.nn.Parameter(torch.randn(4, 6, generator=g)), torch.nn.Parameter(torch.randn(5, 4, generator=g)))


def _same(got, want):
    return all(torch.equal(x, y) for x, y in zip(got, want))


def test_copies_are_reused_in_a_scope_and_remade_when_a_weight_changes_in_place():
    a, b = _pair()
    cache = CastCache()
    first = cache.lora(a, b, 0.5, torch.bfloat16)
    assert cache.lora(a, b, 0.5, torch.bfloat16) is not first  # closed: made per call
    with cache.scope():
        made = cache.lora(a, b, 0.5, torch.bfloat16)
        assert cache.lora(a, b, 0.5, torch.bfloat16) is made and (cache.fills, cache.hits) == (1, 1)
        assert _same(made, cast_lora(a, b, 0.5, torch.bfloat16))
        assert cache.lora(a, b, 0.25, torch.bfloat16) is not made  # another scaling is another copy
        # an optimizer step inside the scope writes the parameters in place: their version counters move
        (a.sum() + b.sum()).backward()
        torch.optim.AdamW([a, b], lr=0.1).step()
        after_step = cache.lora(a, b, 0.5, torch.bfloat16)
        assert after_step is not made and _same(after_step, cast_lora(a, b, 0.5, torch.bfloat16))
        assert not _same(after_step, made)
        # so does load_state_dict's copy_
        module = torch.nn.Module()
        module.a, module.b = a, b
        fresh_a, fresh_b = _pair(seed=1)
        module.load_state_dict({"a": fresh_a.detach(), "b": fresh_b.detach()})
        loaded = cache.lora(a, b, 0.5, torch.bfloat16)
        assert _same(loaded, cast_lora(fresh_a, fresh_b, 0.5, torch.bfloat16))
    assert cache.lora(a, b, 0.5, torch.bfloat16) is not loaded  # nothing outlives the scope


def _checked(trainer, uses: list):
    """Wrap the trainer's cache: every copy a fused op receives must equal a fresh cast of the weights as they are."""
    inner = trainer.lora_casts.lora

    def lora(a, b, scaling, dtype):
        got = inner(a, b, scaling, dtype)
        uses.append(_same(got, cast_lora(a, b, scaling, dtype)))
        return got

    trainer.lora_casts.lora = lora


def test_trainer_fills_once_per_step_refreshes_after_step_and_load_and_never_reads_stale(tiny_model_path, tmp_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**FUSED, dtype="bfloat16"))
    assert trainer.fused_lora_layers == 14
    uses = []
    _checked(trainer, uses)
    cache = trainer.lora_casts
    metrics = trainer.train_step(GROUPS)
    mbs = int(metrics["micro_batches"])
    assert mbs >= 3
    assert cache.fills == 14 and cache.hits == 14 * (mbs - 1)  # the first micro-batch fills, the others reuse
    trainer.save_checkpoint(tmp_path / "after1")
    trainer.train_step(GROUPS)  # after the optimizer step: made again
    assert cache.fills == 28
    trainer.load_checkpoint(tmp_path / "after1")  # the adapter goes back a step: made again from the loaded weights
    trainer.train_step(GROUPS)
    assert cache.fills == 42 and len(uses) == 3 * 14 * mbs and all(uses)


def test_cached_copies_give_the_same_step_as_casting_per_micro_batch(tiny_model_path):
    runs = {}
    for mode in ("off", "on"):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**FUSED, dtype="bfloat16", cache_lora_casts=mode))
        grads = record_gradients(trainer)
        metrics = [trainer.train_step(GROUPS) for _ in range(2)]
        runs[mode] = (trainer, metrics, grads)
    assert runs["off"][0].lora_casts.fills == 0  # off: nothing cached, every call casts
    for got, want in zip(runs["on"][2], runs["off"][2]):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert [m["loss"] for m in runs["on"][1]] == [m["loss"] for m in runs["off"][1]]


def test_the_cache_switch_changes_on_a_live_trainer_and_acts_only_with_fused_lora(tiny_model_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**FUSED))
    trainer.train_step(GROUPS)
    assert trainer.lora_casts.fills == 14
    trainer.update_config(cache_lora_casts="off")
    trainer.train_step(GROUPS)
    assert trainer.lora_casts.fills == 14  # off from the next step: every call casts
    with pytest.raises(ValueError, match="accumulate_lora_grads"):  # baked into the patched modules
        trainer.update_config(accumulate_lora_grads="off")
    unfused = TrainerConfig(cache_lora_casts="on", accumulate_lora_grads="on")  # CPU: fused_lora 'auto' is off
    assert not unfused.enabled("cache_lora_casts", False) and not unfused.enabled("accumulate_lora_grads", False)
    assert TrainerConfig().enabled("cache_lora_casts", True) and TrainerConfig().enabled("accumulate_lora_grads", True)
