"""The hot path: the per-step sampling plan, unsampled calls as plain `F.linear`, sampling to a
budget, and (GPU) the gated step end — no host sync in forward/backward, no waiting before the
optimizer, a held-back update on an alarm."""

from __future__ import annotations

import dataclasses
import sqlite3

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.helpers import MEDIUM, guard_config, hf_llama, small_workload, train, train_until_raised
from torch import nn

import aegis_sdc as aegis
from aegis_sdc.hashing import unit_hash, unit_hash_array
from aegis_sdc.ops import checked_linear
from aegis_sdc.ops.transfer import start_to_host
from aegis_sdc.runtime.budget import plan_budget
from aegis_sdc.runtime.plan import StepPlan
from aegis_sdc.sensors.sampling import Sampler
from aegis_sdc.workloads.llama import Llama, lm_loss


def test_vectorized_hash_equals_the_scalar_one():
    ids = np.arange(300)
    assert unit_hash_array(7, 0x5A3D, ids, 11, 2).tolist() == [unit_hash(7, 0x5A3D, int(i), 11, 2) for i in ids]


def test_the_step_plan_draws_what_the_sampler_draws_for_every_call():
    plan, sampler = StepPlan(seed=3), Sampler(0.3, (), seed=3)
    for _ in range(4):
        plan.add_linear((0.3, 0.3, 0.3))
    for step in range(20):
        plan.begin(step)
        for call in range(3):
            drawn = [plan.checked(site, call) for site in range(12)]
            assert drawn == [sampler.should_check(0.3, site, step, call) for site in range(12)]
            for linear in range(4):
                taken = plan.take(linear)
                assert (taken is not None) == any(drawn[3 * linear : 3 * linear + 3])
                assert taken in (None, call)
    assert plan.take_counts() == [3, 3, 3, 3] and plan.take_counts() == [0, 0, 0, 0]


def test_calibrating_sites_are_checked_and_faulted_linears_take_the_planned_path():
    plan = StepPlan(seed=0)
    plan.add_linear((0.0, 0.0, 0.0))
    plan.add_linear((0.0, 0.0, 0.0))
    plan.begin(5, calibrating=np.array([False, True, False, False, False, False]),
               faulted=np.array([False, False, False, False, False, True]))  # fmt: skip
    assert plan.checked(1, 0) and not plan.checked(0, 0) and not plan.checked(5, 0)
    assert plan.take(0) == 0 and plan.take(1) == 0  # linear 1: not checked, but its fault must fire


def test_unsampled_calls_never_enter_the_checked_op(tmp_path, monkeypatch):
    entered = []
    original = checked_linear.CheckedLinearFunction.apply
    monkeypatch.setattr(checked_linear.CheckedLinearFunction, "apply", lambda *a: entered.append(1) or original(*a))
    model, data, optimizer = small_workload()
    config = guard_config(tmp_path, sampling=aegis.SamplingConfig(probability=0.0),
                          thresholds=aegis.ThresholdConfig(calibration_checks=2))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    train(model, data, optimizer, 3)  # calibration: 2 checked steps
    calibrating = len(entered)
    train(model, data, optimizer, 5)
    summary = guard.close()
    assert calibrating == 2 * 8 and len(entered) == calibrating  # 8 Linears; nothing after calibration
    assert summary.checks == 2 * 8 * 3 and summary.confirmed == 0


def test_a_step_without_checks_is_concluded_after_the_update_is_launched(tmp_path, monkeypatch):
    # Nothing in such a step can hold the update back, so its bookkeeping (the read, the store rows)
    # waits until the optimizer has run: the GPU never idles behind it. A checked step still concludes
    # before the update with this (non-fused) optimizer.
    from aegis_sdc.runtime.step import StepRuntime

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = guard_config(tmp_path, sampling=aegis.SamplingConfig(probability=0.0),
                          thresholds=aegis.ThresholdConfig(calibration_checks=2))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    order = []
    conclude = StepRuntime.conclude
    monkeypatch.setattr(StepRuntime, "conclude", lambda self, *a, **k: order.append("conclude")
                        or conclude(self, *a, **k))  # fmt: skip
    optimizer.register_step_pre_hook(lambda *_: order.append("update"))  # after the guard's pre-hook
    for _ in range(5):  # 2 calibration steps, then 3 without checks
        model(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = guard.close()
    assert order[:4] == ["conclude", "update"] * 2  # checked: judged before the update
    assert order[4:10] == ["update", "conclude"] * 3  # unchecked: after it
    # 5 GEMMs a step (the first Linear has no dgrad: its input needs no gradient), 2 checked steps
    assert order.count("conclude") >= 5 and summary.checks == 2 * 5 and summary.confirmed == 0


def test_the_store_counts_every_call_and_the_checked_flops(tmp_path):
    model, data, optimizer = small_workload()
    sampling = aegis.SamplingConfig(probability=0.5, seed=1)
    config = guard_config(tmp_path, sampling=sampling, thresholds=aegis.ThresholdConfig(calibration_checks=1))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    train(model, data, optimizer, 6)
    summary = guard.close()
    conn = sqlite3.connect(next((tmp_path / "run").glob("*.sqlite")))
    calls = conn.execute("SELECT step, SUM(calls), SUM(checks) FROM step_stats GROUP BY step").fetchall()
    flops = conn.execute("SELECT step, gemm_flops, checked_flops FROM steps ORDER BY step").fetchall()
    assert all(total == 24 for _, total, _ in calls)  # 8 Linears × 3 GEMMs, each called once per step
    assert flops[0][2] == flops[0][1] > 0  # calibration: everything checked
    later = [checked / total for _, total, checked in flops[1:] if total]  # close() adds an empty row
    assert all(0.0 <= f < 1.0 for f in later) and 0.0 < summary.checked_flops_fraction < 1.0


def test_the_budget_plan_fills_the_budget_by_flops_per_millisecond():
    flops = np.array([100.0, 100.0, 1000.0, 10.0])
    cost = np.array([1.0, 2.0, 1.0, 1.0])  # ms per check
    calls = np.ones(4)
    plan = plan_budget(flops, calls, cost, np.ones(4), allowed_ms=1.5, rotation_steps=100)
    p = plan.probabilities
    assert plan.expected_ms == pytest.approx(1.5)
    # floors 0.01 each (0.05 ms), then the best FLOPs per ms first: site 2 to 1, site 0 with the rest
    assert p.tolist() == pytest.approx([0.47, 0.01, 1.0, 0.01])
    capped = plan_budget(flops, calls, cost, np.array([1.0, 1.0, 0.0, 1.0]), allowed_ms=1.5, rotation_steps=100)
    assert capped.probabilities[2] == 0.0  # a per-site rule of 0 excludes the site
    tight = plan_budget(flops, calls, cost, np.ones(4), allowed_ms=0.01, rotation_steps=100)
    assert tight.expected_ms == pytest.approx(0.01)  # floors shrink alike when even they do not fit


def test_a_checks_cost_scales_its_gemm_to_the_calls_tokens_but_not_the_weights_pass(monkeypatch):
    # A wide lm_head (vocabulary 32000) at 8192 tokens is timed at 2097 tokens (its operands capped)
    # and carried to 8192: the checked GEMM's extra time grows with the tokens, the per-step pass
    # over the weight does not (it was scaled too, charging the head's weight pass ×3.9).
    from aegis_sdc.kernels.reference import Tiling
    from aegis_sdc.ops import cost

    def timed(fn, device):  # which part is timed, from the names its code calls
        names = fn.__code__.co_names
        return 5.0 if "weight_side_matrices" in names else 12.0 if "launch_checked_gemm" in names else 10.0

    monkeypatch.setattr(cost, "_median_ms", timed)
    ms = cost.check_cost_ms("fwd", (8192, 2048, 32000), torch.bfloat16, torch.device("cpu"), col_check=False,
                            triton=True, tiling=Tiling())  # fmt: skip
    # the same extra time at 2097 and 1048 tokens: no line through them, so scaled in proportion
    assert ms == pytest.approx((12.0 - 10.0) * 8192 / 2097 + 5.0)
    # a call under the cap is timed whole: nothing scaled
    assert cost.check_cost_ms("fwd", (512, 256, 384), torch.bfloat16, torch.device("cpu"), col_check=False,
                              triton=True, tiling=Tiling()) == pytest.approx(7.0)  # fmt: skip


def test_a_capped_checks_cost_is_carried_along_the_line_through_two_timings(monkeypatch):
    # What a checked launch adds is a fixed part (the evidence's finish, a last wave) and a part per
    # token: timed at 2097 and 1048 tokens, the line through both gives 8192 tokens' cost — scaling
    # the 2097-token time in proportion would charge the fixed part ×3.9.
    from aegis_sdc.kernels.reference import Tiling
    from aegis_sdc.ops import cost

    seen = []

    def parts(kind, shape, dtype, device, *, col_check, triton, tiling, weight):
        tokens = shape[1] if kind == "wgrad" else shape[0]
        seen.append((kind, tokens, weight))
        return 0.3 + 0.001 * tokens, (5.0 if weight and kind != "wgrad" else 0.0)  # a wgrad reads no weight

    monkeypatch.setattr(cost, "_timed_parts", parts)
    ms = cost.check_cost_ms("fwd", (8192, 2048, 32000), torch.bfloat16, torch.device("cpu"), col_check=False,
                            triton=True, tiling=Tiling())  # fmt: skip
    assert ms == pytest.approx(0.3 + 0.001 * 8192 + 5.0)
    assert seen == [("fwd", 2097, True), ("fwd", 1048, False)]  # the weight's pass timed once
    seen.clear()
    ms = cost.check_cost_ms("wgrad", (32000, 8192, 2048), torch.bfloat16, torch.device("cpu"), col_check=True,
                            triton=True, tiling=Tiling())  # fmt: skip
    assert ms == pytest.approx(0.3 + 0.001 * 8192) and [t for _, t, _ in seen] == [2097, 1048]


def test_the_planner_times_a_check_once_per_token_bucket_and_scales_all_but_the_weight_pass(monkeypatch):
    # An expert's token count changes every step: 300 and 400 tokens share the 512-token timing; the
    # part that grows with tokens (8 ms at 512) is scaled, the weight's pass (2 ms) is not.
    from types import SimpleNamespace

    from aegis_sdc.kernels.reference import Tiling
    from aegis_sdc.runtime import planner as planner_module

    timed = []

    def parts(kind, shape, *args, **kwargs):
        timed.append((kind, shape))
        return 8.0, 2.0

    monkeypatch.setattr(planner_module, "check_cost_parts", parts)
    planner = planner_module.StepPlanner(
        sensors=[], attention_sensors={}, plan=None, budget=None, sampler=None, injector=None,
        device=torch.device("cpu"), tiling=Tiling(), events=[],
    )  # fmt: skip

    def sensor(kind, shape):
        return SimpleNamespace(site=SimpleNamespace(kind=SimpleNamespace(value=kind)), shape=shape,
                               dtype=torch.bfloat16, col_check=False, triton=True)  # fmt: skip

    assert planner._check_cost(sensor("fwd", (300, 64, 64))) == pytest.approx(8.0 * 300 / 512 + 2.0)
    assert planner._check_cost(sensor("fwd", (400, 64, 64))) == pytest.approx(8.0 * 400 / 512 + 2.0)
    assert planner._check_cost(sensor("wgrad", (64, 3000, 64))) == pytest.approx(8.0 * 3000 / 4096 + 2.0)
    assert timed == [("fwd", (512, 64, 64)), ("wgrad", (64, 4096, 64))]


def test_a_budget_guard_plans_after_calibration_and_keeps_checking_every_site(tmp_path):
    model, data, optimizer = small_workload()
    # the CPU reference path costs several times the plain matmul: half the step buys the floors
    sampling = aegis.SamplingConfig(budget=0.5, rotation_steps=10, replan_steps=5)
    config = guard_config(tmp_path, sampling=sampling, thresholds=aegis.ThresholdConfig(calibration_checks=2))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    train(model, data, optimizer, 12)
    assert guard.budget_plan is not None
    p = guard.plan.probabilities
    assert np.all(p >= 0.1 - 1e-9) and np.all(p <= 1.0)  # rotation floor: once per 10 steps
    # the attention module is an item of the same plan, under the same floor and its measured cost
    attention = [s.probability for s in guard.attention_sensors.values()]
    assert len(attention) == 1 and 0.1 - 1e-9 <= attention[0] <= 1.0
    assert len(guard.budget_plan.probabilities) == len(p) + 1
    assert guard.budget_plan.expected_ms <= guard.budget_plan.allowed_ms * (1 + 1e-9)
    # the cost table the plan priced with: one entry per kind and shape, every planned site under one
    table = guard.planner.cost_table()
    assert sum(row["sites"] for row in table) == len(p) + 1
    assert {row["kind"] for row in table} == {"fwd", "dgrad", "wgrad", "attention"}
    assert all(row["ms"] >= 0.0 and 0.1 - 1e-9 <= row["mean_probability"] <= 1.0 for row in table)
    summary = guard.close()
    assert summary.confirmed == 0
    assert 0.0 < summary.attention_checked_flops_fraction <= 1.0


def test_sampling_config_rejects_a_bad_budget():
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            aegis.SamplingConfig(budget=bad)


def test_pending_transfers_return_what_was_sent():
    tensors = [torch.arange(5, dtype=torch.int64), torch.tensor([1.5, 2.5]), torch.zeros(0)]
    out = start_to_host(tensors).wait()
    assert all(torch.equal(a, b) for a, b in zip(tensors, out, strict=True))


# -- GPU ------------------------------------------------------------------------------------------------
GPU_CFG = dataclasses.replace(MEDIUM, dim=512, hidden_dim=1024, n_heads=8, n_kv_heads=4)


def _gpu_run(tmp_path, *, faults=(), policy="warn", probability=1.0, steps=24):
    torch.manual_seed(0)
    model = Llama(GPU_CFG).cuda().to(torch.bfloat16)
    _, data, _ = small_workload(cfg=GPU_CFG, batch=8, seq=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    config = guard_config(tmp_path, sampling=aegis.SamplingConfig(probability=probability), faults=faults,
                          response=aegis.ResponseConfig(policy=policy))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    batches = [tuple(t.cuda() for t in data.batch()) for _ in range(steps)]
    return model, optimizer, guard, batches


@pytest.mark.gpu
@pytest.mark.parametrize("triton_attention", [False, True])  # attention on SDPA / on the checked Triton kernels
def test_forward_and_backward_never_synchronize(tmp_path, monkeypatch, triton_attention):
    from aegis_sdc.ops import checked_attention

    monkeypatch.setattr(checked_attention, "TRITON_ON_CUDA", triton_attention)
    model, optimizer, guard, batches = _gpu_run(tmp_path)
    for i, (x, y) in enumerate(batches):
        if i >= 18:  # calibrated: checked calls with evidence, every GEMM
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = lm_loss(model(x), y)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    assert summary.confirmed == 0 and summary.false_alarms == 0
    calls = 2 * GPU_CFG.n_layers * len(batches)  # forward and backward of each layer, every step (probability 1)
    assert summary.attention_checks == (calls if triton_attention else 0)


def _calibrated_linear(tmp_path):
    """A GPU run past calibration (every kernel variant compiled, the workspaces filled): the guard,
    one of its Linears and an input for it."""
    model, optimizer, guard, batches = _gpu_run(tmp_path)
    for x, y in batches[:18]:
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    x = torch.randn(8 * 128, GPU_CFG.dim, device="cuda", dtype=torch.bfloat16)
    return guard, model.layers[0].mlp.up_proj, x


@pytest.mark.gpu
def test_a_checked_gemm_allocates_only_its_output(tmp_path):
    guard, linear, x = _calibrated_linear(tmp_path)
    with torch.no_grad():
        torch.nn.functional.linear(x, linear.weight)  # cuBLAS's workspace, once
        linear(x)  # the weight statistics of this step: once per weight and step, not per call
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        linear(x)
        checked = torch.cuda.memory_stats()["allocation.all.allocated"] - before
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        torch.nn.functional.linear(x, linear.weight)
        plain = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert checked == plain == 1
    # In training the forward also writes X·1 for its wgrad: into the Linear's buffer for its first
    # call of a step, made at the first such call and reused by the next steps' first calls.
    x.requires_grad_(True)
    linear(x)
    guard.step()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    linear(x)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 1
    guard.close()


@pytest.mark.gpu
def test_a_checked_gemm_is_the_gemm_and_its_evidence(tmp_path):
    # A checked forward is one launch: the checked GEMM, its reference side, partials, evidence
    # (block sums, threshold compare, capture) and the by-product X·1 for the wgrad all inside it.
    # With `inline_evidence=False` the evidence and by-product take a second launch. The weight's
    # sums are taken once per weight and step, by the call that first needs them.
    import dataclasses as dc

    from aegis_sdc.kernels import triton_gemm as tg

    guard, linear, x = _calibrated_linear(tmp_path)
    x.requires_grad_(True)  # a wgrad follows: the forward writes the by-product

    def kernels_of_one_call() -> list[str]:
        linear(x)  # this step's weight sums, the variant compiled
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            linear(x)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    kernels = kernels_of_one_call()
    assert len(kernels) == 1 and "checked_gemm_kernel" in kernels[0], kernels
    tg.set_config(dc.replace(tg.config_for(x.shape[0], linear.weight.shape[0], x.shape[1]), inline_evidence=False))
    try:
        kernels = kernels_of_one_call()
    finally:
        tg.set_config(None)
    assert len(kernels) == 2 and "checked_gemm_kernel" in kernels[0] and "evidence_kernel" in kernels[1], kernels
    guard.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_gated_optimizer_holds_back_an_alarmed_update(tmp_path, policy):
    fault = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=30, steps=(20,))
    model, optimizer, guard, batches = _gpu_run(tmp_path, faults=(fault,), policy=policy)
    weight = model.layers[0].mlp.up_proj.weight
    raised = None
    for step, (x, y) in enumerate(batches):
        lm_loss(model(x), y).backward()
        before = weight.detach().clone()
        try:
            optimizer.step()
        except aegis.SilentDataCorruptionError as error:
            raised = (step, error)
            break
        optimizer.zero_grad(set_to_none=True)
    if policy == "raise":
        assert raised is not None and raised[0] == 20
        assert torch.equal(weight.detach(), before)  # the corrupted update never landed
        guard.close()
    else:
        summary = guard.close()
        assert summary.confirmed == 1 and optimizer.state[weight]["step"].item() == len(batches)  # re-applied
    (incident,) = guard.incidents
    assert (incident.site.name, incident.step) == ("layers.0.mlp.up_proj:fwd", 20)


@pytest.mark.gpu
def test_clean_gated_training_confirms_nothing_and_matches_the_waiting_path(tmp_path):
    results = []
    for gate in (True, False):
        model, optimizer, guard, batches = _gpu_run(tmp_path / str(gate), probability=0.5)
        guard.config = dataclasses.replace(guard.config, gate_optimizer=gate)
        for x, y in batches:
            lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        summary = guard.close()
        assert summary.confirmed == 0 and summary.not_verifiable == 0
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


# -- torch.compile ----------------------------------------------------------------------------------------
def test_the_linear_ops_pass_opcheck(tmp_path):
    model, _, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    linear = model.layers[0].mlp.up_proj
    x = torch.randn(16, linear.in_features, requires_grad=True)
    weight = linear.weight.detach().clone().requires_grad_()
    for bias in (None, torch.randn(linear.out_features, requires_grad=True)):
        torch.library.opcheck(torch.ops.aegis_sdc.linear.default, (x, weight, bias, linear.aegis_handle))
    dy = torch.randn(16, linear.out_features)
    args = (dy, x.detach(), weight.detach(), linear.aegis_handle, True, True)
    torch.library.opcheck(torch.ops.aegis_sdc.linear_backward.default, args)
    guard.close()


def _compiled_training(tmp_path, *, compile_first: bool, steps: int = 24, faults=()):
    model, data, optimizer = small_workload()
    always = tuple((f.site, 1.0) for f in faults)  # a faulted site is checked at every call
    sampling = aegis.SamplingConfig(probability=0.5, per_site=always)
    config = guard_config(tmp_path, faults=faults, sampling=sampling,
                          thresholds=aegis.ThresholdConfig(calibration_checks=4))  # fmt: skip
    if compile_first:
        compiled = torch.compile(model, backend="aot_eager")
        guard = aegis.protect(compiled, optimizer=optimizer, config=config)
    else:
        guard = aegis.protect(model, optimizer=optimizer, config=config)
        compiled = torch.compile(model, backend="aot_eager")
    train(compiled, data, optimizer, 1)
    try:  # every later step must reuse the first step's graphs
        torch._dynamo.config.error_on_recompile = True
        train(compiled, data, optimizer, steps - 1)
    finally:
        torch._dynamo.config.error_on_recompile = False
    return model, guard, data


def test_a_compiled_protected_model_has_no_graph_break_and_never_recompiles(tmp_path):
    torch._dynamo.reset()
    model, guard, data = _compiled_training(tmp_path, compile_first=False, steps=30)
    explained = torch._dynamo.explain(model)(data.batch()[0])
    summary = guard.close()
    assert explained.graph_break_count == 0, explained.break_reasons
    # 4 calibration steps check everything, then p = 0.5: (4 + 26 / 2) / 30 = 0.57 expected
    assert summary.confirmed == 0 and 0.45 < summary.checked_flops_fraction < 0.7


def test_a_compiled_protected_model_confirms_an_injected_fault(tmp_path):
    torch._dynamo.reset()
    fault = aegis.FaultSpec(site="layers.0.attn.wo:wgrad", model="bitflip", bit=29, steps=(20,))
    _, guard, _ = _compiled_training(tmp_path, compile_first=True, faults=(fault,))
    guard.close()
    assert [(i.site.name, i.step, i.verdict.kind) for i in guard.incidents] == [
        ("layers.0.attn.wo:wgrad", 20, aegis.VerdictKind.CONFIRMED_SDC)
    ]


def test_site_names_do_not_depend_on_compiling_before_protect(tmp_path):
    names = []
    for compile_first in (True, False):
        model, _, optimizer = small_workload()
        target = torch.compile(model, backend="aot_eager") if compile_first else model
        guard = aegis.protect(target, optimizer=optimizer, config=guard_config(tmp_path / str(compile_first)))
        names.append([site.name for site in guard.sites])
        guard.close()
    assert names[0] == names[1] and names[0][0] == "layers.0.attn.wq:fwd"


def test_site_names_do_not_depend_on_a_data_parallel_wrapper(tmp_path):
    # DDP and DataParallel hold the model as `module`; sites are named without it, as without the
    # wrapper (fault specs, quarantine lists and studies name the same sites either way). A user's own
    # child called `module` keeps its name.
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    names = {}
    try:
        for wrap in ("none", "ddp", "dp"):
            model, _, optimizer = small_workload()
            target = {"none": model, "ddp": nn.parallel.DistributedDataParallel(model),
                      "dp": nn.DataParallel(model)}[wrap]  # fmt: skip
            guard = aegis.protect(target, optimizer=optimizer, config=guard_config(tmp_path / wrap))
            names[wrap] = [site.name for site in guard.sites]
            guard.close()
    finally:
        dist.destroy_process_group()
    assert names["ddp"] == names["none"] == names["dp"] and names["none"][0] == "layers.0.attn.wq:fwd"
    holder = nn.Sequential()
    holder.module = nn.Linear(8, 8)
    guard = aegis.protect(holder, config=guard_config(tmp_path / "holder"))
    assert [site.name for site in guard.sites] == ["module:fwd", "module:dgrad", "module:wgrad"]
    guard.close()


@pytest.mark.parametrize("boundary", ["optimizer", "guard.step"])
def test_fullgraph_compiles_a_protected_hugging_face_llama_and_names_its_attention(tmp_path, boundary):
    # fullgraph=True refuses any graph break: the guard's forward watch once removed its own hook
    # inside the traced forward ("unregistered RemovableHandle"). The attention the compiled graph
    # runs as its own is named, once, at the step's end; the GEMMs stay checked.
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = hf_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    site = "model.layers.0.mlp.up_proj:fwd"
    config = guard_config(tmp_path, faults=(aegis.FaultSpec(site=site, model="bitflip", bit=28, steps=(5,)),))
    guard = aegis.protect(model, optimizer=optimizer if boundary == "optimizer" else None, config=config)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match="the attention of 2 modules .* traced by torch.compile") as caught:
        for step in range(7):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            compiled(input_ids=ids, labels=ids).loss.backward()
            if boundary == "guard.step":
                guard.step()
            optimizer.step()
            optimizer.zero_grad()
            torch._dynamo.config.error_on_recompile = step == 0  # the first step's graphs serve every step
    torch._dynamo.config.error_on_recompile = False
    summary = guard.close()
    assert sum("traced by torch.compile" in str(w.message) for w in caught) == 1
    assert [(i.site.name, i.step) for i in guard.incidents] == [(site, 5)] and summary.false_alarms == 0
    assert summary.attention_checks == 0
    named = summary.coverage["not_covered"]
    assert {m for m in named if m.endswith(":attn_fwd")} == {f"model.layers.{i}.self_attn:attn_fwd" for i in range(2)}
    assert all("traced by torch.compile" in named[f"model.layers.{i}.self_attn:attn_bwd"] for i in range(2))


def test_two_protected_models_compiled_in_one_process_report_to_their_own_guards(tmp_path):
    # Hugging Face slices its ModuleList of layers on every forward, which calls torch's module
    # registration hooks inside the traced graph; the guard's hook once handed Dynamo a global path to
    # the first protected model's modules there, and every later compiled copy ran the first one's
    # graph: its checks reported to the first guard, its own guard saw no step (a budget and a full
    # configuration benchmarked after a p = 0 one checked nothing).
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    site = "model.layers.0.mlp.down_proj:fwd"
    runs = []
    for i, faults in enumerate(((), (aegis.FaultSpec(site=site, model="bitflip", bit=28, steps=(3,)),))):
        model = hf_llama(num_hidden_layers=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path / str(i), faults=faults))
        runs.append((torch.compile(model, backend="aot_eager"), optimizer, guard))
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for compiled, optimizer, _ in runs:  # interleaved, as a benchmark's configurations are
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            compiled(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    (_, _, first), (_, _, second) = runs
    summaries = [first.close(), second.close()]
    assert [s.steps for s in summaries] == [5, 5]
    assert summaries[0].checks == summaries[1].checks > 0  # the same sites, every call checked in both
    assert first.incidents == [] and summaries[0].false_alarms == 0
    assert [(i.site.name, i.step) for i in second.incidents] == [(site, 3)] and summaries[1].false_alarms == 0


def test_the_fingerprint_checks_a_compiled_graph_runs_without_are_named(tmp_path):
    # The recompute and saved-tensor fingerprints are eager-mode checks: inside a compiled graph the
    # compiler recomputes and keeps the saved tensors. Named after the first step, one warning each.
    from tests.helpers import SMALL

    torch._dynamo.reset()
    model, data, optimizer = small_workload(cfg=dataclasses.replace(SMALL, activation_checkpointing=True))
    config = guard_config(tmp_path, fingerprints=aegis.FingerprintConfig(saved_probability=1.0))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(UserWarning, match="inside a torch.compile'd graph") as caught:
        train(compiled, data, optimizer, 3)
    summary = guard.close()
    assert sum("inside a torch.compile'd graph" in str(w.message) for w in caught) == 2
    named = summary.coverage["not_covered"]
    assert named["model:recompute"].startswith("activation checkpointing (the compiler recomputes) inside")
    assert named["model:saved"].startswith("saved-tensor fingerprints inside a torch.compile'd graph")
    assert summary.coverage["recompute_sites_checked"] == [] and summary.confirmed == 0


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_compiled_optimizer_step_is_judged_eagerly_and_never_blamed_on_the_device(tmp_path, policy):
    # torch.compile over optimizer.step(): Dynamo traced the guard's step-end hooks (an internal
    # Dynamo error), and the compiled update's bits differ from the eager replay's — the update replay
    # confirmed "SDCs" on a healthy device (and `raise` stopped training on one).
    torch._dynamo.reset()
    model, data, _ = small_workload()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    site = "layers.0.mlp.up_proj:wgrad"
    config = guard_config(tmp_path, faults=(aegis.FaultSpec(site=site, model="bitflip", bit=29, steps=(4,)),),
                          response=aegis.ResponseConfig(policy=policy))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    weight = model.layers[0].mlp.up_proj.weight

    def loss():
        inputs, targets = data.batch()
        return lm_loss(model(inputs), targets)

    step_compiled = torch.compile(optimizer.step, backend="aot_eager")
    raised_at, before = train_until_raised(loss, step_compiled, optimizer, weight, 6)
    summary = guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(site, 4)] and summary.false_alarms == 0
    if policy == "raise":  # held back before the compiled update ran
        assert raised_at == 4 and torch.equal(weight.detach(), before)
    assert "inside torch.compile" in summary.coverage["not_covered"]["optimizer:optimizer_update"]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_on_cuda_a_compiled_fused_optimizer_step_keeps_the_gate_and_blames_no_healthy_device(tmp_path, policy):
    # The compiled optimizer step on the GPU: fused AdamW under Inductor, the optimizer gate handing
    # it found_inf (runtime/gate.py) — an alarmed update is held back, a clean one lands, and the
    # update replay stands aside (the compiled update's bits are not the eager replay's).
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = hf_llama(hidden_size=256, intermediate_size=512).to("cuda", torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    site = "model.layers.1.mlp.up_proj:wgrad"
    # every call checked (on CUDA the default samples to a 1% budget); bit 30: on the tensor cores the
    # first steps' thresholds sit above a bit-29 flip of this small wgrad (its size 5.2e5, threshold 1.1e6)
    config = guard_config(tmp_path, faults=(aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(4,)),),
                          response=aegis.ResponseConfig(policy=policy),
                          sampling=aegis.SamplingConfig.every_call())  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    weight = model.model.layers[1].mlp.up_proj.weight
    ids = torch.randint(0, 128, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    step_compiled = torch.compile(optimizer.step)
    raised_at, before = train_until_raised(lambda: model(input_ids=ids, labels=ids).loss, step_compiled, optimizer,
                                           weight, 6)  # fmt: skip
    summary = guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(site, 4)] and summary.false_alarms == 0
    if policy == "raise":
        assert raised_at == 4 and torch.equal(weight.detach(), before)
    else:
        assert raised_at is None and optimizer.state[weight]["step"].item() == 6
    assert "inside torch.compile" in summary.coverage["not_covered"]["optimizer:optimizer_update"]


@pytest.mark.gpu
def test_a_compiled_hugging_face_llama_keeps_its_graphs_and_confirms_a_fault(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")  # fmt: skip
    ids = torch.randint(0, 512, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def breaks(model) -> int:
        torch._dynamo.reset()
        return torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    unprotected_breaks = breaks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    site = "model.layers.0.mlp.down_proj:fwd"
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(20,))
    config = guard_config(tmp_path, faults=(fault,), sampling=aegis.SamplingConfig(probability=0.1,
                          per_site=((site, 1.0),)))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    assert breaks(model) == unprotected_breaks  # nothing of the library breaks a graph
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for step in range(24):
        compiled(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            torch._dynamo.config.error_on_recompile = True
    torch._dynamo.config.error_on_recompile = False
    summary = guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(site, 20)] and summary.confirmed == 1


def test_the_automatic_budget_applies_on_cuda_unless_a_probability_is_given():
    assert aegis.SamplingConfig().budget_for("cuda") == 0.01
    assert aegis.SamplingConfig().budget_for("cpu") is None  # the reference path checks every call
    assert aegis.SamplingConfig().probability_for("cpu") == 1.0
    assert aegis.SamplingConfig(probability=0.2).budget_for("cuda") is None
    assert aegis.SamplingConfig.every_call().budget_for("cuda") is None
    assert aegis.SamplingConfig(budget=0.05).budget_for("cpu") == 0.05
    with pytest.raises(ValueError, match="not both"):
        aegis.SamplingConfig(probability=0.5, budget=0.01)


def test_operands_the_gpu_kernels_cannot_take_are_named():
    from aegis_sdc.ops.triton_linear import unsupported

    assert unsupported(torch.zeros(8, 16, dtype=torch.float16)) is None
    assert "16-byte" in unsupported(torch.zeros(8, 5, dtype=torch.float16))  # rows of 10 bytes
    assert "16-byte" in unsupported(torch.zeros(8, 16, dtype=torch.float16)[:, :12].t())


def test_a_linear_the_gpu_cannot_check_runs_unchecked_named_once(tmp_path, monkeypatch):
    # On CUDA a call the kernels cannot take (fp32, misaligned rows) must not fall back to the
    # reference path (a host read per call): it runs F.linear, warns once, and the coverage names it.
    from aegis_sdc.ops.checked_linear import LinearHooks

    def gap(self, x2d, weight):
        return "on this GPU: float32 operands (the GPU kernels take bf16/fp16)" if self.index == 0 else None

    monkeypatch.setattr(LinearHooks, "gpu_gap", gap)
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    with pytest.warns(UserWarning, match="layers.0.attn.wq: not checked — on this GPU") as caught:
        train(model, data, optimizer, 3)
    assert sum("not checked — on this GPU" in str(w.message) for w in caught) == 1
    summary = guard.close()
    assert set(summary.coverage["not_covered"]) == {f"layers.0.attn.wq:{k}" for k in ("fwd", "dgrad", "wgrad")}
    assert summary.checks == 3 * 7 * 3  # the 7 other Linears, 3 GEMMs, 3 steps
    conn = sqlite3.connect(next((tmp_path / "run").glob("*.sqlite")))
    assert conn.execute("SELECT COUNT(*) FROM events WHERE kind = 'not_covered'").fetchone()[0] == 1


def test_the_gate_adds_to_a_grad_scalers_flag_and_gives_it_back():
    from aegis_sdc.runtime.gate import OptimizerGate

    class Optimizer:
        pass

    optimizer = Optimizer()
    own = OptimizerGate.hold(optimizer, torch.tensor(1.0))
    assert own is None and optimizer.found_inf.item() == 1.0
    OptimizerGate.release(optimizer, own)
    assert not hasattr(optimizer, "found_inf")
    optimizer.found_inf = scaler = torch.zeros(())  # GradScaler's, for this step
    own = OptimizerGate.hold(optimizer, torch.tensor(1.0))
    assert own is scaler and optimizer.found_inf.shape == () and optimizer.found_inf.item() == 1.0
    OptimizerGate.release(optimizer, own)
    assert optimizer.found_inf is scaler


def test_the_budget_cycle_measures_quiet_steps_then_plans_and_corrects_its_cost_model():
    from aegis_sdc.runtime.budget import QUIET_STEPS, BudgetController, StepTimer

    controller = BudgetController(0.01, rotation_steps=100, replan_steps=5, timer=StepTimer(torch.device("cpu")))
    phases = [controller.step_begins(calibrating=True) for _ in range(2)]
    phases += [controller.step_begins(calibrating=False) for _ in range(QUIET_STEPS + 1)]
    assert phases == ["calibrating"] * 2 + ["quiet"] * QUIET_STEPS + ["busy"] and controller.due()
    flops, calls, caps = np.full(4, 1e9), np.ones(4), np.ones(4)
    controller.timer.times_ms = {"quiet": [100.0, 100.0, 100.0]}  # the step itself: 100 ms
    plan = controller.replan(flops, calls, np.full(4, 0.5), caps)
    assert plan.allowed_ms == pytest.approx(1.0) and plan.expected_ms == pytest.approx(1.0)
    # the cycle under this plan cost 2 ms per step, not 1: the cost model doubles, the plan halves
    phases = [controller.step_begins(calibrating=False) for _ in range(4 + QUIET_STEPS + 1)]
    assert phases == ["busy"] * 4 + ["quiet"] * QUIET_STEPS + ["busy"] and controller.due()
    controller.timer.times_ms = {"quiet": [100.0] * 3, "busy": [102.0] * 5}
    plan = controller.replan(flops, calls, np.full(4, 0.5), caps)
    assert controller.scale == pytest.approx(2.0)
    assert (plan.probabilities * 0.5).sum() == pytest.approx(0.5)  # 1 ms at the doubled cost


def test_the_cost_model_moves_only_as_far_as_the_step_times_resolve():
    import statistics

    from aegis_sdc.runtime.budget import cycle_cost, resolved_multiplier

    def one_cycle(busy, quiet):  # one cycle's multiplier, its plan expecting 1 ms, the model at ×1
        return resolved_multiplier([(*cycle_cost(busy, quiet), 1.0)], 1.0)

    # A 1% budget is 1 ms of a 100 ms step, whose times spread by ±2 ms: a cycle that seems to have
    # cost half of the plan cannot be told from one that cost exactly the plan — the model stays.
    quiet, busy = [98.0, 102.0, 100.0], [99.0, 103.0, 100.5, 98.5, 101.5]
    assert statistics.median(busy) - statistics.median(quiet) == pytest.approx(0.5)
    assert one_cycle(busy, quiet) == 1.0
    # A cycle that clearly cost 3× the plan raises it to the lower edge of its interval (2σ ≈ 0.17 ms)...
    assert 2.8 < one_cycle([103.0, 103.1, 102.9, 103.0, 103.05], [100.0, 100.1, 99.9]) < 3.0
    # ...and one that clearly cost half of it lowers it only to the upper edge (2σ ≈ 0.08 ms).
    assert 0.55 < one_cycle([100.5, 100.45, 100.55, 100.5, 100.5], [100.0, 100.05, 99.95]) < 0.6
    assert one_cycle([101.0], [100.0, 100.0]) == 1.0  # one step: no spread known


def test_a_cost_model_off_by_less_than_one_cycle_resolves_is_corrected_over_the_cycles_pooled():
    from aegis_sdc.runtime.budget import BudgetController, StepTimer

    # Checks that really cost 1.6× their timed model, in a step whose times spread by ±0.5 ms: one
    # cycle's interval (±0.97 ms around 1.6 ms) holds the model, so it stays; pooled over the cycles
    # the interval narrows as √cycles and the model rises to its lower edge, never past the truth.
    controller = BudgetController(0.01, rotation_steps=100, replan_steps=5, timer=StepTimer(torch.device("cpu")))
    flops, calls, caps, timed = np.full(4, 1e9), np.ones(4), np.ones(4), np.full(4, 0.5)
    quiet, spread = [99.5, 100.0, 100.5], [-0.5, 0.0, -1.0, 0.5, 0.0]
    controller.timer.times_ms = {"quiet": quiet}
    plan = controller.replan(flops, calls, timed, caps)
    scales = []
    for _ in range(8):
        real = 1.6 * plan.expected_ms / controller.scale  # what the plan's checks really cost per step
        controller.timer.times_ms = {"quiet": quiet, "busy": [100.0 + real + d for d in spread]}
        plan = controller.replan(flops, calls, timed, caps)
        scales.append(controller.scale)
    assert scales[0] == 1.0  # one cycle resolves nothing
    assert scales == sorted(scales)  # and it only rises
    assert 1.2 < scales[-1] < 1.6


def test_saved_tensor_steps_are_probed_once_and_paid_from_the_budget():
    from aegis_sdc.runtime.budget import QUIET_STEPS, SAVED_SHARE, BudgetController, StepTimer

    controller = BudgetController(0.01, rotation_steps=100, replan_steps=5, timer=StepTimer(torch.device("cpu")),
                                  saved_probability=0.05)  # fmt: skip
    phases = [controller.step_begins(calibrating=True)]
    phases += [controller.step_begins(calibrating=False) for _ in range(QUIET_STEPS + 2)]
    assert phases == ["calibrating"] + ["quiet"] * QUIET_STEPS + ["probe", "busy"] and controller.due()
    flops, calls, caps = np.full(4, 1e9), np.ones(4), np.ones(4)
    controller.timer.times_ms = {"quiet": [100.0] * 3, "probe": [140.0]}  # a saved-tensor step: +40 ms
    plan = controller.replan(flops, calls, np.full(4, 0.5), caps)
    assert controller.saved_cost_ms == pytest.approx(40.0)
    # 1 ms of budget per step: saved-tensor steps get SAVED_SHARE of it (1 step in 200), the GEMMs the rest
    assert controller.saved_planned == pytest.approx(SAVED_SHARE * 1.0 / 40.0)
    assert plan.allowed_ms == pytest.approx(1.0 - SAVED_SHARE)
    # later cycles plan from the measured cost: no second probe
    phases = [controller.step_begins(calibrating=False) for _ in range(4 + QUIET_STEPS + 1)]
    assert phases == ["busy"] * 4 + ["quiet"] * QUIET_STEPS + ["busy"]


def test_a_budget_guard_fingerprints_saved_tensors_in_its_probe_and_never_in_quiet_steps(tmp_path):
    model, data, optimizer = small_workload()
    sampling = aegis.SamplingConfig(budget=0.5, rotation_steps=10, replan_steps=5)
    fingerprints = aegis.FingerprintConfig(saved_probability=1.0, recompute=False)  # every step, unless the budget says
    config = guard_config(tmp_path, sampling=sampling, fingerprints=fingerprints,
                          thresholds=aegis.ThresholdConfig(calibration_checks=2))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    per_step = []
    for _ in range(10):
        before, phase = guard.counts["fingerprint_checks"], guard.budget._phase  # (the step's plan is drawn
        train(model, data, optimizer, 1)  # when the previous one ends)
        per_step.append((phase, guard.counts["fingerprint_checks"] > before))
    guard.close()
    phases = [phase for phase, _ in per_step]
    assert "probe" in phases and "quiet" in phases
    assert all(fingerprinted for phase, fingerprinted in per_step if phase == "probe")
    assert not any(fingerprinted for phase, fingerprinted in per_step if phase == "quiet")
    assert guard.budget.saved_cost_ms is not None and guard.budget.saved_planned is not None


def test_attention_left_unchecked_does_not_hold_back_the_budget_plan(tmp_path):
    """An attention module whose calls stay unchecked (named in the coverage) never calibrates; the
    plan must come all the same (on CUDA without the Triton attention kernels, it never did)."""

    class SharedKeysAttention(nn.Module):  # keys and values broadcast over the batch: the op cannot take it
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return self.out(F.scaled_dot_product_attention(q, k[:1], v[:1]).transpose(1, 2).flatten(2))

    torch.manual_seed(0)
    model = SharedKeysAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampling = aegis.SamplingConfig(budget=0.5, replan_steps=5)
    config = guard_config(tmp_path, sampling=sampling, thresholds=aegis.ThresholdConfig(calibration_checks=2))
    with pytest.warns(UserWarning, match="attention not checked — q, k, v of shapes"):
        guard = aegis.protect(model, optimizer=optimizer, config=config)
        for _ in range(12):
            model(torch.randn(4, 16, 32)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert guard.budget_plan is not None and guard.budget_plan.checked_flops_fraction > 0
    assert guard.close().confirmed == 0
