"""A campaign's record (JSON) and plots: the coverage heat map and detection against size."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from aegis_sdc.campaign.ranks import RankCampaignResult
from aegis_sdc.campaign.runner import CampaignResult
from aegis_sdc.campaign.trials import GEMM_LOCATIONS, LOCATIONS
from aegis_sdc.response.files import write_atomically


def record(result: CampaignResult, env: dict[str, Any]) -> dict[str, Any]:
    """{env, rows (one per trial), summary, claims, cells}: what `write` stores."""
    return {
        "env": {**env, "campaign": asdict(result.config)},
        "rows": [t.to_dict() for t in result.trials],
        "summary": result.summary(),
        "claims": {name: claim.to_dict() for name, claim in result.claims.items()},
        "cells": result.cells(),
    }


def record_ranks(result: RankCampaignResult, env: dict[str, Any]) -> dict[str, Any]:
    """The same record for a campaign over data-parallel ranks (campaign/ranks.py)."""
    return {"env": {**env, "campaign": asdict(result.config)}, "rows": result.rows, "summary": result.summary(),
            "claims": result.claims, "cells": result.cells()}  # fmt: skip


def write(result: CampaignResult | RankCampaignResult, out: Path, env: dict[str, Any]) -> dict[str, Any]:
    """The record to `out`, atomically: a campaign killed while writing leaves the previous record
    (a partial one, or none), never a torn file."""
    doc = record_ranks(result, env) if isinstance(result, RankCampaignResult) else record(result, env)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(doc, indent=1) + "\n").encode()
    write_atomically(out, lambda f: f.write(text))
    return doc


def plot(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """From a campaign's record (`record`, or its JSON read back): `campaign_coverage.png` (confirmed ÷
    affected per location and magnitude, claimed rows marked) and `campaign_gemm_sensitivity.png`
    (each GEMM trial's size over its row threshold against whether the GEMM check confirmed it at its
    site and tile, per GEMM kind, with the claim's line; a forward fault the GEMM check misses may
    still be confirmed by its segment's recompute check)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_heat_map(doc, out_dir / "campaign_coverage.png"),
            _gemm(doc, out_dir / "campaign_gemm_sensitivity.png")]  # fmt: skip


def _heat_map(doc: dict[str, Any], path: Path) -> Path:
    cells = doc["cells"]
    rows = sorted({(c["location"], c["stage"] or "") for c in cells.values()},
                  key=lambda r: (LOCATIONS.index(r[0]), r[1]))  # fmt: skip
    columns = sorted({(c["model"], c["magnitude"]) for c in cells.values()}, key=lambda m: (m[0] != "bitflip", m[1]))
    grid = [[math.nan] * len(columns) for _ in rows]
    for c in cells.values():
        if c["affected"]:
            i, j = rows.index((c["location"], c["stage"] or "")), columns.index((c["model"], c["magnitude"]))
            grid[i][j] = min(c["confirmed"], c["affected"]) / c["affected"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(columns), 1.2 + 0.32 * len(rows)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(columns)), [f"bit {int(m)}" if model == "bitflip" else f"r {m:g}" for model, m in columns],
                  rotation=60, ha="right", fontsize=7)  # fmt: skip
    claimed = {name for name, claim in doc["claims"].items() if claim["claimed"]}
    labels = [f"{loc} {stage}".strip() + (" *" if loc in claimed else "") for loc, stage in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    fig.colorbar(image, ax=ax, label="confirmed ÷ trials that changed training")
    ax.set_title(f"Fault campaign: {len(doc['rows'])} trials (* claimed; blank: nothing changed)", fontsize=9)
    fig.savefig(path, dpi=130, bbox_inches="tight")  # tight_layout cannot fit a short campaign's few cells
    plt.close(fig)
    return path


SIZE_SHOWN = 1e4  # larger sizes (exponent flips reach 1e40) are drawn at this edge


def _gemm(doc: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(GEMM_LOCATIONS), figsize=(4 * len(GEMM_LOCATIONS), 3.2), sharey=True)
    for ax, location in zip(axes, GEMM_LOCATIONS, strict=True):
        rows = [r for r in doc["rows"] if r["location"] == location and r["size"] is not None and r["affected"]]
        for found, color in ((True, "tab:green"), (False, "tab:red")):  # at the GEMM's own site and tile
            xs = [min(max(r["size"], 1e-5), SIZE_SHOWN) for r in rows if r["localized"] is found]
            jitter = [(1.0 if found else 0.0) + 0.04 * ((i * 7919) % 11 - 5) / 5 for i in range(len(xs))]
            ax.scatter(xs, jitter, s=10, alpha=0.5, color=color,
                       label="confirmed at the GEMM" if found else "not by the GEMM check")  # fmt: skip
        ax.axvline(2.0, color="black", linestyle="--", linewidth=0.8, label="claim: 2 × threshold")
        ax.set_xscale("log")
        ax.set_xlim(1e-5, SIZE_SHOWN * 3)
        ax.set_title(f"{location} ({len(rows)} trials; ≥ 1e4 drawn at 1e4)", fontsize=9)
        ax.set_xlabel("fault size ÷ row threshold (fp32 accumulator checksum)", fontsize=7)
    axes[0].set_yticks([0, 1], ["missed", "confirmed"])
    axes[0].legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
