"""A WMMA GEMM (16x16x16, half inputs, float accumulator) that flips
accumulator bits after mma_sync, and its reference (fault class 4, kernel
variant).

The kernel runs only on an NVIDIA GPU with cupy (pyctl/hooks/gpu_check.py does
that); this module imports without cupy so its reference and helpers can be
tested anywhere.

Which accumulator element sits in which lane is opaque in WMMA, so the
kernel also stores a second accumulator-shaped fragment of flags (1.0 where
it flipped) with the same store_matrix_sync: that flag matrix tells the
reference exactly which C elements were flipped.

Two back ends compute the same thing:

- `wmma`: the C++ WMMA API (`<mma.h>`, 16x16x16 tiles). NVRTC needs the
  toolkit's `crt/mma.h`, which the CUDA 13 pip wheels do not ship (seen on
  the H200 machine); `find_mma_include()` looks for it and `run()` passes it
  as `-I`.
- `ptx`: the same Tensor Core instruction written as inline PTX
  (`mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`, what mma_sync
  compiles to on sm_80+), with the fragment layout of the PTX ISA. It needs
  no header at all, so it runs wherever NVRTC does. Half data travel as raw
  16-bit patterns, so not even cuda_fp16.h is needed.

`run(..., backend="auto")` takes `wmma` when the header is found, else `ptx`.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyctl.exceptions import GpufaultError

KERNEL_NAME = "gf_wmma_flip"

KERNEL_SRC = r"""
#include <mma.h>
using namespace nvcuda;

__device__ __forceinline__ unsigned long long gf_mix(unsigned long long x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/*
 * C[M,N] = A[M,K] (row major, half) x B[K,N] (row major, half), float acc.
 * One warp per 16x16 tile: grid (M/16, N/16), block 32. After the last
 * mma_sync, each accumulator element is XORed with `mask` when
 * hash(seed, tile, lane, i) < threshold (threshold = rate * 2^32, 2^32 =
 * always). F gets 1.0 where a flip happened.
 */
extern "C" __global__ void gf_wmma_flip(const half *A, const half *B, float *C, float *F,
                                        int M, int N, int K, unsigned int mask,
                                        unsigned long long threshold, unsigned long long seed,
                                        unsigned long long *flips)
{
    int tm = blockIdx.x, tn = blockIdx.y, lane = threadIdx.x;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc, flag;

    wmma::fill_fragment(acc, 0.0f);
    wmma::fill_fragment(flag, 0.0f);
    for (int k = 0; k < K; k += 16) {
        wmma::load_matrix_sync(a, A + (size_t)tm * 16 * K + k, K);
        wmma::load_matrix_sync(b, B + (size_t)k * N + tn * 16, N);
        wmma::mma_sync(acc, a, b, acc);
    }
    unsigned long long tile = (unsigned long long)tm * gridDim.y + tn;
    unsigned long long mine = 0;
    for (int i = 0; i < acc.num_elements; i++) {
        unsigned long long h = gf_mix(seed ^ (tile << 24) ^ ((unsigned long long)lane << 8) ^ i);
        if ((h & 0xffffffffULL) < threshold) {
            acc.x[i] = __uint_as_float(__float_as_uint(acc.x[i]) ^ mask);
            flag.x[i] = 1.0f;
            mine++;
        }
    }
    if (mine)
        atomicAdd(flips, mine);
    wmma::store_matrix_sync(C + (size_t)tm * 16 * N + tn * 16, acc, N, wmma::mem_row_major);
    wmma::store_matrix_sync(F + (size_t)tm * 16 * N + tn * 16, flag, N, wmma::mem_row_major);
}
"""


PTX_KERNEL_NAME = "gf_mma_flip"

# One warp per 16x8 output tile; grid (M/16, N/8), block 32. Fragment
# layout (PTX ISA, "mma.m16n8k16" for .f16 A/B and .f32 C/D), with
# g = lane / 4 and t = lane % 4:
#   A (16x16, row): a0 = A[g][2t,2t+1], a1 = A[g+8][2t,2t+1],
#                   a2 = A[g][2t+8,2t+9], a3 = A[g+8][2t+8,2t+9]
#   B (16x8, col):  b0 = B[2t,2t+1][g], b1 = B[2t+8,2t+9][g]
#   C (16x8, f32):  c0,c1 = C[g][2t,2t+1], c2,c3 = C[g+8][2t,2t+1]
# Each 32-bit register holds two halves, the lower index in the low bits.
PTX_KERNEL_SRC = r"""
__device__ __forceinline__ unsigned long long gf_mix(unsigned long long x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

__device__ __forceinline__ unsigned int gf_pack(unsigned short lo, unsigned short hi)
{
    return (unsigned int)lo | ((unsigned int)hi << 16);
}

extern "C" __global__ void gf_mma_flip(const unsigned short *A, const unsigned short *B,
                                       float *C, float *F, int M, int N, int K,
                                       unsigned int mask, unsigned long long threshold,
                                       unsigned long long seed, unsigned long long *flips)
{
    int tm = blockIdx.x, tn = blockIdx.y, lane = threadIdx.x;
    int g = lane >> 2, t = lane & 3;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float flag[4] = {0.0f, 0.0f, 0.0f, 0.0f};

    for (int k = 0; k < K; k += 16) {
        const unsigned short *a = A + (size_t)tm * 16 * K + k;
        const unsigned short *b = B + (size_t)k * N + tn * 8;
        unsigned int a0 = gf_pack(a[g * K + 2 * t], a[g * K + 2 * t + 1]);
        unsigned int a1 = gf_pack(a[(g + 8) * K + 2 * t], a[(g + 8) * K + 2 * t + 1]);
        unsigned int a2 = gf_pack(a[g * K + 2 * t + 8], a[g * K + 2 * t + 9]);
        unsigned int a3 = gf_pack(a[(g + 8) * K + 2 * t + 8], a[(g + 8) * K + 2 * t + 9]);
        unsigned int b0 = gf_pack(b[(2 * t) * N + g], b[(2 * t + 1) * N + g]);
        unsigned int b1 = gf_pack(b[(2 * t + 8) * N + g], b[(2 * t + 9) * N + g]);
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    unsigned long long tile = (unsigned long long)tm * gridDim.y + tn;
    unsigned long long mine = 0;
    for (int i = 0; i < 4; i++) {
        unsigned long long h = gf_mix(seed ^ (tile << 24) ^ ((unsigned long long)lane << 8) ^ i);
        if ((h & 0xffffffffULL) < threshold) {
            acc[i] = __uint_as_float(__float_as_uint(acc[i]) ^ mask);
            flag[i] = 1.0f;
            mine++;
        }
    }
    if (mine)
        atomicAdd(flips, mine);
    for (int i = 0; i < 4; i++) {
        size_t row = (size_t)tm * 16 + g + (i >= 2 ? 8 : 0);
        size_t col = (size_t)tn * 8 + 2 * t + (i & 1);
        C[row * N + col] = acc[i];
        F[row * N + col] = flag[i];
    }
}
"""


def ptx_c_positions(lane: int) -> list[tuple[int, int]]:
    """(row, col) inside a 16x8 tile of the C registers of one lane (the
    layout the PTX kernel stores with; tests check it covers the tile)."""
    g, t = lane >> 2, lane & 3
    return [(g + (8 if i >= 2 else 0), 2 * t + (i & 1)) for i in range(4)]


def mma_include_candidates() -> list[str]:
    """Where a toolkit's include directory may be: $GF_CUDA_INCLUDE, $CUDA_PATH/$CUDA_HOME,
    the NVIDIA wheels and Triton's bundle on sys.path, /usr/local/cuda."""
    cands = [os.environ.get("GF_CUDA_INCLUDE", "")]  # just the crt headers, say
    roots = [os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", "")]
    cands = [c for c in cands if c] + [os.path.join(r, "include") for r in roots if r]
    for sp in sys.path:
        cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "include")))
        cands += glob.glob(os.path.join(sp, "triton", "backends", "nvidia", "include"))
    return cands + ["/usr/local/cuda/include"]


def find_mma_include(candidates: list[str] | None = None) -> str | None:
    """The first directory holding crt/mma.h (what <mma.h> includes), or None."""
    for c in mma_include_candidates() if candidates is None else candidates:
        if (Path(c) / "crt" / "mma.h").is_file():
            return c
    return None


class WmmaError(RuntimeError, GpufaultError):
    """One line that says what to do."""


def threshold(rate: float) -> int:
    """rate in [0, 1] as the kernel's 32-bit threshold (2^32 = always)."""
    if not 0.0 <= rate <= 1.0:
        raise WmmaError(f"rate {rate} is not a probability: use 0..1")
    return min(1 << 32, round(rate * (1 << 32)))


def check_shapes(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int]:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise WmmaError(f"shapes {a.shape} x {b.shape} do not multiply: need [M,K] x [K,N]")
    m, k = a.shape
    n = b.shape[1]
    if m % 16 or n % 16 or k % 16:
        raise WmmaError(f"M, N, K = {m}, {n}, {k} must be multiples of 16 (WMMA tile)")
    return m, n, k


def flip_f32(x: np.ndarray, mask: int) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) ^ np.uint32(mask)).view(np.float32)


def reference(a: np.ndarray, b: np.ndarray, flags: np.ndarray, mask: int) -> np.ndarray:
    """What the kernel must return: fp32 A@B with `mask` XORed where flags is set."""
    exact = a.astype(np.float32) @ b.astype(np.float32)
    return np.where(flags != 0, flip_f32(exact, mask), exact)


def unflip(c: np.ndarray, flags: np.ndarray, mask: int) -> np.ndarray:
    """Undo the kernel's flips (XOR is its own inverse) to compare with A@B."""
    return np.where(flags != 0, flip_f32(c, mask), c)


@dataclass
class WmmaResult:
    c: np.ndarray
    flags: np.ndarray
    flips: int
    backend: str = "wmma"


def run(a: np.ndarray, b: np.ndarray, mask: int, rate: float, seed: int,
        backend: str = "auto") -> WmmaResult:
    """Run the kernel with cupy on the current GPU (half inputs)."""
    try:
        # lazy: cupy is optional (the gpu extra), needed only on a GPU host
        import cupy as cp
    except ImportError:
        raise WmmaError("cupy is not installed: pip install cupy-cuda12x (needs a GPU)") from None
    m, n, k = check_shapes(a, b)
    inc = find_mma_include()
    if backend == "auto":
        backend = "wmma" if inc else "ptx"
    if backend == "wmma":
        if inc is None:
            raise WmmaError("crt/mma.h not found (the CUDA pip wheels lack it): set CUDA_PATH"
                            " to a toolkit, or use backend='ptx'")
        kern: Any = cp.RawKernel(KERNEL_SRC, KERNEL_NAME, options=("-std=c++17", f"-I{inc}"))
        grid, dt = (m // 16, n // 16), np.float16
    elif backend == "ptx":
        kern = cp.RawKernel(PTX_KERNEL_SRC, PTX_KERNEL_NAME, options=("-std=c++17",))
        grid, dt = (m // 16, n // 8), np.float16
    else:
        raise WmmaError(f"backend {backend!r} unknown: use auto, wmma or ptx")
    da = cp.asarray(a.astype(dt))
    db = cp.asarray(b.astype(dt))
    if backend == "ptx":  # raw 16-bit patterns: the kernel needs no fp16 header
        da, db = da.view(cp.uint16), db.view(cp.uint16)
    dc = cp.zeros((m, n), dtype=cp.float32)
    df = cp.zeros((m, n), dtype=cp.float32)
    dflips = cp.zeros(1, dtype=cp.uint64)
    kern(
        grid,
        (32,),
        (
            da,
            db,
            dc,
            df,
            np.int32(m),
            np.int32(n),
            np.int32(k),
            np.uint32(mask),
            np.uint64(threshold(rate)),
            np.uint64(seed),
            dflips,
        ),
    )
    cp.cuda.Device().synchronize()
    return WmmaResult(cp.asnumpy(dc), cp.asnumpy(df), int(dflips.get()[0]), backend)
