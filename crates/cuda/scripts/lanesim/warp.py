# Lane-level semantics of the warp instructions the attention kernels use
# (ldmatrix .x4 with and without .trans, mma.sync m16n8k16 f16 -> f32,
# shuffles, cp.async commit groups), with the 32 lanes as numpy arrays.
#
# Used by sim_decode.py and sim_prefill.py, line-by-line Python ports of
# attn_decode / attn_combine / attn_prefill (kernels/attention.cu), and by
# sim_qmm.py (qmm.cu's group math, hi/lo and F16 columns), to check
# fragment layouts, index math, masking and pipeline-stage reuse on a machine
# without a GPU (python3 + numpy; not part of CI). The fragment layouts are
# those of the PTX ISA; the prefill port shares its Q/K/V fragment code with
# the kernel version measured on the H200, which pins these definitions to
# the hardware. Keep a port in step with its kernel when either changes.
import numpy as np
L = np.arange(32)
G, C = L // 4, L % 4

def f16(x):
    return np.clip(np.asarray(x, np.float32), -65504, 65504).astype(np.float16)

def pack(lo, hi):  # -> (32,2) f16, element 0 = low half
    return np.stack([f16(lo), f16(hi)], axis=1)

def lo(r): return r[:, 0].astype(np.float32)
def hi(r): return r[:, 1].astype(np.float32)

def ldmatrix_x4(smem, addr, trans=False):
    addr = np.asarray(addr)
    assert addr.shape == (32,)
    assert np.all(addr % 8 == 0) and np.all(addr >= 0) and np.all(addr + 8 <= smem.size), addr
    rows = smem[addr[:, None] + np.arange(8)[None, :]]   # (32, 8)
    out = []
    for i in range(4):
        M = rows[8 * i:8 * i + 8]
        if not trans:
            reg = np.stack([M[G, 2 * C], M[G, 2 * C + 1]], axis=1)
        else:
            reg = np.stack([M[2 * C, G], M[2 * C + 1, G]], axis=1)
        out.append(reg.astype(np.float16))
    return out

def mma(d, a0, a1, a2, a3, b0, b1):
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    for e in range(2):
        A[G, 2 * C + e] = a0[:, e]; A[G + 8, 2 * C + e] = a1[:, e]
        A[G, 2 * C + 8 + e] = a2[:, e]; A[G + 8, 2 * C + 8 + e] = a3[:, e]
        B[2 * C + e, G] = b0[:, e]; B[2 * C + 8 + e, G] = b1[:, e]
    Cm = A @ B
    out = d.astype(np.float64).copy()
    out[:, 0] += Cm[G, 2 * C]; out[:, 1] += Cm[G, 2 * C + 1]
    out[:, 2] += Cm[G + 8, 2 * C]; out[:, 3] += Cm[G + 8, 2 * C + 1]
    return out.astype(np.float32)

def shfl(v, src): return np.asarray(v)[np.asarray(src) % 32]
def shfl_xor(v, m): return np.asarray(v)[L ^ m]

class CpAsync:
    """cp.async groups of one warp (or one CTA). eager: copies land at issue
    (exposes write-after-read hazards); lazy: at the wait that guarantees them
    (exposes read-before-arrival)."""
    def __init__(self, smem, eager):
        self.smem, self.eager, self.cur, self.groups = smem, eager, [], []
    def copy(self, dst, values):
        assert dst % 8 == 0 and dst + 8 <= self.smem.size
        if self.eager: self.smem[dst:dst + 8] = values
        else: self.cur.append((dst, np.array(values, np.float16)))
    def action(self, fn):
        """Any other async copy (e.g. into a lane-private slot): runs when it lands."""
        if self.eager: fn()
        else: self.cur.append(fn)
    def commit(self):
        self.groups.append(self.cur); self.cur = []
    def wait(self, n):
        while len(self.groups) > n:
            for item in self.groups.pop(0):
                if callable(item): item()
                else:
                    dst, v = item
                    self.smem[dst:dst + 8] = v
