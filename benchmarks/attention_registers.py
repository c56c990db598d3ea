"""Registers and spills of the attention kernels on Hopper, and where the spills sit — computed on any machine.

Compiles the forward (`GPU_CONFIG`'s and the warp-specialized one), dK/dV and dQ kernels
(`kernels/triton_attention.py`; bf16, head dimension 128 or `--head-dim`, with the blocks `config_for`
gives it; without a mask and dropout causal and full, with `--mask` both and full only, as SDPA takes
no mask with is_causal), unchecked and checked, for sm_90a with Triton's bundled `ptxas` (no GPU
needed), and disassembles each with the bundled `nvdisasm` to count the local-memory stores and loads
(`STL`, `LDL`: spill traffic) inside each of its loops — the K loops run once per key (query)
block, so a spill there is paid by every block, one outside them once per program. Also counted per
loop: `HGMMA` (wgmma instructions) and `SHFL` (reductions across threads); and per kernel the order
in which its PTX issues and waits for its wgmma groups (`mma_sequence`: whether anything runs while
an MMA does).

    python benchmarks/attention_registers.py [--head-dim 256] [--mask] [--out FILE]

Shared memory per kernel (`shared_bytes`) is reported beside: a kernel asking for more than Hopper's
227 KB does not launch. Pointers and the integers a launch at real shapes specializes as multiples of
16 are compiled as such (`_divisible`): that is what lets Triton pipeline the K and V loads into
shared memory, as on the device (records made before counted no such stages).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
import triton.language as tl
from common import bundled_tool, compile_for_sm90a, write_result

from aegis_sdc.kernels import triton_attention as ta


def kernels(head_dim: int, masked: bool = False) -> dict:
    """kernel name → (kernel, its blocks) as a call of this head dimension, with an attn_mask or not,
    runs them (`config_for`); the warp-specialized forward only up to its largest head dimension and
    without a mask."""
    cfg = ta.config_for(head_dim, masked)
    chosen = {"fwd": (ta.attention_fwd_kernel, cfg.fwd),
              "fwd_ws": (ta.attention_fwd_ws_kernel, ta.GPU_FWD_WARP_SPECIALIZED),
              "bwd_kv": (ta.attention_bwd_kv_kernel, cfg.kv),
              "bwd_q": (ta.attention_bwd_q_kernel, cfg.q)}  # fmt: skip
    if head_dim > ta.WS_MAX_HEAD_DIM or masked:
        del chosen["fwd_ws"]
    return chosen


_F32_ARGS = {"scale", "sq_unscale", "sq_scale", "fault_delta", "p_drop", "keep_scale", "u_out"}
_F32_PTRS = {"lse_ptr", "check_ptr", "mask_ptr", "delta_ptr", "dmag_ptr", "dq_ptr", "dk_ptr", "dv_ptr",
             "vcols_ptr", "vsq_ptr", "vmax_ptr"}  # fmt: skip
LOOP_OPCODES = ("STL", "LDL", "HGMMA", "SHFL")
_LOOP_MIN_LINES = 50  # a backward branch over fewer SASS lines is a small loop (the epilogue's block sums)


def _signature(fn, constexprs: dict) -> dict[str, str]:
    """The kernel's argument types as a bf16 launch passes them."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*i64" if name == "drop_ptr" else "*fp32" if name in _F32_PTRS else "*bf16"
        else:
            types[name] = "fp32" if name in _F32_ARGS else "i32"
    return types


def _divisible(fn, types: dict) -> tuple:
    """The arguments a launch at real shapes specializes as multiples of 16: every pointer (torch's
    allocations are aligned) and every integer but the fault's (not specialized) and the GQA group
    (4 or 8 query heads per key/value head) — strides, lengths and head counts of such shapes are.
    With them Triton pipelines the K and V loads into shared memory, as on the device."""
    return tuple(name for name, kind in types.items()
                 if kind.startswith("*") or (kind == "i32" and name not in (*ta._FAULT_INTS, "group")))  # fmt: skip


def _loops(sass: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of every loop: a branch back to a label above it."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(sass):
        m = re.search(r"BRA\b.*\.(L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] >= _LOOP_MIN_LINES:
            loops.append((labels[m.group(1)], i))
    return loops


def mma_sequence(ptx: str) -> str:
    """The kernel's wgmma issue and wait order from its PTX, compressed: W a wgmma, c a commit, wN a
    wait until at most N groups are in flight, e×k k exponentials (`ex2`: the softmax) — e.g.
    `WWWWcw0` is one MMA group waited for at once, nothing overlapping it."""
    tokens = re.findall(r"wgmma\.mma_async|wgmma\.commit_group|wgmma\.wait_group\.sync\.aligned \d+|ex2\.approx", ptx)
    letters = "".join("W" if t.startswith("wgmma.mma") else "c" if "commit" in t else "e" if t.startswith("ex2")
                      else "w" + t.rsplit(" ", 1)[1] for t in tokens)  # fmt: skip
    return re.sub(r"e{2,}", lambda m: f"e×{len(m.group())}", letters)


def _count(lines: list[str], opcode: str) -> int:
    return sum(1 for line in lines if re.search(rf"\b{opcode}\b", line))


def measure(kernel: str, causal: bool, check: bool, head_dim: int = 128, masked: bool = False) -> dict:
    fn, blocks = kernels(head_dim, masked)[kernel]
    constexprs = dict(CAUSAL=causal, HAS_MASK=masked, CHECK=check, MODEL=0, STAGE=ta.NO_STAGE, DROPOUT=masked,
                      EVEN=True, DT=tl.bfloat16, UPCAST=False, D=head_dim, BM=blocks.block_m, BN=blocks.block_n,
                      STAGES=blocks.num_stages)  # fmt: skip
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    types = {k: v for k, v in _signature(fn, constexprs).items() if v != "constexpr"}
    compiled, _, registers, stores, loads = compile_for_sm90a(fn, types, constexprs, divisible=_divisible(fn, types),
                                                              num_warps=blocks.num_warps,
                                                              num_stages=blocks.num_stages)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([bundled_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout.splitlines()  # fmt: skip
    row = {"kernel": kernel, "causal": causal, "check": check, "head_dim": head_dim, "mask_and_dropout": masked,
           "blocks": dataclasses.asdict(blocks),
           "registers": registers, "spill_store_bytes": stores, "shared_bytes": compiled.metadata.shared,
           "warp_specialized": "setmaxnreg" in compiled.asm["ptx"],
           "spill_load_bytes": loads, "stl": _count(sass, "STL"), "ldl": _count(sass, "LDL"),
           "mma_sequence": mma_sequence(compiled.asm["ptx"]),
           "loops": [{"sass_lines": b - a, **{op.lower(): _count(sass[a:b], op) for op in LOOP_OPCODES}}
                     for a, b in _loops(sass)]}  # fmt: skip
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_registers.json")
    parser.add_argument("--head-dim", type=int, default=128, help="the head dimension D (its blocks: config_for)")
    parser.add_argument("--mask", action="store_true", help="calls with an attn_mask and dropout (their blocks)")
    args = parser.parse_args()
    rows = [measure(k, causal, check, args.head_dim, args.mask) for k in kernels(args.head_dim, args.mask)
            for causal in ((False,) if args.mask else (True, False)) for check in (False, True)]  # fmt: skip
    env = {"triton": triton.__version__, "target": "sm_90a", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python", *sys.argv])}  # fmt: skip
    summary = {
        f"{r['kernel']}_{'causal' if r['causal'] else 'full'}_{'checked' if r['check'] else 'unchecked'}": {
            "spill_store_bytes": r["spill_store_bytes"],
            "shared_bytes": r["shared_bytes"],
            "loop_stl_ldl": [(loop["stl"], loop["ldl"]) for loop in r["loops"]],
        }
        for r in rows
    }
    write_result(args.out, env, rows, summary)


if __name__ == "__main__":
    main()
