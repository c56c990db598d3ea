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
    steps: int = typer.Option(400, help="Training steps (about two minutes on two CPU cores)."),
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


DEFAULT_STUDY_FAULT = "layers.1.mlp.up_proj:fwd@model=bitflip,bit=30,probability=0.05,start_step=100"


@app.command()
def study(
    mode: str = typer.Option(..., help="compute-sync, param-sync or free-run (docs/study.md)."),
    fault: list[str] = typer.Option(
        None,
        help="A fault of the suspect, SITE@field=value,... (repeatable; FaultSpec fields, steps as 40+100-104). "
        f"Default: {DEFAULT_STUDY_FAULT}",
    ),
    no_fault: bool = typer.Option(False, "--no-fault", help="A control study: every metric must stay exactly zero."),
    steps: int = typer.Option(300, help="Training steps."),
    seed: int = typer.Option(0, help="Seed of the model, the data and the faults' draws."),
    baseline_seed: int = typer.Option(1, help="free-run: sample-order seed of the reseeded healthy baseline."),
    device: str = typer.Option("cpu", help="Device of the healthy replica (cpu, cuda, cuda:0, ...)."),
    suspect_device: str = typer.Option(None, help="Device of the suspect (default: the healthy one's)."),
    batch_size: int = typer.Option(8, help="Sequences per step."),
    seq_len: int = typer.Option(128, help="Tokens per sequence."),
    finetune_steps: int = typer.Option(100, help="free-run: fine-tuning steps on the held-out task."),
    run_dir: Path = typer.Option(None, help="Run directory (default: aegis-runs/study-<mode>-<time>)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Train a healthy and a suspect replica side by side and measure what the suspect's faults do."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from aegis_sdc.faults.models import FaultSpec
    from aegis_sdc.study.config import StudyConfig
    from aegis_sdc.study.harness import run_study
    from aegis_sdc.study.modes import NondeterminismError

    try:
        specs = () if no_fault else tuple(FaultSpec.parse(text) for text in (fault or [DEFAULT_STUDY_FAULT]))
        cfg = StudyConfig(
            mode=mode,
            steps=steps,
            faults=specs,
            seed=seed,
            baseline_seed=baseline_seed,
            device=device,
            suspect_device=suspect_device,
            batch_size=batch_size,
            seq_len=seq_len,
            finetune_steps=finetune_steps,
            run_dir=str(run_dir) if run_dir else None,
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    console = Console(stderr=as_json)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=as_json) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, completed: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=completed)

        try:
            result = run_study(cfg, progress=progress)
        except (NondeterminismError, FileExistsError) as error:
            console.print(f"[red]refused:[/red] {error}")
            raise typer.Exit(2) from error
    if as_json:
        typer.echo(json.dumps(result.summary, indent=2, default=str))
        return
    _print_study(console, result)


def _print_study(console: Console, result) -> None:
    s = result.summary
    table = Table(title=f"aegis study: {s['mode']}", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("steps", f"{s['steps']} in {s['seconds']:.1f} s")
    by_site: dict[str, list[int]] = {}
    for f in s["faults"]:
        by_site.setdefault(f"{f['site']} ({f['fault']})", []).append(f["step"])
    struck = "; ".join(
        f"{site} at step {', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}"
        for site, steps in by_site.items()
    )
    table.add_row("faults fired", f"{s['faults_fired']}" + (f": {struck}" if struck else ""))
    table.add_row("first affected step", str(s["first_affected_step"]))
    table.add_row("largest loss difference", f"{s['max_loss_difference']:.3g}")
    if s["mode"] == "compute-sync":
        for m in s["mismatches"][:12]:
            table.add_row(
                f"{m['unit']} {m['phase']}",
                f"{m['steps']} step(s) from {m['first_step']}; frequency ≤ {m['max_frequency']:.3g},"
                f" severity ≤ {m.get('max_severity', 0.0):.3g}",
            )
        if not s["mismatches"]:
            table.add_row("mismatches", "none: every submodule agreed bit for bit")
    elif s["mode"] == "param-sync":
        worst = s["max_grad_deviation"]
        table.add_row("steps with gradient deviation", str(len(s["steps_with_grad_deviation"])))
        shown = "none" if worst is None else f"{worst['value']:.3g} at step {worst['step']}"
        table.add_row("largest gradient deviation", shown)
    else:
        table.add_row("first divergent step", str(s["first_divergent_step"]))
        table.add_row(
            "final divergence (suspect / reseeded)",
            f"{s['final_divergence']:.3g} / {s['final_baseline_divergence']:.3g}",
        )
        only = s["spikes"]["suspect_only"]
        table.add_row(
            "loss spikes only in the suspect",
            f"{only['count']}" + (f" from step {only['first_steps'][0]}" if only["count"] else ""),
        )
        if s["first_nonfinite_loss_step"] is not None:
            table.add_row("suspect loss not finite from step", str(s["first_nonfinite_loss_step"]))
        table.add_row("final loss", ", ".join(f"{k} {v:.4f}" for k, v in s["final_loss"].items()))
        table.add_row(
            "held-out accuracy after fine-tuning",
            ", ".join(f"{k.removeprefix('accuracy_')} {v:.4f}" for k, v in s["finetune"].items()),
        )
    table.add_row("replicas bit-identical at the end", "yes" if s["replicas_bit_identical"] else "no")
    table.add_row("run directory", str(result.run_dir))
    for plot in result.plots:
        table.add_row("plot", str(plot))
    console.print(table)


@app.command()
def incidents(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the confirmed incidents of a run, all ranks merged."""
    from aegis_sdc.store.sqlite import (
        StoreError,
        read_coverage,
        read_incidents,
        read_unattributed,
        read_verdict_counts,
        read_warnings,
    )

    try:
        rows = read_incidents(run_dir)
        counts = read_verdict_counts(run_dir)
        warnings = read_warnings(run_dir)
        unattributed = read_unattributed(run_dir)
        coverage = read_coverage(run_dir)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    if as_json:
        report = {"run_dir": str(run_dir), "verdicts": counts, "incidents": rows, "warnings": warnings,
                  "unattributed": unattributed, "coverage": coverage}  # fmt: skip
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
    if coverage["checked_flops_fraction"] is not None:
        console.print(
            f"checked {coverage['checked_flops_fraction']:.1%} of the GEMM FLOPs over {coverage['steps']} steps "
            f"(per step {coverage['per_step_min']:.1%}–{coverage['per_step_max']:.1%})"
        )
    if unattributed:
        console.print(f"corruptions proven but pinned on no device (no majority): {len(unattributed)}")
        for event in unattributed[:20]:
            console.print(f"  step {event['step']}, check failed on rank {event['rank']}: {event['message']}")
    if warnings:
        console.print(f"rank-outlier warnings (heuristic, not confirmed): {len(warnings)}")
        for warning in warnings[:20]:
            console.print(f"  {warning['message']}")


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    out: Path = typer.Option(None, "--out", help="The HTML file to write (default: RUN_DIR/aegis-report.html)."),
) -> None:
    """Write one self-contained HTML page of a run: incidents, timeline, sites, coverage, verification."""
    from aegis_sdc.report.html import write_report
    from aegis_sdc.store.sqlite import StoreError

    try:
        path = write_report(run_dir, out)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(str(path))


if __name__ == "__main__":
    app()
