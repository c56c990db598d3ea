"""The `aegis` command line."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="aegis-sdc: online detection of silent data corruption in PyTorch training.", no_args_is_help=True
)


@app.command()
def demo(
    steps: int = typer.Option(400, help="Training steps (about a minute on two CPU cores)."),
    no_fault: bool = typer.Option(False, "--no-fault", help="Inject nothing: the run must confirm zero incidents."),
    fault_site: str = typer.Option("layers.1.mlp.up_proj:fwd", help="Site whose accumulator the faulty unit corrupts."),
    fault_probability: float = typer.Option(0.03, help="Probability per call that the fault strikes."),
    fault_start: int = typer.Option(100, help="First step at which the fault may strike."),
    run_dir: Path = typer.Option(None, help="Run directory (default: aegis-runs/<run id>)."),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu or cuda."),
    seed: int = typer.Option(0, help="Seed of the model, the data and the fault."),
) -> None:
    """Train a small Llama-style model with every Linear protected while a faulty matrix unit strikes."""
    from aegis_sdc.demo import DemoConfig, run_demo

    try:
        cfg = DemoConfig(
            steps=steps,
            fault=not no_fault,
            fault_site=fault_site,
            fault_probability=fault_probability,
            fault_start=fault_start,
            run_dir=str(run_dir) if run_dir else None,
            device=device,
            seed=seed,
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    run_demo(cfg, Console())


@app.command()
def incidents(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the confirmed incidents of a run, all ranks merged."""
    from aegis_sdc.store.sqlite import StoreError, read_incidents, read_verdict_counts, read_warnings

    try:
        rows = read_incidents(run_dir)
        counts = read_verdict_counts(run_dir)
        warnings = read_warnings(run_dir)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    if as_json:
        report = {"run_dir": str(run_dir), "verdicts": counts, "incidents": rows, "warnings": warnings}
        typer.echo(json.dumps(report, indent=2))
        return
    console = Console()
    table = Table(title=f"confirmed incidents in {run_dir}", title_justify="left")
    for column in ("id", "step", "rank", "device", "site", "evidence", "verdict"):
        table.add_column(column, overflow="fold")
    for r in rows:
        e, v = r["evidence"], r["verdict"]
        tiles = "; ".join(
            f"{t['row_start']}:{t['row_stop']}×{t['col_start']}:{t['col_stop']}" for t in v["mismatched_tiles"]
        )
        device = f"{r['host']} {r['device']}" + (f" {r['gpu_uuid']}" if r["gpu_uuid"] else "")
        verdict = (v["wrong_execution"] or "-") + (" (no effect on output)" if v["no_effect_on_output"] else "")
        table.add_row(
            str(r["id"]),
            str(r["step"]),
            str(r["rank"]),
            device,
            r["site"],
            f"{e['channel']} {e['value']:.3g} > {e['threshold']:.3g}",
            verdict + (f"; tiles {tiles}" if tiles else ""),
        )
    console.print(table)
    console.print(
        f"{len(rows)} confirmed; verdicts: " + (", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none")
    )
    if warnings:
        console.print(f"rank-outlier warnings (heuristic, not confirmed): {len(warnings)}")
        for warning in warnings[:20]:
            console.print(f"  {warning['message']}")


if __name__ == "__main__":
    app()
