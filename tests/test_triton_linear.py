"""The checked Linear on the Triton backend, through the whole guard (interpreter on the CPU; real GPU marked)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import train, train_until_raised
from torch import nn

import aegis_sdc as aegis
from aegis_sdc.events import WrongExecution
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Aligned dims (16-byte rows for TMA) and few tokens: the interpreter runs one program at a time.
TINY = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=128, max_seq_len=16)


def config(tmp_path, **kwargs) -> aegis.GuardConfig:
    return aegis.GuardConfig(
        run_dir=str(tmp_path / "run"),
        backend=kwargs.pop("backend", "triton"),
        thresholds=aegis.ThresholdConfig(calibration_checks=4),  # short calibration: interpreted steps are slow
        sampling=kwargs.pop("sampling", aegis.SamplingConfig.every_call()),  # on a GPU too
        **kwargs,
    )


def tiny_workload(seed=0, cfg=TINY, batch=2, seq=16, dtype=torch.float32):
    torch.manual_seed(seed)
    model = Llama(cfg).to(device=DEVICE, dtype=dtype)
    data = SyntheticTokens(TokenStreamConfig(vocab_size=cfg.vocab_size, seq_len=seq, batch_size=batch), device=DEVICE)
    return model, data, torch.optim.AdamW(model.parameters(), lr=3e-3)


def test_triton_and_reference_backends_compute_the_same_linear(tmp_path):
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(64, 96)).to(DEVICE)
    x = torch.randn(40, 64, device=DEVICE)
    results = {}
    for backend in ("reference", "triton"):
        model = copy.deepcopy(base)
        cfg = aegis.GuardConfig(run_dir=str(tmp_path / backend), backend=backend,
                                sampling=aegis.SamplingConfig.every_call())  # fmt: skip
        guard = aegis.protect(model, config=cfg)
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(torch.ones_like(y))
        guard.step()
        assert guard.close().checks == 3
        results[backend] = (y.detach(), xi.grad, model[0].weight.grad)
    for ours, ref in zip(results["triton"], results["reference"], strict=True):
        # fp32 operands on both paths; on the GPU tl.dot uses tf32 for fp32 inputs (10-bit mantissa).
        tol = 1e-5 if DEVICE == "cpu" else 5e-3
        assert torch.allclose(ours, ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_a_token_count_that_makes_unaligned_rows_is_checked_on_the_triton_path(tmp_path, monkeypatch):
    # 37 tokens: a column of X (the wgrad's reduction) is 74 bytes, no multiple of 16 — TMA needs
    # none, since no output has rows of M elements. All three GEMMs must run the kernel.
    from aegis_sdc.ops import triton_linear

    launches = []
    run = triton_linear.run
    monkeypatch.setattr(triton_linear, "run", lambda *a, **k: launches.append(a[0].site.name) or run(*a, **k))
    torch.manual_seed(2)
    base = nn.Sequential(nn.Linear(64, 96)).to(device=DEVICE, dtype=torch.float16)
    x = torch.randn(37, 64, device=DEVICE, dtype=torch.float16)
    results = {}
    for backend in ("reference", "triton"):
        model = copy.deepcopy(base)
        guard = aegis.protect(model, config=config(tmp_path / backend, backend=backend))
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(torch.ones_like(y))
        guard.step()
        summary = guard.close()
        assert summary.checks == 3 and summary.alarms == 0 and not summary.coverage["not_covered"]
        results[backend] = (y.detach(), xi.grad, model[0].weight.grad)
    assert sorted(launches) == ["0:dgrad", "0:fwd", "0:wgrad"]
    for ours, ref in zip(results["triton"], results["reference"], strict=True):
        # fp16 results of fp32 accumulations in two orders: they differ by the last rounding, one
        # fp16 ulp (2⁻¹⁰ relative) of the larger values, and by far less than that in the sums.
        torch.testing.assert_close(ours, ref, rtol=2**-9, atol=2**-9 * float(ref.abs().max()))


def test_an_accumulator_past_fp32s_range_from_finite_operands_is_the_datas_on_the_triton_path(tmp_path):
    # Finite operands whose products pass fp32's range (a diverging run, or a corrupted value's huge
    # products downstream): the kernel's accumulator correctly reaches +inf and its checksums are not
    # finite. The replay reproduces them, and the exact-bound proof (which confirms a fault that
    # replays identically) must not count an overflow as a value no correct execution gives: that was
    # a confirmed "SDC" on a healthy device. Judged as the data's (non-finite), never false alarm or SDC.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64)).to(DEVICE)
    with torch.no_grad():
        model[0].weight.fill_(0.5)  # 64 products of 1.5e38 in a row
    guard = aegis.protect(model, config=config(tmp_path))
    for step in range(6):
        x = torch.randn(16, 64, device=DEVICE)
        if step == 5:
            x[3] = 3e38  # finite
        model(x).square().mean().backward()
        guard.step()
    summary = guard.close()
    assert summary.confirmed == 0 and summary.false_alarms == 0 and summary.nonfinite_inputs >= 1
    assert guard.incidents == []


def test_misaligned_shapes_fall_back_to_the_reference_path(tmp_path):
    model = nn.Sequential(nn.Linear(33, 7)).to(DEVICE)  # 33 fp32 = 132-byte rows: no TMA
    guard = aegis.protect(model, config=config(tmp_path))
    x = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    model(x).sum().backward()
    guard.step()
    assert guard.close().checks == 3


@pytest.mark.slow
@pytest.mark.parametrize("seq", [16, 15])  # 2 × 15 tokens: rows of X's columns not 16-byte aligned
def test_faults_in_each_gemm_are_confirmed_with_site_step_and_tile(tmp_path, seq):
    model, data, optimizer = tiny_workload(seq=seq)
    # calibration takes steps 0–3 (4 checks a site): step 5 is judged against a calibrated threshold
    spec = aegis.FaultSpec(site="layers.0.mlp.up_proj:*", model="bitflip", bit=27, steps=(5,), seed=5)
    guard = aegis.protect(model, optimizer=optimizer, config=config(tmp_path, faults=(spec,)))
    train(model, data, optimizer, 6)
    summary = guard.close()
    injected = {j.site: j.fault for j in guard.injector.log}
    assert set(injected) == {f"layers.0.mlp.up_proj:{k}" for k in ("fwd", "dgrad", "wgrad")}
    assert sorted(i.site.name for i in guard.incidents) == sorted(injected)
    tokens = 2 * seq
    shapes = {"fwd": (tokens, 128), "dgrad": (tokens, 64), "wgrad": (128, 64)}  # (M, N) of each C
    for incident in guard.incidents:
        assert incident.step == 5 and incident.verdict.wrong_execution is WrongExecution.ORIGINAL
        kind = incident.site.kind.value
        row, col = injected[incident.site.name].element(*shapes[kind])
        (tile,) = incident.verdict.mismatched_tiles
        assert tile.row_start <= row < tile.row_stop and tile.col_start <= col < tile.col_stop
    assert summary.false_alarms == 0 and summary.not_verifiable == 0


def _train_until_raised(model, data, optimizer, weight, steps: int):
    """Train until a step raises SilentDataCorruptionError: (that step or None, `weight` before its update)."""

    def loss():
        inputs, targets = data.batch()
        return lm_loss(model(inputs), targets)

    return train_until_raised(loss, optimizer.step, optimizer, weight, steps)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_optimizer_gate_holds_back_an_alarmed_update(tmp_path, monkeypatch, policy):
    # The gated step end (runtime/gate.py) on the interpreter: CPU fused AdamW takes found_inf as
    # the CUDA one does, so the gate is allowed here for the test (it is CUDA-only in use, where the
    # read it overlaps is asynchronous).
    import aegis_sdc.guard as guard_module

    monkeypatch.setattr(guard_module, "gateable", lambda opt, device: opt._step_supports_amp_scaling)
    model, data, _ = tiny_workload()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    spec = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=27, steps=(5,), seed=5)
    cfg = config(tmp_path, faults=(spec,), response=aegis.ResponseConfig(policy=policy))
    guard = aegis.protect(model, optimizer=optimizer, config=cfg)
    gated = []
    collect = guard.runtime.collect
    monkeypatch.setattr(guard.runtime, "collect",
                        lambda *, gate, **more: gated.append(gate) or collect(gate=gate, **more))  # fmt: skip
    weight = model.layers[0].mlp.up_proj.weight
    raised_at, before = _train_until_raised(model, data, optimizer, weight, steps=6)
    guard.close()
    assert all(gated[:-1]) and not gated[-1]  # every step end gated; close() drains without a gate
    assert [(i.site.name, i.step) for i in guard.incidents] == [("layers.0.mlp.up_proj:fwd", 5)]
    if policy == "raise":  # raised from the post-hook, the update held back: nothing of step 5 landed
        assert raised_at == 5 and torch.equal(weight.detach(), before)
        assert optimizer.state[weight]["step"].item() == 5
    else:  # the verdict allowed it: the held-back update was applied, every step counted
        assert raised_at is None and optimizer.state[weight]["step"].item() == 6


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_fingerprint_checks_join_the_optimizer_gate_after_calibration(tmp_path, monkeypatch, policy):
    # Recompute and saved-tensor fingerprints compared on the device (FingerprintPool.differ_on_device):
    # after the recompute sites' calibration the step end no longer waits for the host before the
    # update; a flipped recomputed activation still holds the update back until its verdict.
    import dataclasses

    import aegis_sdc.guard as guard_module

    monkeypatch.setattr(guard_module, "gateable", lambda opt, device: opt._step_supports_amp_scaling)
    model, data, _ = tiny_workload(cfg=dataclasses.replace(TINY, activation_checkpointing=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    spec = aegis.FaultSpec(site="layers.0:recompute", model="bitflip", bit=27, steps=(4,), seed=5)
    cfg = config(tmp_path, faults=(spec,), response=aegis.ResponseConfig(policy=policy),
                 fingerprints=aegis.FingerprintConfig(saved_probability=1.0))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=cfg)
    collected = []
    collect = guard.runtime.collect
    monkeypatch.setattr(guard.runtime, "collect", lambda **kw: collected.append(collect(**kw)) or collected[-1])
    weight = model.layers[0].mlp.up_proj.weight
    raised_at, before = _train_until_raised(model, data, optimizer, weight, steps=6)
    guard.close()
    steps = collected[:-1]  # the last: close()'s drain, without a gate
    assert all(c.fp_records for c in steps)
    calibrating = cfg.fingerprints.calibration_checks  # the recompute sites' first checks run a third time
    assert not any(c.fp_on_device for c in steps[:calibrating]) and all(c.fp_on_device for c in steps[calibrating:])
    assert [(i.site.name, i.step) for i in guard.incidents] == [("layers.0:recompute", 4)]
    if policy == "raise":  # the update of step 4 held back until the verdict, which raised
        assert raised_at == 4 and torch.equal(weight.detach(), before)
        assert optimizer.state[weight]["step"].item() == 4
    else:  # held back, confirmed, then applied: every step's update landed
        assert raised_at is None and optimizer.state[weight]["step"].item() == 6


# -- real GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq", [(8, 512), (7, 510)])  # 3 570 tokens: X's columns not 16-byte aligned
def test_gpu_bf16_training_clean_then_faulty(tmp_path, batch, seq):
    cfg = LlamaConfig(vocab_size=4096, dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=2816, max_seq_len=512)
    model, data, optimizer = tiny_workload(cfg=cfg, batch=batch, seq=seq, dtype=torch.bfloat16)
    spec = aegis.FaultSpec(site="layers.1.mlp.down_proj:*", model="bitflip", bit=26, steps=(40,), seed=2)
    guard = aegis.protect(
        model,
        optimizer=optimizer,
        config=aegis.GuardConfig(
            run_dir=str(tmp_path / "run"), faults=(spec,), sampling=aegis.SamplingConfig.every_call()
        ),
    )
    losses = train(model, data, optimizer, 42)
    summary = guard.close()
    assert losses[-1] < losses[0]
    assert {(i.site.name, i.step) for i in guard.incidents} == {
        (f"layers.1.mlp.down_proj:{k}", 40) for k in ("fwd", "dgrad", "wgrad")
    }
    for incident in guard.incidents:
        assert incident.identity.gpu_uuid and incident.verdict.mismatched_tiles
    # Clean steps may raise false alarms while thresholds settle (each replayed bit for bit and
    # counted), never an incident.
    assert (
        summary.confirmed == 3 and summary.alarms == summary.false_alarms + summary.confirmed + summary.not_verifiable
    )
    # every GEMM of every step checked, whatever the token count (attention is another sensor's)
    assert not {s.name for s in guard.sites} & set(summary.coverage["not_covered"])
    assert summary.checks == 42 * len(guard.sites)
    print(f"GPU training: {summary.checks} checks, {summary.false_alarms} false alarms")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_wgrads_activation_sums_match_fp64_sums_bit_for_bit_on_every_rerun(dtype):
    # X·1 and dY·1 when no checked forward or dgrad made them (and u1 = 1ᵀA of a forward's optional
    # column check): the device path's own kernels, not torch's fp64 sum, which copies t to fp64 first.
    # Every value is exact in fp64, so the sums differ from torch's only in the order of fp64 additions:
    # |difference| ≤ (columns + 1) · 2⁻⁵³ · Σ|t| per sum (each partial sum rounds once per addition).
    from aegis_sdc.ops.triton_linear import column_sums, row_sums

    gen = torch.Generator().manual_seed(0)
    storage = (torch.randn(70, 100, generator=gen) * 4.0 + 1.0).to(DEVICE, dtype)
    # ragged; strided rows (a 16-byte aligned start: the kernels); an unaligned start (torch's sum); empty
    for t in (storage, storage[8:40, 8:72], storage[3:40, 5:69], storage[:, :0], storage[:0]):
        t64 = t.double()
        for ours, reference, magnitude, terms in (
            (row_sums(t), t64.sum(dim=1), t64.abs().sum(dim=1), t.shape[1]),
            (column_sums(t), t64.sum(dim=0), t64.abs().sum(dim=0), t.shape[0]),
        ):
            assert ours.dtype == torch.float64 and ours.shape == reference.shape
            assert torch.all((ours - reference).abs() <= (terms + 1) * 2.0**-53 * magnitude)
    again = (row_sums(storage), column_sums(storage))
    assert torch.equal(again[0], row_sums(storage)) and torch.equal(again[1], column_sums(storage))


def test_byproduct_buffers_are_reused_from_step_to_step_and_never_twice_in_a_step():
    from aegis_sdc.ops.triton_linear import ByproductPool

    # the device as a tensor reports it (cuda:0, never bare "cuda"): the pool compares it with its buffers'
    pool, dt, device = ByproductPool(), torch.bfloat16, torch.empty(0, device=DEVICE).device
    first, second = pool.take(0, 64, dt, device), pool.take(0, 64, dt, device)  # two calls of one step
    assert first.vec.data_ptr() != second.vec.data_ptr() and first.matrix.data_ptr() != second.matrix.data_ptr()
    again = pool.take(1, 64, dt, device)  # the next step's first call: the first call's buffer
    assert again is first and pool.take(1, 64, dt, device) is second
    shorter = pool.take(2, 32, dt, device)  # a shorter sequence: a view of the same storage
    assert shorter.vec.shape == (32,) and shorter.matrix.shape == (32, 16)
    assert shorter.vec.data_ptr() == first.vec.data_ptr()
    longer = pool.take(3, 128, dt, device)  # a longer one: a new buffer
    assert longer.vec.shape == (128,) and longer.vec.data_ptr() != first.vec.data_ptr()


def test_an_alarmed_wgrad_capture_keeps_copies_of_its_pooled_reference_vectors():
    # The wgrad's c = X·1 lives in a buffer the next step's forward overwrites; a capture that outlives
    # the step (a queued verification) must replay against the values the launch read.
    from aegis_sdc.kernels import triton_gemm as tg
    from aegis_sdc.kernels.gemm_side import SideMatrix
    from aegis_sdc.ops.triton_replay import TritonGemmCall

    vec = torch.arange(64, dtype=torch.float64, device=DEVICE)
    side = SideMatrix.of(vec, torch.float16)
    call = TritonGemmCall(
        a_t=True, b_t=False, m=32, n=48, k=64, dtype=torch.float16, cfg=tg.default_config(),
        capture_kind=tg.CAPTURE_TILE, b=None, bias=None, cvec=vec, u1=None, pool=None, fault=None,
        c_side=side, pooled=True,
    )  # fmt: skip
    kept = call.kept()
    expected_vec, expected_matrix = vec.clone(), side.matrix.clone()
    vec.zero_()
    side.matrix.zero_()  # the next step writes its by-product into the buffer
    assert torch.equal(kept.cvec, expected_vec) and kept.c_side.vec is kept.cvec
    assert torch.equal(kept.c_side.matrix, expected_matrix) and not kept.pooled
    unpooled = TritonGemmCall(**{**call.__dict__, "pooled": False})
    assert unpooled.kept() is unpooled  # nothing pooled: nothing copied


def test_a_step_takes_the_weight_sums_in_one_pass_per_weight_shape(tmp_path, monkeypatch):
    # Every active Linear's weight sums at the step's first checked call, a pair of launches per shape
    # shared by two or more weights: TINY's 8 Linears have 4 shapes, one of them alone. The sums are
    # those of each weight's own launches, bit for bit.
    from aegis_sdc.kernels import weight_sums

    model, data, optimizer = tiny_workload(dtype=torch.bfloat16)
    guard = aegis.protect(model, optimizer=optimizer, config=config(tmp_path))
    launches = []
    real = weight_sums._launch_sums
    monkeypatch.setattr(weight_sums, "_launch_sums", lambda w, table, *a: launches.append(table is not None) or real(
        w, table, *a))  # fmt: skip
    inputs, targets = data.batch()
    lm_loss(model(inputs), targets).backward()  # the step's forward and backward, before the update
    assert sorted(launches) == [False, True, True, True]
    epoch = guard.device_state.epoch
    # what the step's GEMMs read: the keys hold, nothing is launched
    weights = [(swap.checked.weight, swap.checked.aegis_hooks.weight_stats) for swap in guard.protection.linear_swaps]
    read = [(w, stats.get(w, w, epoch)) for w, stats in weights]
    assert len(launches) == 4
    for w, (fwd_side, dgrad_side) in read:
        col_sum, row_sum, s_col, s_row = weight_sums.weight_sides(w)
        assert torch.equal(fwd_side.vec, col_sum) and torch.equal(dgrad_side.vec, row_sum)
        assert torch.equal(fwd_side.matrix, s_col) and torch.equal(dgrad_side.matrix, s_row)
    optimizer.step()
    guard.close()


@pytest.mark.parametrize("bit", [30, 0])
def test_an_injected_faults_size_is_measured_on_the_triton_path(tmp_path, bit):
    # Campaigns judge a GEMM fault against its claim by its size in the row's checksum unit: the
    # Triton path leaves it on the device (nothing waits); a flip of the exponent's top bit is far
    # over twice the threshold and is confirmed, a flip of the lowest mantissa bit far under it.
    spec = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=bit, steps=(6,), row=3, col=5)
    model, data, optimizer = tiny_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=config(tmp_path, faults=(spec,)))
    try:
        train(model, data, optimizer, 7)
    finally:
        guard.close()
    (injection,) = list(guard.injector.log)
    assert isinstance(injection.size, torch.Tensor) and injection.element == (3, 5)
    size = float(injection.size) / injection.threshold
    confirmed = [i.site.name for i in guard.incidents]
    if bit == 30:
        assert size > 2.0 and confirmed == ["layers.0.mlp.up_proj:fwd"]
    else:
        assert size < 1.0 and confirmed == []
