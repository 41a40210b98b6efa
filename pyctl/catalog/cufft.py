"""cuFFT (libcufft.so.*): plan and exec functions, cufftResult codes.

Signatures from cufft.h. `cufftHandle` is a C int, not a pointer.
"""

from __future__ import annotations

from .model import FuncInfo, fn

LIB = "cufft"
RET = "enum:cufftResult"
SONAME_GLOBS = ("libcufft.so", "libcufft.so.*")
CODE_PREFIXES = ("CUFFT_",)

CODES: dict[int, str] = {
    0x0: "CUFFT_SUCCESS",
    0x1: "CUFFT_INVALID_PLAN",
    0x2: "CUFFT_ALLOC_FAILED",
    0x3: "CUFFT_INVALID_TYPE",
    0x4: "CUFFT_INVALID_VALUE",
    0x5: "CUFFT_INTERNAL_ERROR",
    0x6: "CUFFT_EXEC_FAILED",
    0x7: "CUFFT_SETUP_FAILED",
    0x8: "CUFFT_INVALID_SIZE",
    0x9: "CUFFT_UNALIGNED_DATA",
    0xA: "CUFFT_INCOMPLETE_PARAMETER_LIST",  # removed in CUDA 13
    0xB: "CUFFT_INVALID_DEVICE",
    0xC: "CUFFT_PARSE_ERROR",  # removed in CUDA 13
    0xD: "CUFFT_NO_WORKSPACE",
    0xE: "CUFFT_NOT_IMPLEMENTED",
    0xF: "CUFFT_LICENSE_ERROR",  # removed in CUDA 13
    0x10: "CUFFT_NOT_SUPPORTED",
    0x11: "CUFFT_MISSING_DEPENDENCY",  # CUDA 13+
    0x12: "CUFFT_NVRTC_FAILURE",  # CUDA 13+
    0x13: "CUFFT_NVJITLINK_FAILURE",  # CUDA 13+
    0x14: "CUFFT_NVSHMEM_FAILURE",  # CUDA 13+
}

ALIASES: dict[str, str] = {
    "ok": "CUFFT_SUCCESS",
    "success": "CUFFT_SUCCESS",
    "badplan": "CUFFT_INVALID_PLAN",
    "oom": "CUFFT_ALLOC_FAILED",
    "alloc": "CUFFT_ALLOC_FAILED",
    "inval": "CUFFT_INVALID_VALUE",
    "internal": "CUFFT_INTERNAL_ERROR",
    "exec": "CUFFT_EXEC_FAILED",
    "setup": "CUFFT_SETUP_FAILED",
    "size": "CUFFT_INVALID_SIZE",
    "notsupported": "CUFFT_NOT_SUPPORTED",
}

ENUMS: dict[str, dict[int, str]] = {
    "cufftResult": CODES,
    "cufftType": {
        0x2A: "CUFFT_R2C",
        0x2C: "CUFFT_C2R",
        0x29: "CUFFT_C2C",
        0x6A: "CUFFT_D2Z",
        0x6C: "CUFFT_Z2D",
        0x69: "CUFFT_Z2Z",
    },
    # int direction: CUFFT_FORWARD (-1), CUFFT_INVERSE (1)
    "cufftDirection": {-1: "CUFFT_FORWARD", 1: "CUFFT_INVERSE"},
}

_T = ("type", "cufftType", "enum:cufftType")
_PLAN_OUT = ("plan", "cufftHandle *", "out_ptr")
_PLAN = ("plan", "cufftHandle", "handle32")
_WS = ("workSize", "size_t *", "out_ptr")
_MANY = [
    ("rank", "int", "int"),
    ("n", "int *", "ptr"),
    ("inembed", "int *", "ptr"),
    ("istride", "int", "int"),
    ("idist", "int", "int"),
    ("onembed", "int *", "ptr"),
    ("ostride", "int", "int"),
    ("odist", "int", "int"),
    _T,
    ("batch", "int", "int"),
]


def _f(name: str, args: list[tuple[str, str, str]], **kw: object) -> FuncInfo:
    return fn(name, LIB, args, RET, **kw)  # type: ignore[arg-type]


_DIR = ("direction", "int", "enum:cufftDirection")

FUNCTIONS: tuple[FuncInfo, ...] = (
    _f("cufftCreate", [("handle", "cufftHandle *", "out_ptr")]),
    _f("cufftPlan1d", [_PLAN_OUT, ("nx", "int", "int"), _T, ("batch", "int", "int")]),
    _f("cufftPlan2d", [_PLAN_OUT, ("nx", "int", "int"), ("ny", "int", "int"), _T]),
    _f(
        "cufftPlan3d",
        [_PLAN_OUT, ("nx", "int", "int"), ("ny", "int", "int"), ("nz", "int", "int"), _T],
    ),
    _f("cufftPlanMany", [_PLAN_OUT, *_MANY]),
    _f("cufftMakePlan1d", [_PLAN, ("nx", "int", "int"), _T, ("batch", "int", "int"), _WS]),
    _f("cufftMakePlan2d", [_PLAN, ("nx", "int", "int"), ("ny", "int", "int"), _T, _WS]),
    _f(
        "cufftMakePlan3d",
        [_PLAN, ("nx", "int", "int"), ("ny", "int", "int"), ("nz", "int", "int"), _T, _WS],
    ),
    _f("cufftMakePlanMany", [_PLAN, *_MANY, _WS]),
    _f(
        "cufftMakePlanMany64",
        [
            _PLAN,
            ("rank", "int", "int"),
            ("n", "long long int *", "ptr"),
            ("inembed", "long long int *", "ptr"),
            ("istride", "long long int", "i64"),
            ("idist", "long long int", "i64"),
            ("onembed", "long long int *", "ptr"),
            ("ostride", "long long int", "i64"),
            ("odist", "long long int", "i64"),
            _T,
            ("batch", "long long int", "i64"),
            _WS,
        ],
    ),
    _f("cufftSetStream", [_PLAN, ("stream", "cudaStream_t", "handle")]),
    _f(
        "cufftExecC2C",
        [_PLAN, ("idata", "cufftComplex *", "ptr"), ("odata", "cufftComplex *", "ptr"), _DIR],
    ),
    _f(
        "cufftExecR2C", [_PLAN, ("idata", "cufftReal *", "ptr"), ("odata", "cufftComplex *", "ptr")]
    ),
    _f(
        "cufftExecC2R", [_PLAN, ("idata", "cufftComplex *", "ptr"), ("odata", "cufftReal *", "ptr")]
    ),
    _f(
        "cufftExecZ2Z",
        [
            _PLAN,
            ("idata", "cufftDoubleComplex *", "ptr"),
            ("odata", "cufftDoubleComplex *", "ptr"),
            _DIR,
        ],
    ),
    _f(
        "cufftExecD2Z",
        [_PLAN, ("idata", "cufftDoubleReal *", "ptr"), ("odata", "cufftDoubleComplex *", "ptr")],
    ),
    _f(
        "cufftExecZ2D",
        [_PLAN, ("idata", "cufftDoubleComplex *", "ptr"), ("odata", "cufftDoubleReal *", "ptr")],
    ),
    _f("cufftDestroy", [_PLAN]),
)
