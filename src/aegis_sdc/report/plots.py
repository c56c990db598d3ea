"""Plots of a run, read back from its store (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from aegis_sdc.store.sqlite import reading


def _series(conn: sqlite3.Connection):
    """site name → (step, max_row, threshold_row, max_col, threshold_col) over calibrated, checked steps.

    During calibration the threshold is the loose worst-case bound; those steps are left out.
    """
    series: dict[str, list[tuple]] = {}
    for name, step, max_row, thr_row, max_col, thr_col in conn.execute(
        "SELECT s.name, t.step, t.max_row, t.threshold_row, t.max_col, t.threshold_col FROM step_stats t"
        " JOIN sites s ON s.id = t.site_id WHERE t.checks > 0 AND t.calibrating = 0 ORDER BY s.id, t.step"
    ):
        series.setdefault(name, []).append((step, max_row, thr_row, max_col, thr_col))
    return series


def plot_site_differences(db_path: str | Path, out_png: str | Path, highlight: str | None = None) -> Path:
    """Per-site checksum differences against thresholds over the steps.

    Top: every site's largest normalized difference divided by its threshold (1 = alarm line);
    confirmed incidents are marked. Bottom: one site (the `highlight`, else the one with the most
    incidents, else the one closest to its threshold) with its raw value and threshold, log scale.
    """
    with reading(db_path) as conn:
        series = _series(conn)
        incidents = conn.execute(
            "SELECT s.name, i.step FROM incidents i JOIN sites s ON s.id = i.site_id ORDER BY i.step"
        ).fetchall()
    if highlight is None:
        if incidents:
            names = [n for n, _ in incidents]
            highlight = max(set(names), key=names.count)
        elif series:
            highlight = max(series, key=lambda n: max((r[1] or 0) / (r[2] or 1) for r in series[n]))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), constrained_layout=True)
    for name, rows in series.items():
        steps = [r[0] for r in rows]
        ratios = [max((r[1] or 0) / r[2] if r[2] else 0, (r[3] or 0) / r[4] if r[4] else 0) for r in rows]
        is_hl = name == highlight
        top.plot(
            steps,
            ratios,
            lw=1.4 if is_hl else 0.6,
            color="tab:red" if is_hl else "0.6",
            alpha=1.0 if is_hl else 0.5,
            label=name if is_hl else None,
            zorder=3 if is_hl else 1,
        )
    top.axhline(1.0, color="black", ls="--", lw=1, label="threshold")
    if incidents:
        top.scatter(
            [s for _, s in incidents],
            [1.0] * len(incidents),
            marker="v",
            color="tab:red",
            s=40,
            zorder=4,
            label="confirmed SDC",
        )
    top.set_yscale("log")
    top.set_xlabel("step")
    top.set_ylabel("largest difference / threshold")
    top.set_title(f"{len(series)} sites: normalized checksum differences against their thresholds (after calibration)")
    top.legend(loc="upper right", fontsize=8)

    if highlight and highlight in series:
        rows = series[highlight]
        steps = [r[0] for r in rows]
        bottom.plot(steps, [r[1] for r in rows], color="tab:blue", lw=1, label="row: largest difference")
        bottom.plot(steps, [r[2] for r in rows], color="tab:blue", ls="--", lw=1, label="row: threshold")
        if any(r[4] for r in rows):
            bottom.plot(steps, [r[3] for r in rows], color="tab:green", lw=1, label="col: largest difference")
            bottom.plot(steps, [r[4] for r in rows], color="tab:green", ls="--", lw=1, label="col: threshold")
        hits = [s for n, s in incidents if n == highlight]
        if hits:
            for s in hits:
                bottom.axvline(s, color="tab:red", lw=0.8, alpha=0.6)
            bottom.plot([], [], color="tab:red", lw=0.8, label="confirmed SDC")
        bottom.set_yscale("log")
        bottom.set_xlabel("step")
        bottom.set_ylabel("normalized difference (units of u·s)")
        bottom.set_title(highlight)
        bottom.legend(loc="upper right", fontsize=8)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
