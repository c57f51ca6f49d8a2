# Lane-level port of qmm.cu's group math (stage_math_groups) for the dense
# matrices, both column layouts: hi/lo (4 tokens an n-tile, each token's
# hi and lo halves in two B columns) and F16 (8 tokens an n-tile, their hi
# halves only), over as many n-tiles as the tokens need (qmm_dense_2's two
# hi/lo n-tiles at 5-8 tokens, qmm_dense_f16_2's two fp16 ones at 9-16), on
# top of warp.py's mma.sync m16n8k16. Checks, on a task of
# 16 weight rows x G groups of 64 columns with random 4-bit codes, scales,
# biases and x, that every (row, token) output the port's epilogue mapping
# names equals the f64 sum the kernel promises:
#   hi/lo: sum_k w_k (hi_k + lo_k)        (w = scale * q + bias)
#   F16:   sum_k w_k hi_k + sum_g bias_g sum_{k in g} lo_k
# The port follows the kernel's data paths: the stage's code words as
# lds64 reads them (words 2c, 2c + 1 of rows g and g + 8), deq_word's masks
# on the raw bits (fp16 subnormals), the packed x in px_perm order read as
# the kernel's two 16-byte loads a group, the d / e chains, the fold in
# fp32, and the token each lane's accumulators belong to (qmm_run's xoff /
# csoff / csoff2, qmm_epilogues_f16, DenseJob::epilogue).
# Run: python3 sim_qmm.py   (seconds; numpy only, not part of CI)
import numpy as np
from warp import L, G, C, mma

rng = np.random.default_rng(7)

def px_perm(j):
    return ((j & 1) << 2) | (j & 2) | ((j >> 2) & 1)

def f16_bits(v):
    return np.asarray(v, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)

def pair(lo16, hi16):  # two fp16 bit patterns -> the (32,2) f16 register view warp.py takes
    return np.stack([np.asarray(lo16, np.uint16).view(np.float16), np.asarray(hi16, np.uint16).view(np.float16)], axis=1)

def deq_word(w):
    # qmm.cu deq_word: p[0] (n0, n4), p[1] (n2, n6) at 2^-24; p[2] (n1, n5),
    # p[3] (n3, n7) at 2^-20, each an fp16 pair (low half first).
    w8 = w >> 8
    out = []
    for v in (w & 0x000F000F, w8 & 0x000F000F, w & 0x00F000F0, w8 & 0x00F000F0):
        out.append(pair(v & 0xFFFF, v >> 16))
    return out

def regs(u32s):  # four u32 words of packed fp16 (low half first) -> (32,2) f16 views
    return [pair(u & 0xFFFF, u >> 16) for u in u32s]

def simulate(f16, ntok, groups=4):
    K = 64 * groups
    codes = rng.integers(0, 16, size=(16, K))
    scales = (rng.uniform(0.5, 2.0, size=(16, groups)) * 2.0 ** -6).astype(np.float32)
    biases = (rng.uniform(-8, 0, size=(16, groups)) * 2.0 ** -6).astype(np.float32)
    x = rng.uniform(-2, 2, size=(ntok, K)).astype(np.float32)
    hi = x.astype(np.float16).astype(np.float32)
    lo = (x - hi).astype(np.float16).astype(np.float32)
    # Packed rows [tok][2][K] in px_perm order; group sums of hi + lo (xnorm).
    px = np.zeros((ntok, 2, K), np.uint32)
    for col in range(K):
        p = (col & ~7) + px_perm(col & 7)
        px[:, 0, p] = f16_bits(hi[:, col])
        px[:, 1, p] = f16_bits(lo[:, col])
    csum = np.stack([(hi + lo)[:, g * 64:(g + 1) * 64].sum(axis=1, dtype=np.float64) for g in range(groups)], 1).astype(np.float32)
    # Code words: row r, word i = codes 8i..8i+7, n_j at bits 4j.
    words = np.zeros((16, K // 8), np.uint32)
    for i in range(K // 8):
        for j in range(8):
            words[:, i] |= (codes[:, 8 * i + j].astype(np.uint32) << (4 * j))
    tpn = 8 if f16 else 4
    nt_count = -(-ntok // tpn)
    got = {}
    for nt in range(nt_count):
        # qmm_run: the lane's B column token and its C tokens.
        if f16:
            jb = nt * 8 + G
            xtok, xplane = np.where(jb < ntok, jb, 0), np.zeros(32, int)   # absent tokens read row 0
            ctoks = [nt * 8 + 2 * C, nt * 8 + 2 * C + 1]
        else:
            jb = nt * 4 + (G >> 1)
            xtok, xplane = np.where(jb < ntok, jb, 0), G & 1
            ctoks = [nt * 4 + C]
        acc = np.zeros((32, 4 if f16 else 2), np.float32)
        for grp in range(groups):
            # Codes: lds64 of words 2c, 2c + 1 of rows g and g + 8.
            wr_x, wr_y = words[G, grp * 8 + 2 * C], words[G, grp * 8 + 2 * C + 1]
            wh_x, wh_y = words[G + 8, grp * 8 + 2 * C], words[G + 8, grp * 8 + 2 * C + 1]
            pr0, pr1, ph0, ph1 = deq_word(wr_x), deq_word(wr_y), deq_word(wh_x), deq_word(wh_y)
            # x: two 16-byte loads at column 16c of the group (u16 units).
            base = grp * 64 + 16 * C
            row = px[xtok, xplane]                                   # (32, K)
            w01 = [row[L, base + 2 * i] | (row[L, base + 2 * i + 1] << 16) for i in range(4)]
            w23 = [row[L, base + 8 + 2 * i] | (row[L, base + 8 + 2 * i + 1] << 16) for i in range(4)]
            b01, b23 = regs(w01), regs(w23)
            d = np.zeros((32, 4)); e = np.zeros((32, 4))
            d = mma(d, pr0[0], ph0[0], pr0[1], ph0[1], b01[0], b01[1])
            e = mma(e, pr0[2], ph0[2], pr0[3], ph0[3], b01[2], b01[3])
            d = mma(d, pr1[0], ph1[0], pr1[1], ph1[1], b23[0], b23[1])
            e = mma(e, pr1[2], ph1[2], pr1[3], ph1[3], b23[2], b23[3])
            d = d.astype(np.float32); e = e.astype(np.float32)
            sA, sB = scales[G, grp], scales[G + 8, grp]
            bA, bB = biases[G, grp], biases[G + 8, grp]
            cs = [np.where(t < ntok, csum[np.minimum(t, ntok - 1), grp], 0).astype(np.float32) / np.float32(2 ** 20) for t in ctoks]
            if f16:
                y = [np.float32(16) * d[:, i] + e[:, i] for i in range(4)]
                for i, (s, b, c) in enumerate([(sA, bA, cs[0]), (sA, bA, cs[1]), (sB, bB, cs[0]), (sB, bB, cs[1])]):
                    acc[:, i] += s * y[i] + b * c
            else:
                yA = np.float32(16) * (d[:, 0] + d[:, 1]) + (e[:, 0] + e[:, 1])
                yB = np.float32(16) * (d[:, 2] + d[:, 3]) + (e[:, 2] + e[:, 3])
                acc[:, 0] += sA * yA + bA * cs[0]
                acc[:, 1] += sB * yB + bB * cs[0]
        acc *= np.float32(2 ** 20)
        # Epilogue: (token, row) of each lane's accumulators.
        if f16:
            outs = [(ctoks[0], G, acc[:, 0]), (ctoks[0], G + 8, acc[:, 2]), (ctoks[1], G, acc[:, 1]), (ctoks[1], G + 8, acc[:, 3])]
        else:
            outs = [(ctoks[0], G, acc[:, 0]), (ctoks[0], G + 8, acc[:, 1])]
        for toks, rows, vals in outs:
            for lane in range(32):
                if toks[lane] < ntok:
                    key = (int(toks[lane]), int(rows[lane]))
                    assert key not in got, f"({key}) written twice"
                    got[key] = float(vals[lane])
    # The f64 reference the kernel promises.
    w = (scales.repeat(64, axis=1).astype(np.float64) * codes + biases.repeat(64, axis=1))
    if f16:
        lo_sums = np.stack([lo[:, g * 64:(g + 1) * 64].sum(axis=1, dtype=np.float64) for g in range(groups)], 1)
        want = hi.astype(np.float64) @ w.T + (lo_sums @ biases.T.astype(np.float64))
    else:
        want = (hi.astype(np.float64) + lo) @ w.T
    assert len(got) == ntok * 16, f"{len(got)} outputs for {ntok} tokens x 16 rows"
    # Per token, ||got - want|| / ||want|| over its 16 rows (gpu_qmm's `rel`).
    outs = np.array([[got[(t, r)] for r in range(16)] for t in range(ntok)])
    rel = lambda a, b: max(np.linalg.norm(a[t] - b[t]) / np.linalg.norm(b[t]) for t in range(ntok))
    return rel(outs, want), rel(outs, x.astype(np.float64) @ w.T)

for f16 in (False, True):
    for ntok in (1, 3, 5, 8, 12, 16) if f16 else (1, 3, 4, 8):
        err, drift = simulate(f16, ntok)
        print(f"{'F16  ' if f16 else 'hi/lo'} {ntok} tokens: relative error against the promised sum {err:.2e}, "
              f"against the exact input {drift:.2e}")
        assert err < 1e-5, err
print("ok")
