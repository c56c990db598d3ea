"""Is the evidence inside the launch what a second launch computes, in a real protected step? (GPU)

Every checked launch of a protected Hugging Face `LlamaForCausalLM` step (TinyLlama-1.1B shape,
4 × 2048 tokens, bf16, fused AdamW, every GEMM checked) is shadowed by the same GEMM with its evidence
from a second launch (fresh buffers, fixed-order sums); after each step the two evidence slots are
compared per launch class (shape, orientation, column check, by-product). A disagreement is a row
or column value off by more than 1e-3 of the second launch's or a different verdict — the sums are
the same fp64 numbers in another order, so a clean kernel has none. Also reports the guard's own
alarms over the same steps (every clean check that alarmed is a false alarm).

    python benchmarks/evidence_shadow.py [--steps 4] [--layers 22] [--out benchmarks/results/evidence_shadow.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import tempfile
from pathlib import Path

import torch
from common import gpu_environment, write_result  # benchmarks/ is the script's directory

import aegis_sdc as aegis
from aegis_sdc.kernels import triton_gemm as tg
from aegis_sdc.sensors.gemm import decode_triton_stats

TOLERANCE = 1e-3  # relative; the two sums differ by fp64 rounding only (~1e-15 of their terms)


class Shadow:
    """Wraps `tg.launch_checked_gemm`: after every inline-evidence launch, a snapshot of its slot and
    the same GEMM's evidence from a second launch (into fresh buffers; the training step's buffers
    and outputs are not touched)."""

    def __init__(self) -> None:
        self.original = tg.launch_checked_gemm
        self.pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def __call__(self, a, b, out, **kw):
        result = self.original(a, b, out, **kw)
        stats, cfg = kw.get("stats"), kw.get("cfg")
        if stats is None or cfg is None or not cfg.inline_evidence or kw.get("side_all"):
            return result
        snapshot = stats.clone()
        second = torch.zeros_like(stats)
        byproduct = kw.get("byproduct")
        separate = dataclasses.replace(cfg, inline_evidence=False)
        counters = torch.zeros(tg.counters_needed(*out.shape, separate), dtype=torch.int32, device=a.device)
        shadow = dict(kw, stats=second, stats_f64=second.view(torch.float64), pool=None, capture=tg.CAPTURE_NONE,
                      counters=counters, scratch=False, fault=None, cfg=separate, byproduct_side=None,
                      byproduct=None if byproduct is None else torch.empty_like(byproduct))  # fmt: skip
        self.original(a, b, torch.empty_like(out), **shadow)
        m, n = out.shape
        k = a.shape[0] if kw.get("a_t") else a.shape[1]
        label = (f"M={m} N={n} K={k} a_t={int(kw.get('a_t'))} b_t={int(kw.get('b_t'))} "
                 f"col={int(bool(kw.get('col_check')))} byproduct={int(byproduct is not None)}")  # fmt: skip
        self.pending.append((label, snapshot, second))
        return result

    def compare(self, step: int, classes: dict) -> None:
        """After the step (synchronized): each launch's slot against its second launch's."""
        inf = float("inf")
        for label, first, second in self.pending:
            r1, r2 = first.tolist(), second.tolist()
            # [row value, row index, row l2, column value, column index, ...] (the guard's decoding)
            e1, e2 = decode_triton_stats(r1, inf, inf), decode_triton_stats(r2, inf, inf)
            row = classes[label]
            row["launches"] += 1
            worst = 1.0
            for value in (0, 3):
                ratio = (e1[value] + 1e-30) / (e2[value] + 1e-30)
                worst = max(worst, ratio, 1.0 / ratio)
            bad = worst - 1.0 > TOLERANCE or r1[tg.ST_ALARM] != r2[tg.ST_ALARM]
            row["disagreements"] += int(bad)
            row["worst_ratio"] = max(row["worst_ratio"], worst)
            if bad and len(row["examples"]) < 3:
                row["examples"].append({"step": step, "inside": e1[0], "second": e2[0], "row_inside": int(e1[1]),
                                        "row_second": int(e2[1])})  # fmt: skip
        self.pending.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "evidence_shadow.json")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    shadow = Shadow()
    tg.launch_checked_gemm = shadow  # ops/triton_linear calls it through the module
    torch.manual_seed(0)
    shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    config = aegis.GuardConfig(run_dir=tempfile.mkdtemp(prefix="evidence-shadow-"),
                               sampling=aegis.SamplingConfig.every_call())  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    gen = torch.Generator(device="cuda").manual_seed(1)
    classes: dict = collections.defaultdict(lambda: {"launches": 0, "disagreements": 0, "worst_ratio": 1.0,
                                                     "examples": []})  # fmt: skip
    for step in range(args.steps):
        batch = torch.randint(0, shape["vocab_size"], (4, 2048), device="cuda", generator=gen)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        shadow.compare(step, classes)
        print(f"step {step}: disagreements so far {sum(r['disagreements'] for r in classes.values())}", flush=True)
    summary = guard.close()
    rows = [{"launch": label, **row} for label, row in sorted(classes.items())]
    write_result(args.out, gpu_environment(hf_shape=shape, steps=args.steps), rows, {
        "launches": sum(r["launches"] for r in rows),
        "disagreements": sum(r["disagreements"] for r in rows),
        "guard_checks": summary.checks,
        "guard_alarms": summary.alarms,
        "confirmed": summary.confirmed,
    })  # fmt: skip


if __name__ == "__main__":
    main()
