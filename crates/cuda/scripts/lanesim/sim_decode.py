# Lane-level port of attn_decode + attn_combine (kernels/attention.cu) on top
# of warp.py, checked against f64 attention over a paged cache with NaN past
# every context and -1 in unused table entries; cp.async copies land either
# at issue (catches a stage overwritten before it is read) or at the wait
# that guarantees them (catches a stage read before it lands). Also checks
# that every (token, split, KV head) item is computed exactly once.
# Run: python3 sim_decode.py (tiny shapes take seconds, HD 256 a minute).
import numpy as np, math, sys
from warp import *

KV_BLOCK, AG, PAD, W, S, KEYS, SMALL = 64, 8, 8, 2, 6, 16, 16
NEG = np.float32(-np.inf)

def decode_per(nblk, ms): return max(2 if nblk > SMALL else 1, (nblk + ms - 1) // ms)
def decode_splits(len_, ms):
    nblk = (len_ + KV_BLOCK - 1) // KV_BLOCK
    per = decode_per(nblk, ms)
    return (nblk + per - 1) // per

class Dims:
    def __init__(s, HD, KVH): s.HD, s.KVH, s.AH = HD, KVH, 8 * KVH

def dec_item(it, s_first, s_len, ntok, ms, d):
    lo_, hi_ = 0, ntok
    while hi_ - lo_ > 1:
        mid = (lo_ + hi_) >> 1
        if s_first[mid] <= it: lo_ = mid
        else: hi_ = mid
    r = it - s_first[lo_]
    split, g = r // d.KVH, r % d.KVH
    ln = s_len[lo_]
    nblk = (ln + KV_BLOCK - 1) // KV_BLOCK
    per = decode_per(nblk, ms)
    b0 = split * per
    j = b0 * (KV_BLOCK // KEYS)
    j_end = min((ln + KEYS - 1) // KEYS, (b0 + per) * (KV_BLOCK // KEYS))
    assert j < j_end
    return dict(t=lo_, g=g, split=split, j=j, j_end=j_end, len=ln)

def table_chunk(table, rowbase, b0, ln):
    nblk = (ln + KV_BLOCK - 1) // KV_BLOCK
    return np.array([table[rowbase + b0 + l] if b0 + l < nblk else 0 for l in range(32)])

def sim_decode(d, q, kc, vc, table, bt_stride, pos, slot, ms, nsm, scale, eager):
    HD, KVH, AH = d.HD, d.KVH, d.AH
    LD = HD + PAD; TILE = KEYS * LD; TPB = KV_BLOCK // KEYS; KS = HD // 16; CP = KEYS * (HD // 8) // 32
    ntok = len(pos)
    grid = max(1, min(nsm, -(-ntok * ms * KVH // W)))
    part_o = np.full(ntok * AH * ms * HD, np.nan, np.float32)
    part_ml = np.full(ntok * AH * ms * 2, np.nan, np.float32)
    s_len = [p + 1 for p in pos]; s_slot = list(slot)
    s_first = [0]
    for t in range(ntok): s_first.append(s_first[-1] + decode_splits(s_len[t], ms) * KVH)
    total = s_first[ntok]
    nw = grid * W
    done = set()
    for cta in range(grid):
        for warp in range(W):
            first = warp * grid + cta
            if first >= total: continue
            smem = np.full(S * 2 * TILE, np.nan, np.float16)
            cp = CpAsync(smem, eager)
            st_ = dict(item=first, ld=dec_item(first, s_first, s_len, ntok, ms, d))
            st_['row'] = s_slot[st_['ld']['t']] * bt_stride
            st_['b0'] = st_['ld']['j'] // TPB
            st_['tab'] = table_chunk(table, st_['row'], st_['b0'], st_['ld']['len'])
            def issue(stage):
                if st_['item'] < total:
                    ld = st_['ld']
                    b = ld['j'] // TPB
                    if b - st_['b0'] >= 32:
                        st_['b0'] = b; st_['tab'] = table_chunk(table, st_['row'], b, ld['len'])
                    phys = int(shfl(st_['tab'], np.full(32, b - st_['b0']))[0])
                    assert phys >= 0, "read an unused table entry"
                    row0 = ((phys * KVH + ld['g']) * KV_BLOCK + (ld['j'] - b * TPB) * KEYS) * HD
                    valid = ld['len'] - ld['j'] * KEYS
                    dk = stage * 2 * TILE; dv = dk + TILE
                    for it in range(CP):
                        for lane in range(32):
                            i = it * 32 + lane
                            r, c = i // (HD // 8), (i % (HD // 8)) * 8
                            ok = r < valid
                            src = row0 + (r if ok else 0) * HD + c
                            cp.copy(dk + r * LD + c, kc[src:src + 8] if ok else np.zeros(8))
                            cp.copy(dv + r * LD + c, vc[src:src + 8] if ok else np.zeros(8))
                    ld['j'] += 1
                    if ld['j'] == ld['j_end']:
                        st_['item'] += nw
                        if st_['item'] < total:
                            st_['ld'] = dec_item(st_['item'], s_first, s_len, ntok, ms, d)
                            st_['row'] = s_slot[st_['ld']['t']] * bt_stride
                            st_['b0'] = st_['ld']['j'] // TPB
                            st_['tab'] = table_chunk(table, st_['row'], st_['b0'], st_['ld']['len'])
                cp.commit()
            cs_item = first
            cs = dec_item(first, s_first, s_len, ntok, ms, d)
            # first item's raw queries travel with tile 0 (8-byte cp.async into sq)
            sq_raw = np.full((KS, 32, 4), np.nan, np.float32)
            base0 = (cs['t'] * AH + cs['g'] * AG + G) * HD + 2 * C
            for ks in range(KS):
                def land(ks=ks):
                    b = base0 + ks * 16
                    sq_raw[ks] = np.stack([q[b], q[b + 1], q[b + 8], q[b + 9]], axis=1)
                cp.action(land)
            for s_ in range(S - 1): issue(s_)
            fresh = True; stg = 0
            while True:
                cp.wait(S - 2)
                issue(S - 1 if stg == 0 else stg - 1)
                if fresh:
                    qa = []
                    for ks in range(KS):
                        if cs_item == first:
                            x = sq_raw[ks]
                            assert not np.isnan(x).any(), "queries read before they landed"
                            x0, x1, y0, y1 = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
                        else:
                            base = (cs['t'] * AH + cs['g'] * AG + G) * HD + 2 * C + ks * 16
                            x0, x1 = q[base], q[base + 1]; y0, y1 = q[base + 8], q[base + 9]
                        hx = pack(x0, x1); lx = pack(x0 - lo(hx), x1 - hi(hx))
                        hy = pack(y0, y1); ly = pack(y0 - lo(hy), y1 - hi(hy))
                        qa.append((hx, lx, hy, ly))
                    acc = [np.zeros((32, 4), np.float32) for _ in range(KS)]
                    m_i = np.full(32, NEG); l_i = np.zeros(32, np.float32)
                    fresh = False
                sk = stg * 2 * TILE; sv = sk + TILE
                stg = 0 if stg + 1 == S else stg + 1
                sa = [[np.zeros((32, 4), np.float32) for _ in range(2)] for _ in range(2)]
                kaddr = sk + ((L & 7) + ((L >> 4) << 3)) * LD + ((L >> 3) & 1) * 8
                for ks in range(KS):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, kaddr + ks * 16)
                    sa[ks & 1][0] = mma(sa[ks & 1][0], *qa[ks], b0, b1)
                    sa[ks & 1][1] = mma(sa[ks & 1][1], *qa[ks], b2, b3)
                key0 = cs['j'] * KEYS
                sc = [None] * 4
                for nf in range(2):
                    for e in range(2):
                        v = (sa[0][nf][:, e] + sa[0][nf][:, e + 2]) + (sa[1][nf][:, e] + sa[1][nf][:, e + 2])
                        key = key0 + nf * 8 + 2 * C + e
                        sc[nf * 2 + e] = np.where(key < cs['len'], v * scale, NEG).astype(np.float32)
                mx = np.maximum(np.maximum(sc[0], sc[1]), np.maximum(sc[2], sc[3]))
                mx = np.maximum(mx, shfl_xor(mx, 1)); mx = np.maximum(mx, shfl_xor(mx, 2))
                m_new = np.maximum(m_i, mx)
                assert np.all(np.isfinite(m_new))
                alpha = np.exp2(m_i - m_new).astype(np.float32)
                pr = [np.exp2(sc[e] - m_new).astype(np.float32) for e in range(4)]
                rs = pr[0] + pr[1] + pr[2] + pr[3]
                rs = rs + shfl_xor(rs, 1); rs = rs + shfl_xor(rs, 2)
                l_i = l_i * alpha + rs; m_i = m_new
                ph0 = pack(pr[0], pr[1]); pl0 = pack(pr[0] - lo(ph0), pr[1] - hi(ph0))
                ph1 = pack(pr[2], pr[3]); pl1 = pack(pr[2] - lo(ph1), pr[3] - hi(ph1))
                al0 = shfl(alpha, C * 8); al1 = shfl(alpha, C * 8 + 4)
                vaddr = sv + ((L & 7) + ((L >> 4) << 3)) * LD + ((L >> 3) & 1) * 8
                for mt in range(KS):
                    acc[mt][:, 0] *= al0; acc[mt][:, 1] *= al1; acc[mt][:, 2] *= al0; acc[mt][:, 3] *= al1
                    a0, a1, a2, a3 = ldmatrix_x4(smem, vaddr + mt * 16, trans=True)
                    acc[mt] = mma(acc[mt], a0, a1, a2, a3, ph0, ph1)
                    acc[mt] = mma(acc[mt], a0, a1, a2, a3, pl0, pl1)
                cs['j'] += 1
                if cs['j'] == cs['j_end']:
                    key = (cs['t'], cs['g'], cs['split'])
                    assert key not in done; done.add(key)
                    hs = ms * HD
                    po = ((cs['t'] * AH + cs['g'] * AG) * ms + cs['split']) * HD
                    for mt in range(KS):
                        dd = mt * 16 + G
                        part_o[po + (2 * C) * hs + dd] = acc[mt][:, 0]
                        part_o[po + (2 * C + 1) * hs + dd] = acc[mt][:, 1]
                        part_o[po + (2 * C) * hs + dd + 8] = acc[mt][:, 2]
                        part_o[po + (2 * C + 1) * hs + dd + 8] = acc[mt][:, 3]
                    for lane in range(32):
                        if lane % 4 == 0:
                            ml = ((cs['t'] * AH + cs['g'] * AG + lane // 4) * ms + cs['split']) * 2
                            part_ml[ml] = m_i[lane]; part_ml[ml + 1] = l_i[lane]
                    cs_item += nw
                    if cs_item >= total: break
                    cs = dec_item(cs_item, s_first, s_len, ntok, ms, d)
                    fresh = True
            cp.wait(0)
            assert st_['item'] >= total
    want_items = {(t, g, s) for t in range(ntok) for g in range(KVH) for s in range(decode_splits(s_len[t], ms))}
    assert done == want_items, (len(done), len(want_items))
    return part_o, part_ml

def sim_combine(d, part_o, part_ml, proj, proj_stride, pos, ms):
    HD, AH = d.HD, d.AH
    ntok = len(pos)
    mix = np.full(ntok * AH * HD, np.nan, np.float32)
    for t in range(ntok):
        for h in range(AH):
            ns = decode_splits(pos[t] + 1, ms)
            mlb = (t * AH + h) * ms * 2
            M = max(part_ml[mlb + 2 * s] for s in range(ns))
            Lsum = sum(np.exp2(part_ml[mlb + 2 * s] - M) * part_ml[mlb + 2 * s + 1] for s in range(ns))
            for chunk in range(HD // 32):
                red = np.zeros((32, 8, 4), np.float32)
                for tid in range(256):
                    quad, sl = tid % 8, tid // 8
                    pob = (t * AH + h) * ms * HD + chunk * 32 + quad * 4
                    o = np.zeros(4, np.float32)
                    for s in range(sl, ns, 32):
                        w = np.exp2(part_ml[mlb + 2 * s] - M)
                        o += w * part_o[pob + s * HD:pob + s * HD + 4]
                    red[sl, quad] = o
                r = red.reshape(-1)
                for tid in range(32):
                    ssum = sum(r[s * 32 + tid] for s in range(32))
                    dd = chunk * 32 + tid
                    gate = proj[t * proj_stride + h * 2 * HD + HD + dd]
                    mix[t * AH * HD + h * HD + dd] = ssum / Lsum / (1 + np.exp(-gate))
    return mix

def make_cache(d, lens, rng):
    blocks = [max(1, -(-l // KV_BLOCK)) for l in lens]
    nblk = sum(blocks) + 2
    bt_stride = max(blocks) + 1
    perm = rng.permutation(nblk)
    row = KV_BLOCK * d.HD; per = d.KVH * row
    kc = np.full(nblk * per, np.nan, np.float16); vc = np.full(nblk * per, np.nan, np.float16)
    table = np.full(len(lens) * bt_stride, -1, np.int64)
    nxt = 0
    for s, (ln, nb) in enumerate(zip(lens, blocks)):
        for b in range(nb):
            phys = perm[nxt]; nxt += 1
            table[s * bt_stride + b] = phys
            keys = min(max(ln - b * KV_BLOCK, 0), KV_BLOCK)
            for g in range(d.KVH):
                base = (phys * d.KVH + g) * row
                kc[base:base + keys * d.HD] = rng.uniform(-1.5, 1.5, keys * d.HD).astype(np.float16)
                vc[base:base + keys * d.HD] = rng.uniform(-2, 2, keys * d.HD).astype(np.float16)
    return kc, vc, table, bt_stride

def at(d, arr, table, bt_stride, slot, p, g):
    blk = table[slot * bt_stride + p // KV_BLOCK]
    off = ((blk * d.KVH + g) * KV_BLOCK + p % KV_BLOCK) * d.HD
    return arr[off:off + d.HD].astype(np.float64)

def reference(d, q, kc, vc, table, bt_stride, pos, slot, proj, ps):
    HD, AH = d.HD, d.AH
    out = np.zeros(len(pos) * AH * HD)
    for t in range(len(pos)):
        for h in range(AH):
            g = h // AG
            qh = q[(t * AH + h) * HD:(t * AH + h + 1) * HD].astype(np.float64)
            K = np.stack([at(d, kc, table, bt_stride, slot[t], p, g) for p in range(pos[t] + 1)])
            V = np.stack([at(d, vc, table, bt_stride, slot[t], p, g) for p in range(pos[t] + 1)])
            s = K @ qh / math.sqrt(HD)
            w = np.exp(s - s.max()); w /= w.sum()
            gate = proj[t * ps + h * 2 * HD + HD: t * ps + h * 2 * HD + 2 * HD].astype(np.float64)
            out[(t * AH + h) * HD:(t * AH + h + 1) * HD] = (w @ V) / (1 + np.exp(-gate))
    return out

def run(HD, KVH, lens, slots, slot_lens, ms, nsm, eager, seed=1):
    d = Dims(HD, KVH)
    rng = np.random.default_rng(seed)
    kc, vc, table, bt_stride = make_cache(d, slot_lens, rng)
    ntok = len(lens)
    q = rng.uniform(-1, 1, ntok * d.AH * HD).astype(np.float32)
    ps = 2 * d.AH * HD + 2 * KVH * HD
    proj = rng.uniform(-2, 2, ntok * ps).astype(np.float32)
    pos = [l - 1 for l in lens]
    scale = np.float32(1 / math.sqrt(HD) * math.log2(math.e))
    po, pml = sim_decode(d, q, kc, vc, table, bt_stride, pos, slots, ms, nsm, scale, eager)
    mix = sim_combine(d, po, pml, proj, ps, pos, ms)
    want = reference(d, q, kc, vc, table, bt_stride, pos, slots, proj, ps)
    err = np.sqrt(((mix - want) ** 2).sum() / (want ** 2).sum())
    print(f"HD {HD} KVH {KVH} lens {lens} ms {ms} nsm {nsm} eager {eager}: rel err {err:.2e}")
    assert err < 2e-5, err

if __name__ == "__main__":
    run(64, 1, [1, 17, 63, 64, 65, 200], list(range(6)), [1, 17, 63, 64, 65, 200], 7, 3, False)
    run(64, 1, [1, 17, 63, 64, 65, 200], list(range(6)), [1, 17, 63, 64, 65, 200], 7, 3, True)
    run(64, 1, [1200, 33, 5], [0, 1, 0], [1200, 40], 1, 2, False)
    run(64, 1, [1200, 33, 5], [0, 1, 0], [1200, 40], 128, 132, True)
    run(64, 1, [3000], [0], [3000], 4, 1, False)   # per = 12 blocks: table chunk reloads? (47 blocks, 1 split of >32)
    run(256, 2, [70, 1, 130], [0, 1, 2], [70, 1, 130], 64, 132, False)
    run(64, 1, [3000, 100], [0, 1], [3000, 100], 1, 1, False)  # 47 blocks in one split: table chunk reload
    rng = np.random.default_rng(5)
    lens = [int(x) for x in rng.integers(1, 300, 40)]  # 40 tokens: two scan chunks
    run(64, 1, lens, [t % 5 for t in range(40)], [300] * 5, 7, 11, False)
