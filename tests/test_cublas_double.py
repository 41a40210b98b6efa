"""The libcublas TEST DOUBLE (doubles/libcublas_double.c, a CPU stand-in
with cuBLAS's soname; NOT cuBLAS): its SGEMM is cuBLAS's column-major
C = alpha op(A) op(B) + beta C, its errors are cuBLAS's statuses, and the
service's binding (pyctl/service/double.py: CublasDouble) turns a failed
status into a CudaCallError named by cublasGetStatusName."""

from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from pyctl import paths
from pyctl.service.double import CublasDouble, CudaCallError

pytestmark = pytest.mark.skipif(
    not paths.DOUBLE_LIBCUBLAS.exists(), reason="run `make build` (the libcublas test double)"
)


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@pytest.mark.parametrize(("ta", "tb"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_sgemm_is_column_major_with_transposes(ta: int, tb: int) -> None:
    rng = np.random.default_rng(ta * 2 + tb)
    m, n, k = 5, 3, 4
    # Column-major storage: the Fortran-ordered arrays' memory is what cuBLAS reads.
    a = np.asfortranarray(rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32))
    b = np.asfortranarray(rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32))
    c = np.asfortranarray(rng.standard_normal((m, n)).astype(np.float32))
    want = 2.0 * ((a.T if ta else a) @ (b.T if tb else b)) + 0.5 * c
    blas = CublasDouble()
    try:
        alpha, beta = C.c_float(2.0), C.c_float(0.5)
        st = blas.lib.cublasSgemm_v2(blas.handle, ta, tb, m, n, k, C.byref(alpha), _addr(a),
                                     a.shape[0], _addr(b), b.shape[0], C.byref(beta), _addr(c),
                                     m)  # fmt: skip
    finally:
        blas.close()
    assert st == 0
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


def test_the_services_token_gemm_runs_on_its_buffer() -> None:
    buf = np.zeros(3 * 64, dtype=np.float32)
    buf[:64] = np.eye(8, dtype=np.float32).ravel()  # A = I
    buf[64:128] = np.arange(64, dtype=np.float32)  # B
    blas = CublasDouble()
    try:
        blas.sgemm(_addr(buf))
    finally:
        blas.close()
    np.testing.assert_array_equal(buf[128:], buf[64:128])  # C = I @ B


def test_statuses_are_cublas_names() -> None:
    blas = CublasDouble()
    try:
        one = C.c_float(1.0)
        bad = blas.lib.cublasSgemm_v2(blas.handle, 0, 0, -1, 1, 1, C.byref(one), 0, 1, 0, 1,
                                      C.byref(one), 0, 1)  # fmt: skip
        assert bad == 7  # CUBLAS_STATUS_INVALID_VALUE
        with pytest.raises(CudaCallError) as ei:
            blas._ck("cublasSgemm_v2", 13)
        assert ei.value.name == "CUBLAS_STATUS_EXECUTION_FAILED" and ei.value.code == 13
        assert blas.lib.cublasSgemm_v2(None, 0, 0, 1, 1, 1, C.byref(one), 0, 1, 0, 1,
                                       C.byref(one), 0, 1) == 1  # fmt: skip
    finally:
        blas.close()
    assert blas.lib.cublasDestroy_v2(None) == 1  # NOT_INITIALIZED, not a crash
