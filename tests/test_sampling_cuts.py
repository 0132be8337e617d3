"""The sampler kernel's cut shortcuts, modelled in numpy with its fp32 arithmetic (no GPU needed).

raw_kernels/sampling.cu cuts a row by a histogram of 1024 bins of width 1/32 in d = (l - l_max) / T
over its G blocks. Two shortcuts must not change any cut:
- a block merges only the bins up to its own k-th token's bin (top-k), or up to the top-k cut's bin
  (top-p after top-k), and the row's scan still finds the same boundary bin, count and mass above;
- the gathered cut (top-k then top-p): the union of the blocks' own k best tokens holds the row's
  k best, so cutting the union gives the row's top-k and top-p cuts.
The models below use the kernel's composite order (larger d first, equal d: lower id first), its
bin function and integer masses, on rows with ties, clusters and a -inf tail.
"""

import numpy as np
import pytest

BINS = 1024
BIN_FLOOR = np.float32(-31.96875)
MASS_SCALE = 2.0**36


def _d(logits, temperature: float) -> np.ndarray:
    """d = (l - l_max) * (1 / T) in fp32, round to nearest, -0 -> +0 (sample_unit)."""
    lo = logits.astype(np.float32)
    inv_t = np.float32(1.0) / np.float32(temperature)
    return (lo - lo.max()) * inv_t + np.float32(0.0)


def _bin(d: np.ndarray) -> np.ndarray:
    """smp_bin: trunc(-d * 32) above the floor, else the last bin."""
    with np.errstate(invalid="ignore", over="ignore"):
        b = np.trunc(-d.astype(np.float64) * 32.0)
    return np.where(d > BIN_FLOOR, b, BINS - 1).astype(np.int64)


def _mass(d: np.ndarray) -> np.ndarray:
    """Integer masses, monotone in d (smp_mass: exp(d) * 2^36 rounded)."""
    return np.rint(np.exp(d.astype(np.float64)) * MASS_SCALE).astype(np.int64)


def _order(d: np.ndarray) -> np.ndarray:
    """Token ids in the composite order: larger d first, equal d lower id first."""
    return np.lexsort((np.arange(d.size), -d.astype(np.float64)))


def _rank(d: np.ndarray) -> np.ndarray:
    """Each token's position in the composite order."""
    rank = np.empty(d.size, np.int64)
    rank[_order(d)] = np.arange(d.size)
    return rank


def _scan(counts: np.ndarray, masses: np.ndarray, want: int, by_mass: bool):
    """smp_pick: the first bin from the top where the count or the mass reaches `want`, with the
    count and mass above it and the count in it (None when never reached)."""
    cum = np.cumsum(masses if by_mass else counts)
    hit = np.nonzero(cum >= want)[0]
    if hit.size == 0:
        return None
    b = int(hit[0])
    return b, int(counts[:b].sum()), int(masses[:b].sum()), int(counts[b])


def _rows(rng):
    """Logit rows of the kinds the kernel must cut exactly: smooth, heavy ties, clusters, a tail."""
    v = 5000
    yield "normal x 3", (rng.standard_normal(v) * 3).astype(np.float32)
    yield "16 distinct values", rng.integers(0, 16, v).astype(np.float32)
    yield "all equal", np.zeros(v, np.float32)
    yield "clusters", (np.repeat(rng.standard_normal(50), v // 50) * 2 + rng.standard_normal(v) * 1e-3).astype(np.float32)
    tail = (rng.standard_normal(v) * 3).astype(np.float32)
    tail[rng.random(v) < 0.3] = -np.inf
    yield "-inf tail", tail
    yield "bf16-like grid", np.round(rng.standard_normal(v) * 8 * 4) / 4


def _blocks(n: int, g: int) -> list:
    """The G contiguous token ranges of a row, as `geometry` splits it (the last one shorter)."""
    chunk = -(-n // g)
    return [np.arange(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _hist(bins, masses, tokens):
    counts = np.bincount(bins[tokens], minlength=BINS)
    mass = np.bincount(bins[tokens], weights=masses[tokens].astype(np.float64), minlength=BINS).astype(np.int64)
    return counts, mass


@pytest.mark.parametrize("g", [2, 7, 32])
@pytest.mark.parametrize("temperature", [1.0, 0.37, 3.0])
def test_merging_bins_up_to_each_blocks_kth_finds_the_same_top_k_boundary(g, temperature):
    rng = np.random.default_rng(g)
    for name, logits in _rows(rng):
        d = _d(logits, temperature)
        bins, masses = _bin(d), _mass(d)
        blocks = _blocks(d.size, g)
        for k in (1, 7, 50, 300, 2000):
            full = [_hist(bins, masses, t) for t in blocks]
            merged_c, merged_m = np.zeros(BINS, np.int64), np.zeros(BINS, np.int64)
            for (c, m) in full:
                own = _scan(c, m, k, by_mass=False)
                bound = BINS - 1 if own is None else own[0]  # smp_merge_bound
                merged_c[:bound + 1] += c[:bound + 1]
                merged_m[:bound + 1] += m[:bound + 1]
            all_c = sum(c for c, _ in full)
            all_m = sum(m for _, m in full)
            assert _scan(merged_c, merged_m, k, False) == _scan(all_c, all_m, k, False), (name, k)


@pytest.mark.parametrize("g", [3, 16])
def test_top_p_after_top_k_merging_bins_up_to_the_top_k_cut_finds_the_same_boundary(g):
    rng = np.random.default_rng(100 + g)
    for name, logits in _rows(rng):
        d = _d(logits, 1.0)
        bins, masses = _bin(d), _mass(d)
        order = _order(d)
        for k, p in ((5, 0.5), (50, 0.9), (400, 0.3001), (3000, 0.99)):
            kept = order[:k]
            theta_bin = int(bins[kept[-1]])  # the bin of the top-k cut's last token
            target = max(1, int(np.ceil(p * float(masses[kept].sum()))))
            full_c, full_m = _hist(bins, masses, np.arange(d.size))
            cut_c, cut_m = full_c.copy(), full_m.copy()
            cut_c[theta_bin + 1:] = 0
            cut_m[theta_bin + 1:] = 0
            assert _scan(cut_c, cut_m, target, True) == _scan(full_c, full_m, target, True), (name, k, p)


def _top_p(d, candidates, p):
    """The shortest prefix (composite order) of `candidates` whose mass reaches ceil(p * mass)."""
    ranked = candidates[np.argsort(_rank(d)[candidates], kind="stable")]
    cum = np.cumsum(_mass(d)[ranked])
    target = max(1, int(np.ceil(p * float(cum[-1]))))
    return ranked[:int(np.searchsorted(cum, target)) + 1]


@pytest.mark.parametrize("g", [2, 9, 127])
def test_the_gathered_cut_of_the_blocks_own_k_best_equals_the_rows_cut(g):
    rng = np.random.default_rng(200 + g)
    for name, logits in _rows(rng):
        for temperature in (1.0, 2.5):
            d = _d(logits, temperature)
            rank = _rank(d)
            for k in (1, 13, 64):
                if k * g > 8192 or k >= d.size:
                    continue
                # each block's own k best (its exact local cut), then the row's k best among them
                gathered = np.concatenate([t[np.argsort(rank[t], kind="stable")[:k]] for t in _blocks(d.size, g)])
                top = gathered[np.argsort(rank[gathered], kind="stable")[:k]]
                assert np.array_equal(np.sort(top), np.sort(_order(d)[:k])), (name, temperature, k)
                assert np.array_equal(np.sort(_top_p(d, top, 0.9)), np.sort(_top_p(d, _order(d)[:k], 0.9)))
