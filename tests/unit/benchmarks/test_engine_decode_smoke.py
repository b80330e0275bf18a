"""benchmarks/engine_decode.py --smoke on the CPU for the one-slot and merged variants: both run, the merged step's
logprobs are the one-slot step's (float32: float rounding only) and a rebuild of the merged weights is timed."""

import json

from benchmarks import engine_decode as bench


def test_smoke_run_of_the_one_slot_and_merged_variants(tmp_path):
    out = tmp_path / "engine-decode.json"
    assert bench.main(["--smoke", "--variants", "single_slot,merged", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    single, merged = report["variants"]["single_slot"], report["variants"]["merged"]
    assert "error" not in single and "error" not in merged, report["variants"]
    for batch in report["batches"]:
        assert merged[f"batch_{batch}"]["step_ms"] > 0
        assert merged[f"batch_{batch}"]["max_abs_logprob_diff_vs_first"] <= 1e-4
    assert merged["merge_rebuild_ms"] > 0 and "merge_rebuild_ms" not in single
    assert set(report["summary"]["decode_ms_batch1"]) == {"single_slot", "merged"}
    assert "| merged |" in out.with_suffix(".md").read_text()
