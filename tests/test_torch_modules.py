"""torch's own module forms of a matmul: parametrized Linears (weight_norm, spectral_norm, pruning
masks) are protected as Linears (integrations/modules.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import guard_config
from torch import nn
from torch.nn.utils import parametrize

import aegis_sdc as aegis


class Masked(nn.Module):
    """A pruning mask as torch.ao.pruning applies it: W ⊙ mask, the mask a buffer."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.register_buffer("mask", (torch.arange(shape.numel()).reshape(shape) % 3 != 0).float())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.mask


def _parametrized_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.Tanh(), nn.Linear(64, 8))
    if kind == "weight_norm":  # the second layer: its forward, dgrad and wgrad all run
        model[2] = nn.utils.parametrizations.weight_norm(model[2])
    elif kind == "spectral_norm":
        model[2] = nn.utils.parametrizations.spectral_norm(model[2])
    else:
        parametrize.register_parametrization(model[2], "weight", Masked(model[2].weight.shape))
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(96, 48, generator=gen), torch.randn(96, 8, generator=gen)
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "mask"])
def test_a_parametrized_linear_is_protected_and_trains_as_the_unprotected_one(tmp_path, kind):
    model = _parametrized_model(kind)
    reference = copy.deepcopy(model)
    optimizer = _optimizer(model)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    losses = _steps(model, optimizer, 6)
    report = guard.coverage_report()
    summary = guard.close()
    assert report.protected == {"ParametrizedLinear": 1, "Linear": 1}
    assert report.not_covered == {}
    assert summary.checks == 6 * 5 and summary.confirmed == 0  # the first layer has no dgrad
    # The checked GEMMs sum in another order than torch's (fp32, K ≤ 64): the losses agree to a few
    # ulps of fp32 per step, compounded over six SGD steps.
    assert losses == pytest.approx(_steps(reference, _optimizer(reference), 6), rel=1e-5)
    # the parametrization's own tensors are what the optimizer trained, under their own names
    assert model.state_dict().keys() == reference.state_dict().keys()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("site", ["2:fwd", "2:dgrad", "2:wgrad"])
def test_a_fault_in_a_parametrized_linear_is_confirmed_at_its_site_and_step(tmp_path, site):
    model = _parametrized_model("weight_norm")
    optimizer = _optimizer(model)
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=27, steps=(4,))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(fault,)))
    with pytest.warns(UserWarning, match="confirmed SDC"):
        _steps(model, optimizer, 6)
    guard.close()
    assert [(i.step, i.site.name, i.verdict.kind.value) for i in guard.incidents] == [(4, site, "confirmed_sdc")]


def test_copies_of_a_protected_parametrized_linear_are_the_plain_parametrized_module(tmp_path):
    model = _parametrized_model("spectral_norm")
    optimizer = _optimizer(model)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    _steps(model, optimizer, 1)
    copied = copy.deepcopy(model)
    guard.close()
    assert type(copied[2]).__name__ == "ParametrizedLinear" and type(copied[2]).__bases__ == (nn.Linear,)
    assert not any(key.startswith("aegis_") for m in copied.modules() for key in vars(m))
    model.eval(), copied.eval()  # (a spectral norm's power iteration runs in training mode only)
    torch.testing.assert_close(copied[2].weight, model[2].weight)  # the same computed weight


# nn.MultiheadAttention (integrations/multihead.py)


class Seq2Seq(nn.Module):
    """torch's own Transformer pieces: encoder self-attention (q is k is v: one packed projection),
    decoder self- and cross-attention (k is v: split [E | 2E]), and an attention whose key and value
    widths are not E (separate q/k/v weights) called with `need_weights` at its default."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 1,
                                             enable_nested_tensor=False)  # fmt: skip
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
        self.pool = nn.MultiheadAttention(32, 4, kdim=16, vdim=24, batch_first=True)
        self.keys = nn.Linear(32, 16)
        self.values = nn.Linear(32, 24)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(source)
        out = self.decoder(target, memory)
        pooled, _ = self.pool(out, self.keys(memory), self.values(memory))
        return pooled


def _seq2seq_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, run=None) -> list[float]:
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        source, target = torch.randn(4, 12, 32, generator=gen), torch.randn(4, 10, 32, generator=gen)
        loss = (run or model)(source, target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _multihead_sites(name: str) -> set[str]:
    return {f"{name}.{p}:{kind}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for kind in ("fwd", "wgrad")}


def test_multihead_attentions_projections_are_checked_and_train_as_the_unprotected_ones(tmp_path):
    torch.manual_seed(0)
    model = Seq2Seq()
    reference = copy.deepcopy(model)
    # SGD: Adam would turn the rounding noise of gradients that are zero in exact arithmetic (a key
    # projection's bias: softmax ignores a shift shared by all keys) into steps of ±lr
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    with pytest.warns(UserWarning, match="pool: attention not checked — need_weights=True"):
        losses = _seq2seq_steps(model, optimizer, 4)
    report = guard.coverage_report()
    checked = {s.site.name for s in guard.sensors if s.shape is not None}  # a sensor with a checked call
    summary = guard.close()
    assert report.protected == {"Linear": 8, "MultiheadAttention": 6}
    # every projection of every attention is checked, forward and wgrad (out_proj through its module)
    for name in ("encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn",
                 "decoder.layers.1.multihead_attn", "pool"):  # fmt: skip
        assert _multihead_sites(name) <= checked, name
    assert "decoder.layers.1.multihead_attn.q_proj:dgrad" in checked
    # the attention between them: through scaled_dot_product_attention, checked; the bmm path named
    assert summary.attention_checks > 0 and summary.confirmed == 0
    assert set(report.not_covered) == {"pool:attn_fwd", "pool:attn_bwd"}
    # The checked GEMMs sum in another order than torch's (fp32, K ≤ 64): a few ulps per step.
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    assert losses == pytest.approx(_seq2seq_steps(reference, reference_optimizer, 4), rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize(
    "site",
    ["encoder.layers.0.self_attn.q_proj:fwd", "decoder.layers.1.self_attn.v_proj:dgrad",
     "decoder.layers.0.multihead_attn.k_proj:wgrad", "decoder.layers.1.multihead_attn.out_proj:fwd",
     "pool.v_proj:wgrad"],
)  # fmt: skip
def test_a_fault_in_a_multihead_attentions_projection_is_confirmed_at_its_site_and_step(tmp_path, site):
    torch.manual_seed(0)
    model = Seq2Seq()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=27, steps=(3,))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(fault,)))
    with pytest.warns(UserWarning, match="confirmed SDC"):
        _seq2seq_steps(model, optimizer, 4)
    guard.close()
    assert [(i.step, i.site.name, i.verdict.kind.value) for i in guard.incidents] == [(3, site, "confirmed_sdc")]


def test_a_compiled_multihead_attention_has_no_graph_break_and_a_fault_in_it_is_confirmed(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    site = "layers.1.self_attn.k_proj:fwd"
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=27, steps=(3,))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(fault,)))
    source = torch.randn(4, 12, 32)
    assert torch._dynamo.explain(model)(source).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(UserWarning, match="confirmed SDC"):
        for _ in range(5):
            compiled(torch.randn(4, 12, 32)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    guard.close()
    assert [(i.step, i.site.name) for i in guard.incidents] == [(3, site)]


def test_copies_of_a_protected_multihead_attention_are_the_plain_module(tmp_path):
    torch.manual_seed(0)
    model = Seq2Seq()
    guard = aegis.protect(model, config=guard_config(tmp_path))
    copied = copy.deepcopy(model)
    guard.close()
    for name, module in copied.named_modules():
        assert not any(key.startswith("aegis_") for key in vars(module)), name
    assert type(copied.pool) is nn.MultiheadAttention
    assert type(copied.encoder.layers[0].self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_a_multihead_attention_left_out_is_named_once_with_its_out_proj_inside_it(tmp_path):
    torch.manual_seed(0)
    model = Seq2Seq()
    with pytest.warns(UserWarning, match="1 matmul modules not protected, e.g. pool: an nn.MultiheadAttention left"):
        guard = aegis.protect(model, config=guard_config(tmp_path, exclude=("pool",)))
    report = guard.coverage_report()
    guard.close()
    assert report.protected == {"Linear": 8, "MultiheadAttention": 5}
    assert report.not_covered == {"pool": "an nn.MultiheadAttention left out by GuardConfig.include/exclude"}


@pytest.mark.gpu
def test_on_cuda_a_transformer_encoders_projections_run_the_triton_kernels_and_a_fault_is_confirmed(tmp_path):
    # bf16 on the GPU: the thirds of in_proj_weight are row views at an offset of i·E·E elements
    # (16-byte aligned for E a multiple of 8), taken by the Triton kernels like any weight.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to("cuda", torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    site = "layers.1.self_attn.v_proj:wgrad"
    fault = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(6,))
    config = guard_config(tmp_path, faults=(fault,), sampling=aegis.SamplingConfig.every_call())
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(10):
        source = torch.randn(4, 512, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
        model(source).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    assert not any(":" in key and "proj" in key for key in summary.coverage["not_covered"])  # no GPU gap named
    assert [(i.step, i.site.name) for i in guard.incidents] == [(6, site)]
    assert summary.false_alarms == 0


def test_a_recurrent_layer_is_named_at_protect_with_its_reason(tmp_path):
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(16, 32, batch_first=True)
            self.head = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    model = Tagger()
    with pytest.warns(UserWarning, match="1 matmul modules not protected, e.g. rnn: LSTM, a recurrent layer"):
        guard = aegis.protect(model, config=guard_config(tmp_path))
    model(torch.randn(2, 5, 16)).sum().backward()
    guard.step()
    report = guard.coverage_report()
    guard.close()
    assert report.protected == {"Linear": 1}
    assert list(report.not_covered) == ["rnn"]  # the module, not each of its matrices


# Modules put into the model after protect() (integrations/protection.py: LateModules)


def test_matmul_modules_put_into_the_model_after_protect_are_named_with_one_warning(tmp_path):
    import sqlite3
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    with pytest.warns(UserWarning, match=r"2: Linear put into the model after protect\(\): not checked"):
        model[2] = nn.Linear(32, 4)  # a new head where the checked one stood
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.add_module("extra", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Conv1d(1, 1, 3)))
        model[1] = nn.GELU()  # no matmul: nothing to name
        model.extra[1] = nn.Linear(4, 4)  # inside a module put in late: seen too
    assert not [w for w in caught if "aegis-sdc" in str(w.message)]  # one warning for the guard's life
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard.attach_optimizer(optimizer)
    for _ in range(2):
        model[:3](torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    report = guard.coverage_report()
    summary = guard.close()
    assert report.protected == {"Linear": 1}  # the first layer only: the replaced head is not counted
    assert set(report.not_covered) == {"2", "extra.0", "extra.1", "extra.2"}
    assert report.not_covered["extra.2"].startswith("Conv1d put into the model after protect()")
    assert summary.checks == 2 * 2 and summary.confirmed == 0  # the first layer: fwd and wgrad (the data has no grad)
    conn = sqlite3.connect(next((tmp_path / "run").glob("*.sqlite")))
    assert conn.execute("SELECT COUNT(*) FROM events WHERE kind = 'not_covered'").fetchone()[0] == 4
    with warnings.catch_warnings(record=True) as caught:  # a closed guard watches nothing
        warnings.simplefilter("always")
        model[0] = nn.Linear(16, 32)
    assert not caught


# torch.func transforms (integrations/modules.py: TRANSFORMED)


def test_torch_func_transforms_over_a_protected_model_run_unchecked_named_with_one_warning(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    ids = torch.randint(1, 128, (2, 16))

    def loss_of(module):
        return lambda params: functional_call(module, params, (ids,), {"labels": ids}).loss

    params = {name: p.detach() for name, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="torch.func transform") as caught:
        grads = grad(loss_of(model))(params)
    assert sum("aegis-sdc" in str(w.message) for w in caught) == 1  # one warning, not one per module
    expected = grad(loss_of(reference))({name: p.detach() for name, p in reference.named_parameters()})
    for name, g in grads.items():
        assert torch.equal(g, expected[name]), name  # torch's own ops: the same bits

    # per-sample gradients of the head (vmap over grad), then training goes on checked
    head = {"weight": model.lm_head.weight.detach()}
    hidden = torch.randn(8, 64)
    per_sample = vmap(grad(lambda p, h: functional_call(model.lm_head, p, (h,)).square().sum()), in_dims=(None, 0))(
        head, hidden
    )
    assert per_sample["weight"].shape == (8, 128, 64)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = guard.close()
    assert summary.checks > 0 and summary.attention_checks > 0 and summary.confirmed == 0
    reasons = summary.coverage["not_covered"]
    assert reasons["model.layers.0.mlp.down_proj:fwd"].startswith("its calls under a torch.func transform")
    assert reasons["model.layers.1.self_attn:attn_fwd"].startswith("its calls under a torch.func transform")


def test_a_bias_table_and_a_column_of_scales_are_not_named_as_unchecked_matrices(tmp_path):
    class RelativeBias(nn.Module):  # as Swin's: a [positions, heads] table gathered into the scores
        def __init__(self) -> None:
            super().__init__()
            self.relative_position_bias_table = nn.Parameter(torch.zeros(49, 2))

        def forward(self, index: torch.Tensor) -> torch.Tensor:
            return self.relative_position_bias_table[index]

    class Scale(nn.Module):  # as PEFT's IA³: a learned [features, 1] scale, multiplied elementwise
        def __init__(self) -> None:
            super().__init__()
            self.ia3_l = nn.Parameter(torch.ones(2, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.ia3_l.flatten()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = RelativeBias()
            self.scale = Scale()
            self.proj = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(self.proj(x)) + self.bias(torch.arange(x.shape[0]) % 49)

    model = Block()
    guard = aegis.protect(model, config=guard_config(tmp_path))
    model(torch.randn(10, 8)).sum().backward()
    guard.step()
    report = guard.coverage_report()
    guard.close()
    assert report.protected == {"Linear": 1} and report.not_covered == {}


# torch's wrappers: site names without their attributes (integrations/modules.py: module_names)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _residual_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Residual() for _ in range(3)], nn.Linear(32, 4))


def _train_stack(model, optimizer, steps: int, run=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        (run or model)(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "compiled_block"])
def test_sites_are_named_alike_whether_blocks_were_wrapped_before_or_after_protect(tmp_path, wrap):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    def wrapped(model: nn.Sequential) -> None:
        if wrap == "checkpoint_wrapper":  # as torchtitan and FSDP users checkpoint their blocks
            apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                           check_fn=lambda m: isinstance(m, Residual))  # fmt: skip
        else:  # a block compiled on its own
            model[1] = torch.compile(model[1], backend="aot_eager")

    names = {}
    for order in ("before", "after"):
        model = _residual_stack()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fault = aegis.FaultSpec(site="1.a:fwd", model="bitflip", bit=27, steps=(3,))
        if order == "before":
            wrapped(model)
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path / order, faults=(fault,)))
        if order == "after":
            wrapped(model)
        with pytest.warns(UserWarning, match="confirmed SDC"):
            _train_stack(model, optimizer, 5)
        summary = guard.close()
        names[order] = sorted(s.site.name for s in guard.sensors)
        assert [(i.step, i.site.name) for i in guard.incidents] == [(3, "1.a:fwd")], order
        assert summary.false_alarms == 0
        assert summary.coverage["not_covered"] == {}  # a wrapper around the model's blocks puts in nothing new
    assert names["before"] == names["after"] and "1.a:fwd" in names["before"]


def test_a_checkpoint_sequential_segment_is_named_by_its_modules_and_joins_the_incident_inside_it(tmp_path):
    from torch.utils.checkpoint import checkpoint_sequential

    model = _residual_stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = aegis.FaultSpec(site="1.a:fwd", model="bitflip", bit=27, steps=(3,))
    config = guard_config(tmp_path, faults=(fault,), fingerprints=aegis.FingerprintConfig(recompute_probability=1.0))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    with pytest.warns(UserWarning, match="confirmed SDC"):
        _train_stack(model, optimizer, 5, run=lambda x: checkpoint_sequential(model, 2, x, use_reentrant=False))
    summary = guard.close()
    assert summary.coverage["recompute_sites_checked"] == ["<root>[0:2]:recompute"]
    # the recomputation of the segment found the corrupted forward again: one incident, not two
    assert [(i.step, i.site.name) for i in guard.incidents] == [(3, "1.a:fwd")]
    assert summary.same_fault == 1
