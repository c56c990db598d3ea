"""`aegis demo`: train the workload with every Linear protected while a faulty matrix unit strikes.

The fault is intermittent: from `fault_start` on, each call of one site's forward GEMM is corrupted
with probability `fault_probability` (a flipped bit of one fp32 accumulator element, before the
checksum and the rounding). The guard must alarm, confirm each strike by replay, name the site, the
step and the device, and write the run directory. `--no-fault` must end with zero incidents.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import aegis_sdc as aegis
from aegis_sdc.events import Incident, Verdict, VerdictKind, VTask
from aegis_sdc.report.plots import plot_site_differences
from aegis_sdc.store.sqlite import rank_db_path
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 400
    fault: bool = True
    fault_site: str = "layers.1.mlp.up_proj:fwd"
    fault_bit: int = 22  # the fp32 mantissa's top bit: the element changes by up to ±50%
    fault_probability: float = 0.03
    fault_start: int = 100
    run_dir: str | None = None
    device: str = "auto"
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 128

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")


@dataclass
class DemoResult:
    summary: aegis.GuardSummary
    incidents: list[Incident]
    run_dir: Path
    plot: Path
    first_loss: float
    final_loss: float
    seconds: float
    injected: int
    detected: int
    quarantine: Path | None = None
    injected_steps: list[int] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    return torch.device(name)


def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoResult:
    console = console or Console()
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model_cfg = LlamaConfig()
    model = Llama(model_cfg).to(device)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)  # the GPU path: bf16 GEMMs on the fused Triton kernels
    data = SyntheticTokens(
        TokenStreamConfig(
            vocab_size=model_cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed
        ),
        device=device,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    run_dir = Path(cfg.run_dir or aegis.config.default_run_dir())
    faults = ()
    if cfg.fault:
        faults = (
            aegis.FaultSpec(
                site=cfg.fault_site,
                model="bitflip",
                bit=cfg.fault_bit,
                probability=cfg.fault_probability,
                start_step=cfg.fault_start,
                seed=cfg.seed,
            ),
        )
    # every call checked, on the GPU too: the demonstration is about what a check sees (the default
    # on a GPU samples to a 1% budget, docs/hot-path.md)
    guard_cfg = aegis.GuardConfig(run_dir=str(run_dir), faults=faults, sampling=aegis.SamplingConfig.every_call())
    console.rule("[bold]aegis demo")
    console.print(
        f"workload: Llama-style decoder, {model_cfg.n_layers} layers, dim {model_cfg.dim}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, on [bold]{device}[/]; "
        f"synthetic Markov tokens (loss floor {data.entropy_rate():.2f} nats)"
    )
    if cfg.fault:
        console.print(
            f"fault: [bold red]intermittent matrix-unit fault[/] in {cfg.fault_site} — bit {cfg.fault_bit} of one "
            f"fp32 accumulator element flips with p={cfg.fault_probability} per call from step {cfg.fault_start}"
        )
    else:
        console.print("fault: none (--no-fault): a clean run must confirm nothing")

    guard = aegis.protect(model, optimizer=optimizer, config=guard_cfg)
    console.print(
        f"protected: {len(guard.sites)} sites (forward, dgrad, wgrad of {len(guard.sites) // 3} Linears)"
        + ("; attention forward and backward" if guard_cfg.attention and device.type == "cpu" else "")
    )

    def on_event(event: str, payload) -> None:
        if event == "alarm":
            task: VTask = payload
            e = task.evidence
            console.log(
                f"[yellow]alarm[/] step {e.step} {e.site.name}: {e.channel.value} difference {e.value:.3g} "
                f"> threshold {e.threshold:.3g} → vTask {task.id} ({e.tile})"
            )
        elif event == "verdict":
            v: Verdict = payload
            style = {"confirmed_sdc": "bold red", "false_alarm": "green"}.get(v.kind.value, "magenta")
            extra = f", wrong execution: {v.wrong_execution.value}" if v.wrong_execution else ""
            console.log(f"[{style}]verdict[/] vTask {v.vtask_id}: {v.kind.value}{extra} (replay {v.replay_ms:.1f} ms)")
        elif event == "incident":
            inc: Incident = payload
            who = inc.identity
            console.log(
                f"[bold red]INCIDENT {inc.id}[/] confirmed SDC at [bold]{inc.site.name}[/], step {inc.step}, "
                f"rank {who.rank} on {who.host}, device {who.device}{' ' + who.gpu_uuid if who.gpu_uuid else ''}"
            )

    guard.subscribe(on_event)
    # The demo shows every alarm, verdict and incident itself: keep the library's own log lines and
    # warnings (meant for unattended training jobs) out of its display.
    library_log = logging.getLogger("aegis_sdc")
    library_log.addHandler(logging.NullHandler())
    library_log.propagate = False
    warnings.filterwarnings("ignore", category=aegis.SilentDataCorruptionWarning)
    first_loss = final_loss = math.nan
    started = time.perf_counter()
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("checks {task.fields[checks]}"),
        TextColumn("alarms {task.fields[alarms]}"),
        TextColumn("[red]confirmed {task.fields[confirmed]}"),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("train", total=cfg.steps, loss=float("nan"), checks=0, alarms=0, confirmed=0)
            for step in range(cfg.steps):
                inputs, targets = data.batch()
                loss = lm_loss(model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()  # the guard judges and verifies in the optimizer's pre-hook
                if step == 0 or step % 10 == 0 or step == cfg.steps - 1:
                    value = loss.item()
                    first_loss = value if step == 0 else first_loss
                    final_loss = value
                    s = guard.summary()
                    progress.update(
                        bar,
                        completed=step + 1,
                        loss=value,
                        checks=s.checks,
                        alarms=s.alarms,
                        confirmed=s.confirmed,
                    )
                else:
                    progress.update(bar, completed=step + 1)
    finally:
        summary = guard.close()
    seconds = time.perf_counter() - started

    plot = plot_site_differences(
        rank_db_path(run_dir, guard.identity.rank),
        run_dir / "site-differences.png",
        highlight=cfg.fault_site if cfg.fault else None,
    )
    found = {(i.site.name, i.step) for i in guard.incidents}
    injected = [(j.site, j.step) for j in guard.injector.log]
    detected = sum(1 for key in injected if key in found)
    quarantine = Path(guard.responder.quarantine_path) if guard.incidents else None
    result = DemoResult(
        summary=summary,
        incidents=list(guard.incidents),
        run_dir=run_dir,
        plot=plot,
        first_loss=first_loss,
        final_loss=final_loss,
        seconds=seconds,
        injected=len(injected),
        detected=detected,
        quarantine=quarantine,
        injected_steps=sorted({s for _, s in injected}),
    )
    print_summary(console, result)
    return result


def print_summary(console: Console, r: DemoResult) -> None:
    s = r.summary
    table = Table(title="aegis demo: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("steps", f"{s.steps} in {r.seconds:.1f} s")
    table.add_row("loss", f"{r.first_loss:.3f} → {r.final_loss:.3f}")
    table.add_row("protected sites", str(s.sites))
    table.add_row("checked GEMM calls", str(s.checks))
    if s.attention_checks:
        table.add_row("checked attention passes", str(s.attention_checks))
    table.add_row("alarms (vTasks)", str(s.alarms))
    table.add_row("false alarms", f"{s.false_alarms} ({s.false_alarm_rate:.2e} per check)")
    table.add_row("confirmed SDC", f"[bold red]{s.confirmed}[/]" if s.confirmed else "0")
    table.add_row("not verifiable / non-finite input", f"{s.not_verifiable} / {s.nonfinite_inputs}")
    table.add_row("faults injected → confirmed", f"{r.injected} → {r.detected}")
    table.add_row(
        "verification",
        f"max latency {s.max_latency_steps} steps / {s.max_latency_ms:.1f} ms, "
        f"replay total {s.replay_ms_total:.0f} ms, backlog {s.backlog}",
    )
    table.add_row("run directory", str(r.run_dir))
    table.add_row("plot", str(r.plot))
    if r.quarantine:
        table.add_row("quarantine list", str(r.quarantine))
    console.print(table)
    if r.incidents:
        first = r.incidents[0]
        who = first.identity
        console.print(
            f"[bold red]Bad device:[/] {who.device}{' (' + who.gpu_uuid + ')' if who.gpu_uuid else ''} on {who.host}, "
            f"rank {who.rank} — {len(r.incidents)} confirmed incident(s) at "
            f"{', '.join(sorted({i.site.name for i in r.incidents}))}; first at step {first.step}. "
            f"Details: aegis incidents {r.run_dir}"
        )
    elif s.confirmed == 0:
        console.print("[green]No confirmed silent data corruption.[/]")


def confirmed_verdicts(incidents: list[Incident]) -> int:
    return sum(1 for i in incidents if i.verdict.kind is VerdictKind.CONFIRMED_SDC)
