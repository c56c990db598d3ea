"""Prometheus metrics of a guard (the `prometheus` extra: prometheus-client).

    from aegis_sdc.integrations.metrics import GuardMetrics
    metrics = GuardMetrics(guard)                  # its own registry, labelled with the rank
    metrics.serve(9400)                            # an HTTP endpoint for Prometheus to scrape, or
    metrics.write_textfile("/var/lib/node_exporter/aegis.prom")  # for node_exporter's textfile collector

Updated at every step end from the guard's events (a listener: no work on the hot path):

| metric | type | meaning |
|---|---|---|
| `aegis_steps_total` | counter | steps ended |
| `aegis_checks_total` | counter | checked GEMM calls |
| `aegis_alarms_total` | counter | checks over their threshold (vTasks) |
| `aegis_verdicts_total{kind}` | counter | verdicts by kind (`confirmed_sdc`, `false_alarm`, …) |
| `aegis_confirmed_sdc_total` | counter | confirmed silent data corruptions |
| `aegis_verification_backlog` | gauge | vTasks waiting for verification |
| `aegis_verification_ms` | gauge | the last step end's verification time |
| `aegis_max_verification_latency_steps` | gauge | the largest latency so far, in steps |
| `aegis_checked_flops_fraction` | gauge | the last step's checked share of its GEMM FLOPs |
| `aegis_host_wait_ms_total` | counter | the host's time waiting for evidence |

Every metric carries the labels `rank` and `host`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server, write_to_textfile


class GuardMetrics:
    def __init__(self, guard: Any, registry: CollectorRegistry | None = None) -> None:
        self.guard = guard
        self.registry = registry or CollectorRegistry()
        self.labels = {"rank": str(guard.identity.rank), "host": guard.identity.host}
        names = list(self.labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, names + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry)

        self.steps = counter("aegis_steps", "steps ended")
        self.checks = counter("aegis_checks", "checked GEMM calls")
        self.alarms = counter("aegis_alarms", "checks over their threshold (vTasks)")
        self.verdicts = counter("aegis_verdicts", "verdicts by kind", ("kind",))
        self.confirmed = counter("aegis_confirmed_sdc", "confirmed silent data corruptions")
        self.host_wait = counter("aegis_host_wait_ms", "the host's time waiting for evidence (ms)")
        self.backlog = gauge("aegis_verification_backlog", "vTasks waiting for verification")
        self.verify_ms = gauge("aegis_verification_ms", "the last step end's verification time (ms)")
        self.latency = gauge("aegis_max_verification_latency_steps", "the largest verification latency (steps)")
        self.checked = gauge("aegis_checked_flops_fraction", "the last step's checked share of its GEMM FLOPs")
        self._host_wait_seen = 0.0
        guard.subscribe(self._on_event)

    def _on_event(self, event: str, payload: Any) -> None:
        if event != "step":
            return
        report, labels, guard = payload, self.labels, self.guard
        self.steps.labels(**labels).inc()
        self.checks.labels(**labels).inc(report.checks)
        self.alarms.labels(**labels).inc(len(report.alarms))
        for verdict in report.verdicts:
            self.verdicts.labels(**labels, kind=verdict.kind.value).inc()
        self.confirmed.labels(**labels).inc(len(report.incidents))
        self.host_wait.labels(**labels).inc(max(0.0, guard.host_wait_ms - self._host_wait_seen))
        self._host_wait_seen = guard.host_wait_ms
        telemetry = guard.verifier.telemetry
        self.backlog.labels(**labels).set(guard.verifier.backlog)
        self.verify_ms.labels(**labels).set(report.verify_ms)
        self.latency.labels(**labels).set(telemetry.max_latency_steps)
        self.checked.labels(**labels).set(guard.last_checked_flops_fraction)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve the metrics over HTTP for Prometheus to scrape (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)

    def write_textfile(self, path: str) -> None:
        """Write the metrics in the text format (atomically), for node_exporter's textfile collector."""
        write_to_textfile(path, self.registry)
