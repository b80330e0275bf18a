"""The fresh-process training benchmark's opt-in runs (fp8, group-qkv): their configuration; the logprob gap the fp8 run
records once; which compile cache folder and run store each cache mode's run gets."""

import pytest

from backends.training.config import TrainerConfig
from backends.training.token_rows import build_rows
from backends.training.trainer import GRPOTrainer
from benchmarks.training_fresh_process import CACHE_MODES, CONFIGS, CacheFolders, fp8_logprob_gap, summarise_run
from tests.fixtures_trainer import synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("run,switch", [("fp8+warm-up", "fp8_base"), ("group-qkv+warm-up", "group_qkv")])
def test_the_opt_in_runs_turn_their_switch_on_and_nothing_else(run, switch):
    assert CONFIGS[run] == {switch: "on"}
    TrainerConfig(**CONFIGS[run])


@pytest.mark.parametrize("run", ["norm-off+warm-up", "mb24k-norm-off+warm-up", "mb24k-group-qkv+warm-up",
                                 "mb20k+warm-up", "mb24k+warm-up", "mb24k-fold-a+warm-up", "mb24k-b256+warm-up",
                                 "mb24k-low-rank-first+warm-up", "mb24k-low-rank-first-off+warm-up",
                                 "mb24k-low-rank-first-b256+warm-up", "mb24k-chain-off+warm-up",
                                 "mb24k-chain-on+warm-up", "mb24k-head-grad-off+warm-up", "mb24k-head-grad-on+warm-up",
                                 "mb24k-swiglu-off+warm-up", "mb24k-swiglu-on+warm-up"])
def test_the_micro_batch_and_norm_runs_differ_from_the_defaults_in_their_names_only(run):
    expected = {"micro_batch_tokens": {"mb20k": 20480, "mb24k": 24576}[run[:5]]} if run.startswith("mb") else {}
    expected |= {"recompute_norm": "off"} if "norm-off" in run else {}
    expected |= {"group_qkv": "on"} if "group-qkv" in run else {}
    expected |= {"fold_lora_a": "on"} if "fold-a" in run else {}
    expected |= {"attention_bucket": 256} if "b256" in run else {}
    expected |= {"low_rank_first": "off" if "low-rank-first-off" in run else "on"} if "low-rank-first" in run else {}
    expected |= {"chain_input_grads": "on" if "chain-on" in run else "off"} if "-chain-" in run else {}
    expected |= {"logprob_grad_in_forward": run.split("-")[3].split("+")[0]} if "head-grad" in run else {}
    expected |= {"fused_swiglu_lora": run.split("swiglu-")[1][:-len("+warm-up")]} if "swiglu" in run else {}
    assert CONFIGS[run] == expected
    TrainerConfig(**CONFIGS[run])


def test_the_gap_compares_the_fp8_forward_with_the_bf16_one_on_the_same_rows(tiny_model_path):
    groups = [synthetic_group([0.0, 1.0, 0.5]), synthetic_group([2.0, 0.0])]
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fp8_base="on", micro_batch_tokens=16))
    before = trainer.fp8.fp8_forwards
    gap = fp8_logprob_gap(trainer, groups, max_row_tokens=64)
    assert gap["tokens"] == sum(r.trained_tokens for r in build_rows(groups, max_row_tokens=64)[0])
    assert 0 < gap["mean"] <= gap["max"] < 0.5
    assert trainer.fp8.fp8_forwards > before and trainer.fp8._open is False


def test_the_summary_carries_the_gap():
    step = {"step": 0, "wall_s": 1.0, "done_at": 11.0, "tokens": 100, "peak_gib": 1.0, "flops_lora_aware": 1e12}
    run = {"config": "fp8+warm-up", "cache": "cold-cache", "spawned_at": 0.0, "t_imported": 1.0, "t_model": 2.0,
           "t_trainer": 3.0, "warm_up_s": 0.5, "n_params": 10, "steps": [step, {**step, "step": 1}],
           "fp8_lora_layers": 196, "fp8_logprob_gap": {"mean": 0.01, "max": 0.2, "tokens": 5},
           "grouped_qkv_layers": 28}
    summary = summarise_run(run, steady_steps=1)
    assert summary["fp8_lora_layers"] == 196 and summary["fp8_logprob_gap"]["max"] == 0.2
    assert summary["grouped_qkv_layers"] == 28


def test_a_store_cache_run_has_fresh_local_caches_and_the_store_the_cold_run_filled(tmp_path):
    folders = CacheFolders(tmp_path)
    cold_inductor, cold_store = folders.of("defaults+warm-up", "cold-cache")
    warm_inductor, warm_store = folders.of("defaults+warm-up", "warm-cache")
    store_inductor, store = folders.of("defaults+warm-up", "store-cache")
    assert warm_inductor == cold_inductor and warm_store is None  # the local cache the cold run filled, no store
    assert store_inductor not in (cold_inductor, warm_inductor) and store == cold_store
    again_inductor, again_store = folders.of("defaults+warm-up", "cold-cache")
    assert again_inductor != store_inductor and again_store != cold_store  # cold: nothing carried over
    assert folders.of("fp8+warm-up", "store-cache")[1] not in (cold_store, again_store)  # per configuration
    assert set(CACHE_MODES) == {"cold-cache", "warm-cache", "store-cache"}
