"""The optimizer gate: the step ends without waiting for its evidence, and an alarmed update waits.

Optimizers that take GradScaler's device-side `found_inf` (fused Adam, AdamW and SGD on CUDA:
`_step_supports_amp_scaling`) skip their update on the device when it is non-zero, and undo their
step count. The guard's optimizer pre-hook starts the step's evidence read and hands the optimizer
the step's alarm flag (runtime/evidence.py), summed with GradScaler's flag when one is set; the GPU
runs the optimizer while the post-hook judges and verifies — against the step's own weights, since
an alarmed step's update was held back. When the verdicts allow it (`raise` and `exit` have raised;
`skip-step` has dropped the gradients), the post-hook applies the held-back update.
Other optimizers make the pre-hook wait for the evidence: one host read, the GPU idle meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch


def gateable(optimizer: Any, device: torch.device) -> bool:
    return device.type == "cuda" and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class OptimizerGate:
    def __init__(self) -> None:
        self.reapplying = False  # inside `reapply`: the guard's hooks stand aside

    @staticmethod
    def hold(optimizer: Any, flag: torch.Tensor) -> torch.Tensor | None:
        """Hand `flag` to the optimizer; returns its own found_inf, to be restored by `release`."""
        own = getattr(optimizer, "found_inf", None)
        # GradScaler's flag is 0-dim, as fused optimizers need (their step counts are): keep its shape
        optimizer.found_inf = flag if own is None else own + flag.to(own.device).reshape(own.shape)
        return own

    @staticmethod
    def release(optimizer: Any, own: torch.Tensor | None) -> None:
        if own is None:
            del optimizer.found_inf
        else:
            optimizer.found_inf = own

    def reapply(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Run the held-back update (from the post-hook; `args` are the hook's, optimizer first)."""
        self.reapplying = True
        try:
            optimizer.step(*args[1:], **kwargs)
        finally:
            self.reapplying = False
