"""`run_study`: a paired healthy-vs-suspect study of one deterministic training (docs/study.md).

1. Determinism first: a healthy replica and a healthy twin on the suspect's device run the study's
   first `determinism_steps` batches; any differing bit stops the study (`NondeterminismError`).
2. The mode runs for `steps` steps, every step's rows committed to the run directory's store.
3. free-run only: both replicas (and the reseeded baseline) are fine-tuned on a held-out task.
4. A summary (stored with the rows) and the plots of the mode.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aegis_sdc.faults.injector import Injection
from aegis_sdc.store.sqlite import Store, rank_db_path
from aegis_sdc.study import modes
from aegis_sdc.study.config import StudyConfig
from aegis_sdc.study.finetune import finetune_and_evaluate
from aegis_sdc.study.replica import ModelFactory, Replica, build_replica, first_state_difference, token_stream
from aegis_sdc.study.summary import summarize
from aegis_sdc.study.taps import study_units
from aegis_sdc.workloads.data import SyntheticTokens

Progress = Callable[[str, int, int], None]  # (phase, completed, total)


@dataclass
class StudyResult:
    mode: str
    run_dir: Path
    summary: dict[str, Any]
    rows: list[modes.Row]
    replicas: dict[str, Replica]
    injected: list[Injection]
    plots: list[Path] = field(default_factory=list)
    seconds: float = 0.0


class _BatchCache:
    """The batch of each step, drawn once and shared by the replicas that train on it."""

    def __init__(self, data: SyntheticTokens) -> None:
        self.data = data
        self.step = -1
        self.batch: modes.Batch | None = None

    def __call__(self, step: int) -> modes.Batch:
        if step != self.step:
            if step != self.step + 1:
                raise RuntimeError(f"batches are drawn in step order: asked for {step} after {self.step}")
            self.step, self.batch = step, self.data.batch()
        return self.batch


def default_run_dir(mode: str) -> Path:
    return Path("aegis-runs") / f"study-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_study(
    cfg: StudyConfig,
    *,
    model_factory: ModelFactory | None = None,
    progress: Progress | None = None,
    plots: bool = True,
) -> StudyResult:
    """Run the study `cfg` describes; see the module docstring. Raises `NondeterminismError` first."""
    started = time.perf_counter()
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg.mode)
    if rank_db_path(run_dir, 0).exists():
        raise FileExistsError(f"{run_dir} already holds a store; choose a new run directory")

    def replica(name: str, device: torch.device, faults=()) -> Replica:
        return build_replica(name, cfg, device, faults=faults, model_factory=model_factory)

    # 1. Determinism: a healthy replica and its twin on the suspect's device, on the study's first batches.
    first = replica("healthy", cfg.healthy_device)
    units = study_units(first.model)
    probe_data = token_stream(cfg, sample_seed=cfg.seed)
    probe_batches = [probe_data.batch() for _ in range(min(cfg.determinism_steps, cfg.steps))]
    modes.check_determinism(first, replica("twin", cfg.suspect), units, probe_batches)
    if progress is not None:
        progress("determinism", len(probe_batches), len(probe_batches))

    # 2. The mode.
    store = Store(rank_db_path(run_dir, 0))
    try:
        store.write_run(
            {"host": socket.gethostname(), "rank": 0, "local_rank": 0, "world_size": 1, "device": str(cfg.suspect)},
            {"study": dataclasses.asdict(cfg)},
            {"torch": torch.__version__},
        )
        store.write_study(cfg.mode, dataclasses.asdict(cfg))
        healthy = replica("healthy", cfg.healthy_device)
        suspect = replica("suspect", cfg.suspect, cfg.faults)
        replicas = {"healthy": healthy, "suspect": suspect}
        injector = suspect.injector  # the ground truth (fine-tuning switches the faults off)
        batches = _BatchCache(token_stream(cfg, sample_seed=cfg.seed))
        if cfg.mode == "compute-sync":
            steps = modes.compute_sync(healthy, suspect, units, batches, cfg.steps)
        elif cfg.mode == "param-sync":
            steps = modes.param_sync(healthy, suspect, batches, cfg.steps)
        else:
            replicas["baseline"] = replica("baseline", cfg.healthy_device)
            steps = modes.free_run(
                healthy,
                suspect,
                replicas["baseline"],
                batches,
                _BatchCache(token_stream(cfg, sample_seed=cfg.baseline_seed)),
                cfg.steps,
                spike_ratio=cfg.spike_ratio,
                spike_window=cfg.spike_window,
            )
        rows: list[modes.Row] = []
        logged = 0
        for step, step_rows in steps:
            fired = injector.log.since(logged) if injector else []
            logged = injector.log.total if injector else 0
            step_rows += [(step, site, "fault", float(n)) for site, n in Counter(i.site for i in fired).items()]
            store.write_study_metrics(step_rows)
            rows.extend(step_rows)
            if progress is not None:
                progress(cfg.mode, step + 1, cfg.steps)

        # 3. free-run: fine-tune on the held-out task.
        if cfg.mode == "free-run":
            end = cfg.steps
            accuracies = finetune_and_evaluate(
                list(replicas.values()),
                cfg,
                progress=None if progress is None else lambda name, i, n: progress(f"fine-tune {name}", i, n),
            )
            accuracies["accuracy_difference"] = accuracies["accuracy_suspect"] - accuracies["accuracy_healthy"]
            finetune_rows = [(end, "finetune", metric, value) for metric, value in accuracies.items()]
            store.write_study_metrics(finetune_rows)
            rows.extend(finetune_rows)

        # 4. Summary and plots.
        injected = list(injector.log) if injector else []
        difference = first_state_difference(suspect, healthy)
        summary = summarize(cfg, rows, injected, difference)
        summary["seconds"] = round(time.perf_counter() - started, 2)
        store.finish_study(summary)
        store.finish_run({"study": cfg.mode})
    finally:
        store.close()
    result = StudyResult(cfg.mode, run_dir, summary, rows, replicas, injected, seconds=summary["seconds"])
    if plots:
        from aegis_sdc.report.study_plots import plot_study

        result.plots = plot_study(rank_db_path(run_dir, 0), run_dir)
    (run_dir / "study-summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return result
