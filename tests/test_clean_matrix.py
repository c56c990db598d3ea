"""The clean-run matrix: every common way of training ends with zero confirmed incidents on a healthy
device, and one injected fault per cell is confirmed at its site and step.

Cells (`workloads/setups.py`): AdamW fused / foreach / for-loop, SGD with momentum, hand-written
`p.data` updates in both orders, GradScaler with fp16 autocast, bf16 weights, bf16 autocast, fp32
matmuls allowed to round (TF32 / bf16), activation checkpointing, gradient accumulation,
`load_state_dict` mid-run, and Hugging Face Llama (GQA), Qwen2, GPT-2 and BERT (dropout on) built
from configs. Data-parallel cells (2 and 3 ranks) are in test_distributed.py.

The thresholds are set to a hair trigger (margin 1: about half of the checks after calibration
alarm; relax window 10), so every cell replays hundreds of alarms — the triage, not a quiet
threshold, is what keeps the device from being blamed — and passes calibration, false alarms,
widening and relaxation within its 40 steps.
"""

from __future__ import annotations

import pytest
import torch

import aegis_sdc as aegis
from aegis_sdc.workloads.setups import Setup, matrix, run_setup

STEPS = 40
FAULT_STEP = 30  # after calibration (16 checks), in the middle of the widen / relax cycles
HAIR_TRIGGER = aegis.ThresholdConfig(margin=1.0, relax_window=10)
WEIGHTS_CHANGE_FIRST = "manual-update-then-step"


def guard_config(tmp_path, faults=(), backend="auto", thresholds=HAIR_TRIGGER) -> aegis.GuardConfig:
    return aegis.GuardConfig(
        run_dir=str(tmp_path / "run"),
        thresholds=thresholds,
        faults=faults,
        backend=backend,
        sampling=aegis.SamplingConfig.every_call(),  # every call checked, on the GPU too
        response=aegis.ResponseConfig(quarantine=False),
    )


def bitflip(setup: Setup) -> aegis.FaultSpec:
    # bit 27: the exponent moves by 16 (×2¹⁶ or ÷2¹⁶): far above any threshold, finite in fp32
    return aegis.FaultSpec(site=setup.fault_site, model="bitflip", bit=27, steps=(FAULT_STEP,))


def needs_transformers(setup: Setup) -> None:
    if setup.model.startswith("hf-"):
        pytest.importorskip("transformers")


def assert_clean(setup: Setup, result, *, strict: bool) -> None:
    s = result.summary
    assert result.incidents == [] and s["confirmed"] == 0 and s["unattributed"] == 0, result.incidents
    assert s["checks"] > 0 and s["alarms"] > 0  # the hair trigger made the cell replay
    assert result.relaxations >= 1 and result.uncalibrated == []  # calibrated, widened and relaxed
    if setup.precision in ("autocast-bf16", "autocast-fp16") and setup.model in ("llama", "hf-llama"):
        assert s["attention_checks"] > 0 or not strict  # attention checked on the CPU under autocast
    if not strict:
        return  # GPU: a step with more alarms than capture slots leaves some not verifiable
    # Every alarm was replayed and judged; only a weight that changed before verification makes a
    # replay impossible, and that is said, never turned into a verdict against the device.
    judged = s["false_alarms"] + s["not_verifiable"] + s["nonfinite_inputs"]
    assert judged == s["alarms"]
    if setup.name == WEIGHTS_CHANGE_FIRST:
        assert s["not_verifiable"] > 0
    else:
        assert s["not_verifiable"] == 0


def assert_fault_confirmed(setup: Setup, result) -> None:
    assert result.injected == [(setup.fault_site, FAULT_STEP)]
    assert result.incidents == [(setup.fault_site, FAULT_STEP, 0)]


CPU_CELLS = matrix("tiny")


@pytest.mark.slow
@pytest.mark.parametrize("setup", CPU_CELLS, ids=[s.name for s in CPU_CELLS])
def test_a_clean_run_confirms_nothing(setup, tmp_path):
    needs_transformers(setup)
    result = run_setup(setup, guard_config(tmp_path), steps=STEPS)
    assert_clean(setup, result, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("setup", CPU_CELLS, ids=[s.name for s in CPU_CELLS])
def test_one_injected_fault_is_confirmed_at_its_site_and_step(setup, tmp_path):
    needs_transformers(setup)
    result = run_setup(setup, guard_config(tmp_path, faults=(bitflip(setup),)), steps=STEPS)
    assert_fault_confirmed(setup, result)
    assert result.summary["confirmed"] == 1


def test_a_forward_fault_after_the_weights_changed_is_not_verifiable_never_confirmed(tmp_path):
    # guard.step() after a p.data update: a forward replay must reference the weight, which is no
    # longer the one the step multiplied — and no version counter says so. The verdict says why.
    setup = Setup(WEIGHTS_CHANGE_FIRST, optimizer=WEIGHTS_CHANGE_FIRST, fault_site="layers.0.mlp.up_proj:fwd")
    result = run_setup(setup, guard_config(tmp_path, faults=(bitflip(setup),)), steps=FAULT_STEP + 2)
    assert result.injected == [(setup.fault_site, FAULT_STEP)]
    assert result.incidents == [] and result.summary["confirmed"] == 0
    assert result.verdicts.get("not_verifiable", 0) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("setup", matrix("small"), ids=[s.name for s in matrix("small")])
def test_gpu_clean_run_confirms_nothing_and_a_fault_is_confirmed(setup, tmp_path):
    # fp32 cells: the reference path by request (with backend "auto" fp32 GPU layers run unchecked,
    # named in the coverage: tests/test_hot_path.py); the matrix still judges their loops
    backend = "reference" if setup.precision == "fp32" else "auto"
    clean = run_setup(setup, guard_config(tmp_path / "clean", backend=backend), steps=STEPS, device="cuda")
    assert_clean(setup, clean, strict=False)
    # Default thresholds for the fault: under the hair trigger a step alarms more often than the
    # device keeps capture slots (4 per step), and a late GEMM's fault can find them all taken.
    config = guard_config(tmp_path / "faulty", faults=(bitflip(setup),), thresholds=aegis.ThresholdConfig(),
                          backend=backend)  # fmt: skip
    assert_fault_confirmed(setup, run_setup(setup, config, steps=STEPS, device="cuda"))


def test_matrix_cells_have_unique_names_and_sites_of_every_gemm_kind():
    names = [s.name for s in CPU_CELLS]
    assert len(set(names)) == len(names)
    assert {s.fault_site.rsplit(":", 1)[1] for s in CPU_CELLS} == {"fwd", "dgrad", "wgrad"}
    with pytest.raises(ValueError, match=r"Setup\.optimizer"):
        Setup("x", optimizer="adam")
    assert torch.get_float32_matmul_precision() == "highest"  # no cell leaks its precision setting
