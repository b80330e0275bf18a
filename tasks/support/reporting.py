"""What people look at: a per-step table and the reward curve, as files and Prefect artifacts.

Every chart of the project (this reward curve, `trajflow eval`'s bar chart) is drawn through
``chart_png`` and shown in a Prefect artifact through ``png_markdown``.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Callable
from typing import Any

from storage.layout import REWARD_CURVE

log = logging.getLogger("trajflow")

CURVE_KEYS = ("train/reward", "val/reward")


def step_history(store) -> list[dict[str, Any]]:
    """[{step, **metrics}] for every committed step, from the manifests alone."""
    rows = []
    for step in store.committed_steps():
        rows.append({"step": step, **store.read_manifest(step).metrics})
    return rows


def chart_png(draw: Callable[[Any], None], figsize: tuple[float, float]) -> bytes:
    """A chart as PNG bytes: ``draw(ax)`` fills the axes of a fresh ``figsize``-inch figure at 100 dpi.

    matplotlib's Agg backend renders without a display (flows run on headless workers); the layout is
    tightened so labels are not cut off, and the figure is closed so a long-lived worker does not
    keep every chart it drew.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=100)
    try:
        draw(ax)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    return buf.getvalue()


def png_markdown(alt: str, png: bytes) -> str:
    """Markdown that shows ``png`` inline (a data URL): what a Prefect markdown artifact can display."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def reward_curve_png(history: list[dict[str, Any]], title: str) -> bytes:
    """Train (and validation, where evaluated) mean reward per step as a PNG."""

    def draw(ax) -> None:
        for key, style in zip(CURVE_KEYS, ("o-", "s--")):
            pts = [(r["step"], r[key]) for r in history if key in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()

    return chart_png(draw, figsize=(6, 3.5))


def format_step_line(step: int, metrics: dict[str, float]) -> str:
    keys = ["train/reward", "val/reward", "train/loss", "train/grad_norm", "train/failed"]
    parts = [f"{k}={metrics[k]:.4f}" for k in keys if k in metrics]
    return f"step {step}: " + " ".join(parts)


def publish_run_artifacts(store, run: str) -> None:
    """Store the reward curve at run level; add table + curve artifacts when inside a Prefect run."""
    history = step_history(store)
    if not history:
        return
    png = reward_curve_png(history, f"{run}: reward per step")
    store.put_bytes(None, REWARD_CURVE, png)
    try:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:
            return
        keys = sorted({k for row in history for k in row if k != "step"})
        table = [{"step": r["step"], **{k: round(float(r[k]), 5) for k in keys if k in r}} for r in history]
        key = "".join(c if c.isalnum() else "-" for c in run.lower())
        create_table_artifact(table, key=f"{key}-steps", description=f"{run}: metrics per committed step")
        create_markdown_artifact(png_markdown("reward curve", png), key=f"{key}-reward-curve",
                                 description=f"{run}: reward per step")
    except Exception as exc:  # noqa: BLE001 - artifacts are a view; never fail a step for them
        log.warning("could not publish Prefect artifacts: %s", exc)
