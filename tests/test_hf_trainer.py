"""transformers.Trainer end to end (CPU): `protect_trainer(trainer)` binds the step boundary to the
optimizer the Trainer steps, so a fault in each GEMM kind and in attention is confirmed at its step
before the update lands, `raise` stops training, and gradient checkpointing enabled by the Trainer
(after the model exists) is checked per layer (integrations/hf.py)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import guard_config

import aegis_sdc as aegis

transformers = pytest.importorskip("transformers")
from aegis_sdc.integrations.hf import protect_trainer  # noqa: E402

FAULT_STEP = 5


def _trainer(tmp_path, *, steps: int = 8, checkpointing: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=data)


@pytest.mark.parametrize("site,stage", [
    ("model.layers.0.mlp.up_proj:fwd", None),
    ("model.layers.1.self_attn.o_proj:dgrad", None),
    ("model.layers.0.self_attn.q_proj:wgrad", None),
    ("model.layers.1.self_attn:attn_bwd", "dq"),
])  # fmt: skip
def test_a_fault_is_confirmed_at_its_step_before_the_update_and_raise_stops_training(tmp_path, site, stage):
    trainer = _trainer(tmp_path)
    extra = {"stage": stage, "row": 5, "col": 3} if stage else {}
    # bit 30 (the exponent's top bit) of an fp32 accumulator: far over any threshold, calibrated or not
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(FAULT_STEP,), **extra)
    config = guard_config(tmp_path, faults=(fault,), response=aegis.ResponseConfig(policy="raise"),
                          thresholds=aegis.ThresholdConfig(calibration_checks=4))  # fmt: skip
    callback = protect_trainer(trainer, config)
    with pytest.raises(aegis.SilentDataCorruptionError):
        trainer.train()
    guard = callback.guard
    assert [(i.step, i.site.name) for i in guard.incidents] == [(FAULT_STEP, site)]
    # the corrupted step's update never landed: the optimizer took steps 0 … FAULT_STEP − 1 only
    assert {int(s["step"]) for s in trainer.optimizer.optimizer.state.values()} == {FAULT_STEP}
    assert guard.summary().false_alarms == 0
    guard.close()


def test_a_clean_run_confirms_nothing_and_checkpointing_the_trainer_enables_is_checked_per_layer(tmp_path):
    trainer = _trainer(tmp_path, checkpointing=True)
    callback = protect_trainer(trainer, guard_config(tmp_path))
    trainer.train()
    summary = callback.summary
    assert summary is not None and summary.steps == 8
    assert summary.confirmed == 0 and summary.not_verifiable == 0
    assert summary.coverage["recompute_sites_checked"] == ["model.layers.0:recompute", "model.layers.1:recompute"]
    assert summary.attention_checks == 8 * 2 * 2


def test_protecting_without_the_trainers_optimizer_warns_with_the_fix(tmp_path):
    trainer = _trainer(tmp_path, steps=3)
    guard = aegis.protect(trainer.model, config=guard_config(tmp_path, max_pending_calls=64))
    with pytest.warns(UserWarning, match="no step boundary yet.*protect_trainer"):
        trainer.train()
    guard.close()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_enabled_after_protect_is_checked_or_named(tmp_path, reentrant):
    # Enabled after protect() (as a Trainer or a user may): non-reentrant segments are checked per
    # layer from the next step on; reentrant ones run unchecked and are named, once, with the fix.
    trainer = _trainer(tmp_path)
    model = trainer.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))

    def steps(n):
        for _ in range(n):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    if reentrant:
        with pytest.warns(UserWarning, match="recomputation not checked — reentrant"):
            steps(3)
    else:
        steps(3)
    summary = guard.close()
    layers = ["model.layers.0:recompute", "model.layers.1:recompute"]
    assert summary.confirmed == 0
    if reentrant:
        assert summary.coverage["recompute_sites_checked"] == []
        assert all("reentrant" in summary.coverage["not_covered"][name] for name in layers)
    else:
        assert summary.coverage["recompute_sites_checked"] == layers
