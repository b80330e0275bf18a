"""Each objective and aggregation against values worked out by hand on a 4-token batch (no model)."""

import math

import pytest
import torch

from backends.training.advantages import kl_shaping
from backends.training.logprobs import chunked_logprobs, full_logprobs
from backends.training.losses import assign_aggregation_weights, policy_loss
from backends.training.token_rows import TrainingRow

# two rows of two trained tokens: row 0 (A = +1), row 1 (A = -0.5)
LOGP = [-1.0, -0.5, -2.0, -0.2]
OLD = [-1.2, -0.5, -1.0, -0.9]
ADV = [1.0, 1.0, -0.5, -0.5]
ROW = [0, 0, 1, 1]
W = 0.25  # sequence_mean with two single-row trajectories of 2 tokens: 1 / (2 * 2)
R = [math.exp(a - b) for a, b in zip(LOGP, OLD)]  # 1.2214, 1.0, 0.3679, 2.0138


def _run(loss, eps, eps_high, tis_cap=None, weights=None):
    logp = torch.tensor(LOGP, requires_grad=True)
    res = policy_loss(logp, torch.tensor(OLD), torch.tensor(ADV), torch.tensor(weights or [W] * 4),
                      torch.tensor(ROW), loss=loss, eps=eps, eps_high=eps_high, tis_cap=tis_cap)
    res.loss.backward()
    return res, logp.grad.tolist()


def test_cispo_by_hand():
    res, grad = _run("cispo", 0.2, 0.28)
    w_is = [R[0], 1.0, 0.8, 1.28]  # clip(r) to [0.8, 1.28]: token 2 clipped up, token 3 clipped down
    per_token = [-w_is[i] * ADV[i] * LOGP[i] for i in range(4)]  # 1.2214, 0.5, -0.8, -0.128
    assert res.loss.item() == pytest.approx(W * sum(per_token), rel=1e-6)
    assert grad == pytest.approx([-W * w_is[i] * ADV[i] for i in range(4)], rel=1e-6)  # every token keeps a gradient
    assert res.clipped == 2 and res.tokens == 4
    assert res.ratio_min == pytest.approx(R[2], rel=1e-6) and res.ratio_max == pytest.approx(R[3], rel=1e-6)
    assert res.ratio_sum == pytest.approx(sum(R), rel=1e-6)
    assert res.mismatch_k3_sum == pytest.approx(sum(r - 1 - math.log(r) for r in R), rel=1e-5)
    assert res.mismatch_abs_sum == pytest.approx(0.2 + 0 + 1.0 + 0.7, rel=1e-6)


def test_ppo_by_hand():
    res, grad = _run("ppo", 0.2, 0.28)
    # token 0: r=1.22 in range -> -r*A; token 1: r=1 -> -1; token 2: r=0.37, A<0 -> clipped term
    # min(-0.184, 0.8*-0.5=-0.4) = -0.4 active, no gradient; token 3: r=2.01, A<0 -> min(-1.007, -0.64) = unclipped
    per_token = [-R[0] * 1.0, -1.0, 0.4, R[3] * 0.5]
    assert res.loss.item() == pytest.approx(W * sum(per_token), rel=1e-6)
    assert grad == pytest.approx([W * -R[0], W * -1.0, 0.0, W * R[3] * 0.5], rel=1e-6)
    assert res.clipped == 1


def test_gspo_by_hand():
    s0, s1 = math.exp((0.2 + 0.0) / 2), math.exp((-1.0 + 0.7) / 2)  # 1.105, 0.861: geometric-mean ratios
    res, grad = _run("gspo", 0.2, 0.28)  # both inside [0.8, 1.28]
    assert res.loss.item() == pytest.approx(W * (2 * -s0 * 1.0 + 2 * -s1 * -0.5), rel=1e-6)
    assert grad == pytest.approx([W * -s0, W * -s0, W * s1 * 0.5, W * s1 * 0.5], rel=1e-6)
    assert res.clipped == 0
    assert res.ratio_sum == pytest.approx(2 * s0 + 2 * s1, rel=1e-6)
    res, grad = _run("gspo", 0.1, 0.04)  # range [0.9, 1.04]: both rows clipped, no gradient at all
    assert res.loss.item() == pytest.approx(W * (2 * -1.04 + 2 * 0.9 * 0.5), rel=1e-6)
    assert grad == pytest.approx([0.0] * 4, abs=1e-9)
    assert res.clipped == 4


def test_truncated_importance_sampling_by_hand():
    res, grad = _run("cispo", 0.2, 0.28, tis_cap=1.5)
    tis = [min(r, 1.5) for r in R]  # 1.2214, 1, 0.3679, 1.5: trainer-vs-sampler weight, capped
    # old = the trainer's own pre-update logprob, so the objective's ratio is 1 (inside the clip)
    assert res.loss.item() == pytest.approx(W * sum(-tis[i] * ADV[i] * LOGP[i] for i in range(4)), rel=1e-6)
    assert grad == pytest.approx([-W * tis[i] * ADV[i] for i in range(4)], rel=1e-6)
    assert res.tis_weight_sum == pytest.approx(sum(tis), rel=1e-6)
    assert res.clipped == 0 and res.ratio_sum == pytest.approx(4.0)


def _row(trained: int, traj: int) -> TrainingRow:
    return TrainingRow([0] * (trained + 1), [False] + [True] * trained, [0.0] * (trained + 1), trajectory=traj)


def test_aggregation_weights_by_hand():
    rows = [_row(2, 0), _row(3, 0), _row(1, 1)]  # trajectory 0: 5 trained tokens over 2 rows; trajectory 1: 1
    assign_aggregation_weights(rows, "sequence_mean")
    assert [r.weight for r in rows] == pytest.approx([1 / 10, 1 / 10, 1 / 2])
    # each trajectory weighs 1/T in total, whatever its length
    assert 2 * rows[0].weight + 3 * rows[1].weight == pytest.approx(1 * rows[2].weight)
    assign_aggregation_weights(rows, "token_mean")
    assert [r.weight for r in rows] == pytest.approx([1 / 6] * 3)
    assign_aggregation_weights(rows, "dr_grpo", norm=10)
    assert [r.weight for r in rows] == pytest.approx([1 / 20] * 3)
    with pytest.raises(ValueError):
        assign_aggregation_weights(rows, "dr_grpo", norm=None)


def test_token_mean_loss_by_hand():
    res, _ = _run("cispo", 0.2, 0.28, weights=[1 / 4] * 4)
    w_is = [R[0], 1.0, 0.8, 1.28]
    per_token = [-w_is[i] * ADV[i] * LOGP[i] for i in range(4)]
    assert res.loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-6)


def test_kl_shaping_by_hand():
    deltas, mean_k = kl_shaping([torch.tensor([0.1, 0.3]), torch.tensor([-0.1])], coef=0.5)
    assert mean_k == pytest.approx(0.1)
    assert deltas[0].tolist() == pytest.approx([0.0, -0.1])
    assert deltas[1].tolist() == pytest.approx([0.1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_full_values_and_gradients(temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(17, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 17, (13,), generator=g)
    upstream = torch.randn(13, generator=g, dtype=torch.float64)
    lp, ent = chunked_logprobs(hidden, weight, targets, chunk=4, temperature=temperature)
    (lp.double() * upstream).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp_ref, ent_ref = full_logprobs(hidden, weight, targets, temperature=temperature)
    (lp_ref.double() * upstream).sum().backward()
    assert torch.allclose(lp.double(), lp_ref.double(), atol=1e-5)
    assert torch.allclose(ent.double(), ent_ref.double(), atol=1e-5)
    assert torch.allclose(gh, hidden.grad, atol=1e-5) and torch.allclose(gw, weight.grad, atol=1e-5)
