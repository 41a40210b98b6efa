"""A WMMA GEMM (16x16x16, half inputs, float accumulator) that flips
accumulator bits after mma_sync, and its reference (fault class 4, kernel
variant).

The kernel runs only on an NVIDIA GPU with cupy (hooks/gpu_check.py does
that); this module imports without cupy so its reference and helpers can be
tested anywhere.

Which accumulator element sits in which lane is opaque in WMMA, so the
kernel also stores a second accumulator-shaped fragment of flags (1.0 where
it flipped) with the same store_matrix_sync: that flag matrix tells the
reference exactly which C elements were flipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

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


class WmmaError(RuntimeError):
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


def run(a: np.ndarray, b: np.ndarray, mask: int, rate: float, seed: int) -> WmmaResult:
    """Run the kernel with cupy on the current GPU (half inputs)."""
    try:
        import cupy as cp
    except ImportError:
        raise WmmaError("cupy is not installed: pip install cupy-cuda12x (needs a GPU)") from None
    m, n, k = check_shapes(a, b)
    kern: Any = cp.RawKernel(KERNEL_SRC, KERNEL_NAME, options=("-std=c++17",))
    da = cp.asarray(a.astype(np.float16))
    db = cp.asarray(b.astype(np.float16))
    dc = cp.zeros((m, n), dtype=cp.float32)
    df = cp.zeros((m, n), dtype=cp.float32)
    dflips = cp.zeros(1, dtype=cp.uint64)
    kern(
        (m // 16, n // 16),
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
    return WmmaResult(cp.asnumpy(dc), cp.asnumpy(df), int(dflips.get()[0]))
