"""Lightning end to end (CPU): the callback's step boundary is `on_before_optimizer_step`, so under
automatic and manual optimization a fault in each GEMM kind and in attention is confirmed at its step
before the update lands, `raise` stops `fit`, and a clean run confirms nothing (integrations/lightning.py)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import SMALL, guard_config

import aegis_sdc as aegis
from aegis_sdc.workloads.llama import Llama, lm_loss

lightning = pytest.importorskip("lightning")
from aegis_sdc.integrations.lightning import AegisCallback  # noqa: E402

FAULT_STEP = 5


class LlamaModule(lightning.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(SMALL)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _fit(tmp_path, callback, manual=False, steps=8, compiled=False):
    module = LlamaModule(manual)
    if compiled:  # Lightning compiles the training step whole: under manual optimization the step end too
        module = torch.compile(module, backend="aot_eager")
    tokens = torch.randint(0, SMALL.vocab_size, (64, 33), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    trainer = lightning.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path / "pl"), callbacks=[callback],
    )  # fmt: skip
    trainer.fit(module, data)
    return module, trainer


@pytest.mark.parametrize("site,stage,manual", [
    ("model.layers.0.mlp.up_proj:fwd", None, False),
    ("model.layers.0.attn.wq:dgrad", None, False),
    ("model.layers.0.mlp.down_proj:wgrad", None, True),
    ("model.layers.0.attn:attn_bwd", "dk", False),
])  # fmt: skip
def test_a_fault_is_confirmed_at_its_step_before_the_update_and_raise_stops_fit(tmp_path, site, stage, manual):
    extra = {"stage": stage, "row": 5, "col": 3} if stage else {}
    # bit 30 (the exponent's top bit) of an fp32 accumulator: far over any threshold, calibrated or not
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(FAULT_STEP,), **extra)
    config = guard_config(tmp_path, faults=(fault,), response=aegis.ResponseConfig(policy="raise"),
                          thresholds=aegis.ThresholdConfig(calibration_checks=4))  # fmt: skip
    callback = AegisCallback(config)
    with pytest.raises(aegis.SilentDataCorruptionError):
        _fit(tmp_path, callback, manual)
    guard = callback.guard
    assert guard.closed and callback.summary is not None  # closed on the exception, the summary kept
    assert [(i.step, i.site.name) for i in guard.incidents] == [(FAULT_STEP, site)]
    assert callback.summary.false_alarms == 0
    # the corrupted step's update never landed: the optimizer took steps 0 … FAULT_STEP − 1 only
    optimizer = guard.model.trainer.optimizers[0]
    assert {int(s["step"]) for s in optimizer.state.values()} == {FAULT_STEP}


@pytest.mark.parametrize("manual", [False, True])
def test_a_compiled_module_confirms_a_fault_before_the_update(tmp_path, manual):
    # trainer.fit(torch.compile(module)): Lightning compiles the training step, and under manual
    # optimization the optimizer step — and with it the callback's guard.step() — runs inside that
    # compiled frame; traced, the step end once failed inside Dynamo. It runs eagerly there now.
    site = "model.layers.0.mlp.down_proj:wgrad"
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(FAULT_STEP,))
    config = guard_config(tmp_path, faults=(fault,), response=aegis.ResponseConfig(policy="raise"),
                          thresholds=aegis.ThresholdConfig(calibration_checks=4))  # fmt: skip
    callback = AegisCallback(config)
    torch._dynamo.reset()
    with pytest.raises(aegis.SilentDataCorruptionError):
        _fit(tmp_path, callback, manual, compiled=True)
    assert [(i.step, i.site.name) for i in callback.guard.incidents] == [(FAULT_STEP, site)]
    assert callback.summary.steps == FAULT_STEP + 1 and callback.summary.false_alarms == 0
    optimizer = callback.guard.model.trainer.optimizers[0]
    assert {int(s["step"]) for s in optimizer.state.values()} == {FAULT_STEP}


@pytest.mark.parametrize("manual", [False, True])
def test_a_clean_fit_confirms_nothing(tmp_path, manual):
    callback = AegisCallback(guard_config(tmp_path))
    _fit(tmp_path, callback, manual)
    summary = callback.summary
    assert summary.steps == 8 and summary.confirmed == 0 and summary.not_verifiable == 0
    assert summary.checks == 8 * 8 * 3 and summary.attention_checks == 8 * 2  # every Linear's 3 GEMMs, attention


def test_a_guard_bound_to_the_optimizers_pre_hook_under_lightning_names_the_mistake(tmp_path):
    # The wiring the callback replaces: protect(module, optimizer=...) in configure_optimizers. Under
    # automatic optimization the pre-hook runs before the closure's forward and backward, so a
    # forward fault is judged a step late, after its weight was updated: not verifiable — and the
    # guard says why, with the fix.
    fault = aegis.FaultSpec(site="model.layers.0.mlp.up_proj:fwd", model="bitflip", bit=30, steps=(FAULT_STEP,))
    config = guard_config(tmp_path, faults=(fault,), thresholds=aegis.ThresholdConfig(calibration_checks=4))

    class Wired(LlamaModule):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            self.guard = aegis.protect(self, optimizer=optimizer, config=config)
            return optimizer

    module = Wired()
    tokens = torch.randint(0, SMALL.vocab_size, (64, 33), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    trainer = lightning.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path / "pl"))  # fmt: skip
    with pytest.warns(UserWarning, match="step boundary comes after the optimizer's update.*AegisCallback"):
        trainer.fit(module, data)
    summary = module.guard.close()
    assert summary.not_verifiable >= 1 and summary.confirmed == 0
