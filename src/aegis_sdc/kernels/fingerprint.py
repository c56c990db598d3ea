"""64-bit fingerprints of tensors' bits, position-aware and combinable in any order.

A tensor is read as little-endian 32-bit words w_j (j = 0, 1, …; a last partial word is zero-padded).
Each word is mixed with its position p_j = j·K by bijections of 32-bit integers (for a fixed j), the
position entering three times:

    u_j = s₁₅(M₁ · (w_j ⊕ p_j))      s_r(v) = v ⊕ (v >> r); M₁, M₂, M₃ odd constants
    x_j = s₁₆(M₂ · (u_j ⊕ p_j))
    y_j = M₃ · s₁₃(x_j ⊕ p_j)

and the fingerprint is the pair of wrapping sums (Σ x_j mod 2³², Σ y_j mod 2³²) = 64 bits.

- Combinable: sums mod 2³² are commutative and associative, so tiles, programs and partial
  fingerprints combine in any order with the same result (atomics are exact and deterministic here).
- Position-aware: a word's contribution depends on j, so swapped words change it (xor-sum does not).
- A change confined to one aligned 32-bit word (any number of flipped bits in it) is always caught:
  for fixed j, x_j and y_j are bijections of w_j, so both lanes change by a non-zero amount.
- Changes in two or more words (swaps, paired flips, scattered corruption) go unseen only if both
  lanes' changes cancel: about 2⁻⁶⁴ when the mixed words behave like random values. The later
  entries of the position are what make that hold for structured corruptions too: were both lanes
  functions of v_j = w_j ⊕ p_j alone (function 1, kept for certificates written with it), flipping
  the same bit t in two words whose v differ in bit t only would swap their v — the same multiset,
  the same sums, unseen in both lanes (about 2⁻³² per pair of words). docs/fingerprints.md has the
  argument and the measured rates.

Cost: 16 integer operations per 32-bit word, 4 per byte read — below the H200's integer
throughput per byte of HBM bandwidth, so the kernel runs at the read bandwidth (benchmarks/fingerprint.py).

`fingerprint_reference` is the same function in plain PyTorch (int64 arithmetic, every product kept
below 2⁶³): the CPU path and the oracle of the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from aegis_sdc.kernels.grid import ceil_div

KEY = 0x9E3779B9  # position key: j·K spreads consecutive positions over all 32 bits
M1 = 0x7FEB352D  # odd multipliers of a well-mixing 32-bit finalizer (bijections mod 2³²)
M2 = 0x846CA68B
M3 = 0x2C1B3C6D  # the second lane's multiplier: its lane is a different bijection of x
MASK32 = 0xFFFFFFFF
# The function's number, recorded with fingerprints that outlive the process (certificates, screen
# references): 2 enters the position again before the second lane; 1 did not (see the docstring).
FUNCTION = 2
_KEY, _M1, _M2, _M3 = (tl.constexpr(c) for c in (KEY, M1, M2, M3))

# Launch shapes by tensor size, chosen from sweeps of benchmarks/fingerprint.py on the H200 for
# fingerprint function 2 (results/fingerprint_function2_sweep.log: the best of 24 shapes per size read
# 1.44 TB/s at 16 MiB, 2.49 at 64 MiB, 3.63 at 256 MiB, 4.34 at 1 GiB; the shapes before, function 1's
# best, read 3.40 at 1 GiB and 2.84 at 256 MiB with function 2 — its three keyed entries are more
# integer work per word, and more loads in flight (3 stages) now hide it):
# `(up to this many words, words per loop iteration, programs, warps, pipeline stages)`.
SHAPES = [
    (1 << 22, 2048, 528, 4, 3),  # ≤ 16 MiB
    (1 << 26, 1024, 1056, 4, 3),  # ≤ 256 MiB
    (1 << 62, 2048, 528, 4, 3),
]
CHUNK = 1 << 16  # words per work item of the batched kernel (256 KB)
BATCH_SHAPE = (2048, 2112, 8, 3)  # 3.77 TB/s over 200 tensors (the sweep's best; 2.20 before)
# Programs add their partial lanes into one of SPREAD sub-counters of a fingerprint's row (int32
# [SPREAD, 2]), folded on the host: thousands of atomics on one address would serialize in L2.
SPREAD = 16
ROW = 2 * SPREAD


def launch_shape(n_words: int) -> tuple[int, int, int, int]:
    for limit, *shape in SHAPES:
        if n_words <= limit:
            return tuple(shape)
    return tuple(SHAPES[-1][1:])


@triton.jit
def _mix(w, p):
    """(x, y) for words w whose keyed positions are p = j·K (uint32 tensors)."""
    u = (w ^ p) * _M1
    u = u ^ (u >> 15)
    x = (u ^ p) * _M2  # the position again, after a non-linear step: x is not a function of w ⊕ p alone
    x = x ^ (x >> 16)
    z = x ^ p  # and again before the second lane
    y = (z ^ (z >> 13)) * _M3
    return x, y


@triton.jit
def _lanes(words_ptr, start, stop, n_words, last_mask, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Both lane sums of words [start, stop) of a tensor of n_words words (int64 offsets; uint32
    sums). Whole blocks run without masks, their keyed positions one add from a loop-invariant
    vector; what is left (at most one block, always holding the tensor's last word) is masked, and
    the last word keeps only the tensor's own bytes (`last_mask`): the rest of an aligned 4-byte word
    is read (it never crosses a page) and zeroed, which is the zero padding. STAGES > 1 lets the
    compiler keep loads of later iterations in flight (software pipelining)."""
    lanes = tl.arange(0, BLOCK)
    keys = (start + lanes.to(tl.int64)).to(tl.uint32) * _KEY  # j·K of the block's positions (mod 2³²)
    key_step = (tl.zeros([BLOCK], dtype=tl.uint32) + BLOCK) * _KEY  # and what a block adds to them
    lane_x = tl.zeros([BLOCK], dtype=tl.uint32)
    lane_y = tl.zeros([BLOCK], dtype=tl.uint32)
    holds_last = (stop == n_words).to(tl.int64)
    whole_stop = tl.maximum(start + (stop - start - holds_last) // BLOCK * BLOCK, start)
    for offset in tl.range(start, whole_stop, BLOCK, num_stages=STAGES):
        w = tl.load(words_ptr + offset + lanes).to(tl.uint32, bitcast=True)
        x, y = _mix(w, keys)
        keys += key_step
        lane_x += x
        lane_y += y
    for offset in tl.range(whole_stop, stop, BLOCK):
        index = offset + lanes.to(tl.int64)
        inside = index < stop
        w = tl.load(words_ptr + index, mask=inside, other=0).to(tl.uint32, bitcast=True)
        w = tl.where(index == n_words - 1, w & last_mask.to(tl.uint32), w)
        x, y = _mix(w, index.to(tl.uint32) * _KEY)
        lane_x += tl.where(inside, x, 0)
        lane_y += tl.where(inside, y, 0)
    return tl.sum(lane_x, axis=0), tl.sum(lane_y, axis=0)


# Triton compiles a variant per value class of each integer argument (1, a multiple of 16, other)
# unless told not to: saved tensors of every size would compile new variants inside training steps,
# hundreds of milliseconds each. The word count and the last word's mask are runtime values; a
# program's share stays specialized (always a multiple of BLOCK: it keeps the loads vectorized), and
# so does the words' alignment (16 bytes or 4): `warm_up` compiles both.
@triton.jit(do_not_specialize=["n_words", "last_mask"])
def _fingerprint_one_kernel(
    words_ptr, out_ptr, n_words, last_mask, per_program,
    BLOCK: tl.constexpr, SPREAD: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """One tensor: program p sums words [p·per_program, (p+1)·per_program) into sub-counter p % SPREAD
    of out (int32 [SPREAD, 2])."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    stop = tl.minimum(start + per_program, n_words)
    lane_x, lane_y = _lanes(words_ptr, start, stop, n_words, last_mask, BLOCK, STAGES)
    counter = out_ptr + 2 * (pid % SPREAD)
    tl.atomic_add(counter, lane_x.to(tl.int32, bitcast=True))
    tl.atomic_add(counter + 1, lane_y.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["n_items"])
def _fingerprint_many_kernel(
    table_ptr,  # int64 [n_tensors, 5]: (word address, word count, out slot, last-word mask, first item)
    item_tensor_ptr,  # int32 [n_items]: the tensor of each work item
    out_ptr,  # int32 [slots, SPREAD, 2]
    n_items, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPREAD: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Many tensors in one launch: persistent programs walk work items of up to CHUNK words."""
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        row = table_ptr + tl.load(item_tensor_ptr + item).to(tl.int64) * 5
        words_ptr = tl.load(row).to(tl.pointer_type(tl.int32))
        n_words = tl.load(row + 1)
        slot = tl.load(row + 2)
        last_mask = tl.load(row + 3)
        start = (item - tl.load(row + 4)) * CHUNK
        stop = tl.minimum(start + CHUNK, n_words)
        lane_x, lane_y = _lanes(words_ptr, start, stop, n_words, last_mask, BLOCK, STAGES)
        counter = out_ptr + slot * (2 * SPREAD) + 2 * (item % SPREAD)
        tl.atomic_add(counter, lane_x.to(tl.int32, bitcast=True))
        tl.atomic_add(counter + 1, lane_y.to(tl.int32, bitcast=True))


# -- views of a tensor's bits ---------------------------------------------------------------------


def dense_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's memory as a flat uint8 view when its elements fill one dense block in some
    dimension order (contiguous, transposed, permuted); None otherwise (overlapping or strided
    views: fingerprinting them would need a copy). For a permuted tensor the fingerprint is that of
    its memory, which is what a corruption at rest changes."""
    if t.numel() == 0:
        return t.detach().reshape(-1).view(torch.uint8)
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return flat.view(torch.uint8)


@dataclass(frozen=True)
class Words:
    """A tensor's bits as 32-bit words for the kernels: `base` (int32, starts at the first byte),
    `n_words` = ceil(bytes / 4), and the mask of the last word's own bytes (little-endian)."""

    base: torch.Tensor
    n_words: int
    last_mask: int


def as_words(t: torch.Tensor) -> Words | None:
    """The words of a tensor with at least 4 bytes; None for tensors the kernels cannot read in
    place (smaller, or not one dense block: see `dense_bytes`). Views that do not start on a 4-byte
    boundary (odd offsets into a 16-bit storage) are copied first."""
    data = dense_bytes(t)
    if data is None or data.numel() < 4:
        return None
    if data.data_ptr() % 4:
        data = data.clone()
    nbytes = data.numel()
    tail = nbytes % 4
    base = data[: nbytes - tail].view(torch.int32)
    return Words(base, -(-nbytes // 4), (1 << (8 * tail)) - 1 if tail else MASK32)


def padded_words(t: torch.Tensor) -> torch.Tensor:
    """int64 [ceil(bytes / 4)] the words of any tensor (logical order for views that are not one
    dense block), the last one zero-padded: what the reference hashes."""
    data = dense_bytes(t)
    if data is None:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    padded = torch.zeros(-(-data.numel() // 4) * 4, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    return padded.view(torch.int32).to(torch.int64) & MASK32


# -- the PyTorch reference --------------------------------------------------------------------------


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a·c) mod 2³² for int64 a in [0, 2³²): the constant is split in 16-bit halves so no product
    reaches 2⁶³ (a plain int64 product would overflow)."""
    low = a * (c & 0xFFFF)
    high = ((a * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def word_lanes(
    words: torch.Tensor, positions: torch.Tensor, function: int = FUNCTION
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_j, y_j as int64 in [0, 2³²) for words and positions given as int64 in [0, 2³²)."""
    if function not in (1, 2):
        raise ValueError(f"fingerprint function {function} is not known (1 and 2 are)")
    p = _mul32(positions, KEY)
    again = p if function == 2 else 0  # function 1 entered the position once
    u = _mul32(words ^ p, M1)
    u = u ^ (u >> 15)
    x = _mul32(u ^ again, M2)
    x = x ^ (x >> 16)
    z = x ^ again
    y = _mul32(z ^ (z >> 13), M3)
    return x, y


def reference_lanes(t: torch.Tensor, function: int = FUNCTION) -> tuple[int, int]:
    """Both 32-bit lanes of `t`'s fingerprint, in plain PyTorch (any device, any layout)."""
    values = padded_words(t)
    positions = torch.arange(values.numel(), device=values.device, dtype=torch.int64) & MASK32
    x, y = word_lanes(values, positions, function)
    # Σ of < 2³¹ values below 2³² fits int64 exactly; reduce mod 2³² afterwards.
    return int(x.sum()) & MASK32, int(y.sum()) & MASK32


def reference_counter(t: torch.Tensor) -> tuple[int, int]:
    """`t`'s lanes as the int32 values a row's sub-counter holds (the rest of the row zero): what the
    kernels would add into a zeroed row, for rows filled on the CPU."""
    x, y = reference_lanes(t)
    return x - (x >> 31 << 32), y - (y >> 31 << 32)


def fingerprint_reference(t: torch.Tensor, function: int = FUNCTION) -> int:
    """The 64-bit fingerprint as an unsigned Python int: lane y in the high half, lane x in the low.
    `function` 1 is the earlier function, for fingerprints recorded with it (certificates)."""
    x, y = reference_lanes(t, function)
    return (y << 32) | x


def fold_rows(rows: torch.Tensor) -> torch.Tensor:
    """`lanes_to_int`'s fold on the device: int32 [n, ROW] sub-counters → int64 [n, 2], each lane's
    sum mod 2³² (x, y)."""
    return rows.view(rows.shape[0], SPREAD, 2).to(torch.int64).sum(1) & MASK32


def lanes_to_int(row) -> int:
    """A fingerprint's int32 [SPREAD, 2] sub-counters (any sequence of 2·k values, x and y
    interleaved) as read back from the device → the unsigned 64-bit fingerprint."""
    values = [int(v) for v in (row.reshape(-1).tolist() if isinstance(row, torch.Tensor) else row)]
    x = sum(values[0::2]) & MASK32
    y = sum(values[1::2]) & MASK32
    return (y << 32) | x


def signed64(value: int) -> int:
    """An unsigned 64-bit fingerprint as the int64 with the same bits (what int64 tensors carry)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# -- launches ---------------------------------------------------------------------------------------


def launch_one(words: Words, out: torch.Tensor, shape: tuple[int, int, int, int] | None = None) -> None:
    """Add the lanes of one tensor's words into out (int32 [SPREAD · 2], a row of a zeroed pool);
    `shape` (block, programs, warps, stages) overrides the one chosen by size."""
    n = words.n_words
    block, programs, warps, stages = shape or launch_shape(n)
    programs = min(programs, ceil_div(n, block))
    per_program = ceil_div(ceil_div(n, programs), block) * block
    programs = ceil_div(n, per_program)
    # the mask as a signed 32-bit value, the same bits: one argument type (a full mask would be u32,
    # a partial one i32 — a variant each)
    mask = words.last_mask - (1 << 32) if words.last_mask >= 1 << 31 else words.last_mask
    _fingerprint_one_kernel[(programs,)](
        words.base, out, n, mask, per_program, BLOCK=block, SPREAD=SPREAD, STAGES=stages, num_warps=warps,
    )  # fmt: skip


_WARM: set[torch.device] = set()


def warm_up(device: torch.device) -> None:
    """Compile, once per process and device, every kernel variant fingerprints launch: the one-tensor
    kernel in each of its launch shapes, on words that start on a 16-byte boundary and on words that
    do not, and the batched kernel — by launching them on a scratch tensor, before the first step
    that takes fingerprints needs them (a compile inside a sampled saved-tensor step made that step
    hundreds of milliseconds slower). A no-op off CUDA and while a CUDA graph is being captured."""
    if device.type != "cuda":
        return
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device in _WARM or torch.cuda.is_current_stream_capturing():
        return
    _WARM.add(device)
    with torch.cuda.device(device):  # Triton launches on the current device
        words = torch.zeros(4 * 1024 + 4, dtype=torch.int32, device=device)
        out = torch.zeros(3, ROW, dtype=torch.int32, device=device)
        aligned, offset = Words(words[:4096], 4096, MASK32), Words(words[1:4097], 4096, MASK32)
        for shape in dict.fromkeys(tuple(s[1:]) for s in SHAPES):
            for w in (aligned, offset):
                launch_one(w, out[0], shape)
        launch_many([(aligned, 1), (offset, 2)], out)


@dataclass(frozen=True)
class Launch:
    """The tables of one batched launch (`prepare_many`), on the launch's device: reusable for the
    same tensors (their storage addresses and sizes) into the same rows."""

    table: torch.Tensor  # int64 [n_tensors, 5]
    item_tensor: torch.Tensor  # int32 [n_items]


def launch_many(items: list[tuple[Words, int]], out: torch.Tensor) -> None:
    """Add the lanes of several tensors' words into rows of out (int32 [slots, SPREAD · 2]) in one
    launch. `items` holds (words, slot)."""
    if items:
        launch_prepared(prepare_many(items, out.device), out)


def fingerprint_into(items: list[tuple[torch.Tensor, int]], out: torch.Tensor) -> list[int]:
    """Fingerprints of (tensor, row) into zeroed rows of out (int32 [rows, ROW]): one launch on the
    GPU; on the CPU the reference, in the row's first sub-counter. Returns the rows written (tensors
    the kernel cannot read in place are left out)."""
    written, launch = [], []
    for t, row in items:
        if out.is_cuda:
            words = as_words(t)
            if words is not None:
                launch.append((words, row))
                written.append(row)
        elif dense_bytes(t) is not None:
            out[row] = 0
            out[row, 0], out[row, 1] = reference_counter(t)
            written.append(row)
    if launch:
        launch_many(launch, out)
    return written


def launch_prepared(launch: Launch, out: torch.Tensor) -> None:
    """The batched kernel over prepared tables (see `prepare_many`)."""
    block, programs, warps, stages = BATCH_SHAPE
    n_items = launch.item_tensor.numel()
    _fingerprint_many_kernel[(min(n_items, programs),)](
        launch.table, launch.item_tensor, out, n_items, CHUNK=CHUNK, BLOCK=block, SPREAD=SPREAD, STAGES=stages,
        num_warps=warps,
    )  # fmt: skip


def prepare_many(items: list[tuple[Words, int]], device: torch.device) -> Launch:
    """The tables of a batched launch. They travel through pinned memory without a sync; the item →
    tensor map is built by one vectorized op, whatever the sizes."""
    # numpy for the host side: torch.repeat_interleave on small CPU tensors took milliseconds.
    counts = np.array([ceil_div(w.n_words, CHUNK) for w, _ in items], dtype=np.int64)
    first = np.cumsum(counts) - counts
    flat = [v for (w, slot), f in zip(items, first.tolist(), strict=True)
            for v in (w.base.data_ptr(), w.n_words, slot, w.last_mask, f)]  # fmt: skip
    table = torch.from_numpy(np.array(flat, dtype=np.int64))
    item_tensor = torch.from_numpy(np.repeat(np.arange(len(items), dtype=np.int32), counts))
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
        item_tensor = item_tensor.pin_memory().to(device, non_blocking=True)
    return Launch(table, item_tensor)
