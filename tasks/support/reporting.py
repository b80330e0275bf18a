"""What people look at: a per-step table and the reward curve, as files and Prefect artifacts.

Every chart of the project (this reward curve, `trajflow eval`'s bar chart) is drawn through
``chart_png`` and shown in a Prefect artifact through ``png_markdown``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
from collections.abc import Callable
from typing import Any

from storage.layout import REWARD_CURVE

log = logging.getLogger("trajflow")

CURVE_KEYS = ("train/reward", "val/reward")


def step_history(store) -> list[dict[str, Any]]:
    """[{step, **metrics}] for every committed step, from the manifests alone (read once, together)."""
    return [{"step": step, **manifest.metrics} for step, manifest in store.manifests().items()]


def chart_png(draw: Callable[[Any], None], figsize: tuple[float, float], ncols: int = 1) -> bytes:
    """A chart as PNG bytes: ``draw(ax)`` fills the axes of a fresh ``figsize``-inch figure at 100 dpi (with
    ``ncols`` > 1, ``draw`` gets that many axes side by side).

    matplotlib's Agg backend renders without a display (flows run on headless workers); the layout is
    tightened so labels are not cut off, and the figure is closed so a long-lived worker does not
    keep every chart it drew.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, ncols, figsize=figsize, dpi=100)
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


STEP_LINE_KEYS = ("train/reward", "val/reward", "train/loss", "train/grad_norm", "train/failed")
TABLE_FIRST_KEYS = ("train/reward", "val/reward", "train/loss")


def format_step_line(step: int, metrics: dict[str, float], policy: str) -> str:
    """The console's line for a committed step: its key metrics, the policy now served and the publish check.

    Step 0 is the untrained LoRA, or with ``sft`` the adapter trained on demonstrations (then ``sft/loss`` is in its
    metrics), so its line says which and what it was checked against.
    """
    parts = []
    if step == 0:
        parts = [f"the SFT'd policy, sft/loss={metrics['sft/loss']:.4f}" if "sft/loss" in metrics
                 else "the untrained policy"]
    parts += [f"{k}={metrics[k]:.4f}" for k in STEP_LINE_KEYS if k in metrics]
    served = f"served as {policy}"
    if "publish/probe_max_abs_diff" in metrics and "publish/probe_tolerance" in metrics:
        served += (f" (probe max |logprob diff| {metrics['publish/probe_max_abs_diff']:.2g}"
                   f" <= {metrics['publish/probe_tolerance']:g})")
    parts.append(served)
    if "time/step_s" in metrics:
        parts.append(f"in {metrics['time/step_s']:.0f} s")
    return f"step {step}: " + ", ".join(parts)


def artifact_key(store, name: str) -> str:
    """``<project>-<run>-<8 hex of the run's URL>-<name>``: one history per run, whatever another run is called.

    Prefect artifact keys hold lowercase letters, digits and dashes only; project and run names also allow
    capitals, ``.`` and ``_``, so two names can map to one spelling: the URL's digest keeps them apart, and runs
    named alike in other projects or storage roots too.
    """
    def slug(text: str) -> str:
        return "".join(c if c.isascii() and c.isalnum() else "-" for c in text.lower())

    digest = hashlib.sha256(store.url.encode()).hexdigest()[:8]
    return f"{slug(store.project)}-{slug(store.run)}-{digest}-{name}"


def steps_table(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per committed step, every row with the same keys: step, rewards and loss, then the rest sorted.

    A metric a step lacks (step 0 trains nothing; validation runs every `eval_every` steps) is None there, so a
    table whose columns are taken from its first row still shows every metric.
    """
    seen = {k for row in history for k in row if k != "step"}
    keys = [k for k in TABLE_FIRST_KEYS if k in seen] + sorted(seen - set(TABLE_FIRST_KEYS))
    return [{"step": row["step"], **{k: round(float(row[k]), 5) if k in row else None for k in keys}}
            for row in history]


def publish_run_artifacts(store) -> None:
    """Store the reward curve at run level; add table + curve artifacts when inside a Prefect run."""
    history = step_history(store)
    if not history:
        return
    png = reward_curve_png(history, f"{store.run}: reward per step")
    store.put_bytes(None, REWARD_CURVE, png)
    try:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:
            return
        name = f"{store.project}/{store.run}"
        create_table_artifact(steps_table(history), key=artifact_key(store, "steps"),
                              description=f"{name}: metrics per committed step")
        create_markdown_artifact(png_markdown("reward curve", png), key=artifact_key(store, "reward-curve"),
                                 description=f"{name}: reward per step")
    except Exception as exc:  # noqa: BLE001 - artifacts are a view; never fail a step for them
        log.warning("could not publish Prefect artifacts: %s", exc)
