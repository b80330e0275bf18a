"""benchmarks/overlap_check.py --smoke end to end on the CPU: the mix completes alike with overlap off and on, every
figure of the summary is there, and the exit status says so."""

import json

from benchmarks import overlap_check as bench


def test_smoke_run_checks_completions_and_measures_both_modes(tmp_path):
    out = tmp_path / "overlap-check.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert not report["errors"] and report["partial"] is False
    assert list(report["summary"]) == list(bench.SUMMARY_KEYS)
    assert report["summary"]["equal_completions"] is True
    assert all(v is not None and v > 0 for k, v in report["summary"].items() if k.startswith(("tok_s", "decode")))
    assert report["engines"]["off"]["overlap"] is False and report["engines"]["on"]["overlap"] is True
    assert report["summary"]["equal_completions_same_batches"] is True
    for name, waves, mix in (("waves", 3, "mix"), ("one_admission", 1, "mix"), ("same_batches", 1, "same_length_mix")):
        got = report["check"][name]
        assert got["waves"] == waves and got["differing_completions"] == 0 and got["first_difference"] is None
        assert got["completions"] == sum(r["n"] for r in report["config"][mix])
        if mix == "mix":  # sequences end on length, on a stop token and on a stop string
            assert {"length:NoneType", "stop:int", "stop:str"} <= set(got["finish_reasons"]), got["finish_reasons"]
        else:  # all on length, at the same step
            assert got["finish_reasons"] == {"length:NoneType": got["completions"]}
    assert report["check"]["same_batches"]["max_logprob_diff"] == 0  # the same batches: the same numbers
    assert [(r["round"], r["overlap"]) for r in report["rounds"]] == [(0, "off"), (0, "on"), (1, "off"), (1, "on")]
    assert all(r["batch1"]["rows_per_step"] <= 1.5 for r in report["rounds"])
    assert report["hardware"]["cpu_count"] and report["versions"]["torch"] and "--smoke" in report["command"]
