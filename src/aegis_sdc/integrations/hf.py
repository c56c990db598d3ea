"""Hugging Face `transformers.Trainer`: protection in one line.

    from aegis_sdc.integrations.hf import protect_trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)
    protect_trainer(trainer)            # or: Trainer(..., callbacks=[AegisCallback()])
    trainer.train()

`AegisCallback` protects the Trainer's model when training begins — after the Trainer has built its
optimizer and enabled gradient checkpointing — and binds the step boundary to the torch optimizer
the Trainer actually steps (accelerate's `AcceleratedOptimizer` unwrapped): evidence is judged and
alarms verified in that optimizer's step pre-hook, before the update lands, once per optimizer step
(gradient accumulation included). Checkpointed layers are checked per layer. With
`ResponseConfig(policy="raise")` a confirmed SDC raises out of `trainer.train()`. The guard closes
when training ends (pending verifications drained, the model restored); its summary is logged and
kept on the callback (`callback.summary`). When `train()` raises (a confirmed SDC under `raise`),
the guard stays open for inspection: `callback.guard.incidents`, then `callback.guard.close()`.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

import aegis_sdc
from aegis_sdc.config import GuardConfig

log = logging.getLogger("aegis_sdc")


class AegisCallback(TrainerCallback):
    """Protects the Trainer's model for the length of `train()` (see the module docstring).
    `config` and `protect_kwargs` go to `aegis_sdc.protect`."""

    def __init__(self, config: GuardConfig | None = None, **protect_kwargs: Any) -> None:
        self.config = config
        self.protect_kwargs = protect_kwargs
        self.guard: aegis_sdc.Guard | None = None
        self.summary: aegis_sdc.GuardSummary | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("aegis-sdc: the Trainer passed no model or optimizer to its callbacks")
        if self.guard is not None and not self.guard.closed:
            self.guard.close()  # a second train() on the same callback: a fresh guard
        kwargs = {"start_step": state.global_step, **self.protect_kwargs}  # a resumed run numbers on
        self.guard = aegis_sdc.protect(model, optimizer=optimizer, config=self.config, **kwargs)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.guard is not None and not self.guard.closed:
            self.summary = self.guard.close()
            log.info("aegis-sdc: %s", self.summary.brief())
        return control


def protect_trainer(trainer: Any, config: GuardConfig | None = None, **protect_kwargs: Any) -> AegisCallback:
    """Add an `AegisCallback` to `trainer` (before `trainer.train()`); returns it (its `guard` is
    open while training runs)."""
    callback = AegisCallback(config, **protect_kwargs)
    trainer.add_callback(callback)
    return callback
