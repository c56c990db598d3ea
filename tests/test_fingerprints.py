"""Recompute and saved-tensor checks on the CPU workload with per-block activation checkpointing:
injected bit flips are confirmed with site, step and the wrong execution; clean runs confirm nothing;
non-deterministic segments are reported as not covered, never as SDC."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from tests.helpers import MEDIUM, guard_config, small_workload, train

import aegis_sdc as aegis
from aegis_sdc.events import GemmKind, Site, VerdictKind, WrongExecution
from aegis_sdc.ops.checked_linear import LinearHooks, PlanTracer, SegmentTrace
from aegis_sdc.sensors.gemm import CallPlan
from aegis_sdc.store.sqlite import read_verdict_counts
from aegis_sdc.workloads.llama import Llama, lm_loss

CHECKPOINTED = dataclasses.replace(MEDIUM, n_layers=2, activation_checkpointing=True)


def protected(tmp_path, *, faults=(), probability=0.5, saved=1.0, cfg=CHECKPOINTED, batch=8, **kwargs):
    # Sampling 0.5: recomputations must replay the forward's GEMM paths (checked / unchecked), or
    # clean recomputations would differ in the last bits (see the negative control below).
    model, data, optimizer = small_workload(cfg=cfg, batch=batch, seq=128)
    config = guard_config(
        tmp_path, faults=tuple(faults), sampling=aegis.SamplingConfig(probability=probability),
        fingerprints=aegis.FingerprintConfig(saved_probability=saved), **kwargs,
    )  # fmt: skip
    return model, data, optimizer, aegis.protect(model, optimizer=optimizer, config=config)


def test_flipped_bits_in_a_recomputed_activation_and_in_a_saved_tensor_are_confirmed(tmp_path):
    faults = (
        aegis.FaultSpec(site="layers.1:recompute", model="bitflip", bit=20, steps=(21,)),
        aegis.FaultSpec(site="lm_head:saved", model="bitflip", bit=3, steps=(24,)),
    )
    model, data, optimizer, guard = protected(tmp_path, faults=faults)
    train(model, data, optimizer, 26)
    summary = guard.close()
    found = {(i.site.name, i.step): i.verdict for i in guard.incidents}
    assert set(found) == {("layers.1:recompute", 21), ("lm_head:saved", 24)}, found
    assert found["layers.1:recompute", 21].wrong_execution is WrongExecution.REPLAY  # the recomputation
    assert "recomputation in backward differs" in found["layers.1:recompute", 21].detail
    assert found["lm_head:saved", 24].wrong_execution is WrongExecution.ORIGINAL
    assert "changed in memory between forward (saved) and backward (used)" in found["lm_head:saved", 24].detail
    assert summary.confirmed == 2 and summary.false_alarms == 0 and summary.not_deterministic == 0
    assert guard.incidents[0].identity.rank == 0
    assert summary.coverage["recompute_sites_checked"] == ["layers.0:recompute", "layers.1:recompute"]
    assert "lm_head:saved" in summary.coverage["saved_tensor_sites_checked"]


def test_a_forward_fault_its_own_check_confirmed_is_one_incident_though_the_recompute_finds_it_too(tmp_path):
    # The up_proj's forward check confirms the fault; the segment's recompute check then sees the
    # forward's wrong output beside the clean recomputation and confirms it again ("original"): the
    # same fault, one incident — two would tell the user of two faults.
    site = "layers.0.mlp.up_proj:fwd"
    faults = (aegis.FaultSpec(site=site, model="bitflip", bit=27, steps=(21,)),)
    model, data, optimizer, guard = protected(tmp_path, faults=faults, probability=1.0)
    verdicts = []
    guard.subscribe(lambda event, payload: verdicts.append(payload) if event == "verdict" else None)
    train(model, data, optimizer, 23)
    summary = guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(site, 21)]
    again = [v for v in verdicts if v.site.name == "layers.0:recompute"]
    assert len(again) == 1 and again[0].step == 21 and again[0].kind is VerdictKind.CONFIRMED_SDC
    assert again[0].traced_upstream and again[0].same_fault_as == guard.incidents[0].id
    assert f"the fault of incident {guard.incidents[0].id} at {site}" in again[0].detail
    assert summary.confirmed == 1 and summary.same_fault == 1
    # the store says the same: one confirmed verdict of its own, one finding of it again
    counts = read_verdict_counts(tmp_path / "run")
    assert counts["confirmed_sdc"] == 1 and counts["same_fault"] == 1


def test_a_wrong_forward_only_the_recompute_finds_is_its_incident(tmp_path):
    # The forward goes wrong between the checked GEMMs (the MLP's output, corrupted in the training
    # forward of step 3, not in its recomputation): no forward check confirms anything, so the
    # recompute check's "original" verdict is the incident.
    model, data, optimizer, guard = protected(tmp_path, probability=1.0)
    calls = []

    def corrupt_the_training_forward(module, inputs, output):
        calls.append(guard.step_number)
        if guard.step_number == 3 and calls.count(3) == 1:  # the forward; the recomputation is call 2
            return output * 2.0
        return None

    model.layers[0].mlp.register_forward_hook(corrupt_the_training_forward)
    train(model, data, optimizer, 5)
    summary = guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [("layers.0:recompute", 3)]
    verdict = guard.incidents[0].verdict
    assert verdict.wrong_execution is WrongExecution.ORIGINAL and verdict.traced_upstream
    assert verdict.same_fault_as is None and summary.confirmed == 1 and summary.same_fault == 0


@pytest.mark.slow
def test_150_clean_checkpointed_steps_confirm_nothing(tmp_path):
    # A recomputation's fingerprint must equal its forward's bit for bit: a clean mismatch is
    # structural (a path that differs), not rare noise, so 150 steps (300 recomputations, ~1000
    # fingerprint checks over a loss falling by more than 1) show it as well as more would; a batch
    # of 4 sequences keeps every path and check of 8 at half the time.
    model, data, optimizer, guard = protected(tmp_path, batch=4)
    losses = train(model, data, optimizer, 150)
    summary = guard.close()
    assert losses[-1] < losses[0] - 1.0
    assert summary.confirmed == 0 and summary.not_deterministic == 0 and summary.not_verifiable == 0
    # every step: 2 recomputed blocks + the sampled saved tensors outside them
    assert summary.fingerprint_checks >= 150 * 3
    assert summary.coverage["not_covered"] == {}


def test_recomputations_replay_the_forward_plans_silently():
    # A recomputation must take the forward's GEMM paths (checked / unchecked): on a GPU the two
    # can differ in the last bits (Triton tile order vs cuBLAS). On the CPU fp32 both paths give the
    # same bits, so here the tracer itself is tested; the GPU test below runs sampled GEMMs with
    # checkpointing end to end.
    class Sensor:
        site = Site(0, "x", GemmKind.FORWARD)

        def __init__(self):
            self.calls = 0

        def plan(self, call, sampled):
            self.calls += 1
            if not sampled:
                return None
            return CallPlan(self.site, 0, call, True, False, object())

    class Plan:  # every other call sampled
        def __init__(self):
            self.taken = 0

        def take(self, linear):
            self.taken += 1
            return self.taken - 1 if self.taken % 2 == 0 else None

        def checked(self, site, call):
            return True

    tracer, trace = PlanTracer(), SegmentTrace()
    hooks = LinearHooks(Sensor(), Sensor(), Sensor(), tiling=None, tracer=tracer, plan=Plan())
    tracer.current = trace
    x = torch.zeros(2, 2, requires_grad=True)
    recorded = [hooks.plans_for_call(x, x) for _ in range(4)]
    trace.cursor = 0
    replayed = [hooks.plans_for_call(x, x) for _ in range(4)]
    assert hooks.plan.taken == 4 and hooks.forward.calls == 2  # the replay drew nothing (no sampling, no faults)
    assert [p is None for p in recorded] == [True, False, True, False]
    for plans, again in zip(recorded, replayed, strict=True):
        assert (plans is None) == (again is None)
        if again is not None:
            (_, dgrad, wgrad), (fwd2, dgrad2, wgrad2) = plans, again
            assert dgrad is dgrad2 and wgrad is wgrad2
            assert fwd2.silent and not fwd2.check and fwd2.injection is None


@pytest.mark.gpu
def test_clean_checkpointed_training_on_the_gpu_confirms_nothing(tmp_path):
    cfg = dataclasses.replace(CHECKPOINTED, dim=512, hidden_dim=1024, n_heads=8, n_kv_heads=4)

    def run(path):
        torch.manual_seed(0)
        model = Llama(cfg).cuda().to(torch.bfloat16)
        _, data, _ = small_workload(cfg=cfg, batch=8, seq=128)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # fingerprints in the gate
        config = guard_config(path, sampling=aegis.SamplingConfig(probability=0.5),
                              fingerprints=aegis.FingerprintConfig(saved_probability=1.0))  # fmt: skip
        guard = aegis.protect(model, optimizer=optimizer, config=config)
        for _ in range(40):
            x, y = (t.cuda() for t in data.batch())
            loss = lm_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return guard.close(), guard

    summary, guard = run(tmp_path)
    fingerprint_verdicts = [i for i in guard.incidents if i.site.name.endswith((":recompute", ":saved"))]
    assert not fingerprint_verdicts and summary.not_deterministic == 0 and summary.fingerprint_checks >= 40 * 3


def train_small(model, tmp_path, steps: int, rows: int, faults=()):
    """A few SGD steps of a small model whose forward returns the loss; the guard and its summary."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=tuple(faults)))
    for _ in range(steps):
        loss = model(torch.randn(rows, 64))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return guard, guard.close()


class Jitter(torch.nn.Module):
    """A segment with a non-deterministic operator: each run adds a different tiny value (as an
    atomic reduction's order would)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.proj(x) + self.runs * 1e-6


class JitterModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Jitter(64)
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)).sum()


def test_a_non_deterministic_segment_is_reported_not_covered_never_as_sdc(tmp_path):
    torch.manual_seed(0)
    guard, summary = train_small(JitterModel(), tmp_path, steps=6, rows=32)
    assert summary.confirmed == 0 and not guard.incidents
    assert summary.not_deterministic >= 1
    assert "inner:recompute" in summary.coverage["not_covered"]
    assert "not deterministic — not covered" in summary.coverage["not_covered"]["inner:recompute"]


def test_checkpoint_wrapper_modules_and_reentrant_checkpoints(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(MEDIUM, n_layers=2))
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)  # torchtitan-style: non-reentrant by default
    _, data, _ = small_workload(cfg=MEDIUM, batch=2, seq=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults = (aegis.FaultSpec(site="layers.0:recompute", model="bitflip", bit=25, steps=(3,)),)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=faults))
    train(model, data, optimizer, 4)
    reentrant = torch.utils.checkpoint.checkpoint(model.layers[0], torch.randn(1, 8, 256, requires_grad=True),
                                                  model.rope_cos, model.rope_sin, use_reentrant=True)  # fmt: skip
    reentrant.sum().backward()  # passes through unchecked: no site, no error
    guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [("layers.0:recompute", 3)]
    # restored on close (to torch's own, or to a checker some other guard left open in this process)
    assert getattr(torch.utils.checkpoint.checkpoint, "__self__", None) not in guard._checkers
    assert all(i.verdict.kind is VerdictKind.CONFIRMED_SDC for i in guard.incidents)


class BoundCheckpointModel(torch.nn.Module):
    """Checkpoints through a function bound before `protect`, as Hugging Face models do after
    `gradient_checkpointing_enable()`."""

    def __init__(self) -> None:
        super().__init__()
        self.block = SelectiveBlock()
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def forward(self, x):
        return self._gradient_checkpointing_func(self.block.__call__, x).sum()


def test_a_checkpoint_function_bound_before_protect_is_checked(tmp_path):
    torch.manual_seed(0)
    model = BoundCheckpointModel()
    faults = (aegis.FaultSpec(site="block:recompute", model="bitflip", bit=27, steps=(2,)),)
    guard, _ = train_small(model, tmp_path, steps=3, rows=16, faults=faults)
    assert [(i.site.name, i.step) for i in guard.incidents] == [("block:recompute", 2)]
    assert model._gradient_checkpointing_func.func is torch.utils.checkpoint.checkpoint  # restored


class SelectiveBlock(torch.nn.Module):
    """A block checkpointed with selective activation checkpointing: matmul outputs are saved, the
    rest (norm, activation) is recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(torch.nn.functional.layer_norm(x, (64,)))))


class SelectiveModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = SelectiveBlock()

    def forward(self, x):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False, context_fn=context_fn).sum()


def test_selective_activation_checkpointing_is_checked(tmp_path):
    torch.manual_seed(0)
    faults = (aegis.FaultSpec(site="block:recompute", model="bitflip", bit=27, steps=(4,)),)
    guard, summary = train_small(SelectiveModel(), tmp_path, steps=6, rows=32, faults=faults)
    assert [(i.site.name, i.step) for i in guard.incidents] == [("block:recompute", 4)]
    assert summary.fingerprint_checks >= 6 and summary.not_deterministic == 0


class _Gathered(torch.nn.Module):
    """Saves an index tensor (the gather's positions, int64) before a floating-point one (the product's
    input): a module whose first saved tensor is not an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        picked = torch.gather(self.proj(x), 1, index)  # saves `index`
        return picked * picked  # saves `picked`


def test_a_saved_tensor_fault_flips_an_activation_never_an_index(tmp_path):
    # An index with a flipped high bit is an out-of-bounds access in the backward (on the CPU gather's
    # backward raises; on a GPU it is an illegal memory access that ends the process): the fault model
    # of a corrupted activation strikes the site's first floating-point tensor instead.
    torch.manual_seed(0)
    model = _Gathered()
    fault = aegis.FaultSpec(site="<root>:saved", model="bitflip", bit=30, steps=(3,))
    fingerprints = aegis.FingerprintConfig(saved_probability=1.0, saved_min_bytes=4)
    config = guard_config(tmp_path, faults=(fault,), fingerprints=fingerprints)
    guard = aegis.protect(model, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard.attach_optimizer(optimizer)
    index = torch.randint(0, 16, (8, 4))
    for _ in range(5):
        loss = model(torch.randn(8, 16), index).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    guard.close()
    fired = list(guard.injector.log)
    assert [(i.site, i.step) for i in fired] == [("<root>:saved", 3)]
    found = [(i.site.name, i.step) for i in guard.incidents]
    assert found == [("<root>:saved", 3)], found
