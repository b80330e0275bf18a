"""The fused ops keep a norm's inputs instead of its output (kernels/recompute_norm.py): loss, gradients and weights
bit-identical to the switch off, in float32 and bf16, with every composition; fewer saved bytes by exactly the norm
outputs; nothing trusted once the output was written; the switch acting only with the ops it depends on."""

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels import recompute_norm
from backends.training.trainer import GRPOTrainer
from benchmarks.activation_memory import saved_activation_bytes
from tests.fixtures_trainer import record_gradients, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

# rows of 6 to 10 tokens, two or more packed into each 16-token micro-batch
GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0], prompt=(5, 6, 7, 8, 9))]
CFG = dict(fused_lora="on", memory_efficient_ops="on", learning_rate=1e-3, kl_coef=0.2, micro_batch_tokens=16)


def _count_restores(monkeypatch) -> list[int]:
    """How many backward passes recomputed a norm's output (``recompute_norm.normalized`` called by ``restore``; the
    norm's own forward calls its import in lean_ops)."""
    calls, inner = [0], recompute_norm.normalized

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    monkeypatch.setattr(recompute_norm, "normalized", counted)
    return calls


def _run(tiny_model_path, **cfg):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg))
    grads = record_gradients(trainer)
    metrics = [trainer.train_step(GROUPS) for _ in range(2)]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return trainer, metrics, weights, grads


COMPOSITIONS = {  # name: settings on top of CFG
    "unfolded": dict(fold_lora_b="off"),
    "folded-everywhere": dict(fold_lora_b="on"),
    "group-qkv": dict(group_qkv="on", fold_lora_b="on"),
    "row-folded": dict(fold_lora_a="on"),
    "checkpointed-grads-to-autograd": dict(gradient_checkpointing=True, checkpoint_layer_fraction=0.5,
                                           accumulate_lora_grads="off", cache_lora_casts="off"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_trainer_steps_are_identical_to_the_switch_off(tiny_model_path, monkeypatch, composition, dtype):
    cfg = dict(CFG, dtype=dtype, **COMPOSITIONS[composition])
    restores = _count_restores(monkeypatch)
    off = _run(tiny_model_path, recompute_norm="off", **cfg)
    assert restores[0] == 0
    on = _run(tiny_model_path, recompute_norm="on", **cfg)
    assert on[0].recompute_norm and not off[0].recompute_norm
    assert restores[0] > 0 and on[1][0]["micro_batches"] >= 2 and on[1][1]["kl_policy_ref"] != 0.0
    for step, (ours, ref) in enumerate(zip(on[1], off[1])):
        for key in ("loss", "grad_norm", "entropy", "kl_policy_ref", "mismatch_kl"):
            assert ours[key] == ref[key], (step, key)
    assert len(on[3]) == len(off[3]) == 2
    for got, want in zip(on[3], off[3]):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert all(torch.equal(on[2][k], off[2][k]) for k in off[2])
    prompt, completion = [5, 6, 7, 8], [10, 11, 12]
    assert on[0].sequence_logprobs(prompt, completion) == off[0].sequence_logprobs(prompt, completion)


@pytest.mark.parametrize("settings,norm_outputs_per_layer", [
    (dict(fold_lora_b="off"), 2),  # q, k, v share the input norm's output; the MLP reads the other one
    (dict(fold_lora_b="on"), 4),  # q, k, v each folded alone kept their own [n | z]; the MLP's gate and up one
    (dict(group_qkv="on"), 2),  # the grouped q, k, v op kept one [n | z]
    (dict(fold_lora_a="on"), 2),  # row-folded k, v and down keep what the unfolded ops keep
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_drop_by_exactly_the_norm_outputs(tiny_model_path, settings, norm_outputs_per_layer, dtype):
    tokens, stored = 24, {}
    for mode in ("off", "on"):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**CFG, **settings, recompute_norm=mode,
                                                                  dtype=str(dtype).removeprefix("torch.")))
        decoder = trainer._lm.model
        embeds = torch.randn(1, tokens, decoder.config.hidden_size, dtype=dtype, requires_grad=True)
        stored[mode] = saved_activation_bytes(lambda: decoder(inputs_embeds=embeds).last_hidden_state,
                                              trainer.model.parameters())
    layers, hidden = decoder.config.num_hidden_layers, decoder.config.hidden_size
    element = torch.finfo(dtype).bits // 8
    assert stored["off"] - stored["on"] == layers * norm_outputs_per_layer * tokens * hidden * element, stored


def test_each_norm_output_is_recomputed_once_whatever_reads_it(tiny_model_path, monkeypatch):
    """q, k and v as three ops (each kept the input norm's source), folded one by one, or as one grouped op: one
    recomputation per marked norm in every layout, and nothing left held once the backward is done."""
    restores, sources = _count_restores(monkeypatch), []
    inner = recompute_norm.mark

    def marked(n, source):
        sources.append(source)
        return inner(n, source)

    import backends.training.kernels.lean_ops as lean_ops

    monkeypatch.setattr(lean_ops, "mark", marked)
    counts = {}
    for name, settings in {"unfolded": dict(fold_lora_b="off"), "folded": dict(fold_lora_b="on"),
                           "grouped": dict(group_qkv="on")}.items():
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**CFG, **settings, recompute_norm="on"))
        decoder = trainer._lm.model
        embeds = torch.randn(1, 12, decoder.config.hidden_size, requires_grad=True)
        restores[0], sources[:] = 0, []
        out = decoder(inputs_embeds=embeds).last_hidden_state
        read = [s for s in sources if s.shared.users]  # the final norm feeds the head, no fused op
        out.sum().backward()
        counts[name] = (restores[0], len(read))  # the input requires grad: every layer's norms are marked, 0's too
        assert all(s.shared.n is None and s.shared.users == 0 for s in read), name
    layers = decoder.config.num_hidden_layers
    assert counts["unfolded"] == counts["folded"] == counts["grouped"] == (2 * layers, 2 * layers), counts


def test_an_output_written_since_the_norm_is_not_trusted():
    x, w = torch.randn(3, 8, requires_grad=True), torch.ones(8)
    n = (x * 2).detach().requires_grad_()
    recompute_norm.mark(n, recompute_norm.NormSource(x, w, torch.ones(3, 1), False))
    assert recompute_norm.source_of(n) is not None
    with torch.no_grad():
        n.mul_(2)
    assert recompute_norm.source_of(n) is None
    plain = torch.randn(3, 8)
    recompute_norm.mark(plain, recompute_norm.NormSource(x, w, torch.ones(3, 1), False))  # no gradient: not marked
    assert recompute_norm.source_of(plain) is None


def test_the_switch_acts_only_with_its_ops_and_is_baked_in(tiny_model_path):
    assert TrainerConfig(recompute_norm=True).recompute_norm == "on" and TrainerConfig().recompute_norm == "auto"
    assert TrainerConfig().enabled("recompute_norm", True) and not TrainerConfig().enabled("recompute_norm", False)
    assert TrainerConfig(**CFG, recompute_norm="on").enabled("recompute_norm", False)
    assert not TrainerConfig(fused_lora="off", recompute_norm="on").enabled("recompute_norm", True)
    assert not TrainerConfig(memory_efficient_ops="off", recompute_norm="on").enabled("recompute_norm", True)
    assert not TrainerConfig(recompute_norm="off").enabled("recompute_norm", True)
    # fp8_base's steps with it on were not the same bits as off on an H200 (the CPU's were): never together
    assert not TrainerConfig(fp8_base="on", recompute_norm="on").enabled("recompute_norm", True)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**CFG, recompute_norm="on"))
    with pytest.raises(ValueError, match="recompute_norm"):
        trainer.update_config(recompute_norm="off")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on CUDA")
@pytest.mark.parametrize("tokens", [1, 777, 16384])
def test_the_compiled_recompute_gives_the_compiled_forwards_bits(tokens):
    """On CUDA the norm's forward is one compiled kernel (rstd, then n by it) and the recompute another (n from the
    saved rstd): their n must be the same bits, or the gradients would drift from the switch off's."""
    from backends.training.kernels.lean_ops import _norm
    from backends.training.kernels.torch_compile import failure, kernel

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(1, tokens, 1536, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    w = torch.randn(1536, device="cuda", dtype=torch.bfloat16, generator=g)
    n, rstd = kernel(_norm, True)(x, w, 1e-6)
    again = kernel(recompute_norm.normalized, True)(x, w, rstd)
    assert failure() is None and torch.equal(again, n)

