"""`aegis report`: one self-contained HTML page of a run, read back from every rank's store.

Everything is inline (CSS, plots as base64 PNG, no script), so the page opens offline and can be
attached to a ticket as one file. Site names and messages come from the user's model: the template
escapes everything it prints (autoescape on for every template, whatever its file name).
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import Environment, PackageLoader, StrictUndefined
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from aegis_sdc.store.sqlite import (
    RunStores,
    read_coverage,
    read_events,
    read_incidents,
    read_nonfinite,
    read_runs,
    read_site_series,
    read_site_summaries,
    read_step_totals,
    read_unattributed,
    read_verdict_counts,
    read_verdicts,
    read_warnings,
)

TOP_SITES = 6  # sites plotted against their thresholds; the table lists every site
MAX_ROWS = 500  # rows of one long table (events, verdicts); the rest are counted, not listed
COVERAGE_EVENTS = ("not_covered", "not_deterministic", "sampling_plan")


def write_report(run_dir: Path | RunStores, out: Path | None = None) -> Path:
    """Render the run in `run_dir` (all ranks' `aegis-rank*.sqlite`) as one HTML file; returns its
    path (default `RUN_DIR/aegis-report.html`). Raises StoreError when the directory holds no store,
    or any store is unreadable or damaged; given RunStores, reads its stores as it was opened."""
    page = render_report(run_dir)
    base = run_dir.run_dir if isinstance(run_dir, RunStores) else Path(run_dir)
    out = base / "aegis-report.html" if out is None else Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # a reader never sees half a page
    partial.write_text(page, encoding="utf-8")
    os.replace(partial, out)
    return out


def render_report(run_dir: Path | RunStores) -> str:
    """The page's HTML text."""
    if isinstance(run_dir, RunStores):
        run = _read_run(run_dir)
    else:
        with RunStores(run_dir) as stores:  # strict: an unreadable or damaged store raises StoreError
            run = _read_run(stores)
    _count_incidents(run["sites"], run["incidents"])
    context = {
        "run_dir": str(run["run_dir"]),
        "generated": _when(datetime.now(timezone.utc).timestamp()),
        "header": _header(run["runs"]),
        "summary": _summary(run),
        "incidents": [_incident_row(i) for i in run["incidents"]],
        "injected": _capped(_injected_rows(run["events"], run["incidents"])),
        "timeline_png": _timeline_png(run["steps"], run["incidents"]),
        "sites": run["sites"],
        "sites_png": _sites_png(run["top_sites"], run["site_series"], run["incidents"]),
        "top_sites": len(run["top_sites"]),
        "coverage": _coverage(run),
        "latency": _latency(run["verdicts"]),
        "verdicts": _capped(run["verdicts"]),
        "rank_warnings": _capped(run["warnings"]),
        "unattributed": _capped(run["unattributed"]),
        "config_warnings": [e for e in run["events"] if e["kind"] == "fault_unmatched"],
    }
    return _environment().get_template("report.html.j2").render(**context)


# -- reading ----------------------------------------------------------------------------------------
def _read_run(stores: RunStores) -> dict[str, Any]:
    # every store is opened once, read-only, and checked before any of these reads (RunStores)
    sites = _merge_sites(read_site_summaries(stores))
    top_sites = sites[:TOP_SITES]
    return {
        "run_dir": stores.run_dir,
        "runs": read_runs(stores),
        "steps": read_step_totals(stores),
        "sites": sites,
        "top_sites": top_sites,
        "site_series": read_site_series(stores, ((s["site"], s["worst_rank"]) for s in top_sites)),
        "nonfinite": read_nonfinite(stores),
        "events": read_events(stores),
        "verdicts": read_verdicts(stores),
        "incidents": read_incidents(stores),
        "verdict_counts": read_verdict_counts(stores),
        "warnings": read_warnings(stores),
        "unattributed": read_unattributed(stores),
        "coverage": read_coverage(stores),
    }


# -- sections -----------------------------------------------------------------------------------------
def _header(runs: list[dict[str, Any]]) -> dict[str, Any]:
    started = [r["started_wall"] for r in runs if r["started_wall"] is not None]
    finished = [r["finished_wall"] for r in runs if r["finished_wall"] is not None]
    all_finished = bool(runs) and len(finished) == len(runs)
    config = next((r["config"] for r in runs if r["config"]), None)
    return {
        "ranks": runs,
        "hosts": sorted({r["host"] for r in runs if r["host"]}),
        "devices": sorted({r["device"] for r in runs if r["device"]}),
        "world_size": max((r["world_size"] or 0 for r in runs), default=0),
        "started": _when(min(started)) if started else None,
        "finished": _when(max(finished)) if all_finished else None,
        "seconds": max(finished) - min(started) if all_finished and started else None,
        "config_summary": _config_summary(config) if config else [],
        "config": _flatten(config) if config else [],
        "versions": _versions(runs),
    }


def _config_summary(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The settings one reads first; keys missing from older stores are left out."""
    wanted = [
        ("backend", "backend"),
        ("checksums", "checksum"),
        ("sampling budget", "sampling.budget"),
        ("sampling probability", "sampling.probability"),
        ("calibration checks", "thresholds.calibration_checks"),
        ("threshold margin", "thresholds.margin"),
        ("verification budget (ms per step)", "verify.time_budget_ms"),
        ("response policy", "response.policy"),
        ("attention checked", "attention"),
        ("include", "include"),
        ("exclude", "exclude"),
    ]
    rows = []
    for label, key in wanted:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            rows.append((label, _plain(value)))
    faults = config.get("faults") or []
    if faults:
        rows.append(("injected faults (test run)", "; ".join(f"{f.get('model')} at {f.get('site')}" for f in faults)))
    return rows


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict) and value:
        return [row for key, item in value.items() for row in _flatten(item, f"{prefix}{key}.")]
    return [(prefix.rstrip("."), _plain(value))]


def _plain(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _versions(runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each package's version; ranks that disagree are named (a mixed install explains odd results)."""
    seen: dict[str, dict[str, list[int]]] = {}
    for r in runs:
        for name, version in (r["versions"] or {}).items():
            seen.setdefault(name, {}).setdefault(str(version), []).append(r["rank"])
    rows = []
    for name in sorted(seen):
        by_version = seen[name]
        if len(by_version) == 1:
            rows.append((name, next(iter(by_version))))
        else:
            rows.append((name, "; ".join(f"{v} (ranks {_ranges(ranks)})" for v, ranks in by_version.items())))
    return rows


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    steps = run["steps"]
    return {
        "steps": len(steps),
        "last_step": steps[-1]["step"] if steps else None,
        "checks": sum(s["checks"] for s in steps),
        "alarms": sum(s["alarms"] for s in steps),
        "verdict_counts": sorted(run["verdict_counts"].items()),
        "confirmed": len(run["incidents"]),
        "coverage": run["coverage"],
    }


def _incident_row(incident: dict[str, Any]) -> dict[str, Any]:
    evidence, verdict = incident["evidence"], incident["verdict"]
    tiles = verdict.get("mismatched_tiles") or []
    shown = "; ".join(
        f"rows {t['row_start']}:{t['row_stop']} × cols {t['col_start']}:{t['col_stop']}" for t in tiles[:8]
    )
    return {
        "id": incident["id"],
        "step": incident["step"],
        "rank": incident["rank"],
        "host": incident["host"],
        "device": incident["device"],
        "gpu_uuid": incident["gpu_uuid"],
        "site": incident["site"],
        "channel": evidence.get("channel"),
        "value": evidence.get("value"),
        "threshold": evidence.get("threshold"),
        "verdict": verdict.get("kind"),
        "wrong_execution": verdict.get("wrong_execution"),
        "no_effect_on_output": verdict.get("no_effect_on_output"),
        "detail": verdict.get("detail"),
        "tiles": shown + (f"; … {len(tiles)} tiles in all" if len(tiles) > 8 else ""),
    }


def _injected_rows(events: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Faults a test run injected (its ground truth), each with whether an incident confirmed it."""
    confirmed = {(i["site"], i["step"], i["rank"]) for i in incidents}
    return [
        e | {"confirmed": (e["site"], e["step"], e["rank"]) in confirmed}
        for e in events
        if e["kind"] == "fault_injected"
    ]


def _merge_sites(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per site over all ranks, worst difference/threshold first (sites still calibrating last)."""
    merged: dict[str, dict[str, Any]] = {}
    for r in summaries:
        site = merged.setdefault(r["site"], {
            "site": r["site"], "op": r["op"], "ranks": 0, "calls": 0, "checks": 0, "alarms": 0,
            "faults": 0, "nonfinite": 0, "calibrating_steps": 0, "worst_ratio": None, "worst_step": None,
            "worst_rank": r["rank"], "incidents": 0,
        })  # fmt: skip
        site["ranks"] += 1
        for key in ("calls", "checks", "alarms", "faults", "nonfinite"):
            site[key] += r[key]
        site["calibrating_steps"] = max(site["calibrating_steps"], r["calibrating_steps"])
        if r["worst_ratio"] is not None and (site["worst_ratio"] is None or r["worst_ratio"] > site["worst_ratio"]):
            site.update(worst_ratio=r["worst_ratio"], worst_step=r["worst_step"], worst_rank=r["rank"])
    return sorted(merged.values(), key=lambda s: (s["worst_ratio"] is None, -(s["worst_ratio"] or 0.0), s["site"]))


def _count_incidents(sites: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> None:
    by_name = {s["site"]: s for s in sites}
    for incident in incidents:
        if incident["site"] in by_name:
            by_name[incident["site"]]["incidents"] += 1


def _coverage(run: dict[str, Any]) -> dict[str, Any]:
    finished = [r for r in run["runs"] if r["summary"]]
    not_covered: dict[str, dict[str, Any]] = {}
    for r in finished:
        for name, reason in ((r["summary"].get("coverage") or {}).get("not_covered") or {}).items():
            not_covered.setdefault(name, {"name": name, "reason": reason, "ranks": []})["ranks"].append(r["rank"])
    return {
        "overall": run["coverage"],
        "per_rank": [{"rank": r["rank"], **r["summary"]} for r in finished],
        "not_covered": [row | {"ranks": _ranges(row["ranks"])} for _, row in sorted(not_covered.items())],
        "events": _capped([e for e in run["events"] if e["kind"] in COVERAGE_EVENTS]),
        "nonfinite": _capped(run["nonfinite"]),
        "nonfinite_events": _capped([e for e in run["events"] if e["kind"] == "nonfinite_input"]),
    }


def _latency(verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    metrics = [
        ("latency_steps", "latency (steps from alarm to verdict)"),
        ("latency_ms", "latency (ms from alarm to verdict)"),
        ("replay_ms", "replay time (ms)"),
    ]
    stats = []
    for key, label in metrics:
        values = np.array([v[key] for v in verdicts if v[key] is not None], dtype=float)
        if values.size:
            stats.append({
                "label": label, "n": int(values.size), "min": float(values.min()), "median": float(np.median(values)),
                "p95": float(np.percentile(values, 95)), "max": float(values.max()),
            })  # fmt: skip
    kinds = Counter((v["kind"], v["wrong_execution"]) for v in verdicts)
    return {"stats": stats, "kinds": kinds.most_common(), "png": _latency_png(verdicts, metrics)}


# -- plots (matplotlib's Agg canvas through Figure, no pyplot state) --------------------------------------
def _figure(width: float, height: float, **spacing: float) -> Figure:
    """A figure with fixed margins in inches: matplotlib's layout engines cost a second per page."""
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.8 / width, bottom=0.6 / height, top=1 - 0.4 / height, **spacing)
    return fig


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, metadata={"Software": None})  # no link to matplotlib.org
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _label(name: str) -> str:
    """A site name as literal plot text: `$` would start matplotlib's math mode."""
    return name.replace("$", r"\$")


def _timeline_png(steps: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> str | None:
    if not steps:
        return None
    x = [s["step"] for s in steps]
    fig = _figure(12, 5.5, hspace=0.08)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    top.plot(x, [s["checks"] for s in steps], color="tab:blue", lw=1.2, drawstyle="steps-mid", label="checks")
    top.set_ylabel("checks per step", color="tab:blue")
    alarms = top.twinx()
    alarms.plot(x, [s["alarms"] for s in steps], color="tab:orange", lw=1.2, drawstyle="steps-mid", label="alarms")
    alarms.set_ylabel("alarms per step", color="tab:orange")
    alarms.set_ylim(bottom=0, top=max(1, max(s["alarms"] for s in steps)) * 1.15)
    fractions = [s["checked_flops"] / s["gemm_flops"] if s["gemm_flops"] else np.nan for s in steps]
    bottom.plot(x, np.array(fractions) * 100, color="tab:green", lw=1.2, drawstyle="steps-mid")
    bottom.set_ylim(0, 105)
    bottom.set_ylabel("checked GEMM FLOPs (%)")
    bottom.set_xlabel("step")
    for n, step in enumerate(sorted({incident["step"] for incident in incidents})):
        for ax in (top, bottom):
            ax.axvline(step, color="tab:red", ls="--", lw=1.2, label="confirmed SDC" if n == 0 and ax is top else None)
    handles = [h for ax in (top, alarms) for h in ax.get_legend_handles_labels()[0]]
    top.legend(handles=handles, loc="upper left", fontsize=8)
    top.set_title("checks and alarms per step, confirmed incidents marked")
    return _png(fig)


def _sites_png(
    sites: list[dict[str, Any]], series: dict[tuple[str, int], list[dict[str, Any]]], incidents: list[dict[str, Any]]
) -> str | None:
    """Each site's largest row/column difference and threshold over the steps, on the rank where it came
    closest to its threshold; calibration shaded (its threshold is a loose bound then)."""
    if not sites:
        return None
    rows = (len(sites) + 1) // 2
    fig = _figure(12, 2.8 * rows, hspace=0.45, wspace=0.12)
    axes = fig.subplots(rows, 2, squeeze=False).ravel()
    for ax, site in zip(axes, sites, strict=False):
        own = series[(site["site"], site["worst_rank"])]
        x = [r["step"] for r in own]
        for key, color, style, label in (
            ("max_row", "tab:blue", "-", "row difference"),
            ("threshold_row", "tab:blue", "--", "row threshold"),
            ("max_col", "tab:orange", "-", "column difference"),
            ("threshold_col", "tab:orange", "--", "column threshold"),
        ):
            y = np.array([np.nan if r[key] is None else r[key] for r in own], dtype=float)
            if np.isfinite(y).any():
                ax.plot(x, y, color=color, ls=style, lw=1.1, marker="." if len(x) < 60 else None, label=label)
        for n, (start, stop) in enumerate(_spans(r["step"] for r in own if r["calibrating"])):
            ax.axvspan(start - 0.5, stop + 0.5, color="0.85", lw=0, label=None if n else "calibrating")
        struck = [i["step"] for i in incidents if i["site"] == site["site"] and i["rank"] == site["worst_rank"]]
        for step in struck:
            ax.axvline(step, color="tab:red", lw=1.2, ls=":")
        ax.set_yscale("log")
        worst = "still calibrating" if site["worst_ratio"] is None else f"worst {site['worst_ratio']:.3g}× threshold"
        ax.set_title(f"{_label(site['site'])} (rank {site['worst_rank']}): {worst}", fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes[len(sites) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, loc="best")
    fig.supxlabel("step", fontsize=9, y=0.1 / fig.get_figheight())
    return _png(fig)


def _latency_png(verdicts: list[dict[str, Any]], metrics: list[tuple[str, str]]) -> str | None:
    if not verdicts:
        return None
    fig = _figure(12, 3, wspace=0.25)
    for ax, (key, label) in zip(fig.subplots(1, len(metrics)), metrics, strict=True):
        values = np.array([v[key] for v in verdicts if v[key] is not None], dtype=float)
        if not values.size:
            continue
        bins: Any = np.arange(values.max() + 2) - 0.5 if key == "latency_steps" else min(30, max(5, values.size))
        ax.hist(values, bins=bins, color="tab:purple", alpha=0.8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of verdicts
        if key == "latency_steps":  # whole steps: at least 0 and 1 on the axis
            ax.set_xlim(-0.5, max(values.max(), 1) + 0.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("verdicts", fontsize=9)
    return _png(fig)


# -- small helpers ----------------------------------------------------------------------------------------
def _spans(numbers: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted numbers as contiguous (first, last) spans."""
    spans: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if spans and n == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], n)
        else:
            spans.append((n, n))
    return spans


def _ranges(ranks: Iterable[int]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _spans(ranks))


def _capped(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first MAX_ROWS rows of a table and how many more there are: a long run stays a readable page."""
    return {"rows": rows[:MAX_ROWS], "more": max(0, len(rows) - MAX_ROWS), "total": len(rows)}


def _when(wall: float | None) -> str | None:
    if wall is None:
        return None
    return datetime.fromtimestamp(wall, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _num(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.3g}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("aegis_sdc.report", "templates"),
        autoescape=True,  # for every template: select_autoescape would skip a name ending in .j2
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=_num, pct=_pct, when=_when, ranges=_ranges)
    return env
