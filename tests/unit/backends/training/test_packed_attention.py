"""Packed attention: a packed forward + backward equals each row alone, on every path that runs here.

The ``varlen`` path calls torch's public ``varlen_attn`` (its signature handling, its registered autograd, the
layout conversions and cu_seqlens are ours to get right); its FlashAttention kernel has no CPU build, so here the
two operators under it (``torch_attn::_varlen_attn`` and its backward) get a CPU kernel that computes the documented
varlen semantics in plain torch (``_reference_varlen``). The flash kernel itself is compared with the ``rows`` path
on the H200 by benchmarks/varlen_check.py.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from backends.training.attention_choice import AttentionChoice
from backends.training.config import TrainerConfig
from backends.training.packed_attention import (CPU_PATH, PackedAttention, RowSpans, VarlenCall, _CutRows, _PadRows,
                                               _split_rows, attention_path, bucketed, sdpa_backends, varlen_function)
from backends.training.packing import make_micro_batch
from backends.training.token_rows import TrainingRow
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import assert_same_gradients

pytestmark = pytest.mark.usefixtures("single_thread")


def _spans(cu: torch.Tensor):
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _probs(q, k, scale, causal):
    """Per-head softmax of one sequence's scores: q [n, H, D], k [n, Hkv, D] -> p [H, n, n], lse [H, n]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        n = q.shape[0]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp(), lse


def _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, *_, **__):
    """varlen_attn's forward on the CPU: each span of cu_seq attends to itself; (out [T, H, D], lse [H, T], rng)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = torch.empty_like(query), query.new_empty(query.shape[1], query.shape[0])
    for a, b in _spans(cu_seq_q):
        p, lse[:, a:b] = _probs(query[a:b], key[a:b], scale, is_causal)
        v = value[a:b].repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _reference_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                               rng_state, scale=None, *_, **__):
    """Its backward: dv = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dq = dS K scale, dk = dS^T Q scale; the key /
    value heads' gradients summed over the query heads that share them."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    group = query.shape[1] // key.shape[1]
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for a, b in _spans(cu_seq_q):
        p, _ = _probs(query[a:b], key[a:b], scale, is_causal)
        k, v = (x[a:b].repeat_interleave(group, dim=1) for x in (key, value))
        do, o = grad_out[a:b], out[a:b]
        dv_full = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, v) - (do * o).sum(-1).T[..., None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, k) * scale
        dk_full = torch.einsum("hqk,qhd->khd", ds, query[a:b]) * scale
        dk[a:b] = dk_full.unflatten(1, (key.shape[1], group)).sum(2)
        dv[a:b] = dv_full.unflatten(1, (key.shape[1], group)).sum(2)
    return dq, dk, dv


_REGISTERED: list[bool] = []


@pytest.fixture(scope="module")
def cpu_varlen_kernel():
    """CPU kernels for the operators under torch's varlen_attn (registered once per process: no CPU test calls it
    otherwise, where it could only fail)."""
    from torch.nn.attention import varlen

    if not _REGISTERED:
        varlen._varlen_attn.register_kernel("cpu", _reference_varlen)
        varlen._varlen_attn_backward.register_kernel("cpu", _reference_varlen_backward)
        _REGISTERED.append(True)


def _rows(vocab: int) -> list[TrainingRow]:
    """Mixed lengths, two of them a single (untrained) token, each row a different share of the loss."""
    rng = random.Random(3)
    rows = []
    for k, n in enumerate((1, 9, 2, 33, 1, 17, 5, 24)):
        ids = [rng.randrange(vocab) for _ in range(n)]
        mask = [t > 0 and rng.random() < 0.7 for t in range(n)]
        rows.append(TrainingRow(ids, mask, [0.0] * n, advantage=1.0, weight=0.5 + k, source=f"row{k}"))
    return rows


def _logprobs_and_grads(trainer: GRPOTrainer, micro_batches):
    """The trained tokens' logprobs (concatenated) and the LoRA gradients of sum(weight * logprob)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    out = []
    for mb in micro_batches:
        logp, _ = trainer._token_logprobs(mb)
        (logp * mb.weights).sum().backward()
        out.append(logp.detach())
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return torch.cat(out), grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_packed_micro_batch_equals_each_row_alone_on_every_path(tiny_model_path, cpu_varlen_kernel, checkpointing):
    """One packed micro-batch of 8 rows (lengths 1-33, GQA: 4 query / 2 key-value heads) against each row through
    the unpacked model (transformers' own causal mask): the same logprobs and the same LoRA gradients, on the
    ``rows`` path, the ``varlen`` path, and the path a CPU trainer picks."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(gradient_checkpointing=checkpointing,
                                                              checkpoint_layer_fraction=1.0))
    attn = trainer._lm.model.layers[0].self_attn
    assert attn.config.num_attention_heads > attn.config.num_key_value_heads  # GQA
    torch.manual_seed(0)
    for name, p in trainer.model.named_parameters():
        if "lora_B" in name:  # a fresh adapter's B = 0 would leave A without gradient
            p.data.normal_(0, 0.05)
    trainer.model.train()
    rows = _rows(trainer.vocab_size)
    assert trainer.attention_path == CPU_PATH

    trainer.packed = False  # the reference: each row alone, no packing code in its forward
    want_logp, want_grads = _logprobs_and_grads(trainer, [make_micro_batch([r], "cpu") for r in rows])
    trainer.packed = True
    packed = make_micro_batch(rows, "cpu")
    assert packed.spans.lengths == tuple(len(r) for r in rows) and packed.tokens == sum(len(r) for r in rows)
    assert packed.spans.cu_seqlens.dtype == torch.int32 and packed.spans.max_len == 33
    for path in ("rows", "varlen"):
        trainer.attention = AttentionChoice.fixed(path)
        logp, grads = _logprobs_and_grads(trainer, [packed])
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5, msg=lambda m: f"{path}: {m}")
        assert_same_gradients([grads], [want_grads], path)
        assert len(grads) == len(trainer._params)  # every LoRA weight reached


def test_attention_kernel_picks_the_path_for_the_device_and_dtype(tiny_model_path):
    cuda = torch.device("cuda")
    assert varlen_function() is not None  # this torch has it (>= 2.10)
    assert attention_path("auto", cuda, torch.bfloat16) == "varlen"
    assert attention_path("varlen", cuda, torch.float16) == "varlen"
    assert attention_path("auto", cuda, torch.float32) == "rows"  # flash has no float32 kernel
    assert attention_path("flash", cuda, torch.bfloat16) == "rows"
    assert attention_path("sdpa-default", cuda, torch.bfloat16) == "rows"
    with pytest.raises(ValueError, match="attention_kernel 'varlen' cannot run here: FlashAttention varlen needs "
                                         "bfloat16 or float16"):
        attention_path("varlen", cuda, torch.float32)
    for kernel in ("auto", "varlen", "flash", "sdpa-default"):  # the CPU has one kernel: the setting is CUDA's
        assert attention_path(kernel, torch.device("cpu"), torch.float32) == CPU_PATH
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(attention_kernel="varlen"))
    assert trainer.attention == AttentionChoice.fixed(CPU_PATH) and trainer.attention_path == CPU_PATH
    trainer.update_config(attention_kernel="flash")
    assert trainer.attention == AttentionChoice.fixed(CPU_PATH)


def test_varlen_calls_follow_the_signature_of_each_torch():
    """2.10 took ``is_causal``; 2.11 ``window_size`` and ``scale``; 2.12 on also ``enable_gqa``."""
    def v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        pass

    def v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1)):
        pass

    def v212(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        pass

    def unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        pass

    assert VarlenCall.of(v210) == VarlenCall(v210, {"is_causal": True}, False, False)
    assert VarlenCall.of(v211) == VarlenCall(v211, {"window_size": (-1, 0)}, True, False)
    assert VarlenCall.of(v212) == VarlenCall(v212, {"window_size": (-1, 0)}, True, True)
    assert VarlenCall.of(unknown) is None
    installed = varlen_function()
    assert set(installed.causal) <= set(inspect.signature(installed.fn).parameters)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every SDPA call's (query length, key length, SDPA's backend priority order in force) while the test runs."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((query.shape[-2], key.shape[-2], torch._C._get_sdp_priority_order()))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("bucket", [1, 8, 33])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_rows_padded_to_a_bucket_equal_each_row_alone(tiny_model_path, sdpa_calls, bucket, checkpointing):
    """Rows zero-padded at their end to a multiple of the bucket (lengths 1-33: some a multiple of 8 or 33, most
    not) give each row's own logprobs and LoRA gradients; every SDPA call runs on the padded length (bucket 1:
    the rows' own lengths)."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(gradient_checkpointing=checkpointing,
                                                              checkpoint_layer_fraction=1.0))
    torch.manual_seed(0)
    for name, p in trainer.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    trainer.model.train()
    rows = _rows(trainer.vocab_size)
    trainer.packed = False
    want_logp, want_grads = _logprobs_and_grads(trainer, [make_micro_batch([r], "cpu") for r in rows])
    trainer.packed = True
    trainer.attention = AttentionChoice.fixed("rows", bucket=bucket)
    sdpa_calls.clear()
    logp, grads = _logprobs_and_grads(trainer, [make_micro_batch(rows, "cpu")])
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    assert_same_gradients([grads], [want_grads], f"bucket {bucket}")
    assert len(grads) == len(trainer._params)
    padded = [bucketed(len(r), bucket) for r in rows]
    assert bucket == 1 or padded != [len(r) for r in rows]
    layers = trainer._lm.config.num_hidden_layers
    assert [(q, k) for q, k, _ in sdpa_calls[:len(rows)]] == [(m, m) for m in padded]
    assert len(sdpa_calls) == len(rows) * layers * (2 if checkpointing else 1)  # recomputation pads the same


def test_padded_rows_have_strides_of_their_own_length():
    """A padded row is its own [1, H, m, D] tensor in q_proj's layout: nothing in its shape or strides says how long
    the micro-batch was, so one cuDNN plan serves that bucket in every micro-batch."""
    H, D = 4, 8
    layouts = set()
    for lengths in [(5, 16, 12), (12, 3), (16, 30)]:
        x = torch.randn(1, sum(lengths), H, D).transpose(1, 2)  # [1, H, L, D] as q_proj + view + transpose give it
        for n, row in zip(lengths, _split_rows(x, lengths, 16)):
            assert row.shape == (1, H, bucketed(n, 16), D)
            assert torch.equal(row[:, :, :n], x[:, :, sum(lengths[:lengths.index(n)]):][:, :, :n])
            assert not row[:, :, n:].any()  # zeros after the row's tokens
            layouts.add((tuple(row.shape), row.stride()))
    assert layouts == {((1, H, m, D), (m * H * D, D, H * D, 1)) for m in (16, 32)}


def test_padding_and_cutting_rows_copy_only_what_they_must():
    """``_PadRows``: the row, then zeros, even in memory that held NaN (a padded query's output enters the backward);
    its gradient is the padded gradient's first n positions, the same storage (no copy). ``_CutRows``: a view of the
    first n positions; its gradient is a fresh [1, m, ...], the cut's gradient then zeros. Both the same values as
    ``F.pad`` and a slice."""
    x = torch.randn(5, 3, 4, requires_grad=True)
    for _ in range(3):  # the allocator hands back this NaN-filled block to the new_empty below
        torch.full((8, 3, 4), float("nan"))
    padded = _PadRows.apply(x, 8)
    assert torch.equal(padded, torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 3)))
    upstream = torch.randn(8, 3, 4)
    (grad,) = torch.autograd.grad(padded, x, upstream)
    assert torch.equal(grad, upstream[:5])
    assert grad.untyped_storage().data_ptr() == upstream.untyped_storage().data_ptr()

    out = torch.randn(1, 8, 3, 4, requires_grad=True)
    cut = _CutRows.apply(out, 5)
    assert torch.equal(cut, out[:, :5]) and cut.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    torch.full((1, 8, 3, 4), float("nan"))
    (grad,) = torch.autograd.grad(cut, out, torch.ones(1, 5, 3, 4))
    assert torch.equal(grad, torch.cat([torch.ones(1, 5, 3, 4), torch.zeros(1, 3, 3, 4)], dim=1))


def test_cudnn_reaches_the_sdpa_call_first_with_its_bucket(tiny_model_path, tool_conversation, sdpa_calls):
    """attention_kernel 'cudnn': on CUDA the packed forward carries cuDNN first, flash, efficient and math after
    it, and the bucket; the CPU pads the same but keeps its own kernel order. The trainer's PackedAttention is
    what the SDPA calls run under."""
    from torch.nn.attention import SDPBackend

    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
    assert sdpa_backends("cudnn") == cudnn_first
    assert attention_path("cudnn", torch.device("cuda"), torch.bfloat16) == "rows"
    assert attention_path("cudnn", torch.device("cuda"), torch.float32) == "rows"
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(attention_kernel="cudnn", attention_bucket=16))
    t1, p1 = tool_conversation["turns"][0], tool_conversation["prompts"][0]
    (mb,) = trainer._micro_batches([TrainingRow(p1 + t1.token_ids, [False] * len(p1) + [True] * len(t1.token_ids),
                                                [0.0] * (len(p1) + len(t1.token_ids)))])
    on_cpu = trainer._packed_attention(mb)
    assert (on_cpu.path, on_cpu.sdpa_backends, on_cpu.bucket) == (CPU_PATH, None, 16)
    default = trainer.sequence_logprobs(p1, t1.token_ids)
    assert {q for q, _, _ in sdpa_calls} == {bucketed(len(p1) + len(t1.token_ids), 16)} != {len(mb.rows[0])}

    trainer.device, trainer.dtype = torch.device("cuda"), torch.bfloat16  # what _choose_attention sees on a GPU
    trainer._choose_attention(trainer.config)
    on_gpu = trainer._packed_attention(mb)
    assert (on_gpu.path, on_gpu.sdpa_backends, on_gpu.bucket) == ("rows", cudnn_first, 16)
    trainer.device, trainer.dtype = torch.device("cpu"), torch.float32  # run that choice here: CPU kernels
    sdpa_calls.clear()
    assert trainer.sequence_logprobs(p1, t1.token_ids) == pytest.approx(default, abs=1e-5)
    assert sdpa_calls and all(order[:4] == [int(b) for b in cudnn_first] for _, _, order in sdpa_calls)
    trainer.update_config(attention_kernel="flash")
    assert trainer.attention.usual.bucket == 1 and trainer._packed_attention(mb).bucket == 1


def test_attention_bucket_is_validated():
    assert TrainerConfig().attention_bucket == 512 and TrainerConfig().attention_kernel == "auto"
    with pytest.raises(ValueError, match="attention_bucket"):
        TrainerConfig(attention_bucket=0)
    with pytest.raises(ValueError, match="attention_kernel"):
        TrainerConfig(attention_kernel="cudnn-v9")
    with pytest.raises(ValueError, match="bucket 0: expected >= 1"):
        PackedAttention(RowSpans.of([3], "cpu"), bucket=0)
    assert [bucketed(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8] and bucketed(7, 1) == 7
