"""What the guard does with a confirmed SDC once its incident is committed to the store."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

from aegis_sdc.config import ResponseConfig
from aegis_sdc.events import Incident, Verdict
from aegis_sdc.response.console import RateLimiter
from aegis_sdc.response.quarantine import append_quarantine, device_key, quarantine_entry, read_quarantine

log = logging.getLogger("aegis_sdc")


class SilentDataCorruptionError(RuntimeError):
    """Raised by the ``raise`` policy; `incident` is the first confirmed incident (None when only
    corruptions no device could be blamed for were proven: `unattributed`), `incidents` all of the step."""

    def __init__(self, incidents: Sequence[Incident], unattributed: Sequence[Verdict] = (), why: str = "") -> None:
        self.incidents = tuple(incidents)
        self.unattributed = tuple(unattributed)
        self.incident = self.incidents[0] if self.incidents else None
        messages = [i.describe() for i in self.incidents] + [describe_unattributed(v) for v in self.unattributed]
        more = f" (and {len(messages) - 1} more this step)" if len(messages) > 1 else ""
        super().__init__(messages[0] + more + (f"; {why}" if why else ""))


def describe_unattributed(verdict: Verdict) -> str:
    return f"corruption proven at {verdict.site.name}, step {verdict.step}, no device named: {verdict.detail}"


class SilentDataCorruptionWarning(UserWarning):
    """Emitted by the ``warn`` and ``skip-step`` policies."""


class Responder:
    """Applies the response policy to a step's confirmed incidents. The quarantine list is written
    first; when it cannot be (disk full, no permission, a link in the way), its entries wait here,
    are logged, and are written again at every later step and at close — the policy still acts."""

    def __init__(self, config: ResponseConfig, quarantine_path: str | None) -> None:
        self.config = config
        self.quarantine_path = quarantine_path
        self._quarantined: set[tuple[str, str]] = set()
        self.pending_quarantine: list[dict] = []  # entries not yet written (the list failed)
        self.quarantine_failures = 0
        self.dropped_updates = 0  # updates `skip-step` dropped (the replica vote must know)
        # the `rollback` policy's action (the guard's): restores a certified checkpoint, False if none
        self.rollback: Callable[[Sequence[Incident]], bool] | None = None
        self._warning_limit = RateLimiter()  # SilentDataCorruptionWarning: one per step, rate-limited

    def adopt_list(self) -> None:
        """Take the devices the list already names as listed (a restarted run names none twice)."""
        if not (self.config.quarantine and self.quarantine_path):
            return
        try:
            self._quarantined.update(device_key(entry) for entry in read_quarantine(self.quarantine_path))
        except OSError as error:  # unreadable now: writing it will be tried (and logged) as always
            log.error("aegis-sdc: the quarantine list %s cannot be read: %s", self.quarantine_path, error)

    def quarantine(self, entries: Sequence[dict]) -> None:
        """Queue entries for the list (one per device per process) and write what is queued."""
        if not (self.config.quarantine and self.quarantine_path):
            return
        for entry in entries:
            key = device_key(entry)
            if key not in self._quarantined:
                self._quarantined.add(key)
                self.pending_quarantine.append(entry)
        self.retry_quarantine()

    def retry_quarantine(self) -> bool:
        """Write the queued entries; True when nothing is left queued. Never raises for a write that
        fails: the entries stay queued and the failure is logged (the incidents are in the store)."""
        if not self.pending_quarantine:
            return True
        try:
            append_quarantine(self.quarantine_path, self.pending_quarantine)
        except OSError as error:
            self.quarantine_failures += 1
            if self.quarantine_failures == 1 or self.quarantine_failures % 100 == 0:
                log.error("aegis-sdc: the quarantine list %s cannot be written (%s); %d device(s) wait to be "
                          "listed and are retried every step — their incidents are in the store",
                          self.quarantine_path, error, len(self.pending_quarantine))  # fmt: skip
            return False
        self.pending_quarantine = []
        return True

    def respond(self, incidents: Sequence[Incident], optimizer=None, unattributed: Sequence[Verdict] = (),
                *, stopping: bool = True) -> None:  # fmt: skip
        """Apply the policy to the step's incidents. Corruptions proven but pinned on no device
        (`unattributed`) get the same policy for the step — the update they feed is corrupted —
        but quarantine no device. `stopping=False` (an exception of the user's already in flight)
        keeps `raise` and `exit` from replacing it: the caller reports the incidents instead."""
        self.retry_quarantine()
        if not incidents and not unattributed:
            return
        self.quarantine([quarantine_entry(i.to_dict()) for i in incidents])
        messages = [i.describe() for i in incidents] + [describe_unattributed(v) for v in unattributed]
        policy = self.config.policy
        rolled_back = policy == "rollback" and stopping and self.rollback is not None and self.rollback(incidents)
        if policy == "rollback" and stopping and not rolled_back:
            raise SilentDataCorruptionError(incidents, unattributed, "no certified checkpoint to roll back to")
        if policy == "raise" and stopping:
            raise SilentDataCorruptionError(incidents, unattributed)
        if policy == "exit" and stopping:
            raise SystemExit(self.config.exit_code)
        if self._warning_limit.allow():
            more = f" (and {len(messages) - 1} more this step)" if len(messages) > 1 else ""
            warnings.warn(messages[0] + more + self._warning_limit.take_suppressed(), SilentDataCorruptionWarning,
                          stacklevel=4)  # fmt: skip
        if policy == "skip-step" and optimizer is not None:
            # Optimizers skip parameters whose .grad is None: this step's corrupted update is dropped.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self.dropped_updates += 1  # this replica now differs from its peers by design
