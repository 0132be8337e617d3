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


# ---- the gathered cut's bound (posted thread maxima)
#
# Before the row's max barrier each block posts the keys of its `each` largest thread maxima
# (a thread's largest raw logit; 0 for a thread without tokens); after it, the k-th largest posted
# key L bounds the row: k distinct tokens have a logit >= L, so each of the row's k best tokens has
# d >= d(L), computed with the same fp32 arithmetic as every token's d. A block sends only its tokens
# at or above d(L), and of those at most its own k best; the finisher cuts the few it gets by rank.
# Tokens in the last bin (d <= -31.97: no mass, and below kNeverWins) are never sent: they change
# neither a top-p target nor the race, whether or not the top-k would keep them.

THREADS = 256
POST_SLOTS = 256
POST_MAX_EACH = 16


def _key(x: np.ndarray) -> np.ndarray:
    """smp_key: the order-preserving uint32 key of fp32 values (NaN -> -inf, -0 -> +0)."""
    x = np.where(np.isnan(x), -np.inf, x).astype(np.float32)
    u = x.view(np.uint32).copy()
    u[u == 0x80000000] = 0
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def _unkey(k: int) -> np.float32:
    """smp_unkey of one key."""
    k = np.uint32(k)
    bits = k & np.uint32(0x7FFFFFFF) if k & np.uint32(0x80000000) else ~k
    return np.array([bits], np.uint32).view(np.float32)[0]


def _post_each(k: int, g: int) -> int:
    """smp_post_each: thread maxima each block posts (0: no bound); G - 1 full blocks post >= k."""
    if g < 2 or k == 0:
        return 0
    each = -(-k // (g - 1))
    return each if each <= POST_MAX_EACH and g * each <= POST_SLOTS else 0


def _bounded_gather(logits, temperature: float, g: int, per: int, k: int):
    """The gathered candidates of a row split over g blocks of THREADS * per tokens (the kernel's
    layout): the posted bound, then each block's tokens at or above it, at most its own k best."""
    lo = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
    d = _d(lo, temperature)
    rank = _rank(d)
    chunk = THREADS * per
    each = _post_each(k, g)
    d_bound = np.float32(-np.inf)
    if each:
        keys = _key(lo)
        posts = []
        for b in range(g):
            tk = [int(keys[s:s + per].max()) for s in range(b * chunk, (b + 1) * chunk, per) if s < lo.size]
            tk += [0] * (THREADS - len(tk))  # threads without tokens
            posts += sorted(tk, reverse=True)[:each]
        bound = sorted(posts, reverse=True)[k - 1]  # the k-th largest posted key
        assert bound > 0
        inv_t = np.float32(1.0) / np.float32(temperature)
        d_bound = (_unkey(bound) - lo.max()) * inv_t + np.float32(0.0)
    sent = []
    for b in range(g):
        t = np.arange(b * chunk, min((b + 1) * chunk, lo.size))
        t = t[(d[t] >= d_bound) & (d[t] > BIN_FLOOR)]
        sent.append(t[np.argsort(rank[t], kind="stable")[:k]])
    return d, np.concatenate(sent), each


def _rank_cut(d, gathered, k, p):
    """smp_rank_cut: each candidate's rank by counting the candidates above it; ranks < k survive;
    top-p keeps those whose exclusive prefix mass (rank order) is below ceil(p * their mass)."""
    r = _rank(d)[gathered]
    above = np.array([(r < x).sum() for x in r])
    survivors = gathered[np.argsort(above)][:k]
    if p < 1.0:
        m = _mass(d)[survivors]
        before = np.concatenate([[0], np.cumsum(m)[:-1]])
        survivors = survivors[before < max(1, int(np.ceil(p * float(m.sum()))))]
    return survivors


def _vocab_rows(rng, v):
    """Rows of a 129280-token vocabulary where a block-local bound is weak: a block of unlikely
    tokens, masked ranges, ties at the top, a sorted row."""
    yield "normal", (rng.standard_normal(v) * 3).astype(np.float32)
    low = (rng.standard_normal(v) * 3).astype(np.float32)
    low[:9000] -= 40.0  # ids the context makes unlikely, in a few blocks
    yield "a low range", low
    masked = (rng.standard_normal(v) * 3).astype(np.float32)
    masked[20000:90000] = -np.inf
    yield "a masked range", masked
    yield "sorted", np.sort(rng.standard_normal(v).astype(np.float32))
    top = rng.integers(-50, 3, v).astype(np.float32)
    yield "ties at the top", top
    yield "all equal", np.zeros(v, np.float32)


@pytest.mark.parametrize("g,per", [(127, 4), (32, 16), (3, 4)])
def test_the_posted_bound_keeps_the_rows_k_best_and_the_rank_cut_equals_the_rows_cut(g, per):
    rng = np.random.default_rng(300 + g)
    v = min(129280, g * THREADS * per - 777)  # the last block partly filled
    for name, logits in _vocab_rows(rng, v):
        for temperature in (1.0, 0.6):
            for k in (1, 2, 50, 64, 200):
                if k * g > 8192:
                    continue  # the gather slots: the histogram path
                d, gathered, each = _bounded_gather(logits, temperature, g, per, k)
                top = _order(d)[:k]
                top = top[d[top] > BIN_FLOOR]  # what can matter: mass, or a chance in the race
                assert np.isin(top, gathered).all(), (name, temperature, k)
                assert gathered.size <= g * k
                for p in (1.0, 0.9, 0.3):
                    p = float(np.float32(p))  # the kernel's fp32 top_p, times the mass in double
                    got = _rank_cut(d, gathered, k, p)
                    want = top if p == 1.0 else _top_p(d, top, p)
                    assert np.array_equal(np.sort(got), np.sort(want)), (name, temperature, k, p)


def test_the_posted_bound_leaves_few_candidates_on_smooth_and_structured_rows():
    """What the bound is for: at batch 1 (127 blocks of 1024 tokens) and batch 8 (32 of 4096) the
    finisher cuts about k candidates instead of G * k, also when a range of the vocabulary is
    unlikely or masked (while the unmasked blocks alone post k values). Where it cannot help: ties
    at the bound (every tied token is sent, each block at most k), and a row sorted by id (the
    k-th largest block maximum is k blocks from the top: ~k * 1024 / 2 tokens lie above it)."""
    rng = np.random.default_rng(7)
    for name, logits in _vocab_rows(rng, 129280):
        for k in (20, 50):
            for g, per in ((127, 4), (32, 16)):
                _, gathered, each = _bounded_gather(logits, 1.0, g, per, k)
                assert each == -(-k // (g - 1))
                if name in ("ties at the top", "all equal", "sorted") or (name == "a masked range" and g == 32):
                    assert gathered.size > 4 * k  # the limits named above (32 blocks: 15 unmasked)
                else:
                    assert gathered.size <= 2 * k, (name, k, g, gathered.size)


def test_the_bound_is_only_used_when_full_blocks_post_k_values():
    assert [_post_each(k, 127) for k in (1, 50, 126, 127, 252, 253)] == [1, 1, 1, 2, 2, 0]
    assert [_post_each(k, 32) for k in (1, 31, 32, 62, 248, 249)] == [1, 1, 2, 2, 8, 0]
    assert _post_each(50, 1) == 0 and _post_each(17, 2) == 0 and _post_each(16, 2) == 16
    assert _post_each(0, 127) == 0


def test_the_models_constants_are_the_kernels():
    import re

    from fp4kit.runtime import loader

    src = loader.kernel_source("sampling")
    const = {name: int(v) for name, v in re.findall(r"constexpr int (k\w+) = (\d+);", src)}
    assert (const["kThreads"], const["kPostSlots"], const["kPostMaxEach"]) == (THREADS, POST_SLOTS, POST_MAX_EACH)


# ---- top-p alone by racing first (smp_race_front / smp_race_decide)
#
# Every block sends, per level-0 bin, its best race key there, kept where it beats the best keys of
# all better bins of the block. The decider finds the top-p cut's boundary bin b* from the row's
# histogram: the best front key of the bins before b* wins, unless a front key in b* beats it (then
# b* decides only when it holds one token; otherwise the histogram path runs).


CAP = 512  # kCap: a boundary bin of at most this many tokens is cut exactly by the row's finisher


def _race_first(d, key, p, g):
    """(the winner: the decider's, or the boundary bin's exact cut; None when the row falls back to
    the histogram path; the exact winner; front entries sent; the boundary bin's tokens)."""
    bins, masses = _bin(d), _mass(d)
    order = _order(d)
    cum = np.cumsum(masses[order])
    n_kept = int(np.searchsorted(cum, max(1, int(np.ceil(p * float(cum[-1])))))) + 1
    kept = order[:n_kept]
    relevant = kept[key[kept] > 0]
    exact = relevant[np.argmax(key[relevant])]
    counts = np.bincount(bins, minlength=BINS)
    b_star = int(bins[kept[-1]])  # the histogram's boundary bin: where the mass reaches the target
    assert (bins[kept] <= b_star).all() and (bins[order[n_kept:]] >= b_star).all()
    best_kept = best_und = (0.0, -1)
    sent = 0
    for t in _blocks(d.size, g):
        best = {}
        for i in t[key[t] > 0]:
            if key[i] > best.get(bins[i], (0.0, -1))[0]:
                best[bins[i]] = (key[i], i)
        run = 0.0
        for b in sorted(best):
            if best[b][0] > run:  # on the block's front
                run = best[b][0]
                sent += 1
                if b < b_star:
                    best_kept = max(best_kept, best[b])
                elif b == b_star:
                    best_und = max(best_und, best[b])
    in_b = int(counts[b_star])
    if best_und[0] <= best_kept[0]:
        return best_kept[1], exact, sent, in_b
    if in_b == 1:
        return best_und[1], exact, sent, in_b
    if in_b > CAP:
        return None, exact, sent, in_b
    # kVerdictBin: b*'s tokens in composite order, kept while the mass before them in the bin is
    # below the bin's share of the target (target - the mass of the bins before b*); the winner is
    # the best of the kept bins' key (the race slot) and the kept tokens' keys
    target = max(1, int(np.ceil(p * float(masses.sum()))))
    bin_rem = target - int(masses[bins < b_star].sum())
    in_bin = order[bins[order] == b_star]
    before = np.concatenate([[0], np.cumsum(masses[in_bin])[:-1]])
    cut = in_bin[before < bin_rem]
    cut = cut[key[cut] > 0]
    best_cut = (key[cut].max(), cut[np.argmax(key[cut])]) if cut.size else (0.0, -1)
    return max(best_kept, best_cut)[1], exact, sent, in_b


@pytest.mark.parametrize("g", [1, 5, 20])
def test_racing_first_decides_the_exact_winner_or_falls_back(g):
    """Every draw the decider settles, by the fronts or by the boundary bin's exact cut, names the
    exact winner; only a boundary bin of more than kCap tokens (ties: one value everywhere, 16
    values) falls back.
    The cut is needed when a key of the boundary bin beats the kept bins' (common when top-p keeps
    a handful of tokens, so the boundary bin holds much of their mass: p = 0.3 here)."""
    rng = np.random.default_rng(400 + g)
    v = 20000
    rows = dict(_rows(rng))
    rows["peaked"] = np.concatenate([[14.0, 11.0, 10.5], rng.standard_normal(v - 3) * 2]).astype(np.float32)
    rows["one dominant token"] = np.concatenate([[30.0], rng.standard_normal(v - 1)]).astype(np.float32)
    for name, logits in rows.items():
        d = _d(logits[:v] if logits.size >= v else np.resize(logits, v), 1.0)
        for p in (0.3, 0.9, 0.99):
            undecided = 0
            for trial in range(4):
                # race keys: exp(d) / E, E ~ Exp(1) (0: the token cannot win, d < -20)
                key = np.where(d >= -20.0, np.exp(d.astype(np.float64)) / rng.exponential(size=v), 0.0)
                got, exact, sent, in_b = _race_first(d, key, p, g)
                assert sent <= g * BINS
                if got is None:
                    undecided += 1
                    assert in_b > CAP, (name, p, trial)
                else:
                    assert got == exact, (name, p, trial)
            if name == "all equal":
                assert undecided == 4  # 20000 tokens tie in b*
            elif name != "16 distinct values":
                assert undecided == 0, (name, p)
