"""benchmarks/completion_determinism.py on the CPU: its rounds run, and the streamed answers equal the plain ones."""

import json

from benchmarks import completion_determinism as bench


def test_rounds_run_and_find_no_mismatch(tiny_model_path, capsys):
    assert bench.main(["--device", "cpu", "--rounds", "3", "--prompts", "3", "--max-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rounds"] == 3 and report["mismatches"] == 0 and report["first_max_logprob_diff"] is None
