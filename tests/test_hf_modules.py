"""Hugging Face's matmul modules beyond nn.Linear: GPT-2's `Conv1D` (Y = X·W + b, W [in, out]) is
protected as the Linear with Wᵀ (integrations/modules.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import guard_config, hf_llama

import aegis_sdc as aegis

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2s_conv1d_projections_are_protected_and_a_fault_in_one_is_confirmed(tmp_path):
    model = _gpt2()
    conv1d = [name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 8  # c_attn, c_proj, mlp.c_fc, mlp.c_proj per block
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    site = "transformer.h.1.mlp.c_fc"
    faults = tuple(aegis.FaultSpec(site=f"{site}:{kind}", model="bitflip", bit=27, steps=(step,), row=3, col=5)
                   for kind, step in (("fwd", 4), ("dgrad", 5), ("wgrad", 6)))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=faults))
    checked = {name for name, m in model.named_modules() if type(m).__name__ == "CheckedConv1D"}
    assert checked == set(conv1d)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = torch.randint(0, 128, (4, 32), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    assert sorted((i.step, i.site.name) for i in guard.incidents) == [
        (4, f"{site}:fwd"), (5, f"{site}:dgrad"), (6, f"{site}:wgrad")
    ]  # fmt: skip
    assert summary.false_alarms == 0
    assert not any(":" in key and key.split(":")[0] in conv1d for key in summary.coverage["not_covered"])
    assert all(type(m).__name__ == "Conv1D" for name, m in model.named_modules() if name in conv1d)  # restored


def test_an_unsampled_conv1d_call_is_conv1ds_own_and_copies_are_plain(tmp_path):
    # Nothing sampled once each site's one calibration check is taken (attention left to SDPA): the
    # protected model then computes exactly what the unprotected one does — Conv1D's own addmm.
    model = _gpt2()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = guard_config(tmp_path, sampling=aegis.SamplingConfig(probability=0.0), attention=False,
                          thresholds=aegis.ThresholdConfig(calibration_checks=1))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()  # step 0: every site's calibration check
    optimizer.step()
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    copied = copy.deepcopy(model)
    assert all(type(m).__name__ != "CheckedConv1D" for m in copied.modules())
    assert guard.close().checks == 3 * 9  # step 0: 8 Conv1D and the head, three GEMMs each


def _one_step(model, tmp_path, ids):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))  # CPU: every call checked
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    report = guard.coverage_report()
    guard.close()
    return report


def test_the_coverage_report_counts_gpt2s_and_berts_matmul_flops(tmp_path):
    # Analytic counts at 4 × 32 tokens (T = 128): a protected module's three GEMMs cost 3 · 2·T·in·out;
    # attention per layer 14·B·H·S²·D (forward QKᵀ and P·V, backward the scores again, dV, dP, dQ,
    # dK), half of it for GPT-2's causal calls; BERT's have no mask (full).
    t, b, h, s, d = 128, 4, 4, 32, 16
    ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(3))
    gpt2 = _one_step(_gpt2(), tmp_path / "gpt2", ids)
    per_layer = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64  # c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    assert gpt2.protected == {"Conv1D": 8, "Linear": 1}
    assert gpt2.gemm_flops == 3 * 2 * t * (2 * per_layer + 64 * 128)  # and lm_head
    assert gpt2.attention_flops == 2 * 14 * b * h * s * s * d / 2
    assert gpt2.checked_share == 1.0 and gpt2.not_covered == {}

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=128, max_position_embeddings=64)  # fmt: skip
    bert = _one_step(transformers.BertForMaskedLM(config), tmp_path / "bert", ids)
    per_layer = 4 * 64 * 64 + 64 * 128 + 128 * 64  # q, k, v, attention output; intermediate, output
    assert bert.protected == {"Linear": 14}
    assert bert.gemm_flops == 3 * 2 * t * (2 * per_layer + 64 * 64 + 64 * 128)  # and the MLM head's two
    assert bert.attention_flops == 2 * 14 * b * h * s * s * d
    assert "protected: 14 Linear" in bert.describe()


class WithUncheckedMatmuls(torch.nn.Module):
    """A Linear subclass (as LoRA and quantized layers are) and nn.MultiheadAttention beside a Linear."""

    class Scaled(torch.nn.Linear):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.plain = torch.nn.Linear(16, 16)
        self.scaled = self.Scaled(16, 16)
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)


def test_matmul_modules_left_unprotected_are_named_with_the_reason(tmp_path):
    model = WithUncheckedMatmuls()
    with pytest.warns(UserWarning, match="1 matmul modules not protected"):
        guard = aegis.protect(model, config=guard_config(tmp_path))
    report = guard.coverage_report()
    guard.close()
    # nn.MultiheadAttention is protected (its out_proj through it: tests/test_torch_modules.py)
    assert report.protected == {"Linear": 1, "MultiheadAttention": 1}
    assert set(report.not_covered) == {"scaled"}
    assert "subclass of nn.Linear" in report.not_covered["scaled"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_no_matrix_of_a_mixture_of_experts_model_is_left_out_silently(tmp_path, family):
    # Experts held as [experts, out, in] parameters (grouped matmuls) and routers are no nn.Linear:
    # each matrix of the model is either checked — a Linear's, or one Linear's sites per expert and the
    # router's (integrations/matrices.py; tests/test_matrices.py trains them) — or named as not covered.
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)  # fmt: skip
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4))
    else:
        config = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64)  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(config)
    guard = aegis.protect(model, optimizer=torch.optim.AdamW(model.parameters()), config=guard_config(tmp_path))
    report = guard.coverage_report()
    guard.close()  # the model's own modules again
    protected = {site.name.rsplit(":", 1)[0] for site in guard.sites}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or name in protected:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() < 2 or p.shape[0] == 1:
                continue
            sites = {f"{name}.{pname}"} if p.dim() == 2 else {f"{name}.{e}.{pname}" for e in range(p.shape[0])}
            assert sites <= protected or f"{name}.{pname}" in report.not_covered, (name, pname)


def test_attention_a_model_computes_without_sdpa_is_named_not_covered_with_one_warning(tmp_path):
    # transformers' 'eager' attention (Gemma2's only one) multiplies Q·Kᵀ and P·V itself: the
    # router never sees it, so its modules are named at protect(), not left out silently
    model = hf_llama(attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters())
    spec = aegis.FaultSpec(site="model.layers.0.self_attn:attn_fwd", model="bitflip", bit=30, steps=(0,))
    with pytest.warns(UserWarning, match="attention of 2 modules") as caught:
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    assert sum("not checked" in str(w.message) for w in caught) == 1
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.warns(UserWarning, match="matches only sites that run unchecked, so it never fires"):
        optimizer.step()  # a fault aimed at such a site is named, not silently a no-op
    summary = guard.close()
    attention = {f"model.layers.{i}.self_attn:{kind}" for i in range(2) for kind in ("attn_fwd", "attn_bwd")}
    assert summary.attention_checks == 0 and set(summary.coverage["not_covered"]) == attention
    assert all("'eager'" in summary.coverage["not_covered"][site] for site in attention)


@pytest.mark.parametrize("fault", [False, True])
def test_a_left_padded_batch_has_its_attention_checked_and_a_fault_in_it_confirmed(tmp_path, fault):
    # Left padding (the first 5 tokens of row 0 are padding): the padded query rows see no key at all
    # in Hugging Face's causal mask. SDPA gives them zeros; the checked op does the same and checks
    # every other row — the call was left unchecked before, so padded batches ran with no attention
    # check at all.
    model = hf_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    site = "model.layers.1.self_attn:attn_bwd"
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, stage="dq", steps=(6,), row=12, col=3)
    specs = (spec,) if fault else ()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=specs))
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    summary = guard.close()
    assert summary.attention_checks == 8 * 2 * 2  # every call of both layers, forward and backward
    assert not any(":attn_" in site for site in summary.coverage["not_covered"])
    assert [(i.site.name, i.step) for i in guard.incidents] == ([(site, 6)] if fault else [])
    assert summary.confirmed == int(fault)


def test_mambas_projections_are_checked_and_its_state_matrix_is_not_named_as_a_matmul(tmp_path):
    # Mamba's mixer holds A_log [d_inner, state] of its own: exp'd and multiplied by the step sizes
    # elementwise (the discretization), never a matmul weight — not named; its conv1d is (a
    # convolution). Its four projections are Linears, checked; a fault in one is confirmed.
    torch.manual_seed(0)
    config = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=8)
    model = transformers.MambaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    site = "backbone.layers.1.mixer.x_proj:wgrad"
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(2,), row=1, col=2)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    report = guard.coverage_report()
    summary = guard.close()
    assert set(report.not_covered) == {f"backbone.layers.{i}.mixer.conv1d" for i in range(2)}
    assert report.protected == {"Linear": 9}  # in_proj, x_proj, dt_proj, out_proj per layer; lm_head
    assert [(i.step, i.site.name) for i in guard.incidents] == [(2, site)]
    assert summary.false_alarms == 0


@pytest.mark.parametrize("method", ["lora", "dora", "ia3", "vera", "loha", "oft"])
def test_peft_adapters_are_checked_or_named_with_their_layer(tmp_path, method):
    # LoRA's factors are nn.Linear modules (checked; DoRA's magnitude is a vector), IA³ scales
    # elementwise: nothing to name. VeRA's frozen random matrices, LoHa's Hadamard factors and OFT's
    # rotations are multiplied outside nn.Linear: named — the tuner layer with its adapter matrices,
    # OFT's rotation module by the einsum that multiplies it (integrations/matrices.py).
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj"]
    config = {
        "lora": lambda: peft.LoraConfig(r=4, target_modules=targets),
        "dora": lambda: peft.LoraConfig(r=4, target_modules=targets, use_dora=True),
        "ia3": lambda: peft.IA3Config(target_modules=targets, feedforward_modules=[]),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=targets),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=targets),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=16, target_modules=targets),
    }[method]()
    model = peft.get_peft_model(hf_llama(), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    site = "base_model.model.model.layers.1.mlp.down_proj:dgrad"  # no adapter there: a plain Linear
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(2,))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    named = guard.coverage_report().not_covered
    summary = guard.close()
    layers = {f"base_model.model.model.layers.{i}.self_attn.{t}" for i in range(2) for t in targets}
    if method in ("lora", "dora", "ia3"):
        assert named == {}
    elif method == "oft":
        assert set(named) == {f"{layer}.oft_R.default.weight" for layer in layers}
        assert all("multiplied by torch.einsum" in reason for reason in named.values())
    else:
        assert set(named) == layers and all("PEFT adapter layer" in reason for reason in named.values())
    assert [(i.step, i.site.name) for i in guard.incidents] == [(2, site)] and summary.false_alarms == 0


@pytest.mark.parametrize("change", ["resize_untied", "resize_tied", "peft_after_protect"])
def test_modules_a_model_gains_after_protect_are_named_and_the_rest_stays_checked(tmp_path, change):
    # resize_token_embeddings puts a new nn.Linear where an untied lm_head stood (a tied one keeps its
    # module and takes the embedding's weight); get_peft_model after protect() wraps the checked
    # Linears, its LoRA factors new Linears. What is new runs unchecked: named, with one warning.
    model = hf_llama(tie_word_embeddings=change == "resize_tied")
    site = "model.layers.1.mlp.down_proj:fwd"
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(2,))
    guard = aegis.protect(model, config=guard_config(tmp_path, faults=(spec,)))
    if change == "peft_after_protect":
        peft = pytest.importorskip("peft")
        with pytest.warns(UserWarning, match=r"lora_A.default: Linear put into the model after protect\(\)"):
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    elif change == "resize_untied":
        with pytest.warns(UserWarning, match=r"lm_head: Linear put into the model after protect\(\)"):
            model.resize_token_embeddings(160)
    else:
        model.resize_token_embeddings(160)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard.attach_optimizer(optimizer)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 160 if change.startswith("resize") else 128, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report = guard.coverage_report()
    summary = guard.close()
    assert [(i.step, i.site.name) for i in guard.incidents] == [(2, site)] and summary.false_alarms == 0
    if change == "resize_untied":
        assert list(report.not_covered) == ["lm_head"] and report.protected == {"Linear": 14}
    elif change == "resize_tied":  # the checked head multiplies by the resized, tied weight
        assert report.not_covered == {} and report.protected == {"Linear": 15}
        assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.shape[0] == 160
    else:
        factors = {f"model.layers.{i}.self_attn.q_proj.lora_{f}.default" for i in range(2) for f in "AB"}
        assert set(report.not_covered) == factors
