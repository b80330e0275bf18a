"""The catalogue of bad inputs to `trajflow backend serve`: every one we know of, with the answer it must get.

Each row is one request to the real server (uvicorn, a LocalBackend on tiny-random, an API key) through httpx: a
4xx with a message naming what is wrong, never a 500 or a traceback, and nothing stored that should not be. Add a
row for every new bad input found.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.fixtures_backend import BACKEND_KEY, start_backend_server

PROJECT, NAME = "cat", "registered"
REF = {"project": PROJECT, "name": NAME}
KEY = {"Authorization": f"Bearer {BACKEND_KEY}"}
JSON = {**KEY, "content-type": "application/json"}
MODEL = {**REF, "base_model": "tiny-random"}
TURN = {"role": "user", "content": "hi"}
GROUP = {"trajectories": [{"reward": 1.0, "messages_and_choices": [TURN]}]}

# (id, method, path, json body | raw bytes, headers, expected status, text the answer must contain)
CASES = [
    # --- the key: only "Authorization: Bearer <key>", on every route but /health --------------------------------
    ("no-key", "POST", "/backend/step", REF, {}, 401, "Bearer"),
    ("bare-key-without-bearer", "POST", "/backend/step", REF, {"Authorization": BACKEND_KEY}, 401, "Bearer"),
    ("basic-scheme", "POST", "/backend/step", REF, {"Authorization": f"Basic {BACKEND_KEY}"}, 401, "Bearer"),
    ("wrong-key", "POST", "/backend/step", REF, {"Authorization": "Bearer nope"}, 401, "wrong API key"),
    ("key-as-query", "POST", f"/backend/step?api_key={BACKEND_KEY}", REF, {}, 401, "Bearer"),
    ("openapi-without-key", "GET", "/openapi.json", None, {}, 401, "API key"),
    ("docs-without-key", "GET", "/docs", None, {}, 401, "API key"),
    ("redoc-without-key", "GET", "/redoc", None, {}, 401, "API key"),
    ("unknown-route-without-key", "GET", "/backend/nothing", None, {}, 401, "API key"),
    # --- bodies that are not the request's shape ---------------------------------------------------------------
    ("malformed-json", "POST", "/backend/register", b'{"name": "x",', JSON, 422, "JSON decode error"),
    ("json-array-body", "POST", "/backend/register", b"[1, 2]", JSON, 422, "valid dictionary"),
    ("empty-body", "POST", "/backend/register", b"", JSON, 422, "Field required"),
    ("register-without-base-model", "POST", "/backend/register", REF, KEY, 422, "base_model"),
    ("register-name-not-a-string", "POST", "/backend/register", {**MODEL, "name": 5}, KEY, 422, "valid string"),
    ("register-unknown-field", "POST", "/backend/register", {**MODEL, "lora_rank": 8}, KEY, 422, "lora_rank"),
    ("step-unknown-field", "POST", "/backend/step", {**REF, "step": 3}, KEY, 422, "Extra inputs"),
    ("train-typo-in-groups", "POST", "/backend/train", {**REF, "grups": [GROUP]}, KEY, 422, "groups"),
    ("train-groups-not-a-list", "POST", "/backend/train", {**REF, "groups": "x"}, KEY, 422, "valid list"),
    ("train-trajectories-not-a-list", "POST", "/backend/train", {**REF, "groups": [{"trajectories": "x"}]}, KEY,
     422, "invalid trajectory group"),
    ("train-negative-learning-rate", "POST", "/backend/train", {**REF, "groups": [GROUP],
                                                                "config": {"learning_rate": -1}}, KEY, 422,
     "greater than 0"),
    ("train-unknown-config-key", "POST", "/backend/train", {**REF, "groups": [GROUP], "config": {"lr": 1e-5}}, KEY,
     422, "Extra inputs"),
    ("log-split-not-a-string", "POST", "/backend/log", {**REF, "groups": [GROUP], "split": 5}, KEY, 422,
     "valid string"),
    ("prune-metric-not-a-string", "POST", "/backend/delete_checkpoints", {**REF, "best_checkpoint_metric": 5}, KEY,
     422, "valid string"),
    ("get-on-a-post-route", "GET", "/backend/train", None, KEY, 405, "Method Not Allowed"),
    # --- well-formed, but wrong ---------------------------------------------------------------------------------
    ("unknown-base-model", "POST", "/backend/register", {**MODEL, "name": "typo", "base_model": "tiny-randon"}, KEY,
     400, "unknown model 'tiny-randon'"),
    ("project-escapes-the-root", "POST", "/backend/register", {**MODEL, "project": "../x"}, KEY, 400,
     "invalid project name"),
    ("run-name-with-slash", "POST", "/backend/register", {**MODEL, "name": "a/b"}, KEY, 400, "invalid run name"),
    ("lora-rank-unbounded", "POST", "/backend/register", {**MODEL, "name": "huge", "trainer": {"lora_rank": 50000}},
     KEY, 400, "lora_rank: Input should be less than or equal to 512"),
    ("lora-rank-above-the-servers", "POST", "/backend/register",
     {**MODEL, "name": "big", "trainer": {"lora_rank": 128}}, KEY, 400, "max_lora_rank 64"),
    ("lora-rank-not-a-number", "POST", "/backend/register", {**MODEL, "name": "nan", "trainer": {"lora_rank": "x"}},
     KEY, 400, "lora_rank"),
    ("unknown-trainer-setting", "POST", "/backend/register", {**MODEL, "name": "typo2", "trainer": {"nope": 1}}, KEY,
     400, "nope: Extra inputs are not permitted"),
    ("re-register-other-base-model", "POST", "/backend/register", {**MODEL, "base_model": "smollm2-135m"}, KEY, 400,
     "'tiny-random', not 'smollm2-135m'"),
    ("re-register-other-adapter-shape", "POST", "/backend/register", {**MODEL, "trainer": {"lora_rank": 16}}, KEY,
     400, "lora_rank: 8 -> 16"),
    ("step-unknown-model", "POST", "/backend/step", {**REF, "name": "ghost"}, KEY, 404, "cat/ghost is not registered"),
    ("train-unknown-model", "POST", "/backend/train", {**REF, "name": "ghost", "groups": [GROUP]}, KEY, 404,
     "cat/ghost is not registered"),
    ("train-no-groups", "POST", "/backend/train", {**REF, "groups": []}, KEY, 400, "at least one trajectory group"),
    ("log-unknown-model", "POST", "/backend/log", {**REF, "name": "ghost", "groups": [GROUP]}, KEY, 404,
     "not registered"),
    ("log-empty-split", "POST", "/backend/log", {**REF, "groups": [GROUP], "split": ""}, KEY, 400,
     "invalid split name ''"),
    ("log-dot-split", "POST", "/backend/log", {**REF, "groups": [GROUP], "split": "."}, KEY, 400,
     "invalid split name '.'"),
    ("log-split-with-slash", "POST", "/backend/log", {**REF, "groups": [GROUP], "split": "a/b"}, KEY, 400,
     "invalid split name 'a/b'"),
    ("log-split-escapes", "POST", "/backend/log", {**REF, "groups": [GROUP], "split": "../../x"}, KEY, 400,
     "invalid split name"),
    ("log-no-groups", "POST", "/backend/log", {**REF, "groups": [], "split": "val"}, KEY, 400,
     "log needs trajectories, trajectory groups or metrics"),
    ("log-step-not-committed", "POST", "/backend/log", {**REF, "metrics": {"x": 1.0}, "step": 99}, KEY, 400,
     "step 99 of cat/registered is not committed"),
    ("log-negative-step", "POST", "/backend/log", {**REF, "metrics": {"x": 1.0}, "step": -1}, KEY, 422,
     "greater than or equal to 0"),
    ("log-metric-not-a-number", "POST", "/backend/log", {**REF, "metrics": {"x": "high"}}, KEY, 422,
     "valid number"),
    ("fork-from-another-storage", "POST", "/backend/fork", {"model": {**MODEL, "name": "f1"}, "from_model": NAME,
                                                            "from_project": PROJECT, "from_storage": "/etc"}, KEY,
     400, "forks runs of its own storage only"),
    ("fork-unknown-source", "POST", "/backend/fork", {"model": {**MODEL, "name": "f2"}, "from_model": "ghost",
                                                      "from_project": PROJECT}, KEY, 400, "no run cat/ghost"),
    ("fork-source-escapes", "POST", "/backend/fork", {"model": {**MODEL, "name": "f3"}, "from_model": "../x",
                                                      "from_project": PROJECT}, KEY, 400, "invalid run name"),
    ("fork-into-itself", "POST", "/backend/fork", {"model": MODEL, "from_model": NAME, "from_project": PROJECT}, KEY,
     400, "into itself"),
    ("fork-missing-source", "POST", "/backend/fork", {"model": MODEL}, KEY, 422, "from_model"),
    ("prune-unknown-model", "POST", "/backend/delete_checkpoints", {**REF, "name": "ghost"}, KEY, 404,
     "not registered"),
]


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    handle = start_backend_server(str(tmp_path_factory.mktemp("catalogue") / "store"))
    assert handle.post("/backend/register", MODEL).status_code == 200
    yield handle
    handle.stop()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_4xx(server, case):
    _, method, path, body, headers, status, text = case
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.request(method, server.url + path, headers=headers, timeout=300, **kwargs)
    assert resp.status_code == status, resp.text[:1000]
    assert text in resp.text, resp.text[:1000]
    assert "Traceback" not in resp.text


def test_what_the_bad_inputs_left_in_storage(server):
    """Run after the table: refused requests stored nothing, the registered run is intact."""
    run = Path(server.storage) / PROJECT / NAME
    assert not (run / "steps" / "00000" / "logs").exists()  # no logs/.parquet, no logs/..parquet
    assert sorted(p.name for p in (run / "steps").iterdir()) == ["00000"]  # train [] committed no step
    assert json.loads((run / "run.json").read_text())["base_model"] == "tiny-random"
    assert json.loads((run / "run.json").read_text())["trainer"]["lora_rank"] == 8
    # registrations that failed leave their run names free: no run.json, no lease, nothing
    for name in ("typo", "huge", "big", "nan", "typo2"):
        assert not (Path(server.storage) / PROJECT / name / "run.json").exists(), name
        assert not (Path(server.storage) / PROJECT / name / "lease.json").exists(), name
    assert server.post("/backend/step", REF).json() == {"step": 0}
