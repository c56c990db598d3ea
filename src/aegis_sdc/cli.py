"""The `aegis` command line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from aegis_sdc.store.sqlite import RunStores, StoreProblem

app = typer.Typer(
    help="aegis-sdc: online detection of silent data corruption in PyTorch training.", no_args_is_help=True
)


# Checks of the demo's and the study's options. They run while the command line is parsed, before
# any work: a bad value ends the command with a usage error naming the option (exit status 2), not
# with a traceback from deep inside a run, possibly minutes into it.

# Seeds reach torch's generators (which take −2⁶³..2⁶⁴ − 1; the demo and the study add small offsets
# for their derived streams) and the fault's int64 hash keys: the int64 range fits them all.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _probability_option(value: float) -> float:
    if not 0.0 <= value <= 1.0:  # NaN fails this too (click's FloatRange lets NaN through)
        raise typer.BadParameter(f"must be a probability in [0, 1], got {value}")
    return value


def _run_dir_option(value: Path | None) -> Path | None:
    """A directory that exists, or can be created: the nearest existing path is a writable directory."""
    if value is None:
        return None
    try:
        if value.exists() and not value.is_dir():
            raise typer.BadParameter(f"{value} exists and is not a directory")
        nearest = next(path for path in (value, *value.absolute().parents) if path.exists())
    except OSError as error:
        raise typer.BadParameter(f"{value}: {error.strerror or error}") from error
    if not nearest.is_dir():
        raise typer.BadParameter(f"{value} cannot be created: {nearest} is not a directory")
    if not os.access(nearest, os.W_OK | os.X_OK):
        action = "written to" if nearest == value else "created"
        raise typer.BadParameter(f"{value} cannot be {action}: {nearest} is not writable")
    return value


def _require_cuda(index: int | None) -> None:
    import torch

    if not torch.cuda.is_available():
        raise typer.BadParameter("CUDA was asked for but no CUDA device is available")
    if index is not None and index >= torch.cuda.device_count():
        raise typer.BadParameter(f"there is no cuda:{index} (CUDA devices here: {torch.cuda.device_count()})")


def _demo_device_option(value: str) -> str:
    if value not in ("auto", "cpu", "cuda"):
        raise typer.BadParameter(f"must be auto, cpu or cuda, got {value!r}")
    if value == "cuda":
        _require_cuda(None)
    return value


def _cpu_or_cuda(value: str, refusal: str) -> str:
    """`value` when it is cpu or an available CUDA device; else a usage error saying `refusal`."""
    if value == "cpu":
        return value
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as error:
        raise typer.BadParameter(f"{value!r} is not a device") from error
    if device.type != "cuda":
        raise typer.BadParameter(f"{refusal}, got {value!r}")
    _require_cuda(device.index)
    return value


def _study_device_option(value: str | None) -> str | None:
    """A CPU or an available CUDA device (the study's replicas train on these two kinds only)."""
    return value if value is None else _cpu_or_cuda(value, "the study runs on cpu or cuda devices")


def _choice(value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise typer.BadParameter(f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _study_mode_option(value: str) -> str:
    from aegis_sdc.study.config import MODES

    return _choice(value, MODES)


@app.command()
def demo(
    steps: int = typer.Option(400, min=1, help="Training steps (about two minutes on two CPU cores)."),
    no_fault: bool = typer.Option(False, "--no-fault", help="Inject nothing: the run must confirm zero incidents."),
    fault_site: str = typer.Option("layers.1.mlp.up_proj:fwd", help="Site whose accumulator the faulty unit corrupts."),
    fault_probability: float = typer.Option(
        0.03, callback=_probability_option, help="Probability per call that the fault strikes."
    ),
    fault_start: int = typer.Option(100, min=0, help="First step at which the fault may strike."),
    run_dir: Path = typer.Option(None, callback=_run_dir_option, help="Run directory (default: aegis-runs/<run id>)."),
    device: str = typer.Option("auto", callback=_demo_device_option, help="auto (CUDA when present), cpu or cuda."),
    seed: int = typer.Option(0, min=SEED_MIN, max=SEED_MAX, help="Seed of the model, the data and the fault."),
) -> None:
    """Train a small Llama-style model with every Linear protected while a faulty matrix unit strikes."""
    if not no_fault and not fault_site:
        raise typer.BadParameter("the faulty site must be named (an fnmatch pattern)", param_hint="'--fault-site'")
    if not no_fault and fault_probability == 0.0:
        raise typer.BadParameter("0 never strikes; --no-fault runs without a fault", param_hint="'--fault-probability'")

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
def campaign(
    trials: int = typer.Option(2000, min=1, help="Trials: one fault each, spread over every location and magnitude."),
    out: Path = typer.Option(Path("campaign.json"), help="The record: env, rows (one per trial), summary, claims."),
    plots: Path = typer.Option(None, help="Folder for the coverage heat map and the GEMM sensitivity plot."),
    device: str = typer.Option("cpu", callback=_demo_device_option, help="cpu, cuda or auto."),
    seed: int = typer.Option(0, min=SEED_MIN, max=SEED_MAX, help="Seed of the model, the data and the trials."),
    ranks: int = typer.Option(
        0,
        min=0,
        help="Over this many data-parallel gloo ranks on the CPU (≥ 2): faults in "
        "the gradient all-reduce; 0: one process, every other location.",
    ),
) -> None:
    """Inject faults at every location the project knows, each in a short trial from one snapshot of a
    protected training, and check every miss against the coverage the configuration claims. Exit 0:
    no miss inside the claims and nothing confirmed in the clean twins; 1 otherwise. With `--ranks`,
    the gradient buckets of the all-reduce on that many gloo processes (CPU)."""

    import torch
    from rich.progress import Progress

    from aegis_sdc.campaign import CampaignConfig, run_campaign
    from aegis_sdc.campaign import report as campaign_report

    if ranks == 1:
        raise typer.BadParameter("--ranks takes 0 (one process) or at least 2 ranks", param_hint="--ranks")
    if ranks:
        _rank_campaign(trials, out, seed, ranks)
        return
    resolved = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = "bfloat16" if resolved == "cuda" else "float32"  # on a GPU: the Triton kernels, as training runs them
    cfg = CampaignConfig(trials=trials, seed=seed, device=resolved, dtype=dtype)
    env = {"device": torch.cuda.get_device_name() if resolved == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    errors = Console(stderr=True)

    def partial(result: Any) -> None:  # the record so far, so that a kill loses at most half a minute
        campaign_report.write(result, out, env)
        if not errors.is_terminal:  # a batch job's log: a line per partial record, not a live bar
            errors.print(f"campaign: {len(result.trials)}/{trials} trials, {result.seconds / 60:.1f} min; "
                         f"record so far in {escape(str(out))}")  # fmt: skip

    with Progress(console=errors) as bar:
        task = bar.add_task("trials", total=trials)
        result = run_campaign(cfg, progress=lambda done, total: bar.update(task, completed=done), partial=partial)
    doc = campaign_report.write(result, out, env)
    if plots is not None:
        campaign_report.plot(doc, plots)
    summary = result.summary()
    Console().print_json(json.dumps(summary))
    for miss in result.misses_inside()[:10]:
        line = f"missed inside the claimed coverage: {miss.trial.cell} at {miss.trial.site}"
        Console(stderr=True).print(escape(line))
    raise typer.Exit(0 if summary["missed_inside_coverage"] == 0 and summary["false_confirmed"] == 0 else 1)


class _LogLines:
    """Progress where the console is no terminal (a batch job's log, where a live bar prints nothing
    until it ends): a line per phase when it starts, every EVERY_S seconds, and when it completes."""

    EVERY_S = 30.0

    def __init__(self, console: Console) -> None:
        self.console = console
        self._last: dict[str, float] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.console.is_terminal:
            return
        now = time.monotonic()
        if phase not in self._last or done >= total or now - self._last[phase] >= self.EVERY_S:
            self._last[phase] = now
            self.console.print(f"{escape(phase)}: {done}/{total}")


def _rank_campaign(trials: int, out: Path, seed: int, world: int) -> None:
    """`aegis campaign --ranks N`: the all-reduce's gradient buckets over N gloo processes."""

    import torch

    from aegis_sdc.campaign import report as campaign_report
    from aegis_sdc.campaign.ranks import RankCampaignConfig, run_rank_campaign

    with Console(stderr=True).status(f"{trials} trials over {world} ranks"):
        result = run_rank_campaign(RankCampaignConfig(trials=trials, world=world, seed=seed))
    env = {"device": "cpu (gloo)", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    campaign_report.write(result, out, env)
    summary = result.summary()
    Console().print_json(json.dumps(summary))
    raise typer.Exit(0 if summary["missed_inside_coverage"] == 0 and summary["false_confirmed"] == 0 else 1)


DEFAULT_STUDY_FAULT = "layers.1.mlp.up_proj:fwd@model=bitflip,bit=30,probability=0.05,start_step=100"


@app.command()
def study(
    mode: str = typer.Option(
        ..., callback=_study_mode_option, help="compute-sync, param-sync or free-run (docs/study.md)."
    ),
    fault: list[str] = typer.Option(
        None,
        help="A fault of the suspect, SITE@field=value,... (repeatable; FaultSpec fields, steps as 40+100-104). "
        f"Default: {DEFAULT_STUDY_FAULT}",
    ),
    no_fault: bool = typer.Option(False, "--no-fault", help="A control study: every metric must stay exactly zero."),
    steps: int = typer.Option(300, min=1, help="Training steps."),
    seed: int = typer.Option(0, min=SEED_MIN, max=SEED_MAX, help="Seed of the model, the data and the faults' draws."),
    baseline_seed: int = typer.Option(
        1, min=SEED_MIN, max=SEED_MAX, help="free-run: sample-order seed of the reseeded healthy baseline."
    ),
    device: str = typer.Option(
        "cpu", callback=_study_device_option, help="Device of the healthy replica (cpu, cuda, cuda:0, ...)."
    ),
    suspect_device: str = typer.Option(
        None, callback=_study_device_option, help="Device of the suspect (default: the healthy one's)."
    ),
    batch_size: int = typer.Option(8, min=1, help="Sequences per step."),
    seq_len: int = typer.Option(128, min=1, help="Tokens per sequence."),
    finetune_steps: int = typer.Option(100, min=0, help="free-run: fine-tuning steps on the held-out task."),
    run_dir: Path = typer.Option(
        None, callback=_run_dir_option, help="Run directory (default: aegis-runs/study-<mode>-<time>)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Train a healthy and a suspect replica side by side and measure what the suspect's faults do."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from aegis_sdc.faults.models import FaultSpec
    from aegis_sdc.study.config import StudyConfig
    from aegis_sdc.study.harness import run_study
    from aegis_sdc.study.modes import NondeterminismError
    from aegis_sdc.workloads.llama import LlamaConfig

    # What the options' own checks cannot see: their combinations, and the faults' fields.
    if no_fault and fault:
        raise typer.BadParameter("a control study takes no --fault", param_hint="'--no-fault'")
    if seq_len > LlamaConfig().max_seq_len:
        raise typer.BadParameter(f"at most the model's {LlamaConfig().max_seq_len} tokens", param_hint="'--seq-len'")
    if baseline_seed == seed:
        raise typer.BadParameter("must differ from --seed (it seeds the reseeded run)", param_hint="'--baseline-seed'")
    try:
        specs = () if no_fault else tuple(FaultSpec.parse(text) for text in (fault or [DEFAULT_STUDY_FAULT]))
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="'--fault'") from error
    try:
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

        log_lines = _LogLines(console)

        def progress(phase: str, completed: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=completed)
            log_lines(phase, completed, total)

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


# -- reading a run directory: nothing a store holds is trusted -------------------------------------------
def _shown(value: object) -> str:
    """Text read from a store (site names, messages, hosts: whatever a file holds) as literal console
    text: rich markup escaped (a site named `[/x]` would close a style nobody opened and crash the
    print) and every unprintable character written as its escape (`\\x1b`), so ANSI sequences,
    newlines and bidi overrides never reach the terminal as such. Every stored value printed goes
    through here."""
    text = str(value)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return escape(text)


def _number(value: object) -> str:
    """A stored number in 3 significant digits; anything else a store holds there as its text."""
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def _console(*, stderr: bool = False) -> Console:
    # emoji off: rich would turn a stored `:name:` into an emoji; soft wrap on stderr: a problem is one
    # line, whatever the terminal's width
    return Console(stderr=stderr, emoji=False, soft_wrap=stderr)


def _open_run(run_dir: Path, *, none_readable_ok: bool = False) -> RunStores:
    """The stores of `run_dir`, opened read-only to read what can be read; exit status 2 when not one
    can be read (a missing directory, no store, or only unreadable ones, each named on stderr) unless
    `none_readable_ok` (the caller has something else to show: the quarantine list)."""
    from aegis_sdc.store.sqlite import RunStores, StoreError

    try:
        stores = RunStores(run_dir, strict=False)
    except StoreError as error:
        _console(stderr=True).print(f"error: {_shown(error)}")
        raise typer.Exit(2) from error
    if not stores.databases and not none_readable_ok:
        _print_problems(stores.problems)
        _console(stderr=True).print(f"error: no readable aegis store in {_shown(run_dir)}")
        raise typer.Exit(2)
    return stores


def _print_problems(problems: list[StoreProblem]) -> bool:
    """One stderr line per file not read (error) or not read whole (warning), naming it; True if any."""
    console = _console(stderr=True)
    for problem in problems:
        console.print(f"{'error' if problem.skipped else 'warning'}: {_shown(problem)}")
    if problems:
        console.print(f"{len(problems)} problem(s) reading the run directory: what could be read is shown")
    return bool(problems)


def _incident_cells(incident: dict[str, Any]) -> list[str]:
    """An incident's table row; the evidence and verdict are whatever the store's record holds."""
    e, v = incident["evidence"], incident["verdict"]
    try:
        spans = v.get("mismatched_tiles") or ()
        tiles = "; ".join(f"{t['row_start']}:{t['row_stop']}×{t['col_start']}:{t['col_stop']}" for t in spans)
        evidence = f"{e['channel']} {_number(e['value'])} > {_number(e['threshold'])}"
        verdict = f"{v.get('wrong_execution') or '-'}" + (" (no effect on output)" * bool(v.get("no_effect_on_output")))
    except (KeyError, TypeError, ValueError) as error:
        tiles, evidence, verdict = "", "?", f"unreadable record ({type(error).__name__}: {error})"
    device = f"{incident['host']} {incident['device']}" + (f" {incident['gpu_uuid']}" if incident["gpu_uuid"] else "")
    cells = (incident["id"], incident["step"], incident["rank"], device, incident["site"], evidence,
             verdict + (f"; tiles {tiles}" if tiles else ""))  # fmt: skip
    return [_shown(cell) for cell in cells]


@app.command()
def incidents(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the confirmed incidents of a run, all ranks merged.

    Stores are opened read-only and checked first; a file that cannot be read, or is damaged, is named
    on stderr and the others are listed: exit status 1. Exit status 2: nothing could be read.
    """
    from aegis_sdc.store.sqlite import (
        read_coverage,
        read_incidents,
        read_unattributed,
        read_verdict_counts,
        read_warnings,
    )

    with _open_run(run_dir) as stores:
        rows = read_incidents(stores)
        counts = read_verdict_counts(stores)
        warnings = read_warnings(stores)
        unattributed = read_unattributed(stores)
        coverage = read_coverage(stores)
    if as_json:
        problems = [{"path": str(p.path), "reason": p.reason, "skipped": p.skipped} for p in stores.problems]
        report = {"run_dir": str(run_dir), "verdicts": counts, "incidents": rows, "warnings": warnings,
                  "unattributed": unattributed, "coverage": coverage, "problems": problems}  # fmt: skip
        typer.echo(json.dumps(report, indent=2))  # JSON escapes control characters itself
    else:
        _print_incidents(run_dir, rows, counts, warnings, unattributed, coverage)
    if _print_problems(stores.problems):
        raise typer.Exit(1)


@app.command()
def checkpoints(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List a run's checkpoints with their certificates: certified (nothing known corrupted the state),
    pending (decided at a later step) or uncertified, with the reason (docs/response.md).

    Exit status as `aegis incidents`: 1 when a store was skipped or damaged, 2 when none could be read.
    """
    from aegis_sdc.store.sqlite import read_checkpoints

    with _open_run(run_dir) as stores:
        rows = read_checkpoints(stores)
    if as_json:
        typer.echo(json.dumps([{k: v for k, v in r.items() if k != "certificate"} for r in rows], indent=2))
    else:
        table = Table(title=f"checkpoints in {_shown(run_dir)}", title_justify="left")
        for column in ("step", "rank", "status", "path", "reason"):
            table.add_column(column, overflow="fold")
        for r in rows:
            table.add_row(*(_shown(r[key]) for key in ("step", "rank", "status", "path", "reason")))
        _console().print(table)
    if _print_problems(stores.problems):
        raise typer.Exit(1)


def _print_incidents(
    run_dir: Path,
    rows: list[dict[str, Any]],
    counts: dict[str, int],
    warnings: list[dict[str, Any]],
    unattributed: list[dict[str, Any]],
    coverage: dict[str, Any],
) -> None:
    console = _console()
    table = Table(title=f"confirmed incidents in {_shown(run_dir)}", title_justify="left")
    for column in ("id", "step", "rank", "device", "site", "evidence", "verdict"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(*_incident_cells(r))
    console.print(table)
    console.print(
        f"{len(rows)} confirmed; verdicts: "
        + (", ".join(f"{_shown(k)} {n}" for k, n in sorted(counts.items())) or "none")
    )
    if coverage["checked_flops_fraction"] is not None:
        console.print(
            f"checked {coverage['checked_flops_fraction']:.1%} of the GEMM FLOPs over {coverage['steps']} steps"
            + (f" of {coverage['ranks']} ranks" if coverage["ranks"] > 1 else "")
            + f" (per step {coverage['per_step_min']:.1%}–{coverage['per_step_max']:.1%})"
        )
    if unattributed:
        console.print(f"corruptions proven but pinned on no device (no majority): {len(unattributed)}")
        for event in unattributed[:20]:
            console.print(
                f"  step {_shown(event['step'])}, check failed on rank {event['rank']}: {_shown(event['message'])}"
            )
    if warnings:
        console.print(f"rank-outlier warnings (heuristic, not confirmed): {len(warnings)}")
        for warning in warnings[:20]:
            console.print(f"  {_shown(warning['message'])}")


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    out: Path = typer.Option(None, "--out", help="The HTML file to write (default: RUN_DIR/aegis-report.html)."),
) -> None:
    """Write one self-contained HTML page of a run: incidents, timeline, sites, coverage, verification.

    Stores are read as `aegis incidents` reads them (exit status 1: a file was skipped or is damaged,
    named on stderr; 2: nothing could be read, or the page could not be written).
    """
    from aegis_sdc.report.html import write_report

    with _open_run(run_dir) as stores:
        try:
            path = write_report(stores, out)
        except OSError as error:  # a read-only run directory: the page goes elsewhere
            _print_problems(stores.problems)
            _console(stderr=True).print(f"error: cannot write the page ({_shown(error)}); choose another with --out")
            raise typer.Exit(2) from error
    typer.echo(str(path))
    if _print_problems(stores.problems):
        raise typer.Exit(1)


QUARANTINE_FORMATS = ("json", "slurm-exclude", "k8s")


def _quarantine_format_option(value: str) -> str:
    return _choice(value, QUARANTINE_FORMATS)


@app.command()
def quarantine(
    run_dir: Path = typer.Argument(..., help="A run directory holding aegis-rank*.sqlite stores."),
    output_format: str = typer.Option(
        "json", "--format", callback=_quarantine_format_option, help="json, slurm-exclude or k8s."
    ),
    list_path: Path = typer.Option(None, "--list", help="The quarantine list (default: RUN_DIR/quarantine.jsonl)."),
) -> None:
    """Print the devices to drain, for a scheduler: the quarantine list's devices and those of every
    incident committed in the stores, as JSON, a Slurm host list (--exclude=) or kubectl commands.

    Exit status 1: a store skipped or damaged (with none readable, the list's devices alone are
    printed), the list unreadable or a line of it not JSON, or an unsafe host name refused.

    Exit status 2: neither a store nor the list could be read (as `aegis incidents`).
    """
    from aegis_sdc.response.quarantine import (
        k8s_commands,
        read_quarantine,
        scheduler_devices,
        scheduler_hosts,
        slurm_exclude,
        split_unsafe,
    )
    from aegis_sdc.store.sqlite import read_incidents

    errors = _console(stderr=True)
    path = list_path or run_dir / "quarantine.jsonl"
    # A damaged store must not cost the scheduler the list: with no store readable the list's devices
    # are still printed (exit 1); with neither, exit 2 as `aegis incidents`.
    with _open_run(run_dir, none_readable_ok=path.is_file()) as stores:
        failed = not stores.databases
        records = [] if failed else read_incidents(stores)
    if failed:
        errors.print(f"error: no readable aegis store in {_shown(run_dir)}: only the quarantine list's devices")
    skipped: list[int] = []
    try:
        entries = read_quarantine(path, skipped)
    except OSError as error:  # a directory, a symbolic link, no permission
        reason = _shown(error.strerror or error)
        errors.print(f"error: {_shown(path)}: cannot be read ({reason}); the stores' devices are listed")
        entries, failed = [], True
    if skipped:
        lines = ", ".join(map(str, skipped[:10])) + (" …" if len(skipped) > 10 else "")
        errors.print(f"error: {_shown(path)}: line(s) {lines} not a JSON object (torn or edited): skipped; the"
                     " stores' incidents stand in for what they named")  # fmt: skip
        failed = True
    devices = scheduler_devices(entries, records)
    for d in devices:
        if not d["listed"]:
            errors.print(
                f"note: {_shown(d['host'])} {_shown(d['gpu_uuid'] or d['device'])} (incident {_shown(d['incident_id'])}"
                f" of rank {_shown(d['rank'])}, step {_shown(d['step'])}) is in the stores but not in the quarantine"
                " list (a process killed between the two writes): included"
            )
    if output_format == "json":
        problems = [{"path": str(p.path), "reason": p.reason, "skipped": p.skipped} for p in stores.problems]
        problems += [{"path": str(path), "reason": f"line {n} is not a JSON object", "skipped": True} for n in skipped]
        document = {"run_dir": str(run_dir), "devices": devices, "hosts": scheduler_hosts(devices),
                    "problems": problems}  # fmt: skip
        typer.echo(json.dumps(document, indent=2, default=str))  # JSON escapes control characters itself
    else:
        safe, unsafe = split_unsafe(devices)
        for host in unsafe:  # never printed where a shell or scheduler would parse it
            errors.print(
                f"error: host name '{_shown(host)}' refused: only letters, digits, '.', '-' and '_' (a letter or"
                " digit first) are printed; its devices are left out"
            )
        failed = failed or bool(unsafe)
        if output_format == "slurm-exclude":
            typer.echo(slurm_exclude(safe))
        else:
            for line in k8s_commands(safe):
                typer.echo(line)
    if _print_problems(stores.problems) or failed:
        raise typer.Exit(1)


def _replay_device_option(value: str) -> str:
    """cpu, or an available cuda[:N]."""
    return _cpu_or_cuda(value, "must be cpu or cuda:N")


def _fault_option(value: str | None) -> str | None:
    if value is not None:
        from aegis_sdc.faults.models import FaultSpec

        try:
            FaultSpec.parse(value)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
    return value


@app.command()
def replay(
    evidence: Path = typer.Argument(..., help="An evidence file (RUN_DIR/evidence/incident-R-N.json or .safetensors)."),
    device: str = typer.Option("cpu", "--device", callback=_replay_device_option, help="cpu or cuda:N."),
    times: int = typer.Option(3, "--times", min=1, help="How many times to re-execute the computation."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    inject: str = typer.Option(
        None,
        "--inject",
        hidden=True,
        callback=_fault_option,
        help="Tests: a fault spec (SITE@field=value,...) applied to every run.",
    ),
) -> None:
    """Re-execute an evidence file (an incident's, or a clean sample's) on a device: right or wrong values?

    Exit status: 0 every run computed the right values (the device is healthy for this evidence);
    3 a run reproduced the wrong values and no run computed anything else (the device is faulty);
    4 a run computed something else (unstable, or a device whose arithmetic differs); 2 the evidence
    cannot be used (missing, truncated, modified, not replayable, or not here: Triton needs CUDA).
    """
    from aegis_sdc.faults.models import FaultSpec
    from aegis_sdc.response.evidence import EvidenceError
    from aegis_sdc.response.replay import replay_evidence

    try:
        result = replay_evidence(evidence, device, times, FaultSpec.parse(inject) if inject else None)
    except EvidenceError as error:
        _console(stderr=True).print(f"error: {_shown(error)}")
        raise typer.Exit(2) from None
    except RuntimeError as error:  # the device failed to run it (out of memory, a kernel launch)
        _console(stderr=True).print(f"error: replay failed on {_shown(device)}: {_shown(str(error).splitlines()[0])}")
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        console = _console()
        console.print(
            f"{_shown(result.evidence)}: {_shown(result.site)}, step {result.step}, recorded on "
            f"{_shown(result.recorded_on)}; replayed {len(result.runs)}× on {_shown(result.device)}"
        )
        for i, run in enumerate(result.runs, 1):
            console.print(f"  run {i}: {run.upper()}")
        note = " (right: within the exact fp32 error bound; the evidence holds no right values)"
        console.print(f"{result.outcome}" + (note if result.right_by == "bound" else ""))
    raise typer.Exit(result.exit_code)


def _screen_device(value: str | None) -> str:
    """cpu, an available cuda[:N], or (None) the current CUDA device where there is one."""
    import torch

    if value is None:
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device: {value!r} is not a device") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"--device: must be cpu or cuda:N, got {value!r}")
    if not torch.cuda.is_available():
        raise ValueError("--device: CUDA was asked for but no CUDA device is available")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device: there is no cuda:{index} (CUDA devices here: {torch.cuda.device_count()})")
    return f"cuda:{index}"


@app.command()
def screen(
    device: str = typer.Option(None, "--device", help="cpu or cuda:N (default: the current CUDA device, else cpu)."),
    record: Path = typer.Option(None, "--record", help="Write the cases' fingerprints as a reference to this file."),
    against: Path = typer.Option(None, "--against", help="Compare bit for bit with a reference (it fixes the cases)."),
    evidence: list[Path] = typer.Option(
        None, "--evidence", help="A run directory, an evidence directory or file, replayed (repeatable)."
    ),
    shapes: str = typer.Option(None, "--shapes", help="tinyllama (default), llama3-8b, or Linear shapes INxOUT,..."),
    scales: str = typer.Option(None, "--scales", help="Scales of the A operand (default 1e-3,1,1e3)."),
    tokens: int = typer.Option(None, "--tokens", help="Rows of every GEMM (default 2048)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    inject: str = typer.Option(
        None, "--inject", hidden=True, help="Tests: a fault spec (SITE@field=value,...) the screened kernel applies."
    ),
) -> None:
    """A health verdict on one device: its checked GEMMs over a model's shapes, and evidence replayed.

    Exit status: 0 PASS; 3 FAIL (the device computed something wrong: a checksum beyond the exact bound,
    two runs that differ, a difference from a comparable reference, evidence reproduced); 4 INCONCLUSIVE
    (nothing failed, but the reference is from another kind of device or software, or an evidence replay
    computed something else); 2 the screen could not run as asked (an option, a reference or evidence file).
    """
    from aegis_sdc.faults.models import FaultSpec
    from aegis_sdc.response import screen as sc

    def refuse(message: str) -> typer.Exit:
        _console(stderr=True).print(f"error: {_shown(message)}")
        return typer.Exit(sc.EXIT_ERROR)

    try:
        if record is not None and against is not None:
            raise ValueError("--record and --against exclude each other")
        fixed = [name for name, value in (("--shapes", shapes), ("--scales", scales), ("--tokens", tokens)) if value]
        if against is not None and fixed:
            raise ValueError(f"{', '.join(fixed)} given with --against: the reference fixes the cases")
        if tokens is not None and tokens < 1:
            raise ValueError(f"--tokens: must be >= 1, got {tokens}")
        fault = FaultSpec.parse(inject) if inject else None
        device = _screen_device(device)
        reference = sc.load_reference(against) if against is not None else None
        report = sc.screen(
            device,
            shapes=shapes or "tinyllama",
            tokens=tokens or sc.DEFAULT_TOKENS,
            scales=sc.parse_scales(scales) if scales else sc.DEFAULT_SCALES,
            against=reference,
            evidence=evidence or (),
            fault=fault,
        )
        if record is not None and report.verdict != sc.FAIL:
            sc.write_reference(report, record)
            report.notes.append(f"reference written to {record}")
        elif record is not None:
            report.notes.append("no reference written: the screen failed")
    except (ValueError, sc.ScreenError) as error:
        raise refuse(str(error)) from None
    except RuntimeError as error:  # the device failed to run it (out of memory, a kernel launch)
        raise refuse(f"the screen failed on {device}: {str(error).splitlines()[0]}") from None
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_screen(report)
    raise typer.Exit(report.exit_code)


def _print_screen(report) -> None:
    console = _console()
    env, counts = report.env, report.evidence_counts()
    alarms = sum(c.alarm for c in report.cases)
    console.print(
        f"{_shown(env['device'])} ({_shown(env['path'])}, {_shown(env['dtype'])}): {len(report.cases)} cases in "
        f"{report.seconds:.1f} s, {alarms} checksum alarm(s)"
    )
    if any(not e.get("clean") for e in report.evidence):
        console.print("evidence replayed: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    if any(e.get("clean") for e in report.evidence):
        console.print("clean samples: " + ", ".join(f"{n} {kind}" for kind, n in report.clean_counts().items()))
    if report.reference is not None and report.reference["compared"]:
        console.print(f"against the reference: {len(report.reference['differs'])} case(s) differ bit for bit")
    for failure in report.failing():
        what = failure.get("case") or failure.get("evidence")
        console.print(f"  {_shown(what)}: {_shown(failure['reason'])}")
    for note in report.notes:
        console.print(f"note: {_shown(note)}")
    console.print(report.verdict)


if __name__ == "__main__":
    app()
