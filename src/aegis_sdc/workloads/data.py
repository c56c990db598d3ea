"""A synthetic token stream a small model can learn: a sparse random Markov chain.

Each token has `branching` possible successors with fixed random probabilities, so the best
achievable loss is the chain's entropy rate (about ln(branching) nats), far below the ln(vocab) of
an untrained model: the loss visibly falls within a few hundred steps. Fully determined by the seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenStreamConfig:
    vocab_size: int = 256
    seq_len: int = 128
    batch_size: int = 8
    branching: int = 4
    seed: int = 0  # the chain (successors and their probabilities)
    sample_seed: int | None = None  # the order of the samples drawn from it; None: seed + 1

    def __post_init__(self) -> None:
        if not (1 <= self.branching <= self.vocab_size):
            raise ValueError("branching must lie in 1..vocab_size")
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("seq_len and batch_size must be >= 1")


class SyntheticTokens:
    """Iterator of (inputs, targets), each [batch, seq_len] int64; targets are inputs shifted by one."""

    def __init__(self, config: TokenStreamConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(config.seed)
        v, k = config.vocab_size, config.branching
        self.successors = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(v)])  # [V, k]
        weights = torch.rand(v, k, generator=g) + 0.1
        self.probs = weights / weights.sum(dim=1, keepdim=True)  # [V, k]
        sample_seed = config.seed + 1 if config.sample_seed is None else config.sample_seed
        self._generator = torch.Generator().manual_seed(sample_seed)

    def entropy_rate(self) -> float:
        """Nats per token of the chain, averaged over tokens uniformly: the floor of the loss."""
        p = self.probs
        return float(-(p * p.log()).sum(dim=1).mean())

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        g = self._generator
        tokens = torch.empty(c.batch_size, c.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(c.vocab_size, (c.batch_size,), generator=g)
        for t in range(c.seq_len):
            prev = tokens[:, t]
            choice = torch.multinomial(self.probs[prev], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.successors[prev, choice]
        tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.batch()
