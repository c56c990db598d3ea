"""The fingerprint kernel against its PyTorch reference, and the collision properties docs/fingerprints.md
states: xor-sum is blind to swaps and paired flips, ours is not; single-word changes are always seen.
On the CPU the kernels run under TRITON_INTERPRET=1 (conftest)."""

from __future__ import annotations

import pytest
import torch

from aegis_sdc.kernels import fingerprint as kfp
from aegis_sdc.ops.fingerprint import FingerprintPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MASK = kfp.MASK32


def kernel_value(t: torch.Tensor) -> int:
    out = torch.zeros(kfp.ROW, dtype=torch.int32, device=t.device)
    kfp.launch_one(kfp.as_words(t), out)
    return kfp.lanes_to_int(out.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(4097,), (33, 65), (3,), (7, 1, 5)])
def test_kernel_matches_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    t = (torch.randn(shape, generator=g) * 50).to(dtype).to(DEVICE)
    if t.numel() * t.element_size() < 4:
        assert kfp.as_words(t) is None  # under one word: not fingerprinted by the kernels
        return
    assert kernel_value(t) == kfp.fingerprint_reference(t)


def test_permuted_tensors_are_fingerprinted_in_place_and_strided_views_are_refused():
    t = torch.randn(64, 48, device=DEVICE)
    transposed = t.t()  # dense in another order: same memory, same fingerprint
    assert kfp.as_words(transposed) is not None
    assert kernel_value(transposed) == kernel_value(t) == kfp.fingerprint_reference(transposed)
    assert kfp.as_words(t[:, ::2]) is None  # a strided view would need a copy


def test_batch_launch_equals_one_launch_per_tensor():
    g = torch.Generator().manual_seed(3)
    sizes = [5, 4096, 70_001, 2, 131_075]  # chunks of several work items, odd tails
    tensors = [torch.randn(n, generator=g).to(torch.float16).to(DEVICE) for n in sizes]
    pool = FingerprintPool(slots=3, use_triton=True)  # 3 slots per buffer: the batch spans buffers
    handles = pool.take_many(tensors)
    pool.resolve([rows.cpu() for rows in pool.device_buffers()])
    assert [h.value for h in handles] == [kfp.fingerprint_reference(t) for t in tensors]
    again = pool.take(tensors[1])  # the rows were zeroed for the next step: no stale lanes added
    pool.resolve([rows.cpu() for rows in pool.device_buffers()])
    assert again.value == kfp.fingerprint_reference(tensors[1])


def test_a_batch_taken_again_reuses_its_launch_and_rows_stay_consecutive():
    # The pool keeps a batch's launch tables per layout: the same tensors again (new values) hit the
    # cache; a batch that does not fit the buffer's remaining rows starts the next buffer; a view with
    # the same address and size but other strides is another layout, never the cached one.
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(n, generator=g).to(DEVICE) for n in (300, 5000, 17)]
    pool = FingerprintPool(slots=5, use_triton=True)
    first = pool.take_many(tensors)
    for t in tensors:
        t.mul_(3.0)  # the same storages, other values
    second = pool.take_many(tensors)  # rows 3-5 do not fit after rows 0-2: the next buffer's 0-2
    assert len(pool._launches) == 1
    assert [h.slot for h in first + second] == [0, 1, 2, 0, 1, 2] and first[0].buffer is not second[0].buffer
    square = torch.randn(8, 8, generator=g).to(DEVICE)
    views = [square, square.t()]  # same address and size; the transpose is fingerprinted as its memory
    third = pool.take_many(views)
    pool.resolve([rows.cpu() for rows in pool.device_buffers()])
    assert len(pool._launches) == 2
    assert [h.value for h in second] == [kfp.fingerprint_reference(t) for t in tensors]
    assert [h.value for h in third] == [kfp.fingerprint_reference(square)] * 2
    # a dense [8, 4] at the address of a strided [8, 4] view: same address, size and element size
    dense, strided = square.reshape(-1)[:32].view(8, 4), square[:, ::2]
    pool.take_many([dense, tensors[0]])
    late = pool.take_many([strided, tensors[0]])
    pool.resolve([rows.cpu() for rows in pool.device_buffers()])
    assert late[0].value is None and late[1].value == kfp.fingerprint_reference(tensors[0])


def test_the_device_comparison_agrees_with_the_host_values_pair_by_pair():
    # `differ_on_device` decides the optimizer gate before the read: it must flag a step exactly when
    # the host, after the read, finds two fingerprints of a pair different. Pairs over two buffers
    # (3 slots each), the same tensor twice, one word changed by a flipped low bit, by a sign.
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=g).to(DEVICE) for n in (4096, 70_001, 17)]
    pool = FingerprintPool(slots=3, use_triton=True)
    first = pool.take_many(tensors)
    changed = [t.clone() for t in tensors]
    changed[1].view(torch.int32)[12_345] ^= 1  # the lowest mantissa bit of one element
    changed[2][16] = -changed[2][16]
    second = pool.take_many(changed)
    same = pool.take_many(tensors)
    unreadable = pool.take(tensors[0][::2])  # a strided view: not fingerprinted, never compared
    cases = {
        "equal": [(first[0], same[0]), (first[2], same[2])],
        "one bit": [(first[0], same[0]), (first[1], second[1])],
        "sign": [(first[2], second[2])],
        "with an unreadable pair": [(first[0], same[0]), (unreadable, first[0])],
    }
    flags = {name: pool.differ_on_device(pairs) for name, pairs in cases.items()}
    pool.resolve([rows.cpu() for rows in pool.device_buffers()])
    for name, pairs in cases.items():
        flag = flags[name]
        host = any(a.value != b.value for a, b in pairs if a.value is not None and b.value is not None)
        assert flag is not None and bool(flag) == host, name
    assert [bool(flags[n]) for n in cases] == [False, True, True, False]
    # a value already on the host (the reference path), or nothing comparable: the host judges
    known = FingerprintPool().take(tensors[2])
    assert not known.pending and pool.differ_on_device([(known, known)]) is None
    assert pool.differ_on_device([(unreadable, unreadable)]) is None


def test_host_tensors_take_the_reference_path_where_triton_does_not_interpret(monkeypatch):
    # On a GPU machine AdamW's `step` count is a host tensor among device ones; Triton cannot launch
    # on it, so the pool must fingerprint it at once (same function, known value, nothing pending).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = FingerprintPool(use_triton=True)
    step = torch.tensor(7.0)
    handle = pool.take(step)
    assert not handle.pending and handle.value == kfp.fingerprint_reference(step)
    assert pool.device_buffers() == []


@pytest.mark.parametrize("n_bytes", [4 * 2048, 4 * 2049, 4 * 4095, 4 * 65536 + 3, 4 * 65537, 4 * 131072 + 1])
def test_block_and_chunk_edges_match_the_reference(n_bytes):
    # The kernels run whole blocks without masks and leave the tensor's last word (and its padding
    # mask) to a masked tail: word counts at, one past and one short of a block (2048 words here) and
    # of the batched kernel's work item (65 536 words), with and without a partial last word.
    g = torch.Generator().manual_seed(n_bytes)
    t = torch.randint(-128, 128, (n_bytes,), generator=g, dtype=torch.int8).to(DEVICE)
    assert kernel_value(t) == kfp.fingerprint_reference(t)
    pool = FingerprintPool(use_triton=True)
    handles = pool.take_many([t, t[: n_bytes - 4]])
    pool.resolve([rows.cpu() for rows in pool.device_buffers()])
    assert [h.value for h in handles] == [kfp.fingerprint_reference(x) for x in (t, t[: n_bytes - 4])]


def xor_sum(t: torch.Tensor) -> int:
    words = kfp.padded_words(t)
    out = 0
    for w in words.tolist():
        out ^= w
    return out


def test_xor_sum_misses_a_swap_and_paired_flips_that_the_fingerprint_catches():
    t = torch.arange(1, 257, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 200]] = swapped[[200, 3]]
    flipped = t.clone()
    ints = flipped.view(torch.int32)
    ints[10] ^= 1 << 5  # the same bit in two words
    ints[77] ^= 1 << 5
    for changed in (swapped, flipped):
        assert xor_sum(changed) == xor_sum(t)  # blind
        assert kfp.fingerprint_reference(changed) != kfp.fingerprint_reference(t)


def test_every_change_confined_to_one_word_changes_both_lanes():
    # For a fixed position both lanes are bijections of the word: any change of one word shows.
    g = torch.Generator().manual_seed(5)
    words = torch.randint(0, 1 << 32, (4096,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 1 << 32, (4096,), generator=g, dtype=torch.int64)
    changed = words ^ torch.randint(1, 1 << 32, (4096,), generator=g, dtype=torch.int64)  # non-zero xor
    x0, y0 = kfp.word_lanes(words, positions)
    x1, y1 = kfp.word_lanes(changed, positions)
    assert bool((x0 != x1).all()) and bool((y0 != y1).all())


def test_two_word_changes_collide_at_the_rate_of_random_lanes():
    # Swaps of two different words and paired flips of one bit: the change of lane x, truncated to
    # 16 bits, must be zero about 2⁻¹⁶ of the time (a random function) — 200 000 trials expect 3.1,
    # P(≥ 16) < 1e-6 under Poisson(3.1) — and the full 64 bits never (expected 1e-14).
    g = torch.Generator().manual_seed(11)
    n = 200_000
    a, b = (torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64) for _ in range(2))
    j1, j2 = (torch.randint(0, 1 << 24, (n,), generator=g, dtype=torch.int64) for _ in range(2))
    keep = (a != b) & (j1 != j2)
    bit = 1 << torch.randint(0, 32, (n,), generator=g, dtype=torch.int64)

    def delta(before1, after1, before2, after2):
        x = [kfp.word_lanes(w, j) for w, j in ((after1, j1), (before1, j1), (after2, j2), (before2, j2))]
        dx = (x[0][0] - x[1][0] + x[2][0] - x[3][0]) & MASK
        dy = (x[0][1] - x[1][1] + x[2][1] - x[3][1]) & MASK
        return dx[keep], dy[keep]

    for dx, dy in (delta(a, b, b, a), delta(a, a ^ bit, b, b ^ bit)):  # swap; paired flips
        assert int(((dx & 0xFFFF) == 0).sum()) < 16
        assert int(((dx == 0) & (dy == 0)).sum()) == 0


def crafted_pair(t: torch.Tensor, a: int, b: int, bit: int) -> torch.Tensor:
    """`t` (fp32) with word b set so that the position-keyed words v = w ⊕ j·K of a and b differ in
    `bit` only: the pair on which flipping `bit` in both words swaps their v."""
    words = t.view(torch.int32)
    keyed_a = (int(words[a]) & MASK) ^ ((a * kfp.KEY) & MASK)
    w_b = keyed_a ^ (1 << bit) ^ ((b * kfp.KEY) & MASK)
    words[b] = w_b - (1 << 32) if w_b >= 1 << 31 else w_b
    return t


def test_the_same_bit_flipped_in_a_crafted_pair_is_seen():
    # Function 1 (both lanes functions of v_j = w_j ⊕ j·K only) is blind here: the flips swap v_a
    # and v_b, the multiset of v — and so both sums — stays the same. Function 2 sees it, and so does
    # the kernel, which runs function 2.
    g = torch.Generator().manual_seed(21)
    t = crafted_pair(torch.randn(1024, generator=g), a=10, b=777, bit=22)
    flipped = t.clone()
    flipped.view(torch.int32)[[10, 777]] ^= 1 << 22
    assert kfp.fingerprint_reference(flipped, function=1) == kfp.fingerprint_reference(t, function=1)
    assert kfp.fingerprint_reference(flipped) != kfp.fingerprint_reference(t)
    on_device = t.to(DEVICE), flipped.to(DEVICE)
    assert [kernel_value(x) for x in on_device] == [kfp.fingerprint_reference(x) for x in (t, flipped)]


def test_paired_flips_on_crafted_pairs_collide_at_the_rate_of_random_lanes():
    # 200 000 crafted pairs, a random bit each: function 1 misses every one; function 2's lane x
    # truncated to 16 bits cancels about 2⁻¹⁶ of the time (expected 3.1, fewer than 16 asserted as
    # above), and the whole 64 bits never.
    g = torch.Generator().manual_seed(13)
    n = 200_000
    w_a = torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64)
    j1, j2 = (torch.randint(0, 1 << 24, (n,), generator=g, dtype=torch.int64) for _ in range(2))
    keep = j1 != j2
    bit = 1 << torch.randint(0, 32, (n,), generator=g, dtype=torch.int64)
    w_b = w_a ^ kfp._mul32(j1, kfp.KEY) ^ kfp._mul32(j2, kfp.KEY) ^ bit
    for function in (1, 2):
        lanes = [kfp.word_lanes(w, j, function) for w, j in ((w_a ^ bit, j1), (w_a, j1), (w_b ^ bit, j2), (w_b, j2))]
        dx = (lanes[0][0] - lanes[1][0] + lanes[2][0] - lanes[3][0])[keep] & MASK
        dy = (lanes[0][1] - lanes[1][1] + lanes[2][1] - lanes[3][1])[keep] & MASK
        unseen = int(((dx == 0) & (dy == 0)).sum())
        if function == 1:
            assert unseen == int(keep.sum())
        else:
            assert int(((dx & 0xFFFF) == 0).sum()) < 16 and unseen == 0


def test_a_function_that_is_not_known_is_refused():
    with pytest.raises(ValueError, match="fingerprint function 3"):
        kfp.fingerprint_reference(torch.ones(4), function=3)


def _compiled_variants() -> int:
    return sum(len(cache[0]) for kernel in (kfp._fingerprint_one_kernel, kfp._fingerprint_many_kernel)
               for cache in kernel.device_caches.values())  # fmt: skip


@pytest.mark.gpu
def test_after_the_warm_up_no_tensor_compiles_a_new_kernel_variant():
    # Saved tensors come in every size, offset and tail: none of them may compile a variant inside a
    # training step (a compile there took a sampled step hundreds of milliseconds).
    device = torch.device("cuda")
    kfp.warm_up(device)
    before = _compiled_variants()
    base = torch.randn(1 << 23, device=device)  # 32 MiB: every launch shape, by size
    tensors = [base[:1], base[:17], base[1:4097], base[3 : 3 + (1 << 21)], base, base.half()[1:7],
               base.bfloat16()[:12345], base.view(torch.uint8)[5:1000], base[: (1 << 22) + 5]]  # fmt: skip
    for t in tensors:
        assert kernel_value(t) == kfp.fingerprint_reference(t)
    pool = FingerprintPool()
    pool.take_many(tensors)
    pool.take_many(tensors[:1] + tensors[2:4])
    torch.cuda.synchronize()
    assert _compiled_variants() == before
