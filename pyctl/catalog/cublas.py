"""cuBLAS (libcublas.so.*) and cuBLASLt (libcublasLt.so.*): functions,
cublasStatus_t, and the enums that gemm arguments carry.

Signatures from cublas_api.h / cublasLt.h (CUDA 12/13). cuBLAS 12 added
ILP64 twins (`cublasSgemm_v2_64`, `cublasGemmEx_64`, ...) whose int sizes
and leading dimensions are int64_t; they get entries of their own.
"""

from __future__ import annotations

from dataclasses import replace

from .model import Arg, FuncInfo, fn

LIB = "cublas"
LIB_LT = "cublasLt"
RET = "enum:cublasStatus_t"
SONAME_GLOBS = ("libcublas.so", "libcublas.so.*")
SONAME_GLOBS_LT = ("libcublasLt.so", "libcublasLt.so.*")
CODE_PREFIXES = ("CUBLAS_STATUS_", "CUBLAS_")

CODES: dict[int, str] = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}

ALIASES: dict[str, str] = {
    "ok": "CUBLAS_STATUS_SUCCESS",
    "success": "CUBLAS_STATUS_SUCCESS",
    "noinit": "CUBLAS_STATUS_NOT_INITIALIZED",
    "oom": "CUBLAS_STATUS_ALLOC_FAILED",
    "alloc": "CUBLAS_STATUS_ALLOC_FAILED",
    "inval": "CUBLAS_STATUS_INVALID_VALUE",
    "arch": "CUBLAS_STATUS_ARCH_MISMATCH",
    "mapping": "CUBLAS_STATUS_MAPPING_ERROR",
    "exec": "CUBLAS_STATUS_EXECUTION_FAILED",
    "internal": "CUBLAS_STATUS_INTERNAL_ERROR",
    "notsupported": "CUBLAS_STATUS_NOT_SUPPORTED",
    "license": "CUBLAS_STATUS_LICENSE_ERROR",
}

ENUMS: dict[str, dict[int, str]] = {
    "cublasStatus_t": CODES,
    # CUBLAS_OP_HERMITAN is a second name for 2.
    "cublasOperation_t": {
        0: "CUBLAS_OP_N",
        1: "CUBLAS_OP_T",
        2: "CUBLAS_OP_C",
        3: "CUBLAS_OP_CONJG",
    },
    # library_types.h (CUDA 13.5)
    "cudaDataType": {
        0: "CUDA_R_32F",
        1: "CUDA_R_64F",
        2: "CUDA_R_16F",
        3: "CUDA_R_8I",
        4: "CUDA_C_32F",
        5: "CUDA_C_64F",
        6: "CUDA_C_16F",
        7: "CUDA_C_8I",
        8: "CUDA_R_8U",
        9: "CUDA_C_8U",
        10: "CUDA_R_32I",
        11: "CUDA_C_32I",
        12: "CUDA_R_32U",
        13: "CUDA_C_32U",
        14: "CUDA_R_16BF",
        15: "CUDA_C_16BF",
        16: "CUDA_R_4I",
        17: "CUDA_C_4I",
        18: "CUDA_R_4U",
        19: "CUDA_C_4U",
        20: "CUDA_R_16I",
        21: "CUDA_C_16I",
        22: "CUDA_R_16U",
        23: "CUDA_C_16U",
        24: "CUDA_R_64I",
        25: "CUDA_C_64I",
        26: "CUDA_R_64U",
        27: "CUDA_C_64U",
        28: "CUDA_R_8F_E4M3",
        29: "CUDA_R_8F_E5M2",
        30: "CUDA_R_8F_UE8M0",
        31: "CUDA_R_6F_E2M3",
        32: "CUDA_R_6F_E3M2",
        33: "CUDA_R_4F_E2M1",
        34: "CUDA_R_8F_UE5M3",
    },
    # 78 and 79 (emulated compute types) appeared in CUDA 12.9/13; unsure of
    # the exact release, kept because a value seen in a trace is worth naming.
    "cublasComputeType_t": {
        64: "CUBLAS_COMPUTE_16F",
        65: "CUBLAS_COMPUTE_16F_PEDANTIC",
        68: "CUBLAS_COMPUTE_32F",
        69: "CUBLAS_COMPUTE_32F_PEDANTIC",
        70: "CUBLAS_COMPUTE_64F",
        71: "CUBLAS_COMPUTE_64F_PEDANTIC",
        72: "CUBLAS_COMPUTE_32I",
        73: "CUBLAS_COMPUTE_32I_PEDANTIC",
        74: "CUBLAS_COMPUTE_32F_FAST_16F",
        75: "CUBLAS_COMPUTE_32F_FAST_16BF",
        77: "CUBLAS_COMPUTE_32F_FAST_TF32",
        78: "CUBLAS_COMPUTE_32F_EMULATED_16BFX9",
        79: "CUBLAS_COMPUTE_64F_EMULATED_FIXEDPOINT",
    },
    "cublasGemmAlgo_t": {
        -1: "CUBLAS_GEMM_DEFAULT",
        99: "CUBLAS_GEMM_DEFAULT_TENSOR_OP",
        **{i: f"CUBLAS_GEMM_ALGO{i}" for i in range(24)},
        **{100 + i: f"CUBLAS_GEMM_ALGO{i}_TENSOR_OP" for i in range(16)},
    },
}

_H = "handle"
_OPS = [
    ("handle", "cublasHandle_t", _H),
    ("transa", "cublasOperation_t", "enum:cublasOperation_t"),
    ("transb", "cublasOperation_t", "enum:cublasOperation_t"),
    ("m", "int", "int"),
    ("n", "int", "int"),
    ("k", "int", "int"),
]


def _b(name: str, args: list[tuple[str, str, str]], **kw: object) -> FuncInfo:
    return fn(name, LIB, args, RET, **kw)  # type: ignore[arg-type]


# ILP64 twins: the int dimensions, leading dimensions and batch counts become
# int64_t; everything else is unchanged.
_ILP64_ARGS = frozenset({"m", "n", "k", "lda", "ldb", "ldc", "batchCount"})


def _ilp64(info: FuncInfo, name: str) -> FuncInfo:
    args = tuple(Arg(a.name, "int64_t", "i64") if a.name in _ILP64_ARGS else a for a in info.args)
    return replace(info, name=name, args=args, aliases=(), notes="ILP64 variant (cuBLAS 12+)")


_SGEMM = _b(
    "cublasSgemm_v2",
    [
        *_OPS,
        ("alpha", "const float *", "ptr"),
        ("A", "const float *", "ptr"),
        ("lda", "int", "int"),
        ("B", "const float *", "ptr"),
        ("ldb", "int", "int"),
        ("beta", "const float *", "ptr"),
        ("C", "float *", "ptr"),
        ("ldc", "int", "int"),
    ],
    hot=True,
    aliases=("cublasSgemm",),
    notes="cublas_v2.h maps cublasSgemm here; the legacy cublas.h symbol "
    "cublasSgemm has another signature (no handle)",
)
_HGEMM = _b(
    "cublasHgemm",
    [
        *_OPS,
        ("alpha", "const __half *", "ptr"),
        ("A", "const __half *", "ptr"),
        ("lda", "int", "int"),
        ("B", "const __half *", "ptr"),
        ("ldb", "int", "int"),
        ("beta", "const __half *", "ptr"),
        ("C", "__half *", "ptr"),
        ("ldc", "int", "int"),
    ],
    hot=True,
)
_GEMMEX = _b(
    "cublasGemmEx",
    [
        *_OPS,
        ("alpha", "const void *", "ptr"),
        ("A", "const void *", "ptr"),
        ("Atype", "cudaDataType", "enum:cudaDataType"),
        ("lda", "int", "int"),
        ("B", "const void *", "ptr"),
        ("Btype", "cudaDataType", "enum:cudaDataType"),
        ("ldb", "int", "int"),
        ("beta", "const void *", "ptr"),
        ("C", "void *", "ptr"),
        ("Ctype", "cudaDataType", "enum:cudaDataType"),
        ("ldc", "int", "int"),
        ("computeType", "cublasComputeType_t", "enum:cublasComputeType_t"),
        ("algo", "cublasGemmAlgo_t", "enum:cublasGemmAlgo_t"),
    ],
    hot=True,
    notes="only handle..k arrive in registers",
)
_GEMMSB = _b(
    "cublasGemmStridedBatchedEx",
    [
        *_OPS,
        ("alpha", "const void *", "ptr"),
        ("A", "const void *", "ptr"),
        ("Atype", "cudaDataType", "enum:cudaDataType"),
        ("lda", "int", "int"),
        ("strideA", "long long int", "i64"),
        ("B", "const void *", "ptr"),
        ("Btype", "cudaDataType", "enum:cudaDataType"),
        ("ldb", "int", "int"),
        ("strideB", "long long int", "i64"),
        ("beta", "const void *", "ptr"),
        ("C", "void *", "ptr"),
        ("Ctype", "cudaDataType", "enum:cudaDataType"),
        ("ldc", "int", "int"),
        ("strideC", "long long int", "i64"),
        ("batchCount", "int", "int"),
        ("computeType", "cublasComputeType_t", "enum:cublasComputeType_t"),
        ("algo", "cublasGemmAlgo_t", "enum:cublasGemmAlgo_t"),
    ],
    hot=True,
)

FUNCTIONS: tuple[FuncInfo, ...] = (
    _b(
        "cublasCreate_v2",
        [("handle", "cublasHandle_t *", "out_ptr")],
        aliases=("cublasCreate",),
        notes="allocates device workspace: a natural ALLOC_FAILED site",
    ),
    _b("cublasDestroy_v2", [("handle", "cublasHandle_t", _H)], aliases=("cublasDestroy",)),
    _b(
        "cublasSetStream_v2",
        [("handle", "cublasHandle_t", _H), ("streamId", "cudaStream_t", _H)],
        aliases=("cublasSetStream",),
    ),
    _b(
        "cublasSetWorkspace_v2",
        [
            ("handle", "cublasHandle_t", _H),
            ("workspace", "void *", "ptr"),
            ("workspaceSizeInBytes", "size_t", "size"),
        ],
    ),
    _b(
        "cublasSetMathMode",
        [("handle", "cublasHandle_t", _H), ("mode", "cublasMath_t", "int")],
    ),
    _SGEMM,
    _ilp64(_SGEMM, "cublasSgemm_v2_64"),
    _HGEMM,
    _ilp64(_HGEMM, "cublasHgemm_64"),
    _GEMMEX,
    _ilp64(_GEMMEX, "cublasGemmEx_64"),
    _GEMMSB,
    _ilp64(_GEMMSB, "cublasGemmStridedBatchedEx_64"),
    # -- cuBLASLt (its own library, same status codes)
    fn("cublasLtCreate", LIB_LT, [("lightHandle", "cublasLtHandle_t *", "out_ptr")], RET),
    fn("cublasLtDestroy", LIB_LT, [("lightHandle", "cublasLtHandle_t", _H)], RET),
    fn(
        "cublasLtMatmul",
        LIB_LT,
        [
            ("lightHandle", "cublasLtHandle_t", _H),
            ("computeDesc", "cublasLtMatmulDesc_t", _H),
            ("alpha", "const void *", "ptr"),
            ("A", "const void *", "ptr"),
            ("Adesc", "cublasLtMatrixLayout_t", _H),
            ("B", "const void *", "ptr"),
            ("Bdesc", "cublasLtMatrixLayout_t", _H),
            ("beta", "const void *", "ptr"),
            ("C", "const void *", "ptr"),
            ("Cdesc", "cublasLtMatrixLayout_t", _H),
            ("D", "void *", "ptr"),
            ("Ddesc", "cublasLtMatrixLayout_t", _H),
            ("algo", "const cublasLtMatmulAlgo_t *", "ptr"),
            ("workspace", "void *", "ptr"),
            ("workspaceSizeInBytes", "size_t", "size"),
            ("stream", "cudaStream_t", _H),
        ],
        RET,
        hot=True,
        notes="torch's default matmul path on Hopper; stream is on the stack",
    ),
)
