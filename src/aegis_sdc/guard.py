"""The Guard: builds the protection of one model from its config; its public face.

The parts, in the order a step meets them:

- runtime/sites.py     one numbering of every site (GEMM sites first, three per Linear);
- runtime/planner.py   each step's sampling plan (runtime/plan.py: which calls run checked, drawn
                       once per step; runtime/budget.py: the probabilities under
                       `SamplingConfig.budget`);
- ops/ and sensors/    the checked calls record evidence on the device (no host sync per op);
- sensors/state_vote.py, sensors/update_replay.py, distributed/peer_replay.py: the state no op
                       check sees (the replicas' vote in the step's read and exchange, the update
                       replayed by slices, peers recomputing micro-batches at the step end);
- runtime/step.py      the step end: collect (runtime/evidence.py: one read to the host, started
                       without waiting; runtime/gate.py lets a fused optimizer run meanwhile and
                       holds back its update on the device when a check alarmed) → judge → exchange
                       (data parallelism) → verify → record (runtime/record.py) → respond (listeners,
                       then the policy, which may raise before an update lands);
- response/certification.py  certified checkpoints and the rollback policy.

Here: building those parts from the config and the model (integrations/protection.py swaps the matmul
modules for checked ones and keeps the ledger of what runs unchecked; the attention routed, the
fingerprint checkers installed), the optimizer's step hooks that end each
step, the public API (step, summary, coverage, checkpoints, close) and the state sensors' cadence.
The step ends in the optimizer's step hooks, or at `Guard.step()` for loops without an optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import os
import platform
import sqlite3
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aegis_sdc import __version__
from aegis_sdc.bounded import BoundedLog
from aegis_sdc.config import GuardConfig
from aegis_sdc.distributed.agreement import check_agreement
from aegis_sdc.distributed.comm_check import (
    CheckedReduceScatter,
    CommChecks,
    checked_allreduce_hook,
)
from aegis_sdc.distributed.context import make_context
from aegis_sdc.distributed.identity import discover
from aegis_sdc.distributed.outlier import OutlierWarning
from aegis_sdc.distributed.peer_replay import LossFn, PeerReplay
from aegis_sdc.events import (
    AttentionKind,
    CommKind,
    FingerprintKind,
    GemmKind,
    Incident,
    RankIdentity,
    Site,
    StateKind,
    VerdictKind,
)
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.integrations.attention import AttentionRouter
from aegis_sdc.integrations.checkpointing import RecomputeChecker, SavedTensorChecker
from aegis_sdc.integrations.matrices import select_matrix_modules
from aegis_sdc.integrations.modules import GuardHook, LinearFilter, is_protected, module_names, select_linears
from aegis_sdc.integrations.multihead import select_multihead
from aegis_sdc.integrations.protection import Protection, Uncovered
from aegis_sdc.kernels.reference import Tiling
from aegis_sdc.ops.checked_linear import LinearHooks, PlanTracer
from aegis_sdc.ops.fingerprint import FingerprintPool
from aegis_sdc.ops.triton_linear import DeviceState, WeightSums
from aegis_sdc.response.certification import Certification
from aegis_sdc.response.checkpoints import Certificate
from aegis_sdc.response.console import StepConsole
from aegis_sdc.response.evidence import EvidenceBudget
from aegis_sdc.response.policies import Responder
from aegis_sdc.response.quarantine import quarantine_entry
from aegis_sdc.runtime.budget import BudgetController, BudgetPlan, StepTimer
from aegis_sdc.runtime.coverage import CoverageReport
from aegis_sdc.runtime.evidence import Collected
from aegis_sdc.runtime.gate import OptimizerGate, gateable
from aegis_sdc.runtime.plan import GEMMS_PER_LINEAR, StepPlan
from aegis_sdc.runtime.planner import StepPlanner
from aegis_sdc.runtime.record import StepRecorder, StepReport
from aegis_sdc.runtime.run_dir import open_run_store
from aegis_sdc.runtime.sensor_cost import SensorClock, SensorCost
from aegis_sdc.runtime.sites import SiteRegistry
from aegis_sdc.runtime.step import StepRuntime
from aegis_sdc.runtime.summary import GuardSummary
from aegis_sdc.sensors.attention import AttentionRecord, AttentionSensor
from aegis_sdc.sensors.fingerprint import FingerprintChecks
from aegis_sdc.sensors.gemm import CallRecord, CleanSampler, GemmSensor, StepClock
from aegis_sdc.sensors.sampling import Sampler
from aegis_sdc.sensors.state_vote import StateVote, replica_sets
from aegis_sdc.sensors.update_replay import UpdateReplay
from aegis_sdc.verify.verifier import Verifier

log = logging.getLogger("aegis_sdc")

# Forward passes with gradients at the first step, no optimizer and no guard.step(), before the guard
# says that the loop has no step boundary (more than any gradient accumulation of one step runs).
NO_BOUNDARY_FORWARDS = 64
Listener = Callable[[str, Any], None]


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


def _updates_any(optimizer: Any, model: nn.Module) -> bool:
    """Whether the optimizer holds any parameter of the model (an optimizer without param_groups —
    a wrapper of another kind — is given the benefit of the doubt)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return True
    held = {id(p) for group in groups for p in group.get("params", ())}
    params = list(model.parameters())
    return not params or any(id(p) in held for p in params)


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
        if isinstance(start_step, bool) or not isinstance(start_step, numbers.Integral) or start_step < 0:
            raise ValueError(f"start_step must be an int ≥ 0 (the first step's number), got {start_step!r}")
        start_step = int(start_step)
        if optimizer is not None and not _updates_any(optimizer, model):
            warnings.warn("aegis-sdc: the optimizer passed to protect() updates none of the model's parameters: "
                          "its step() still marks the step boundaries, but pass the model's own optimizer",
                          stacklevel=3)  # fmt: skip
        self.config = config
        self.model = model
        self.module_names = {name or "<root>" for name, _ in module_names(model)}  # as sites name modules
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
        self._tiling = Tiling(config.verify.row_block, config.verify.col_block)
        self.device_state = DeviceState()
        self.weight_sums = WeightSums(self.plan)  # every active weight's sums per step, a pass per shape
        self.tracer = PlanTracer()  # shared by every checked Linear: checkpointed segments replay plans
        self.closed = False
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
        self._pending_events: list[tuple[str, str, int]] = []  # events for the next record (plans, gaps)
        self._collected: Collected | None = None  # a gated step between optimizer pre- and post-hook
        self._start_step = start_step
        self._warned_no_boundary = False  # checked calls with no step boundary: named once
        self.gate = OptimizerGate()

        chosen = select_linears(model, config.include, config.exclude, filter)
        others = [*select_matrix_modules(model, config.include, config.exclude),
                  *select_multihead(model, config.include, config.exclude)]  # fmt: skip
        if not chosen and not others:
            if any(is_protected(m) for m in model.modules()):
                raise ValueError("protect(): this model's Linears are protected by a guard already; close that "
                                 "guard (guard.close()) before protecting the model again")  # fmt: skip
            raise ValueError(
                "protect() found no nn.Linear, nn.MultiheadAttention or matrix module to protect (check "
                "GuardConfig.include/exclude and the filter)"
            )
        # the rank's store, locked for writing: one writer per store (runtime/run_dir.py)
        self.run_dir, self.store = open_run_store(config.run_dir, self.identity.rank)
        try:
            self._open(model, optimizer, config, chosen, process_group)
        except BaseException as error:
            self._abandon()  # a failed protect() leaves the model as it was and the directory usable
            if isinstance(error, sqlite3.DatabaseError):  # damage past the pages the opening read
                raise self.store.unreadable(error) from error
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
        last_vtask = self.store.conn.execute("SELECT COALESCE(MAX(id), 0) FROM vtasks").fetchone()[0]
        last_incident = self.store.conn.execute("SELECT COALESCE(MAX(id), 0) FROM incidents").fetchone()[0]
        self.runtime = StepRuntime(self, next_vtask=last_vtask + 1, next_incident=last_incident + 1,
                                   start_step=self._start_step)  # fmt: skip
        self.attention_records: list[AttentionRecord] = []
        self.attention_sensors: dict[str, AttentionSensor] = {}
        # what runs unchecked, and why (integrations/protection.py); the modules swapped for checked ones
        self.uncovered = Uncovered(self._pending_events, self._site_id, self._attention_sensor)
        self.protection = Protection(model, chosen, config.include, config.exclude, self._make_hooks, self.uncovered)
        self.planner = StepPlanner(
            sensors=self.sensors, attention_sensors=self.attention_sensors, plan=self.plan, budget=self.budget,
            sampler=self.sampler, injector=self.injector, device=self._device, tiling=self._tiling,
            events=self._pending_events,
        )  # fmt: skip
        self.planner.state_sensors_ms = lambda: sum(self.sensor_clock.cost(name, period).ms_per_step
                                                    for name, period in self._sensor_periods().items())  # fmt: skip
        self.planner.begin(self.clock.step)
        self._setup_fingerprints(model, config)
        self._router = (
            AttentionRouter(model, self._attention_sensor, self.tracer, self.uncovered.attention_module)
            if config.attention
            else None
        )
        if self._router is not None:
            self._router.install()
            self.uncovered.attention_outside_sdpa(model)
        self.store.write_run(self.identity.to_dict(), config.to_dict(), _versions())
        self.step_recorder = StepRecorder(self.store, self.registry, self.injector, self.identity.rank)
        self.store.write_sites(self.registry.take_unwritten())
        self._stopping = True  # False while closing under an exception of the user's (see __exit__)
        # certified checkpoints and the rollback policy (response/certification.py)
        self.certification = Certification(model, self.identity, self.run_dir, self.injector,
                                           self.step_recorder.writer.submit, self.store.write_certificate,
                                           self._pending_events)  # fmt: skip
        self.responder.rollback = self._rollback
        self._handles = []
        self._forwards_at_start = 0
        # removed once moot; a GuardHook, so that a copy of the model made meanwhile (an EMA model at
        # the start) holds a no-op in its place, not the guard
        self._forward_watch = model.register_forward_pre_hook(GuardHook(self._count_forward))
        self._handles.append(self._forward_watch)
        self.update_replay: UpdateReplay | None = None  # with an optimizer: its update replayed by slices
        self._compiled_step = False  # the optimizer step running now is torch.compile'd
        if optimizer is not None:
            self.attach_optimizer(optimizer)

        # Data parallelism: the rank-outlier exchange and the checks of gradient collectives.
        dist_cfg = config.distributed
        if process_group is None and isinstance(model, nn.parallel.DistributedDataParallel):
            process_group = model.process_group
        self.dist = make_context(process_group, dist_cfg.exchange_timeout_s)
        # alone, the budget's factor on the state sensors' periods applies at once; with ranks, all
        # adopt the largest asked for, in the step's exchange
        self.planner.adopt_stretch = self._adopt_sensor_stretch if self.dist is None else None
        if self.dist is not None:  # ranks whose guards would not line up fail here, every one of them
            check_agreement(self.dist, config, model, [s.name for s in self.sites], self._device.type)
        self.comm_checks = CommChecks(dist_cfg.comm_chunks, self.runtime.comm_site, self._comm_fault,
                                      timeout_s=dist_cfg.exchange_timeout_s)  # fmt: skip
        self.state_vote: StateVote | None = None  # under DDP: the replicas vote on their state
        self.peer_replay: PeerReplay | None = None  # under DDP with run_batch: peers recompute steps
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
            uncovered=self.uncovered.linear,
        )
        self.weight_sums.join(linear, hooks.index, hooks.weight_stats)  # the Linear shares its parameters
        return hooks

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
                self.runtime.false_alarm_handlers[site.id] = functools.partial(sensor.on_false_alarm, backward)
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
            self.planner.saved_checker = self._saved_checker
        for checker in self._checkers:
            checker.install()

    # -- public API ------------------------------------------------------------------------------
    @property
    def step_number(self) -> int:
        """The step the training is at. After a rollback — from inside `on_rollback` on — the
        restored checkpoint's step, which the next step re-executes."""
        rolled_back = self.certification.rolled_back_to
        return rolled_back if rolled_back is not None else self.clock.step

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
        self.runtime.listeners.append(listener)

    # what the step ends so far found and counted (runtime/step.py keeps them)
    @property
    def incidents(self) -> BoundedLog[Incident]:
        return self.runtime.incidents

    @property
    def counts(self) -> Counter[str]:
        return self.runtime.counts

    @property
    def outlier_warnings(self) -> BoundedLog[OutlierWarning]:
        return self.runtime.outlier_warnings

    @property
    def comm_sites(self) -> dict[str, Site]:
        return self.runtime.comm_sites

    @property
    def host_wait_ms(self) -> float:
        return self.runtime.host_wait_ms

    @property
    def last_checked_flops_fraction(self) -> float:
        return self.runtime.last_checked_flops_fraction

    @property
    def budget_plan(self) -> BudgetPlan | None:
        """The sampling plan in force under `SamplingConfig.budget` (None before the first, or without)."""
        return self.budget.plan if self.budget is not None else None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """End each step at `optimizer.step()` (for optimizers built after `protect`, e.g. after FSDP2;
        a wrapper such as accelerate's `AcceleratedOptimizer` is unwrapped to the optimizer it steps)."""
        optimizer = unwrap_optimizer(optimizer)
        self.optimizer = optimizer
        if self.config.update_replay.enabled:
            inner = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
            replay = self.config.update_replay
            self.update_replay = UpdateReplay(inner, self.fingerprint_pool, replay.slices, replay.every)
        # eager even in a compiled optimizer step (torch.compile over `optimizer.step()`): the step
        # end's host work (numpy plans, verdicts, the store) is not for tracing; a graph break there.
        # The first hook tells the step end whether the update itself is compiled.
        self._handles.append(optimizer.register_step_pre_hook(self._mark_compiled_step))
        self._handles.append(optimizer.register_step_pre_hook(torch.compiler.disable(self._optimizer_pre_step)))
        self._handles.append(optimizer.register_step_post_hook(torch.compiler.disable(self._optimizer_post_step)))

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

    # Eager even when called from inside a compiled function (a training step compiled whole, Lightning's
    # compiled training_step under manual optimization): the step end's host work (numpy plans,
    # verdicts, the store) is not for tracing — Dynamo failed inside it; a graph break there instead.
    @torch.compiler.disable
    def step(self) -> StepReport:
        """End the current step and start the next; for training loops that pass no optimizer. Call it
        after backward and before the weights change (see `protect`)."""
        self._require_open()
        self.runtime.conclude_peer_replay()
        report = self.runtime.process(drain=False, vote=True)
        self._advance()
        return report

    @torch.compiler.disable
    def end_step(self) -> StepReport:
        """Judge, verify, record and respond for everything recorded since the last call."""
        self._require_open()
        return self.runtime.process(drain=False)

    def flush(self) -> StepReport:
        """Like end_step, without advancing the step (inference loops; full buffers)."""
        return self.end_step()

    def drain(self) -> StepReport:
        """Judge what was recorded and verify every pending vTask now, whatever the verification
        budget (a fault campaign's trial boundary: each trial's verdicts are its own)."""
        self._require_open()
        return self.runtime.process(drain=True)

    def summary(self) -> GuardSummary:
        t = self.verifier.telemetry
        c = self.counts
        return GuardSummary(
            steps=self.runtime.steps_counted,
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
            same_fault=c["same_fault"],
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
        calls = self.planner.last_calls or [0] * self.plan.linears
        gemm = sum(calls[s.site.id // GEMMS_PER_LINEAR] * s.flops for s in self.sensors)
        step = self.runtime.last_recorded_step
        attention = checked_attention = 0.0
        for sensor in self.attention_sensors.values():
            made, checked = sensor.calls_of_step(step)
            attention += made * sensor.call_flops
            checked_attention += checked * sensor.call_flops
        checked = self.runtime.last_checked_gemm_flops + checked_attention
        return CoverageReport(self.protection.counts(), gemm, attention, checked, self._coverage()["not_covered"])

    def _coverage(self) -> dict[str, Any]:
        coverage = self.fingerprints.coverage()
        coverage["not_covered"].update(self.uncovered.not_covered())
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
            self.runtime.process(drain=True)
            self.runtime.name_unfired_faults()
        finally:
            for handle in self._handles:
                handle.remove()
            for checker in self._checkers:
                checker.uninstall()
            if self._router is not None:
                self._router.uninstall()
            self.protection.restore()
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
            if hasattr(self, "protection"):
                self.protection.restore()
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
        rolled_back, self.certification.rolled_back_to = self.certification.rolled_back_to, None
        self.clock.step = rolled_back if rolled_back is not None else self.clock.step + 1
        self.comm_checks.step = self.clock.step
        for checker in self._checkers:  # checkpointing enabled since the last step (a scan of the modules)
            if isinstance(checker, RecomputeChecker):
                checker.rebind()
        self.planner.begin(self.clock.step)

    def _comm_fault(self, site: Site, step: int, result: torch.Tensor) -> None:
        """Fault injection into a collective's result on this rank: a flipped bit in one element."""
        self.injector.flip_tensor_bit(site, step, 0, result, salt=0xC0)

    # -- the step end at optimizer.step() (runtime/gate.py) ------------------------------------------
    def _mark_compiled_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Traced into a compiled optimizer step this is the constant True, a store Dynamo makes at
        # the graph break before the next hook runs; eager, False.
        self._compiled_step = torch.compiler.is_compiling()

    def _optimizer_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.gate.reapplying:
            return
        self._require_open()
        if self.update_replay is not None:
            closure = (args[1] if len(args) > 1 else None) or kwargs.get("closure")
            step = self.clock.step
            span = self.sensor_clock.begin("update_replay", step) if self.update_replay.due(step) else None
            self.update_replay.before(optimizer, step, self.responder.dropped_updates, closure is not None,
                                      compiled=self._compiled_step)  # fmt: skip
            if span is not None:
                self.sensor_clock.end(span)
        self.runtime.conclude_peer_replay()
        gated = self.config.gate_optimizer and gateable(optimizer, self._device)
        collected = self.runtime.collect(gate=gated, vote=True)
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
            self.runtime.conclude(collected, drain=False)
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
            report = self.runtime.conclude(collected, drain=False)  # may raise: the update stays held back
            if report.alarms and self.certification.rolled_back_to is None:  # held back; the verdicts let it through
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
        if torch.compiler.is_compiling():
            # traced into a compiled model's graph: counting (and removing a hook) there would break
            # the graph, an error under fullgraph=True; checked calls piling up warn too (_after_call)
            return
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

    # -- certified checkpoints and rollback (response/certification.py) ---------------------------
    def save_checkpoint(self, path: str | os.PathLike, extra: Any = None) -> Certificate:
        """Save the model, the optimizer, the RNG states, the step and `extra` (the caller's own state:
        tensors and plain data) to `path` atomically, and certify it. Call it after the optimizer's step:
        the checkpoint holds the state after the updates of steps < `step_number`."""
        state = self.certification.save(path, self.clock.step, self.optimizer, extra)
        return self._certify(path, state, saved_by="aegis")

    def certify(self, path: str | os.PathLike, state: Any) -> Certificate:
        """Certify a checkpoint the caller saved (a `torch.save` file or a torch.distributed.checkpoint
        directory) at the current step; `state` is what was saved (its tensors are fingerprinted). The
        certificate is written beside it and to the store: certified now, or pending until the step
        that decides it, or uncertified with the reason (docs/response.md). A rollback to such a
        checkpoint needs `on_rollback(..., restore=...)`: the guard does not know its layout."""
        return self._certify(path, state, saved_by="caller")

    def _certify(self, path: str | os.PathLike, state: Any, saved_by: str) -> Certificate:
        self.certification.add(path, self.clock.step, state, saved_by)
        self._decide_certificates(final=False, only=len(self.certificates) - 1)
        return self.certificates[-1]

    def on_rollback(self, callback: Callable[[int, Any], None] | None = None,
                    restore: Callable[[str], Any] | None = None) -> None:  # fmt: skip
        """`callback(step, extra)` after a rollback restored a checkpoint: move the data to `step` (the
        next step to run) from `extra`, what `save_checkpoint` was given. `restore(path)`: loads a
        checkpoint the caller saved and certified (`certify`: a torch.distributed.checkpoint directory,
        say) into the model and optimizer, and returns its `extra` (checkpoints.verify_state checks
        what it loaded); the guard restores its own `save_checkpoint` files itself."""
        self.certification.on_rollback = callback
        self.certification.restore = restore

    @property
    def certificates(self) -> list[Certificate]:
        return self.certification.certificates

    @property
    def rollbacks(self) -> int:
        return self.certification.rollbacks

    def _decide_certificates(self, *, final: bool, only: int | None = None) -> None:
        pending = [e.step for e in self.runtime.pending_evidence.values()]
        self.certification.decide(pending, voting=self.state_vote is not None, final=final, only=only,
                                  ranks=self.dist is not None)  # fmt: skip

    def _rollback(self, incidents: list[Incident]) -> bool:
        """The `rollback` policy: restore the last certified checkpoint; False when there is none (or
        under torch.distributed: the policy then raises or exits, see ResponseConfig)."""
        if self.dist is not None:
            raise SystemExit(self.config.response.exit_code)
        self._decide_certificates(final=False)  # the incident just noted withdraws what it corrupts
        return self.certification.rollback(self.clock.step, self.optimizer)


def _versions() -> dict[str, str]:
    versions = {"aegis_sdc": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions
