"""The step's record: everything one step end learned, committed to the store in one transaction.

Per step: the sites first seen, events, rank-outlier warnings (each rank's store keeps those naming
it), the step row (checks, alarms, verifications, backlog, and how many of the step's GEMM FLOPs were
checked), one statistics row per GEMM site that ran, the vTasks, verdicts, incidents and the injected
faults. A step with an incident commits durably (synchronous to disk) before any policy acts.

The writes run on a thread of their own (`StoreWriter`): the training thread builds the step's rows
and goes on. A step that has more than its step and statistics rows to write (new sites, events,
vTasks, verdicts, incidents, injected faults: rare) waits for its commit, so an incident is on disk
before the response acts. A process killed meanwhile loses at most the statistics rows of the steps
still queued; one that exits without `Guard.close()` is drained at exit. A store that fails (a full
disk) holds nothing up: the writes wait in memory and are retried (`StoreWriter`), reading only
what they were given (frozen records, rows built here), and the response still acts.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis_sdc.distributed.outlier import OutlierWarning
from aegis_sdc.events import Incident, Verdict, VerdictKind, VTask
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.runtime.plan import GEMMS_PER_LINEAR
from aegis_sdc.runtime.sites import SiteRegistry
from aegis_sdc.store.sqlite import Store

log = logging.getLogger("aegis_sdc")


@dataclass
class StepReport:
    """What one step end (or flush) found and did."""

    step: int
    checks: int = 0
    alarms: list[VTask] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    warnings: list[OutlierWarning] = field(default_factory=list)
    events: list[tuple[str, str, int | None]] = field(default_factory=list)  # (kind, message, site id)
    verify_ms: float = 0.0


@dataclass(frozen=True)
class StepFlops:
    total: float  # 2·M·N·K over every GEMM call of the step
    checked: float  # over the checked ones


class StoreWriter:
    """Runs store writes in order on a daemon thread; `submit(..., wait=True)` returns once the write
    was tried (`drain`).

    A write that fails — a full disk, an I/O error, a store made read-only — never reaches the
    training thread. It waits in memory with every write after it, in order, and they are tried
    again (at most every `RETRY_S`, and at `drain` and `close`) until the store takes them; each
    write is one transaction, rolled back whole when it fails, so a retry starts clean. The failure
    is logged when it starts, every 100 failures, and when the store recovers. Memory stays bounded:
    past `MAX_WAITING` waiting writes the oldest that hold only step statistics are dropped and
    counted (`dropped`); writes holding incidents, verdicts, vTasks, sites or events are kept.
    """

    RETRY_S = 1.0
    MAX_WAITING = 10_000

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: queue.Queue[tuple[Callable[[], None], bool] | None] = queue.Queue()
        self._waiting: deque[tuple[Callable[[], None], bool]] = deque()  # failed and after, in order
        self._next_retry = 0.0
        self.failures = 0  # attempts that failed
        self.dropped = 0  # statistics-only writes let go while the store failed
        self._thread = threading.Thread(target=self._run, name="aegis-store-writer", daemon=True)
        self._thread.start()
        # A script that ends without `Guard.close()` still commits what it queued: at interpreter
        # exit the daemon thread is still running when atexit handlers run.
        atexit.register(self._finish_at_exit)

    @property
    def waiting(self) -> int:
        """Writes the store has not taken yet (it failed)."""
        return len(self._waiting)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._add(item)
                self._write_waiting(force=False)
            finally:
                self._queue.task_done()

    def _add(self, item: tuple[Callable[[], None], bool]) -> None:
        self._waiting.append(item)
        if len(self._waiting) > self.MAX_WAITING:
            for index, (_, essential) in enumerate(self._waiting):
                if not essential:
                    del self._waiting[index]
                    self.dropped += 1
                    break

    def _write_waiting(self, *, force: bool) -> None:
        """Write the waiting writes in order, stopping at the first failure (kept for a retry)."""
        if len(self._waiting) > 1 and not force and time.monotonic() < self._next_retry:
            return  # the store failed a moment ago: the new write waits behind the older ones
        while self._waiting:
            write, _ = self._waiting[0]
            try:
                write()
            except Exception as error:
                self.failures += 1
                self._next_retry = time.monotonic() + self.RETRY_S
                if self.failures == 1 or self.failures % 100 == 0:
                    log.error("aegis-sdc: the store %s cannot be written (%s); %d step record(s) wait in "
                              "memory and are retried — training goes on", self.store.path, error,
                              len(self._waiting))  # fmt: skip
                return
            self._waiting.popleft()
            if self.failures and not self._waiting:
                log.warning("aegis-sdc: the store %s is written again: nothing waits (%d attempts had "
                            "failed, %d statistics-only records dropped)", self.store.path, self.failures,
                            self.dropped)  # fmt: skip
                self.failures = 0

    def submit(self, write: Callable[[], None], *, wait: bool = False, essential: bool = True) -> None:
        """Queue `write`; `essential` writes are never dropped (see the class docstring)."""
        if not self._thread.is_alive():  # closed: write here
            self._add((write, essential))
            self._write_waiting(force=True)
            return
        self._queue.put((write, essential))
        if wait:
            self.drain()

    def drain(self) -> None:
        """Wait until every submitted write was tried."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Stop the thread and try what still waits, once more, here."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        atexit.unregister(self._finish_at_exit)
        self._write_waiting(force=True)

    def _finish_at_exit(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30.0)
        self._write_waiting(force=True)
        if self._waiting:
            log.error("aegis-sdc: %d step record(s) could not be written to %s before exit",
                      len(self._waiting), self.store.path)  # fmt: skip


class StepRecorder:
    def __init__(self, store: Store, registry: SiteRegistry, injector: FaultInjector, rank: int) -> None:
        self.store = store
        self.registry = registry
        self.injector = injector
        self.rank = rank
        self._injections_written = 0
        self.writer = StoreWriter(store)

    def record(self, report: StepReport, calls: list[int], *, backlog: int) -> StepFlops:
        """Commit `report`; `calls` are the calls of each Linear in the step (checked or not)."""
        step_row, stats_rows, flops = self._gemm_site_rows(report, calls, backlog)
        new_sites = self.registry.take_unwritten()
        # taken here, not in the write: a write may run again after a failure
        injections = self.injector.log.since(self._injections_written)
        self._injections_written = self.injector.log.total
        rare = bool(new_sites or report.events or report.warnings or report.alarms or report.verdicts
                    or report.incidents or injections)  # fmt: skip

        def write() -> None:
            store = self.store
            with store.transaction(durable=bool(report.incidents)):
                if new_sites:
                    store.write_sites(new_sites)
                for kind, message, site_id in report.events:
                    store.write_event(kind, message, step=report.step, site_id=site_id)
                for warning in report.warnings:
                    if warning.store_rank == self.rank:
                        store.write_event("rank_outlier", warning.describe(), step=warning.step,
                                          site_id=warning.site.id, data=warning.to_dict())  # fmt: skip
                store.write_step(report.step, **step_row)
                store.write_step_stats(stats_rows)
                for task in report.alarms:
                    store.write_vtask(task)
                for verdict in report.verdicts:
                    self._write_verdict(verdict, report.step)
                for incident in report.incidents:
                    store.write_incident(incident)
                self._write_injections(injections)

        self.writer.submit(write, wait=rare, essential=rare)
        return flops

    def close(self, summary: dict | None = None) -> None:
        """Every submitted write tried (and `summary`, the run's, written last); the writer stopped.
        What the store still refuses is logged as lost, never raised."""
        if summary is not None:
            self.writer.submit(lambda: self.store.finish_run(summary))
        self.writer.close()
        if self.writer.waiting:
            log.error("aegis-sdc: %d record(s) could not be written to %s and are lost (the incidents among "
                      "them were logged above)", self.writer.waiting, self.store.path)  # fmt: skip

    def _gemm_site_rows(self, report: StepReport, calls: list[int], backlog: int) -> tuple[dict, list, StepFlops]:
        rows = []
        total = checked = 0.0
        for sensor in self.registry.gemm:
            st = sensor.take_step_stats()
            st.calls = calls[sensor.site.id // GEMMS_PER_LINEAR]
            total += st.calls * sensor.flops
            checked += st.checks * sensor.flops
            if st.calls:
                rows.append((
                    report.step, sensor.site.id, st.calls, st.checks, st.alarms, st.faults, st.nonfinite,
                    st.max_row if st.checks else None, st.max_col if st.checks and sensor.col_check else None,
                    _finite(sensor.row.current if st.row_limit is None else st.row_limit),
                    _finite(sensor.col.current if st.col_limit is None else st.col_limit) if sensor.col_check else None,
                    int(sensor.row.calibrating),
                ))  # fmt: skip
        step_row = dict(checks=report.checks, alarms=len(report.alarms), verified=len(report.verdicts),
                        backlog=backlog, verify_ms=report.verify_ms, gemm_flops=total,
                        checked_flops=checked)  # fmt: skip
        return step_row, rows, StepFlops(total, checked)

    def _write_verdict(self, verdict: Verdict, step: int) -> None:
        store = self.store
        store.write_verdict(verdict, step)
        if verdict.kind is VerdictKind.UNATTRIBUTED:
            store.write_event("unattributed_sdc", f"{verdict.site.name}: {verdict.detail}",
                              step=verdict.step, site_id=verdict.site.id)  # fmt: skip
        if verdict.kind is VerdictKind.NONFINITE_INPUT:
            store.write_event("nonfinite_input", f"NaN/Inf in the inputs of {verdict.site.name}: reported, not an SDC",
                              step=verdict.step, site_id=verdict.site.id)  # fmt: skip

    def _write_injections(self, injections: list) -> None:
        for injection in injections:
            data = {"call": injection.call, "model": injection.fault.model}
            self.store.write_event(
                "fault_injected", f"{injection.fault.describe()} into {injection.site}", step=injection.step,
                site_id=self.registry.id_of(injection.site), data=data,
            )  # fmt: skip


def _finite(value: float) -> float | None:
    return value if value != float("inf") else None
