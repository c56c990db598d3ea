"""The Guard: builds the protection of one model from its config, and runs the step end.

The parts, in the order a step meets them:

- runtime/sites.py     one numbering of every site (GEMM sites first, three per Linear);
- runtime/plan.py      the step's sampling plan: which calls run checked, drawn once per step;
                       runtime/budget.py chooses its probabilities under `SamplingConfig.budget`;
- ops/ and sensors/    the checked calls record evidence on the device (no host sync per op);
- runtime/evidence.py  at the step end, the evidence travels to the host in one read, started
                       without waiting; runtime/gate.py lets a fused optimizer run meanwhile and
                       holds back its update on the device when a check alarmed;
- sensors/state_vote.py, sensors/update_replay.py, distributed/peer_replay.py: the state no op
                       check sees (the replicas' vote in the step's read and exchange, the update
                       replayed by slices, peers recomputing micro-batches at the step end);
- here, `_conclude`    `_judge` (alarms become vTasks) → `_verify` (replays; thresholds adapt on
                       false alarms; confirmed SDCs become incidents) → `_record` (runtime/record.py:
                       one transaction per step) → `_respond` (listeners, then the policy, which may
                       raise before an update lands: after the record, so nothing found is lost).

The step ends in the optimizer's step hooks, or at `Guard.step()` for loops without an optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from aegis_sdc import __version__
from aegis_sdc.bounded import BoundedLog
from aegis_sdc.config import GuardConfig
from aegis_sdc.distributed.agreement import check_agreement
from aegis_sdc.distributed.comm_check import (
    CheckedReduceScatter,
    CommCapture,
    CommChecks,
    checked_allreduce_hook,
    max_ratios,
)
from aegis_sdc.distributed.context import make_context
from aegis_sdc.distributed.identity import discover
from aegis_sdc.distributed.outlier import OutlierWarning, detect_outliers
from aegis_sdc.distributed.peer_replay import LossFn, PeerCapture, PeerFinding, PeerReplay
from aegis_sdc.events import (
    AttentionKind,
    Channel,
    CommKind,
    Evidence,
    FingerprintKind,
    GemmKind,
    Incident,
    RankIdentity,
    Site,
    StateKind,
    Verdict,
    VerdictKind,
    VTask,
)
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.integrations.attention import AttentionRouter
from aegis_sdc.integrations.checkpointing import RecomputeChecker, SavedTensorChecker
from aegis_sdc.integrations.modules import LinearFilter, restore_linears, select_linears, swap_linears
from aegis_sdc.kernels.reference import Tiling
from aegis_sdc.ops.checked_linear import LinearHooks, PlanTracer
from aegis_sdc.ops.cost import attention_check_cost_ms, check_cost_ms
from aegis_sdc.ops.fingerprint import FingerprintPool
from aegis_sdc.ops.gemm_replay import MODIFIED_BEFORE_REPLAY
from aegis_sdc.ops.triton_linear import DeviceState, WeightSums
from aegis_sdc.response.checkpoints import (
    CERTIFIED,
    PENDING,
    UNCERTIFIED,
    Certificate,
    certificate_path,
    fingerprints,
    latest_certified,
    load_state,
    rng_states,
    save_state,
    set_rng_states,
    write_certificate,
)
from aegis_sdc.response.console import StepConsole
from aegis_sdc.response.evidence import CleanSample, EvidenceBudget, write_clean_evidence, write_incident_evidence
from aegis_sdc.response.policies import Responder
from aegis_sdc.response.quarantine import quarantine_entry
from aegis_sdc.runtime import evidence as step_evidence
from aegis_sdc.runtime.budget import BudgetController, BudgetPlan, StepTimer
from aegis_sdc.runtime.coverage import CoverageReport, unprotected_modules
from aegis_sdc.runtime.evidence import Collected
from aegis_sdc.runtime.gate import OptimizerGate, gateable
from aegis_sdc.runtime.plan import GEMMS_PER_LINEAR, StepPlan
from aegis_sdc.runtime.record import StepRecorder, StepReport
from aegis_sdc.runtime.run_dir import open_run_store
from aegis_sdc.runtime.sensor_cost import SensorClock, SensorCost
from aegis_sdc.runtime.sites import SiteRegistry
from aegis_sdc.sensors.attention import AttentionRecord, AttentionSensor
from aegis_sdc.sensors.fingerprint import FingerprintChecks
from aegis_sdc.sensors.gemm import CallRecord, CleanSampler, GemmSensor, StepClock
from aegis_sdc.sensors.sampling import Sampler
from aegis_sdc.sensors.state_vote import StateVote, VoteCapture, VoteRecord, replica_sets
from aegis_sdc.sensors.update_replay import UpdateCapture, UpdateReplay
from aegis_sdc.verify.verifier import Verifier

log = logging.getLogger("aegis_sdc")

# Forward passes with gradients at the first step, no optimizer and no guard.step(), before the guard
# says that the loop has no step boundary (more than any gradient accumulation of one step runs).
NO_BOUNDARY_FORWARDS = 64
Listener = Callable[[str, Any], None]
COMM_SLOTS = 256  # collectives exchanged per step (the exchange tensor has a fixed shape)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that steps: wrappers that hold it as `.optimizer` (accelerate's
    `AcceleratedOptimizer`, Lightning's `LightningOptimizer`) are unwrapped."""
    inner = optimizer
    while not _has_step_hooks(inner) and isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not _has_step_hooks(inner):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return inner


def _has_step_hooks(optimizer: Any) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks")


@dataclass(frozen=True)
class GuardSummary:
    steps: int
    sites: int
    checks: int
    alarms: int
    false_alarms: int
    confirmed: int
    not_verifiable: int
    nonfinite_inputs: int
    backlog: int
    verified: int
    max_latency_steps: int
    max_latency_ms: float
    replay_ms_total: float
    faults_injected: int
    outlier_warnings: int = 0
    fingerprint_checks: int = 0
    attention_checks: int = 0
    not_deterministic: int = 0
    coverage: dict[str, Any] = field(default_factory=dict)  # fingerprint sites checked / not covered
    unattributed: int = 0  # proven corruptions no majority or replay pins on one device (collectives)
    data_false_alarms: int = 0  # false alarms on unusual data: thresholds left alone
    checked_flops_fraction: float = 0.0  # of all GEMM FLOPs run while protected, the checked share
    attention_checked_flops_fraction: float = 0.0  # of the FLOPs of the attention calls the op takes
    state_votes: int = 0  # replica state votes judged (sensors/state_vote.py)
    update_replays: int = 0  # optimizer-update slices replayed (sensors/update_replay.py)
    peer_replays: int = 0  # steps whose micro-batches peers recomputed (distributed/peer_replay.py)
    # per state sensor: its measured ms per firing, period in steps and ms per step (runtime/sensor_cost.py)
    state_sensor_costs: dict[str, dict] = field(default_factory=dict)
    # a long run's overflow, counted (docs/operations.md): incidents, injected faults and outlier
    # warnings no longer held in memory (the store has them), statistics-only step records the store
    # could not take, console lines the rate limit held back, store records still waiting (a full disk)
    records_dropped_from_memory: int = 0
    store_records_dropped: int = 0
    console_lines_held_back: int = 0
    store_records_waiting: int = 0

    @property
    def false_alarm_rate(self) -> float:
        """False alarms per checked call."""
        return self.false_alarms / self.checks if self.checks else 0.0

    def brief(self) -> str:
        """One line for a log."""
        return (f"{self.steps} steps, {self.checks} checks, {self.confirmed} confirmed SDCs, "
                f"{self.false_alarms} false alarms")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self) | {"false_alarm_rate": self.false_alarm_rate}


class Guard:
    """Protection of one model; use `aegis_sdc.protect()` to build one. A context manager."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        config: GuardConfig | None = None,
        filter: LinearFilter | None = None,
        identity: RankIdentity | None = None,
        start_step: int = 0,
        process_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"protect() expects an nn.Module, got {type(model).__name__}")
        optimizer = None if optimizer is None else unwrap_optimizer(optimizer)
        if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            # torch.compile(model) before protect(): protect the module it wraps (its forward is
            # traced at the first call, after the swap), so that site names do not depend on the order.
            model = model._orig_mod
        config = config or GuardConfig()
        if not isinstance(config, GuardConfig):
            raise TypeError(f"config must be a GuardConfig, got {type(config).__name__}")
        self.config = config
        self.model = model
        self.optimizer = optimizer
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.identity = identity or discover(device)
        self.clock = StepClock()
        self.clock.step = start_step
        self.recorder: list[CallRecord] = []
        # Under a budget no site is sampled until the first plan: calibration checks every call anyway.
        budget = config.sampling.budget_for(device.type)
        default_probability = 0.0 if budget is not None else config.sampling.probability_for(device.type)
        self.sampler = Sampler(default_probability, config.sampling.per_site, config.sampling.seed)
        self.plan = StepPlan(config.sampling.seed)  # which GEMM calls run checked, drawn once per step
        self.injector = FaultInjector(config.faults, rank=self.identity.rank)
        self.registry = SiteRegistry()
        self.sensors = self.registry.gemm  # GemmSensor by site id
        self.verifier = Verifier(config.verify, keep_confirmed=True)  # confirmed contexts: evidence files
        self.evidence_budget = EvidenceBudget()  # evidence files written, skipped past the limit, failed
        # clean checked tiles kept as evidence (sensors/gemm.py CleanSampler), within a budget of their own
        self.clean_sampler = CleanSampler()
        self.clean_budget = EvidenceBudget(limit=self.clean_sampler.limit)
        self.incidents: BoundedLog[Incident] = BoundedLog()  # the latest; the store has them all
        self.counts: Counter[str] = Counter()
        self._listeners: list[Listener] = []
        self._tiling = Tiling(config.verify.row_block, config.verify.col_block)
        self.device_state = DeviceState()
        self.weight_sums = WeightSums(self.plan)  # every active weight's sums per step, a pass per shape
        self._steps_counted, self._last_step_counted = 0, None  # distinct steps that checked or verified
        self._pending_evidence: dict[int, Evidence] = {}  # vTask id → its evidence, until verified
        self._comm_values: dict[int, float] = {}  # this step: collective slot → largest mismatch / bound
        self._comm_slot: dict[int, int] = {}  # collective site id → its slot in the exchange
        self.tracer = PlanTracer()  # shared by every checked Linear: checkpointed segments replay plans
        self.closed = False
        self.last_checked_flops_fraction = 0.0  # of the GEMM FLOPs of the last recorded step
        self._device = device
        sampling = config.sampling
        self.budget = None
        if budget is not None:
            fp = config.fingerprints
            saved = fp.saved_probability if fp.saved_tensors else 0.0
            self.budget = BudgetController(
                budget, sampling.rotation_steps, sampling.replan_steps, StepTimer(device), saved_probability=saved
            )
        self._saved_checker: SavedTensorChecker | None = None  # set with the fingerprint checkers
        self.sensor_clock = SensorClock(device)  # what the state sensors' firings cost
        self.sensor_stretch = 1  # in force: the state sensors fire at this multiple of their periods
        self._check_costs: dict[tuple, float] = {}
        self._last_calls: list[int] = []
        self._pending_events: list[tuple[str, str, int]] = []  # events for the next record (plans, gaps)
        self.uncovered_linears: dict[str, str] = {}  # module → why the GPU kernels cannot check it
        self._collected: Collected | None = None  # a gated step between optimizer pre- and post-hook
        self._start_step = start_step
        # wiring checks, each named once: fault specs against the sites (after the first step), checked
        # calls with no step boundary, a boundary after the update
        self._fault_sites_named = self._warned_no_boundary = self._warned_late_boundary = False
        self._coverage_logged = False  # the coverage report, logged after the first recorded step
        self._last_checked_gemm_flops, self._last_recorded_step = 0.0, start_step  # for the report
        self.gate = OptimizerGate()
        self.host_wait_ms = 0.0  # the host's time waiting for evidence (the device still computing)

        chosen = select_linears(model, config.include, config.exclude, filter)
        if not chosen:
            raise ValueError(
                "protect() found no nn.Linear to protect (check GuardConfig.include/exclude and the filter)"
            )
        # the rank's store, locked for writing: one writer per store (runtime/run_dir.py)
        self.run_dir, self.store = open_run_store(config.run_dir, self.identity.rank)
        try:
            self._open(model, optimizer, config, chosen, process_group)
        except BaseException:
            self._abandon()  # a failed protect() leaves the model as it was and the directory usable
            raise

    def _open(self, model: nn.Module, optimizer: Any, config: GuardConfig, chosen: Any, process_group: Any) -> None:
        """The rest of the construction, with the store open."""
        self.responder = Responder(
            config.response, config.response.quarantine_path or str(self.run_dir / "quarantine.jsonl")
        )
        # devices the list names already are not named again; a committed incident whose device it does
        # not name (a process killed between the two writes) is listed now: the store is the truth
        self.responder.adopt_list()
        self.responder.quarantine([quarantine_entry(record) for record in self.store.incident_records()])
        self.console = StepConsole()
        self._next_vtask = 1 + (self.store.conn.execute("SELECT COALESCE(MAX(id), 0) FROM vtasks").fetchone()[0])
        self._next_incident = 1 + (self.store.conn.execute("SELECT COALESCE(MAX(id), 0) FROM incidents").fetchone()[0])
        self.attention_records: list[AttentionRecord] = []
        self.attention_sensors: dict[str, AttentionSensor] = {}
        self._swaps = swap_linears(model, chosen, self._make_hooks)
        self.unprotected_modules = unprotected_modules(model, {id(swap.checked) for swap in self._swaps})
        if self.unprotected_modules:  # named at once: nothing matmul-bearing is left out silently
            first, reason = next(iter(self.unprotected_modules.items()))
            warnings.warn(f"aegis-sdc: {len(self.unprotected_modules)} matmul modules not protected, e.g. {first}: "
                          f"{reason} (guard.coverage_report() names each)", stacklevel=3)  # fmt: skip
        self._begin_plan()
        self._setup_fingerprints(model, config)
        self._false_alarm_handlers: dict[int, Callable[[Evidence], None]] = {}
        self.uncovered_attention: dict[str, str] = {}  # module → why its attention runs unchecked
        self._router = (
            AttentionRouter(model, self._attention_sensor, self.tracer, self._uncovered_attention)
            if config.attention
            else None
        )
        if self._router is not None:
            self._router.install()
        self.store.write_run(self.identity.to_dict(), config.to_dict(), _versions())
        self.step_recorder = StepRecorder(self.store, self.registry, self.injector, self.identity.rank)
        self.store.write_sites(self.registry.take_unwritten())
        self._stopping = True  # False while closing under an exception of the user's (see __exit__)
        # certified checkpoints (response/checkpoints.py): this run's certificates, the first state a
        # confirmed SDC not rolled back has corrupted, the latest step whose state the vote judged
        self.certificates: list[Certificate] = []
        self._corrupt_from: int | None = None
        self._vote_judged_step = -1
        self._rolled_back_to: int | None = None  # a rollback's step: the next step number
        self._on_rollback: Callable[[int, Any], None] | None = None
        self._restore: Callable[[str], Any] | None = None  # loads a checkpoint the caller certified
        self.rollbacks = 0
        self.responder.rollback = self._rollback
        self._handles = []
        self._forwards_at_start = 0
        self._forward_watch = model.register_forward_pre_hook(self._count_forward)  # removed once moot
        self._handles.append(self._forward_watch)
        self.update_replay: UpdateReplay | None = None  # with an optimizer: its update replayed by slices
        if optimizer is not None:
            self.attach_optimizer(optimizer)

        # Data parallelism: the rank-outlier exchange and the checks of gradient collectives.
        dist_cfg = config.distributed
        if process_group is None and isinstance(model, nn.parallel.DistributedDataParallel):
            process_group = model.process_group
        self.dist = make_context(process_group, dist_cfg.exchange_timeout_s)
        if self.dist is not None:  # ranks whose guards would not line up fail here, every one of them
            check_agreement(self.dist, config, model, [s.name for s in self.sites], self._device.type)
        self.outlier_warnings: BoundedLog[OutlierWarning] = BoundedLog()
        self.comm_sites: dict[str, Site] = {}
        self.comm_checks = CommChecks(dist_cfg.comm_chunks, self._register_comm_site, self._comm_fault,
                                      timeout_s=dist_cfg.exchange_timeout_s)  # fmt: skip
        self.state_vote: StateVote | None = None  # under DDP: the replicas vote on their state
        # The vote taken at a step's end is read and exchanged at the next step's end: its copy to the
        # host is long done by then, so no step waits for the device on its account.
        self._vote_taken: VoteRecord | None = None  # this step's vote, on its way to the host
        self._vote_due: VoteRecord | None = None  # the previous step's, for this step's exchange
        self._state_sites: dict[tuple[str, StateKind], Site] = {}
        self._vote_out_of_step_named = False
        self.peer_replay: PeerReplay | None = None  # under DDP with run_batch: peers recompute steps
        self._peer_findings: list[PeerFinding] = []
        self._training_module: nn.Module = model  # what run_batch hands the user's loss function
        if isinstance(model, nn.parallel.DistributedDataParallel):
            if dist_cfg.comm_check:
                self.attach_ddp(model)
            else:
                self._enable_state_vote(model.module)

    # -- construction ----------------------------------------------------------------------------
    def _make_hooks(self, name: str, linear: nn.Linear) -> LinearHooks:
        modes = self.config.checksum
        sensors = []
        for kind, mode in (
            (GemmKind.FORWARD, modes.forward),
            (GemmKind.DGRAD, modes.dgrad),
            (GemmKind.WGRAD, modes.wgrad),
        ):
            sensor = GemmSensor(
                self.registry.next_gemm_site(name, kind),
                col_check=mode == "row+col",
                thresholds=self.config.thresholds,
                sampler=self.sampler,
                injector=self.injector,
                clock=self.clock,
                recorder=self.recorder,
                clean=self.clean_sampler,
            )
            self.registry.add_gemm(sensor)
            sensors.append(sensor)
        hooks = LinearHooks(
            *sensors,
            tiling=self._tiling,
            after_call=self._after_call,
            backend=self.config.backend,
            state=self.device_state,
            tracer=self.tracer,
            plan=self.plan,
            index=self.plan.add_linear(tuple(s.probability for s in sensors)),
            uncovered=self._uncovered,
        )
        self.weight_sums.join(linear, hooks.index, hooks.weight_stats)  # the Linear shares its parameters
        return hooks

    def _uncovered(self, module: str, reason: str) -> None:
        """A protected Linear the GPU kernels cannot take: named once, in a warning and the coverage."""
        if module not in self.uncovered_linears:
            self.uncovered_linears[module] = reason
            message = f"{module}: not checked on this GPU — {reason}"
            self._pending_events.append(("not_covered", message, self._site_id(f"{module}:fwd")))
            warnings.warn(f"aegis-sdc: {message}", stacklevel=4)

    def _uncovered_attention(self, module: str, reason: str) -> None:
        """An attention module of the model whose calls stay unchecked: named once, in a warning and
        the coverage (its sites are registered so the report and the store can name them)."""
        if module not in self.uncovered_attention:
            self.uncovered_attention[module] = reason
            self._attention_sensor(module)
            message = f"{module}: attention not checked — {reason}"
            self._pending_events.append(("not_covered", message, self._site_id(f"{module}:attn_fwd")))
            warnings.warn(f"aegis-sdc: {message}", stacklevel=4)

    def _attention_sensor(self, module: str) -> AttentionSensor:
        """The sensor of an attention module, made at its first checked call (sites in call order)."""
        sensor = self.attention_sensors.get(module)
        if sensor is None:
            sites = tuple(self.registry.add(module, kind, "attention") for kind in AttentionKind)
            sensor = self.attention_sensors[module] = AttentionSensor(
                module, sites, thresholds=self.config.thresholds, sampler=self.sampler, injector=self.injector,
                clock=self.clock, records=self.attention_records,
            )  # fmt: skip
            for site, backward in zip(sites, (False, True), strict=True):
                self._false_alarm_handlers[site.id] = functools.partial(sensor.on_false_alarm, backward)
        return sensor

    def _setup_fingerprints(self, model: nn.Module, config: GuardConfig) -> None:
        fp = config.fingerprints
        self.fingerprint_pool = FingerprintPool(fp.pool_slots, use_triton=config.backend == "triton")
        probability = {
            FingerprintKind.RECOMPUTE: fp.recompute_probability,
            FingerprintKind.SAVED: fp.saved_probability,
        }
        self.fingerprints = FingerprintChecks(
            self.fingerprint_pool,
            lambda module, kind: self.registry.add(module, kind, "fingerprint"),
            lambda kind, name: self.sampler.probability_for(name, probability[kind]),
            self.sampler.should_check,
            fp.calibration_checks,
        )
        self._checkers: list[RecomputeChecker | SavedTensorChecker] = []
        if fp.recompute:
            self._checkers.append(RecomputeChecker(model, self.fingerprints, self.tracer, self.injector, self.clock))
        if fp.saved_tensors:
            self._saved_checker = SavedTensorChecker(
                model, self.fingerprints, self.injector, self.clock, fp.saved_min_bytes, fp.saved_probability
            )
            self._checkers.append(self._saved_checker)
        for checker in self._checkers:
            checker.install()

    # -- public API ------------------------------------------------------------------------------
    @property
    def step_number(self) -> int:
        return self.clock.step

    @property
    def sites(self) -> list[Site]:
        return [s.site for s in self.sensors]

    def sensor(self, site_name: str) -> GemmSensor:
        for s in self.sensors:
            if s.site.name == site_name:
                return s
        raise KeyError(f"no protected site named {site_name!r}")

    def _site_id(self, site_name: str) -> int:
        return self.registry.id_of(site_name)

    def subscribe(self, listener: Listener) -> None:
        """`listener(event, payload)` for events 'alarm' (VTask), 'verdict' (Verdict), 'incident', 'step'."""
        self._listeners.append(listener)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """End each step at `optimizer.step()` (for optimizers built after `protect`, e.g. after FSDP2;
        a wrapper such as accelerate's `AcceleratedOptimizer` is unwrapped to the optimizer it steps)."""
        optimizer = unwrap_optimizer(optimizer)
        self.optimizer = optimizer
        if self.config.update_replay.enabled:
            inner = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
            replay = self.config.update_replay
            self.update_replay = UpdateReplay(inner, self.fingerprint_pool, replay.slices, replay.every)
        self._handles.append(optimizer.register_step_pre_hook(self._optimizer_pre_step))
        self._handles.append(optimizer.register_step_post_hook(self._optimizer_post_step))

    def attach_ddp(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Check DDP's gradient all-reduces (a communication hook; done by `protect(ddp_model)`)."""
        self._training_module = ddp
        if self.config.distributed.comm_check:
            hook = checked_allreduce_hook(self.comm_checks, ddp.process_group, CommKind.ALLREDUCE)
            ddp.register_comm_hook(None, hook)
            period = self.config.distributed.peer_replay_period
            if period > 0 and self.dist is not None and self.peer_replay is None:
                self.peer_replay = PeerReplay(ddp.module, self.dist, period, self._device)
                self.comm_checks.on_local_gradients = self.peer_replay.local_gradients
        self._enable_state_vote(ddp.module)

    def run_batch(self, loss_fn: LossFn, batch: Any) -> torch.Tensor:
        """`loss_fn(model, batch)` — the micro-batch's loss, computed through the guard so that a peer
        can recompute it (DistributedConfig.peer_replay_period). `loss_fn` gets the model as trained
        (the DDP module) and, in a replay, the module it wraps; it must not depend on the rank."""
        if self.peer_replay is None:
            return loss_fn(self._training_module, batch)
        return self.peer_replay.run_batch(self.clock.step, self._training_module, loss_fn, batch)

    def _enable_state_vote(self, module: nn.Module) -> None:
        """DDP's replicas vote on their parameters and optimizer state (DistributedConfig.state_vote)."""
        cfg = self.config.distributed
        if cfg.state_vote and self.dist is not None and self.state_vote is None:
            self.state_vote = StateVote(module, self._device, param_slices=cfg.vote_param_slices,
                                        state_slices=cfg.vote_state_slices)  # fmt: skip

    def attach_fsdp(self, model: nn.Module) -> int:
        """Check FSDP2's gradient reduce-scatters: call after `fully_shard`. Returns the modules hooked."""
        from torch.distributed.fsdp import FSDPModule

        # Sharded parameters are no replicas, but under HSDP the ranks holding the same shards are
        # (one per index of the mesh's replicate dimension): they vote on their local shards.
        sets = replica_sets(model)
        cfg = self.config.distributed
        self.state_vote = None
        if sets is not None and cfg.state_vote and self.dist is not None:
            self.state_vote = StateVote(model, self._device, param_slices=cfg.vote_param_slices,
                                        state_slices=cfg.vote_state_slices, sets=sets)  # fmt: skip
        self.peer_replay = self.comm_checks.on_local_gradients = None  # nor are their gradients whole
        for sensor in self.sensors:
            sensor.copy_referenced = True  # FSDP2 frees unsharded weights before verification
        self.weight_sums.enabled = False  # and regathers them layer by layer: each weight's own sums
        hooked = 0
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(
                    CheckedReduceScatter(self.comm_checks, f"fsdp.{name or 'root'}", CommKind.REDUCE_SCATTER)
                )
                hooked += 1
        return hooked

    def step(self) -> StepReport:
        """End the current step and start the next; for training loops that pass no optimizer. Call it
        after backward and before the weights change (see `protect`)."""
        self._require_open()
        self._conclude_peer_replay()
        report = self._process(drain=False, vote=True)
        self._advance()
        return report

    def end_step(self) -> StepReport:
        """Judge, verify, record and respond for everything recorded since the last call."""
        self._require_open()
        return self._process(drain=False)

    def flush(self) -> StepReport:
        """Like end_step, without advancing the step (inference loops; full buffers)."""
        return self.end_step()

    def drain(self) -> StepReport:
        """Judge what was recorded and verify every pending vTask now, whatever the verification
        budget (a fault campaign's trial boundary: each trial's verdicts are its own)."""
        self._require_open()
        return self._process(drain=True)

    def summary(self) -> GuardSummary:
        t = self.verifier.telemetry
        c = self.counts
        return GuardSummary(
            steps=self._steps_counted,
            sites=len(self.sensors),
            checks=c["checks"],
            alarms=c["alarms"],
            false_alarms=c[VerdictKind.FALSE_ALARM.value],
            confirmed=c[VerdictKind.CONFIRMED_SDC.value],
            not_verifiable=c[VerdictKind.NOT_VERIFIABLE.value],
            nonfinite_inputs=c[VerdictKind.NONFINITE_INPUT.value],
            backlog=self.verifier.backlog,
            verified=t.verified,
            max_latency_steps=t.max_latency_steps,
            max_latency_ms=t.max_latency_ms,
            replay_ms_total=t.replay_ms_total,
            faults_injected=self.injector.log.total,
            outlier_warnings=self.outlier_warnings.total,
            fingerprint_checks=c["fingerprint_checks"],
            attention_checks=c["attention_checks"],
            not_deterministic=c[VerdictKind.NOT_DETERMINISTIC.value] + c["not_deterministic_calibration"],
            coverage=self._coverage(),
            unattributed=c[VerdictKind.UNATTRIBUTED.value],
            data_false_alarms=sum(s.data_false_alarms for s in self.sensors),
            checked_flops_fraction=c["checked_flops"] / c["gemm_flops"] if c["gemm_flops"] else 0.0,
            attention_checked_flops_fraction=self._attention_checked_fraction(),
            state_votes=self.state_vote.votes - self.state_vote.skipped_votes if self.state_vote else 0,
            update_replays=self.update_replay.replays if self.update_replay else 0,
            peer_replays=self.peer_replay.replays if self.peer_replay else 0,
            state_sensor_costs={name: cost.to_dict() for name, cost in self.sensor_costs().items()},
            records_dropped_from_memory=self.incidents.dropped
            + self.injector.log.dropped
            + self.outlier_warnings.dropped,
            store_records_dropped=self.step_recorder.writer.dropped,
            console_lines_held_back=self.console.limiter.suppressed_total,
            store_records_waiting=self.step_recorder.writer.waiting,
        )

    def sensor_costs(self) -> dict[str, SensorCost]:
        """What each state sensor of this guard costs, at the period in force (runtime/sensor_cost.py)."""
        return {name: self.sensor_clock.cost(name, period * self.sensor_stretch)
                for name, period in self._sensor_periods().items()}  # fmt: skip

    def _sensor_periods(self) -> dict[str, int]:
        """The state sensors present and their configured periods (steps)."""
        periods = {}
        if self.state_vote is not None:
            periods["state_vote"] = 1
        if self.update_replay is not None:
            periods["update_replay"] = self.config.update_replay.every
        if self.peer_replay is not None:
            periods["peer_replay"] = self.config.distributed.peer_replay_period
        return periods

    def _adopt_sensor_stretch(self, stretch: int, report: StepReport | None = None) -> None:
        """From the next step on, every state sensor fires at `stretch` × its configured period (the
        same step on every rank: the factor is agreed in the step's exchange)."""
        if stretch == self.sensor_stretch:
            return
        self.sensor_stretch = stretch
        if self.update_replay is not None:
            self.update_replay.every = self.config.update_replay.every * stretch
        if self.peer_replay is not None:
            self.peer_replay.period = self.config.distributed.peer_replay_period * stretch
        message = f"state sensors fire at {stretch}× their configured periods (the overhead budget)"
        if report is not None:
            report.events.append(("sensor_cadence", message, None))
        else:
            self._pending_events.append(("sensor_cadence", message, None))

    def _attention_checked_fraction(self) -> float:
        total = sum(s.flops["total"] for s in self.attention_sensors.values())
        return sum(s.flops["checked"] for s in self.attention_sensors.values()) / total if total else 0.0

    def coverage_report(self) -> CoverageReport:
        """What is protected, the matmul FLOPs of the last recorded step and their checked share, and
        what is not covered and why (runtime/coverage.py)."""
        protected: Counter[str] = Counter()
        for checked in {id(swap.checked): swap.original for swap in self._swaps}.values():
            protected[type(checked).__name__] += 1
        calls = self._last_calls or [0] * self.plan.linears
        gemm = sum(calls[s.site.id // GEMMS_PER_LINEAR] * s.flops for s in self.sensors)
        step = self._last_recorded_step
        attention = checked_attention = 0.0
        for sensor in self.attention_sensors.values():
            made, checked = sensor.calls_of_step(step)
            attention += made * sensor.call_flops
            checked_attention += checked * sensor.call_flops
        return CoverageReport(dict(protected), gemm, attention, self._last_checked_gemm_flops + checked_attention,
                              self._coverage()["not_covered"])  # fmt: skip

    def _coverage(self) -> dict[str, Any]:
        coverage = self.fingerprints.coverage()
        coverage["not_covered"].update(self.unprotected_modules)
        for module, reason in self.uncovered_linears.items():
            for kind in GemmKind:
                coverage["not_covered"][f"{module}:{kind.value}"] = reason
        for module, reason in self.uncovered_attention.items():
            for kind in AttentionKind:
                coverage["not_covered"][f"{module}:{kind.value}"] = reason
        if self.peer_replay is not None and self.peer_replay.not_covered:
            coverage["not_covered"][f"model:{StateKind.PEER_REPLAY.value}"] = self.peer_replay.not_covered
        if self.update_replay is not None and self.update_replay.uncovered:
            coverage["not_covered"][f"optimizer:{StateKind.OPTIMIZER_UPDATE.value}"] = self.update_replay.uncovered
        elif self.update_replay is not None and self.update_replay.closure_steps:
            coverage["not_covered"][f"optimizer:{StateKind.OPTIMIZER_UPDATE.value}"] = (
                f"{self.update_replay.closure_steps} optimizer steps given a closure (their gradients are computed "
                "inside the step) were not replayed"
            )
        return coverage

    def close(self) -> GuardSummary:
        """Verify everything pending, restore the original modules, and finish the store."""
        if self.closed:
            return self.summary()
        try:
            self._process(drain=True)
        finally:
            for handle in self._handles:
                handle.remove()
            for checker in self._checkers:
                checker.uninstall()
            if self._router is not None:
                self._router.uninstall()
            restore_linears(self._swaps)
            if self.dist is not None:
                self.dist.close()
            self._decide_certificates(final=True)
            summary = self.summary()
            self.console.close()
            self.responder.retry_quarantine()
            self.step_recorder.close(summary.to_dict())  # every queued row tried, the run's summary last
            self.store.close()
            self.closed = True
        return summary

    def _abandon(self) -> None:
        """Undo a construction that failed part way: hooks off, modules restored, store unlocked."""
        with contextlib.suppress(Exception):
            for handle in getattr(self, "_handles", ()):
                handle.remove()
            for checker in getattr(self, "_checkers", ()):
                checker.uninstall()
            if getattr(self, "_router", None) is not None:
                self._router.uninstall()
            if hasattr(self, "_swaps"):
                restore_linears(self._swaps)
            if getattr(self, "dist", None) is not None:
                self.dist.close()
            if hasattr(self, "step_recorder"):
                self.step_recorder.close()
        self.store.close()
        self.closed = True

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # The user's exception is what the with block ends with: a confirmed SDC found while closing
        # is committed, logged and quarantined as always, and named on that exception — a `raise` or
        # `exit` policy does not replace it.
        self._stopping = False
        try:
            summary = self.close()
        except Exception as error:
            exc.add_note(f"aegis-sdc: closing the guard failed as well: {error!r}")
            return
        if summary.confirmed or summary.unattributed:
            last = self.incidents[-1].describe() if self.incidents else "none attributed to a device"
            exc.add_note(f"aegis-sdc: {summary.confirmed} confirmed SDC(s) in this run (the last: {last})")

    # -- internals -------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Guard is closed")

    def _advance(self) -> None:
        rolled_back, self._rolled_back_to = self._rolled_back_to, None
        self.clock.step = rolled_back if rolled_back is not None else self.clock.step + 1
        self.comm_checks.step = self.clock.step
        for checker in self._checkers:  # checkpointing enabled since the last step (a scan of the modules)
            if isinstance(checker, RecomputeChecker):
                checker.rebind()
        self._begin_plan()

    def _begin_plan(self) -> None:
        """Draw the step's sampling plan; calibrating sites and sites a fault may hit run checked."""
        step = self.clock.step
        calibrating = np.fromiter((s.row.calibrating for s in self.sensors), dtype=bool, count=len(self.sensors))
        quiet = False
        if self.budget is not None:
            # a module whose calls run unchecked (named in the coverage report) never calibrates: it
            # must not hold the budget's plan back (a shape is set by its first planned call)
            attention_calibrating = any(s.calibrating and s.shape is not None for s in self.attention_sensors.values())
            # likewise a GEMM site never called (the dgrad of a first Linear whose input needs no
            # gradient) — once some site has been called: before the first step, all are to come
            called = np.fromiter((s.shape is not None for s in self.sensors), dtype=bool, count=len(self.sensors))
            gemm_calibrating = bool((calibrating & called).any()) or (called.size > 0 and not called.any())
            quiet = self._plan_budget(gemm_calibrating or attention_calibrating)
        for sensor in self.attention_sensors.values():
            sensor.quiet = quiet
        faulted = None
        if self.injector:
            faulted = np.fromiter((self.injector.may_fire(s.site, step) for s in self.sensors), dtype=bool)
        self.plan.begin(step, calibrating, faulted, quiet=quiet)

    def _plan_budget(self, calibrating: bool) -> bool:
        """Under `SamplingConfig.budget` (runtime/budget.py): after calibration, a few steps without
        sampling measure the step, the checks are timed at each site's shape, and the plan fills the
        budget; the cycle repeats every `replan_steps` steps. True: this step samples nothing."""
        phase = self.budget.step_begins(calibrating)
        saved = self._saved_checker
        if saved is not None:  # a probe measures a saved-tensor step; quiet steps have none
            saved.forced = {"probe": True, "quiet": False}.get(phase)
            if self.budget.saved_planned is not None:
                saved.probability = self.budget.saved_planned
        if self.budget.due():
            # one knapsack over the GEMM sites and the attention modules (a call's forward and
            # backward are checked together), each at its measured cost per check
            attention = list(self.attention_sensors.values())
            costs = np.array([self._check_cost(s) for s in self.sensors] + [self._attention_cost(s) for s in attention])
            flops = np.array([s.flops for s in self.sensors] + [s.call_flops for s in attention])
            calls = np.concatenate((
                np.repeat(np.asarray(self._last_calls or [1] * self.plan.linears, dtype=np.float64), GEMMS_PER_LINEAR),
                np.asarray([s.calls_last_step for s in attention], dtype=np.float64),
            ))  # fmt: skip
            caps = np.array([self.sampler.probability_for(s.site.name, 1.0) for s in self.sensors]
                            + [self.sampler.probability_for(s.forward_site.name, 1.0) for s in attention])  # fmt: skip
            sensors_ms = sum(self.sensor_clock.cost(name, period).ms_per_step
                             for name, period in self._sensor_periods().items())  # fmt: skip
            plan = self.budget.replan(flops, calls, costs, caps, sensors_ms_at_base=sensors_ms)
            if self.dist is None:  # nothing to agree on (with ranks, the step's exchange agrees)
                self._adopt_sensor_stretch(self.budget.sensor_stretch)
            if plan is not None:
                gemms = len(self.sensors)
                self.plan.set_probabilities(plan.probabilities[:gemms])
                for sensor, probability in zip(attention, plan.probabilities[gemms:], strict=True):
                    sensor.probability = float(probability)
                work = np.maximum(calls, 1.0) * flops
                fractions = [
                    float((plan.probabilities[part] * work[part]).sum() / work[part].sum()) if work[part].sum() else 0.0
                    for part in (slice(0, gemms), slice(gemms, None))
                ]  # fmt: skip
                self._pending_events.append(
                    ("sampling_plan", f"budget {self.budget.budget:.2%} of a {self.budget.base_ms:.1f} ms step: "
                     f"{plan.expected_ms:.2f} ms of checks (cost model × {self.budget.scale:.2f}), "
                     f"{fractions[0]:.1%} of GEMM FLOPs, {fractions[1]:.1%} of attention FLOPs"
                     + self.budget.describe_saved() + self.budget.describe_sensors(),
                     None)
                )  # fmt: skip
        return phase in ("quiet", "probe")

    def _attention_cost(self, sensor: AttentionSensor) -> float:
        if sensor.shape is None:
            return 0.0  # never called (or never checkable): nothing to time
        key = ("attention", *sensor.shape)
        if key not in self._check_costs:
            self._check_costs[key] = attention_check_cost_ms(*sensor.shape, self._device)
        return self._check_costs[key]

    @property
    def budget_plan(self) -> BudgetPlan | None:
        return self.budget.plan if self.budget is not None else None

    def _check_cost(self, sensor: GemmSensor) -> float:
        if sensor.shape is None or sensor.dtype is None:
            return 0.0  # never called: nothing to time, and nothing its checks would cost
        key = (sensor.site.kind.value, sensor.shape, sensor.dtype, sensor.col_check, sensor.triton)
        cost = self._check_costs.get(key)
        if cost is None:
            cost = self._check_costs[key] = check_cost_ms(
                sensor.site.kind.value, sensor.shape, sensor.dtype, self._device, col_check=sensor.col_check,
                triton=sensor.triton, tiling=self._tiling,
            )  # fmt: skip
        return cost

    def _register_comm_site(self, name: str, kind: CommKind) -> Site:
        key = f"{name}:{kind.value}"
        site = self.comm_sites.get(key)
        if site is None:
            site = self.comm_sites[key] = self.registry.add(name, kind, kind.value)
            self._comm_slot[site.id] = len(self._comm_slot) % COMM_SLOTS
        return site

    def _comm_fault(self, site: Site, step: int, result: torch.Tensor) -> None:
        """Fault injection into a collective's result on this rank: a flipped bit in one element."""
        self.injector.flip_tensor_bit(site, step, 0, result, salt=0xC0)

    # -- the step end at optimizer.step() (runtime/gate.py) ------------------------------------------
    def _optimizer_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.gate.reapplying:
            return
        self._require_open()
        if self.update_replay is not None:
            closure = (args[1] if len(args) > 1 else None) or kwargs.get("closure")
            step = self.clock.step
            span = self.sensor_clock.begin("update_replay", step) if self.update_replay.due(step) else None
            self.update_replay.before(optimizer, step, self.responder.dropped_updates, closure is not None)
            if span is not None:
                self.sensor_clock.end(span)
        self._conclude_peer_replay()
        gated = self.config.gate_optimizer and gateable(optimizer, self._device)
        collected = self._collect(gate=gated, vote=True)
        if collected.nothing_to_judge():
            # A step without checks (unsampled, p = 0): nothing in it can hold the update back, so it
            # is concluded after the update is launched (any optimizer) — the GPU never idles behind
            # its bookkeeping.
            self._collected = collected
            return
        host_judged_fingerprints = bool(collected.fp_records) and not collected.fp_on_device
        if collected.gate is None or host_judged_fingerprints or collected.alarmed_on_host():
            # Reference-path alarms, and fingerprint checks the device could not compare (a site in
            # calibration, values already on the host), are judged on the host, before the update.
            self._conclude(collected, drain=False)
            return
        collected.held_found_inf = self.gate.hold(optimizer, collected.gate)
        self._collected = collected

    def _optimizer_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.gate.reapplying:
            return
        collected, self._collected = self._collected, None
        if collected is not None:
            if collected.gate is not None:  # held (a step without checks was not)
                self.gate.release(optimizer, collected.held_found_inf)
            report = self._conclude(collected, drain=False)  # may raise: the update stays held back
            if report.alarms and self._rolled_back_to is None:  # held back; the verdicts let it through
                self.gate.reapply(optimizer, args, kwargs)
        if self.update_replay is not None and self.update_replay.pending:  # the update has run: replay its slice
            span = self.sensor_clock.begin("update_replay", self.clock.step)
            self.update_replay.after(optimizer, self.responder.dropped_updates)
            self.sensor_clock.end(span)
        self._advance()

    def _after_call(self) -> None:
        if len(self.recorder) >= self.config.max_pending_calls:
            if self.optimizer is None and self.clock.step == self._start_step:
                self._warn_no_boundary(f"{len(self.recorder)} checked calls")
            self.flush()

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook of the model while no optimizer is attached: many forwards with gradients
        and still no step boundary mean every check is counted as the first step."""
        if torch.is_grad_enabled() and self.optimizer is None and self.clock.step == self._start_step:
            self._forwards_at_start += 1
            if self._forwards_at_start >= NO_BOUNDARY_FORWARDS:
                self._warn_no_boundary(f"{self._forwards_at_start} forward passes with gradients")
        if self._warned_no_boundary or self.optimizer is not None or self.clock.step != self._start_step:
            self._forward_watch.remove()  # nothing left to watch for: off the hot path

    def _warn_no_boundary(self, seen: str) -> None:
        if self._warned_no_boundary:
            return
        self._warned_no_boundary = True
        message = (f"{seen} and no step boundary yet: every check is counted as step {self._start_step}. Pass "
                   "the optimizer that steps the model (protect(model, optimizer=...) or guard.attach_optimizer), "
                   "or call guard.step() after each backward; with transformers' Trainer use "
                   "aegis_sdc.integrations.hf.protect_trainer(trainer)")  # fmt: skip
        warnings.warn(f"aegis-sdc: {message}", stacklevel=4)
        self._pending_events.append(("no_step_boundary", message, None))

    def _emit(self, event: str, payload: Any) -> None:
        for listener in self._listeners:
            listener(event, payload)

    def _process(self, *, drain: bool, vote: bool = False) -> StepReport:
        return self._conclude(self._collect(gate=False, vote=vote), drain=drain)

    def _collect(self, *, gate: bool, vote: bool = False) -> Collected:
        """Take what the step recorded and start its evidence on the way to the host (nothing waits).
        `vote`: at a step's end, before its update — the replicas' state is fingerprinted here."""
        if vote:  # the previous step's vote is due; this step's is taken (unless the cadence skips it)
            self._vote_due, self._vote_taken = self._vote_taken, None
        if vote and self.state_vote is not None and self.clock.step % self.sensor_stretch == 0:
            span = self.sensor_clock.begin("state_vote", self.clock.step)
            self._vote_taken = self.state_vote.take(self.clock.step, self.optimizer, self.responder.dropped_updates)
            self.sensor_clock.end(span)
        records = list(self.recorder)
        self.recorder.clear()
        for swap in self._swaps:  # compiled forwards whose backward never came (see ops/linear_op.py)
            swap.checked.aegis_hooks.pending.clear()
        comm_records = self.comm_checks.take()
        attention, self.attention_records[:] = list(self.attention_records), []
        fp_records = self.fingerprints.take()
        differ = self.fingerprints.differ_on_device(fp_records) if gate and fp_records else None
        collected = step_evidence.collect(
            self.clock.step, records, comm_records, max_ratios(comm_records) if comm_records else None,
            fp_records, attention, self.fingerprint_pool.device_buffers(), gate=gate,
            fingerprints_differ=differ,
        )  # fmt: skip
        self.device_state.end_step()  # fresh slots and pools: their contents are copied or queued
        return collected

    def _conclude(self, collected: Collected, *, drain: bool) -> StepReport:
        """One step's evidence, end to end: read it (the step's one wait for the device), judge every
        check, verify the alarms, record the step, respond to what was confirmed."""
        report = StepReport(collected.step)
        started = time.perf_counter()
        synced, comm_values = step_evidence.read(collected, self.fingerprint_pool)
        self.host_wait_ms += (time.perf_counter() - started) * 1000.0
        evidence_of = self._judge(collected, synced, comm_values, report)
        if self.dist is not None and not drain:
            self._exchange(collected.step, report, evidence_of)
        self._verify(report, evidence_of, drain=drain)
        self.counts["checks"] += report.checks
        self.counts["alarms"] += len(report.alarms)
        if (collected.records or report.verdicts) and collected.step != self._last_step_counted:
            self._steps_counted, self._last_step_counted = self._steps_counted + 1, collected.step
        if self.injector and not self._fault_sites_named and (collected.records or collected.attention):
            self._name_unmatched_faults(report)
        self._record(report)
        self._note_incidents(report)
        self._respond(report)
        self._decide_certificates(final=False)
        return report

    def _judge(self, collected: Collected, synced: list, comm_values: list, report: StepReport) -> dict[int, Evidence]:
        """Every check of the step against its threshold (GEMMs, collectives, attention, fingerprints):
        an alarm becomes a vTask in the report, with its evidence (by vTask id)."""
        report.checks = len(collected.records)
        evidence_of: dict[int, Evidence] = {}
        alarm = functools.partial(self._alarm, report, evidence_of)

        for record, stats in zip(collected.records, synced, strict=True):
            evidence = record.sensor.judge(record, stats)
            if evidence is not None:
                alarm(evidence, record.capture)
            elif record.clean is not None:  # a clean sample's tile as evidence (never raises: logged)
                plan, tile, record.clean = record.plan, record.clean, None  # released once written
                sample = CleanSample(record.sensor.site, plan.step, plan.call, self.identity, tile)
                write_clean_evidence(self.run_dir, sample, self.clean_budget)
        for record, value in zip(collected.comm_records, comm_values, strict=True):
            if value > 1.0:
                alarm(
                    Evidence(
                        site=record.site, step=record.step, call=0, channel=Channel.COMM, value=value,
                        threshold=1.0, index=record.mismatched()[0], raw_l2=0.0, channels=(Channel.COMM,),
                    ),
                    CommCapture(record, [self.identity.rank], self.dist.ranks if self.dist else [self.identity.rank]),
                )  # fmt: skip
            self._comm_values[self._comm_slot[record.site.id]] = value
        self.counts["attention_checks"] += len(collected.attention)
        for record in collected.attention:
            evidence = AttentionSensor.judge(record)
            if evidence is not None:
                alarm(evidence, record.capture)
        if self.update_replay is not None:
            self._judge_updates(alarm)
        self._raise_peer_findings(alarm)
        mismatched, not_deterministic = self.fingerprints.judge(collected.fp_records)
        self.counts["fingerprint_checks"] += len(collected.fp_records)
        for record in mismatched:
            alarm(record.evidence(), record.capture)
        for name in not_deterministic:
            self.counts["not_deterministic_calibration"] += 1
            report.events.append(("not_deterministic", f"{name}: not deterministic — not covered", self._site_id(name)))
        return evidence_of

    def _conclude_peer_replay(self) -> None:
        """On a peer-replay step, before the update: the ranks recompute each other's micro-batches
        (distributed/peer_replay.py); the findings are raised with the step's other alarms."""
        if self.peer_replay is not None and self.peer_replay.due(self.clock.step):
            span = self.sensor_clock.begin("peer_replay", self.clock.step)
            self._peer_findings = self.peer_replay.conclude(self.clock.step, self._replaying)
            self.sensor_clock.end(span)

    @contextlib.contextmanager
    def _replaying(self):
        """The checked ops run a recomputation of this step's calls: the plan's call counts start
        again from zero (the same calls are checked, so the same kernels run) and are restored after.
        The recomputation's checks are judged with the step's: they are real checks of this device."""
        calls = list(self.plan.calls)
        self.plan.calls = [0] * len(calls)
        try:
            yield
        finally:
            self.plan.calls = calls

    def _raise_peer_findings(self, alarm: Callable[[Evidence, object], None]) -> None:
        """A peer-replay finding is raised once: by the rank it names, or (a pair, an unstable step)
        by the lowest rank that ran it."""
        findings, self._peer_findings = self._peer_findings, []
        me = self.identity.rank
        for finding in findings:
            raiser = finding.blamed if finding.blamed is not None else min(finding.executions.values())
            if raiser != me:
                continue
            site = self._state_site("model", StateKind.PEER_REPLAY)
            evidence = Evidence(site=site, step=finding.step, call=0, channel=Channel.FINGERPRINT,
                                value=float(len(finding.params)), threshold=0.0, index=finding.owner, raw_l2=0.0,
                                channels=(Channel.FINGERPRINT,))  # fmt: skip
            alarm(evidence, PeerCapture(finding))

    def _judge_updates(self, alarm: Callable[[Evidence, object], None]) -> None:
        """Optimizer-update replays whose fingerprints came with this read: a parameter whose training
        update and replay differ raises a vTask (its verdict runs the update a third time)."""
        for record in self.update_replay.take_resolved():
            for index in record.mismatched():
                site = self._state_site(record.inputs.names[index], StateKind.OPTIMIZER_UPDATE)
                evidence = Evidence(site=site, step=record.step, call=0, channel=Channel.FINGERPRINT, value=1.0,
                                    threshold=0.0, index=0, raw_l2=0.0, channels=(Channel.FINGERPRINT,))  # fmt: skip
                alarm(evidence, UpdateCapture(record, index, self.fingerprint_pool))

    def _alarm(self, report: StepReport, evidence_of: dict[int, Evidence], evidence: Evidence, payload: object) -> None:
        """Evidence over its threshold becomes a vTask of the step, with its replay context."""
        task = VTask(self._next_vtask, evidence, payload)
        self._next_vtask += 1
        report.alarms.append(task)
        evidence_of[task.id] = evidence

    def _verify(self, report: StepReport, evidence_of: dict[int, Evidence], *, drain: bool) -> None:
        """Queue the step's alarms, replay what is due (all of it when draining), and act on each
        verdict: a false alarm widens its site's threshold, a confirmed SDC becomes an incident."""
        self._pending_evidence.update(evidence_of)
        self.verifier.submit(report.alarms)
        started = time.perf_counter()
        report.verdicts = self.verifier.run(report.step, drain=drain)
        report.verify_ms = (time.perf_counter() - started) * 1000.0
        for verdict in report.verdicts:
            evidence = self._pending_evidence.pop(verdict.vtask_id)
            self.counts[verdict.kind.value] += 1
            if verdict.kind is VerdictKind.FALSE_ALARM and verdict.site.id < len(self.sensors):
                self.sensors[verdict.site.id].on_false_alarm(evidence)
            elif verdict.kind is VerdictKind.FALSE_ALARM and verdict.site.id in self._false_alarm_handlers:
                self._false_alarm_handlers[verdict.site.id](evidence)
            elif verdict.kind is VerdictKind.NOT_VERIFIABLE and MODIFIED_BEFORE_REPLAY in verdict.detail:
                self._name_late_boundary()
            elif verdict.kind is VerdictKind.NOT_DETERMINISTIC:
                state = self.fingerprints.sites.get(verdict.site.name)
                if state is not None:
                    state.not_deterministic = verdict.detail
            elif verdict.kind is VerdictKind.CONFIRMED_SDC:
                incident = Incident(self._next_incident, verdict.site, evidence.step, self.identity, evidence, verdict)
                self._next_incident += 1
                report.incidents.append(incident)
                # its replay context as files, before the policy acts (never raises: a failure is logged)
                write_incident_evidence(self.run_dir, incident, self.verifier.kept.pop(verdict.vtask_id, None),
                                        self.evidence_budget)  # fmt: skip
        self.incidents.extend(report.incidents)
        _log_nonfinite_inputs(self.console, report.verdicts)

    def _respond(self, report: StepReport) -> None:
        """Tell the listeners, then act on confirmed incidents by the configured policy (which may raise)."""
        for task in report.alarms:
            self._emit("alarm", task)
        for verdict in report.verdicts:
            self._emit("verdict", verdict)
        for incident in report.incidents:
            self._emit("incident", incident)
        for warning in report.warnings:
            self._emit("warning", warning)
        self._emit("step", report)
        unattributed = [v for v in report.verdicts if v.kind is VerdictKind.UNATTRIBUTED]
        self.console.step(report.step, report.verdicts, report.incidents, len(report.alarms), len(report.warnings),
                          self.step_recorder.writer.waiting)  # fmt: skip
        self.responder.respond(report.incidents, self.optimizer, unattributed, stopping=self._stopping)

    def _name_late_boundary(self) -> None:
        """A replay found its weight already updated: the step ended after the update. Warned once."""
        if self._warned_late_boundary:
            return
        self._warned_late_boundary = True
        warnings.warn(
            "aegis-sdc: an alarm could not be verified because its weight was updated before the step "
            "ended — the step boundary comes after the optimizer's update (as an optimizer pre-hook does "
            "under Lightning's automatic optimization, which runs forward and backward inside "
            "optimizer.step). Use aegis_sdc.integrations.lightning.AegisCallback, or call guard.step() "
            "after backward and before the update (docs/integrations.md)", stacklevel=3,
        )  # fmt: skip

    def _name_unmatched_faults(self, report: StepReport) -> None:
        """After the first step that ran checks: a fault spec that matches none of this rank's sites
        would never fire — named in a warning and the store, with what site names look like."""
        self._fault_sites_named = True
        names = [sensor.site.name for sensor in self.registry.gemm] + [site.name for site in self.registry.extra]
        rank = self.identity.rank
        for spec in self.injector.specs:
            if (not spec.ranks or rank in spec.ranks) and not any(spec.matches(name, rank) for name in names):
                examples = ", ".join(repr(name) for name in names[:3])
                message = (f"fault spec site {spec.site!r} matches no protected site, so it never fires; sites "
                           f"are named like {examples} (fnmatch patterns allowed)")  # fmt: skip
                warnings.warn(f"aegis-sdc: {message}", stacklevel=2)
                report.events.append(("fault_unmatched", message, None))

    def _exchange(self, step: int, report: StepReport, evidence_of: dict[int, Evidence]) -> None:
        """The step's one collective: per site, every data-parallel rank's largest normalized difference
        (and per collective, how far its check was off), the replicas' state vote and the factor on the
        state sensors' periods this rank's budget asks for, gathered on the exchange group (int64: the
        differences' float64 bits, the vote's values, the factor). All ranks adopt the largest factor."""
        nan = float("nan")
        values = [max(s.step_stats.max_row, s.step_stats.max_col) if s.step_stats.checks else nan for s in self.sensors]
        comm = [nan] * COMM_SLOTS
        for index, value in self._comm_values.items():
            comm[index % COMM_SLOTS] = value
        self._comm_values = {}
        sent = torch.tensor(values + comm, dtype=torch.float64).view(torch.int64)
        vote, self._vote_due = self._vote_due, None
        if vote is not None:
            vote.read()  # copied a step ago: nothing to wait for
        if self.state_vote is not None:  # a fixed width on every rank, zeros when no vote was taken
            width = self.state_vote.width
            sent = torch.cat((sent, vote.values(width) if vote else torch.zeros(width, dtype=torch.int64)))
        stretch = self.budget.sensor_stretch if self.budget is not None else 1
        everyone = self.dist.all_gather(torch.cat((sent, torch.tensor([stretch], dtype=torch.int64))), step)
        gathered = everyone[:, : len(values) + COMM_SLOTS].contiguous().view(torch.float64)
        if vote is not None:
            self._judge_vote(vote, everyone[:, len(values) + COMM_SLOTS : -1], report, evidence_of)
            self._vote_judged_step = max(self._vote_judged_step, vote.step)
        self._adopt_sensor_stretch(int(everyone[:, -1].max()), report)
        n = len(self.sensors)
        if step >= self.config.distributed.warmup_steps:
            cfg = self.config.distributed
            warnings = detect_outliers(
                gathered[:, :n], self.dist.ranks, self.sites, step, cfg.outlier_factor, cfg.outlier_quantile
            )
            self.outlier_warnings.extend(warnings)
            report.warnings.extend(warnings)
        failed: dict[int, list[int]] = {}
        for slot in range(COMM_SLOTS):
            column = gathered[:, n + slot].tolist()
            bad = [self.dist.ranks[r] for r, v in enumerate(column) if v == v and v > 1.0]
            if bad:
                failed[slot] = bad
        for task in report.alarms:
            if isinstance(task.payload, CommCapture):
                task.payload.ranks_failed = failed.get(self._comm_slot[task.site.id], task.payload.ranks_failed)
                task.payload.exchanged = True

    def _judge_vote(self, vote: VoteRecord, gathered: torch.Tensor, report: StepReport,
                    evidence_of: dict[int, Evidence]) -> None:  # fmt: skip
        """The replicas' state vote of this step: a rank outside a majority raises a vTask against
        itself; a disagreement no majority decides is raised once, by the lowest rank involved."""
        findings = self.state_vote.judge(vote, gathered, self.dist.ranks)
        if findings is None:
            if not self._vote_out_of_step_named:
                self._vote_out_of_step_named = True
                why = "a skip-step policy dropped an update on some rank"
                report.events.append(("vote_skipped", f"the replicas are out of step by design ({why}): the state "
                                      "vote judges nothing", None))  # fmt: skip
            return
        me = self.identity.rank
        for finding in findings:
            if me not in finding.minority or (not finding.majority and me != min(finding.minority)):
                continue
            evidence = Evidence(
                site=self._state_site(finding.param, finding.kind), step=finding.step, call=0, channel=Channel.VOTE,
                value=float(len(finding.ranks) - len(finding.minority)) if finding.majority else 0.0,
                threshold=0.0, index=0, raw_l2=0.0, channels=(Channel.VOTE,),
            )  # fmt: skip
            self._alarm(report, evidence_of, evidence, VoteCapture(finding))

    # -- certified checkpoints and rollback (response/checkpoints.py) -----------------------------
    def save_checkpoint(self, path: str | os.PathLike, extra: Any = None) -> Certificate:
        """Save the model, the optimizer, the RNG states, the step and `extra` (the caller's own state:
        tensors and plain data) to `path` atomically, and certify it. Call it after the optimizer's step:
        the checkpoint holds the state after the updates of steps < `step_number`."""
        # a certificate describes one file: the old one goes before the file is replaced (a kill in
        # between leaves a checkpoint without a certificate, never one with another file's)
        certificate_path(path).unlink(missing_ok=True)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict() if self.optimizer
                 else None, "rng": rng_states(), "step": self.clock.step, "extra": extra}  # fmt: skip
        save_state(path, state)
        return self._certify(path, state, saved_by="aegis")

    def certify(self, path: str | os.PathLike, state: Any) -> Certificate:
        """Certify a checkpoint the caller saved (a `torch.save` file or a torch.distributed.checkpoint
        directory) at the current step; `state` is what was saved (its tensors are fingerprinted). The
        certificate is written beside it and to the store: certified now, or pending until the step
        that decides it, or uncertified with the reason (docs/response.md). A rollback to such a
        checkpoint needs `on_rollback(..., restore=...)`: the guard does not know its layout."""
        return self._certify(path, state, saved_by="caller")

    def _certify(self, path: str | os.PathLike, state: Any, saved_by: str) -> Certificate:
        certificate = Certificate(path=str(path), step=self.clock.step, status=PENDING, reason="",
                                  verified_through=-1, fingerprints=fingerprints(state),
                                  identity=self.identity.to_dict(), run_dir=str(self.run_dir),
                                  saved_by=saved_by)  # fmt: skip
        self.certificates.append(certificate)
        self._decide_certificates(final=False, only=len(self.certificates) - 1)
        return self.certificates[-1]

    def on_rollback(self, callback: Callable[[int, Any], None] | None = None,
                    restore: Callable[[str], Any] | None = None) -> None:  # fmt: skip
        """`callback(step, extra)` after a rollback restored a checkpoint: move the data to `step` (the
        next step to run) from `extra`, what `save_checkpoint` was given. `restore(path)`: loads a
        checkpoint the caller saved and certified (`certify`: a torch.distributed.checkpoint directory,
        say) into the model and optimizer, and returns its `extra` (checkpoints.verify_state checks
        what it loaded); the guard restores its own `save_checkpoint` files itself."""
        self._on_rollback = callback
        self._restore = restore

    def _note_incidents(self, report: StepReport) -> None:
        """The first state a confirmed SDC corrupts: a state vote's finding names the state itself; a
        step's computation (its update lands unless a policy holds it back) the state after it."""
        steps = [(i.step if i.site.kind in (StateKind.PARAM, StateKind.OPTIMIZER_STATE) else i.step + 1)
                 for i in report.incidents]  # fmt: skip
        steps += [v.step + 1 for v in report.verdicts if v.kind is VerdictKind.UNATTRIBUTED]
        if steps:
            first = min(steps)
            self._corrupt_from = first if self._corrupt_from is None else min(self._corrupt_from, first)

    def _decide_certificates(self, *, final: bool, only: int | None = None) -> None:
        """Decide what can be decided of the pending certificates (and withdraw a certified one an
        incident found later makes unsafe); `final`: at close, what is still pending is uncertified."""
        pending_steps = [e.step for e in self._pending_evidence.values()]
        indices = range(len(self.certificates)) if only is None else [only]
        for i in indices:
            c = self.certificates[i]
            if c.status == UNCERTIFIED:
                continue
            unverified = sum(step < c.step for step in pending_steps)
            verified_through = min([step for step in pending_steps if step < c.step], default=c.step) - 1
            if self._corrupt_from is not None and self._corrupt_from <= c.step:
                decided = c.decided(UNCERTIFIED, f"a confirmed SDC corrupted the state from step {self._corrupt_from} "
                                    "on, before this checkpoint", verified_through)  # fmt: skip
            elif c.status == CERTIFIED:
                continue
            elif unverified:
                reason = f"{unverified} vTask(s) of earlier steps not verified yet"
                decided = c.decided(UNCERTIFIED if final else PENDING, reason, verified_through)
            elif self.state_vote is not None and self._vote_judged_step < c.step:
                when = "was never judged" if final else f"is judged at the end of step {c.step + 1}"
                reason = f"the replicas' vote on this state {when}"
                decided = c.decided(UNCERTIFIED if final else PENDING, reason, verified_through)
            else:
                decided = c.decided(CERTIFIED, "", verified_through)
            if (decided.status, decided.reason) != (c.status, c.reason) or c.decided_wall is None:
                self.certificates[i] = decided
                self._write_certificate(decided)

    def _write_certificate(self, certificate: Certificate) -> None:
        """Beside the checkpoint and in the store; a failure is logged, never raised (docs/operations.md)."""
        try:
            write_certificate(certificate)
        except OSError as error:
            log.error("aegis-sdc: the certificate of %s cannot be written: %s", certificate.path, error)
        self.step_recorder.writer.submit(lambda: self.store.write_certificate(certificate))
        if certificate.status != PENDING:
            log.info("aegis-sdc: checkpoint %s (step %d): %s%s", certificate.path, certificate.step,
                     certificate.status, f" — {certificate.reason}" if certificate.reason else "")  # fmt: skip

    def _rollback(self, incidents: list[Incident]) -> bool:
        """The `rollback` policy: restore the last certified checkpoint; False when there is none (or
        under torch.distributed: the policy then raises or exits, see ResponseConfig)."""
        if self.dist is not None:
            raise SystemExit(self.config.response.exit_code)
        self._decide_certificates(final=False)  # the incident just noted withdraws what it corrupts
        usable = [c for c in self.certificates if c.saved_by == "aegis" or self._restore is not None]
        certificate = latest_certified(usable)
        if certificate is None:
            return False
        if certificate.saved_by == "aegis":
            state = load_state(certificate.path)
            self.model.load_state_dict(state["model"])
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            set_rng_states(state["rng"])
            extra = state.get("extra")
        else:
            extra = self._restore(certificate.path)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:  # the step in flight must not apply its update
                for param in group["params"]:
                    param.grad = None
        # transient faults of the steps about to run again struck once; the state is clean again
        self.injector.reexecuted_below = max(self.injector.reexecuted_below, self.clock.step + 1)
        self._corrupt_from = None
        self._rolled_back_to = certificate.step
        self.rollbacks += 1
        self._pending_events.append(("rollback", f"rolled back to {certificate.path} (step {certificate.step}) "
                                     f"after a confirmed SDC at step {self.clock.step}", None))  # fmt: skip
        log.warning("aegis-sdc: rolled back to the certified checkpoint %s (step %d)", certificate.path,
                    certificate.step)  # fmt: skip
        if self._on_rollback is not None:
            self._on_rollback(certificate.step, extra)
        return True

    def _state_site(self, param: str, kind: StateKind) -> Site:
        """The site of a parameter's state (vote or update replay), registered at its first finding."""
        site = self._state_sites.get((param, kind))
        if site is None:
            site = self._state_sites[(param, kind)] = self.registry.add(param, kind, "state")
        return site

    def _record(self, report: StepReport) -> None:
        report.events.extend(self._pending_events)
        self._pending_events.clear()
        calls = self.plan.take_counts()  # the calls of each Linear, checked or not
        if any(calls):
            self._last_calls = calls
        flops = self.step_recorder.record(report, calls, backlog=self.verifier.backlog)
        self.counts["gemm_flops"] += flops.total
        self.counts["checked_flops"] += flops.checked
        if flops.total:
            self.last_checked_flops_fraction = flops.checked / flops.total
            self._last_checked_gemm_flops, self._last_recorded_step = flops.checked, report.step
            if not self._coverage_logged:  # once, after the first step that ran: the report with its FLOPs
                self._coverage_logged = True
                log.info("aegis-sdc coverage:\n%s", self.coverage_report().describe())


def _log_nonfinite_inputs(console: StepConsole, verdicts: list[Verdict]) -> None:
    """NaN/Inf in a checked call's inputs is the data's doing (an overflow, a bad batch), not the
    device's: one console line per step that had any, naming the sites — the store has every one."""
    by_step: dict[int, list[str]] = {}
    for verdict in verdicts:
        if verdict.kind is VerdictKind.NONFINITE_INPUT:
            by_step.setdefault(verdict.step, []).append(verdict.site.name)
    for step, names in sorted(by_step.items()):
        sites = list(dict.fromkeys(names))
        shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
        console.emit(
            logging.WARNING,
            f"step {step}: NaN/Inf in the inputs of {len(names)} checked "
            f"call{'' if len(names) == 1 else 's'} at {shown} — from the data, not the device (not an SDC)",
        )


def _versions() -> dict[str, str]:
    versions = {"aegis_sdc": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions
