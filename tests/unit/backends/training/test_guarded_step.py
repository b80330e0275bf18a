"""The fused optimizer's step queued before the step's one read, skipped on the device where the step is not finite
(``backends/training/guarded_step.py``). CPU torch has a fused AdamW too: the trainers here get one."""

import pytest
import torch

from backends.training import trainer as trainer_module
from backends.training.config import TrainerConfig
from backends.training.guarded_step import guards, queue_guarded_step
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import synthetic_group
from tests.unit.backends.training.test_host_syncs import GROUPS, SyncCounter

pytestmark = pytest.mark.usefixtures("single_thread")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _step(params, fused, loss, norm, guarded):
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=fused)
    for p in params:
        p.grad = torch.ones_like(p)
    if guarded:
        queue_guarded_step(opt, [torch.tensor(1.0), torch.tensor(loss)], torch.tensor(norm))
    else:
        opt.step()
    assert not hasattr(opt, "found_inf")
    return opt


def test_only_a_fused_optimizer_is_guarded():
    assert guards(torch.optim.AdamW(_params(), fused=True))
    assert not guards(torch.optim.AdamW(_params(), foreach=True)) and not guards(torch.optim.AdamW(_params()))


def test_a_finite_step_is_the_plain_step():
    plain, guarded = _params(), _params()
    a = _step(plain, True, 2.0, 1.0, guarded=False)
    b = _step(guarded, True, 2.0, 1.0, guarded=True)
    assert all(torch.equal(p, q) for p, q in zip(plain, guarded))
    assert all(torch.equal(a.state[p]["exp_avg"], b.state[q]["exp_avg"]) for p, q in zip(plain, guarded))
    assert not torch.equal(plain[0], _params()[0])  # it moved


@pytest.mark.parametrize("loss,norm", [(float("nan"), 1.0), (float("inf"), 1.0), (1.0, float("nan")),
                                       (1.0, float("inf"))])
def test_a_non_finite_loss_or_norm_leaves_parameters_moments_and_step_counts(loss, norm):
    params = _params()
    opt = _step(params, True, 1.0, 1.0, guarded=True)  # one real step first: moments and counts to keep
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    queue_guarded_step(opt, [torch.tensor(loss)], torch.tensor(norm))
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    for p in params:
        assert all(torch.equal(v, state[id(p)][k]) for k, v in opt.state[p].items()), p.shape
    assert float(opt.state[params[0]]["step"]) == 1.0


def _fused_trainer(path, **cfg):
    """A CPU trainer with a fused AdamW, as CUDA's (the same hyperparameters, the same schedule)."""
    trainer = GRPOTrainer(str(path), TrainerConfig(micro_batch_tokens=8, **cfg))
    c = trainer.config
    trainer.optimizer = torch.optim.AdamW(trainer._params, lr=c.learning_rate, betas=tuple(c.adam_betas),
                                          eps=c.adam_eps, weight_decay=c.weight_decay, fused=True)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer,
                                                          lambda taken: trainer_module.lr_factor(c, taken))
    return trainer


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def test_trainer_steps_queued_equal_the_steps_read_first(tiny_model_path, monkeypatch):
    queued = _fused_trainer(tiny_model_path, learning_rate=1e-2, warmup_steps=1)
    metrics_q = [queued.train_step(GROUPS) for _ in range(2)]
    monkeypatch.setattr(trainer_module, "guards", lambda optimizer: False)
    read_first = _fused_trainer(tiny_model_path, learning_rate=1e-2, warmup_steps=1)
    metrics_r = [read_first.train_step(GROUPS) for _ in range(2)]
    a, b = _lora(queued), _lora(read_first)
    assert all(torch.equal(a[n], b[n]) for n in a)
    timing = ("step_time_s", "tokens_per_s", "peak_memory_gib")
    for mq, mr in zip(metrics_q, metrics_r):
        assert {k: v for k, v in mq.items() if k not in timing} == {k: v for k, v in mr.items() if k not in timing}


def test_a_non_finite_trainer_step_raises_and_changes_nothing(tiny_model_path):
    trainer = _fused_trainer(tiny_model_path, learning_rate=1e-2)
    trainer.train_step(GROUPS)
    lora_b = next(p for n, p in trainer.model.named_parameters() if "down_proj.lora_B" in n)
    kept = lora_b.detach().clone()
    with torch.no_grad():
        lora_b.fill_(float("nan"))
    before = _lora(trainer)
    steps = [float(s["step"]) for s in trainer.optimizer.state.values()]
    with pytest.raises(FloatingPointError, match=r"non-finite loss .*scenario nan-step\), trajectory"):
        trainer.train_step([synthetic_group([0.0, 1.0], scenario_id="nan-step")])
    after = _lora(trainer)
    assert all(torch.equal(before[n], after[n]) or torch.isnan(before[n]).all() and torch.isnan(after[n]).all()
               for n in before)
    assert [float(s["step"]) for s in trainer.optimizer.state.values()] == steps and trainer.step == 1
    assert all(p.grad is None for p in trainer._params)
    with torch.no_grad():
        lora_b.copy_(kept)
    assert trainer.train_step(GROUPS)["step"] == 2.0


def test_the_queued_step_adds_no_read_of_the_device(tiny_model_path):
    trainer = _fused_trainer(tiny_model_path)
    trainer.train_step(GROUPS)
    with SyncCounter() as syncs:
        trainer.train_step(GROUPS)
    assert dict(syncs.counts) == {"tolist": 1}  # the metrics and the gradient norm; the fused step reads nothing
