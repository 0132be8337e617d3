"""How few shift and mask instructions can turn one 32-bit word of eight E2M1 codes into the four
bf16x2 registers of an m16n8k16 A fragment, whatever order the packer stores the 32 bits in?

Each output register holds two values, each at the bf16 field bits of E2M1 (sign at bit 15, the
exponent's two low bits and the mantissa's top bit at bits 6..8, the exponent bias folded into the
scale multiply): the mask M = {6, 7, 8, 15, 22, 23, 24, 31}. An output built from the word shifted
by s (one SHF or IMAD.SHL unless s = 0) and masked (one LOP3; each further shifted copy merged in
costs one more LOP3) takes its bits from M - s, and the four outputs together must take each of the
32 bits exactly once. The search below tries every program of shifts in [-31, 31] with one copy
for two or three outputs and two copies for the others, and prints any cheaper than the 11
instructions the engine's `dequant_step` uses (shifts 0, 3 and 6 for three outputs, three copies
for the fourth): there is none. Fewer would need the 32 bits tiled by translates of M, which does
not exist (M is {0, 1, 2, 9} mod 16 twice, and no four translates of that set tile Z_16).

    python3 scripts/dequant_bound.py
"""

import itertools

M = (6, 7, 8, 15, 22, 23, 24, 31)
SHIFTS = range(-31, 32)


def cover(outputs, free):
    """Whether the outputs' shift sets can take every bit of ``free`` exactly once (each output
    taking each of the 8 positions of M from one of its shifts)."""
    def rec(i, used):
        if i == len(M):
            return used == free
        d = M[i]
        for pick in itertools.product(*outputs):
            srcs = [d - s for s in pick]
            if len(set(srcs)) == len(srcs) and all(x in free and x not in used for x in srcs):
                if rec(i + 1, used | set(srcs)):
                    return True
        return False
    return rec(0, set())


def cheapest(limit: int = 11):
    found = []
    singles = [s for s in range(7)]  # a one-copy output needs M - s inside the word
    for n_single in (3, 2):
        for fixed in itertools.combinations(singles, n_single):
            taken = set()
            for s in fixed:
                taken |= {d - s for d in M}
            if len(taken) != 8 * n_single:
                continue
            free = set(range(32)) - taken
            rest = 4 - n_single
            for sets in itertools.product(itertools.combinations(SHIFTS, 2), repeat=rest):
                nonzero = len((set(fixed) | set(itertools.chain(*sets))) - {0})
                cost = nonzero + n_single + 2 * rest
                if cost < limit and cover(sets, free):
                    found.append((cost, fixed, sets))
    return found


if __name__ == "__main__":
    better = cheapest()
    print("programs cheaper than 11 instructions per word:", better or "none")
