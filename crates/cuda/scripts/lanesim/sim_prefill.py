# Lane-level port of attn_prefill (kernels/attention.cu) on top of warp.py,
# checked against f64 causal attention over a paged cache with NaN past the
# sequence, with chunks starting at p0 > 0; also asserts that the tiles it
# leaves unmasked hold no key past any query of the block.
# Run: python3 sim_prefill.py
import numpy as np, math
from warp import *
from sim_decode import Dims, make_cache, at, KV_BLOCK, AG, PAD

NEG = np.float32(-np.inf)

def sim_prefill(d, q16, kc, vc, table, rowbase, proj, ps, T, p0, sl2, eager):
    HD, KVH, AH = d.HD, d.KVH, d.AH
    LD = HD + PAD; BQ = 16; BN = 64; NF = BN // 8; OF = HD // 8
    ntile = (T + BQ - 1) // BQ
    mix = np.full(T * AH * HD, np.nan, np.float32)
    def tab(i):
        v = table[rowbase + i]; assert v >= 0, "unused table entry read"; return v
    for bx in range(ntile):
        for kvh in range(KVH):
            qt = ntile - 1 - bx; q0 = qt * BQ
            qlast = min(q0 + BQ, T) - 1
            nkeys = p0 + qlast + 1
            kb_last = (nkeys - 1) // KV_BLOCK
            kb_diag = (p0 + q0) // KV_BLOCK
            smem = np.full((AG * BQ + 4 * BN) * LD, np.nan, np.float16)
            sQ = 0; sK = AG * BQ * LD; sV = sK + 2 * BN * LD
            cp = CpAsync(smem, eager)
            for i in range(AG * BQ * (HD // 8)):
                row, c = i // (HD // 8), (i % (HD // 8)) * 8
                hh, r = row // BQ, row % BQ
                tok = q0 + r
                src = (min(tok, T - 1) * AH + kvh * AG + hh) * HD + c
                cp.copy(sQ + row * LD + c, q16[src:src + 8] if tok < T else np.zeros(8))
            cp.commit()
            def load_tile(dst, cache, phys, kb):
                base = (phys * KVH + kvh) * KV_BLOCK * HD
                valid = nkeys - kb * BN
                assert valid >= 1
                for i in range(BN * (HD // 8)):
                    r, c = i // (HD // 8), (i % (HD // 8)) * 8
                    ok = r < valid
                    s = base + (r if ok else 0) * HD + c
                    cp.copy(dst + r * LD + c, cache[s:s + 8] if ok else np.zeros(8))
                cp.commit()
            ph = tab(0)
            load_tile(sK, kc, ph, 0); load_tile(sV, vc, ph, 0)
            ph_next = tab(1) if kb_last >= 1 else 0
            o = [[np.zeros((32, 4), np.float32) for _ in range(OF)] for _ in range(AG)]
            m_r = [[np.full(32, NEG), np.full(32, NEG)] for _ in range(AG)]
            l_r = [[np.zeros(32, np.float32), np.zeros(32, np.float32)] for _ in range(AG)]
            qpos0 = p0 + q0 + G
            for kb in range(kb_last + 1):
                stg = kb & 1
                cK = sK + stg * BN * LD; cV = sV + stg * BN * LD
                cp.wait(0)
                if kb < kb_last:
                    load_tile(sK + (stg ^ 1) * BN * LD, kc, ph_next, kb + 1)
                    load_tile(sV + (stg ^ 1) * BN * LD, vc, ph_next, kb + 1)
                    ph_next = tab(kb + 2) if kb + 2 <= kb_last else 0
                pas = []
                for w in range(AG):
                    s = [np.zeros((32, 4), np.float32) for _ in range(NF)]
                    qaddr = sQ + (w * BQ + (L & 15)) * LD + (L >> 4) * 8
                    for ks in range(HD // 16):
                        a = ldmatrix_x4(smem, qaddr + ks * 16)
                        for nf in range(0, NF, 2):
                            b0, b1, b2, b3 = ldmatrix_x4(smem, cK + (nf * 8 + (L & 7) + (L >> 4) * 8) * LD + ks * 16 + ((L >> 3) & 1) * 8)
                            s[nf] = mma(s[nf], *a, b0, b1); s[nf + 1] = mma(s[nf + 1], *a, b2, b3)
                    if kb >= kb_diag:
                        for nf in range(NF):
                            for e in range(4):
                                kpos = kb * KV_BLOCK + nf * 8 + 2 * C + (e & 1)
                                qpos = qpos0 + (e >> 1) * 8
                                s[nf][:, e] = np.where(kpos > qpos, NEG, s[nf][:, e])
                    else:
                        # no key of this tile may be past any query of the CTA
                        for nf in range(NF):
                            for e in range(4):
                                kpos = kb * KV_BLOCK + nf * 8 + 2 * C + (e & 1)
                                assert np.all(kpos <= qpos0 + (e >> 1) * 8)
                    mx = [np.full(32, NEG), np.full(32, NEG)]
                    for nf in range(NF):
                        mx[0] = np.maximum(mx[0], np.maximum(s[nf][:, 0], s[nf][:, 1]))
                        mx[1] = np.maximum(mx[1], np.maximum(s[nf][:, 2], s[nf][:, 3]))
                    alpha = [None, None]; msc = [None, None]
                    for r in range(2):
                        mx[r] = np.maximum(mx[r], shfl_xor(mx[r], 1)); mx[r] = np.maximum(mx[r], shfl_xor(mx[r], 2))
                        m_new = np.maximum(m_r[w][r], mx[r])
                        assert np.all(np.isfinite(m_new))
                        alpha[r] = np.exp2((m_r[w][r] - m_new) * sl2).astype(np.float32)
                        m_r[w][r] = m_new; msc[r] = (m_new * sl2).astype(np.float32)
                    rs = [np.zeros(32, np.float32), np.zeros(32, np.float32)]
                    pa = []
                    for nf in range(NF):
                        e = [np.exp2(s[nf][:, k] * sl2 - msc[k >> 1]).astype(np.float32) for k in range(4)]
                        for k in range(4): rs[k >> 1] = rs[k >> 1] + e[k]
                        pa.append((pack(e[0], e[1]), pack(e[2], e[3])))
                    for r in range(2):
                        rs[r] = rs[r] + shfl_xor(rs[r], 1); rs[r] = rs[r] + shfl_xor(rs[r], 2)
                        l_r[w][r] = l_r[w][r] * alpha[r] + rs[r]
                    for i in range(OF):
                        o[w][i][:, 0] *= alpha[0]; o[w][i][:, 1] *= alpha[0]
                        o[w][i][:, 2] *= alpha[1]; o[w][i][:, 3] *= alpha[1]
                    pas.append(pa)
                for w in range(AG):
                    pa = pas[w]
                    for ks in range(BN // 16):
                        a0, a1, a2, a3 = pa[2 * ks][0], pa[2 * ks][1], pa[2 * ks + 1][0], pa[2 * ks + 1][1]
                        for df in range(0, OF, 2):
                            b0, b1, b2, b3 = ldmatrix_x4(smem, cV + (ks * 16 + (L & 7) + ((L >> 3) & 1) * 8) * LD + df * 8 + (L >> 4) * 8, trans=True)
                            o[w][df] = mma(o[w][df], a0, a1, a2, a3, b0, b1)
                            o[w][df + 1] = mma(o[w][df + 1], a0, a1, a2, a3, b2, b3)
            cp.wait(0)
            for w in range(AG):
                h = kvh * AG + w
                for r in range(2):
                    for lane in range(32):
                        row = q0 + lane // 4 + 8 * r
                        if row >= T: continue
                        inv = 1 / l_r[w][r][lane]
                        for df in range(OF):
                            dd = df * 8 + 2 * (lane % 4)
                            for e in range(2):
                                gate = proj[row * ps + h * 2 * HD + HD + dd + e]
                                mix[row * AH * HD + h * HD + dd + e] = o[w][df][lane, 2 * r + e] * inv / (1 + np.exp(-gate))
    return mix

def run(HD, KVH, p0, T, eager, seed=3):
    d = Dims(HD, KVH)
    rng = np.random.default_rng(seed)
    kc, vc, table, bt_stride = make_cache(d, [p0 + T + 70, p0 + T], rng)
    q16 = rng.uniform(-1, 1, T * d.AH * HD).astype(np.float16)
    ps = 2 * d.AH * HD + 2 * KVH * HD
    proj = rng.uniform(-2, 2, T * ps).astype(np.float32)
    sl2 = np.float32(1 / math.sqrt(HD) * math.log2(math.e))
    mix = sim_prefill(d, q16, kc, vc, table, bt_stride, proj, ps, T, p0, sl2, eager)
    want = np.zeros(T * d.AH * HD)
    for i in range(T):
        for h in range(d.AH):
            g = h // AG
            K = np.stack([at(d, kc, table, bt_stride, 1, p, g) for p in range(p0 + i + 1)])
            V = np.stack([at(d, vc, table, bt_stride, 1, p, g) for p in range(p0 + i + 1)])
            qh = q16[(i * d.AH + h) * HD:(i * d.AH + h + 1) * HD].astype(np.float64)
            s = K @ qh / math.sqrt(HD); w = np.exp(s - s.max()); w /= w.sum()
            gate = proj[i * ps + h * 2 * HD + HD:i * ps + h * 2 * HD + 2 * HD].astype(np.float64)
            want[(i * d.AH + h) * HD:(i * d.AH + h + 1) * HD] = (w @ V) / (1 + np.exp(-gate))
    err = np.sqrt(((mix - want) ** 2).sum() / (want ** 2).sum())
    print(f"prefill HD {HD} KVH {KVH} p0 {p0} T {T} eager {eager}: rel err {err:.2e}")
    assert err < 2e-3, err

if __name__ == "__main__":
    import sys
    for (p0, T, eager) in [(0, 1, False), (0, 17, True), (0, 70, False), (100, 77, True), (64, 20, False), (130, 33, False)]:
        run(64, 1, p0, T, eager)
    run(256, 2, 50, 20, False)
