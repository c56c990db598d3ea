"""Shared builders for tests: a small workload and a guard around it."""

from __future__ import annotations

import torch

import aegis_sdc as aegis
from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, lm_loss

SMALL = LlamaConfig(vocab_size=128, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=256, max_seq_len=64)
# Sensitivity tests need realistic row counts: a row check tells a corruption of r = 1 median
# differences from noise by about sqrt(rows / (2 ln rows)) = 8.6 at 1024 rows, against a margin of 4
# (docs/thresholds.md). MEDIUM has 1024 tokens per step and 512 rows in its widest wgrad.
MEDIUM = LlamaConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=128)


def hf_llama(seed: int = 0, **config: object):
    """A two-layer Hugging Face LlamaForCausalLM (hidden 64, 4 query / 2 key-value heads, vocabulary
    128); `config` overrides or adds LlamaConfig fields. Needs transformers."""
    import transformers

    torch.manual_seed(seed)
    options = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128)  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**options, **config}))


def small_workload(seed: int = 0, cfg: LlamaConfig = SMALL, batch: int = 4, seq: int = 64):
    torch.manual_seed(seed)
    model = Llama(cfg)
    data = SyntheticTokens(TokenStreamConfig(vocab_size=cfg.vocab_size, seq_len=seq, batch_size=batch, seed=seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, data, optimizer


def train(model, data, optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        inputs, targets = data.batch()
        loss = lm_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def guard_config(tmp_path, **kwargs) -> aegis.GuardConfig:
    kwargs.setdefault("response", aegis.ResponseConfig(policy="warn"))
    return aegis.GuardConfig(run_dir=str(tmp_path / "run"), **kwargs)


class Quiet:
    """Attention op hooks that plan a check on every call and keep the values: the op alone."""

    def __init__(self):
        self.values = {}

    def plan(self, heads):
        return object()

    def fault_for(self, plan, backward):
        return None

    def observe(self, plan, backward, values, capture):
        self.values[backward] = values


def skip_unless_fused_experts(model) -> None:
    """Skip a test written for transformers ≥ 5's experts — 3-D parameters (`gate_up_proj`) run by a
    grouped GEMM — when the installed transformers keeps them as one Linear module per expert (4.x:
    those are protected as Linears, under other site names)."""
    import pytest

    experts = model.model.layers[0].mlp.experts
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.nn.Parameter):
        pytest.skip("this transformers keeps a MoE layer's experts as Linear modules (before 5.0)")


def train_until_raised(loss, step, optimizer, weight: torch.Tensor, steps: int):
    """Train until `step()` (the optimizer's step, or a compiled one) raises SilentDataCorruptionError:
    (that step or None, `weight` as it was before the step's update). `loss()` gives a step's loss."""
    before = weight.detach().clone()
    for i in range(steps):
        loss().backward()
        before = weight.detach().clone()
        try:
            step()
        except aegis.SilentDataCorruptionError:
            return i, before
        optimizer.zero_grad(set_to_none=True)
    return None, before
