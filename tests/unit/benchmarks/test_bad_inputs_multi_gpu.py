"""Catalogue of bad inputs to benchmarks/multi_gpu.py: each is one line on stderr naming what is wrong, exit 2, and a
result file already there is left as it was (checked before any measurement, so no torch or GPU is needed)."""

from __future__ import annotations

import json

import pytest

from benchmarks import multi_gpu

SMOKE_RESULT = json.dumps({"smoke": True, "parts": {}, "summary": {}})
BAD_INPUTS = [  # (arguments, existing --out content or None, words the message must contain)
    (["--smoke", "--parts", "train,eval"], None, "--parts: unknown part(s) 'eval'"),
    (["--smoke", "--parts", ","], None, "--parts: no part given"),
    (["--smoke", "--budget-s", "0"], None, "--budget-s: '0' is not a positive number"),
    (["--smoke", "--budget-s", "soon"], None, "--budget-s: 'soon' is not a positive number"),
    (["--smoke", "--budget-s", "nan"], None, "--budget-s: 'nan' is not a positive number"),
    (["--smoke"], "{broken", "not readable as JSON"),
    (["--smoke"], json.dumps({"summary": {}}), "not a multi_gpu.py result with 'parts'"),
    (["--smoke"], json.dumps({"smoke": True, "parts": {"eval": {}}}), "not a multi_gpu.py result with 'parts'"),
    ([], SMOKE_RESULT, "holds a smoke run, this is a GPU run; they do not merge"),
    (["--smoke"], SMOKE_RESULT.replace("true", "false"), "holds a GPU run, this is a smoke run"),
]


@pytest.mark.parametrize(("args", "existing", "message"), BAD_INPUTS)
def test_bad_inputs_multi_gpu(tmp_path, capsys, args, existing, message):
    out = tmp_path / "r.json"
    if existing is not None:
        out.write_text(existing)
    with pytest.raises(SystemExit) as stop:
        raise SystemExit(multi_gpu.main([*args, "--out", str(out)]))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert (out.read_text() if out.exists() else None) == existing
    assert not out.with_suffix(".md").exists()

