"""Run a fault campaign: many short trials from one snapshot of a protected training, each judged
against its clean twin and against the coverage report.

One guard protects one model for the whole campaign, so thresholds are calibrated once (the warm-up)
and every trial meets the sensors as a long run would. A trial restores the model and the optimizer
from the snapshot, arms one fault for its first step, runs `steps_per_trial` steps on the same
batches as every other trial, and drains the guard (every vTask verified before the next trial).
The clean twin — the same steps without a fault — runs first and again every `twin_every` trials:
its parameters are the reference a trial's are compared with bit for bit (`affected`), and it must
confirm nothing (`false_confirmed`). Per trial: injected, alarmed, confirmed, localized (site, step,
and the GEMM tile holding the element), detection latency in steps, affected, inside the claim.
"""

from __future__ import annotations

import copy
import logging
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from aegis_sdc.campaign.coverage import Claim, coverage_report, inside, segment_of
from aegis_sdc.campaign.trials import (
    ATTENTION_STAGES,
    GEMM_LOCATIONS,
    HOOKED,
    LOCATIONS,
    Targets,
    Trial,
    draw_trials,
    install,
    targets_of,
)
from aegis_sdc.events import VerdictKind
from aegis_sdc.validation import check_bool, check_choice, check_int, check_text, set_field


@dataclass(frozen=True)
class CampaignConfig:
    """A campaign on the project's Llama workload (docs/campaigns.md has every field's meaning)."""

    trials: int = 2000
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # the model's: "bfloat16" on a GPU runs the Triton kernels as training does
    warmup_steps: int = 20  # calibration (16 checks per site) and two more
    steps_per_trial: int = 2  # the fault strikes the first; the second brings what is read a step late
    twin_every: int = 25  # a clean twin every this many trials (and before the first)
    bits: tuple[int, ...] = (0, 8, 13, 16, 20, 22, 23, 26, 30, 31)
    rs: tuple[float, ...] = (0.25, 1.0, 4.0, 16.0)
    locations: tuple[str, ...] = LOCATIONS
    n_layers: int = 2
    dim: int = 128
    batch: int = 4
    seq: int = 64
    run_dir: str | None = None
    # on CUDA, attention on the checked Triton kernels (ops/checked_attention.TRITON_ON_CUDA, for the
    # campaign's run): without them a GPU's attention runs unchecked and its stages cannot be struck
    triton_attention: bool = True

    def __post_init__(self) -> None:
        for name, least in (("trials", 1), ("warmup_steps", 18), ("steps_per_trial", 2), ("twin_every", 1),
                            ("n_layers", 1), ("dim", 8), ("batch", 1), ("seq", 2)):  # fmt: skip
            set_field(self, name, check_int, ge=least)
        set_field(self, "seed", check_int)
        set_field(self, "device", check_text)
        set_field(self, "triton_attention", check_bool)
        set_field(self, "dtype", check_choice, choices=("float32", "bfloat16", "float16"))
        for location in self.locations:
            check_choice("CampaignConfig", "locations", location, choices=LOCATIONS)


@dataclass
class TrialResult:
    trial: Trial
    injected: bool
    alarmed: bool
    confirmed: bool
    localized: bool  # confirmed at its own site and step (a GEMM: in the tile holding the element)
    localized_segment: bool  # or at the checkpointed segment it ran in (the recompute check)
    latency_steps: int | None
    affected: bool
    inside: bool
    size: float | None  # GEMM: |δ| over the row threshold
    sites: list[str]  # where incidents were confirmed

    def to_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if k != "trial"}
        return {**asdict(self.trial), "cell": self.trial.cell, **fields}


@dataclass
class CampaignResult:
    config: CampaignConfig
    claims: dict[str, Claim]
    trials: list[TrialResult] = field(default_factory=list)
    twins: int = 0
    twin_confirmed: int = 0
    twin_false_alarms: int = 0
    twin_deterministic: bool = True
    seconds: float = 0.0
    complete: bool = False  # every trial ran (a partial record says how far it got)

    def misses_inside(self) -> list[TrialResult]:
        """Faults inside the claimed coverage that changed training and were not confirmed: each one
        fails the campaign."""
        return [t for t in self.trials if t.inside and not t.confirmed]

    def summary(self) -> dict[str, Any]:
        claimed = [t for t in self.trials if t.inside]
        confirmed = [t for t in claimed if t.confirmed]
        return {
            "trials": len(self.trials),
            "complete": self.complete,  # False: a partial record, `trials` of `config.trials` done
            "confirmed_inside_coverage": len(confirmed),
            "missed_inside_coverage": len(self.misses_inside()),
            "localized": sum(t.localized for t in confirmed) / len(confirmed) if confirmed else None,
            "localized_to_segment": sum(t.localized_segment for t in confirmed) / len(confirmed) if confirmed else None,
            "false_confirmed": self.twin_confirmed,
            "inside_coverage": len(claimed),
            "clean_twins": self.twins,
            "twin_false_alarms": self.twin_false_alarms,
            "twins_identical": self.twin_deterministic,
            # GEMM trials whose size was measured (the reference path measures it; the Triton path not
            # yet: unmeasured GEMM trials are never inside the claim)
            "gemm_trials_sized": sum(t.size is not None for t in self.trials if t.trial.location in GEMM_LOCATIONS),
            "seconds": self.seconds,
        }

    def cells(self) -> dict[str, dict[str, Any]]:
        """Per cell (location, stage, magnitude): counts and the median detection latency."""
        by_cell: dict[str, list[TrialResult]] = defaultdict(list)
        for t in self.trials:
            by_cell[t.trial.cell].append(t)
        out = {}
        for cell, ts in by_cell.items():
            latencies = [t.latency_steps for t in ts if t.latency_steps is not None]
            out[cell] = {
                "location": ts[0].trial.location, "stage": ts[0].trial.stage, "model": ts[0].trial.model,
                "magnitude": ts[0].trial.magnitude, "trials": len(ts), "injected": sum(t.injected for t in ts),
                "affected": sum(t.affected for t in ts), "alarmed": sum(t.alarmed for t in ts),
                "confirmed": sum(t.confirmed for t in ts), "localized": sum(t.localized for t in ts),
                "localized_segment": sum(t.localized_segment for t in ts),
                "inside": sum(t.inside for t in ts), "missed_inside": sum(t.inside and not t.confirmed for t in ts),
                "median_latency_steps": statistics.median(latencies) if latencies else None,
            }  # fmt: skip
        return out


class _Workload:
    """The project's Llama with every block checkpointed (so recompute sites exist), AdamW, and the
    fixed batches every trial trains on."""

    def __init__(self, cfg: CampaignConfig) -> None:
        from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
        from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

        self.device = torch.device(cfg.device)
        torch.manual_seed(cfg.seed)
        model_cfg = LlamaConfig(vocab_size=256, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=4, n_kv_heads=2,
                                hidden_dim=2 * cfg.dim, max_seq_len=cfg.seq, activation_checkpointing=True)  # fmt: skip
        self.model = Llama(model_cfg).to(self.device, getattr(torch, cfg.dtype))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.data = SyntheticTokens(TokenStreamConfig(vocab_size=256, seq_len=cfg.seq, batch_size=cfg.batch,
                                                      seed=cfg.seed))  # fmt: skip
        self.loss = lm_loss

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        # copies: a fault in a saved tensor may flip the very token ids the embedding saved
        inputs, targets = (t.to(self.device, copy=True) for t in batch)
        loss = self.loss(self.model(inputs), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    from aegis_sdc.kernels.reference import bitwise_equal

    return all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))


PARTIAL_EVERY_S = 30.0  # seconds between the partial records `run_campaign` hands its `partial` callback


def run_campaign(
    cfg: CampaignConfig,
    progress: Callable[[int, int], None] | None = None,
    partial: Callable[[CampaignResult], None] | None = None,
) -> CampaignResult:
    """The campaign (see the module docstring); `progress(done, total)` after each trial, and
    `partial(result)` every PARTIAL_EVERY_S seconds with the trials done so far (`result.complete` is
    False), so that a campaign killed hours in leaves its record up to its last half minute. The
    guard's console lines and warnings — one per confirmed fault, thousands here, all expected — are
    held back while it runs; the store in `run_dir` keeps every incident."""
    from aegis_sdc.response.policies import SilentDataCorruptionWarning

    logger = logging.getLogger("aegis_sdc")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SilentDataCorruptionWarning)
            return _run(cfg, progress, partial)
    finally:
        logger.setLevel(level)


Partial = Callable[[CampaignResult], None] | None


def _run(cfg: CampaignConfig, progress: Callable[[int, int], None] | None, partial: Partial) -> CampaignResult:
    from aegis_sdc.ops import checked_attention

    routed = checked_attention.TRITON_ON_CUDA
    checked_attention.TRITON_ON_CUDA = cfg.triton_attention
    try:
        return _run_routed(cfg, progress, partial)
    finally:
        checked_attention.TRITON_ON_CUDA = routed


def _run_routed(cfg: CampaignConfig, progress: Callable[[int, int], None] | None, partial: Partial
                ) -> CampaignResult:  # fmt: skip
    import aegis_sdc as aegis

    started = time.perf_counter()
    work = _Workload(cfg)
    run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="aegis-campaign-")
    config = aegis.GuardConfig(
        run_dir=run_dir, sampling=aegis.SamplingConfig.every_call(),
        fingerprints=aegis.FingerprintConfig(saved_probability=1.0, saved_min_bytes=4),
        update_replay=aegis.UpdateReplayConfig(slices=1, every=1),
        response=aegis.ResponseConfig(policy="warn", quarantine=False),
    )  # fmt: skip
    guard = aegis.protect(work.model, optimizer=work.optimizer, config=config)
    verdicts: list[Any] = []
    guard.subscribe(lambda event, payload: verdicts.append(payload) if event == "verdict" else None)
    try:
        for _ in range(cfg.warmup_steps):
            work.step(work.data.batch())
        guard.drain()
        targets = targets_of(work.model, guard)
        claims = coverage_report(guard)
        result = CampaignResult(cfg, claims)
        model_state = copy.deepcopy(work.model.state_dict())
        optimizer_state = copy.deepcopy(work.optimizer.state_dict())
        batches = [work.data.batch() for _ in range(cfg.steps_per_trial)]

        def restore() -> None:
            work.model.load_state_dict(model_state)
            work.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
            torch.manual_seed(cfg.seed)

        def twin() -> list[torch.Tensor]:
            restore()
            incidents, n_verdicts = guard.incidents.total, len(verdicts)
            for batch in batches:
                work.step(batch)
            guard.drain()
            result.twins += 1
            result.twin_confirmed += guard.incidents.total - incidents
            result.twin_false_alarms += sum(v.kind is VerdictKind.FALSE_ALARM for v in verdicts[n_verdicts:])
            return [p.detach().clone() for p in work.model.parameters()]

        reference = twin()
        trials = draw_trials(targets, cfg.trials, cfg.seed, cfg.bits, cfg.rs, cfg.locations)
        saved = time.perf_counter()
        for n, trial in enumerate(trials):
            if n and n % cfg.twin_every == 0:
                result.twin_deterministic &= _bits_equal(twin(), reference)
            result.trials.append(_run_trial(trial, work, guard, targets, claims, batches, restore, reference))
            if progress is not None:
                progress(n + 1, len(trials))
            if partial is not None and time.perf_counter() - saved >= PARTIAL_EVERY_S and n + 1 < len(trials):
                result.seconds = time.perf_counter() - started
                partial(result)
                saved = time.perf_counter()
        result.twin_deterministic &= _bits_equal(twin(), reference)
    finally:
        guard.close()
    result.seconds = time.perf_counter() - started
    result.complete = True
    return result


def _run_trial(trial: Trial, work: _Workload, guard, targets: Targets, claims: dict[str, Claim], batches: list,
               restore: Callable[[], None], reference: list[torch.Tensor]) -> TrialResult:  # fmt: skip
    restore()
    step = guard.step_number
    spec = trial.spec(step)
    guard.injector.set_specs((spec,) if spec is not None else ())
    incidents, injections, alarms = guard.incidents.total, guard.injector.log.total, guard.counts["alarms"]
    undo = install(trial, work.model, work.optimizer) if trial.location in HOOKED else (lambda: None)
    try:
        for batch in batches:
            work.step(batch)
        guard.drain()
    finally:
        undo()
        guard.injector.set_specs(())
    found = guard.incidents.since(incidents)
    fired = guard.injector.log.since(injections)
    for injection in fired:  # the Triton path leaves the size on the device: read after the trial
        if isinstance(injection.size, torch.Tensor):
            injection.size = float(injection.size)
    affected = not _bits_equal([p.detach() for p in work.model.parameters()], reference)
    injected = bool(fired) or trial.location in HOOKED
    expected = _expected_sites(trial, targets)
    hits = [i for i in found if i.site.name in expected and i.step == step]
    if trial.location in GEMM_LOCATIONS and hits:
        hits = [i for i in hits if _holds(i, fired)]
    segment = segment_of(trial.site.rsplit(":", 1)[0], targets.recompute)
    in_segment = [i for i in found if segment is not None and i.site.name == segment and i.step == step]
    size = None
    sized = [i for i in fired if i.size is not None and i.threshold]
    if sized:
        size = max(i.size / i.threshold for i in sized)
    return TrialResult(
        trial=trial, injected=injected, alarmed=guard.counts["alarms"] > alarms, confirmed=bool(found),
        localized=bool(hits), localized_segment=bool(hits or in_segment),
        latency_steps=min((i.step - step for i in found), default=None), affected=affected,
        inside=inside(trial, claims, fired, affected, targets.recompute), size=size,
        sites=sorted({i.site.name for i in found}),
    )  # fmt: skip


def _expected_sites(trial: Trial, targets: Targets) -> set[str]:
    if trial.location in ATTENTION_STAGES:  # a forward fault may show in the backward's checks
        module = trial.site.rsplit(":", 1)[0]
        return {f"{module}:attn_fwd", f"{module}:attn_bwd"}
    if trial.location == "elementwise":
        segment = segment_of(trial.site, targets.recompute)
        return {segment} if segment else set()
    if trial.location == "optimizer_update":
        return {f"{trial.site}:optimizer_update"}
    if trial.location in ("optimizer_state", "weights"):
        return {f"{trial.site}:param", f"{trial.site}:optimizer_state"}
    return {trial.site}


def _holds(incident, fired) -> bool:
    """A GEMM incident's mismatched tiles hold the corrupted element."""
    elements = [i.element for i in fired if i.element is not None]
    tiles = incident.verdict.mismatched_tiles
    return any(t.row_start <= r < t.row_stop and t.col_start <= c < t.col_stop for t in tiles for r, c in elements)
