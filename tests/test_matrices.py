"""Matrix parameters outside nn.Linear (integrations/matrices.py): a mixture-of-experts model's experts
([experts, out, in] parameters run by transformers' grouped GEMM or its eager loop of F.linear) and
routers are checked as Linears, one set of sites per expert; a matrix no checked op multiplies by is
named, and its module handed back."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers import guard_config, skip_unless_fused_experts

import aegis_sdc as aegis

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128)  # fmt: skip
EXPERTS = 4


def moe_model(family: str, implementation: str = "grouped_mm"):
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=EXPERTS, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(**COMMON, num_experts=EXPERTS, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=64)  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(config)
    model.config._experts_implementation = implementation  # what experts_implementation= sets at loading
    skip_unless_fused_experts(model)
    return model


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (4, 32), generator=g) for _ in range(steps)]


def train(model, guard_cfg, steps: int = 8, lr: float = 1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_cfg)
    for ids in batches(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return guard, guard.close()


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_every_expert_and_router_of_a_moe_model_is_checked_and_nothing_is_left_out(tmp_path, family, implementation):
    model = moe_model(family, implementation)
    guard, summary = train(model, guard_config(tmp_path), steps=2)
    names = {site.name.rsplit(":", 1)[0] for site in guard.sites}
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        experts = {f"{mlp}.experts.{e}.{p}" for e in range(EXPERTS) for p in ("gate_up_proj", "down_proj")}
        assert experts <= names and f"{mlp}.gate" in names  # one Linear's sites per expert, and the router
    assert summary.confirmed == 0 and summary.false_alarms == 0
    assert summary.coverage["not_covered"] == {}  # nothing named: every matrix was checked
    assert all(sensor.shape is not None for sensor in guard.sensors)  # every site's GEMM ran checked
    assert type(model.model.layers[0].mlp.experts).__name__ in ("MixtralExperts", "Qwen2MoeExperts")  # closed


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_a_protected_moe_model_computes_what_the_unprotected_one_does(tmp_path, implementation):
    # The checked GEMMs accumulate in fp32 tile by tile, the unprotected ones in fp32 in their own order:
    # the loss and every gradient agree to fp32 rounding over K ≤ 128 products (relative 1e-5 is
    # ~80 units of 2⁻²⁴, far above that order's difference, far below any real error).
    reference, model = moe_model("mixtral", implementation), moe_model("mixtral", implementation)
    (ids,) = batches(1)
    guard = aegis.protect(model, optimizer=None, config=guard_config(tmp_path))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    expected = reference(input_ids=ids, labels=ids).loss
    expected.backward()
    guard.close()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    ours = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert (ours[name].grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item())


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize(
    "site",
    ["model.layers.1.mlp.experts.2.gate_up_proj:fwd", "model.layers.0.mlp.experts.1.down_proj:dgrad",
     "model.layers.1.mlp.experts.3.down_proj:wgrad", "model.layers.0.mlp.gate:fwd", "model.layers.1.mlp.gate:wgrad"],
)  # fmt: skip
def test_a_fault_in_an_experts_or_a_routers_gemm_is_confirmed_at_its_site_and_step(tmp_path, site, implementation):
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(5,))
    config = guard_config(tmp_path, faults=(spec,), response=aegis.ResponseConfig(policy="skip-step"))
    guard, summary = train(moe_model("mixtral", implementation), config)
    assert [(i.step, i.site.name) for i in guard.incidents] == [(5, site)]
    assert summary.false_alarms == 0 and summary.not_verifiable == 0


def test_copies_of_a_protected_moe_model_are_plain_and_closing_gives_the_modules_back(tmp_path):
    model = moe_model("mixtral")
    experts, router = model.model.layers[0].mlp.experts, model.model.layers[0].mlp.gate
    guard = aegis.protect(model, optimizer=None, config=guard_config(tmp_path))
    assert type(model.model.layers[0].mlp.experts).__name__ == "CheckedMixtralExperts"
    copied = copy.deepcopy(model)
    assert type(copied.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    assert type(copied.model.layers[0].mlp.gate).__name__ == "MixtralTopKRouter"
    assert not any(key.startswith("aegis_") for key in vars(copied.model.layers[0].mlp.experts))
    guard.close()
    assert model.model.layers[0].mlp.experts is experts and model.model.layers[0].mlp.gate is router


class PositionTable(torch.nn.Module):
    """A matrix parameter added to the input, not multiplied: no matmul weight."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8, 16))
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.table)


class Einsum(torch.nn.Module):
    """A matrix multiplied by an einsum: no op the guard checks."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,io->...o", x, self.w)


class Matmul(torch.nn.Module):
    """A matrix on its own layout [in, out] and a stack of them [experts, in, out], multiplied by `@`
    (GPT-OSS's eager experts): each the Linear of its transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 32) / 4)
        self.stack = torch.nn.Parameter(torch.randn(3, 32, 16) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        return sum(h @ self.stack[e] for e in range(3))


@pytest.mark.parametrize("site", ["0.w:fwd", "0.1.stack:dgrad", "0.2.stack:wgrad"])
def test_a_matrix_multiplied_by_matmul_is_checked_as_the_linear_of_its_transpose(tmp_path, site):
    model = torch.nn.Sequential(Matmul(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(2,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    x = torch.randn(2, 8, 16)
    model(x).sum().backward()  # step 0: what the unprotected model computes (fp32 sums over K ≤ 32)
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    optimizer.step()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 8, 16)).sum().backward()
        optimizer.step()
    summary = guard.close()
    assert [(i.step, i.site.name) for i in guard.incidents] == [(2, site)]
    # a forward fault's huge element reaches the next matmuls: their replays reproduce — extreme data,
    # false alarms that leave every threshold alone
    assert summary.false_alarms == summary.data_false_alarms and summary.coverage["not_covered"] == {}


class DerivedWeights(torch.nn.Module):
    """Matrices multiplied after a derivation the checked ops do not take — a scaled copy by F.linear,
    one scaled by a learned vector, a low-rank product by bmm — one used elementwise after exp
    (Mamba's A_log), one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.scaled = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.gained = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.gain = torch.nn.Parameter(torch.ones(16))
        self.low = torch.nn.Parameter(torch.randn(4, 16) / 4)
        self.a_log = torch.nn.Parameter(torch.randn(8, 16))
        self.spare = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, 8, 16]
        x = torch.nn.functional.linear(x, self.scaled.float() * 0.5)
        x = torch.nn.functional.linear(x, self.gained * self.gain[:, None])
        lr = self.low.t().unsqueeze(0).expand(x.shape[0], -1, -1)  # [B, 16, 4]
        x = torch.bmm(torch.bmm(x, lr), lr.transpose(1, 2))
        return x * torch.exp(-self.a_log.exp())


def test_a_matrix_no_checked_op_multiplies_by_is_named_with_what_multiplied_it_and_its_module_handed_back(
    tmp_path,
):
    model = torch.nn.Sequential(PositionTable(), Einsum(), DerivedWeights(), torch.nn.Linear(16, 4))
    guard = aegis.protect(model, optimizer=None, config=guard_config(tmp_path))
    assert [type(m).__name__ for m in model] == ["CheckedPositionTable", "CheckedEinsum", "CheckedDerivedWeights",
                                                 "CheckedLinear"]  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        model(torch.randn(2, 8, 16)).sum().backward()
    named = sorted(str(w.message).split(": ")[1] for w in caught if "not checked" in str(w.message))
    assert named == ["1.w", "2.gained", "2.low", "2.scaled", "2.spare"]  # not the table, a_log: elementwise only
    # none of their matrices checked: the model runs their own classes from the next call on
    assert [type(m).__name__ for m in model] == ["PositionTable", "Einsum", "DerivedWeights", "CheckedLinear"]
    model(torch.randn(2, 8, 16)).sum().backward()
    report = guard.coverage_report()
    summary = guard.close()
    named = {name: reason for name, reason in report.not_covered.items() if name[0].isdigit()}
    assert set(named) == {"1.w", "2.gained", "2.low", "2.scaled", "2.spare"}
    assert "multiplied by torch.einsum" in named["1.w"] and "multiplied by torch.bmm" in named["2.low"]
    assert "multiplied by torch.linear" in named["2.scaled"] and "multiplied by torch.linear" in named["2.gained"]
    assert "no op of the module's first call multiplied its input by it" in named["2.spare"]
    assert report.protected == {"Linear": 2}  # the position table's Linear and the head
    assert summary.confirmed == 0


def test_a_first_call_without_grad_still_tells_a_matrix_used_elementwise_from_one_multiplied(tmp_path):
    # Under no_grad nothing requires grad: the call's data is what derives from its inputs
    model = torch.nn.Sequential(PositionTable(), Einsum(), torch.nn.Linear(16, 4))
    guard = aegis.protect(model, optimizer=None, config=guard_config(tmp_path))
    with torch.no_grad(), pytest.warns(UserWarning, match="multiplied by torch.einsum"):
        model(torch.randn(2, 8, 16))
    report = guard.coverage_report()
    guard.close()
    assert "1.w" in report.not_covered and "0.table" not in report.not_covered


@pytest.mark.gpu
def test_on_cuda_grouped_experts_are_named_and_handed_back_and_eager_experts_are_checked(tmp_path):
    # Splitting a grouped GEMM by expert needs the routing on the host (a sync per call): on the GPU
    # the grouped experts run as they are, named; the eager loop's F.linear per expert is checked.
    for implementation in ("grouped_mm", "eager"):
        model = moe_model("mixtral", implementation).to("cuda", torch.bfloat16)
        site = "model.layers.1.mlp.experts.2.gate_up_proj:fwd"
        spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(5,))
        config = guard_config(tmp_path / implementation, faults=(spec,), sampling=aegis.SamplingConfig.every_call())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = aegis.protect(model, optimizer=optimizer, config=config)
        for ids in batches(8):
            ids = ids.cuda()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        summary = guard.close()
        not_covered = summary.coverage["not_covered"]
        if implementation == "grouped_mm":
            assert "model.layers.0.mlp.experts.gate_up_proj" in not_covered
            assert "grouped GEMM on the GPU" in not_covered["model.layers.0.mlp.experts.gate_up_proj"]
            assert guard.incidents == []
        else:
            assert not any("experts" in key for key in not_covered)
            assert [(i.step, i.site.name) for i in guard.incidents] == [(5, spec.site)]
        assert summary.false_alarms == 0


def test_under_a_budget_experts_token_counts_share_one_timing_per_power_of_two(tmp_path):
    # An expert sees another token count every step: its checks are timed per power-of-two bucket of
    # tokens and scaled (runtime/planner.py), not once per exact shape at every replan.
    model = moe_model("mixtral")
    sampling = aegis.SamplingConfig(budget=0.5, rotation_steps=10, replan_steps=3)
    config = guard_config(tmp_path, sampling=sampling, thresholds=aegis.ThresholdConfig(calibration_checks=2))
    guard, summary = train(model, config, steps=14)
    assert guard.budget_plan is not None and summary.confirmed == 0
    table = guard.planner.cost_table()
    gemms = [row for row in table if row["kind"] != "attention"]
    tokens = [row["shape"][1 if row["kind"] == "wgrad" else 0] for row in gemms]  # (M, K, N, dtype, ...)
    assert all(t >= 256 and t & (t - 1) == 0 for t in tokens), tokens
    assert sum(row["sites"] for row in table) == len(guard.sensors) + len(guard.attention_sensors)


def test_experts_whose_token_counts_vary_keep_their_thresholds_clean(tmp_path):
    # An expert's GEMMs change shape every step (the tokens the router sends it): its wgrad sums a
    # varying number of products, its forward takes its maximum over a varying number of rows. Clean
    # values grow with both; thresholds calibrated at the median shape grow with them
    # (GemmSensor.thresholds). Without that, this run had 13 false alarms in 30 steps; with it, 1.
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=128, num_experts_per_tok=8,
                                         moe_intermediate_size=32)  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    skip_unless_fused_experts(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        ids = torch.randint(0, 128, (4, 64), generator=g)  # 2 048 expert slots over 128 experts a layer
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    assert summary.confirmed == 0 and summary.false_alarms <= 3, summary.false_alarms
    grown = [s for s in guard.sensors if s.reference_shape is not None and ".experts." in s.site.name]
    assert grown and all(s.reference_shape[1 if s.site.kind.value == "wgrad" else 0] >= 1 for s in grown)


def test_a_call_larger_than_the_calibration_median_gets_proportionally_larger_thresholds():
    from aegis_sdc.config import ThresholdConfig
    from aegis_sdc.events import GemmKind, Site
    from aegis_sdc.sensors.gemm import GemmSensor, StepClock
    from aegis_sdc.sensors.sampling import Sampler

    sensor = GemmSensor(Site(0, "x", GemmKind.WGRAD), col_check=True, thresholds=ThresholdConfig(),
                        sampler=Sampler(1.0, (), 0), injector=None, clock=StepClock(), recorder=[])  # fmt: skip
    sensor.thresholds(64, 16, 32)
    sensor.row.base = sensor.row.current = 10.0
    sensor.col.base = sensor.col.current = 12.0
    sensor.reference_shape = (64.0, 16.0, 32.0)
    assert sensor.thresholds(64, 16, 32) == (10.0, 12.0)  # the calibration's shape: as calibrated
    assert sensor.thresholds(8, 4, 8) == (10.0, 12.0)  # smaller: never tighter than calibrated
    row, col = sensor.thresholds(64, 64, 32)  # 4× the terms per element: √4
    assert (row, col) == pytest.approx((20.0, 24.0))
    row, col = sensor.thresholds(4096, 16, 1024)  # more rows and columns to take the maximum over
    assert row == pytest.approx(10.0 * (torch.tensor(4096.0).log() / torch.tensor(64.0).log()).sqrt().item())
    assert col == pytest.approx(12.0 * (torch.tensor(1024.0).log() / torch.tensor(32.0).log()).sqrt().item())


def test_a_parameter_list_of_matrices_is_named_at_protect_not_swapped(tmp_path):
    # A ParameterList has no forward of its own: its matrices are multiplied by whatever module reads
    # them, which the mode of its own forward would never see — named at protect(), as before.
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 8)) for _ in range(2)])
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for w in self.ws:
                x = torch.nn.functional.linear(x, w)
            return self.head(x)

    model = Holder()
    with pytest.warns(UserWarning, match="1 matmul modules not protected, e.g. ws"):
        guard = aegis.protect(model, optimizer=None, config=guard_config(tmp_path))
    assert type(model.ws).__name__ == "ParameterList"
    model(torch.randn(4, 8)).sum().backward()
    report = guard.coverage_report()
    guard.close()
    assert "matrix parameters" in report.not_covered["ws"] and report.protected == {"Linear": 1}


class Late(torch.nn.Module):
    """A matrix of its own, multiplied in its forward — which runs from step 1 on only (`on`)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


class Reaching(torch.nn.Module):
    """`bypassed`'s matrix is multiplied here, past its forward (which never runs); `late` joins later."""

    def __init__(self) -> None:
        super().__init__()
        self.bypassed, self.late, self.head = Late(), Late(), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.linear(x, self.bypassed.w)
        return self.head(self.late(x) if self.late.on else x)


def test_a_matrix_whose_module_never_ran_in_the_first_step_is_named_until_it_is_checked(tmp_path):
    model = Reaching()
    spec = aegis.FaultSpec(site="late.w:fwd", model="bitflip", bit=30, steps=(3,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    with pytest.warns(UserWarning, match="forward did not run in the first step"):
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()  # the end of step 0: both named
    named = guard.coverage_report().not_covered
    assert {"bypassed.w", "late.w"} <= set(named) and "did not run" in named["bypassed.w"]
    model.late.on = True
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
    report = guard.coverage_report()
    summary = guard.close()
    assert "bypassed.w" in report.not_covered and "late.w" not in report.not_covered  # checked from step 1
    assert [(i.step, i.site.name) for i in guard.incidents] == [(3, "late.w:fwd")]
    assert summary.false_alarms == 0


def test_experts_under_lora_on_their_parameters_are_named_and_train_as_unprotected(tmp_path):
    # PEFT's LoRA on parameters (target_parameters: a MoE layer's expert tensors) registers W + B·A as
    # a parametrization of the experts module at each call and removes it after, changing the
    # module's class both times: a swapped module broke that (AttributeError in PEFT's removal). Such
    # modules are not swapped and are named with the reason; the LoRA'd attention projections (a
    # Linear base layer and its adapters) are checked, and a fault in one confirmed.
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    model, reference = (peft.get_peft_model(moe_model("qwen2_moe"), lora) for _ in range(2))
    reference.load_state_dict(model.state_dict())
    site = "base_model.model.model.layers.1.self_attn.q_proj.base_layer:fwd"
    spec = aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(2,))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6
    )  # fmt: skip  (fp32 sums of ≤ 128 terms, another order)
    for step_ids in batches(3):
        model(input_ids=step_ids, labels=step_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report = guard.coverage_report()
    guard.close()
    experts = {f"base_model.model.model.layers.{i}.mlp.experts.base_layer.base_layer" for i in range(2)}
    assert experts <= set(report.not_covered)
    assert all("LoRA on its parameters" in report.not_covered[name] for name in experts)
    assert [(i.step, i.site.name) for i in guard.incidents] == [(2, site)]
