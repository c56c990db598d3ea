"""The coverage report: which fault locations each enabled sensor covers, at what sampling, down to
what size — computed from the guard's configuration and the model, before any fault is injected —
and the rule a campaign's trial is judged by: inside the claim, a fault that changes training must
be confirmed.

Claims, and why they hold:

- **GEMM accumulators** (the row checksum, then a bit-exact replay): a fault of size |δ| in row i's
  checksum unit u·s_i (`Injection.size`) larger than **twice the row threshold T** in force alarms —
  a clean call keeps every row's difference under T·u·s_i (else it alarms itself), so the faulted
  row's difference exceeds (2T − T)·u·s_i = T·u·s_i — and the replay, which does not reproduce a
  transient fault, confirms it. Smaller faults are below the stated sensitivity (they may alarm).
  Sampled calls only: the claim's sampling is the configured probability.
- **Saved tensors** (fingerprints when saved and when used): any change to a saved tensor's words is
  seen (for a fixed position the fingerprint's lanes are bijections of the word, docs/fingerprints.md),
  on the steps the saved-tensor check samples.
- **Recomputed segments** (forward against recomputation): any change in the segment's output, for
  segments found deterministic.
- **Element-wise ops inside a checkpointed segment** (a norm, the activation, the residual add,
  through the recompute check): a
  corruption that changes the segment's output — and only through that output can a forward value of
  a checkpointed segment reach training, its backward using recomputed values.
- **The optimizer's update** (the update replay): any change of an updated parameter whose slice is
  replayed at that step.
- **Attention stages**: measured, not claimed — each stage's detection against its size is what the
  campaign reports; no size bound is derived for the invariants yet.
- **Weights and optimizer state at rest**: covered only by the replica vote, which needs replicas;
  in one process they are not covered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from aegis_sdc.campaign.trials import ATTENTION_STAGES, GEMM_LOCATIONS, LOCATIONS, Trial
from aegis_sdc.faults.injector import Injection

GEMM_MARGIN = 2.0  # a GEMM fault is claimed above this many thresholds (see the module docstring)


@dataclass(frozen=True)
class Claim:
    """What the configuration claims for one fault location."""

    location: str
    sensor: str  # the sensor that covers it ("" where nothing does)
    sampling: float  # the probability that a fault there is checked
    sensitivity: str  # down to what the claim goes, in words
    claimed: bool  # whether a miss there fails the campaign

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def coverage_report(guard) -> dict[str, Claim]:
    """Claims per location for a protected model (`guard` after its first step: the saved and
    recompute sites exist)."""
    config = guard.config
    p = 1.0 if config.sampling.probability is None else config.sampling.probability
    fp = config.fingerprints
    saved = fp.saved_probability if fp.saved_tensors else 0.0
    recompute = fp.recompute_probability if fp.recompute else 0.0
    replicas = guard.state_vote is not None
    replay = guard.update_replay
    replay_rate = 0.0 if replay is None or replay.uncovered else 1.0 / (replay.slices * replay.every)
    claims = {}
    for location in GEMM_LOCATIONS:
        size = f"|δ| > {GEMM_MARGIN:g} × the row threshold, in the row's checksum unit"
        claims[location] = Claim(location, "GEMM row checksum + replay", p, size, p > 0)
    for location in ATTENTION_STAGES:
        checked = bool(guard.attention_sensors) and not guard.uncovered.attention
        claims[location] = Claim(location, "attention invariants + replay" if checked else "", p if checked else 0.0,
                                 "measured, not claimed: no size bound derived for the invariants", False)  # fmt: skip
    claims["saved"] = Claim("saved", "saved-tensor fingerprints", saved, "any change of a saved tensor's words",
                            saved > 0)  # fmt: skip
    claims["recompute"] = Claim("recompute", "recompute fingerprints", recompute,
                                "any change of a deterministic segment's output", recompute > 0)  # fmt: skip
    claims["elementwise"] = Claim("elementwise", "recompute fingerprints (the segment's output)", recompute,
                                  "inside a checkpointed segment: any change of the segment's output; outside: none",
                                  recompute > 0)  # fmt: skip
    claims["optimizer_update"] = Claim("optimizer_update", "update replay" if replay_rate else "", replay_rate,
                                       "any change of an updated parameter in the replayed slice",
                                       replay_rate > 0)  # fmt: skip
    for location in ("optimizer_state", "weights"):
        claims[location] = Claim(location, "replica vote" if replicas else "", 1.0 if replicas else 0.0,
                                 "any change, where replicas vote" if replicas else "not covered without replicas",
                                 replicas)  # fmt: skip
    assert set(claims) == set(LOCATIONS)
    return claims


def segment_of(module: str, recompute_sites: tuple[str, ...]) -> str | None:
    """The checkpointed segment (its `:recompute` site) a module runs in, if any."""
    for site in recompute_sites:
        segment = site.removesuffix(":recompute")
        if module == segment or module.startswith(segment + "."):
            return site
    return None


def inside(trial: Trial, claims: dict[str, Claim], injections: list[Injection], affected: bool,
           recompute_sites: tuple[str, ...]) -> bool:  # fmt: skip
    """Whether the trial's fault lies inside the claimed coverage (a miss there fails the campaign).
    Only faults that changed training count: one that changed nothing has nothing to be caught."""
    claim = claims[trial.location]
    if not claim.claimed or not affected:
        return False
    if trial.location in GEMM_LOCATIONS:
        sized = [i for i in injections if i.size is not None and i.threshold is not None]
        return bool(sized) and all(i.size > GEMM_MARGIN * i.threshold for i in sized)
    if trial.location == "elementwise":
        return segment_of(trial.site, recompute_sites) is not None
    if trial.location in ("saved", "recompute"):
        return bool(injections)  # the fault fired (a saved tensor's step, a recomputed segment)
    return True  # the optimizer's update: a campaign replays every parameter's update at every step
