"""The pieces that keep a healthy device from being blamed: nothing derived from a weight outlives its
step, a replay that cannot see the step's operands is not verifiable, checked ops and replays run
with the same numerics whatever the caller set, rank outliers are named only by a majority, and
unusual data does not widen thresholds."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers import guard_config
from tests.test_verifier import make_task
from torch import nn

import aegis_sdc as aegis
from aegis_sdc.config import ThresholdConfig, VerifyConfig
from aegis_sdc.distributed.outlier import detect_outliers
from aegis_sdc.events import GemmKind, Site, VerdictKind
from aegis_sdc.kernels.numerics import exact_fp32
from aegis_sdc.kernels.reference import Tiling, bitwise_equal, checked_gemm
from aegis_sdc.ops.checked_attention import CallReplay, autocast_inputs, checked_attention
from aegis_sdc.sensors.thresholds import ThresholdState
from aegis_sdc.verify.verifier import Verifier

SITES = [Site(i, f"layer{i}", GemmKind.FORWARD) for i in range(2)]


# -- the replay's operands --------------------------------------------------------------------------
def test_a_weight_written_through_data_before_the_replay_is_not_verifiable_with_the_reason():
    task, b = make_task()
    b.data.add_(1e-3)  # a p.data update: no version counter moves, the replay sees other operands
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.NOT_VERIFIABLE
    assert "changed after the step without bumping its version" in verdict.detail
    assert "two recomputations agree" in verdict.detail


def test_a_fault_is_still_confirmed_when_the_weight_is_untouched():
    from tests.test_verifier import fault_at

    task, _ = make_task(fault=fault_at(40, 20))
    assert Verifier(VerifyConfig()).verify(task, step=3).kind is VerdictKind.CONFIRMED_SDC


@pytest.mark.parametrize("update", ["data", "fused"])
def test_weight_stats_never_outlive_their_step(update, tmp_path):
    # The Triton path (interpreted on the CPU) takes c = Wᵀ·1 from a per-step cache. Weights updated
    # without a version bump — p.data writes, fused AdamW — must not leave the next step a stale c:
    # every check would then differ by the update, and replays (which recompute c) blamed the device.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if update == "fused" else None
    config = guard_config(tmp_path, backend="triton", thresholds=ThresholdConfig(calibration_checks=4))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    for _ in range(10):
        versions = [p._version for p in model.parameters()]
        model(torch.randn(32, 64)).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            guard.step()
            with torch.no_grad():
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.5)
                    p.grad = None
        assert [p._version for p in model.parameters()] == versions  # the updates left no trace
    summary = guard.close()
    assert summary.checks == 50  # 10 steps × 5 GEMMs (the first layer's input needs no gradient)
    assert summary.alarms == 0 and summary.confirmed == 0  # a stale c alarms on every forward and dgrad


# -- numerics --------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_checked_gemms_compute_the_same_bits_whatever_the_fp32_matmul_precision(precision):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 160, generator=g), torch.randn(160, 80, generator=g)
    exact = checked_gemm(a, b, out_dtype=torch.float32, tiling=Tiling(32, 32))
    torch.set_float32_matmul_precision(precision)  # TF32 on CUDA, bf16 in oneDNN on the CPU
    try:
        again = checked_gemm(a, b, out_dtype=torch.float32, tiling=Tiling(32, 32))
        assert torch.get_float32_matmul_precision() == precision  # the caller's setting is back
    finally:
        torch.set_float32_matmul_precision("highest")
    assert bitwise_equal(exact.out, again.out) and bitwise_equal(exact.row_partials, again.row_partials)


def test_exact_fp32_restores_settings_made_through_either_api():
    matmul = torch.backends.cuda.matmul
    torch.backends.cuda.matmul.allow_tf32 = True  # the legacy flag
    try:
        with exact_fp32("cpu"):
            assert matmul.fp32_precision == "ieee" and torch.backends.mkldnn.matmul.fp32_precision in ("ieee", "none")
            assert not torch.is_autocast_enabled("cpu")
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    with torch.autocast("cpu", dtype=torch.bfloat16), exact_fp32("cpu"):
        assert not torch.is_autocast_enabled("cpu")


class _Recorder:
    """Attention hooks that check every call and keep its replay context."""

    def __init__(self):
        self.replays = {}

    def plan(self, heads):
        return "plan"

    def fault_for(self, plan, backward):
        return None

    def observe(self, plan, backward, values, capture):
        self.replays[backward] = capture(0)


def test_attention_under_autocast_takes_sdpa_dtypes_and_replays_bit_for_bit():
    # Hugging Face Llama under bf16 autocast: q and k leave RoPE in fp32, v stays bf16.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 16, 32, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 16, 32, generator=g).bfloat16().requires_grad_()
    hooks = _Recorder()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {t.dtype for t in autocast_inputs(q, k, v)} == {torch.bfloat16}
        out = checked_attention(q, k, v, causal=True, hooks=hooks)
        kv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        reference = torch.nn.functional.scaled_dot_product_attention(q, *kv, is_causal=True)
    assert out.dtype == torch.bfloat16 == reference.dtype
    # bf16 outputs of two correct implementations: within a few bf16 ulps (2⁻⁸ relative) of each other
    torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    assert q.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    replay: CallReplay = hooks.replays[False]  # replayed at the step's end: outside autocast
    assert all(bitwise_equal(x, y) for x, y in zip(replay.forward_outputs(), replay.saved_forward(), strict=True))
    backward: CallReplay = hooks.replays[True]
    assert all(bitwise_equal(x, y) for x, y in zip(backward.backward_outputs(), backward.grads, strict=True))


# -- rank attribution ------------------------------------------------------------------------------
def _warnings(rows, ranks=None):
    gathered = torch.tensor(rows, dtype=torch.float64)
    return detect_outliers(gathered, ranks or list(range(len(rows))), SITES, 7, 10.0, 0.9)


def test_two_ranks_report_a_disagreement_and_name_neither():
    (warning,) = _warnings([[20.0, 20.0], [400.0, 21.0]])
    assert warning.rank is None and warning.ranks == (0, 1) and warning.values == (20.0, 400.0)
    assert warning.store_rank == 0 and "no rank named" in warning.describe()
    # a corrupted rank whose values *fall* makes its healthy peer stand out: still nobody named
    (low,) = _warnings([[30.0, 20.0], [1.0, 20.0]])
    assert low.rank is None and low.ranks == (0, 1)


def test_a_majority_names_the_rank_that_stands_out_and_only_then():
    (warning,) = _warnings([[20.0, 20.0], [600.0, 22.0], [21.0, 19.0]], ranks=[4, 5, 6])
    assert warning.rank == 5 and warning.ranks == (5,) and warning.site == SITES[0]
    assert "the other ranks agree" in warning.describe()
    assert _warnings([[30.0, 20.0], [1.0, 20.0], [28.0, 20.0]]) == []  # one rank low: nobody stands out
    (named,) = _warnings([[20.0, 5.0], [20.0, 5.0], [900.0, 5.0], [22.0, 5.0]])
    assert named.rank == 2
    (split,) = _warnings([[1.0, 5.0], [30.0, 5.0], [9000.0, 5.0]])  # the other two disagree as well
    assert split.rank is None and split.ranks == (0, 1, 2)
    assert _warnings([[20.0, math.nan], [21.0, math.nan], [22.0, 5.0]]) == []  # unchecked sites skipped


# -- thresholds and data ---------------------------------------------------------------------------
def test_a_false_alarm_with_a_nonfinite_value_widens_nothing():
    state = ThresholdState(ThresholdConfig(calibration_checks=1), hard_bound=1e6)
    state.observe_clean(10.0)
    state.on_false_alarm(math.nan)
    state.on_false_alarm(math.inf)
    assert state.current == 40.0 and state.false_alarms == 2


def test_an_extreme_batch_leaves_the_thresholds_alone(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    # margin 2.5 (default 4): the extreme batch's largest normalized difference (~204 on the wgrad's
    # column check here, ~3.5× that site's clean values) must cross its threshold whatever CPU rounds
    # it; with the default margin it sat at 0.99× the threshold on one CPU and alarmed on another.
    # Clean checks stay under 2× the calibration median (docs/thresholds.md): no clean alarm.
    config = guard_config(tmp_path, thresholds=aegis.ThresholdConfig(margin=2.5))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    extreme = 30
    before = None
    for step in range(40):
        x = torch.randn(512, 64) * (1e30 if step == extreme else 1.0)
        out = model(x)
        (out.mean() if step == extreme else out.square().mean()).backward()
        if step == extreme:
            before = [(s.row.current, s.col.current) for s in guard.sensors]
            for p in model.parameters():  # keep the model finite: this batch trains nothing
                p.grad = None
        optimizer.step()
        optimizer.zero_grad()
        if step == extreme:
            after = [(s.row.current, s.col.current) for s in guard.sensors]
    summary = guard.close()
    assert summary.data_false_alarms >= 1  # the batch did alarm (and replayed bit for bit) ...
    assert after == before  # ... and no threshold paid for it
    assert summary.confirmed == 0


def test_a_corruption_pinned_on_no_device_gets_the_policy_but_quarantines_nothing(tmp_path):
    from aegis_sdc.config import ResponseConfig
    from aegis_sdc.events import Verdict
    from aegis_sdc.response.policies import Responder, SilentDataCorruptionError, SilentDataCorruptionWarning

    verdict = Verdict(1, SITES[0], 5, VerdictKind.UNATTRIBUTED, detail="ranks whose check failed: [1]")
    quarantine = tmp_path / "quarantine.jsonl"
    with pytest.raises(SilentDataCorruptionError) as raised:
        Responder(ResponseConfig(policy="raise"), str(quarantine)).respond([], None, [verdict])
    assert raised.value.incident is None and raised.value.unattributed == (verdict,)
    assert "no device named" in str(raised.value)
    with pytest.warns(SilentDataCorruptionWarning, match="no device named"):
        Responder(ResponseConfig(policy="warn"), str(quarantine)).respond([], None, [verdict])
    assert not quarantine.exists()
