"""The headline figures of a study, from its metric rows (stored with them as the study's summary)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from aegis_sdc.faults.injector import Injection
from aegis_sdc.study.config import StudyConfig

Row = tuple[int, str, str, float]

# Metrics that compare the suspect with the healthy replica: all exactly zero when nothing struck.
COMPARISON_METRICS = ("mismatch_frequency", "severity_mean", "severity_max", "grad_deviation", "accuracy_difference")


def is_comparison(scope: str, metric: str) -> bool:
    if metric == "param_divergence":
        return scope != "baseline"  # the reseeded baseline diverges by design
    if scope == "spike":
        return metric == "suspect_only"
    if scope == "loss":
        return False  # compared below as loss_difference
    return metric in COMPARISON_METRICS


def _nonzero(value: float) -> bool:
    return value != 0.0 or math.isnan(value)


def summarize(cfg: StudyConfig, rows: Sequence[Row], injected: Sequence[Injection], state_difference: str | None):
    """See docs/study.md, "Summary"."""
    fault_steps = sorted({i.step for i in injected})
    losses: dict[int, dict[str, float]] = {}
    for step, scope, metric, value in rows:
        if scope == "loss":
            losses.setdefault(step, {})[metric] = value
    affected = [step for step, scope, metric, value in rows if is_comparison(scope, metric) and _nonzero(value)] + [
        step for step, v in losses.items() if v["suspect"] != v["healthy"] or math.isnan(v["suspect"])
    ]
    summary: dict[str, Any] = {
        "mode": cfg.mode,
        "steps": cfg.steps,
        "faults_fired": len(injected),
        "faults": [{"site": i.site, "step": i.step, "call": i.call, "fault": i.fault.describe()} for i in injected],
        "first_fault_step": fault_steps[0] if fault_steps else None,
        "first_affected_step": min(affected) if affected else None,
        "replicas_bit_identical": state_difference is None,
        "first_state_difference": state_difference,
        "max_loss_difference": max(
            (abs(v["suspect"] - v["healthy"]) for v in losses.values() if math.isfinite(v["suspect"])), default=0.0
        ),
        "first_nonfinite_loss_step": next(
            (step for step in sorted(losses) if not math.isfinite(losses[step]["suspect"])), None
        ),
    }
    summary.update(_BY_MODE[cfg.mode](rows))
    return summary


def _compute_sync(rows: Sequence[Row]) -> dict[str, Any]:
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for step, scope, metric, value in rows:
        if metric != "mismatch_frequency" or not _nonzero(value):
            continue
        unit, _, phase = scope.rpartition("/")
        entry = entries.setdefault((unit, phase), {"unit": unit, "phase": phase, "first_step": step, "steps": 0})
        entry["steps"] += 1
        entry["max_frequency"] = max(entry.get("max_frequency", 0.0), value)
    for _, scope, metric, value in rows:
        unit, _, phase = scope.rpartition("/")
        if metric == "severity_max" and (unit, phase) in entries:
            entry = entries[(unit, phase)]
            entry["max_severity"] = max(entry.get("max_severity", 0.0), value)
    ordered = sorted(entries.values(), key=lambda e: (e["first_step"], e["phase"] != "forward", e["unit"]))
    return {"mismatches": ordered, "mismatching_submodule_steps": sum(e["steps"] for e in ordered)}


def _param_sync(rows: Sequence[Row]) -> dict[str, Any]:
    overall = [(step, value) for step, scope, metric, value in rows if metric == "grad_deviation" and scope == "all"]
    deviating = [(step, value) for step, value in overall if _nonzero(value)]
    per_layer: dict[str, float] = {}
    for _, scope, metric, value in rows:
        if metric == "grad_deviation" and scope != "all":
            per_layer[scope] = max(per_layer.get(scope, 0.0), value)
    worst = max(deviating, key=lambda sv: sv[1], default=None)
    return {
        "steps_with_grad_deviation": [step for step, _ in deviating],
        "max_grad_deviation": None if worst is None else {"step": worst[0], "value": worst[1]},
        "max_grad_deviation_per_layer": per_layer,
    }


def _free_run(rows: Sequence[Row]) -> dict[str, Any]:
    divergence = {step: v for step, scope, metric, v in rows if metric == "param_divergence" and scope == "all"}
    baseline = {step: v for step, scope, metric, v in rows if metric == "param_divergence" and scope == "baseline"}
    last = max(divergence) if divergence else None
    spike_steps: dict[str, list[int]] = {"healthy": [], "suspect": [], "baseline": [], "suspect_only": []}
    for step, scope, metric, value in rows:
        if scope == "spike" and value:
            spike_steps[metric].append(step)
    spikes = {name: {"count": len(steps), "first_steps": steps[:10]} for name, steps in spike_steps.items()}
    final_losses = {metric: v for step, scope, metric, v in rows if scope == "loss" and step == last}
    out: dict[str, Any] = {
        "first_divergent_step": next((s for s in sorted(divergence) if _nonzero(divergence[s])), None),
        "final_divergence": divergence.get(last),
        "final_baseline_divergence": baseline.get(last),
        "final_divergence_vs_baseline": (
            divergence[last] / baseline[last] if last is not None and baseline.get(last) else None
        ),
        "spikes": spikes,
        "final_loss": final_losses,
    }
    out["finetune"] = {metric: v for _, scope, metric, v in rows if scope == "finetune"}
    return out


_BY_MODE = {"compute-sync": _compute_sync, "param-sync": _param_sync, "free-run": _free_run}
