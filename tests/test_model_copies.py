"""A protected model is still a model: copies, pickles and averages of it are the unprotected model,
and a Linear shared by two parents is checked under both (integrations/modules.py)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from tests.helpers import guard_config, small_workload, train

import aegis_sdc as aegis
from aegis_sdc.integrations.modules import CheckedLinear, detached_hook
from aegis_sdc.workloads.llama import lm_loss


def _no_checked_linear(model: torch.nn.Module) -> bool:
    return not any(isinstance(m, CheckedLinear) for m in model.modules())


def test_copies_pickles_and_averages_of_a_protected_model_are_the_unprotected_model(tmp_path):
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    train(model, data, optimizer, 2)
    checks_before = guard.summary().checks

    copied = copy.deepcopy(model)
    averaged = torch.optim.swa_utils.AveragedModel(model)
    averaged.update_parameters(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    payload = buffer.getvalue()
    loaded = torch.load(io.BytesIO(payload), weights_only=False)
    for other in (copied, averaged.module, loaded):
        assert _no_checked_linear(other)
        assert all(type(m) is torch.nn.Linear for m in other.modules() if isinstance(m, torch.nn.Linear))
        # the guard's hooks on the model are no-ops in a copy
        for m in other.modules():
            for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
                assert hook is detached_hook
    assert b"sqlite" not in payload and b"Guard" not in payload
    assert pickle.loads(pickle.dumps(model)) is not None

    # a copy trains on its own, unseen by the guard
    copy_optimizer = torch.optim.AdamW(copied.parameters(), lr=1e-3)
    inputs, targets = data.batch()
    lm_loss(copied(inputs), targets).backward()
    copy_optimizer.step()
    assert guard.summary().checks == checks_before

    # the original stays protected; after close, it and an untouched copy compute the same bits
    fresh = copy.deepcopy(model)
    train(model, data, optimizer, 1)
    assert guard.summary().checks > checks_before
    summary = guard.close()
    assert summary.confirmed == 0
    inputs, _ = data.batch()
    with torch.no_grad():
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(fresh(inputs), model(inputs))


def test_a_hugging_face_model_with_gradient_checkpointing_copies_with_torchs_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bound = {name: m.__dict__["_gradient_checkpointing_func"] for name, m in model.named_modules()
             if "_gradient_checkpointing_func" in m.__dict__}  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    copied = copy.deepcopy(model)
    # in the copy, each bound checkpoint function is again the one the model had before protect()
    assert bound and all(
        copied.get_submodule(name)._gradient_checkpointing_func.func is fn.func
        and copied.get_submodule(name)._gradient_checkpointing_func.keywords == fn.keywords
        for name, fn in bound.items()
    )
    assert _no_checked_linear(copied)
    copied(input_ids=ids, labels=ids).loss.backward()  # the copy trains with torch's own checkpoint
    assert guard.close().confirmed == 0


class SharedProjection(torch.nn.Module):
    """One Linear reachable under two names (`a` and `b.proj`), as tied or shared modules are."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Module()
        self.b.proj = self.a
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b.proj(torch.relu(self.a(x))))


def test_a_linear_shared_by_two_parents_is_checked_under_both(tmp_path):
    torch.manual_seed(0)
    model = SharedProjection()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    assert isinstance(model.a, CheckedLinear) and model.b.proj is model.a
    for _ in range(3):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    summary = guard.close()
    # per step: the shared Linear's two calls and the head's one, three GEMMs each — but the first
    # call's input needs no gradient (no dgrad): 8 checks
    assert summary.checks == 3 * 8 and summary.confirmed == 0
    assert type(model.a) is torch.nn.Linear and model.b.proj is model.a  # restored under both names


def test_a_copy_made_right_after_protect_holds_no_guard(tmp_path):
    # an EMA model made at the start of training, before the first forward: the guard's forward
    # pre-hook (it watches for a missing step boundary until the first forward) is a no-op in it
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    ema = copy.deepcopy(model)
    assert _no_checked_linear(ema)
    assert all(hook is detached_hook for m in ema.modules() for hook in m._forward_pre_hooks.values())
    train(model, data, optimizer, 1)
    assert guard.close().checks > 0


def test_falcons_linear_is_protected_as_a_linear_and_copied_as_itself(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.models.falcon.modeling_falcon import FalconLinear

    torch.manual_seed(0)
    config = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    model = transformers.FalconForCausalLM(config)
    linears = [name for name, m in model.named_modules() if type(m) is FalconLinear]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec = aegis.FaultSpec(site="transformer.h.1.mlp.dense_4h_to_h:wgrad", model="bitflip", bit=27, steps=(5,), seed=1)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    assert {s.name.rsplit(":", 1)[0] for s in guard.sites} == set(linears) | {"lm_head"}
    assert all(isinstance(model.get_submodule(name), FalconLinear) for name in linears)  # still one
    copied = copy.deepcopy(model)
    assert all(type(copied.get_submodule(name)) is FalconLinear for name in linears)
    for _ in range(6):
        ids = torch.randint(0, 128, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [("transformer.h.1.mlp.dense_4h_to_h:wgrad", 5)]
    assert summary.false_alarms == 0
    assert not any("FalconLinear" in reason for reason in summary.coverage["not_covered"].values())
    assert all(type(model.get_submodule(name)) is FalconLinear for name in linears)  # restored
