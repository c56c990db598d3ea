"""Plots of a study, read back from its store (matplotlib, Agg backend).

compute-sync: the mismatch heatmap (submodule × phase against step). param-sync: the gradient
deviation over steps. free-run: parameter divergence against the reseeded baseline, and the loss
curves with spikes marked. Steps where the suspect's fault struck are marked on every plot.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from aegis_sdc.store.sqlite import read_study


def plot_study(db_path: str | Path, out_dir: str | Path) -> list[Path]:
    study = read_study(db_path)
    out_dir = Path(out_dir)
    rows = study["rows"]
    fault_steps = sorted({step for step, _, metric, _ in rows if metric == "fault"})
    if study["mode"] == "compute-sync":
        return [_heatmap(rows, fault_steps, out_dir / "study-mismatch-heatmap.png")]
    if study["mode"] == "param-sync":
        return [_grad_deviation(rows, fault_steps, out_dir / "study-grad-deviation.png")]
    return [
        _divergence(rows, fault_steps, out_dir / "study-divergence.png"),
        _losses(rows, fault_steps, out_dir / "study-loss.png"),
    ]


def _mark_faults(ax, fault_steps: list[int]) -> None:
    """Red ticks along the top edge at the steps where a fault struck (lines would hide the data)."""
    if fault_steps:
        ax.plot(fault_steps, [1.0] * len(fault_steps), "v", color="tab:red", markersize=5, clip_on=False,
                transform=ax.get_xaxis_transform(), label="fault struck")  # fmt: skip


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _mark_nonfinite(ax, steps: list[int], color, label: str) -> None:
    """Values that cannot be drawn (inf, NaN): an x along the top edge."""
    ax.plot(steps, [0.97] * len(steps), "x", markersize=4, color=color, clip_on=False,
            transform=ax.get_xaxis_transform(), label=label)  # fmt: skip


def _finish(fig, ax, fault_steps: list[int], path: Path, *, ylabel: str, title: str, **legend) -> Path:
    _mark_faults(ax, fault_steps)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax, **legend)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _heatmap(rows, fault_steps: list[int], path: Path) -> Path:
    """log10 of the mismatch frequency per (submodule, phase) and step; white where nothing differed."""
    scopes: list[str] = []
    steps = sorted({step for step, scope, _, _ in rows if scope == "loss"})
    values: dict[tuple[str, int], float] = {}
    for step, scope, metric, value in rows:
        if metric == "mismatch_frequency":
            if scope not in scopes:
                scopes.append(scope)
            values[(scope, step)] = value
    grid = np.full((len(scopes), len(steps)), np.nan)
    for i, scope in enumerate(scopes):
        for j, step in enumerate(steps):
            v = values.get((scope, step), 0.0)
            if v > 0:
                grid[i, j] = math.log10(v)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.22 * len(scopes) + 1.5)))
    if np.isfinite(grid).any():
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(scopes) - 0.5, -0.5))  # fmt: skip
        fig.colorbar(image, ax=ax, label="log10 mismatch frequency (mismatched / elements)")
    else:
        ax.text(0.5, 0.5, "no submodule differed", transform=ax.transAxes, ha="center")
        ax.set_xlim(steps[0] - 0.5 if steps else 0, steps[-1] + 0.5 if steps else 1)
        ax.set_ylim(len(scopes) - 0.5, -0.5)
    ax.set_yticks(range(len(scopes)), scopes, fontsize=6)
    title = "compute-sync: where the suspect's submodules differ (outputs overwritten after each)"
    return _finish(fig, ax, fault_steps, path, ylabel="submodule / phase", title=title, loc="upper right", fontsize=7)


def _log_series(ax, series: dict[str, list[tuple[int, float]]], styles: dict[str, dict], lines: bool = True) -> bool:
    """Positive values on a log axis; zeros cannot be drawn there and are left out, non-finite values
    are marked with an x along the top edge."""
    drew = False
    for name, points in series.items():
        style = {"linewidth": 0.8, "marker": ".", "markersize": 4, **styles.get(name, {})}
        shown = [(s, v) for s, v in points if v > 0 and math.isfinite(v)]
        if shown:
            xs, ys = zip(*shown, strict=True)
            ax.plot(xs, ys, linestyle="-" if lines else "none", label=name, **style)
            drew = True
        broken = [s for s, v in points if not math.isfinite(v)]
        if broken:
            _mark_nonfinite(ax, broken, style.get("color"), f"{name}: not finite")
            drew = True
    if drew:
        ax.set_yscale("log")
    return drew


def _grad_deviation(rows, fault_steps: list[int], path: Path) -> Path:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for step, scope, metric, value in rows:
        if metric == "grad_deviation":
            series[scope].append((step, value))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if not _log_series(ax, dict(series), {"all": {"color": "black", "markersize": 6}}, lines=False):
        ax.text(0.5, 0.5, "no gradient deviated (all exactly zero)", transform=ax.transAxes, ha="center")
    title = "param-sync: gradient deviation of the suspect (parameters synced every step)"
    return _finish(fig, ax, fault_steps, path, ylabel="‖g_s − g_h‖ / ‖g_h‖", title=title, fontsize=6, ncol=2)


def _divergence(rows, fault_steps: list[int], path: Path) -> Path:
    series: dict[str, list[tuple[int, float]]] = {"suspect vs healthy": [], "reseeded healthy vs healthy": []}
    for step, scope, metric, value in rows:
        if metric == "param_divergence" and scope == "all":
            series["suspect vs healthy"].append((step, value))
        elif metric == "param_divergence" and scope == "baseline":
            series["reseeded healthy vs healthy"].append((step, value))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    styles = {"suspect vs healthy": {"color": "tab:red"}, "reseeded healthy vs healthy": {"color": "tab:gray"}}
    _log_series(ax, series, styles)
    title = "free-run: parameter divergence against the natural divergence of a reseeded run"
    return _finish(fig, ax, fault_steps, path, ylabel="‖θ − θ_h‖ / ‖θ_h‖", title=title, fontsize=7)


def _losses(rows, fault_steps: list[int], path: Path) -> Path:
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    spikes: dict[str, list[int]] = defaultdict(list)
    for step, scope, metric, value in rows:
        if scope == "loss":
            curves[metric].append((step, value))
        elif scope == "spike" and metric != "suspect_only" and value:
            spikes[metric].append(step)
    colors = {"healthy": "tab:blue", "suspect": "tab:red", "baseline": "tab:gray"}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, points in curves.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, linewidth=0.9, color=colors.get(name), label=name)
        loss_at = dict(points)
        marked = [s for s in spikes.get(name, []) if math.isfinite(loss_at[s])]
        if marked:
            ax.scatter(marked, [loss_at[s] for s in marked], marker="x", color=colors.get(name), zorder=3,
                       label=f"{name} spikes")  # fmt: skip
        broken = [s for s, v in points if not math.isfinite(v)]
        if broken:
            _mark_nonfinite(ax, broken, colors.get(name), f"{name} loss not finite")
    return _finish(fig, ax, fault_steps, path, ylabel="loss (nats)", title="free-run: loss curves, spikes marked",
                   fontsize=7)  # fmt: skip
