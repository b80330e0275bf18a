"""GRPOTrainer on the tiny model: exact logprob alignment, packing, checkpoints and bit-exact resume."""

import json
import math

import pytest
import torch

from agents.trajectory import Trajectory, TrajectoryGroup
from backends.modeling.host_memory import release_freed_memory
from backends.training.attention_choice import AttentionChoice
from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer, lr_factor
from tests.fixtures_trainer import (
    assert_same_adam_updates,
    assert_same_gradients,
    record_gradients,
    synthetic_group,
    synthetic_turn,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _trainer(path, **cfg) -> GRPOTrainer:
    return GRPOTrainer(str(path), TrainerConfig(**cfg))


def _lora_state(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def _tool_group(tool_conversation):
    traj = tool_conversation["trajectory"]
    worse = Trajectory(messages_and_choices=list(traj.messages_and_choices)[:5], reward=0.0)  # stopped after turn 2
    return TrajectoryGroup([traj, worse], scenario_id="paris")


def test_trainer_logprobs_match_the_sampler_token_for_token(tiny_model_path, tool_conversation):
    trainer = _trainer(tiny_model_path)
    assert trainer.packed and trainer.patched_ops == {}
    t1, t2, t3 = tool_conversation["turns"]
    p1 = tool_conversation["prompts"][0]
    # a fresh adapter is a no-op (B = 0): the trainer must reproduce generate()'s logprobs exactly
    assert trainer.sequence_logprobs(p1, t1.token_ids) == pytest.approx(t1.logprobs, abs=1e-4)
    m = trainer.train_step([_tool_group(tool_conversation)])
    n_trained = 2 * (len(t1.token_ids) + len(t2.token_ids)) + len(t3.token_ids)
    assert m["no_trainable_rows"] == 0 and m["step"] == 1 and trainer.step == 1
    assert m["rows"] == 3 and m["trained_tokens"] == n_trained and m["trajectories"] == 2
    assert m["mismatch_abs_diff"] < 1e-4 and abs(m["mismatch_kl"]) < 1e-6
    assert m["ratio_min"] == pytest.approx(1.0, abs=1e-3) and m["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert m["grad_norm"] > 0 and math.isfinite(m["loss"]) and m["entropy"] > 0
    assert m["learning_rate"] == pytest.approx(1e-5) and m["tokens_per_s"] > 0 and m["peak_memory_gib"] > 0
    # after one step the policy has moved away from the sampler
    assert trainer.sequence_logprobs(p1, t1.token_ids) != pytest.approx(t1.logprobs, abs=1e-7)


def test_packed_micro_batches_and_checkpointing_give_the_same_step(tiny_model_path, tool_conversation):
    groups = [_tool_group(tool_conversation), synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
    results = {}
    for name, cfg in {
        "packed": dict(micro_batch_tokens=4096),
        "one_row_each": dict(micro_batch_tokens=2),
        "checkpointed": dict(micro_batch_tokens=64, gradient_checkpointing=True, checkpoint_layer_fraction=0.5),
        "lean_ops": dict(micro_batch_tokens=4096, memory_efficient_ops=True),
    }.items():
        trainer = _trainer(tiny_model_path, learning_rate=1e-3, **cfg)
        grads = record_gradients(trainer)
        results[name] = (trainer.train_step(groups), _lora_state(trainer), grads)
        if name == "lean_ops":
            assert trainer.patched_ops == {"rms_norm": 5, "swiglu": 2}  # 2 layers x 2 norms + final norm
    ref_m, ref_w, ref_g = results["one_row_each"]
    assert ref_m["micro_batches"] == ref_m["rows"] == 8
    for name in ("packed", "checkpointed", "lean_ops"):
        m, w, g = results[name]
        assert m["micro_batches"] < ref_m["micro_batches"]
        for key in ("loss", "grad_norm", "entropy", "trained_tokens", "mismatch_kl"):
            assert m[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-7), (name, key)
        assert_same_gradients(g, ref_g, name)
        assert_same_adam_updates(w, ref_w, 1e-3, 1, name)


def test_cpu_default_micro_batches_are_small_and_give_the_same_step(tiny_model_path):
    """On the CPU an unset micro_batch_tokens packs at most 512 tokens per forward (activations live in host memory),
    the freed ones handed back to the OS between micro-batches; the update is the one-micro-batch update."""
    assert TrainerConfig().micro_batch_budget(on_cuda=False) == 512
    assert TrainerConfig().micro_batch_budget(on_cuda=True) == 8192
    assert TrainerConfig(micro_batch_tokens=100).micro_batch_budget(on_cuda=False) == 100
    assert release_freed_memory()  # glibc's malloc_trim is found here (Linux): the CPU trainer really trims
    prompt = tuple(range(5, 205))  # three rows of ~205 tokens: two micro-batches under 512, one under 8192
    groups = [synthetic_group([0.0, 1.0, 0.25], prompt=prompt, completion_len=4)]
    results = {}
    for name, cfg in {"default": {}, "one_micro_batch": dict(micro_batch_tokens=8192)}.items():
        trainer = _trainer(tiny_model_path, learning_rate=1e-3, **cfg)
        grads = record_gradients(trainer)
        results[name] = (trainer.train_step(groups), _lora_state(trainer), grads)
    (m, w, g), (ref_m, ref_w, ref_g) = results["default"], results["one_micro_batch"]
    assert (m["micro_batches"], ref_m["micro_batches"]) == (2, 1)
    assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-5)
    assert_same_gradients(g, ref_g, "cpu default")
    assert_same_adam_updates(w, ref_w, 1e-3, 1, "cpu default")


def test_memory_efficient_ops_match_autograd():
    from backends.training.kernels.lean_ops import rms_norm, silu_mul

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    up = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    upstream = torch.randn(3, 5, 16, generator=g)

    def stock_norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    for ours, stock, inputs in ((lambda: rms_norm(x, w, 1e-6), lambda: stock_norm(x, w), (x, w)),
                                (lambda: silu_mul(x, up), lambda: torch.nn.functional.silu(x) * up, (x, up))):
        a = ours()
        grads_a = torch.autograd.grad((a * upstream).sum(), inputs)
        b = stock()
        grads_b = torch.autograd.grad((b * upstream).sum(), inputs)
        assert torch.equal(a, b)
        for ga, gb in zip(grads_a, grads_b):
            assert torch.allclose(ga, gb, atol=1e-5)


def test_nothing_trainable_takes_no_step(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    before = _lora_state(trainer)
    errored = synthetic_group([0.0, 1.0])
    for t in errored.trajectories:
        t.error = "sandbox timed out"
    m = trainer.train_step([synthetic_group([1.0, 1.0, 1.0]), errored])
    assert m["no_trainable_rows"] == 1 and m["skipped_groups"] == 2 and m["errored_trajectories"] == 2
    assert trainer.step == 0
    assert all(torch.equal(before[n], p) for n, p in _lora_state(trainer).items())
    bad = TrajectoryGroup([Trajectory(messages_and_choices=[synthetic_turn([1, 2], [10**6])], reward=1.0),
                           Trajectory(messages_and_choices=[synthetic_turn([1, 2], [3])], reward=0.0)],
                          scenario_id="oov")
    with pytest.raises(ValueError, match=r"scenario oov\), trajectory 0.*outside the model's vocabulary"):
        trainer.train_step([bad])


def test_non_finite_loss_is_an_error_and_no_step(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "down_proj.lora_B" in n).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"non-finite loss .*scenario nan-step\), trajectory 0"):
        trainer.train_step([synthetic_group([0.0, 1.0], scenario_id="nan-step")])
    assert trainer.step == 0


def test_losses_and_kl_shaping_run(tiny_model_path):
    groups = [synthetic_group([0.0, 1.0, 0.5, 0.2]), synthetic_group([3.0, 1.0])]
    for loss in ("ppo", "gspo"):
        trainer = _trainer(tiny_model_path, loss=loss, kl_coef=0.5, tis_cap=2.0, aggregation="token_mean",
                           learning_rate=1e-2)
        first = trainer.train_step(groups)
        second = trainer.train_step(groups)
        assert first["kl_policy_ref"] == 0.0  # fresh adapter: policy == reference
        assert second["kl_policy_ref"] != 0.0
        for m in (first, second):
            assert all(math.isfinite(v) for v in m.values()), m
        assert second["tis_weight_mean"] > 0


def test_update_config_between_steps(tiny_model_path):
    trainer = _trainer(tiny_model_path, warmup_steps=2)
    assert trainer.train_step([synthetic_group([0.0, 1.0])])["learning_rate"] == pytest.approx(0.5e-5)
    trainer.update_config(learning_rate=4e-5, loss="ppo", kl_coef=0.1)
    m = trainer.train_step([synthetic_group([0.0, 1.0])])
    assert m["learning_rate"] == pytest.approx(4e-5) and "kl_policy_ref" in m and trainer.config.loss == "ppo"
    with pytest.raises(ValueError, match="lora_rank: 8 -> 4"):
        trainer.update_config(lora_rank=4)
    with pytest.raises(ValueError, match="seed: 0 -> 1; fused_lora: 'auto' -> 'off'"):
        trainer.update_config(seed=1, fused_lora="off")
    with pytest.raises(ValueError):
        trainer.update_config(learning_rate=-1.0)
    assert trainer.config.learning_rate == 4e-5


def test_fields_that_may_not_change_nest():
    shape, identity, construction = (TrainerConfig.ADAPTER_SHAPE_FIELDS, TrainerConfig.IDENTITY_FIELDS,
                                     TrainerConfig.CONSTRUCTION_FIELDS)
    assert set(shape) < set(identity) < set(construction) <= set(TrainerConfig.model_fields)
    assert set(identity) - set(shape) == {"lora_dropout", "seed"}


def test_backend_choice():
    from backends.training.unsloth_loader import choose_backend

    assert choose_backend("auto", "cpu") == "peft" and choose_backend("peft", "cuda") == "peft"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_backend("unsloth", "cpu")


def test_lr_schedules():
    cos = TrainerConfig(lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [round(lr_factor(cos, s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    lin = TrainerConfig(lr_schedule="linear", total_steps=4)
    assert [lr_factor(lin, s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="needs total_steps"):
        TrainerConfig(lr_schedule="cosine")


def _resume_groups(step: int):
    return [synthetic_group([0.0, 1.0 + step, 0.5], scenario_id=f"a{step}"),
            synthetic_group([float(step), 2.0, 1.0, 0.0], completion_len=2, scenario_id=f"b{step}")]


RESUME_CFG = dict(learning_rate=5e-3, lora_dropout=0.1, warmup_steps=1, lr_schedule="cosine", total_steps=4,
                  kl_coef=0.1, micro_batch_tokens=24, seed=3)


def test_resume_is_bit_exact(tiny_model_path, tmp_path):
    straight = _trainer(tiny_model_path, **RESUME_CFG)
    for k in range(3):
        straight.train_step(_resume_groups(k))
    straight.save_checkpoint(tmp_path / "straight")

    first = _trainer(tiny_model_path, **RESUME_CFG)
    first.train_step(_resume_groups(0))
    first.save_checkpoint(tmp_path / "after1")
    del first
    resumed = _trainer(tiny_model_path, **RESUME_CFG)
    resumed.load_checkpoint(tmp_path / "after1")
    assert resumed.step == 1
    for k in (1, 2):
        resumed.train_step(_resume_groups(k))
    resumed.save_checkpoint(tmp_path / "resumed")

    a = (tmp_path / "straight" / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (tmp_path / "resumed" / "adapter" / "adapter_model.safetensors").read_bytes()
    fresh = _trainer(tiny_model_path, **RESUME_CFG)
    fresh.save_checkpoint(tmp_path / "fresh")
    assert a == b
    assert a != (tmp_path / "fresh" / "adapter" / "adapter_model.safetensors").read_bytes()
    meta = json.loads((tmp_path / "resumed" / "trainer" / "trainer.json").read_text())
    assert meta["step"] == 3 and meta["config"]["lora_dropout"] == 0.1
    history = json.loads((tmp_path / "resumed" / "trainer" / "metrics.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left
    # resumed under a new learning rate, the new rate (on the same schedule position) is the one used
    retuned = _trainer(tiny_model_path, **{**RESUME_CFG, "learning_rate": 3 * RESUME_CFG["learning_rate"]})
    retuned.load_checkpoint(tmp_path / "after1")
    assert retuned.train_step(_resume_groups(1))["learning_rate"] == pytest.approx(
        3 * resumed.metrics_history[1]["learning_rate"])


def _checkpoint_form(path) -> tuple:
    """What a checkpoint holds, up to its values: the adapter's tensors and config, the optimizer state's layout."""
    from backends.training.checkpoint import read_checkpoint

    weights, state, _, _ = read_checkpoint(path)
    adapter = {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
    slots = {i: {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in state["optimizer"]["state"].items()}
    config = json.loads((path / "adapter" / "adapter_config.json").read_text())
    return adapter, slots, [g["params"] for g in state["optimizer"]["param_groups"]], config


SWITCHED = {"off": dict(fold_lora_b="off"), "fold": dict(fold_lora_b="on"), "fp8": dict(fp8_base="on"),
            "qkv": dict(group_qkv="on"), "fold-a": dict(fold_lora_a="on")}


@pytest.mark.parametrize("saved,resumed", [("fold", "off"), ("off", "fold"), ("fp8", "off"), ("off", "fp8"),
                                           ("qkv", "off"), ("off", "qkv"), ("fold-a", "off"), ("off", "fold-a")])
def test_a_checkpoint_resumes_with_fold_fp8_or_qkv_switched(tiny_model_path, tmp_path, saved, resumed):
    """'auto' differs between CPU and CUDA machines, so a run saved with fold_lora_b, fold_lora_a, fp8_base or
    group_qkv on resumes with it off and the other way round: the checkpoint is the same in form, and the resumed
    step is the one a trainer with the resumed settings takes from the same state (fp8 moves it by its rounding
    only)."""
    cfg = dict(RESUME_CFG, fused_lora="on", memory_efficient_ops="on", fused_rope="on")
    for mode in {saved, "off"}:
        trainer = _trainer(tiny_model_path, **cfg, **SWITCHED[mode])
        trainer.train_step(_resume_groups(0))
        trainer.save_checkpoint(tmp_path / mode)
    assert _checkpoint_form(tmp_path / saved) == _checkpoint_form(tmp_path / "off")
    steps = {}
    for mode in {resumed, "off"}:
        trainer = _trainer(tiny_model_path, **cfg, **SWITCHED[mode])
        trainer.load_checkpoint(tmp_path / saved)
        steps[mode] = trainer.train_step(_resume_groups(1)), _lora_state(trainer)
    (metrics, weights), (ref_metrics, ref_weights) = steps[resumed], steps["off"]
    tol = 0.02 if "fp8" in (saved, resumed) else 1e-5
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=tol, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=tol)
    # an Adam step moves each weight by up to ~lr whatever its gradient: compare the moves, bounded by lr
    assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) <= (
        2.5 * cfg["learning_rate"] if "fp8" in (saved, resumed) else 1e-6)


def test_checkpoint_is_a_peft_adapter(tiny_model_path, tmp_path):
    from peft import PeftModel

    from backends.modeling.loading import load_model

    trainer = _trainer(tiny_model_path, learning_rate=1e-2)
    trainer.train_step(_resume_groups(0))
    trainer.save_checkpoint(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    base, _, _ = load_model(str(tiny_model_path))
    served = PeftModel.from_pretrained(base, str(tmp_path / "ckpt" / "adapter")).eval()
    prompt, completion = [5, 6, 7, 8], [10, 11, 12]
    with torch.no_grad():
        logits = served(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    assert trainer.sequence_logprobs(prompt, completion) == pytest.approx(lp.tolist(), abs=1e-5)

    other = _trainer(tiny_model_path, lora_rank=4)
    with pytest.raises(ValueError, match="lora_rank: checkpoint 8 vs now 4"):
        other.load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "trainer" / "state.pt").unlink()
    with pytest.raises(FileNotFoundError, match="missing trainer/state.pt"):
        trainer.load_checkpoint(tmp_path / "ckpt")


def test_greedy_continuation_is_the_argmax_of_full_forwards_and_scored_like_sequence_logprobs(tiny_model_path,
                                                                                                random_adapter):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from backends.modeling.logits import logits_fp32
    from backends.training.packing import make_micro_batch
    from backends.training.token_rows import TrainingRow

    for cfg in (dict(), dict(fused_lora="on", memory_efficient_ops="on")):
        trainer = _trainer(tiny_model_path, **cfg)
        set_peft_model_state_dict(trainer.model, load_file(random_adapter[0] / "adapter_model.safetensors"))
        prompt = [5, 17, 42, 7, 99, 3]
        tokens, logprobs = trainer.greedy_continuation(prompt, 12)
        ids = list(prompt)  # reference: the whole sequence through the training forward, token by token
        with torch.no_grad():
            for _ in range(12):
                mb = make_micro_batch([TrainingRow(ids, [False] * len(ids), [0.0] * len(ids), source="ref")], "cpu")
                ids.append(int(logits_fp32(trainer._hidden(mb)[-1:], trainer._lm.lm_head.weight).argmax(-1)))
        assert tokens == ids[len(prompt):] and len(set(tokens)) > 1, cfg
        assert logprobs == trainer.sequence_logprobs(prompt, tokens)
        assert trainer.model.training  # left as it was
    for bad_prompt, bad_n in (([], 4), ([5, 6], 0)):
        with pytest.raises(ValueError, match="non-empty prompt and max_tokens >= 1"):
            trainer.greedy_continuation(bad_prompt, bad_n)


def test_packed_attention_runs_the_chosen_sdpa_kernels(tiny_model_path, tool_conversation):
    """The backends a packed forward carries reach the rows' SDPA calls: only-efficient has no CPU kernel and fails,
    math-only gives the default kernel's logprobs, and no choice is PyTorch's own (CPU trainers pass none)."""
    from torch.nn.attention import SDPBackend

    from backends.training import packed_attention

    trainer = _trainer(tiny_model_path)
    assert trainer.attention == AttentionChoice.fixed("rows")
    t1, p1 = tool_conversation["turns"][0], tool_conversation["prompts"][0]
    default = trainer.sequence_logprobs(p1, t1.token_ids)
    trainer.attention = AttentionChoice.fixed("rows", [SDPBackend.MATH])
    assert trainer.sequence_logprobs(p1, t1.token_ids) == pytest.approx(default, abs=1e-5)
    trainer.attention = AttentionChoice.fixed("rows", [SDPBackend.EFFICIENT_ATTENTION])
    with pytest.raises(RuntimeError, match="No viable backend|No available kernel"):
        trainer.sequence_logprobs(p1, t1.token_ids)
    assert packed_attention.sdpa_backends("sdpa-default") is None
    assert packed_attention.sdpa_backends("flash")[0] == SDPBackend.FLASH_ATTENTION


@pytest.mark.parametrize("attention", [{}, {"attention_kernel": "cudnn", "attention_bucket": 16}],
                         ids=["default", "cudnn-buckets"])
def test_warm_up_changes_nothing_a_step_depends_on(tiny_model_path, monkeypatch, attention):
    """warm_up runs forward + backward but leaves the adapter, optimizer, step count, gradients and RNG alone:
    the step after it is bit-identical to a step without it. With padded rows ('cudnn') it also
    runs every padded length up to the micro-batch budget (here 16, 32, 48, 64), so no step meets a new one."""
    groups = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
    lengths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: lengths.append(q.shape[-2]) or sdpa(q, *a, **kw))
    results = []
    for warm in (False, True):
        trainer = _trainer(tiny_model_path, learning_rate=1e-3, micro_batch_tokens=64, **attention)
        if warm:
            before = _lora_state(trainer)
            rng = torch.get_rng_state()
            lengths.clear()
            assert trainer.warm_up() > 0
            assert torch.equal(torch.get_rng_state(), rng) and trainer.step == 0
            assert all(p.grad is None for p in trainer.model.parameters())
            assert all(torch.equal(before[n], w) for n, w in _lora_state(trainer).items())
            assert not trainer.optimizer.state
            warmed = set(lengths)
        results.append((trainer.train_step(groups), _lora_state(trainer)))
    (m0, w0), (m1, w1) = results
    assert m0["loss"] == m1["loss"] and m0["grad_norm"] == m1["grad_norm"]
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    runs = trainer.warm_up_runs
    if attention:
        assert warmed == {16, 32, 48, 64} and runs["bucket_lengths"] == 4 and runs["bucket"] == 16
        # the two generic micro-batches, then one attention call per padded length, not whole-model micro-batches
        assert runs["micro_batches"] == 2 and runs["tokens"] == 64 + 32 and runs["from_length"] == 16
    else:
        assert runs == {"micro_batches": 2, "tokens": 64 + 32, "bucket": 1, "bucket_lengths": 0}
    assert trainer.warm_up_s == 0.0  # 'auto' warms up on CUDA only
    assert _trainer(tiny_model_path, warm_up="on", micro_batch_tokens=64).warm_up_s > 0
