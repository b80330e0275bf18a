"""Trainer test helpers: real sampled turns from the tiny model (chat template + generate + raw logits).

``sample_turn`` plays the inference server: it renders nothing itself, it takes prompt token ids,
samples with ``model.generate`` (top-k/top-p off, so the sampling distribution is the model's own)
and records each sampled token's logprob from the raw logits, as vLLM reports them. ``forced`` makes
it emit given tokens (a canonical tool call), still reporting the model's logprobs of those tokens.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
TOOL_CALL_TEXT = '<tool_call>{"name": "search", "arguments": {"query": "paris weather"}}</tool_call><|im_end|>'
TOOL_CALL_MESSAGE = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "call_0", "type": "function",
                    "function": {"name": "search", "arguments": '{"query": "paris weather"}'}}],
}


def chat_prompt_ids(tok, messages, tools=None) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def sample_turn(model, tok, prompt_ids, max_new_tokens: int = 6, forced: list[int] | None = None,
                seed: int = 0) -> SampledTurn:
    """One sampled assistant turn with exact prompt ids, sampled ids and the model's logprobs."""
    n_prompt = len(prompt_ids)
    kwargs = {}
    if forced is not None:
        max_new_tokens = len(forced)
        kwargs["prefix_allowed_tokens_fn"] = lambda _b, ids: [forced[min(len(ids) - n_prompt, len(forced) - 1)]]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), do_sample=True, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
            output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id, **kwargs,
        )
    new = out.sequences[0, n_prompt:].tolist()
    logits = torch.stack(out.logits)[: len(new), 0].float()
    lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None]).squeeze(1).tolist()
    text = tok.decode(new, skip_special_tokens=True)
    finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
    return SampledTurn(message={"role": "assistant", "content": text}, prompt_token_ids=list(prompt_ids),
                       token_ids=new, logprobs=lps, finish_reason=finish, policy="tiny@0")


def synthetic_turn(prompt: list[int], completion: list[int], logprob: float = -1.0) -> SampledTurn:
    return SampledTurn(message={"role": "assistant", "content": "x"}, prompt_token_ids=prompt,
                       token_ids=completion, logprobs=[logprob] * len(completion))


def synthetic_group(rewards, prompt=(5, 6, 7), completion_len: int = 3, scenario_id: str = "s") -> TrajectoryGroup:
    """A group of single-turn trajectories with fixed token ids (for row/advantage logic, no model)."""
    trajs = []
    for i, r in enumerate(rewards):
        comp = [10 + i + k for k in range(completion_len + i)]
        trajs.append(Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                      synthetic_turn(list(prompt), comp)], reward=r))
    return TrajectoryGroup(trajs, scenario_id=scenario_id)


def step_rows(groups, max_row_tokens: int = 64) -> list:
    """The training rows a step builds from ``groups``, with sequence-mean weights (to run micro-batches by hand)."""
    from backends.training.losses import assign_aggregation_weights
    from backends.training.token_rows import build_rows

    rows, _ = build_rows(groups, max_row_tokens=max_row_tokens, overlong="drop", scale_rewards=True)
    assign_aggregation_weights(rows, "sequence_mean")
    return rows


def record_gradients(trainer) -> list[dict[str, torch.Tensor]]:
    """The LoRA gradients, by parameter name, of each optimizer step the trainer takes from now on (as the
    optimizer sees them: accumulated over micro-batches, after clipping)."""
    names = {id(p): n for n, p in trainer.model.named_parameters() if "lora_" in n}
    steps: list[dict[str, torch.Tensor]] = []

    def before_step(optimizer, args, kwargs):
        steps.append({names[id(p)]: p.grad.detach().clone() for group in optimizer.param_groups
                      for p in group["params"] if p.grad is not None and id(p) in names})

    trainer.optimizer.register_step_pre_hook(before_step)
    return steps


GRAD_RTOL = 1e-4
ADAM_RTOL = 0.02


def assert_same_gradients(got: list[dict], want: list[dict], where: str = "") -> None:
    """Every step's gradients agree within GRAD_RTOL of each tensor's largest entry.

    Summing the same terms in another order (fused kernels, packing, checkpointing) moves a float32
    gradient by about 1e-6 of its scale, so 1e-4 leaves room for rounding and none for a wrong term.
    (Inputs whose gradients cancel, e.g. two groups with mirrored rewards, leave only rounding noise:
    no comparison of that is meaningful, and the tests do not use them.)
    """
    assert len(got) == len(want) > 0, (where, len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), (where, step)
        for name, ref in w.items():
            torch.testing.assert_close(g[name], ref, rtol=0, atol=GRAD_RTOL * float(ref.abs().max()),
                                       msg=lambda m, name=name, step=step: f"{where} step {step} {name}: {m}")


def assert_same_adam_updates(got: dict, want: dict, learning_rate: float, steps: int, where: str = "") -> None:
    """LoRA weights after ``steps`` Adam steps agree within ADAM_RTOL of the distance Adam can move them.

    Adam moves each weight by about ``learning_rate`` per step whatever its gradient's size (m/sqrt(v)), so
    rounding in a near-zero gradient entry shows up as a fraction of ``learning_rate``, not of the
    gradient; a fixed atol (1e-6 with lr 1e-3) sat at the edge of that. The gradients themselves are
    compared with assert_same_gradients; this checks the updates landed on the same parameters.
    """
    assert got.keys() == want.keys(), where
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=0, atol=ADAM_RTOL * learning_rate * steps,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


def assert_as_close_to_exact(got: list[dict], ref: list[dict], exact: list[dict]) -> None:
    """Gradients of two paths in a low-precision dtype, each step's tensors against ``exact`` (float32) as a fraction of
    the tensor's largest entry: ``got``'s error is the size of ``ref``'s, tensor by tensor (a wrong term would be far
    larger), and no larger in sum. Zero tensors (B starts at zero: step 0's dL/dA) are left out."""
    errors: dict[str, list[float]] = {"got": [], "ref": []}
    for step, want_step in enumerate(exact):
        for k, want in want_step.items():
            scale = float(want.abs().max())
            if scale > 0:
                for name, run in (("got", got), ("ref", ref)):
                    errors[name].append(float((run[step][k] - want).abs().max()) / scale)
    assert all(g <= 2.5 * r + 1e-3 for g, r in zip(errors["got"], errors["ref"])), errors
    assert sum(errors["got"]) <= 1.25 * sum(errors["ref"])


def assert_same_model_state(got, want) -> None:
    """Two trainers' models hold the same ``state_dict``: the same keys, shapes and values (a base weight moved into
    a wider buffer still reads as the plain matrix)."""
    state_got, state_want = got.model.state_dict(), want.model.state_dict()
    assert state_got.keys() == state_want.keys()
    for k, v in state_want.items():
        assert state_got[k].shape == v.shape and torch.equal(state_got[k], v), k


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_path):
    """(model, tokenizer) of the tiny random model, fp32 CPU, for sampling conversations."""
    from backends.modeling.loading import load_model

    model, tok, _ = load_model(str(tiny_model_path))
    return model, tok


@pytest.fixture(scope="session")
def tool_conversation(tiny_lm):
    """A real multi-turn tool-calling trajectory: forced tool call, tool result, sampled answer,
    then a turn whose prompt is a fresh (summarised) conversation that does not extend the first."""
    model, tok = tiny_lm
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    p1 = chat_prompt_ids(tok, messages, tools=[SEARCH_TOOL])
    call_ids = tok(TOOL_CALL_TEXT, add_special_tokens=False)["input_ids"]
    t1 = sample_turn(model, tok, p1, forced=call_ids, seed=1)
    t1.message = dict(TOOL_CALL_MESSAGE)
    traj = Trajectory(messages_and_choices=messages, tools=[SEARCH_TOOL], reward=1.0)
    traj.messages_and_choices.append(t1)
    traj.messages_and_choices.append({"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"})
    p2 = chat_prompt_ids(tok, traj.messages(), tools=[SEARCH_TOOL])
    t2 = sample_turn(model, tok, p2, max_new_tokens=7, seed=2)
    traj.messages_and_choices.append(t2)
    fresh = [{"role": "system", "content": "Summary: the user asked about Paris."},
             {"role": "user", "content": "Anything else?"}]
    p3 = chat_prompt_ids(tok, fresh)
    t3 = sample_turn(model, tok, p3, max_new_tokens=5, seed=3)
    traj.messages_and_choices.append(t3)
    return {"trajectory": traj, "turns": (t1, t2, t3), "prompts": (p1, p2, p3), "tool_call_ids": call_ids}


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` within the block, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def single_thread():
    """Run a test's tiny-model math on one thread (restored after): on a shared 2-core machine this
    avoids thread oversubscription, which slows these small matmuls down several times."""
    with torch_threads(1):
        yield
