"""The step end: collect → judge → (exchange) → verify → record → respond, once per training step.

The guard builds the parts (sensors, verifier, store, policies) and ends each step here: at the
optimizer's step hooks, or at `Guard.step()` for loops without an optimizer. This runtime owns what
lives from one step end to the next: the counts, the alarms waiting for a verdict, the ids of
vTasks and incidents, the listeners, the collectives' slots in the exchange, the replicas' vote in
flight.

- `collect`  takes what the step's checked calls recorded on the device and starts it on its way to
             the host (runtime/evidence.py: one packed copy, nothing waits);
- `conclude` reads it (the step's one wait for the device) and runs the rest:
  - `judge`    every check against its threshold (GEMMs, collectives, attention, fingerprints, update
               replays, peer replays); an alarm becomes a vTask with its replay context;
  - `exchange` with data-parallel ranks, the step's one collective: every rank's largest differences
               (rank-outlier warnings), the collectives' checks, the replicas' state vote;
  - `verify`   replays what is due (verify/verifier.py, within VerifyConfig's time budget) and
               acts on each verdict: a false alarm widens its site's threshold, a confirmed SDC
               becomes an incident with its evidence files;
  - `record`   one store transaction per step (runtime/record.py, written off the training thread);
  - `respond`  tells the listeners, then the policy acts (response/policies.py), which may raise
               before the update lands: after the record, so nothing found is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from aegis_sdc.bounded import BoundedLog
from aegis_sdc.distributed.comm_check import CommCapture, max_ratios
from aegis_sdc.distributed.outlier import OutlierWarning, detect_outliers
from aegis_sdc.distributed.peer_replay import PeerCapture, PeerFinding
from aegis_sdc.events import (
    AttentionKind,
    Channel,
    CommKind,
    Evidence,
    FingerprintKind,
    GemmKind,
    Incident,
    Site,
    StateKind,
    Verdict,
    VerdictKind,
    VTask,
)
from aegis_sdc.ops.gemm_replay import MODIFIED_BEFORE_REPLAY
from aegis_sdc.response.console import StepConsole
from aegis_sdc.response.evidence import CleanSample, write_clean_evidence, write_incident_evidence
from aegis_sdc.runtime import evidence as step_evidence
from aegis_sdc.runtime.evidence import Collected
from aegis_sdc.runtime.record import StepReport
from aegis_sdc.sensors.attention import AttentionSensor
from aegis_sdc.sensors.state_vote import VoteCapture, VoteRecord
from aegis_sdc.sensors.update_replay import UpdateCapture

log = logging.getLogger("aegis_sdc")

Listener = Callable[[str, Any], None]
Alarm = Callable[[Evidence, object], None]
COMM_SLOTS = 256  # collectives exchanged per step (the exchange tensor has a fixed shape)
NO_STEP = 2**62  # "no such step" in the exchange (a min over ranks ignores it)


class StepRuntime:
    """The step end of one guard. `guard`: the parts it runs over (read here, built by the guard)."""

    def __init__(self, guard: Any, *, next_vtask: int, next_incident: int, start_step: int) -> None:
        self.guard = guard
        self.counts: Counter[str] = Counter()
        self.incidents: BoundedLog[Incident] = BoundedLog()  # the latest; the store has them all
        self.first_incident_step: int | None = None  # of the run's first confirmed SDC
        self.outlier_warnings: BoundedLog[OutlierWarning] = BoundedLog()
        self.listeners: list[Listener] = []
        self.pending_evidence: dict[int, Evidence] = {}  # vTask id → its evidence, until verified
        self.false_alarm_handlers: dict[int, Callable[[Evidence], None]] = {}  # non-GEMM sites, by site id
        self.next_vtask, self.next_incident = next_vtask, next_incident  # the store's ids continue
        self.comm_sites: dict[str, Site] = {}
        self.comm_slot: dict[int, int] = {}  # collective site id → its slot in the exchange
        self.comm_values: dict[int, float] = {}  # this step: collective slot → largest mismatch / bound
        # The vote taken at a step's end is read and exchanged at the next step's end: its copy to the
        # host is long done by then, so no step waits for the device on its account.
        self.vote_taken: VoteRecord | None = None  # this step's vote, on its way to the host
        self.vote_due: VoteRecord | None = None  # the previous step's, for this step's exchange
        self.peer_findings: list[PeerFinding] = []
        self.state_sites: dict[tuple[str, StateKind], Site] = {}
        self.steps_counted, self.last_step_counted = 0, None  # distinct steps that checked or verified
        self.host_wait_ms = 0.0  # the host's time waiting for evidence (the device still computing)
        self.last_checked_flops_fraction = 0.0  # of the GEMM FLOPs of the last recorded step
        self.last_checked_gemm_flops, self.last_recorded_step = 0.0, start_step  # for the coverage report
        # each named once: fault specs matching no site, a boundary after the update, an out-of-step vote
        self.fault_sites_named = self.warned_late_boundary = self.vote_out_of_step_named = False
        self.coverage_logged = False  # the coverage report, logged after the first recorded step

    # -- the step end, in order --------------------------------------------------------------------
    def process(self, *, drain: bool, vote: bool = False) -> StepReport:
        return self.conclude(self.collect(gate=False, vote=vote), drain=drain)

    def collect(self, *, gate: bool, vote: bool = False) -> Collected:
        """Take what the step recorded and start its evidence on the way to the host (nothing waits).
        `vote`: at a step's end, before its update — the replicas' state is fingerprinted here."""
        g = self.guard
        step = g.clock.step
        if vote:  # the previous step's vote is due; this step's is taken (unless the cadence skips it)
            self.vote_due, self.vote_taken = self.vote_taken, None
        if vote and g.state_vote is not None and step % g.sensor_stretch == 0:
            span = g.sensor_clock.begin("state_vote", step)
            self.vote_taken = g.state_vote.take(step, g.optimizer, g.responder.dropped_updates)
            g.sensor_clock.end(span)
        records = list(g.recorder)
        g.recorder.clear()
        for swap in g.protection.linear_swaps:  # compiled forwards whose backward never came (see ops/linear_op.py)
            swap.checked.aegis_hooks.pending.clear()
        comm_records = g.comm_checks.take()
        attention, g.attention_records[:] = list(g.attention_records), []
        fp_records = g.fingerprints.take()
        differ = g.fingerprints.differ_on_device(fp_records) if gate and fp_records else None
        collected = step_evidence.collect(
            step, records, comm_records, max_ratios(comm_records) if comm_records else None,
            fp_records, attention, g.fingerprint_pool.device_buffers(), gate=gate,
            fingerprints_differ=differ,
        )  # fmt: skip
        g.device_state.end_step()  # fresh slots and pools: their contents are copied or queued
        return collected

    def conclude(self, collected: Collected, *, drain: bool) -> StepReport:
        """One step's evidence, end to end: read it (the step's one wait for the device), judge every
        check, verify the alarms, record the step, respond to what was confirmed."""
        g = self.guard
        report = StepReport(collected.step)
        started = time.perf_counter()
        synced, comm_values = step_evidence.read(collected, g.fingerprint_pool)
        self.host_wait_ms += (time.perf_counter() - started) * 1000.0
        evidence_of = self.judge(collected, synced, comm_values, report)
        if g.dist is not None and not drain:
            self.exchange(collected.step, report, evidence_of)
        self.verify(report, evidence_of, drain=drain)
        self.counts["checks"] += report.checks
        self.counts["alarms"] += len(report.alarms)
        if (collected.records or report.verdicts) and collected.step != self.last_step_counted:
            self.steps_counted, self.last_step_counted = self.steps_counted + 1, collected.step
        if g.injector and not self.fault_sites_named and (collected.records or collected.attention):
            self._name_unmatched_faults(report)
        self.record(report)
        g.certification.note_incidents(report.incidents, report.verdicts)
        self.respond(report)
        g._decide_certificates(final=False)
        return report

    # -- judge -------------------------------------------------------------------------------------
    def judge(self, collected: Collected, synced: list, comm_values: list, report: StepReport) -> dict[int, Evidence]:
        """Every check of the step against its threshold (GEMMs, collectives, attention, fingerprints):
        an alarm becomes a vTask in the report, with its evidence (by vTask id)."""
        g = self.guard
        report.checks = len(collected.records)
        evidence_of: dict[int, Evidence] = {}
        alarm = functools.partial(self.alarm, report, evidence_of)

        for record, stats in zip(collected.records, synced, strict=True):
            evidence = record.sensor.judge(record, stats)
            if evidence is not None:
                alarm(evidence, record.capture)
            elif record.clean is not None:  # a clean sample's tile as evidence (never raises: logged)
                plan, tile, record.clean = record.plan, record.clean, None  # released once written
                sample = CleanSample(record.sensor.site, plan.step, plan.call, g.identity, tile)
                write_clean_evidence(g.run_dir, sample, g.clean_budget)
        for record, value in zip(collected.comm_records, comm_values, strict=True):
            if value > 1.0:
                alarm(
                    Evidence(
                        site=record.site, step=record.step, call=0, channel=Channel.COMM, value=value,
                        threshold=1.0, index=record.mismatched()[0], raw_l2=0.0, channels=(Channel.COMM,),
                    ),
                    CommCapture(record, [g.identity.rank], g.dist.ranks if g.dist else [g.identity.rank]),
                )  # fmt: skip
            self.comm_values[self.comm_slot[record.site.id]] = value
        self.counts["attention_checks"] += len(collected.attention)
        for record in collected.attention:
            evidence = AttentionSensor.judge(record)
            if evidence is not None:
                alarm(evidence, record.capture)
        if g.update_replay is not None:
            self._judge_updates(alarm)
        self._raise_peer_findings(alarm)
        mismatched, not_deterministic = g.fingerprints.judge(collected.fp_records)
        self.counts["fingerprint_checks"] += len(collected.fp_records)
        for record in mismatched:
            alarm(record.evidence(), record.capture)
        for name in not_deterministic:
            self.counts["not_deterministic_calibration"] += 1
            report.events.append(("not_deterministic", f"{name}: not deterministic — not covered",
                                  g.registry.id_of(name)))  # fmt: skip
        return evidence_of

    def alarm(self, report: StepReport, evidence_of: dict[int, Evidence], evidence: Evidence, payload: object) -> None:
        """Evidence over its threshold becomes a vTask of the step, with its replay context."""
        task = VTask(self.next_vtask, evidence, payload)
        self.next_vtask += 1
        report.alarms.append(task)
        evidence_of[task.id] = evidence

    def _judge_updates(self, alarm: Alarm) -> None:
        """Optimizer-update replays whose fingerprints came with this read: a parameter whose training
        update and replay differ raises a vTask (its verdict runs the update a third time)."""
        g = self.guard
        for record in g.update_replay.take_resolved():
            for index in record.mismatched():
                site = self.state_site(record.inputs.names[index], StateKind.OPTIMIZER_UPDATE)
                evidence = Evidence(site=site, step=record.step, call=0, channel=Channel.FINGERPRINT, value=1.0,
                                    threshold=0.0, index=0, raw_l2=0.0, channels=(Channel.FINGERPRINT,))  # fmt: skip
                alarm(evidence, UpdateCapture(record, index, g.fingerprint_pool))

    def conclude_peer_replay(self) -> None:
        """On a peer-replay step, before the update: the ranks recompute each other's micro-batches
        (distributed/peer_replay.py); the findings are raised with the step's other alarms."""
        g = self.guard
        if g.peer_replay is not None and g.peer_replay.due(g.clock.step):
            span = g.sensor_clock.begin("peer_replay", g.clock.step)
            self.peer_findings = g.peer_replay.conclude(g.clock.step, self._replaying)
            g.sensor_clock.end(span)

    @contextlib.contextmanager
    def _replaying(self):
        """The checked ops run a recomputation of this step's calls: the plan's call counts start
        again from zero (the same calls are checked, so the same kernels run) and are restored after.
        The recomputation's checks are judged with the step's: they are real checks of this device."""
        plan, injector = self.guard.plan, self.guard.injector
        calls = list(plan.calls)
        plan.calls = [0] * len(calls)
        try:
            with injector.recomputing():  # a transient fault struck the step's own calls, not these
                yield
        finally:
            plan.calls = calls

    def _raise_peer_findings(self, alarm: Alarm) -> None:
        """A peer-replay finding is raised once: by the rank it names, or (a pair, an unstable step)
        by the lowest rank that ran it."""
        findings, self.peer_findings = self.peer_findings, []
        me = self.guard.identity.rank
        for finding in findings:
            raiser = finding.blamed if finding.blamed is not None else min(finding.executions.values())
            if raiser != me:
                continue
            site = self.state_site("model", StateKind.PEER_REPLAY)
            evidence = Evidence(site=site, step=finding.step, call=0, channel=Channel.FINGERPRINT,
                                value=float(len(finding.params)), threshold=0.0, index=finding.owner, raw_l2=0.0,
                                channels=(Channel.FINGERPRINT,))  # fmt: skip
            alarm(evidence, PeerCapture(finding))

    def state_site(self, param: str, kind: StateKind) -> Site:
        """The site of a parameter's state (vote or update replay), registered at its first finding."""
        site = self.state_sites.get((param, kind))
        if site is None:
            site = self.state_sites[(param, kind)] = self.guard.registry.add(param, kind, "state")
        return site

    def comm_site(self, name: str, kind: CommKind) -> Site:
        """The site of a checked collective, registered at its first call, with its exchange slot."""
        key = f"{name}:{kind.value}"
        site = self.comm_sites.get(key)
        if site is None:
            site = self.comm_sites[key] = self.guard.registry.add(name, kind, kind.value)
            self.comm_slot[site.id] = len(self.comm_slot) % COMM_SLOTS
        return site

    # -- exchange (data parallelism) ----------------------------------------------------------------
    def exchange(self, step: int, report: StepReport, evidence_of: dict[int, Evidence]) -> None:
        """The step's one collective: per site, every data-parallel rank's largest normalized difference
        (and per collective, how far its check was off), the replicas' state vote and the factor on the
        state sensors' periods this rank's budget asks for, gathered on the exchange group (int64: the
        differences' float64 bits, the vote's values, the factor). All ranks adopt the largest factor."""
        g = self.guard
        nan = float("nan")
        values = [max(s.step_stats.max_row, s.step_stats.max_col) if s.step_stats.checks else nan for s in g.sensors]
        comm = [nan] * COMM_SLOTS
        for index, value in self.comm_values.items():
            comm[index % COMM_SLOTS] = value
        self.comm_values = {}
        sent = torch.tensor(values + comm, dtype=torch.float64).view(torch.int64)
        vote, self.vote_due = self.vote_due, None
        if vote is not None:
            vote.read()  # copied a step ago: nothing to wait for
        if g.state_vote is not None:  # a fixed width on every rank, zeros when no vote was taken
            width = g.state_vote.width
            sent = torch.cat((sent, vote.values(width) if vote else torch.zeros(width, dtype=torch.int64)))
        # what this rank knows of the replicas' common state, for every rank's certificates: the first
        # state a confirmed SDC here corrupted (all-reduced gradients carry it to every replica) and
        # the oldest step with a vTask here still unverified (NO_STEP: none)
        certification = g.certification
        corrupt = certification.corrupt_from if certification.corrupt_from is not None else NO_STEP
        pending = min((e.step for e in self.pending_evidence.values()), default=NO_STEP)
        stretch = g.budget.sensor_stretch if g.budget is not None else 1
        tail = torch.tensor([corrupt, pending, stretch], dtype=torch.int64)
        everyone = g.dist.all_gather(torch.cat((sent, tail)), step)
        gathered = everyone[:, : len(values) + COMM_SLOTS].contiguous().view(torch.float64)
        if vote is not None:
            self._judge_vote(vote, everyone[:, len(values) + COMM_SLOTS : -3], report, evidence_of)
            certification.vote_judged_step = max(certification.vote_judged_step, vote.step)
        corrupt_from, pending_from = (int(everyone[:, column].min()) for column in (-3, -2))
        certification.peers_known(step, None if corrupt_from == NO_STEP else corrupt_from,
                                  None if pending_from == NO_STEP else pending_from)  # fmt: skip
        g._adopt_sensor_stretch(int(everyone[:, -1].max()), report)
        n = len(g.sensors)
        cfg = g.config.distributed
        if step >= cfg.warmup_steps:
            found = detect_outliers(gathered[:, :n], g.dist.ranks, g.sites, step, cfg.outlier_factor,
                                    cfg.outlier_quantile)  # fmt: skip
            self.outlier_warnings.extend(found)
            report.warnings.extend(found)
        failed: dict[int, list[int]] = {}
        for slot in range(COMM_SLOTS):
            column = gathered[:, n + slot].tolist()
            bad = [g.dist.ranks[r] for r, v in enumerate(column) if v == v and v > 1.0]
            if bad:
                failed[slot] = bad
        for task in report.alarms:
            if isinstance(task.payload, CommCapture):
                task.payload.ranks_failed = failed.get(self.comm_slot[task.site.id], task.payload.ranks_failed)
                task.payload.exchanged = True

    def _judge_vote(self, vote: VoteRecord, gathered: torch.Tensor, report: StepReport,
                    evidence_of: dict[int, Evidence]) -> None:  # fmt: skip
        """The replicas' state vote of this step: a rank outside a majority raises a vTask against
        itself; a disagreement no majority decides is raised once, by the lowest rank involved."""
        g = self.guard
        findings = g.state_vote.judge(vote, gathered, g.dist.ranks)
        if findings is None:
            if not self.vote_out_of_step_named:
                self.vote_out_of_step_named = True
                why = "a skip-step policy dropped an update on some rank"
                report.events.append(("vote_skipped", f"the replicas are out of step by design ({why}): the state "
                                      "vote judges nothing", None))  # fmt: skip
            return
        me = g.identity.rank
        for finding in findings:
            if me not in finding.minority or (not finding.majority and me != min(finding.minority)):
                continue
            evidence = Evidence(
                site=self.state_site(finding.param, finding.kind), step=finding.step, call=0, channel=Channel.VOTE,
                value=float(len(finding.ranks) - len(finding.minority)) if finding.majority else 0.0,
                threshold=0.0, index=0, raw_l2=0.0, channels=(Channel.VOTE,),
            )  # fmt: skip
            self.alarm(report, evidence_of, evidence, VoteCapture(finding))

    # -- verify --------------------------------------------------------------------------------------
    def verify(self, report: StepReport, evidence_of: dict[int, Evidence], *, drain: bool) -> None:
        """Queue the step's alarms, replay what is due (all of it when draining), and act on each
        verdict: a false alarm widens its site's threshold, a confirmed SDC becomes an incident."""
        g = self.guard
        self.pending_evidence.update(evidence_of)
        g.verifier.submit(report.alarms)
        started = time.perf_counter()
        report.verdicts = g.verifier.run(report.step, drain=drain)
        report.verify_ms = (time.perf_counter() - started) * 1000.0
        # Verdicts that found a wrong result upstream of their own site (a backward check, a
        # recomputation, a peer replay) are judged last: when the upstream op's own check confirmed
        # the fault at that step, they join its incident.
        order = sorted(range(len(report.verdicts)), key=lambda i: report.verdicts[i].traced_upstream)
        for i in order:
            verdict = report.verdicts[i]
            evidence = self.pending_evidence.pop(verdict.vtask_id)
            if verdict.traced_upstream:
                found = self._upstream_incident(verdict.site, evidence.step, report.incidents)
                if found is not None:
                    report.verdicts[i] = dataclasses.replace(
                        verdict, same_fault_as=found.id,
                        detail=f"{verdict.detail}; the fault of incident {found.id} at {found.site.name}, found again",
                    )  # fmt: skip
                    g.verifier.kept.pop(verdict.vtask_id, None)
                    self.counts["same_fault"] += 1
                    continue
            self.counts[verdict.kind.value] += 1
            if verdict.kind is VerdictKind.FALSE_ALARM and verdict.site.id < len(g.sensors):
                g.sensors[verdict.site.id].on_false_alarm(evidence)
            elif verdict.kind is VerdictKind.FALSE_ALARM and verdict.site.id in self.false_alarm_handlers:
                self.false_alarm_handlers[verdict.site.id](evidence)
            elif verdict.kind is VerdictKind.NOT_VERIFIABLE and MODIFIED_BEFORE_REPLAY in verdict.detail:
                self._name_late_boundary()
            elif verdict.kind is VerdictKind.NOT_DETERMINISTIC:
                state = g.fingerprints.sites.get(verdict.site.name)
                if state is not None:
                    state.not_deterministic = verdict.detail
            elif verdict.kind is VerdictKind.CONFIRMED_SDC:
                incident = Incident(self.next_incident, verdict.site, evidence.step, g.identity, evidence, verdict)
                self.next_incident += 1
                report.incidents.append(incident)
                # its replay context as files, before the policy acts (never raises: a failure is logged)
                write_incident_evidence(g.run_dir, incident, g.verifier.kept.pop(verdict.vtask_id, None),
                                        g.evidence_budget)  # fmt: skip
        self.incidents.extend(report.incidents)
        if report.incidents and self.first_incident_step is None:
            self.first_incident_step = min(incident.step for incident in report.incidents)
        _log_nonfinite_inputs(g.console, report.verdicts, self.first_incident_step)

    def _upstream_incident(self, traced: Site, step: int, new: list[Incident]) -> Incident | None:
        """This rank's incident at `step` of what a traced verdict found wrong upstream: for an
        attention backward check, its own module's forward check; for a recomputed segment, a
        forward check of an op inside the segment (a GEMM's or attention's); for a peer replay, which
        recomputed the rank's whole step, any incident of the step."""
        inside = traced.module + "."
        # a recomputed segment that is a function of modules, not one module (checkpoint_sequential's
        # closures, a user's function): which ops ran inside is not known by name, so any forward
        # incident of the step is its upstream, as for a peer replay
        anywhere = traced.kind is StateKind.PEER_REPLAY or (
            traced.kind is FingerprintKind.RECOMPUTE and traced.module not in self.guard.module_names
        )
        for incident in [*new, *self.incidents]:
            site = incident.site
            if incident.step != step:
                continue
            if anywhere and site.kind in (GemmKind.FORWARD, AttentionKind.FORWARD):
                return incident
            if traced.kind is StateKind.PEER_REPLAY:
                return incident
            if traced.kind is AttentionKind.BACKWARD:
                if site.kind is AttentionKind.FORWARD and site.module == traced.module:
                    return incident
            elif site.kind in (GemmKind.FORWARD, AttentionKind.FORWARD) and (
                site.module == traced.module or site.module.startswith(inside)
            ):
                return incident
        return None

    # -- record and respond ------------------------------------------------------------------------
    def record(self, report: StepReport) -> None:
        """The step's record: its checks, alarms, verdicts, incidents and events, one transaction."""
        g = self.guard
        for eager_check in (g._router, *g._checkers):  # what stood aside inside a compiled graph
            if eager_check is not None:
                eager_check.name_compiled()
        report.events.extend(g._pending_events)
        g._pending_events.clear()
        calls = g.plan.take_counts()  # the calls of each Linear, checked or not
        if any(calls):
            g.planner.last_calls = calls
        flops = g.step_recorder.record(report, calls, backlog=g.verifier.backlog)
        self.counts["gemm_flops"] += flops.total
        self.counts["checked_flops"] += flops.checked
        if flops.total:
            self.last_checked_flops_fraction = flops.checked / flops.total
            self.last_checked_gemm_flops, self.last_recorded_step = flops.checked, report.step
            if not self.coverage_logged:  # once, after the first step that ran: the report with its FLOPs
                self.coverage_logged = True
                g.protection.name_uncalled()
                log.info("aegis-sdc coverage:\n%s", g.coverage_report().describe())

    def respond(self, report: StepReport) -> None:
        """Tell the listeners, then act on confirmed incidents by the configured policy (which may raise)."""
        g = self.guard
        for task in report.alarms:
            self.emit("alarm", task)
        for verdict in report.verdicts:
            self.emit("verdict", verdict)
        for incident in report.incidents:
            self.emit("incident", incident)
        for warning in report.warnings:
            self.emit("warning", warning)
        self.emit("step", report)
        unattributed = [v for v in report.verdicts if v.kind is VerdictKind.UNATTRIBUTED]
        g.console.step(report.step, report.verdicts, report.incidents, len(report.alarms), len(report.warnings),
                       g.step_recorder.writer.waiting)  # fmt: skip
        g.responder.respond(report.incidents, g.optimizer, unattributed, stopping=g._stopping)

    def emit(self, event: str, payload: Any) -> None:
        for listener in self.listeners:
            listener(event, payload)

    # -- wiring mistakes, named once ---------------------------------------------------------------
    def _name_late_boundary(self) -> None:
        """A replay found its weight already updated: the step ended after the update. Warned once."""
        if self.warned_late_boundary:
            return
        self.warned_late_boundary = True
        warnings.warn(
            "aegis-sdc: an alarm could not be verified because its weight was updated before the step "
            "ended — the step boundary comes after the optimizer's update: forward and backward ran inside "
            "optimizer.step(closure) (Lightning's automatic optimization; LBFGS, which updates the weights "
            "between evaluations of its closure). Under Lightning use aegis_sdc.integrations.lightning."
            "AegisCallback; with a closure of your own call guard.step() at the closure's end, after "
            "backward; otherwise call guard.step() after backward and before the update "
            "(docs/integrations.md)", stacklevel=3,
        )  # fmt: skip

    def _name_unmatched_faults(self, report: StepReport) -> None:
        """After the first step that ran checks: a fault spec that matches none of this rank's sites
        would never fire — named in a warning and the store, with what site names look like."""
        g = self.guard
        self.fault_sites_named = True
        names, not_covered = self._fault_sites()
        rank = g.identity.rank
        for spec in g.injector.specs:
            if spec.ranks and rank not in spec.ranks:
                continue
            matched = [name for name in names if spec.matches(name, rank)]
            if not matched:
                examples = ", ".join(repr(name) for name in names[:3])
                message = (f"fault spec site {spec.site!r} matches no protected site, so it never fires; sites "
                           f"are named like {examples} (fnmatch patterns allowed)")  # fmt: skip
            elif all(name in not_covered for name in matched):
                message = (f"fault spec site {spec.site!r} matches only sites that run unchecked, so it never "
                           f"fires: {matched[0]} — {not_covered[matched[0]]}")  # fmt: skip
            else:
                continue
            warnings.warn(f"aegis-sdc: {message}", stacklevel=2)
            report.events.append(("fault_unmatched", message, None))

    def name_unfired_faults(self) -> None:
        """At close: a fault spec whose steps passed without it ever striking a site it matches (its
        GEMM never ran then) is named in a warning, so that a test or campaign counting on it is not
        misled in silence. Specs aimed only at unchecked sites were named after the first step."""
        g = self.guard
        if not g.injector:
            return
        names, not_covered = self._fault_sites()
        for spec in g.injector.unfired(g.clock.step, [name for name in names if name not in not_covered]):
            warnings.warn(f"aegis-sdc: fault spec site {spec.site!r} (steps {spec.steps}) never fired: the GEMM it "
                          "names did not run at those steps (a dgrad whose input needs no gradient, a frozen "
                          "weight's wgrad, a module the forward skipped)", stacklevel=3)  # fmt: skip

    def _fault_sites(self) -> tuple[list[str], dict[str, str]]:
        """(every site's name a fault spec may aim at, the sites that exist but run unchecked: why)."""
        g = self.guard
        names = [sensor.site.name for sensor in g.registry.gemm] + [site.name for site in g.registry.extra]
        return names, g.coverage_report().not_covered


def _log_nonfinite_inputs(console: StepConsole, verdicts: list[Verdict], first_incident_step: int | None) -> None:
    """NaN/Inf in a checked call's inputs came before the call: from the data (an overflow, a bad
    batch), or — once an SDC was confirmed and its corruption let through (a `warn` policy) — from
    that corruption spreading. Not judged again either way: one console line per step that had any,
    naming the sites — the store has every one."""
    by_step: dict[int, list[str]] = {}
    for verdict in verdicts:
        if verdict.kind is VerdictKind.NONFINITE_INPUT:
            by_step.setdefault(verdict.step, []).append(verdict.site.name)
    for step, names in sorted(by_step.items()):
        sites = list(dict.fromkeys(names))
        shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
        if first_incident_step is not None and first_incident_step <= step:
            source = (f"after the confirmed SDC of step {first_incident_step}, likely its corruption spreading "
                      "(not judged again)")  # fmt: skip
        else:
            source = "from the data, not the device (not an SDC)"
        console.emit(logging.WARNING, f"step {step}: NaN/Inf in the inputs of {len(names)} checked "
                                      f"call{'' if len(names) == 1 else 's'}, or overflowing in them, at {shown} "
                                      f"— {source}")  # fmt: skip
