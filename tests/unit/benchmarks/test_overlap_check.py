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


def test_compare_counts_differing_completions_and_names_the_first_difference():
    from backends.inference.engine import Completion

    def done(tokens, lps, finish="length", stop=None):
        return Completion(tokens, lps, None, finish, "", stop)

    mix = [{"kind": "length"}, {"kind": "stop_token"}]
    off = [[done([4, 5, 6], [-1.0, -2.0, -3.0])], [done([7, 8], [-1.0, -1.0], "stop", 8), done([9], [-0.5])]]
    on = [[done([4, 5, 7], [-1.0, -2.25, -3.0])], [done([7, 8, 1], [-1.0, -1.0, -2.0]), done([9], [-0.5])]]
    got = bench.compare(mix, off, on)
    assert (got["completions"], got["differing_completions"], got["max_logprob_diff"]) == (3, 2, 0.25)
    assert got["first_difference"]["token_index"] == 2 and got["first_difference"]["request"] == 0
    assert (got["first_difference"]["off"]["token_there"], got["first_difference"]["on"]["token_there"]) == (6, 7)
    assert got["finish_reasons"] == {"length:NoneType": 2, "stop:int": 1}
    assert "0 of 3" not in bench.verdict({"waves": got}, "cpu") and "2 of 3" in bench.verdict({"waves": got}, "cpu")
