"""64-bit fingerprints of tensors' bits, position-aware and combinable in any order.

A tensor is read as little-endian 32-bit words w_j (j = 0, 1, …; a last partial word is zero-padded).
Each word is mixed with its position by a chain of bijections of 32-bit integers,

    x_j = M(w_j ⊕ j·K)          M: multiply by an odd constant, xor-shift, multiply, xor-shift
    y_j = N(x_j)                N: xor-shift, multiply by another odd constant

and the fingerprint is the pair of wrapping sums (Σ x_j mod 2³², Σ y_j mod 2³²) = 64 bits.

- Combinable: sums mod 2³² are commutative and associative, so tiles, programs and partial
  fingerprints combine in any order with the same result (atomics are exact and deterministic here).
- Position-aware: a word's contribution depends on j, so swapped words change it (xor-sum does not).
- A change confined to one aligned 32-bit word (any number of flipped bits in it) is always caught:
  for fixed j, x_j and y_j are bijections of w_j, so both lanes change by a non-zero amount.
- Changes in two or more words (swaps, paired flips, scattered corruption) go unseen only if both
  lanes' changes cancel: about 2⁻⁶⁴ when the mixed words behave like random values (docs/fingerprints.md
  has the analysis and the measured collision rates of truncated lanes).

Cost: 14 integer operations per 32-bit word, about 3.5 per byte read — below the H200's integer
throughput per byte of HBM bandwidth, so the kernel runs at the read bandwidth (benchmarks/fingerprint.py).

`fingerprint_reference` is the same function in plain PyTorch (int64 arithmetic, every product kept
below 2⁶³): the CPU path and the oracle of the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

KEY = 0x9E3779B9  # position key: j·K spreads consecutive positions over all 32 bits
M1 = 0x7FEB352D  # odd multipliers of a well-mixing 32-bit finalizer (bijections mod 2³²)
M2 = 0x846CA68B
M3 = 0x2C1B3C6D  # the second lane's multiplier: its lane is a different bijection of x
MASK32 = 0xFFFFFFFF
_KEY, _M1, _M2, _M3 = (tl.constexpr(c) for c in (KEY, M1, M2, M3))

# Launch shape, from the sweep in benchmarks/fingerprint.py on the H200 (1 GiB): 2048-word blocks,
# 8 programs per SM, 8 warps read at 3.86 TB/s; 4096 / 4 per SM / 4 warps at 2.80 TB/s.
BLOCK = 2048  # words per loop iteration of a program (8 KB)
CHUNK = 1 << 15  # words per work item of the batched kernel (128 KB)
PROGRAMS = 1056
WARPS = 8


@triton.jit
def _mix(w, j):
    """(x, y) for words w at positions j (uint32 tensors); zero where the caller masks."""
    x = (w ^ (j * _KEY)) * _M1
    x = (x ^ (x >> 15)) * _M2
    x = x ^ (x >> 16)
    y = (x ^ (x >> 13)) * _M3
    return x, y


@triton.jit
def _lanes(words_ptr, start, stop, n_words, last_mask, BLOCK: tl.constexpr):
    """Both lane sums of words [start, stop) of a tensor of n_words words (int64 offsets; uint32
    sums). The last word keeps only the tensor's own bytes (`last_mask`): the rest of an aligned
    4-byte word is read (it never crosses a page) and zeroed, which is the zero padding."""
    lane_x = tl.zeros([BLOCK], dtype=tl.uint32)
    lane_y = tl.zeros([BLOCK], dtype=tl.uint32)
    for offset in range(start, stop, BLOCK):
        index = offset + tl.arange(0, BLOCK).to(tl.int64)
        inside = index < stop
        w = tl.load(words_ptr + index, mask=inside, other=0).to(tl.uint32, bitcast=True)
        w = tl.where(index == n_words - 1, w & last_mask.to(tl.uint32), w)
        x, y = _mix(w, index.to(tl.uint32))
        lane_x += tl.where(inside, x, 0)
        lane_y += tl.where(inside, y, 0)
    return tl.sum(lane_x, axis=0), tl.sum(lane_y, axis=0)


@triton.jit
def _fingerprint_one_kernel(words_ptr, out_ptr, n_words, last_mask, per_program, BLOCK: tl.constexpr):
    """One tensor: program p sums words [p·per_program, (p+1)·per_program) and adds into out[0:2]."""
    start = tl.program_id(0).to(tl.int64) * per_program
    stop = tl.minimum(start + per_program, n_words)
    lane_x, lane_y = _lanes(words_ptr, start, stop, n_words, last_mask, BLOCK)
    tl.atomic_add(out_ptr, lane_x.to(tl.int32, bitcast=True))
    tl.atomic_add(out_ptr + 1, lane_y.to(tl.int32, bitcast=True))


@triton.jit
def _fingerprint_many_kernel(
    table_ptr,  # int64 [n_tensors, 4]: (word address, word count, out slot, last-word mask)
    first_item_ptr,  # int64 [n_tensors + 1]: each tensor's first work item (a prefix sum)
    out_ptr,  # int32 [slots, 2]
    n_tensors, n_items, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    """Many tensors in one launch: persistent programs walk work items of up to CHUNK words; a work
    item finds its tensor by binary search over the prefix sums (the table stays one row per tensor,
    so the host builds it in microseconds whatever the sizes)."""
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        low = 0  # the last tensor whose first item is <= item
        high = n_tensors
        for _ in tl.static_range(SEARCH_STEPS):
            middle = (low + high) // 2
            go_right = tl.load(first_item_ptr + middle) <= item
            low = tl.where(go_right, middle, low)
            high = tl.where(go_right, high, middle)
        row = table_ptr + low * 4
        words_ptr = tl.load(row).to(tl.pointer_type(tl.int32))
        n_words = tl.load(row + 1)
        slot = tl.load(row + 2)
        last_mask = tl.load(row + 3)
        start = (item - tl.load(first_item_ptr + low)) * CHUNK
        stop = tl.minimum(start + CHUNK, n_words)
        lane_x, lane_y = _lanes(words_ptr, start, stop, n_words, last_mask, BLOCK)
        tl.atomic_add(out_ptr + 2 * slot, lane_x.to(tl.int32, bitcast=True))
        tl.atomic_add(out_ptr + 2 * slot + 1, lane_y.to(tl.int32, bitcast=True))


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


def word_lanes(words: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_j, y_j as int64 in [0, 2³²) for words and positions given as int64 in [0, 2³²)."""
    x = _mul32(words ^ _mul32(positions, KEY), M1)
    x = _mul32(x ^ (x >> 15), M2)
    x = x ^ (x >> 16)
    y = _mul32(x ^ (x >> 13), M3)
    return x, y


def reference_lanes(t: torch.Tensor) -> tuple[int, int]:
    """Both 32-bit lanes of `t`'s fingerprint, in plain PyTorch (any device, any layout)."""
    values = padded_words(t)
    x, y = word_lanes(values, torch.arange(values.numel(), device=values.device, dtype=torch.int64) & MASK32)
    # Σ of < 2³¹ values below 2³² fits int64 exactly; reduce mod 2³² afterwards.
    return int(x.sum()) & MASK32, int(y.sum()) & MASK32


def fingerprint_reference(t: torch.Tensor) -> int:
    """The 64-bit fingerprint as an unsigned Python int: lane y in the high half, lane x in the low."""
    x, y = reference_lanes(t)
    return (y << 32) | x


def lanes_to_int(pair) -> int:
    """An int32 [2] (x, y) pair as read back from the device → the unsigned 64-bit fingerprint."""
    x, y = (int(v) & MASK32 for v in pair)
    return (y << 32) | x


# -- launches ---------------------------------------------------------------------------------------


def launch_one(words: Words, out: torch.Tensor) -> None:
    """Add the lanes of one tensor's words into out (int32 [2], a row of a zeroed pool)."""
    n = words.n_words
    programs = min(PROGRAMS, triton.cdiv(n, BLOCK))
    per_program = triton.cdiv(triton.cdiv(n, programs), BLOCK) * BLOCK
    programs = triton.cdiv(n, per_program)
    _fingerprint_one_kernel[(programs,)](words.base, out, n, words.last_mask, per_program, BLOCK=BLOCK, num_warps=WARPS)


def launch_many(items: list[tuple[Words, int]], out: torch.Tensor) -> None:
    """Add the lanes of several tensors' words into rows of out (int32 [slots, 2]) in one launch.
    `items` holds (words, slot). The table travels through pinned memory without a sync."""
    if not items:
        return
    rows, first_items, total = [], [], 0
    for words, slot in items:
        rows.append((words.base.data_ptr(), words.n_words, slot, words.last_mask))
        first_items.append(total)
        total += triton.cdiv(words.n_words, CHUNK)
    first_items.append(total)
    table = torch.tensor(rows, dtype=torch.int64)
    first = torch.tensor(first_items, dtype=torch.int64)
    if out.is_cuda:
        table = table.pin_memory().to(out.device, non_blocking=True)
        first = first.pin_memory().to(out.device, non_blocking=True)
    search_steps = max(1, (len(items)).bit_length())
    _fingerprint_many_kernel[(min(total, PROGRAMS),)](
        table, first, out, len(items), total, CHUNK=CHUNK, BLOCK=BLOCK, SEARCH_STEPS=search_steps, num_warps=WARPS
    )
