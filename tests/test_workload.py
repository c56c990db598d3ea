"""The shipped workload: a Llama-style decoder that learns the synthetic stream."""

import pytest
import torch
from tests.helpers import SMALL, small_workload, train

from aegis_sdc.workloads.data import SyntheticTokens, TokenStreamConfig
from aegis_sdc.workloads.llama import Llama, LlamaConfig, apply_rope, rope_tables


def test_the_loss_falls_toward_the_entropy_floor():
    model, data, optimizer = small_workload()
    losses = train(model, data, optimizer, 120)
    floor = data.entropy_rate()
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert start > 4.0  # about ln(128) = 4.85 untrained
    assert end < floor + 0.8 < start  # learned most of the chain's structure


def test_the_stream_is_deterministic_and_shifted_by_one():
    cfg = TokenStreamConfig(vocab_size=32, seq_len=16, batch_size=3, branching=2, seed=5)
    (x1, y1), (x2, y2) = SyntheticTokens(cfg).batch(), SyntheticTokens(cfg).batch()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    chain = SyntheticTokens(cfg)
    for row_x, row_y in zip(x1, y1, strict=True):
        for a, b in zip(row_x.tolist(), row_y.tolist(), strict=True):
            assert b in chain.successors[a].tolist()  # every transition is one the chain allows


def test_model_shapes_and_names():
    model = Llama(SMALL)
    logits = model(torch.randint(0, SMALL.vocab_size, (2, 10)))
    assert logits.shape == (2, 10, SMALL.vocab_size)
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "layers.0.attn.wq" in names and "layers.0.mlp.down_proj" in names and "lm_head" in names
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.int64))


def test_rope_preserves_norms_and_rotates_by_position():
    cos, sin = rope_tables(8, 4, 10000.0)
    x = torch.randn(1, 1, 4, 8)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.equal(y[..., 0, :], x[..., 0, :])  # position 0 is not rotated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"dim": 30, "n_heads": 4}, "multiple of n_heads"), ({"n_kv_heads": 3}, "n_kv_heads")],
)
def test_bad_model_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)
