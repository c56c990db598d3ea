"""The paired healthy-vs-suspect study on a GPU: Hugging Face `LlamaForCausalLM` at the TinyLlama-1.1B
widths with fewer layers, bf16, deterministic kernels, the three modes with the default strike, and a
sweep of bit positions (docs/study.md).

    python benchmarks/study_gpu.py [--device cuda] [--suspect-device cuda:1] [--layers 2] [--steps 200]
                                   [--bits 16,20,22,26,30] [--data-vocab N] [--out docs/study/gpu] [--tiny]

Deterministic kernels: `torch.use_deterministic_algorithms(True)` with cuBLAS's fixed workspace
(`CUBLAS_WORKSPACE_CONFIG=:4096:8`), attention in HF's `eager` implementation (plain matmuls and a
softmax: SDPA's flash and cuDNN backends choose kernels by shape and their backward may accumulate in
a varying order); the study itself verifies that two healthy replicas agree bit for bit before it
starts (`determinism_steps`). Each replica is one model on the device (both on one GPU by default).

Writes, under `--out`: per mode the study's summary (`<mode>.json`) and plots (`<mode>-*.png`), the
control of each mode without a fault (`<mode>-control.json`), and `bit-sweep.json`: param-sync with
one strike per bit position (the default site, forward GEMM), each strike's effect on the step's
gradients. `--tiny` runs a 64-wide model on the CPU (a dry run of the script, nothing measured).
`--data-vocab N`: the training and held-out Markov chains over N tokens (default: the model's whole
vocabulary). At the 1.1B widths a 32 000-token chain is not learned in 200 steps, so the held-out
fine-tune compares nothing (docs/study.md); 256 tokens is the CPU study's chain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initializes

import torch
from torch import nn

from aegis_sdc.faults.models import FaultSpec
from aegis_sdc.study import StudyConfig, run_study
from aegis_sdc.workloads.llama import LlamaConfig

WIDTHS = dict(
    hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000
)  # fmt: skip  (TinyLlama-1.1B)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
SITE = "model.model.layers.1.mlp.up_proj"  # the default strike's site, as in `aegis study` (the wrapper adds `model.`)


class CausalLM(nn.Module):
    """tokens [B, T] → logits [B, T, vocab] (the study's model interface) around an HF model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def factory(widths: dict, layers: int, seq: int, dtype: torch.dtype):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    def build() -> nn.Module:
        config = HFLlamaConfig(**widths, num_hidden_layers=layers, max_position_embeddings=seq,
                               attn_implementation="eager")  # fmt: skip
        return CausalLM(LlamaForCausalLM(config).to(dtype))

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--suspect-device", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--bits", default="16,20,22,26,30")
    parser.add_argument("--modes", default="compute-sync,param-sync,free-run")
    parser.add_argument("--out", type=Path, default=Path("docs/study/gpu"))
    parser.add_argument("--data-vocab", type=int, default=None, help="tokens of the data's Markov chains")
    parser.add_argument("--tiny", action="store_true", help="a 64-wide model on the CPU: a dry run")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    widths, device, dtype = (TINY, "cpu", torch.float32) if args.tiny else (WIDTHS, args.device, torch.bfloat16)
    build = factory(widths, args.layers, args.seq, dtype)
    data_vocab = args.data_vocab or widths["vocab_size"]
    if not 2 <= data_vocab <= widths["vocab_size"]:
        parser.error(f"--data-vocab must be from 2 to the model's vocabulary ({widths['vocab_size']})")
    model = LlamaConfig(vocab_size=data_vocab, max_seq_len=args.seq)  # the data's vocabulary
    strike = FaultSpec.parse(f"{SITE}:fwd@model=bitflip,bit=30,probability=0.05,start_step={args.steps // 3}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "torch": torch.__version__,
           "dtype": str(dtype), "layers": args.layers, "widths": widths, "data_vocab": data_vocab,
           "batch": args.batch, "seq": args.seq,
           "deterministic": "use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, eager attention",
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip

    def study(mode: str, faults: tuple[FaultSpec, ...], steps: int, plots: bool) -> dict:
        run_dir = Path(tempfile.mkdtemp(prefix=f"study-{mode}-")) / "run"
        cfg = StudyConfig(mode=mode, steps=steps, faults=faults, model=model, batch_size=args.batch,
                          seq_len=args.seq, device=device, suspect_device=args.suspect_device, run_dir=str(run_dir),
                          finetune_steps=min(100, steps))  # fmt: skip
        result = run_study(cfg, model_factory=build, plots=plots)
        for plot in result.plots:
            shutil.copy(plot, args.out / f"{mode}-{plot.name}")
        print(mode, [f.site for f in faults] or "control", json.dumps(result.summary, default=str)[:400], flush=True)
        return result.summary

    for mode in args.modes.split(","):
        summary = study(mode, (strike,), args.steps, plots=True)
        (args.out / f"{mode}.json").write_text(json.dumps({"env": env, "summary": summary}, indent=1, default=str))
        control = study(mode, (), min(args.steps, 60), plots=False)
        (args.out / f"{mode}-control.json").write_text(json.dumps({"env": env, "summary": control}, indent=1,
                                                                   default=str))  # fmt: skip
    sweep = {}
    for bit in (int(b) for b in args.bits.split(",")):
        spec = FaultSpec.parse(f"{SITE}:fwd@model=bitflip,bit={bit},steps=5")
        sweep[bit] = study("param-sync", (spec,), 8, plots=False)
    (args.out / "bit-sweep.json").write_text(json.dumps({"env": env, "rows": sweep}, indent=1, default=str))


if __name__ == "__main__":
    main()
