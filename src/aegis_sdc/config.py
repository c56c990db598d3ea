"""Configuration: frozen dataclasses that reject bad values with a message naming the field.

Every field is checked at construction, its type (TypeError) and its range (ValueError): an int
field takes an int (not a bool, not a float), a number field a finite real number (an int too), a
flag a bool. Every constant has a default chosen for LLM training and a comment saying why;
docs/configuration.md lists them all.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.validation import INT64_MAX, INT64_MIN, check_bool, check_choice, check_int, check_real, set_field, shown

CHECK_MODES = ("row", "row+col")
AUTO_BUDGET = 0.01  # SamplingConfig(budget="auto") on CUDA: 1% of the step (see SamplingConfig)
POLICIES = ("warn", "raise", "exit", "skip-step", "rollback")
BACKENDS = ("auto", "reference", "triton")

# Exit status of a process stopped by the `exit` policy. Schedulers can requeue the job on other
# hardware when they see it; it is outside the shell's 126–165 and sysexits' 64–78 ranges.
EXIT_CODE_SDC = 86


# The per-step exchange's gloo group takes its timeout as a datetime.timedelta, which holds at most
# this many seconds (about 2.7 million years: the bound only turns an overflow into a clear error).
MAX_EXCHANGE_TIMEOUT_S = datetime.timedelta.max // datetime.timedelta(seconds=1)

# The field checks shared with FaultSpec are in validation.py; the three below are configuration's own.


def _check_instance(owner: str, name: str, value: object, *, kind: type) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{owner}.{name} must be a {kind.__name__}, got {shown(value)}")
    return value


def _check_items(owner: str, name: str, value: object, *, kind: type, single: bool = False) -> tuple[Any, ...]:
    """A tuple of `kind` from any iterable of them (or from one alone when `single`)."""
    if single and isinstance(value, kind):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{owner}.{name} must be a tuple of {kind.__name__}, got {shown(value)}")
    items = tuple(value)
    for i, item in enumerate(items):
        _check_instance(owner, f"{name}[{i}]", item, kind=kind)
    return items


def _check_path(owner: str, name: str, value: object, *, optional: bool = False) -> str | None:
    """A non-empty path as a str (an os.PathLike is converted); None too when `optional`."""
    if optional and value is None:
        return None
    expected = "a non-empty path (str or os.PathLike)" + (" or None" if optional else "")
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise TypeError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    if not path or "\0" in path:  # "" would silently mean the default; NUL no system accepts
        raise ValueError(f"{owner}.{name} must be {expected}, got {path!r}")
    return path


@dataclass(frozen=True)
class ChecksumConfig:
    """Which checksums each GEMM of a Linear takes: ``row`` or ``row+col``.

    Row checks catch any single corrupted element of any GEMM. Column checks add a second,
    independent view and localize the corrupted element to a tile. wgrad defaults to ``row+col``
    because both its operands are activations: the tile localization lets its replay context be two
    small slabs instead of a whole activation held until the end of the step.
    """

    forward: str = "row"
    dgrad: str = "row"
    wgrad: str = "row+col"

    def __post_init__(self) -> None:
        for name in ("forward", "dgrad", "wgrad"):
            set_field(self, name, check_choice, choices=CHECK_MODES)

    @classmethod
    def all(cls, mode: str) -> ChecksumConfig:
        return cls(forward=mode, dgrad=mode, wgrad=mode)


@dataclass(frozen=True)
class ThresholdConfig:
    """Per-site adaptive thresholds on the normalized checksum difference (units of u·s, u = 2⁻²⁴).

    - `calibration_checks`: the first clean checks of a site set its base threshold (from the median
      of their nonzero values: an exactly zero difference is an all-zero product, not noise). 16 is enough:
      the statistic is already a maximum over thousands of rows, so its spread between calls is
      narrow; during calibration the exact worst-case rounding bound acts as the threshold.
    - `margin`: base = margin × median(calibration). The median is robust to a fault during
      calibration. Measured on the workload (docs/thresholds.md), the largest clean value over
      thousands of checks stays below 2× the calibration median; 4 leaves room for drift while a
      fault of r = 1 (the AEGIS unit: the whole clean checksum noise) still lands far above it.
    - `backoff`: a false alarm multiplies the site's threshold by this (2: the issue's doubling).
    - `relax_window`: after this many consecutive clean checks the threshold halves back toward its
      base; 200 checks are a few hundred steps, long enough that one noisy batch cannot flap it.
    - `floor`: no threshold goes below one unit of fp32 rounding of the operands.
    - `data_outlier_factor`: a false alarm on a call whose raw checksum difference ‖C·1 − A·(B·1)‖₂
      lies more than this factor above (or below) the site's recent clean median came from unusual
      data (a batch of extreme values), not from a noisier regime: the threshold stays where it is.
      Raw differences scale with the operands; over a whole training run they drift by a few ×,
      tracked by the median of the last 16 clean checks, while a batch at 10³⁰ moves them by 10²⁹.
      100 keeps loss spikes of one or two orders of magnitude counted as regime changes.
    """

    calibration_checks: int = 16
    margin: float = 4.0
    backoff: float = 2.0
    relax_window: int = 200
    floor: float = 1.0
    data_outlier_factor: float = 100.0

    def __post_init__(self) -> None:
        set_field(self, "calibration_checks", check_int, ge=1)
        set_field(self, "margin", check_real, ge=1.0)
        set_field(self, "backoff", check_real, gt=1.0)
        set_field(self, "relax_window", check_int, ge=1)
        set_field(self, "floor", check_real, gt=0.0)
        set_field(self, "data_outlier_factor", check_real, gt=1.0)


@dataclass(frozen=True)
class SamplingConfig:
    """Which calls of a site run the checked kernel (the others run the fast path, exactly `F.linear`).

    Decisions are drawn once per step for all sites, as a pure function of (seed, site, step, call):
    every data-parallel rank checks the same calls. Calibration checks are always taken.

    - `probability`: the chance that a call is checked, for every site (1.0 when neither it nor a
      budget is in force). Giving it turns the automatic budget off.
    - `per_site`: fnmatch patterns over site names → probability; the first match wins. Under a
      budget a rule caps its sites' probability (0 leaves them unchecked).
    - `budget`: instead of a fixed probability, keep the cost of checking under this fraction of the
      step (0.01 = 1%). After calibration, each site's extra cost per check is timed on the device
      (checked kernel against the unchecked one, at the site's shape) and the step time is measured
      on a few unsampled steps; the plan then checks as many GEMM and attention FLOPs per step as
      fit (an attention module's calls are items of the same plan, timed checked against SDPA's
      default backend), most FLOPs per millisecond first, and re-plans every `replan_steps` steps
      from what the plan really cost
      (runtime/budget.py). ``"auto"`` (the default) is a 1% budget for a model on CUDA when no
      `probability` is given, and no budget (every call checked) on the CPU reference path. Why 1%
      on the GPU: measured on the H200 with HF Llama at the TinyLlama-1.1B shape (docs/hot-path.md),
      checking every GEMM costs +92% of the step with today's kernel — protection at a few percent
      holds only when sampled; a 1% budget costs about 1–2% and still checks every site about once
      per `rotation_steps` steps. The CPU reference path is for tests and demonstrations.
      ``None``: always `probability`.
    - `rotation_steps`: under a budget, every site is still checked about once per this many steps,
      however poor its FLOPs per millisecond (a fault in a cheap site must not go unseen forever).
    """

    probability: float | None = None
    per_site: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    budget: float | str | None = "auto"
    rotation_steps: int = 100
    replan_steps: int = 50

    def budget_for(self, device_type: str) -> float | None:
        """The budget in force for a model on `device_type` (see `budget`)."""
        if self.budget == "auto":
            return AUTO_BUDGET if device_type == "cuda" and self.probability is None else None
        return self.budget

    def probability_for(self, device_type: str) -> float:
        """Every site's probability when no budget is in force (1.0 unless given)."""
        return 1.0 if self.probability is None else self.probability

    @classmethod
    def every_call(cls, **kwargs: Any) -> SamplingConfig:
        """Check every call of every site, on any device (tests, sensitivity runs, demonstrations)."""
        return cls(probability=1.0, budget=None, **kwargs)

    def __post_init__(self) -> None:
        set_field(self, "probability", check_real, ge=0.0, le=1.0, optional=True)
        object.__setattr__(self, "per_site", _per_site_rules(self.per_site))
        set_field(self, "seed", check_int, ge=INT64_MIN, le=INT64_MAX)
        if isinstance(self.budget, str):
            if self.budget != "auto":
                raise ValueError(
                    f"SamplingConfig.budget must be a fraction of the step in (0, 1], 'auto' or None, "
                    f"got {self.budget!r}"
                )
        else:
            set_field(self, "budget", check_real, gt=0.0, le=1.0, optional=True)
        if self.probability is not None and isinstance(self.budget, float):
            raise ValueError("SamplingConfig takes a probability or a budget, not both")
        set_field(self, "rotation_steps", check_int, ge=1)
        set_field(self, "replan_steps", check_int, ge=1)


def _per_site_rules(value: object) -> tuple[tuple[str, float], ...]:
    """`SamplingConfig.per_site` as (fnmatch pattern, probability) pairs, from a mapping or pairs."""
    rules = value.items() if isinstance(value, Mapping) else value
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise TypeError(
            f"SamplingConfig.per_site must be a mapping or (pattern, probability) pairs, got {shown(value)}"
        )
    checked = []
    for i, rule in enumerate(rules):
        if isinstance(rule, (str, bytes)) or not isinstance(rule, Sequence) or len(rule) != 2:
            raise TypeError(f"SamplingConfig.per_site[{i}] must be a (pattern, probability) pair, got {shown(rule)}")
        pattern, probability = rule
        if not isinstance(pattern, str):
            raise TypeError(f"SamplingConfig.per_site[{i}] pattern must be a str, got {shown(pattern)}")
        checked.append((pattern, check_real("SamplingConfig", f"per_site[{pattern!r}]", probability, ge=0.0, le=1.0)))
    return tuple(checked)


@dataclass(frozen=True)
class VerifyConfig:
    """When and how vTasks are replayed.

    - `time_budget_ms`: replay time allowed per step for vTasks that hold no reference to a weight;
      vTasks that reference a weight are always replayed before the optimizer step, budget or not.
      50 ms is under 5% of a typical 1–2 s LLM training step.
    - `max_backlog`: past this many pending vTasks the oldest are replayed regardless of the budget,
      bounding the memory held by replay contexts.
    - `row_block` / `col_block`: the tile of the reference GEMM; the replay unit and the size of a
      replay context (a row block of A, a column block of B).
    """

    time_budget_ms: float = 50.0
    max_backlog: int = 64
    row_block: int = 128
    col_block: int = 128

    def __post_init__(self) -> None:
        set_field(self, "time_budget_ms", check_real, ge=0.0)
        set_field(self, "max_backlog", check_int, ge=0)
        set_field(self, "row_block", check_int, ge=1)
        set_field(self, "col_block", check_int, ge=1)


@dataclass(frozen=True)
class ResponseConfig:
    """What happens on a confirmed SDC (after the incident is committed to the store).

    - ``warn``: log and emit a `SilentDataCorruptionWarning`; training continues.
    - ``raise``: raise `SilentDataCorruptionError` (carrying the incident) from `optimizer.step()`,
      before the corrupted gradients are applied.
    - ``exit``: exit the process with `exit_code` (default 86, `EXIT_CODE_SDC`).
    - ``skip-step``: warn and drop this step's gradients so the optimizer skips the update.
    - ``rollback``: restore the last certified checkpoint in-process (model, optimizer, RNG states, and
      the caller's data position through `guard.on_rollback`) and go on from its step
      (response/checkpoints.py, docs/response.md); with none certified yet it raises, as ``raise``.
      Under torch.distributed with more than one rank it exits as ``exit`` (a rollback must be taken
      by every rank together: restart the job from the certified checkpoint).

    With `quarantine` the device is appended to a JSON-lines quarantine list (default
    ``RUN_DIR/quarantine.jsonl``), written atomically.
    """

    policy: str = "warn"
    quarantine: bool = True
    quarantine_path: str | None = None
    exit_code: int = EXIT_CODE_SDC

    def __post_init__(self) -> None:
        set_field(self, "policy", check_choice, choices=POLICIES)
        set_field(self, "quarantine", check_bool)
        set_field(self, "quarantine_path", _check_path, optional=True)
        set_field(self, "exit_code", check_int, ge=1, le=255)  # a process exit status; 0 would mean success


@dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel sensors (used when torch.distributed is initialized with more than one rank).

    - `outlier_factor`: a rank is an outlier for a site when its largest normalized difference of the
      step exceeds `outlier_factor` × the `outlier_quantile` of the *other* ranks' values (leaving the
      rank out keeps a single bad rank from raising its own reference; with two ranks the reference
      is simply the other rank). The values are normalized (units of u·s), so ranks are comparable
      whatever their data: on the workload a site's largest clean value stayed within 2.1× of its
      median over 300 steps (docs/thresholds.md); 10 leaves ~5× headroom, while a corruption that
      matters (r ≥ 4) lands 50–5000× above its peers. AEGIS used ~10⁶ on raw differences, whose
      scale varies with the data.
    - `warmup_steps`: no outlier warnings before this step (thresholds are still calibrating).
    - `exchange_timeout_s`: the per-step exchange runs on its own gloo group with this timeout; a
      rank that dies or stalls makes the others raise `RankExchangeError` instead of hanging.
    - `comm_check`: check DDP all-reduces / FSDP2 reduce-scatters of gradients with linear checksums.
    - `comm_chunks`: checksums per bucket (localization and sensitivity grow with it).
    - `state_vote`: under DDP, the replicas vote on their parameters and optimizer state at every
      step's end (sensors/state_vote.py): a weight or an optimizer moment corrupted at rest, or a
      replica that missed an update, is named at the next step's end (with two replicas: proven,
      no rank named). Costs one read of the voted tensors (fingerprints at the read bandwidth).
    - `vote_param_slices`: the parameters are voted in this many rotating slices (a corrupted
      parameter is found within this many steps). 8: the vote reads an eighth of the parameters per
      step — on an H200 with a 1.1B Llama 0.41–0.69% of the step (two runs), all of them every
      step 1.5–2.3% (benchmarks/state_sensors.py): the batched fingerprint kernel reads ~1 TB/s
      there, a third of what the single-tensor kernel reaches.
    - `vote_state_slices`: likewise the optimizer state; 16 by default because it is 2–3× the
      parameters' bytes (Adam's two fp32 moments) and changes only through the update.
    - `peer_replay_period`: under DDP, every this many steps a peer rank recomputes each rank's
      micro-batch and the local gradients are compared before the all-reduce
      (distributed/peer_replay.py): it sees corruption between the checked ops (element-wise ops,
      norms, module outputs, gradients in memory). Needs the loss computed through
      `guard.run_batch(loss_fn, batch)` and the checked all-reduce (`comm_check`); a replay step
      costs one more forward and backward, so 200 keeps it near 0.5% of training. 0: off.
    """

    outlier_factor: float = 10.0
    outlier_quantile: float = 0.9
    warmup_steps: int = 20
    exchange_timeout_s: float = 300.0
    comm_check: bool = True
    comm_chunks: int = 64
    state_vote: bool = True
    vote_param_slices: int = 8
    vote_state_slices: int = 16
    peer_replay_period: int = 200

    def __post_init__(self) -> None:
        set_field(self, "outlier_factor", check_real, gt=1.0)
        set_field(self, "outlier_quantile", check_real, ge=0.0, le=1.0)
        set_field(self, "warmup_steps", check_int, ge=0)
        set_field(self, "exchange_timeout_s", check_real, gt=0.0, le=MAX_EXCHANGE_TIMEOUT_S)
        set_field(self, "comm_check", check_bool)
        set_field(self, "comm_chunks", check_int, ge=1)
        set_field(self, "state_vote", check_bool)
        set_field(self, "vote_param_slices", check_int, ge=1)
        set_field(self, "vote_state_slices", check_int, ge=1)
        set_field(self, "peer_replay_period", check_int, ge=0)


@dataclass(frozen=True)
class FingerprintConfig:
    """Fingerprint checks of recomputed and saved activations (docs/fingerprints.md).

    - `recompute`: check checkpointed segments (`torch.utils.checkpoint`, non-reentrant): the output
      in forward against the output of its recomputation in backward. Costs one read of each
      segment's output per pass, a small fraction of the segment's own work: on by default, every
      call (`recompute_probability`).
    - `calibration_checks`: the first checks of a recompute site also run the segment a third time,
      so a segment with non-deterministic operators is found and reported as not covered.
    - `saved_tensors`: check tensors saved for backward: fingerprinted when saved and when used.
      `saved_probability` samples whole steps (identical on every rank): Python pack/unpack hooks
      cost microseconds per saved tensor, so unsampled steps run without them. In a sampled step
      every saved tensor is read twice more and stays referenced until the step's end: measured on
      an H200 with a 1.1B HF Llama (4 × 2048 tokens), such a step took 40–75 ms more than the
      157 ms step, so the default samples 1% of steps (about 0.3–0.5% on average). Under an
      overhead budget (`SamplingConfig.budget`) this is an upper bound: one probe step measures
      what a sampled step costs, and such steps get at most a fifth of the budget
      (runtime/budget.py, SAVED_SHARE).
    - `saved_min_bytes`: smaller saved tensors are not fingerprinted (their launches cost more than
      their bytes).
    - `pool_slots`: fingerprints per device buffer (buffers are added when a step needs more).
    """

    recompute: bool = True
    recompute_probability: float = 1.0
    calibration_checks: int = 2
    saved_tensors: bool = True
    saved_probability: float = 0.01
    saved_min_bytes: int = 1 << 16
    pool_slots: int = 4096

    def __post_init__(self) -> None:
        for name in ("recompute", "saved_tensors"):
            set_field(self, name, check_bool)
        for name in ("recompute_probability", "saved_probability"):
            set_field(self, name, check_real, ge=0.0, le=1.0)
        set_field(self, "calibration_checks", check_int, ge=0)
        set_field(self, "saved_min_bytes", check_int, ge=4)
        set_field(self, "pool_slots", check_int, ge=1)


@dataclass(frozen=True)
class UpdateReplayConfig:
    """Optimizer-update replay (sensors/update_replay.py): each step, a slice of the parameters'
    update is executed again from a copy of its inputs and compared bit for bit.

    - `enabled`: on by default: no other check sees the optimizer step.
    - `slices`: the parameters are split into this many slices of about equal bytes (the copies hold
      about 2/`slices` of the parameters', gradients' and state's bytes while a replay waits for its
      read).
    - `every`: a slice is replayed every this many steps; every parameter's update is replayed every
      `slices · every` steps (64 by default). Each replay costs host time of its own (copies, an
      optimizer built for the slice, one step of it, fingerprints, ~2–8 ms), so fewer, larger
      replays cost less: measured on an H200 with a 1.1B Llama (benchmarks/state_sensors.py), one
      slice of 64 every step +1.4–1.5% of the step, one of 16 every 4 steps +0.26% (a second run:
      +0.43% in its second round; its first round held a warm-up outlier).
    """

    enabled: bool = True
    slices: int = 16
    every: int = 4

    def __post_init__(self) -> None:
        set_field(self, "enabled", check_bool)
        set_field(self, "slices", check_int, ge=1)
        set_field(self, "every", check_int, ge=1)


def default_run_dir() -> str:
    """``aegis-runs/<run id>``; the id comes from AEGIS_RUN_ID, torchrun's run id, or the start time.

    An id from the environment becomes one directory name inside ``aegis-runs/`` whatever it holds:
    every character outside ``[A-Za-z0-9._-]`` (a ``/`` above all) becomes ``_`` and a leading dot
    gets a ``_`` before it, so ``../../x`` or an absolute path never puts the store elsewhere."""
    run_id = run_id_from_environment() or time.strftime("run-%Y%m%d-%H%M%S")
    return os.path.join("aegis-runs", safe_run_id(run_id))


def run_id_from_environment() -> str | None:
    """AEGIS_RUN_ID, else torchrun's run id (TORCHELASTIC_RUN_ID, unless "none"); None without either.
    A job restarted under the same id writes on in the same directory (a resume)."""
    run_id = os.environ.get("AEGIS_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return None if not run_id or run_id == "none" else run_id


def safe_run_id(run_id: str) -> str:
    """`run_id` as a single, non-hidden directory name (see `default_run_dir`)."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in run_id)[:200]
    return "_" + safe if safe.startswith(".") else safe


@dataclass(frozen=True)
class GuardConfig:
    """Everything `aegis_sdc.protect()` needs. All fields have defaults; see docs/configuration.md.

    - `include` / `exclude`: fnmatch patterns over module names choosing which Linears (and modules
      whose own matrices are checked: MoE experts and routers, integrations/matrices.py;
      nn.MultiheadAttention, integrations/multihead.py) to protect.
    - `run_dir`: where the per-rank SQLite store, plots and quarantine list go.
    - `max_pending_calls`: checked calls buffered before an automatic flush when no optimizer step
      comes (inference loops); one host sync per flush.
    - `attention`: check the protected model's `F.scaled_dot_product_attention` calls (forward
      O·1 = P·(V·1), backward 1ᵀdV = 1ᵀdO; sampled like the GEMMs; CPU tensors for now —
      docs/attention.md).
    - `backend`: ``auto`` runs the fused Triton kernels on CUDA tensors whose shapes TMA accepts
      (rows 16-byte aligned) and the reference path on the CPU; a CUDA call the kernels cannot take
      (fp32, misaligned rows) runs unchecked, named once in a warning and in the coverage report —
      never the reference path, which reads its evidence on the host per call; ``reference`` always
      the reference path; ``triton`` the Triton kernels wherever they can run (on the CPU only under
      TRITON_INTERPRET=1: for tests).
    - `gate_optimizer`: with an optimizer that takes GradScaler's device-side `found_inf` (fused
      Adam, AdamW, SGD on CUDA), end the step without waiting for its evidence: the optimizer gets a
      device flag that holds back the update of a step whose checks alarmed, judging runs while the
      GPU works, and a held-back update is applied once its verdicts allow it. Off: the step end
      waits for the evidence before the optimizer runs (one host read per step, GPU idle meanwhile).
      Either way a step that checked nothing is concluded after the optimizer step: nothing in it
      can hold an update back.
    """

    checksum: ChecksumConfig = field(default_factory=ChecksumConfig)
    thresholds: ThresholdConfig = field(default_factory=ThresholdConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    response: ResponseConfig = field(default_factory=ResponseConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    fingerprints: FingerprintConfig = field(default_factory=FingerprintConfig)
    update_replay: UpdateReplayConfig = field(default_factory=UpdateReplayConfig)
    attention: bool = True
    faults: tuple[FaultSpec, ...] = ()
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    run_dir: str | None = None
    max_pending_calls: int = 4096
    backend: str = "auto"
    gate_optimizer: bool = True

    def __post_init__(self) -> None:
        for name, kind in (
            ("checksum", ChecksumConfig),
            ("thresholds", ThresholdConfig),
            ("sampling", SamplingConfig),
            ("verify", VerifyConfig),
            ("response", ResponseConfig),
            ("distributed", DistributedConfig),
            ("fingerprints", FingerprintConfig),
            ("update_replay", UpdateReplayConfig),
        ):
            set_field(self, name, _check_instance, kind=kind)
        set_field(self, "attention", check_bool)
        set_field(self, "faults", _check_items, kind=FaultSpec)
        for name in ("include", "exclude"):
            set_field(self, name, _check_items, kind=str, single=True)  # one pattern alone is taken as a tuple
        set_field(self, "run_dir", _check_path, optional=True)
        set_field(self, "max_pending_calls", check_int, ge=1)
        set_field(self, "backend", check_choice, choices=BACKENDS)
        set_field(self, "gate_optimizer", check_bool)

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)
