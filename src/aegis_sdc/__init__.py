"""aegis-sdc: online detection of silent data corruption in PyTorch training.

import aegis_sdc as aegis
guard = aegis.protect(model, optimizer=optimizer)   # every nn.Linear is now checked
...train as usual...
guard.close()                                       # verify what is pending, restore the model
"""

from __future__ import annotations

__version__ = "0.1.0"

from aegis_sdc.config import (
    EXIT_CODE_SDC,
    ChecksumConfig,
    DistributedConfig,
    FingerprintConfig,
    GuardConfig,
    ResponseConfig,
    SamplingConfig,
    ThresholdConfig,
    UpdateReplayConfig,
    VerifyConfig,
)
from aegis_sdc.distributed.context import RankExchangeError
from aegis_sdc.events import (
    Channel,
    CommKind,
    Evidence,
    FingerprintKind,
    GemmKind,
    Incident,
    RankIdentity,
    Site,
    Tile,
    Verdict,
    VerdictKind,
    VTask,
    WrongExecution,
)
from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.guard import Guard, GuardSummary, StepReport
from aegis_sdc.response.policies import SilentDataCorruptionError, SilentDataCorruptionWarning


def protect(
    model,
    optimizer=None,
    config: GuardConfig | None = None,
    *,
    filter=None,
    start_step: int = 0,
    process_group=None,
) -> Guard:
    """Check every `nn.Linear` of `model` (those `config.include`/`exclude` and `filter` keep), and the
    matrix parameters other modules multiply by through `F.linear` or a grouped GEMM — a mixture of
    experts' experts and routers (those `include`/`exclude` keep; docs/integrations.md).

    With an `optimizer`, the end of each step is its `step()`: evidence is judged and vTasks are
    verified in its pre-hook, before any weight changes. Without one, call `guard.step()` once per
    training step, after backward and *before* the weights change: a replay that references a weight
    updated in between (through `p.data`, which leaves no trace on the tensor) cannot be judged and
    ends `not_verifiable`. `filter(name, linear) -> bool` narrows the choice further. `start_step` numbers
    the first step (for resumed runs). Returns the `Guard`; `guard.close()` (or leaving its `with`
    block) verifies what is pending and restores the original modules.

    Under torch.distributed (more than one rank) every rank must call `protect` with the same model
    structure. `process_group` is the data-parallel group the ranks compare notes over (default: the
    DDP model's group, else the default group; for a device mesh, `mesh.get_group("dp")`). A DDP
    model's gradient all-reduces are checked automatically; for FSDP2, protect before `fully_shard`
    and call `guard.attach_fsdp(model)` after it.

    While the guard is open, activation checkpointing (`torch.utils.checkpoint`, non-reentrant) is
    checked by comparing each segment's output with its recomputation, and tensors saved for
    backward on sampled steps are compared when saved and when used (`config.fingerprints`,
    docs/fingerprints.md).
    """
    return Guard(
        model, optimizer=optimizer, config=config, filter=filter, start_step=start_step, process_group=process_group
    )


__all__ = [
    "EXIT_CODE_SDC",
    "Channel",
    "ChecksumConfig",
    "CommKind",
    "DistributedConfig",
    "Evidence",
    "FaultSpec",
    "FingerprintConfig",
    "FingerprintKind",
    "GemmKind",
    "Guard",
    "GuardConfig",
    "GuardSummary",
    "Incident",
    "RankExchangeError",
    "RankIdentity",
    "ResponseConfig",
    "SamplingConfig",
    "SilentDataCorruptionError",
    "SilentDataCorruptionWarning",
    "Site",
    "StepReport",
    "ThresholdConfig",
    "Tile",
    "UpdateReplayConfig",
    "VTask",
    "Verdict",
    "VerdictKind",
    "VerifyConfig",
    "WrongExecution",
    "protect",
]
