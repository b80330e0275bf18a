"""benchmarks/profile_gaps.py on synthetic traces (busy time over overlapping streams, gaps and what the host did, the
kernel categories) and on a real CPU profile of a trainer step (no device events: said, not divided by)."""

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.step_phases import MICRO_BATCH, PREPARE, UPDATE
from backends.training.trainer import GRPOTrainer
from benchmarks import profile_gaps as pg
from tests.fixtures_trainer import synthetic_group

STEP_TID, AUTOGRAD_TID = 1, 2


def x(name, cat, ts, dur, tid=STEP_TID, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0 if cat.startswith("gpu") or
            cat == "kernel" else 100, "tid": tid, "args": args}


def launched(op, ext, corr, ts, kernel, k_ts, k_dur, tid=STEP_TID, dims=None, stream=7, cat="kernel",
             launch="cudaLaunchKernel"):
    """A torch op at ``ts`` (100 us) launching (at ts + 50) one device event."""
    op_args = {"External id": ext, **({"Input Dims": dims} if dims else {})}
    return [x(op, "cpu_op", ts, 100, tid, **op_args), x(launch, "cuda_runtime", ts + 50, 10, tid, correlation=corr),
            x(kernel, cat, k_ts, k_dur, stream, correlation=corr, **{"External id": ext})]


def synthetic_step():
    """A 10 ms step: prepare, two micro-batches (the first one's LoRA GEMM launched from the autograd thread runs on
    a second stream, overlapping the base GEMM), the update; times in microseconds."""
    return [
        x(pg.STEP, "user_annotation", 0, 10_000), x(PREPARE, "user_annotation", 0, 1000),
        x(MICRO_BATCH, "user_annotation", 1000, 3000), x(MICRO_BATCH, "user_annotation", 4000, 3000),
        x(UPDATE, "user_annotation", 7000, 2500),
        x("trajflow.step.micro_batch", "gpu_user_annotation", 1000, 8000, 7),  # the GPU side of a range: not busy
        *launched("aten::copy_", 5, 15, 960, "Memcpy HtoD (Pinned -> Device)", 1000, 50, cat="gpu_memcpy",
                  launch="cudaMemcpyAsync"),
        *launched("aten::mm", 1, 11, 1100, "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 1300, 1700,
                  dims=[[16384, 1536], [1536, 8960]]),
        *launched("aten::addmm_", 2, 12, 2000, "sm90_xmma_gemm_f32f32_tf32f32", 2500, 1000, tid=AUTOGRAD_TID,
                  dims=[[16, 1536], [16, 16384], [16384, 1536]], stream=8),
        *launched("aten::_flash_attention_forward", 3, 13, 4100, "flash_fwd_kernel", 4300, 1700),
        x("aten::_local_scalar_dense", "cpu_op", 7100, 900), x("cudaStreamSynchronize", "cuda_runtime", 7110, 880),
        *launched("aten::_fused_adamw_", 4, 14, 8100, "multi_tensor_apply_kernel<FusedAdamMathFunctor>", 8300, 200),
    ]


def test_busy_time_is_the_union_over_streams_and_each_gap_is_placed_and_attributed():
    got = pg.summarise(synthetic_step(), step_thread_cpu_s=0.0123)
    dev = got["device"]
    assert got["wall_ms"] == 10.0 and got["step_marker"] is True
    assert got["phases"] == ["prepare", "update", "2 micro-batches"]
    # 50 + (1300..3500: two streams overlapping) + 1700 + 200 us; the GPU side of a profiler range does not count
    assert dev["busy_ms"] == pytest.approx(4.15) and dev["idle_ms"] == pytest.approx(5.85)
    assert dev["gaps_over_0.2ms"] == 5 and dev["gaps_total_ms"] == pytest.approx(5.85)
    assert dev["gap_ms_by_where"] == pytest.approx({"around the optimizer step": 2.3, "after the last kernel": 1.5,
                                                    "before the first kernel": 1.0, "between micro-batches": 0.8,
                                                    "inside micro-batch 0": 0.25})
    largest = dev["largest_gaps"]
    assert [g["ms"] for g in largest] == pytest.approx([2.3, 1.5, 1.0, 0.8, 0.25])
    optimizer, after, before, between, inside = largest
    assert optimizer["where"] == "around the optimizer step" and optimizer["at_ms"] == 6.0
    assert optimizer["host_at_start"] == [pg.STEP, MICRO_BATCH]  # the second micro-batch's range, still open
    assert optimizer["launched_by"] == "aten::_fused_adamw_" and optimizer["launch_late_ms"] == pytest.approx(2.15)
    assert optimizer["launch_thread"] == "step" and optimizer["next_kernel"].startswith("multi_tensor_apply")
    assert optimizer["launch_ranges"] == [pg.STEP, UPDATE, "aten::_fused_adamw_", "cudaLaunchKernel"]
    assert "launched_by" not in after and after["where"] == "after the last kernel"
    assert before["launched_by"] == "aten::copy_" and before["host_at_start"] == [pg.STEP, PREPARE]
    assert between["launched_by"] == "aten::_flash_attention_forward" and between["launch_thread"] == "step"
    assert between["launch_late_ms"] == pytest.approx(0.65)
    assert inside["where"] == "inside micro-batch 0" and inside["launched_by"] == "aten::mm"


def test_a_kernel_queued_before_its_gap_shows_a_negative_lateness():
    events = [x(pg.STEP, "user_annotation", 0, 5000), *launched("aten::mm", 1, 11, 0, "gemm_a", 100, 1000),
              *launched("aten::mm", 2, 12, 200, "gemm_b", 2000, 1000)]  # launched at 250, ran at 2000
    gap = pg.summarise(events)["device"]["largest_gaps"]
    queued = next(g for g in gap if g["at_ms"] == pytest.approx(1.1))
    assert queued["launch_late_ms"] == pytest.approx(-0.85) and queued["where"] == "inside the step"


def test_cuda_time_by_category_splits_gemms_by_shape_and_ranks_kernels():
    got = pg.summarise(synthetic_step(), lora_dim=16)
    assert got["cuda_by_category"] == {"gemm base": {"ms": 1.7, "count": 1},
                                       "attention forward": {"ms": 1.7, "count": 1},
                                       "gemm lora": {"ms": 1.0, "count": 1},
                                       "optimizer + grad norm": {"ms": 0.2, "count": 1},
                                       "memcpy": {"ms": 0.05, "count": 1}}
    top = got["top_kernels"]
    assert [k["category"] for k in top][:2] in (["gemm base", "attention forward"], ["attention forward", "gemm base"])
    assert all(k["count"] == 1 for k in top) and len(top) == 5


@pytest.mark.parametrize("name,category", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128", "attention backward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128", "attention forward"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention backward"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention forward"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("triton_red_fused__log_softmax_gather_sub_0", "logprob + loss"),
    ("triton_red_fused_exp_logsumexp_mul_sub_sum_1", "logprob + loss"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_poi_fused_mul_sigmoid_silu_0", "elementwise + reduction"),
    ("void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>", "optimizer + grad norm"),
    ("void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float>", "optimizer + grad norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise + reduction"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>",
     "elementwise + reduction"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_names_fall_in_their_category(name, category):
    assert pg.kernel_category(name) == category


def test_a_gemm_splits_by_its_inputs_shapes_only_when_it_has_them():
    name = "nvjet_tst_128x64"
    assert pg.kernel_category(name, input_dims=[[16384, 1536], [1536, 16]], lora_dim=16) == "gemm lora"
    assert pg.kernel_category(name, input_dims=[[16384, 1536], [1536, 256]], lora_dim=16) == "gemm base"
    assert pg.kernel_category(name, input_dims=[[], []]) == "gemm"
    assert pg.kernel_category("Memcpy DtoH", "gpu_memcpy") == "memcpy"
    assert pg.kernel_category("Memset", "gpu_memset") == "memset"


def test_union_merges_overlaps_and_touching_intervals():
    assert pg.union([(5, 25), (0, 10), (20, 30), (30, 31), (40, 41)]) == [(0, 31), (40, 41)]
    assert pg.covered([(0, 10), (5, 12), (20, 21)]) == 13


def test_host_figures_per_thread_and_per_phase():
    host = pg.summarise(synthetic_step(), step_thread_cpu_s=0.0123)["host"]
    assert host["step_thread_cpu_s"] == 0.0123
    step, autograd = host["threads"]["step"], host["threads"][str(AUTOGRAD_TID)]
    assert step["launches"] == 3 and autograd["launches"] == 1  # cudaMemcpyAsync is a copy, not a launch
    assert step["syncs"] == 1 and step["sync_ms"] == pytest.approx(0.88)
    assert step["in_ops_ms"] == pytest.approx(0.4 + 0.9)
    mb0 = next(p for p in host["phases"] if p["phase"] == "micro-batch 0")
    assert mb0["wall_ms"] == 3.0 and mb0["outside_ops_ms"] == pytest.approx(3.0 - 0.06 - 0.1 - 0.1)
    assert mb0["launches"] == 2


def test_without_device_events_it_says_so():
    cpu_only = [e for e in synthetic_step() if e["cat"] not in ("kernel", "gpu_memcpy", "gpu_user_annotation")]
    got = pg.summarise(cpu_only)
    assert "no device events" in got["device"] and "cuda_by_category" not in got
    assert got["host"]["threads"]["step"]["in_ops_ms"] > 0
    empty = pg.summarise([])
    assert "no device events" in empty["device"] and empty["wall_ms"] == 0.0


def test_a_real_cpu_profile_of_a_trainer_step(tiny_model_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(micro_batch_tokens=8))
    groups = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
    trainer.train_step(groups)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(pg.STEP):
            metrics = trainer.train_step(groups)
    got = pg.summarise(pg.trace_events(prof), step_thread_cpu_s=0.5)
    n = int(metrics["micro_batches"])
    assert n >= 3 and got["step_marker"] and got["phases"] == ["prepare", "update", f"{n} micro-batches"]
    assert "no device events" in got["device"]
    assert [p["phase"] for p in got["host"]["phases"]] == ["prepare"] + [f"micro-batch {k}" for k in range(n)] + [
        "update"]
    assert got["host"]["threads"]["step"]["in_ops_ms"] > 0 and got["wall_ms"] > 0
