// pdl_release.cu: how long after a kernel's last useful write does a
// programmatic dependent see it, through griddepcontrol.wait (the primary
// grid's completion and memory flush) against polling a flag the primary
// releases right after that write?
//
// Kernel `primary` (P blocks): each block spins ~work_ns, then arrives on a
// ticket; the last block to arrive stamps %globaltimer (t_write), writes
// `flag` with release semantics and exits. Kernel `dependent` (D blocks,
// launched with programmatic stream serialization, the primary triggering at
// its start): every block either waits in griddepcontrol.wait or polls the
// flag with acquire loads, then block b stamps t_seen[b]. Reported: the
// first, median and last t_seen - t_write over the blocks, per mode, over
// many launches. Build: nvcc -O3 -arch=sm_90a -o pdl_release pdl_release.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void primary(int* ticket, int* flag, unsigned long long* t_write, long long work_ns) {
    asm volatile("griddepcontrol.launch_dependents;");
    const unsigned long long t0 = gtime();
    while ((long long)(gtime() - t0) < work_ns) {}
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) {
        *ticket = 0;
        __threadfence();
        *t_write = gtime();
        asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flag), "r"(1) : "memory");
    }
}

__global__ void dependent(int* flag, unsigned long long* t_seen, int mode) {
    if (mode == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        if (threadIdx.x == 0) {
            unsigned v = 0;
            while (true) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
                if (v) break;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) t_seen[blockIdx.x] = gtime();
}

__global__ void reset(int* flag) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    *flag = 0;
}

int main() {
    const int iters = 200;
    int *ticket, *flag;
    unsigned long long *t_write, *t_seen;
    CK(cudaMalloc(&ticket, 4));
    CK(cudaMalloc(&flag, 4));
    CK(cudaMalloc(&t_write, 8 * iters));
    CK(cudaMalloc(&t_seen, 8 * 1024 * iters));
    CK(cudaMemset(ticket, 0, 4));
    CK(cudaMemset(flag, 0, 4));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    const int shapes[][2] = {{33, 132}, {33, 396}, {1, 132}, {132, 264}};
    for (auto& sh : shapes) {
        const int P = sh[0], D = sh[1];
        for (int mode = 0; mode < 2; ++mode) {
            std::vector<double> first, med, last;
            for (int it = 0; it < iters; ++it) {
                primary<<<P, 256, 0, s>>>(ticket, flag, t_write + it, 5000);
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(D);
                cfg.blockDim = dim3(128);
                cfg.stream = s;
                cfg.attrs = &attr;
                cfg.numAttrs = 1;
                CK(cudaLaunchKernelEx(&cfg, dependent, flag, t_seen + (size_t)it * 1024, mode));
                cfg.gridDim = dim3(1);
                CK(cudaLaunchKernelEx(&cfg, reset, flag));
            }
            CK(cudaStreamSynchronize(s));
            std::vector<unsigned long long> tw(iters), ts((size_t)iters * 1024);
            CK(cudaMemcpy(tw.data(), t_write, 8 * iters, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(ts.data(), t_seen, 8 * 1024 * iters, cudaMemcpyDeviceToHost));
            for (int it = 10; it < iters; ++it) {
                std::vector<double> d;
                for (int b = 0; b < D; ++b) d.push_back((double)(long long)(ts[(size_t)it * 1024 + b] - tw[it]));
                std::sort(d.begin(), d.end());
                first.push_back(d.front());
                med.push_back(d[d.size() / 2]);
                last.push_back(d.back());
            }
            auto m = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
            printf("primary %3d blocks, dependent %3d blocks, %-22s: t_seen - t_write (ns, median over launches): first %7.0f  median %7.0f  last %7.0f\n",
                   P, D, mode == 0 ? "griddepcontrol.wait" : "flag (ld.acquire poll)", m(first), m(med), m(last));
        }
    }
    return 0;
}
