"""What the guard does with a confirmed SDC once its incident is committed to the store."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence

from aegis_sdc.config import ResponseConfig
from aegis_sdc.events import Incident
from aegis_sdc.response.quarantine import append_quarantine

log = logging.getLogger("aegis_sdc")


class SilentDataCorruptionError(RuntimeError):
    """Raised by the ``raise`` policy; `incident` is the first confirmed incident, `incidents` all of the step."""

    def __init__(self, incidents: Sequence[Incident]) -> None:
        self.incidents = tuple(incidents)
        self.incident = self.incidents[0]
        more = f" (and {len(self.incidents) - 1} more this step)" if len(self.incidents) > 1 else ""
        super().__init__(self.incident.describe() + more)


class SilentDataCorruptionWarning(UserWarning):
    """Emitted by the ``warn`` and ``skip-step`` policies."""


def quarantine_entry(incident: Incident) -> dict:
    who = incident.identity
    wrong = incident.verdict.wrong_execution
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(incident.created_wall)),
        "host": who.host,
        "rank": who.rank,
        "local_rank": who.local_rank,
        "device": who.device,
        "gpu_uuid": who.gpu_uuid,
        "site": incident.site.name,
        "step": incident.step,
        "incident_id": incident.id,
        "reason": f"confirmed SDC (wrong execution: {wrong.value if wrong else '?'})",
    }


class Responder:
    def __init__(self, config: ResponseConfig, quarantine_path: str | None) -> None:
        self.config = config
        self.quarantine_path = quarantine_path
        self._quarantined: set[tuple[str, str]] = set()

    def respond(self, incidents: Sequence[Incident], optimizer=None) -> None:
        if not incidents:
            return
        if self.config.quarantine and self.quarantine_path:
            fresh = []
            for incident in incidents:
                key = (incident.identity.host, incident.identity.gpu_uuid or incident.identity.device)
                if key not in self._quarantined:  # one entry per device per process
                    self._quarantined.add(key)
                    fresh.append(quarantine_entry(incident))
            append_quarantine(self.quarantine_path, fresh)
        for incident in incidents:
            log.error("aegis-sdc: %s", incident.describe())
        policy = self.config.policy
        if policy == "raise":
            raise SilentDataCorruptionError(incidents)
        if policy == "exit":
            raise SystemExit(self.config.exit_code)
        for incident in incidents:
            warnings.warn(incident.describe(), SilentDataCorruptionWarning, stacklevel=4)
        if policy == "skip-step" and optimizer is not None:
            # Optimizers skip parameters whose .grad is None: this step's corrupted update is dropped.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
