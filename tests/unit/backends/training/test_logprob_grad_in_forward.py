"""The output head's gradient computed in the logprob forward (logprob_grad_in_forward.py): the same logp, entropy,
loss, LossResult stats and gradients as the recomputing op followed by the loss' backward, in the op and in the trainer
(CISPO and PPO, tis_cap, temperature, several chunks and micro-batches, every aggregation, KL-shaped advantages); GSPO
takes the recomputing path; the loss' graph keeps dL/dh, not h."""

import pytest
import torch

from backends.training import trainer as trainer_module
from backends.training.config import TrainerConfig
from backends.training.logprob_grad_in_forward import logprobs_with_head_grad
from backends.training.logprobs import chunked_logprobs
from backends.training.losses import LossResult, policy_loss, weighted_token_losses
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import record_gradients, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

N, H, V = 11, 8, 23


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    sampler = -torch.rand(N, generator=g) * 4  # ratios on both sides of the clip range
    adv = torch.randn(N, generator=g)
    weights = torch.rand(N, generator=g)
    row_index = torch.tensor([0] * 4 + [1] * 5 + [2] * 2)
    return hidden, weight, targets, (sampler, adv, weights, row_index)


def _both_paths(loss, tis_cap, temperature, chunk, dtype=torch.float32, weight_grad=False):
    """{path: (logp, entropy, LossResult, dL/dh, dL/dW)} of the recomputing op + backward and of the fused op."""
    hidden, weight, targets, per_token = _inputs(dtype)
    options = dict(loss=loss, eps=0.2, eps_high=0.28, tis_cap=tis_cap, n_rows=3)
    out = {}
    for path in ("recompute", "in-forward"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(weight_grad)
        if path == "recompute":
            logp, entropy = chunked_logprobs(h, w, targets, chunk, temperature)
            res = policy_loss(logp, *per_token, **options)
        else:
            def token_loss(lp, sl):
                return weighted_token_losses(lp, *(t[sl] for t in per_token), **options)[0].sum()

            head = logprobs_with_head_grad(h, w, targets, token_loss, chunk, temperature)
            logp, entropy = head.logp, head.entropy
            res = policy_loss(logp, *per_token, **options)
            res.loss = head.attach(res.loss)
        res.loss.backward()
        out[path] = (logp.detach(), entropy, res, h.grad, w.grad)
    return out


@pytest.mark.parametrize("loss", ["cispo", "ppo"])
@pytest.mark.parametrize("tis_cap", [None, 2.0], ids=["sampler", "tis"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 64], ids=["chunks", "one-chunk"])
def test_the_op_gives_todays_values_stats_and_gradients_bit_for_bit(loss, tis_cap, temperature, chunk):
    out = _both_paths(loss, tis_cap, temperature, chunk, weight_grad=True)
    (lp, ent, res, gh, gw), (lp2, ent2, res2, gh2, gw2) = out["recompute"], out["in-forward"]
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
    assert torch.equal(res.loss.detach(), res2.loss.detach()) and torch.equal(res.stats, res2.stats)
    assert res.tokens == res2.tokens
    assert torch.equal(gh, gh2) and torch.equal(gw, gw2)
    assert gh.abs().sum() > 0 and gw.abs().sum() > 0


def test_bf16_hidden_gets_the_same_bits_too():
    out = _both_paths("cispo", None, 0.7, 3, dtype=torch.bfloat16)
    assert out["in-forward"][3].dtype == torch.bfloat16
    assert torch.equal(out["recompute"][3], out["in-forward"][3])


def test_the_upstream_gradient_scales_dh():
    hidden, weight, targets, per_token = _inputs()
    grads = []
    for scale in (1.0, 0.5):
        h = hidden.clone().requires_grad_()
        head = logprobs_with_head_grad(h, weight, targets, lambda lp, sl: (lp * per_token[1][sl]).sum(), 3)
        (head.attach((head.logp * per_token[1]).sum()) * scale).backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[1], grads[0] * 0.5, rtol=0, atol=0)


def test_the_loss_graph_keeps_dh_and_not_h():
    hidden, weight, targets, per_token = _inputs()
    h = hidden.clone().requires_grad_()
    head = logprobs_with_head_grad(h, weight, targets, lambda lp, sl: (lp * per_token[1][sl]).sum(), 3)
    loss = head.attach((head.logp * per_token[1]).sum())
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 1 and saved[0].shape == h.shape and saved[0].dtype == h.dtype
    assert saved[0].untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    assert not head.logp.requires_grad and not head.entropy.requires_grad
    # today's op keeps h itself (what this one replaces by dL/dh)
    logp, _ = chunked_logprobs(h, weight, targets, 3)
    assert any(t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr() for t in logp.grad_fn.saved_tensors)


GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0], prompt=(5, 6, 7, 8, 9))]
IGNORED = ("step_time_s", "tokens_per_s", "peak_memory_gib")


def _train(tiny_model_path, monkeypatch, mode: str, **cfg):
    """(metrics of two steps, their LoRA gradients, the micro-batches whose loss took the fused op)."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(logprob_grad_in_forward=mode, **cfg))
    fused, inner = [], trainer_module.logprobs_with_head_grad
    monkeypatch.setattr(trainer_module, "logprobs_with_head_grad", lambda *a: fused.append(1) or inner(*a))
    grads = record_gradients(trainer)
    metrics = [trainer.train_step(GROUPS) for _ in range(2)]
    return metrics, grads, len(fused)


@pytest.mark.parametrize("loss,tis_cap,aggregation,kl_coef", [
    ("cispo", None, "sequence_mean", 0.0), ("cispo", 2.0, "token_mean", 0.0), ("cispo", None, "dr_grpo", 0.2),
    ("ppo", None, "sequence_mean", 0.0), ("ppo", 2.0, "dr_grpo", 0.0), ("ppo", None, "token_mean", 0.2),
])
def test_trainer_steps_are_the_same_bits_with_the_switch_on_and_off(tiny_model_path, monkeypatch, loss, tis_cap,
                                                                    aggregation, kl_coef):
    cfg = dict(loss=loss, tis_cap=tis_cap, aggregation=aggregation, kl_coef=kl_coef, temperature=0.7,
               logprob_chunk=2, micro_batch_tokens=8, learning_rate=1e-2, dr_grpo_norm=16)
    off, on = (_train(tiny_model_path, monkeypatch, mode, **cfg) for mode in ("off", "on"))
    assert off[2] == 0 and on[2] == 2 * on[0][0]["micro_batches"] and on[0][0]["micro_batches"] >= 3
    for ours, ref in zip(on[0], off[0]):
        assert {k: v for k, v in ours.items() if k not in IGNORED} == {k: v for k, v in ref.items() if k not in IGNORED}
    for ours, ref in zip(on[1], off[1]):
        assert ours.keys() == ref.keys() and all(torch.equal(ours[n], ref[n]) for n in ref)
        assert any(ref[n].abs().sum() > 0 for n in ref)


def test_with_the_fused_lora_ops_and_checkpointing_too(tiny_model_path, monkeypatch):
    cfg = dict(fused_lora="on", memory_efficient_ops="on", gradient_checkpointing=True, checkpoint_layer_fraction=0.5,
               temperature=0.7, logprob_chunk=3, micro_batch_tokens=8, learning_rate=1e-2)
    off, on = (_train(tiny_model_path, monkeypatch, mode, **cfg) for mode in ("off", "on"))
    assert off[2] == 0 and on[2] > 0
    for ours, ref in zip(on[0], off[0]):
        assert {k: v for k, v in ours.items() if k not in IGNORED} == {k: v for k, v in ref.items() if k not in IGNORED}
    assert all(torch.equal(a[n], b[n]) for a, b in zip(on[1], off[1]) for n in a)


def test_gspo_takes_the_recomputing_path(tiny_model_path, monkeypatch):
    cfg = dict(loss="gspo", logprob_chunk=2, micro_batch_tokens=8)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(logprob_grad_in_forward="on", **cfg))
    assert not trainer.head_grad_in_forward()
    off, on = (_train(tiny_model_path, monkeypatch, mode, **cfg) for mode in ("off", "on"))
    assert on[2] == off[2] == 0
    assert all(torch.equal(a[n], b[n]) for a, b in zip(on[1], off[1]) for n in a)


def test_the_switch_reads_like_the_others_and_auto_is_on_on_the_cpu(tiny_model_path):
    assert TrainerConfig().logprob_grad_in_forward == "auto"
    assert TrainerConfig(logprob_grad_in_forward=False).logprob_grad_in_forward == "off"
    assert TrainerConfig().enabled("logprob_grad_in_forward", False)
    assert not TrainerConfig().enabled("logprob_grad_in_forward", True)  # measured no faster on the H200
    assert TrainerConfig(logprob_grad_in_forward="on").enabled("logprob_grad_in_forward", True)
    assert not TrainerConfig(logprob_grad_in_forward="off").enabled("logprob_grad_in_forward", False)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig())
    assert trainer.head_grad_in_forward()
    trainer.update_config(logprob_grad_in_forward="off")  # a per-step choice, not baked into the model
    assert not trainer.head_grad_in_forward()


def test_warm_up_runs_the_fused_path(tiny_model_path, monkeypatch):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(warm_up="off", micro_batch_tokens=32))
    calls, inner = [], trainer_module.logprobs_with_head_grad
    monkeypatch.setattr(trainer_module, "logprobs_with_head_grad", lambda *a: calls.append(1) or inner(*a))
    trainer.warm_up()
    assert calls and all(p.grad is None for p in trainer.trainable_parameters)


def test_loss_result_is_unchanged_for_a_plain_call():
    res = policy_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), torch.tensor([1.0, -1.0]),
                      torch.tensor([0.5, 0.5]), torch.tensor([0, 1]), loss="cispo", eps=0.2, eps_high=0.2)
    assert isinstance(res, LossResult) and res.tokens == 2 and res.clipped == 2.0
