"""What the guard does with a confirmed SDC once its incident is committed to the store."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence

from aegis_sdc.config import ResponseConfig
from aegis_sdc.events import Incident, Verdict
from aegis_sdc.response.quarantine import append_quarantine

log = logging.getLogger("aegis_sdc")


class SilentDataCorruptionError(RuntimeError):
    """Raised by the ``raise`` policy; `incident` is the first confirmed incident (None when only
    corruptions no device could be blamed for were proven: `unattributed`), `incidents` all of the step."""

    def __init__(self, incidents: Sequence[Incident], unattributed: Sequence[Verdict] = ()) -> None:
        self.incidents = tuple(incidents)
        self.unattributed = tuple(unattributed)
        self.incident = self.incidents[0] if self.incidents else None
        messages = [i.describe() for i in self.incidents] + [describe_unattributed(v) for v in self.unattributed]
        more = f" (and {len(messages) - 1} more this step)" if len(messages) > 1 else ""
        super().__init__(messages[0] + more)


def describe_unattributed(verdict: Verdict) -> str:
    return f"corruption proven at {verdict.site.name}, step {verdict.step}, no device named: {verdict.detail}"


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
        self.dropped_updates = 0  # updates `skip-step` dropped (the replica vote must know)

    def respond(self, incidents: Sequence[Incident], optimizer=None, unattributed: Sequence[Verdict] = ()) -> None:
        """Apply the policy to the step's incidents. Corruptions proven but pinned on no device
        (`unattributed`) get the same policy for the step — the update they feed is corrupted —
        but quarantine no device."""
        if not incidents and not unattributed:
            return
        if incidents and self.config.quarantine and self.quarantine_path:
            fresh = []
            for incident in incidents:
                key = (incident.identity.host, incident.identity.gpu_uuid or incident.identity.device)
                if key not in self._quarantined:  # one entry per device per process
                    self._quarantined.add(key)
                    fresh.append(quarantine_entry(incident))
            append_quarantine(self.quarantine_path, fresh)
        messages = [i.describe() for i in incidents] + [describe_unattributed(v) for v in unattributed]
        for message in messages:
            log.error("aegis-sdc: %s", message)
        policy = self.config.policy
        if policy == "raise":
            raise SilentDataCorruptionError(incidents, unattributed)
        if policy == "exit":
            raise SystemExit(self.config.exit_code)
        for message in messages:
            warnings.warn(message, SilentDataCorruptionWarning, stacklevel=4)
        if policy == "skip-step" and optimizer is not None:
            # Optimizers skip parameters whose .grad is None: this step's corrupted update is dropped.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self.dropped_updates += 1  # this replica now differs from its peers by design
