"""The step's record: everything one step end learned, committed to the store in one transaction.

Per step: the sites first seen, events, rank-outlier warnings (each rank's store keeps those naming
it), the step row (checks, alarms, verifications, backlog, and how many of the step's GEMM FLOPs were
checked), one statistics row per GEMM site that ran, the vTasks, verdicts, incidents and the injected
faults. A step with an incident commits durably (synchronous to disk) before any policy acts.

The writes run on a thread of their own (`StoreWriter`): the training thread builds the step's rows
and goes on. A step that has more than its step and statistics rows to write (new sites, events,
vTasks, verdicts, incidents, injected faults: rare) waits for its commit, so an incident is on disk
before the response acts and no object is read by the writer after the training thread moves on.
A process killed meanwhile loses at most the statistics rows of the steps still queued; one that
exits without `Guard.close()` is drained at exit.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis_sdc.distributed.outlier import OutlierWarning
from aegis_sdc.events import Incident, Verdict, VerdictKind, VTask
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.runtime.plan import GEMMS_PER_LINEAR
from aegis_sdc.runtime.sites import SiteRegistry
from aegis_sdc.store.sqlite import Store


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
    """Runs store writes in order on a daemon thread; `submit(..., wait=True)` returns once written.
    A write that failed is raised on the training thread at the next submit, `drain` or `close`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aegis-store-writer", daemon=True)
        self._thread.start()
        # A script that ends without `Guard.close()` still commits what it queued: at interpreter
        # exit the daemon thread is still running when atexit handlers run.
        atexit.register(self._finish_at_exit)

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                if write is None:
                    return
                if self._error is None:  # after a failure nothing more is written (the order would break)
                    write()
            except BaseException as error:  # handed to the training thread
                self._error = error
            finally:
                self._queue.task_done()

    def submit(self, write: Callable[[], None], *, wait: bool = False) -> None:
        self._raise_pending()
        if not self._thread.is_alive():  # closed: write here
            write()
            return
        self._queue.put(write)
        if wait:
            self.drain()

    def drain(self) -> None:
        """Wait until every submitted write is done."""
        if self._thread.is_alive():
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        atexit.unregister(self._finish_at_exit)
        self._raise_pending()

    def _finish_at_exit(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30.0)

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


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
        rare = bool(new_sites or report.events or report.warnings or report.alarms or report.verdicts
                    or report.incidents or len(self.injector.log) > self._injections_written)  # fmt: skip

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
                self._write_injections()

        self.writer.submit(write, wait=rare)
        return flops

    def close(self) -> None:
        """Every submitted write committed; the writer stopped (later writes run on the caller's thread)."""
        self.writer.close()

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
                    _finite(sensor.row.current), _finite(sensor.col.current) if sensor.col_check else None,
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

    def _write_injections(self) -> None:
        for injection in self.injector.log[self._injections_written :]:
            data = {"call": injection.call, "model": injection.fault.model}
            self.store.write_event(
                "fault_injected", f"{injection.fault.describe()} into {injection.site}", step=injection.step,
                site_id=self.registry.id_of(injection.site), data=data,
            )  # fmt: skip
        self._injections_written = len(self.injector.log)


def _finite(value: float) -> float | None:
    return value if value != float("inf") else None
