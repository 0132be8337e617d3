"""L2 prefetch tables (`fp4kit.runtime.prefetch`) on the CPU: the table's layout and refusals, and
the kernel's split of the chunks over a launch (`assignment`, the specification of
``l2::prefetch_share``): every byte of every range issued exactly once, consecutive chunks on
different blocks."""

import ml_dtypes
import numpy as np
import pytest

from fp4kit.ops import elementwise as ew
from fp4kit.runtime import prefetch as l2


def test_table_layout_rounds_sizes_down_and_drops_empty_ranges():
    tab = l2.table([(0x1000, 100), (0x2000, 15), (0x3000, 64)], chunk=32)
    assert tab.dtype == np.uint64 and tab.shape == (2 + 2 * l2.MAX_RANGES,)
    assert tab[:6].tolist() == [2, 32, 0x1000, 96, 0x3000, 64]
    assert not tab[6:].any()


@pytest.mark.parametrize("ranges, chunk, match", [
    ([(0x1008, 64)], 32, r"ranges\[0\]: the address must be a multiple of 16"),
    ([(0x1000, -16)], 32, r"ranges\[0\]: expected a non-negative size"),
    ([(0x1000 * i, 64) for i in range(1, 6)], 32, r"at most 4 non-empty ranges"),
    ([(0x1000, 64)], 24, r"chunk: expected a multiple of 16"),
    ([(0x1000, 64)], 0, r"chunk: expected a multiple of 16"),
    ([(0x1000, 64)], 1 << 32, r"chunk: expected a multiple of 16"),
])
def test_table_refuses_bad_ranges(ranges, chunk, match):
    with pytest.raises(ValueError, match=match):
        l2.table(ranges, chunk)


@pytest.mark.parametrize("sizes, chunk, grid, threads", [
    ([96], 32, 2, 2), ([1 << 20, 4096, 48], 16 << 10, 64, 256), ([5 << 10, 7 << 10, 16, 3 << 10], 1 << 10, 3, 4),
    ([100 << 10], 16 << 10, 128, 256), ([33 << 10, 1 << 10], 1 << 10, 5, 3)])
def test_assignment_issues_every_byte_once(sizes, chunk, grid, threads):
    base = [0x10000 * (i + 1) << 12 for i in range(len(sizes))]
    tab = l2.table(list(zip(base, sizes)), chunk)
    issued = l2.assignment(tab, grid, threads)
    covered = {}
    for block, thread, addr, nbytes in issued:
        assert 0 <= block < grid and 0 <= thread < threads
        assert 0 < nbytes <= chunk and nbytes % 16 == 0 and addr % 16 == 0
        for start, size in zip(base, sizes):
            if start <= addr < start + size:
                assert addr + nbytes <= start + size // 16 * 16
                covered.setdefault(start, []).append((addr - start, nbytes))
    for start, size in zip(base, sizes):
        spans = sorted(covered.get(start, []))
        assert sum(n for _, n in spans) == size // 16 * 16
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))  # no gap, no overlap
    chunks = sum(-(-(s // 16 * 16) // chunk) for s in sizes)
    per_block = np.bincount([b for b, *_ in issued], minlength=grid)
    assert per_block.max() - per_block.min() <= 1  # spread evenly over the blocks
    assert len(issued) == chunks


def test_rmsnorm_rope_refuses_a_prefetch_that_is_not_a_table():
    x = np.ones((1, 4, 64), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="prefetch: expected an fp4kit.runtime.prefetch.L2Prefetch or None, got list"):
        ew.rmsnorm_rope(x, prefetch=[x])
    with pytest.raises(TypeError, match="prefetch: expected an fp4kit.runtime.prefetch.L2Prefetch"):
        ew.rmsnorm_rope_pair(ew.NormRope(x), ew.NormRope(x), prefetch=np.zeros(10, np.uint64))
