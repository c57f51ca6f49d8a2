# Block-level port of the weight ring of gemm_body (kernels/gemm.cu): the
# per-thread index math of the copies (A tile, raw W codes, scale/bias
# chunks or the plain-load fallback), the cp.async commit groups and the
# ring stages, and the dequantisation's addressing, for one block of 256
# threads (numpy over the thread index). Checks, at every k-tile's
# multiply, that the A stage holds the tile's A rows (zeros past the tile)
# and the fp16 W tile the dequantised weights of the right rows (SwiGLU:
# 8 gate / 8 up rows), and tags every shared byte with what wrote it so a
# stage overwritten before it is read, or read before it lands, fails.
# cp.async copies land either at issue (eager: exposes write-after-read) or
# at the wait that guarantees them (lazy: exposes read-before-arrival).
# The dequantisation's arithmetic is not ported (one f64 formula stands for
# it on both sides; the GPU tests check the kernel's); the multiply is
# unchanged by the ring and not ported either. It fails, as it should, when
# the wait allows S - 1 pending groups, when a k-tile is issued into the
# stage being read, when scale chunks ignore their parity, or with more
# than 9 stages. Keep it in step with gemm_body when either changes.
# Run: python3 sim_gemm.py (python3 + numpy, ~40 s; not part of CI).
import numpy as np

BN, BK, PAD, NT, SG = 128, 64, 8, 256, 8
LD = BK + PAD
TID = np.arange(NT)

def f16sat(x):
    return np.clip(np.asarray(x, np.float64), -65504, 65504).astype(np.float32).astype(np.float16)

def dequant(codes_row_q, s, b):
    # fp16(fmaf(s, q, b)): f64 s*q+b is exact here, one rounding to f32
    return f16sat((np.float64(s) * codes_row_q + np.float64(b)).astype(np.float32))

def bf16(x):
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

def bf16f(h): return (np.asarray(h, np.uint32) << 16).view(np.float32)

class Mat:
    """One W matrix (one expert): codes packed as the kernel reads them."""
    def __init__(s, rng, n, K, bits):
        s.n, s.K, s.bits = n, K, bits
        s.q = rng.integers(0, 1 << bits, size=(n, K))
        per = 32 // bits
        w = s.q.reshape(n, K // per, per).astype(np.uint64)
        s.words = (w << (np.arange(per, dtype=np.uint64) * bits)).sum(axis=2).astype(np.uint32)   # [n][K*bits/32]
        s.scales = bf16(rng.uniform(0.01, 0.1, size=(n, K // 64)))
        s.biases = bf16(rng.uniform(-0.5, 0.5, size=(n, K // 64)))
        s.bytes = s.words.reshape(-1).view(np.uint8)

    def w16(s, row, kt):
        return dequant(s.q[row, kt * 64:(kt + 1) * 64], bf16f(s.scales[row, kt]), bf16f(s.biases[row, kt]))

KIND = {'A': 1, 'W': 2, 'S': 3, 'sW': 4}
def T(kind, kt): return KIND[kind] * 1_000_000 + kt

class Smem:
    def __init__(s, size):
        s.b = np.full(size, 0xEE, np.uint8)
        s.tag = np.full(size, -1, np.int64)
    def write(s, off, data, tag):
        data = np.asarray(data).view(np.uint8).reshape(-1)
        assert off % 2 == 0 and off + data.size <= s.b.size, (off, data.size)
        s.b[off:off + data.size] = data
        s.tag[off:off + data.size] = tag
    def read(s, off, n, tag, what):
        t = s.tag[off:off + n]
        assert np.all(t == tag), f"{what}: bytes at {off} tagged {np.unique(t)}, want {tag}"
        return s.b[off:off + n].copy()

def run_block(bits, BM, S, K, n, mats, kt0, kt1, m0, m1, a, a_rows, swiglu, sring_ok, eager, n0=0):
    RB = BK * bits // 8; LPT = RB // 32; CPU4 = 128 // bits
    A_BYTES = BM * LD * 2; STAGE = A_BYTES + BN * RB
    SROW = 2 * SG; S_OFF = BN * LD * 2; B_OFF = S_OFF + BN * SROW * 2; R_OFF = B_OFF + BN * SROW * 2
    assert S >= 2 and S - 1 <= SG
    sm = Smem(R_OFF + S * STAGE)
    wpr = K * bits // 32; gpr = K // 64; nkt = kt1 - kt0
    tr = TID >> 1; part = TID & 1
    if swiglu:
        j8 = tr >> 3; wrow = n0 + (j8 >> 1) * 8 + (tr & 7); up = j8 & 1
    else:
        wrow = n0 + tr; up = np.zeros(NT, int)
    wvalid = wrow < n
    mat_of = [mats[u] for u in up]
    sring = (gpr % SG == 0) & np.array([sring_ok[u] for u in up])
    wr = np.where(wvalid, wrow, 0)
    wsrc = wr * wpr + kt0 * (BK * bits // 32) + part * LPT * 4      # word index
    wrow_sb = wr * gpr
    s_wq = R_OFF + A_BYTES + tr * RB + part * LPT * 16
    sb_slot = np.where(part == 1, (B_OFF - S_OFF) // 2, 0) + tr * SROW
    CPR = BK // 8; A_CHUNKS = BM * CPR; A_ITERS = -(-A_CHUNKS // NT)
    a_off = np.zeros((A_ITERS, NT), np.int64); a_ok = np.zeros((A_ITERS, NT), bool)
    lda = a.shape[1]
    for i in range(A_ITERS):
        idx = TID + i * NT
        m = m0 + idx // CPR
        ok = (idx < A_CHUNKS) & (m < m1)
        arow = np.where(ok, np.array([a_rows[x] if o else 0 for x, o in zip(m, ok)]), 0)
        a_off[i] = arow * lda + kt0 * BK + (idx % CPR) * 8
        a_ok[i] = ok
    a_flat = a.reshape(-1)
    groups, cur = [], []

    def cp(dst, data, tag):
        if eager: sm.write(dst, data, tag)
        else: cur.append((dst, np.array(data), tag))

    def issue(it, stage):
        nonlocal wsrc, cur
        if it < nkt:
            kt = kt0 + it
            for i in range(A_ITERS):
                for t in range(NT):
                    idx = t + i * NT
                    if idx < A_CHUNKS:
                        dst = R_OFF + stage + (idx // CPR) * LD * 2 + (idx % CPR) * 16
                        src = a_off[i, t] + it * BK
                        cp(dst, a_flat[src:src + 8] if a_ok[i, t] else np.zeros(8, np.float16), T('A', kt))
            for t in range(NT):
                wm = mat_of[t]
                for i in range(LPT):
                    src = wsrc[t] + 4 * i
                    cp(s_wq[t] + stage + 16 * i, wm.words.reshape(-1)[src:src + 4] if wvalid[t] else np.zeros(4, np.uint32), T('W', kt))
            wsrc = wsrc + BK * bits // 32
            for t in range(NT):
                wm = mat_of[t]; arr = wm.biases if part[t] else wm.scales
                if sring[t]:
                    if it == 0 or kt % SG == 0:
                        c0 = kt & ~(SG - 1)
                        src = arr.reshape(-1)[wrow_sb[t] + c0:wrow_sb[t] + c0 + SG] if wvalid[t] else np.zeros(SG, np.uint16)
                        dst = S_OFF + 2 * (sb_slot[t] + (kt & SG))
                        assert dst % 16 == 0
                        # tag each 2-byte slot with its k-tile
                        for j in range(SG):
                            cp(dst + 2 * j, src[j:j + 1], T('S', c0 + j))
                else:
                    v = arr.reshape(-1)[wrow_sb[t] + kt] if wvalid[t] else np.uint16(0)
                    sm.write(S_OFF + 2 * (sb_slot[t] + kt % SROW), np.array([v], np.uint16), T('S', kt))   # plain store
        groups.append(cur); cur = []

    def wait(nn):
        while len(groups) > nn:
            for dst, data, tag in groups.pop(0): sm.write(dst, data, tag)

    for s_ in range(S - 1): issue(s_, s_ * STAGE)
    rd = 0
    for it in range(nkt):
        kt = kt0 + it
        slot = kt % SROW
        wait(S - 2)
        # barrier
        issue(it + S - 1, (S - 1) * STAGE if rd == 0 else rd - STAGE)
        # dequantisation (after every thread's copies of this phase: the worst order for eager writes)
        for t in range(NT):
            raw = sm.read(R_OFF + A_BYTES + tr[t] * RB + part[t] * LPT * 16 + rd, LPT * 16, T('W', kt), f"codes t{t} kt{kt}")
            sc = sm.read(S_OFF + 2 * (tr[t] * SROW + slot), 2, T('S', kt), f"scale t{t} kt{kt}").view(np.uint16)[0]
            bi = sm.read(B_OFF + 2 * (tr[t] * SROW + slot), 2, T('S', kt), f"bias t{t} kt{kt}").view(np.uint16)[0]
            words = raw.view(np.uint32)
            per = 32 // bits
            q = ((words[:, None] >> (np.arange(per, dtype=np.uint32) * bits)) & ((1 << bits) - 1)).reshape(-1)
            w16 = dequant(q, bf16f(sc), bf16f(bi))
            sm.write(2 * (tr[t] * LD + part[t] * LPT * CPU4), w16, T('sW', kt))
        # barrier; the multiply reads the A stage and the W tile
        # (columns 0..63 of each row: ldmatrix never reads the padding)
        sa = np.stack([sm.read(R_OFF + rd + r * LD * 2, 128, T('A', kt), f"A stage row {r} kt{kt}").view(np.float16) for r in range(BM)])
        sw = np.stack([sm.read(r * LD * 2, 128, T('sW', kt), f"W tile row {r} kt{kt}").view(np.float16) for r in range(BN)])
        for r in range(BM):
            m = m0 + r
            want = a[a_rows[m], kt * 64:(kt + 1) * 64] if m < m1 else np.zeros(64, np.float16)
            assert np.array_equal(sa[r, :64], want), f"A row {r} kt {kt}"
        for r in range(BN):
            if not wvalid[2 * r]: continue
            want = mat_of[2 * r].w16(wrow[2 * r], kt)
            assert np.array_equal(sw[r, :64], want), f"W tile row {r} kt {kt}"
        rd = 0 if rd == (S - 1) * STAGE else rd + STAGE
    wait(0)

def main():
    rng = np.random.default_rng(1)
    cases = 0
    # (bits, BM, S): the production depths (gemm.rs TILE_WSTAGES) and the extremes.
    for bits, BM, S in [(4, 16, 4), (4, 32, 5), (4, 64, 5), (4, 128, 3), (8, 16, 4), (8, 32, 5), (4, 16, 2), (4, 16, 9)]:
        for K, splits in [(64, 1), (256, 1), (1536, 1), (1536, 5), (1536, 24), (2048, 3)]:
            nk = K // 64
            per = -(-nk // splits)
            for swiglu in [False, True]:
                n = 200 if not swiglu else 100
                mats = [Mat(rng, n, K, bits), Mat(rng, n, K, bits)]
                for sring_ok in [(True, True), (False, False), (True, False)]:
                    if not swiglu and sring_ok == (True, False): continue
                    for eager in [True, False]:
                        z = rng.integers(0, splits)
                        kt0, kt1 = z * per, min(nk, (z + 1) * per)
                        if kt0 >= kt1: continue
                        M = BM + 5
                        a = rng.uniform(-2, 2, size=(M + 7, K)).astype(np.float16)
                        a_rows = rng.integers(0, M + 7, size=M)
                        m0 = BM if M > BM else 0
                        run_block(bits, BM, S, K, n, mats, kt0, kt1, m0, min(M, m0 + BM), a, a_rows, swiglu, sring_ok, eager)
                        cases += 1
        print(f"bits {bits} BM {BM} S {S}: ok", flush=True)
    print(f"{cases} blocks ok")

if __name__ == "__main__":
    main()
