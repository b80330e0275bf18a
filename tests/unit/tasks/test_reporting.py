"""Charts: one helper draws every PNG (the reward curve, `trajflow eval`'s bars) and always closes its figure."""

from __future__ import annotations

import base64
import struct

import matplotlib.pyplot as plt
import pytest

from flows.evaluate import _bar_chart
from tasks.support.reporting import chart_png, png_markdown, reward_curve_png


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
