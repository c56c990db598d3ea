"""After a free run: fine-tune each replica on a held-out task and measure next-token accuracy.

The held-out task is another Markov chain over the same vocabulary (chain seed `seed + HELDOUT`):
nothing of it was seen in pretraining, so the accuracy it reaches after a short fine-tune measures
how usable the pretrained weights are, the question an operator asks of a corrupted run. Every
replica fine-tunes on the same batches with a fresh AdamW and no faults, and is evaluated on the
same held-out batches; the *oracle* accuracy (always predicting the chain's most likely successor)
is the ceiling.
"""

from __future__ import annotations

import torch

from aegis_sdc.study.config import StudyConfig
from aegis_sdc.study.replica import Replica, token_stream
from aegis_sdc.workloads.llama import lm_loss

HELDOUT = 7919  # chain seed offset of the held-out task (any value other than the pretraining chain's)


def finetune_and_evaluate(replicas: list[Replica], cfg: StudyConfig, progress=None) -> dict[str, float]:
    """`accuracy_<replica>` for each replica and `accuracy_oracle`, on `eval_batches` held-out batches."""
    train = token_stream(cfg, chain_seed=cfg.seed + HELDOUT, sample_seed=cfg.seed + HELDOUT + 1)
    batches = [train.batch() for _ in range(cfg.finetune_steps)]
    evaluation = token_stream(cfg, chain_seed=cfg.seed + HELDOUT, sample_seed=cfg.seed + HELDOUT + 2)
    eval_batches = [evaluation.batch() for _ in range(cfg.eval_batches)]
    results: dict[str, float] = {}
    for replica in replicas:
        replica.disable_faults()
        model = replica.model
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.finetune_lr)
        model.train()
        for i, (inputs, targets) in enumerate(batches):
            with replica.rng.active():
                optimizer.zero_grad(set_to_none=True)
                lm_loss(model(inputs.to(replica.device)), targets.to(replica.device)).backward()
                optimizer.step()
            if progress is not None:
                progress(replica.name, i + 1, len(batches))
        results[f"accuracy_{replica.name}"] = _accuracy(replica, eval_batches)
    correct = total = 0
    for inputs, targets in eval_batches:
        best = evaluation.successors[inputs, evaluation.probs[inputs].argmax(dim=-1)]  # [B, T]
        correct += int((best == targets).sum())
        total += targets.numel()
    results["accuracy_oracle"] = correct / total
    return results


@torch.no_grad()
def _accuracy(replica: Replica, batches) -> float:
    replica.model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=replica.device)
    total = 0
    for inputs, targets in batches:
        logits = replica.model(inputs.to(replica.device))  # [B, T, vocab]
        # A prediction from non-finite logits is wrong (argmax would pick an arbitrary NaN's index).
        hit = (logits.argmax(dim=-1) == targets.to(replica.device)) & torch.isfinite(logits).all(dim=-1)
        correct += hit.sum()
        total += targets.numel()
    replica.model.train()
    return int(correct) / total
