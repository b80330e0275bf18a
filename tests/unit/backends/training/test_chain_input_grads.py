"""q, k and v sum their input gradients in their GEMMs (kernels/chain_input_grads.py): loss and every gradient equal to
the switch off (float32, within 1e-6 of each tensor's scale) with every composition, across micro-batches and steps;
a reader whose output does not reach the loss, a second backward over a retained graph and a pass whose norm backward
never ran leave the gradients exact; two full-width adds per layer gone (counted); the switch acting only with
recompute_norm."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.training.config import TrainerConfig
from backends.training.kernels import chain_input_grads
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import record_gradients, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

# rows of 6 to 10 tokens, two or more packed into each 16-token micro-batch
GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0], prompt=(5, 6, 7, 8, 9))]
CFG = dict(fused_lora="on", memory_efficient_ops="on", recompute_norm="on", fold_lora_b="off", learning_rate=1e-3,
           kl_coef=0.2, micro_batch_tokens=16)
TOLERANCE = 1e-6  # of each tensor's largest entry: the sum's order differs from autograd's, its terms do not


def _count_handovers(monkeypatch) -> list[int]:
    """How many norm backwards took a chained sum."""
    calls, inner = [0], chain_input_grads.InputGradSum.take

    def counted(self, grad):
        calls[0] += self.into() is not None
        return inner(self, grad)

    monkeypatch.setattr(chain_input_grads.InputGradSum, "take", counted)
    return calls


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= TOLERANCE * max(want.abs().max().item(), 1e-30))


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert all(_close(got[k], want[k]) for k in want), [k for k in want if not _close(got[k], want[k])]


def _run(tiny_model_path, **cfg):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg))
    grads = record_gradients(trainer)
    metrics = [trainer.train_step(GROUPS) for _ in range(2)]
    return trainer, metrics, grads


COMPOSITIONS = {  # name: settings on top of CFG, and whether q, k, v chain
    "unfolded": (dict(), True),
    "row-folded": (dict(fold_lora_a="on"), True),
    "low-rank-first": (dict(low_rank_first="on"), True),
    "low-rank-first-row-folded": (dict(low_rank_first="on", fold_lora_a="on"), True),
    "checkpointed-grads-to-autograd": (dict(gradient_checkpointing=True, checkpoint_layer_fraction=0.5,
                                            accumulate_lora_grads="off", cache_lora_casts="off"), True),
    "folded-everywhere": (dict(fold_lora_b="on"), False),  # every reader folded on the output side: none chains
    "group-qkv": (dict(group_qkv="on"), False),  # one reader
    "recompute-norm-off": (dict(recompute_norm="off"), False),  # nothing shared: no chain
}


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_trainer_steps_equal_the_switch_off(tiny_model_path, monkeypatch, composition):
    settings, chains = COMPOSITIONS[composition]
    cfg = dict(CFG, **settings)
    handovers = _count_handovers(monkeypatch)
    off = _run(tiny_model_path, chain_input_grads="off", **cfg)
    assert handovers[0] == 0
    on = _run(tiny_model_path, chain_input_grads="on", **cfg)
    assert (handovers[0] > 0) == chains, handovers
    assert on[1][0]["micro_batches"] >= 2 and on[1][1]["kl_policy_ref"] != 0.0
    for step, (ours, ref) in enumerate(zip(on[1], off[1])):
        for key in ("loss", "grad_norm", "entropy", "kl_policy_ref", "mismatch_kl"):
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (step, key)
    assert len(on[2]) == len(off[2]) == 2
    for got, want in zip(on[2], off[2]):
        _assert_close(got, want)


def _decoder_grads(tiny_model_path, chain: str, settings: dict, run) -> dict:
    """The input's and every trainable parameter's gradient after ``run(decoder, embeds)`` (LoRA B random, so every
    LoRA term of dL/dn is non-zero)."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**CFG, **settings, chain_input_grads=chain))
    decoder = trainer._lm.model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(trainer.model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    embeds = torch.randn(2, 12, decoder.config.hidden_size, generator=g, requires_grad=True)
    run(trainer, decoder, embeds)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"embeds": embeds.grad.clone(), **grads}


@pytest.mark.parametrize("settings", [dict(), dict(fold_lora_a="on"), dict(low_rank_first="on"),
                                      dict(accumulate_lora_grads="off")])
@pytest.mark.parametrize("cut", [("v_proj",), ("q_proj",), ("k_proj", "v_proj"), ("q_proj", "k_proj", "v_proj")])
def test_a_reader_whose_output_does_not_reach_the_loss(tiny_model_path, monkeypatch, settings, cut):
    """The cut readers' outputs are detached in every layer: their ops ran forward and kept the norm's source (counted
    as users) but their backwards never run; the others' sum still reaches the norm."""
    handovers = _count_handovers(monkeypatch)

    def run(trainer, decoder, embeds):
        for layer in decoder.layers:
            for name in cut:
                getattr(layer.self_attn, name).register_forward_hook(lambda m, args, out: out.detach())
        decoder(inputs_embeds=embeds).last_hidden_state.pow(2).sum().backward()

    off = _decoder_grads(tiny_model_path, "off", settings, run)
    on = _decoder_grads(tiny_model_path, "on", settings, run)
    assert (handovers[0] > 0) == (len(cut) < 3)  # a reader left alone still chains (with nothing to add into)
    _assert_close(on, off)


def test_two_backwards_over_a_retained_graph(tiny_model_path, monkeypatch):
    handovers = _count_handovers(monkeypatch)

    def run(trainer, decoder, embeds):
        loss = decoder(inputs_embeds=embeds).last_hidden_state.pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    off = _decoder_grads(tiny_model_path, "off", dict(accumulate_lora_grads="off"), run)
    on = _decoder_grads(tiny_model_path, "on", dict(accumulate_lora_grads="off"), run)
    assert handovers[0] > 0
    _assert_close(on, off)


def test_a_sum_left_by_a_pass_whose_norm_backward_never_ran_is_dropped(tiny_model_path):
    """``autograd.grad`` for one q_proj's LoRA A runs that q's backward (which starts a sum) but not its norm's; the
    next full backward must not add into that sum."""
    def run(trainer, decoder, embeds):
        loss = decoder(inputs_embeds=embeds).last_hidden_state.pow(2).sum()
        lora_a = next(p for n, p in decoder.layers[-1].self_attn.q_proj.named_parameters() if "lora_A" in n)
        torch.autograd.grad(loss, [lora_a], retain_graph=True)
        loss.backward()

    off = _decoder_grads(tiny_model_path, "off", dict(accumulate_lora_grads="off"), run)
    on = _decoder_grads(tiny_model_path, "on", dict(accumulate_lora_grads="off"), run)
    _assert_close(on, off)


def test_a_no_grad_pass_chains_nothing_and_leaves_nothing(tiny_model_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**CFG, chain_input_grads="on"))
    decoder = trainer._lm.model
    embeds = torch.randn(1, 8, decoder.config.hidden_size, requires_grad=True)
    with torch.no_grad():
        ref = decoder(inputs_embeds=embeds).last_hidden_state
    assert torch.equal(decoder(inputs_embeds=embeds).last_hidden_state, ref)


def test_the_switch_acts_only_with_recompute_norm_and_is_baked_in(tiny_model_path):
    assert TrainerConfig().chain_input_grads == "auto"
    auto = TrainerConfig()
    assert not auto.enabled("chain_input_grads", True) and not auto.enabled("chain_input_grads", False)  # opt-in
    assert TrainerConfig(chain_input_grads="on").enabled("chain_input_grads", True)
    assert TrainerConfig(**CFG, chain_input_grads="on").enabled("chain_input_grads", False)
    assert not TrainerConfig(**dict(CFG, recompute_norm="off"), chain_input_grads="on").enabled("chain_input_grads",
                                                                                                 True)
    assert not TrainerConfig(fused_lora="off", chain_input_grads="on").enabled("chain_input_grads", True)
    assert not TrainerConfig(chain_input_grads="off").enabled("chain_input_grads", True)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**CFG, chain_input_grads="on"))
    assert trainer.chain_input_grads and all(m._trajflow_lora_runtime.chain_input_grads for m in trainer.model.modules()
                                             if hasattr(m, "_trajflow_lora_runtime"))
    with pytest.raises(ValueError, match="chain_input_grads"):
        trainer.update_config(chain_input_grads="off")


def _distance(got: list[dict], want: list[dict]) -> list[float]:
    """Each step's gradients' distance from ``want``'s, relative to ``want``'s norm (all LoRA tensors together)."""
    return [(sum((g[k].float() - w[k]).norm() ** 2 for k in w) / sum(w[k].norm() ** 2 for k in w)).sqrt().item()
            for g, w in zip(got, want)]


def test_bf16_steps_chain_and_are_as_close_to_float32_as_the_switch_off(tiny_model_path, monkeypatch):
    """In bf16 the sum's other order rounds otherwise (measured: 1.80e-2 / 1.87e-2 of the float32 steps' gradients on,
    1.81e-2 / 1.86e-2 off): as close to float32 as off, not the same bits."""
    handovers = _count_handovers(monkeypatch)
    exact = _run(tiny_model_path, chain_input_grads="off", **CFG)[2]
    off = _run(tiny_model_path, chain_input_grads="off", dtype="bfloat16", **CFG)[2]
    on = _run(tiny_model_path, chain_input_grads="on", dtype="bfloat16", **CFG)[2]
    assert handovers[0] > 0
    assert all(d_on <= 1.1 * d_off for d_on, d_off in zip(_distance(on, exact), _distance(off, exact)))


def test_a_reader_whose_compute_dtype_is_not_the_norms_does_not_chain(tiny_model_path, monkeypatch):
    """Under autocast a float32 n is read in bf16: the reader's dx is not n's gradient as it is, so nothing chains
    and the gradients are the switch off's, bit for bit."""
    handovers = _count_handovers(monkeypatch)

    def run(trainer, decoder, embeds):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = decoder(inputs_embeds=embeds).last_hidden_state.float().pow(2).sum()
        loss.backward()

    off = _decoder_grads(tiny_model_path, "off", {}, run)
    on = _decoder_grads(tiny_model_path, "on", {}, run)
    assert handovers[0] == 0
    assert all(torch.equal(on[k], off[k]) for k in off)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("settings", [dict(), dict(fold_lora_a="on")])
def test_each_layer_loses_autograds_two_adds_of_input_gradients(tiny_model_path, settings):
    """Counted on the CPU over a decoder's backward: per layer the two full-width adds of q's, k's and v's dL/dn are
    gone, and two products that wrote a fresh dL/dn add into the sum instead (``mm`` -> ``addmm_``)."""
    counts = {}

    def run(trainer, decoder, embeds):
        loss = decoder(inputs_embeds=embeds).last_hidden_state.pow(2).sum()
        with _CountOps() as mode:
            loss.backward()
        counts[trainer.chain_input_grads] = mode.ops
        counts["layers"] = len(decoder.layers)

    _decoder_grads(tiny_model_path, "off", settings, run)
    _decoder_grads(tiny_model_path, "on", settings, run)
    off, on, layers = counts[False], counts[True], counts["layers"]
    assert off["aten.add.Tensor"] - on["aten.add.Tensor"] == 2 * layers
    assert off["aten.mm.default"] - on["aten.mm.default"] == 2 * layers
    assert on["aten.addmm_.default"] - off["aten.addmm_.default"] == 2 * layers


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_recompute_their_forward_and_still_chain_exactly(tiny_model_path, monkeypatch, reentrant):
    """Non-reentrant (the trainer's): the recomputed forward marks a new norm output, whose readers' counts and sum
    no backward reads; the recorded ops chain on the first forward's. Reentrant: the first forward runs without grad
    (nothing marked), the recomputation builds the graph that chains, inside the checkpoint's own backward."""
    handovers = _count_handovers(monkeypatch)

    def run(trainer, decoder, embeds):
        trainer._lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        decoder.train()
        decoder(inputs_embeds=embeds).last_hidden_state.pow(2).sum().backward()

    off = _decoder_grads(tiny_model_path, "off", dict(accumulate_lora_grads="off"), run)
    on = _decoder_grads(tiny_model_path, "on", dict(accumulate_lora_grads="off"), run)
    assert handovers[0] > 0
    _assert_close(on, off)


def test_a_reader_on_peft_path_returns_its_gradient_which_the_norm_adds_to_the_sum(tiny_model_path, monkeypatch):
    """q_proj's adapter disabled: peft computes q (its base product still reads n) and autograd hands its dL/dn to the
    norm, which adds it to k's and v's chained sum."""
    handovers = _count_handovers(monkeypatch)

    def run(trainer, decoder, embeds):
        for layer in decoder.layers:
            layer.self_attn.q_proj.enable_adapters(False)
        decoder(inputs_embeds=embeds).last_hidden_state.pow(2).sum().backward()

    off = _decoder_grads(tiny_model_path, "off", {}, run)
    on = _decoder_grads(tiny_model_path, "on", {}, run)
    assert handovers[0] > 0
    _assert_close(on, off)
