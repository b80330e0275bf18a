"""benchmarks/shared_prefill.py on tiny-random with a LoRA: both modes run, give the same tokens, and only the shared
one prefills each group's prompt once."""

import json

from backends.inference import engine as engine_module
from backends.inference.prompt_sharing import share_rows
from benchmarks import shared_prefill as bench


def test_shared_mode_prefills_each_group_once_and_gives_the_same_tokens(tmp_path):
    out = tmp_path / "shared-prefill.json"
    assert bench.main(["--device", "cpu", "--model", "tiny-random", "--lora-rank", "4", "--prompt-tokens", "24",
                       "--groups", "2", "--group-size", "3", "--new-tokens", "4", "--reps", "1",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    shared, each = report["results"]["shared"], report["results"]["one-row-each"]
    assert report["same_tokens"]
    assert shared["per_run"]["shared_prefill_requests"] == 4 and each["per_run"]["shared_prefill_requests"] == 0
    assert shared["per_run"]["prefill_tokens"] * 3 == each["per_run"]["prefill_tokens"]
    assert shared["prefill_ms"] > 0 and each["end_to_end_ms"] > 0
    assert engine_module.share_rows is share_rows  # the engine is left as it was
