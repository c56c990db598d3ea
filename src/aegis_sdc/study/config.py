"""Configuration of a paired healthy-vs-suspect study (docs/study.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.workloads.llama import LlamaConfig

MODES = ("compute-sync", "param-sync", "free-run")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class StudyConfig:
    """One study: which synchronization, which faults on the suspect, the workload and its training.

    Steps are numbered from 0, as the guard numbers them, so a `FaultSpec` fires at the same
    (site, step, call) in a study as under `protect`.
    """

    mode: str = "free-run"
    steps: int = 300
    faults: tuple[FaultSpec, ...] = ()  # the suspect's faulty matrix unit; empty: a control study
    model: LlamaConfig = field(default_factory=LlamaConfig)
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3  # AdamW; the workload's loss falls from ln(vocab) to ~1.4 nats in 300 steps at this rate
    seed: int = 0  # model initialization, the Markov chain and the order of its samples
    baseline_seed: int = 1  # free-run: the reseeded healthy replica draws its samples with this seed
    device: str = "cpu"  # the healthy replica (and the baseline); "cuda", "cuda:0", ...
    suspect_device: str | None = None  # None: the healthy device; "cuda:1": a second GPU
    # Two healthy replicas must agree bit for bit for this many steps before the study starts: three
    # steps cover the first optimizer update, the moments' first use and a step on updated weights.
    determinism_steps: int = 3
    # free-run: a loss spike is a loss above `spike_ratio` × the median of the preceding
    # `spike_window` losses (a non-finite loss always is). 1.2: the workload's step-to-step loss
    # noise at batch 8 stays within ±8% of its running median after the first 20 steps.
    spike_ratio: float = 1.2
    spike_window: int = 20
    # free-run: fine-tuning on a held-out Markov chain (another chain seed), then next-token accuracy.
    finetune_steps: int = 100
    finetune_lr: float = 1e-3
    eval_batches: int = 8
    run_dir: str | None = None  # default: aegis-runs/study-<mode>-<time>

    def __post_init__(self) -> None:
        _require(self.mode in MODES, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        _require(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        object.__setattr__(self, "faults", tuple(self.faults))
        _require(
            all(isinstance(f, FaultSpec) for f in self.faults), "faults must be FaultSpec objects (FaultSpec.parse)"
        )
        _require(self.batch_size >= 1 and self.seq_len >= 1, "batch_size and seq_len must be >= 1")
        _require(
            self.seq_len <= self.model.max_seq_len,
            f"seq_len {self.seq_len} exceeds the model's max_seq_len {self.model.max_seq_len}",
        )
        _require(math.isfinite(self.lr) and self.lr > 0, f"lr must be finite and > 0, got {self.lr}")
        _require(math.isfinite(self.finetune_lr) and self.finetune_lr > 0, "finetune_lr must be finite and > 0")
        _require(self.baseline_seed != self.seed, "baseline_seed must differ from seed (it is the reseeded run)")
        _require(self.determinism_steps >= 1, "determinism_steps must be >= 1: the study refuses to run unchecked")
        _require(self.spike_ratio > 1.0, f"spike_ratio must be > 1, got {self.spike_ratio}")
        _require(self.spike_window >= 2, f"spike_window must be >= 2, got {self.spike_window}")
        _require(self.finetune_steps >= 0 and self.eval_batches >= 1, "finetune_steps >= 0 and eval_batches >= 1")
        for name in ("device", "suspect_device"):
            value = getattr(self, name)
            if value is not None:
                try:
                    torch.device(value)
                except (RuntimeError, TypeError) as error:
                    raise ValueError(f"{name}: {value!r} is not a device ({error})") from None

    @property
    def healthy_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def suspect(self) -> torch.device:
        return torch.device(self.suspect_device or self.device)
