"""Which attention a packed micro-batch runs (backends/training/attention_choice.py): the rule per setting, device
and dtype, and that the trainer's forwards and warm-up follow it. The CUDA kernels cannot run here; the choice is
made for a CUDA device and dtype and then run on the CPU kernels (as test_packed_attention's cudnn test does)."""

from __future__ import annotations

import pytest
import torch

from backends.training.attention_choice import AttentionChoice, AttentionMode
from backends.training.config import TrainerConfig
from backends.training.packed_attention import CPU_PATH, sdpa_backends
from backends.training.token_rows import TrainingRow
from backends.training.trainer import GRPOTrainer
from tests.unit.backends.training.test_packed_attention import cpu_varlen_kernel, sdpa_calls  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("single_thread")

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
SHORT = [40] * 500  # the main job's micro-batch: ~500 rows of ~40 tokens
LONG = [2048, 3000, 9000]  # the 1.5B benchmark's rows: 2k-16k tokens
MIXED = [15000, 2047]  # a long row topped up with one shorter than the threshold
MANY_SHORT = [16000] + [40] * 100  # one long row among many short ones


def _mode(kernel, lengths, device=CUDA, dtype=torch.bfloat16, bucket=512, long_row_tokens=2048) -> AttentionMode:
    return AttentionChoice.of(kernel, device, dtype, bucket, long_row_tokens).mode(lengths)


def test_auto_on_cuda_runs_cudnn_rows_where_the_rows_quadratic_mean_is_long():
    varlen = AttentionMode("varlen", sdpa_backends("auto"), 1)
    cudnn = AttentionMode("rows", sdpa_backends("cudnn"), 512)
    assert _mode("auto", SHORT) == varlen
    assert _mode("auto", LONG) == cudnn
    assert _mode("auto", MIXED) == cudnn  # long rows topped up with a short one: the long rows' FLOPs decide
    assert _mode("auto", [14386, 8101, 1731]) == cudnn  # the H200 benchmark's micro-batch that ran varlen before
    assert _mode("auto", MANY_SHORT) == varlen  # 101 calls a layer: sum n^2 = 256.2M < 101 * 2048^2 = 423.6M
    assert _mode("auto", [2048]) == cudnn and _mode("auto", [2047]) == varlen  # at the threshold: long
    assert _mode("auto", [2048, 2048, 2047]) == varlen  # just under: 3 * 2048^2 - 4095
    assert _mode("auto", [2049, 2048, 2047]) == cudnn  # 2049^2 + 2047^2 = 2 * 2048^2 + 2
    assert _mode("auto", [100, 200], long_row_tokens=100, bucket=64) == AttentionMode("rows", cudnn.sdpa_backends, 64)
    assert _mode("auto", LONG, dtype=torch.float16) == cudnn


def test_the_explicit_kernels_and_the_cpu_do_what_they_did():
    """'varlen', 'flash', 'sdpa-default' and 'cudnn' are one mode for every micro-batch, short or long; 'auto'
    where varlen cannot run (float32) is 'flash' rows; off CUDA every setting is the CPU's one path ('cudnn' padded)."""
    for lengths in (SHORT, LONG, MIXED):
        assert _mode("varlen", lengths) == AttentionMode("varlen", sdpa_backends("varlen"), 1)
        assert _mode("flash", lengths) == AttentionMode("rows", sdpa_backends("flash"), 1)
        assert _mode("sdpa-default", lengths) == AttentionMode("rows", None, 1)
        assert _mode("cudnn", lengths) == AttentionMode("rows", sdpa_backends("cudnn"), 512)
        assert _mode("auto", lengths, dtype=torch.float32) == AttentionMode("rows", sdpa_backends("flash"), 1)
        for kernel in ("auto", "varlen", "flash", "sdpa-default"):
            assert _mode(kernel, lengths, CPU, torch.float32) == AttentionMode(CPU_PATH, None, 1)
        assert _mode("cudnn", lengths, CPU, torch.float32) == AttentionMode(CPU_PATH, None, 512)
    assert AttentionChoice.of("auto", CPU, torch.float32, 512, 2048) == AttentionChoice.fixed(CPU_PATH)
    with pytest.raises(ValueError, match="attention_kernel 'varlen' cannot run here"):
        AttentionChoice.of("varlen", CUDA, torch.float32, 512, 2048)


def test_padded_lengths_are_those_the_rule_can_reach():
    """'cudnn' and 'auto' on CUDA: every multiple of the bucket up to the budget's (a long micro-batch can hold a
    row of any length); 'auto' with the threshold over the budget, the others and the CPU's 'auto': none."""
    def padded(kernel, device=CUDA, long_row_tokens=2048, budget=16384):
        mode, lengths = AttentionChoice.of(kernel, device, torch.bfloat16, 512, long_row_tokens).padded_lengths(budget)
        return (mode.path, mode.bucket, lengths[0], lengths[-1], len(lengths)) if mode else lengths

    assert padded("cudnn") == ("rows", 512, 512, 16384, 32)
    assert padded("auto") == ("rows", 512, 512, 16384, 32)
    assert padded("auto", long_row_tokens=1000) == ("rows", 512, 512, 16384, 32)
    assert padded("auto", budget=16000) == ("rows", 512, 512, 16384, 32)  # a row of 16,000 pads to 16,384
    assert padded("auto", long_row_tokens=16384) == ("rows", 512, 512, 16384, 32)  # one full row is long
    assert padded("auto", long_row_tokens=20000) == []  # no micro-batch within the budget is long: lone rows over it
    assert padded("cudnn", CPU) == ("rows", 512, 512, 16384, 32)
    for kernel in ("varlen", "flash", "sdpa-default"):
        assert padded(kernel) == []
    assert padded("auto", CPU) == []


def test_warm_up_lengths_run_each_mode_once(tiny_model_path):
    """One mode: the budget split 1/2, 1/3, 1/6, then half of it so. 'auto' on CUDA: the full micro-batch in rows of
    long_row_tokens (the last takes the rest), the other in rows just under it; a threshold over the budget: as one."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(micro_batch_tokens=16384))
    assert trainer._warm_up_lengths(2) == [[8192, 5461, 2731], [4096, 2730, 1366]]
    for long_row_tokens, want in ((2048, [[2048] * 8, [2047] * 4 + [4]]),
                                  (5000, [[5000, 5000, 6384], [4999, 3193]]),
                                  (1000, [[1000] * 15 + [1384], [999] * 8 + [200]]),
                                  (20000, None)):
        trainer.update_config(long_row_tokens=long_row_tokens)
        trainer.device, trainer.dtype = CUDA, torch.bfloat16
        trainer._choose_attention(trainer.config)
        trainer.device, trainer.dtype = CPU, torch.float32
        lengths = trainer._warm_up_lengths(2)
        assert lengths == (want or [[8192, 5461, 2731], [4096, 2730, 1366]]), long_row_tokens
        modes = [trainer.attention.mode(n).path for n in lengths]
        assert modes == (["rows", "varlen"] if want else ["varlen", "varlen"]), long_row_tokens


def _long_and_short(vocab: int) -> tuple[TrainingRow, TrainingRow]:
    def row(n):
        return TrainingRow([(5 * i + 1) % vocab for i in range(n)], [i > 0 for i in range(n)], [0.0] * n)
    return row(40), row(12)


def test_the_trainer_chooses_per_micro_batch(tiny_model_path, cpu_varlen_kernel, sdpa_calls):  # noqa: F811
    """A trainer with 'auto' resolved for CUDA bf16: its long micro-batch runs one SDPA call per row, cuDNN first,
    padded to the bucket; its short one runs varlen (no SDPA call), and both give the logprobs of the CPU path."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(long_row_tokens=32, attention_bucket=16,
                                                              micro_batch_tokens=40))
    long_row, short_row = _long_and_short(trainer.vocab_size)
    long_mb, short_mb = trainer._micro_batches([long_row]), trainer._micro_batches([short_row, short_row])
    assert len(long_mb) == len(short_mb) == 1
    with torch.no_grad():
        want = [trainer._token_logprobs(mb)[0] for mb in (long_mb[0], short_mb[0])]
    trainer.device, trainer.dtype = CUDA, torch.bfloat16  # what _choose_attention sees on a GPU
    trainer._choose_attention(trainer.config)
    trainer.device, trainer.dtype = CPU, torch.float32  # run that choice here
    assert trainer.attention_path == "varlen; rows (cudnn, bucket 16) where the rows' quadratic mean >= 32 tokens"
    assert [trainer._packed_attention(mb).path for mb in (*long_mb, *short_mb)] == ["rows", "varlen"]
    sdpa_calls.clear()
    with torch.no_grad():
        got_long = trainer._token_logprobs(long_mb[0])[0]
        layers = trainer._lm.config.num_hidden_layers
        assert [q for q, _, _ in sdpa_calls] == [48] * layers  # 40 tokens padded to 48, one call per layer
        assert all(order[0] == int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION) for _, _, order in sdpa_calls)
        sdpa_calls.clear()
        got_short = trainer._token_logprobs(short_mb[0])[0]
        assert sdpa_calls == []  # one varlen call per layer instead
    torch.testing.assert_close(got_long, want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_short, want[1], rtol=0, atol=1e-5)
    trainer.update_config(attention_kernel="varlen")  # explicit: back to one mode (the CPU's, here)
    assert trainer.attention == AttentionChoice.fixed(CPU_PATH)


def test_auto_warms_up_the_long_padded_lengths_with_one_attention_call_each(tiny_model_path, cpu_varlen_kernel,
                                                                            sdpa_calls):  # noqa: F811
    """'auto' resolved for CUDA: the warm-up's first generic micro-batch is long rows (cuDNN rows through the whole
    model), the second short rows (varlen), then ONE attention forward + backward per padded length from the
    bucket to the budget's (here 16, 32, 48 and 64: one SDPA call each), cuDNN first; gradients dropped."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(long_row_tokens=40, attention_bucket=16,
                                                              micro_batch_tokens=64))
    trainer.device, trainer.dtype = CUDA, torch.bfloat16
    trainer._choose_attention(trainer.config)
    trainer.device, trainer.dtype = CPU, torch.float32
    sdpa_calls.clear()
    assert trainer._warm_up_lengths(2) == [[64], [32]]  # one row of 64 >= 40; then one of 32 < 40
    assert trainer.warm_up() > 0
    cudnn = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    layers = trainer._lm.config.num_hidden_layers
    # the 64-token row through every layer, the short micro-batch through varlen (no SDPA call), then the plans
    assert [(q, order[0]) for q, _, order in sdpa_calls] == [(64, cudnn)] * layers + [(m, cudnn) for m in
                                                                                      (16, 32, 48, 64)]
    assert trainer.warm_up_runs == {"micro_batches": 2, "tokens": 64 + 32, "bucket": 16, "bucket_lengths": 4,
                                    "from_length": 16}
    assert all(p.grad is None for p in trainer.model.parameters())
