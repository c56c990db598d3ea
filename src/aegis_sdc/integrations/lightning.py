"""Lightning: protection as a callback.

    from aegis_sdc.integrations.lightning import AegisCallback
    trainer = lightning.Trainer(..., callbacks=[AegisCallback()])
    trainer.fit(module, data)

The step boundary is Lightning's `on_before_optimizer_step`: it runs after the step's forward and
backward (inside the optimizer's closure under automatic optimization, inside `optimizer.step()` under
manual optimization) and before the update — so evidence is judged and alarms verified before a
corrupted update lands. The torch optimizer's own step pre-hook would not do: under automatic
optimization it runs before the closure, that is before the step's forward and backward.

The LightningModule is protected when fitting starts (after `configure_optimizers`) and the guard
closes when fitting ends or raises (pending verifications drained, the model restored); the guard
and its summary stay on the callback (`callback.guard`, `callback.summary`). With
`ResponseConfig(policy="raise")` a confirmed SDC raises out of `trainer.fit()`.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import Callback

import aegis_sdc
from aegis_sdc.config import GuardConfig

log = logging.getLogger("aegis_sdc")


class AegisCallback(Callback):
    """Protects the LightningModule while `fit` runs (see the module docstring). `config` and
    `protect_kwargs` go to `aegis_sdc.protect` (no optimizer: the boundary is the callback's)."""

    def __init__(self, config: GuardConfig | None = None, **protect_kwargs: Any) -> None:
        if "optimizer" in protect_kwargs:
            raise TypeError("AegisCallback binds the step boundary itself: pass no optimizer")
        self.config = config
        self.protect_kwargs = protect_kwargs
        self.guard: aegis_sdc.Guard | None = None
        self.summary: aegis_sdc.GuardSummary | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        kwargs = {"start_step": trainer.global_step, **self.protect_kwargs}  # a resumed run numbers on
        self.guard = aegis_sdc.protect(pl_module, config=self.config, **kwargs)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.guard is not None and not self.guard.closed:
            self.guard.step()  # judge, verify and respond for this step, before the update

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.guard is not None and not self.guard.closed:
            self.summary = self.guard.close()
            log.info("aegis-sdc: %s", self.summary.brief())
