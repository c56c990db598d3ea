"""Checked attention on the reference path: values and gradients against SDPA's math backend, the two
invariants catching injected faults in every stage with (site, step, batch, head), clean training
confirming nothing, and the routing of a protected model's SDPA calls."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tests.helpers import MEDIUM, Quiet, guard_config, small_workload, train

import aegis_sdc as aegis
from aegis_sdc.faults.models import AccumulatorFault
from aegis_sdc.kernels.attention_reference import HeadFault, attention_backward, attention_forward, backward_bound
from aegis_sdc.ops import checked_attention as attention_op
from aegis_sdc.ops.checked_attention import checked_attention


def reference(q, k, v, causal):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,d,heads,kv_heads,seq", [
    (torch.float32, 64, 4, 2, 77),  # GQA; a length that is not a multiple of any block
    (torch.float32, 128, 2, 2, 64),
    (torch.bfloat16, 64, 4, 1, 50),
    (torch.float16, 128, 2, 2, 33),
])  # fmt: skip
def test_values_and_gradients_match_sdpa(causal, dtype, d, heads, kv_heads, seq):
    g = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(2, h, seq, d, generator=g).to(dtype).requires_grad_() for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(2, heads, seq, d, generator=g).to(dtype)
    hooks = Quiet()
    out = checked_attention(q, k, v, causal=causal, hooks=hooks)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # The fp32 math reference on the same (rounded) inputs.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(q32, k32, v32, causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    # Outputs are convex combinations of V: fp32 rounding of S·D-term sums stays below (Sk + D)·u
    # of max|V| (both sides), ×4 slack; a 16-bit output adds half an ulp of its format (2⁻⁸ bf16).
    u_out = 2.0**-24 if dtype == torch.float32 else (2.0**-9 if dtype == torch.bfloat16 else 2.0**-11)
    scale = v32.abs().max()
    assert (out.float() - ref).abs().max() <= (4 * (seq + d) * 2.0**-24 + 2 * u_out) * scale
    # Gradients chain three such products (dP, dS, dQ/dK/dV): allow (Sq + Sk + D)·u relative to the
    # largest reference gradient, ×8, plus the output dtype's rounding.
    for got, want in zip(grads, ref_grads, strict=True):
        bound = (8 * (2 * seq + d) * 2.0**-24 + 4 * u_out) * want.abs().max()
        assert (got.float() - want).abs().max() <= bound
    # Clean checksums stay below the bounds used during calibration (dv's is exact).
    assert float(hooks.values[True][0].max()) < backward_bound(seq, seq)
    assert bool(torch.isfinite(hooks.values[False]).all()) and bool(torch.isfinite(hooks.values[True]).all())


def test_unsupported_arguments_raise_clear_errors():
    q = torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        checked_attention(q, torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), hooks=Quiet())
    with pytest.raises(ValueError, match="4-D"):
        checked_attention(q[0], q[0], q[0], hooks=Quiet())
    with pytest.raises(ValueError, match="one floating dtype"):
        checked_attention(q, q.double(), q, hooks=Quiet())


def test_each_invariant_sees_its_own_corruption():
    # Direct: a corrupted PV accumulator breaks O·1 = P·(V·1); a corrupted recomputed probability
    # breaks 1ᵀdV = 1ᵀdO, in the corrupted head only.
    from aegis_sdc.faults.models import AccumulatorFault
    from aegis_sdc.kernels.attention_reference import HeadFault

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(6, 40, 32, generator=g) for _ in range(4))
    flip = AccumulatorFault("bitflip", 27, 0.0, 30, 3, 0.0, 0.0)
    clean = attention_forward(q, k, v, 0.2, True)
    bad = attention_forward(q, k, v, 0.2, True, HeadFault(4, "pv", flip))
    assert int(bad.values.argmax()) == 4 and bad.values[4] > 100 * clean.values.max()
    clean_b = attention_backward(q, k, v, clean.out, clean.lse, do, 0.2, True)
    bad_b = attention_backward(q, k, v, clean.out, clean.lse, do, 0.2, True, HeadFault(2, "softmax", flip))
    assert int(bad_b.values[0].argmax()) == 2 and bad_b.values[0, 2] > 100 * clean_b.values[0].max()


@pytest.mark.parametrize("stage", ["dp", "ds", "dq", "dk"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_checks_see_faults_in_dp_ds_dq_and_dk(stage, causal):
    # Each backward stage's corruption breaks its own check, in the corrupted head, by orders of
    # magnitude over the clean values; the other checks of that head stay clean (each is localized).
    from aegis_sdc.faults.models import AccumulatorFault
    from aegis_sdc.kernels.attention_reference import BACKWARD_CHECKS, HeadFault

    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(6, 40, 32, generator=g) for _ in range(4))
    # row 30 / column 3: inside the causal mask's kept part for dp and ds (key 3 ≤ query 30)
    flip = AccumulatorFault("bitflip", 27, 0.0, 30, 3, 0.0, 0.0)
    forward = attention_forward(q, k, v, 0.2, causal)
    clean = attention_backward(q, k, v, forward.out, forward.lse, do, 0.2, causal)
    bad = attention_backward(q, k, v, forward.out, forward.lse, do, 0.2, causal, HeadFault(4, stage, flip))
    check = BACKWARD_CHECKS.index(stage)
    assert int(bad.values[check].argmax()) == 4
    assert bad.values[check, 4] > 100 * clean.values[check].max()
    assert torch.equal(bad.values[:, :4], clean.values[:, :4])  # other heads untouched


STAGE_FAULTS = [  # (site kind, stage, step, detected at, wrong pass); forward qk/softmax faults show up in
    # the backward checks (through the saved lse), a forward pv fault in both (O feeds D = rowsum(dO ⊙ O))
    ("attn_fwd", "pv", 20, "attn_fwd", "forward"),
    ("attn_bwd", "dp", 21, "attn_bwd", "backward"),
    ("attn_bwd", "ds", 23, "attn_bwd", "backward"),
    ("attn_bwd", "dq", 25, "attn_bwd", "backward"),
    ("attn_bwd", "dk", 27, "attn_bwd", "backward"),
    ("attn_fwd", "qk", 22, "attn_bwd", "forward"),
    ("attn_fwd", "softmax", 24, "attn_bwd", "forward"),
    ("attn_bwd", "qk", 26, "attn_bwd", "backward"),
    ("attn_bwd", "softmax", 28, "attn_bwd", "backward"),
    ("attn_bwd", "pv", 30, "attn_bwd", "backward"),
]


def test_faults_in_every_stage_are_confirmed_with_site_step_batch_and_head(tmp_path):
    # Row 100, column 5 (inside the causal mask). Forward scores and probabilities: bit 30, far above
    # the noise (it reaches the backward check through the saved lse); elsewhere bit 27. The policy
    # skips each corrupted step, so one fault does not poison the model for the next.
    faults = tuple(
        aegis.FaultSpec(
            site=f"layers.0.attn:{kind}",
            model="bitflip",
            bit=30 if kind == "attn_fwd" and stage != "pv" else 27,
            stage=stage,
            steps=(step,),
            row=100,
            col=5,
        )
        for kind, stage, step, _, _ in STAGE_FAULTS
    )
    model, data, optimizer = small_workload(cfg=MEDIUM, batch=4, seq=128)
    config = guard_config(tmp_path, faults=faults, response=aegis.ResponseConfig(policy="skip-step"))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    train(model, data, optimizer, 32)
    summary = guard.close()
    heads = MEDIUM.n_heads
    injected = {inj.step: inj.head for inj in guard.injector.log if ":attn_" in inj.site}
    found = {(i.step, i.site.name): i for i in guard.incidents}
    # one incident per fault: the forward pv fault, its own check's incident, is found again by the
    # backward check (O feeds D) — that verdict joins the incident (`same_fault`), no second one
    assert sorted(found) == sorted((step, f"layers.0.attn:{at}") for _, _, step, at, _ in STAGE_FAULTS)
    assert summary.false_alarms == 0 and summary.same_fault == 1 and summary.confirmed == len(STAGE_FAULTS)
    for _, _, step, detected_at, wrong_pass in STAGE_FAULTS:
        incident = found[(step, f"layers.0.attn:{detected_at}")]
        assert incident.identity.rank == 0
        batch, head = divmod(incident.evidence.index, heads)
        assert incident.evidence.index == injected[step]
        assert f"batch {batch}, head {head}" in incident.verdict.detail
        assert f"training step's {wrong_pass} differs" in incident.verdict.detail


def test_clean_training_checks_attention_and_confirms_nothing(tmp_path):
    model, data, optimizer = small_workload(cfg=MEDIUM, batch=4, seq=128)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    losses = train(model, data, optimizer, 40)
    summary = guard.close()
    assert summary.attention_checks == 40 * 2  # one call per step, forward and backward
    assert summary.confirmed == 0 and not guard.incidents
    assert losses[-1] < losses[0]
    assert {s.name for s in guard.registry.extra} >= {"layers.0.attn:attn_fwd", "layers.0.attn:attn_bwd"}


def test_finite_inputs_whose_scores_overflow_are_the_datas_never_a_false_alarm(tmp_path):
    # Queries and keys of 1e20: finite, but their scores pass fp32's range and the softmax gives NaN.
    # The forward check's values are not finite, two replays reproduce every bit: the data's values
    # overflow — not the device, and not the check's noise (a false alarm counts against the check).
    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x, scale):
            q = self.proj(x).view(2, 8, 2, 8).transpose(1, 2) * scale
            return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(2, 8, 16)

    torch.manual_seed(0)
    model = SelfAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    for step in range(19):
        model(torch.randn(2, 8, 16), 1e20 if step == 17 else 1.0).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = guard.close()
    assert summary.false_alarms == 0 and summary.confirmed == 0 and not guard.incidents
    assert summary.nonfinite_inputs >= 2  # step 17's forward check among them


def test_differentiating_a_gradient_through_checked_attention_names_the_way_out(tmp_path):
    model, data, optimizer = small_workload(cfg=MEDIUM, batch=2, seq=32)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    tokens, _ = data.batch()
    embedded = model.tok_embeddings(tokens).detach().requires_grad_()
    hidden = embedded
    for layer in model.layers:
        hidden = layer(hidden, model.rope_cos[: tokens.shape[1]], model.rope_sin[: tokens.shape[1]])
    (grad,) = torch.autograd.grad(hidden.square().sum(), embedded, create_graph=True)
    with pytest.raises(RuntimeError, match=r"aegis-sdc.*attention=False"):
        grad.square().sum().backward()
    guard.close()


def test_unsupported_calls_and_calls_outside_the_model_keep_sdpa(tmp_path):
    model, data, optimizer = small_workload(cfg=MEDIUM, batch=2, seq=64)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    q = torch.randn(1, 2, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # not from the model: SDPA
        assert torch.allclose(masked, reference(q, q, q, True), atol=1e-6)
    train(model, data, optimizer, 2)
    summary = guard.close()
    assert summary.attention_checks == 2 * 2
    assert F.scaled_dot_product_attention.__module__ != "aegis_sdc.integrations.attention"  # restored
    assert math.isfinite(summary.false_alarm_rate)


def test_two_guards_closed_in_either_order_leave_sdpa_and_checkpoint_working(tmp_path):
    original_sdpa, original_checkpoint = F.scaled_dot_product_attention, torch.utils.checkpoint.checkpoint
    first_model, data, first_opt = small_workload(cfg=MEDIUM, batch=2, seq=64)
    second_model, _, second_opt = small_workload(cfg=MEDIUM, batch=2, seq=64)
    first = aegis.protect(first_model, optimizer=first_opt, config=guard_config(tmp_path / "a"))
    second = aegis.protect(second_model, optimizer=second_opt, config=guard_config(tmp_path / "b"))
    first.close()  # closed under the second guard's patches: its own must pass calls on
    train(second_model, data, second_opt, 2)
    assert second.close().attention_checks == 2 * 2 and first.summary().attention_checks == 0
    train(first_model, data, first_opt, 1)  # both closed: the originals are back
    assert F.scaled_dot_product_attention is original_sdpa
    assert torch.utils.checkpoint.checkpoint is original_checkpoint


def test_a_wrong_reference_side_is_confirmed_not_taken_for_noise():
    # A replay that reproduces every output but not the check's own values means the step computed
    # its reference side wrong (a device fault that did not touch training): confirmed, never a
    # false alarm (which would raise the threshold). A replay that reproduces both is a false alarm.
    from aegis_sdc.events import VerdictKind
    from aegis_sdc.ops.checked_attention import REFERENCE, CallReplay
    from aegis_sdc.sensors.attention import AttentionCapture

    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(4, 24, 16, generator=g) for _ in range(4))
    forward = attention_forward(q, k, v, 0.25, True)
    backward = attention_backward(q, k, v, forward.out, forward.lse, do, 0.25, True)
    grads = (backward.dq, backward.dk, backward.dv)
    replay = CallReplay(REFERENCE, 1, q, k, v, 0.25, True, forward.out, forward.lse, do, grads)
    clean = AttentionCapture(replay, True, 0, 1, backward.values[:, 1].clone())
    assert clean.verdict()[0] is VerdictKind.FALSE_ALARM
    wrong_reference = backward.values[:, 1].clone()
    wrong_reference[2] += 1.0  # the ds check's value, as a faulty fp64 sum would leave it
    kind, _, detail = AttentionCapture(replay, True, 0, 1, wrong_reference).verdict()
    assert kind is VerdictKind.CONFIRMED_SDC and "reference side" in detail
    forward_replay = CallReplay(REFERENCE, 3, q, k, v, 0.25, True, forward.out, forward.lse)
    assert AttentionCapture(forward_replay, False, 0, 3, forward.values[3:4].clone()).verdict()[0] is (
        VerdictKind.FALSE_ALARM
    )


@pytest.mark.parametrize("kind", ["padding-bool", "float-bias", "left-padded-causal"])
def test_attn_masks_are_checked_and_match_sdpa(kind):
    # A padded batch (boolean [B, 1, 1, Sk]: the last keys of batch 1 are padding), an additive float
    # mask [1, H, Sq, Sk], and a left-padded causal batch as Hugging Face builds it ([B, 1, Sq, Sk]:
    # the first 7 query rows of batch 1 see no key at all; SDPA gives them zeros, output and
    # gradients): values and gradients as SDPA's math backend, checks under their bounds.
    g = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 4, 24, 16
    q, k, v = (torch.randn(b, h, s, d, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, s, d, generator=g)
    if kind == "padding-bool":
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
        mask[1, ..., s - 7 :] = False
    elif kind == "left-padded-causal":
        mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
        mask[1, ..., :7] = False  # keys 0..6 of batch 1 are padding: its query rows 0..6 see none
    else:
        mask = torch.randn(1, h, s, s, generator=g)
    hooks = Quiet()
    out = checked_attention(q, k, v, attn_mask=mask, hooks=hooks)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
    # fp32 on both sides, sums in another order: (Sk + D)·u of the largest value, ×4 (as above)
    assert (out - ref).abs().max() <= 4 * (s + d) * 2.0**-24 * v.abs().max()
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).abs().max() <= 8 * (2 * s + d) * 2.0**-24 * want.abs().max()
    assert float(hooks.values[True][0].max()) < backward_bound(s, s)
    assert bool(torch.isfinite(hooks.values[False]).all()) and bool(torch.isfinite(hooks.values[True]).all())
    if kind == "left-padded-causal":  # the keyless rows: zeros, as SDPA's, and nothing else touched
        assert not out[1, :, :7].any() and not grads[0][1, :, :7].any()
        assert ref[1, :, 7:].abs().min() > 0


@pytest.mark.parametrize("shape", [(24, 24), (1, 4, 24, 24), (2, 1, 24, 24), (2, 4, 24, 24), (4, 24, 24)])
def test_a_learned_attn_mask_gets_sdpas_gradient_summed_over_its_broadcast(shape):
    # T5's position bias [1, H, Sq, Sk], Swin's relative bias: a float mask that requires grad. Its
    # gradient is the scores' gradient dS, summed over the dimensions it was broadcast along.
    g = torch.Generator().manual_seed(5)
    b, h, s, d = 2, 4, 24, 16
    q, k, v = (torch.randn(b, h, s, d, generator=g).requires_grad_() for _ in range(3))
    mask = (0.5 * torch.randn(*shape, generator=g)).requires_grad_()
    dout = torch.randn(b, h, s, d, generator=g)
    hooks = Quiet()
    out = checked_attention(q, k, v, attn_mask=mask, hooks=hooks)
    grads = torch.autograd.grad(out, (q, k, v, mask), dout)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, mask)]
        ref = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3])
        ref_grads = torch.autograd.grad(ref, leaves, dout)
    assert grads[3].shape == mask.shape
    # fp32 on both sides, sums in another order (as above); dMask adds a sum over at most B·H = 8 terms
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).abs().max() <= 8 * (2 * s + d + b * h) * 2.0**-24 * want.abs().max()
    assert float(hooks.values[True][0].max()) < backward_bound(s, s)


def test_t5s_attention_with_its_learned_position_bias_is_checked_and_a_fault_in_it_confirmed(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                   decoder_start_token_id=0, dropout_rate=0.0)  # fmt: skip

    def run(run_dir, faults=()):
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(run_dir, faults=faults))
        g, losses = torch.Generator().manual_seed(1), []
        for _ in range(5):
            ids, labels = torch.randint(1, 128, (4, 16), generator=g), torch.randint(1, 128, (4, 12), generator=g)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return guard, guard.close(), losses

    guard, summary, losses = run(tmp_path / "clean")
    assert not any(name.endswith((":attn_fwd", ":attn_bwd")) for name in summary.coverage["not_covered"])
    assert summary.attention_checks == 5 * 6 * 2 and summary.confirmed == 0  # 6 attention modules
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(config)  # the same model unprotected: same losses
    optimizer, g, expected = torch.optim.SGD(plain.parameters(), lr=0.05), torch.Generator().manual_seed(1), []
    for _ in range(5):
        ids, labels = torch.randint(1, 128, (4, 16), generator=g), torch.randint(1, 128, (4, 12), generator=g)
        loss = plain(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)  # fp32, sums in another order
    site = "encoder.block.0.layer.0.SelfAttention:attn_bwd"  # the block whose bias is learned
    fault = aegis.FaultSpec(site=site, model="perturb", scale=64.0, steps=(3,), stage="ds")
    with pytest.warns(UserWarning, match="confirmed SDC"):
        guard, summary, _ = run(tmp_path / "fault", (fault,))
    assert [(i.step, i.site.name) for i in guard.incidents] == [(3, site)]


class OddShapes(torch.nn.Module):
    """SDPA called the ways it allows beyond [B, H, S, D] with grouped heads."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [B, S, 16]
        if self.mode == "one head [B, S, D]":
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        heads = [t.view(*x.shape[:2], 2, 8).transpose(1, 2) for t in (q, k, v)]  # [B, 2, S, 8]
        if self.mode == "one key head broadcast":
            q, k, v = heads[0], heads[1][:, :1], heads[2][:, :1]
        elif self.mode == "keys broadcast over the batch":
            q, k, v = heads[0], heads[1][:1], heads[2][:1]
        else:  # "5-D"
            q, k, v = (t.unsqueeze(1) for t in heads)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.reshape(*x.shape[:2], 2, 8).flatten(2) if y.dim() == 5 else y.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("mode,reason", [
    ("one head [B, S, D]", None),
    ("one key head broadcast", None),
    ("keys broadcast over the batch", "the batch not broadcast"),
    ("5-D", "the checked op takes [B, H, S, D] or [B, S, D]"),
])  # fmt: skip
def test_sdpa_calls_of_other_shapes_are_checked_or_named_never_crashed(tmp_path, mode, reason):
    # Before, a call the op did not take ran SDPA unnamed (a 3-D or 5-D one), or raised from inside the
    # op (keys broadcast over the batch).
    torch.manual_seed(0)
    model = OddShapes(mode)
    site = "<root>:attn_bwd"
    fault = aegis.FaultSpec(site=site, model="perturb", scale=64.0, steps=(2,), stage="dk")
    guard = aegis.protect(model, config=guard_config(tmp_path, faults=() if reason else (fault,)))
    with pytest.warns(UserWarning, match="confirmed SDC" if reason is None else "attention not checked"):
        for _ in range(4):
            model(torch.randn(4, 8, 16)).square().mean().backward()
            guard.step()
    summary = guard.close()
    if reason is None:
        assert summary.attention_checks == 4 * 2
        assert [(i.step, i.site.name) for i in guard.incidents] == [(2, site)]
    else:
        assert summary.attention_checks == 0 and reason in summary.coverage["not_covered"]["<root>:attn_fwd"]


class PaddedAttention(torch.nn.Module):
    """A tiny model whose attention takes a padding mask (and dropout when asked), as HF models do."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.proj = torch.nn.Linear(32, 32)
        self.dropout = dropout

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 16).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(b, s, 32))


def _padded_training(model, optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 1, 1, 32, dtype=torch.bool)
    mask[2:, ..., 20:] = False  # two sequences padded after 20 tokens
    for _ in range(steps):
        x = torch.randn(4, 32, 32, generator=g)
        loss = model(x, mask).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


# the Triton case under the interpreter (slow on the CPU): dropout and padding together, fewer steps
@pytest.mark.parametrize("dropout,kernels", [(0.0, "reference"), (0.1, "reference"), (0.1, "triton")])
def test_a_padded_batch_is_checked_and_a_fault_in_it_confirmed(tmp_path, monkeypatch, dropout, kernels):
    # A padded batch, with attention dropout (p = 0.1) or without: every call checked (under dropout
    # dv is P_dᵀ·dO's column check plus P's rows on the reference kernels, P_dᵀ·dO's row check on the
    # Triton kernels), no false alarm over the clean steps, a dq fault confirmed — the replay redraws
    # the same mask (kept with the call's context; the Triton kernels keep its seed). On the Triton
    # kernels (the interpreter here) the suspect head is chosen and copied without a host read.
    steps, fault_step, calibration = 24, 20, aegis.ThresholdConfig()
    if kernels == "triton":
        monkeypatch.setattr(attention_op, "kernels_for", lambda *args, **kwargs: attention_op.TRITON)
        steps, fault_step, calibration = 7, 5, aegis.ThresholdConfig(calibration_checks=4)  # 4 steps calibrate
    torch.manual_seed(0)
    model = PaddedAttention(dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = aegis.FaultSpec(site="<root>:attn_bwd", model="bitflip", bit=27, stage="dq", steps=(fault_step,), row=5,
                            col=3)  # fmt: skip
    config = guard_config(tmp_path, faults=(fault,), thresholds=calibration)
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    _padded_training(model, optimizer, steps)
    summary = guard.close()
    assert summary.attention_checks == steps * 2
    assert [(i.step, i.site.name) for i in guard.incidents] == [(fault_step, "<root>:attn_bwd")]
    assert summary.false_alarms == 0


@pytest.mark.parametrize("stage", ["qk", "softmax", "pv", "dp", "ds", "dq", "dk"])
def test_under_dropout_each_backward_stage_is_seen_by_its_check(stage):
    g = torch.Generator().manual_seed(5)
    n, s, d = 2, 24, 16
    q, k, v, do = (torch.randn(n, s, d, generator=g) for _ in range(4))
    drop = (torch.rand(n, s, s, generator=g) >= 0.2).float() / 0.8
    fwd = attention_forward(q, k, v, 0.25, True, drop=drop)
    clean = attention_backward(q, k, v, fwd.out, fwd.lse, do, 0.25, True, drop=drop)
    corruption = AccumulatorFault("bitflip", 27, 0.0, 5, 3, 0.0, 0.0)
    hit = attention_backward(q, k, v, fwd.out, fwd.lse, do, 0.25, True, HeadFault(1, stage, corruption), drop=drop)
    row = {"qk": 0, "softmax": 0, "pv": 0, "dp": 1, "ds": 2, "dq": 3, "dk": 4}[stage]  # qk, softmax: P's rows
    assert float(clean.values.max()) < backward_bound(s, s)  # clean: every check under its bound
    assert float(hit.values[row, 1]) > 100 * float(clean.values[row].max())
    assert torch.equal(hit.values[:, 0], clean.values[:, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("triton_on,dropout,reason", [
    (False, 0.0, "attention on CUDA"),  # the switch off: every CUDA call is named
    (True, 0.1, "torch.float32 operands"),  # the kernels take bf16/fp16
])  # fmt: skip
def test_unchecked_attention_on_cuda_is_named_in_the_coverage(tmp_path, monkeypatch, triton_on, dropout, reason):
    monkeypatch.setattr(attention_op, "TRITON_ON_CUDA", triton_on)
    torch.manual_seed(0)
    model = PaddedAttention(dropout=dropout).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match=f"attention not checked — {reason}"):
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
        x = torch.randn(4, 32, 32, device="cuda")
        for _ in range(2):
            model(x, None).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    assert reason in summary.coverage["not_covered"]["<root>:attn_fwd"]


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_on_cuda_the_triton_kernels_check_padded_bf16_batches_and_confirm_a_fault(tmp_path, monkeypatch, dropout):
    # The routed path as it will run once TRITON_ON_CUDA is on: a bf16 model on the GPU whose SDPA
    # calls take a padding mask [B, 1, 1, S], with attention dropout or without — every sampled call
    # on the Triton kernels, no false alarm in the clean steps, a dq fault confirmed at its site and
    # step, nothing named unchecked.
    monkeypatch.setattr(attention_op, "TRITON_ON_CUDA", True)
    torch.manual_seed(0)
    model = PaddedAttention(dropout=dropout).cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = aegis.FaultSpec(site="<root>:attn_bwd", model="bitflip", bit=27, stage="dq", steps=(20,), row=5, col=3)
    # every call checked: on CUDA the default 1% budget samples, and this test counts checks
    every_call = aegis.SamplingConfig(probability=1.0)
    config = guard_config(tmp_path, faults=(fault,), sampling=every_call)
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    mask = torch.ones(4, 1, 1, 32, dtype=torch.bool, device="cuda")
    mask[2:, ..., 20:] = False
    for _ in range(24):
        x = torch.randn(4, 32, 32, device="cuda", dtype=torch.bfloat16)
        model(x, mask).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    assert summary.attention_checks == 24 * 2
    assert [(i.step, i.site.name) for i in guard.incidents] == [(20, "<root>:attn_bwd")]
    assert summary.false_alarms == 0 and not any(":attn_" in site for site in summary.coverage["not_covered"])


class CrossAttention(torch.nn.Module):
    """Self-attention over `x`, then attention from `x` to a `memory` that may hold no token."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.kv = torch.nn.Linear(32, 64)
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x, memory):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 16).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mk, mv = self.kv(memory).view(b, memory.shape[1], 2, 2, 16).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(h, mk, mv)
        return self.proj(o.transpose(1, 2).reshape(b, s, 32))


def test_attention_on_an_empty_batch_or_no_token_runs_unchecked_as_sdpa(tmp_path):
    # batch 0, no query token, no key token: no arithmetic to check; SDPA's result, nothing recorded
    torch.manual_seed(0)
    model = CrossAttention()
    plain = CrossAttention()
    plain.load_state_dict(model.state_dict())
    config = guard_config(tmp_path, sampling=aegis.SamplingConfig.every_call())
    guard = aegis.protect(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    # (batch, query tokens, memory tokens); only (2, 8, 0) has a call with something to check: its
    # self-attention (forward and backward); its attention to the empty memory has no key
    for batch, tokens, memory_tokens in [(0, 8, 8), (2, 0, 8), (2, 8, 0), (0, 0, 0)]:
        x = torch.randn(batch, tokens, 32, requires_grad=True)
        memory = torch.randn(batch, memory_tokens, 32)
        out = model(x, memory)
        want = plain(x, memory)
        assert out.shape == want.shape == (batch, tokens, 32)
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
        out.sum().backward()  # the backward of an empty call too
        assert x.grad.shape == x.shape
    model(torch.randn(2, 8, 32), torch.randn(2, 4, 32)).sum().backward()  # both calls checked
    summary = guard.close()
    assert summary.attention_checks == 2 + 2 * 2  # the empty calls: none
    assert not any(":attn_" in site for site in summary.coverage["not_covered"])
