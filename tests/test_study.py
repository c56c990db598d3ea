"""The paired healthy-vs-suspect study on the CPU workload (docs/study.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.helpers import SMALL
from typer.testing import CliRunner

from aegis_sdc.cli import app
from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.store.sqlite import rank_db_path, read_study
from aegis_sdc.study.config import MODES, StudyConfig
from aegis_sdc.study.harness import run_study
from aegis_sdc.study.modes import NondeterminismError
from aegis_sdc.study.summary import is_comparison
from aegis_sdc.workloads.llama import Llama

TOKENS = 4 * 32  # batch × sequence of the studies below


def study(tmp_path, mode: str, *faults: str, steps: int = 10, plots: bool = False, **kwargs):
    cfg = StudyConfig(
        mode=mode,
        steps=steps,
        faults=tuple(FaultSpec.parse(f) for f in faults),
        model=SMALL,
        batch_size=4,
        seq_len=32,
        finetune_steps=kwargs.pop("finetune_steps", 3),
        eval_batches=2,
        run_dir=str(tmp_path / f"study-{mode}"),
        **kwargs,
    )
    return run_study(cfg, plots=plots)


def metric(rows, name: str, scope: str | None = None) -> dict[int, float]:
    return {step: v for step, s, m, v in rows if m == name and (scope is None or s == scope)}


def assert_bit_identical(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), name


@pytest.mark.parametrize("mode", MODES)
def test_without_a_fault_every_metric_is_exactly_zero_and_the_replicas_end_bit_identical(tmp_path, mode):
    result = study(tmp_path, mode, steps=8, plots=True)
    stored = read_study(rank_db_path(result.run_dir, 0))
    assert stored["mode"] == mode and stored["summary"] == json.loads(json.dumps(result.summary))
    comparisons = [(step, scope, m, v) for step, scope, m, v in stored["rows"] if is_comparison(scope, m)]
    # Not vacuous: every step carries comparisons (compute-sync: every unit and phase).
    assert {step for step, *_ in comparisons} >= set(range(8))
    assert [row for row in comparisons if row[3] != 0.0] == []
    assert metric(stored["rows"], "suspect", "loss") == metric(stored["rows"], "healthy", "loss")
    assert result.summary["first_affected_step"] is None and result.summary["faults_fired"] == 0
    assert result.summary["replicas_bit_identical"]
    assert_bit_identical(result.replicas["suspect"].model, result.replicas["healthy"].model)
    assert all(path.stat().st_size > 10_000 for path in result.plots)
    if mode == "compute-sync":
        scopes = {scope for _, scope, m, _ in comparisons}
        assert {"layers.0.mlp/forward", "layers.0.attn/backward", "layers.0.mlp/param_grad"} <= scopes
    if mode == "free-run":
        # The reseeded baseline really is another run (the divergence a study compares against) ...
        assert all(v > 0 for v in metric(stored["rows"], "param_divergence", "baseline").values())
        finetune = result.summary["finetune"]  # ... and the fine-tuned replicas score identically.
        assert finetune["accuracy_suspect"] == finetune["accuracy_healthy"]


def test_compute_sync_shows_a_forward_fault_at_its_submodule_and_step_only(tmp_path):
    result = study(tmp_path, "compute-sync", "layers.0.mlp.up_proj:fwd@model=bitflip,bit=22,steps=5")
    assert [(i.site, i.step) for i in result.injected] == [("layers.0.mlp.up_proj:fwd", 5)]
    frequency = [(step, scope, v) for step, scope, m, v in result.rows if m == "mismatch_frequency" and v != 0]
    forward = [(step, scope, v) for step, scope, v in frequency if scope.endswith("/forward")]
    # One corrupted element of up_proj's [tokens, hidden] output reaches, through down_proj, the row
    # of its token in the MLP's [tokens, dim] output (all of it, but for an element whose change
    # rounds away); the overwrite stops it there: no other submodule, no other step.
    assert [(step, scope) for step, scope, _ in forward] == [(5, "layers.0.mlp/forward")]
    assert 0.9 / TOKENS <= forward[0][2] <= 1 / TOKENS
    assert {step for step, _, _ in frequency} == {5}
    # In the backward the saved, corrupted activation changes the MLP's own gradients, nothing else.
    assert {scope for _, scope, _ in frequency} == {
        "layers.0.mlp/forward",
        "layers.0.mlp/backward",
        "layers.0.mlp/param_grad",
    }
    severity = metric(result.rows, "severity_max", "layers.0.mlp/forward")
    assert severity[5] > 0 and all(v == 0 for step, v in severity.items() if step != 5)
    assert result.summary["first_affected_step"] == 5
    assert result.summary["mismatches"][0]["unit"] == "layers.0.mlp"
    assert result.summary["replicas_bit_identical"]  # synchronized: the error never propagated


def test_compute_sync_taps_the_backward(tmp_path):
    result = study(tmp_path, "compute-sync", "layers.0.attn.wv:dgrad@model=bitflip,bit=22,steps=3")
    frequency = [(step, scope) for step, scope, m, v in result.rows if m == "mismatch_frequency" and v != 0]
    # A dgrad fault corrupts one element of the attention's input gradient [tokens, dim]; the forward is clean.
    assert frequency == [(3, "layers.0.attn/backward")]
    assert metric(result.rows, "mismatch_frequency", "layers.0.attn/backward")[3] == 1 / (TOKENS * SMALL.dim)


def test_param_sync_shows_the_gradient_deviation_of_the_fault_step(tmp_path):
    result = study(tmp_path, "param-sync", "layers.0.mlp.down_proj:wgrad@model=bitflip,bit=22,steps=4")
    overall = metric(result.rows, "grad_deviation", "all")
    assert overall[4] > 0 and all(v == 0 for step, v in overall.items() if step != 4)
    # A wgrad fault corrupts one weight's gradient and nothing else of the step's backward.
    at_fault = {scope: v for step, scope, m, v in result.rows if m == "grad_deviation" and step == 4}
    assert at_fault["layers.0"] > 0
    assert [scope for scope, v in at_fault.items() if v != 0] == ["layers.0", "all"]
    # The suspect continues from the healthy state, so later steps are exact again.
    assert result.summary["steps_with_grad_deviation"] == [4]


def test_param_sync_forward_fault_deviates_every_layer_it_reaches(tmp_path):
    result = study(tmp_path, "param-sync", "layers.0.mlp.up_proj:fwd@model=bitflip,bit=22,steps=2", steps=4)
    at_fault = {scope: v for step, scope, m, v in result.rows if m == "grad_deviation" and step == 2}
    # The corrupted activation flows into the final norm and the head, and back into the embedding.
    assert all(at_fault[layer] > 0 for layer in ("tok_embeddings", "layers.0", "norm", "lm_head", "all"))
    assert result.summary["steps_with_grad_deviation"] == [2]


def test_free_run_divergence_starts_at_the_fault_step_and_grows(tmp_path):
    result = study(tmp_path, "free-run", "layers.0.mlp.up_proj:fwd@model=bitflip,bit=22,steps=4", steps=24)
    divergence = metric(result.rows, "param_divergence", "all")
    assert all(divergence[step] == 0 for step in range(4))
    assert divergence[4] > 0
    # Training carries the difference on and amplifies it (measured: 3.1e-5 at step 4, growing every
    # step to 2.2e-4 at step 23, 7×), yet it stays far below the natural divergence of a reseeded run.
    assert all(divergence[step] > 0 for step in range(4, 24))
    assert divergence[23] > 3 * divergence[4]
    assert divergence[23] < 0.01 * metric(result.rows, "param_divergence", "baseline")[23]
    losses_h, losses_s = metric(result.rows, "healthy", "loss"), metric(result.rows, "suspect", "loss")
    assert all(losses_h[step] == losses_s[step] for step in range(4))
    assert result.summary["first_divergent_step"] == 4
    assert not result.summary["replicas_bit_identical"]


def test_free_run_marks_a_blow_up_as_spikes_and_a_ruined_fine_tune(tmp_path):
    # A broken unit: every forward call of every Linear flips the exponent's top bit from step 6.
    result = study(tmp_path, "free-run", "*:fwd@model=bitflip,bit=30,probability=1.0,start_step=6", steps=30)
    s = result.summary
    assert s["first_affected_step"] == 6
    assert s["first_nonfinite_loss_step"] is not None and s["spikes"]["suspect_only"]["count"] > 0
    assert s["spikes"]["healthy"]["count"] == 0
    assert not math.isfinite(s["final_divergence"])  # the suspect's weights are no longer finite ...
    assert s["finetune"]["accuracy_suspect"] == 0.0 < s["finetune"]["accuracy_healthy"]  # ... nor usable


class _NumpyNoise:
    """A forward hook with randomness outside torch's generators: a non-deterministic training."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng()  # seeded from the OS: differs between replicas

    def __call__(self, module, args, output):
        return output + float(self.rng.normal()) * 1e-6


def test_a_nondeterministic_training_is_refused_naming_the_first_differing_tensor(tmp_path):
    def factory():
        model = Llama(SMALL)
        model.layers[0].mlp.register_forward_hook(_NumpyNoise())
        return model

    cfg = StudyConfig(mode="free-run", steps=5, model=SMALL, batch_size=2, seq_len=16, run_dir=str(tmp_path / "r"))
    with pytest.raises(NondeterminismError, match=r"at step 0 the first differing tensor is layers\.0\.mlp output"):
        run_study(cfg, model_factory=factory)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_randomness_through_torch_is_replayed_per_replica(tmp_path):
    def factory():  # dropout after the MLP: random, but drawn from torch's generator
        model = Llama(SMALL)
        model.layers[0].mlp.register_forward_hook(lambda m, a, out: F.dropout(out, p=0.1, training=True))
        return model

    cfg = StudyConfig(mode="compute-sync", steps=4, model=SMALL, batch_size=2, seq_len=16, run_dir=str(tmp_path / "r"))
    result = run_study(cfg, model_factory=factory, plots=False)
    assert result.summary["first_affected_step"] is None and result.summary["replicas_bit_identical"]


def test_study_config_rejects_bad_values():
    with pytest.raises(ValueError, match="mode must be one of"):
        StudyConfig(mode="sync")
    with pytest.raises(ValueError, match="seq_len 512 exceeds"):
        StudyConfig(seq_len=512)
    with pytest.raises(ValueError, match="baseline_seed must differ"):
        StudyConfig(seed=3, baseline_seed=3)
    with pytest.raises(ValueError, match="not a device"):
        StudyConfig(device="gpu7")


def test_fault_spec_command_line_form():
    spec = FaultSpec.parse("layers.1.mlp.up_proj:fwd@model=bitflip,bit=22,steps=40+100-102")
    assert (spec.site, spec.model, spec.bit, spec.steps) == (
        "layers.1.mlp.up_proj:fwd",
        "bitflip",
        22,
        (40, 100, 101, 102),
    )
    burst = FaultSpec.parse("*:wgrad@probability=0.5,start_step=10,stop_step=20")
    assert (burst.probability, burst.start_step, burst.stop_step) == (0.5, 10, 20)
    with pytest.raises(ValueError, match="a field among"):
        FaultSpec.parse("x:fwd@colour=red")
    with pytest.raises(ValueError, match="bad value for bit"):
        FaultSpec.parse("x:fwd@bit=high,steps=1")
    with pytest.raises(ValueError, match="never fires"):
        FaultSpec.parse("x:fwd")


def test_cli_study_writes_the_run_and_prints_the_summary(tmp_path):
    args = ["study", "--mode", "param-sync", "--steps", "3", "--batch-size", "2", "--seq-len", "16"]
    run = CliRunner().invoke(
        app,
        [
            *args,
            "--fault",
            "layers.1.mlp.up_proj:fwd@model=bitflip,bit=22,steps=1",
            "--run-dir",
            str(tmp_path / "r"),
            "--json",
        ],
    )
    assert run.exit_code == 0, run.output
    summary = json.loads(run.stdout)
    assert summary["steps_with_grad_deviation"] == [1] and summary["faults_fired"] == 1
    assert "param-sync: 1/3" in run.stderr and "param-sync: 3/3" in run.stderr  # a log's progress lines
    assert (tmp_path / "r" / "study-grad-deviation.png").exists()
    bad = CliRunner().invoke(app, [*args, "--fault", "layers.1.mlp.up_proj:fwd@bit=x"])
    assert bad.exit_code == 2 and "bad value for bit" in bad.output
    again = CliRunner().invoke(app, [*args, "--no-fault", "--run-dir", str(tmp_path / "r")])
    assert again.exit_code == 2 and "already holds a store" in " ".join(again.output.split())


def test_a_hugging_face_model_is_studied_through_its_containers(tmp_path):
    # An HF `LlamaForCausalLM` behind the study's model interface: its blocks sit two containers down
    # (`model.model.layers`), its output is not a tensor. The units are found through the containers,
    # a fault fires at its site, and compute-sync names the block it struck.
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from aegis_sdc.study.taps import study_units

    class CausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = HFLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=SMALL.vocab_size, max_position_embeddings=32,
                                   attn_implementation="eager")  # fmt: skip
            self.model = LlamaForCausalLM(config)

        def forward(self, tokens):
            return self.model(input_ids=tokens).logits

    units = study_units(CausalLM())
    expected = {"model.model.embed_tokens", "model.model.layers.1", "model.model.layers.1.mlp", "model.lm_head"}
    assert expected <= set(units)
    fault = FaultSpec.parse("model.model.layers.1.mlp.up_proj:fwd@model=bitflip,bit=30,steps=3")
    cfg = StudyConfig(mode="compute-sync", steps=6, model=SMALL, batch_size=2, seq_len=32, run_dir=str(tmp_path / "s"),
                      faults=(fault,))  # fmt: skip
    result = run_study(cfg, model_factory=CausalLM, plots=False)
    summary = result.summary
    assert summary["faults_fired"] == 1 and summary["first_affected_step"] == 3
    assert {m["unit"] for m in summary["mismatches"]} >= {"model.model.layers.1.mlp"}
