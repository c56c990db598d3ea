"""One guard's certified checkpoints and its rollback (the rules: response/checkpoints.py).

Each step end tells it what the step learned — the confirmed incidents (`note_incidents`), the steps
still waiting for a verdict and whether the replicas' vote has judged a state (`decide`) — and it
keeps every certificate of the run decided as far as that allows: written beside its checkpoint and
to the store at each change of status. The `rollback` policy asks it for
the latest certified state and restores it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aegis_sdc.events import Incident, RankIdentity, StateKind, Verdict, VerdictKind
from aegis_sdc.faults.injector import FaultInjector
from aegis_sdc.response.checkpoints import (
    CERTIFIED,
    PENDING,
    UNCERTIFIED,
    Certificate,
    CheckpointError,
    certificate_path,
    fingerprints,
    latest_certified,
    load_state,
    rng_states,
    save_state,
    set_rng_states,
    write_certificate,
)

log = logging.getLogger("aegis_sdc")
Event = tuple[str, str, int | None]  # (kind, message, site id): a line of the step's record


class Certification:
    """The run's certificates, the first state a confirmed SDC corrupted, and the rollback."""

    def __init__(
        self,
        model: nn.Module,
        identity: RankIdentity,
        run_dir: os.PathLike,
        injector: FaultInjector,
        submit: Callable[[Callable[[], None]], None],
        write_to_store: Callable[[Certificate], None],
        events: list[Event],
    ) -> None:
        self.model = model
        self.identity = identity
        self.run_dir = run_dir
        self.injector = injector
        self._submit = submit  # the store's writer thread: the certificate's row, off the training thread
        self._write_to_store = write_to_store
        self._events = events  # the guard's events for the next step record
        self.certificates: list[Certificate] = []
        self.corrupt_from: int | None = None  # the first state a confirmed SDC not rolled back corrupted
        self.vote_judged_step = -1  # the latest step whose state the replicas' vote judged
        # under data parallelism, what the step exchange brought of every rank (`peers_known`): the
        # latest step exchanged, and the oldest step some rank still has a vTask of unverified
        self.exchanged_through = -1
        self.peers_pending_from: int | None = None
        self.rolled_back_to: int | None = None  # set by a rollback: the next step to run
        self.rollbacks = 0
        self.on_rollback: Callable[[int, Any], None] | None = None
        self.restore: Callable[[str], Any] | None = None  # loads a checkpoint the caller certified

    # -- certifying ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, step: int, optimizer: torch.optim.Optimizer | None, extra: Any) -> dict:
        """Write the model, the optimizer, the RNG states, `step` and `extra` to `path` atomically;
        returns the saved state (for `add`)."""
        # a certificate describes one file: the old one goes before the file is replaced (a kill in
        # between leaves a checkpoint without a certificate, never one with another file's)
        certificate_path(path).unlink(missing_ok=True)
        state = {"model": self.model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None,
                 "rng": rng_states(), "step": step, "extra": extra}  # fmt: skip
        save_state(path, state)
        return state

    def add(self, path: str | os.PathLike, step: int, state: Any, saved_by: str) -> Certificate:
        """A new pending certificate of `state` saved at `path` at `step`; decided by the next `decide`."""
        certificate = Certificate(path=str(path), step=step, status=PENDING, reason="", verified_through=-1,
                                  fingerprints=fingerprints(state), identity=self.identity.to_dict(),
                                  run_dir=str(self.run_dir), saved_by=saved_by)  # fmt: skip
        self.certificates.append(certificate)
        return certificate

    def note_incidents(self, incidents: list[Incident], verdicts: list[Verdict]) -> None:
        """The first state a confirmed SDC corrupts: a state vote's finding names the state itself; a
        step's computation (its update lands unless a policy holds it back) the state after it."""
        steps = [(i.step if i.site.kind in (StateKind.PARAM, StateKind.OPTIMIZER_STATE) else i.step + 1)
                 for i in incidents]  # fmt: skip
        steps += [v.step + 1 for v in verdicts if v.kind is VerdictKind.UNATTRIBUTED]
        if steps:
            first = min(steps)
            self.corrupt_from = first if self.corrupt_from is None else min(self.corrupt_from, first)

    def peers_known(self, step: int, corrupt_from: int | None, pending_from: int | None) -> None:
        """The step exchange of `step` (data parallelism): the first state a confirmed SDC on any rank
        corrupted and the oldest step any rank has a vTask of unverified (None: none). A corrupted
        update reaches every replica through the all-reduced gradients, so one rank's incident
        withholds every rank's certificates of the states after it."""
        if corrupt_from is not None:
            self.corrupt_from = corrupt_from if self.corrupt_from is None else min(self.corrupt_from, corrupt_from)
        self.peers_pending_from = pending_from
        self.exchanged_through = max(self.exchanged_through, step)

    def decide(self, pending_steps: list[int], *, voting: bool, final: bool, only: int | None = None,
               ranks: bool = False) -> None:  # fmt: skip
        """Decide what can be decided of the pending certificates (and withdraw a certified one an
        incident found later makes unsafe). `pending_steps`: the steps of the vTasks not verified yet;
        `voting`: the replicas vote on their state, so a state is certified only once its vote was
        judged; `ranks`: under data parallelism a state of step s is certified only once the step
        exchange of step s has told every rank's incidents and unverified vTasks of the steps before
        it (`peers_known`); `final`: at close, what is still pending is uncertified."""
        if ranks and self.peers_pending_from is not None:
            pending_steps = [*pending_steps, self.peers_pending_from]
        indices = range(len(self.certificates)) if only is None else [only]
        for i in indices:
            c = self.certificates[i]
            if c.status == UNCERTIFIED:
                continue
            unverified = sum(step < c.step for step in pending_steps)
            verified_through = min([step for step in pending_steps if step < c.step], default=c.step) - 1
            if self.corrupt_from is not None and self.corrupt_from <= c.step:
                decided = c.decided(UNCERTIFIED, f"a confirmed SDC corrupted the state from step {self.corrupt_from} "
                                    "on, before this checkpoint", verified_through)  # fmt: skip
            elif c.status == CERTIFIED:
                continue
            elif unverified:
                reason = f"{unverified} vTask(s) of earlier steps not verified yet"
                decided = c.decided(UNCERTIFIED if final else PENDING, reason, verified_through)
            elif ranks and self.exchanged_through < c.step:
                when = "were never exchanged" if final else f"are exchanged at the end of step {c.step}"
                reason = f"the other ranks' verdicts on the steps before this state {when}"
                decided = c.decided(UNCERTIFIED if final else PENDING, reason, verified_through)
            elif voting and self.vote_judged_step < c.step:
                when = "was never judged" if final else f"is judged at the end of step {c.step + 1}"
                reason = f"the replicas' vote on this state {when}"
                decided = c.decided(UNCERTIFIED if final else PENDING, reason, verified_through)
            else:
                decided = c.decided(CERTIFIED, "", verified_through)
            if (decided.status, decided.reason) != (c.status, c.reason) or c.decided_wall is None:
                self.certificates[i] = decided
                self._write(decided)

    def _write(self, certificate: Certificate) -> None:
        """Beside the checkpoint and in the store; a failure is logged, never raised (docs/operations.md)."""
        try:
            write_certificate(certificate)
        except OSError as error:
            log.error("aegis-sdc: the certificate of %s cannot be written: %s", certificate.path, error)
        self._submit(lambda: self._write_to_store(certificate))
        if certificate.status != PENDING:
            log.info("aegis-sdc: checkpoint %s (step %d): %s%s", certificate.path, certificate.step,
                     certificate.status, f" — {certificate.reason}" if certificate.reason else "")  # fmt: skip

    def _withdraw(self, certificate: Certificate, reason: str) -> None:
        i = next(i for i, c in enumerate(self.certificates) if c is certificate)
        self.certificates[i] = certificate.decided(UNCERTIFIED, reason, certificate.verified_through)
        self._write(self.certificates[i])
        log.error("aegis-sdc: checkpoint %s: %s", certificate.path, reason)

    # -- rolling back -------------------------------------------------------------------------------
    def rollback(self, step: int, optimizer: torch.optim.Optimizer | None) -> bool:
        """Restore the latest certified checkpoint at `step` (the step that confirmed an SDC; decide
        first, so that the incident just noted withdraws what it corrupts). False when there is none
        the guard can restore: its own `save_checkpoint` files, or the caller's with a `restore`."""
        while True:
            usable = [c for c in self.certificates if c.saved_by == "aegis" or self.restore is not None]
            certificate = latest_certified(usable)
            if certificate is None:
                return False
            if certificate.saved_by != "aegis":
                extra = self.restore(certificate.path)
                break
            try:  # read and checked against its certificate before anything is loaded
                state = load_state(certificate.path)
            except CheckpointError as error:  # damaged since: withdrawn, and the one before is tried
                self._withdraw(certificate, f"unreadable when a rollback needed it: {error}")
                continue
            self.model.load_state_dict(state["model"])
            if optimizer is not None and state["optimizer"] is not None:
                optimizer.load_state_dict(state["optimizer"])
            set_rng_states(state["rng"])
            extra = state.get("extra")
            break
        if optimizer is not None:
            for group in optimizer.param_groups:  # the step in flight must not apply its update
                for param in group["params"]:
                    param.grad = None
        # transient faults of the steps about to run again struck once; the state is clean again
        self.injector.reexecuted_below = max(self.injector.reexecuted_below, step + 1)
        self.corrupt_from = None
        self.rolled_back_to = certificate.step
        self.rollbacks += 1
        self._events.append(("rollback", f"rolled back to {certificate.path} (step {certificate.step}) "
                             f"after a confirmed SDC at step {step}", None))  # fmt: skip
        log.warning("aegis-sdc: rolled back to the certified checkpoint %s (step %d)", certificate.path,
                    certificate.step)  # fmt: skip
        if self.on_rollback is not None:
            self.on_rollback(certificate.step, extra)
        return True
