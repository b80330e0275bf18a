"""What people look at: one chart helper for every PNG, the console's step line, the Prefect UI's steps table."""

from __future__ import annotations

import base64
import json
import re
import struct

import matplotlib.pyplot as plt
import pytest

from flows.evaluate import _bar_chart
from tasks.support.reporting import (
    artifact_key,
    chart_png,
    format_step_line,
    png_markdown,
    publish_run_artifacts,
    reward_curve_png,
    step_history,
    steps_table,
)


def _size(png: bytes) -> tuple[int, int]:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", png[16:24])


def test_chart_png_draws_at_100_dpi_and_closes_the_figure():
    before = plt.get_fignums()
    png = chart_png(lambda ax: ax.plot([0, 1], [1, 0]), figsize=(5, 2))
    assert _size(png) == (500, 200)
    assert plt.get_fignums() == before


def test_chart_png_closes_the_figure_when_drawing_fails():
    before = plt.get_fignums()

    def draw(ax):
        raise RuntimeError("bad data")

    with pytest.raises(RuntimeError, match="bad data"):
        chart_png(draw, figsize=(5, 2))
    assert plt.get_fignums() == before


def test_the_reward_curve_and_the_evaluation_bars_are_drawn_by_it():
    history = [{"step": 1, "train/reward": 0.1}, {"step": 2, "train/reward": 0.4, "val/reward": 0.3}]
    assert _size(reward_curve_png(history, "run: reward per step")) == (600, 350)
    results = [{"policy": f"run@{i}", "val/reward": i / 10} for i in range(6)]
    assert _size(_bar_chart(results[:1])) == (400, 350)  # at least 4 inches wide
    assert _size(_bar_chart(results)) == (720, 350)  # 1.2 inches a bar


def test_png_markdown_embeds_the_bytes():
    png = chart_png(lambda ax: None, figsize=(1, 1))
    markdown = png_markdown("chart", png)
    assert markdown.startswith("![chart](data:image/png;base64,") and markdown.endswith(")")
    assert base64.b64decode(markdown[len("![chart](data:image/png;base64,"):-1]) == png


STEP0 = {"publish/probe_max_abs_diff": 4.8e-07, "publish/probe_mean_abs_diff": 2.7e-07, "publish/probe_tolerance": 0.05,
         "publish/probe_common_prefix": 16.0}


def test_the_step_0_line_says_what_step_0_is():
    line = format_step_line(0, STEP0, "tiny@0")
    assert line == "step 0: the untrained policy, served as tiny@0 (probe max |logprob diff| 4.8e-07 <= 0.05)"
    later = format_step_line(3, {**STEP0, "train/reward": 0.25, "train/loss": -0.01, "time/step_s": 41.2}, "tiny@3")
    assert later.startswith("step 3: train/reward=0.2500, train/loss=-0.0100, served as tiny@3")
    assert later.endswith(", in 41 s")


def _store_with_steps(root, project="p", run="same-name"):
    from storage.store import RunStore

    store = RunStore(str(root), project, run)
    store.commit(0, STEP0)  # step 0 has the publish check only
    store.commit(1, {**STEP0, "train/loss": -0.1, "train/reward": 0.5, "train/grad_norm": 1.0, "time/step_s": 3.0})
    store.commit(2, {**STEP0, "train/loss": -0.2, "train/reward": 0.7, "val/reward": 0.6, "time/step_s": 2.0})
    return store


def test_every_row_of_the_steps_table_has_the_same_columns_rewards_and_loss_first(tmp_path):
    table = steps_table(step_history(_store_with_steps(tmp_path)))
    assert [list(row) for row in table] == [list(table[0])] * 3
    assert list(table[0])[:4] == ["step", "train/reward", "val/reward", "train/loss"]
    assert table[0]["train/reward"] is None and table[2]["val/reward"] == 0.6


def test_the_artifact_key_is_a_valid_prefect_key_per_project_storage_and_run(tmp_path):
    from prefect.types.names import LOWERCASE_LETTERS_NUMBERS_AND_DASHES_ONLY_REGEX as VALID

    keys = {artifact_key(_store_with_steps(tmp_path / root, project, run), "steps")
            for root, project, run in [("a", "p", "Same_Name.v2"), ("a", "other", "Same_Name.v2"),
                                       ("b", "p", "Same_Name.v2"), ("a", "p", "same-name-v2")]}
    assert len(keys) == 4  # other project, other storage, a name that slugs alike: four histories
    for key in keys:
        assert re.fullmatch(VALID, key) and key.startswith(("p-same-name-v2-", "other-same-name-v2-")), key


def test_the_steps_artifact_in_prefect_has_every_metric_in_every_row(prefect_api, tmp_path):
    from prefect import flow
    from prefect.artifacts import Artifact

    store = _store_with_steps(tmp_path)

    @flow
    def publish():
        publish_run_artifacts(store)

    publish()
    stored = Artifact.get(artifact_key(store, "steps"))
    rows = json.loads(stored.data) if isinstance(stored.data, str) else stored.data
    assert len(rows) == 3 and all(list(row) == list(rows[0]) for row in rows)
    assert list(rows[0])[:4] == ["step", "train/reward", "val/reward", "train/loss"]
    assert Artifact.get(artifact_key(store, "reward-curve")).data.startswith("![reward curve](data:image/png;base64,")
