"""NCCL (libnccl.so.2): functions, ncclResult_t, data types and reduction ops.

Signatures from nccl.h (NVIDIA/nccl src/nccl.h.in, 2.2x). Every public
function is also exported as `p<name>` (the profiling interface): NCCL
defines `ncclX` as a weak alias of `pncclX`, so both names are one address.
"""

from __future__ import annotations

from .model import FuncInfo, fn

LIB = "nccl"
RET = "enum:ncclResult_t"
SONAME_GLOBS = ("libnccl.so", "libnccl.so.*")
CODE_PREFIXES = ("nccl",)

CODES: dict[int, str] = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",  # added in NCCL 2.2x (ncclNumResults moved to 9)
}

ALIASES: dict[str, str] = {
    "ok": "ncclSuccess",
    "success": "ncclSuccess",
    "cuda": "ncclUnhandledCudaError",
    "system": "ncclSystemError",
    "sys": "ncclSystemError",
    "internal": "ncclInternalError",
    "inval": "ncclInvalidArgument",
    "usage": "ncclInvalidUsage",
    "remote": "ncclRemoteError",
    "peer": "ncclRemoteError",
    "inprogress": "ncclInProgress",
    "timeout": "ncclTimeout",
}

ENUMS: dict[str, dict[int, str]] = {
    "ncclResult_t": CODES,
    # Values with two names (ncclInt8/ncclChar...) show the first name.
    "ncclDataType_t": {
        0: "ncclInt8",
        1: "ncclUint8",
        2: "ncclInt32",
        3: "ncclUint32",
        4: "ncclInt64",
        5: "ncclUint64",
        6: "ncclFloat16",
        7: "ncclFloat32",
        8: "ncclFloat64",
        9: "ncclBfloat16",
        10: "ncclFloat8e4m3",
        11: "ncclFloat8e5m2",
    },
    # Values >= ncclNumOps (5) are user ops made by ncclRedOpCreatePreMulSum.
    "ncclRedOp_t": {0: "ncclSum", 1: "ncclProd", 2: "ncclMax", 3: "ncclMin", 4: "ncclAvg"},
}

_H = "handle"


def _n(name: str, args: list[tuple[str, str, str]], **kw: object) -> FuncInfo:
    aliases = (f"p{name}",)
    return fn(name, LIB, args, RET, aliases=aliases, **kw)  # type: ignore[arg-type]


_COLL_TAIL = [("comm", "ncclComm_t", _H), ("stream", "cudaStream_t", _H)]

FUNCTIONS: tuple[FuncInfo, ...] = (
    _n("ncclGetVersion", [("version", "int *", "out_ptr")]),
    _n("ncclGetUniqueId", [("uniqueId", "ncclUniqueId *", "out_ptr")]),
    _n(
        "ncclCommInitRank",
        [
            ("comm", "ncclComm_t *", "out_ptr"),
            ("nranks", "int", "int"),
            # 128-byte struct by value: passed in memory, so rank is in rdx.
            ("commId", "ncclUniqueId", "stack"),
            ("rank", "int", "int"),
        ],
        notes="commId (128 bytes) is passed on the stack: rank arrives in arg3",
    ),
    _n(
        "ncclCommInitRankConfig",
        [
            ("comm", "ncclComm_t *", "out_ptr"),
            ("nranks", "int", "int"),
            ("commId", "ncclUniqueId", "stack"),
            ("rank", "int", "int"),
            ("config", "ncclConfig_t *", "ptr"),
        ],
        notes="commId (128 bytes) is passed on the stack",
    ),
    _n(
        "ncclCommInitAll",
        [
            ("comm", "ncclComm_t *", "out_ptr"),
            ("ndev", "int", "int"),
            ("devlist", "const int *", "ptr"),
        ],
    ),
    _n("ncclCommFinalize", [("comm", "ncclComm_t", _H)]),
    _n("ncclCommDestroy", [("comm", "ncclComm_t", _H)]),
    _n("ncclCommAbort", [("comm", "ncclComm_t", _H)]),
    _n(
        "ncclCommGetAsyncError",
        [("comm", "ncclComm_t", _H), ("asyncError", "ncclResult_t *", "out_ptr")],
        hot=True,
        notes="polled by framework watchdogs",
    ),
    _n(
        "ncclAllReduce",
        [
            ("sendbuff", "const void *", "ptr"),
            ("recvbuff", "void *", "ptr"),
            ("count", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            ("op", "ncclRedOp_t", "enum:ncclRedOp_t"),
            *_COLL_TAIL,
        ],
        notes="stream is the 7th argument (on the stack)",
    ),
    _n(
        "ncclBroadcast",
        [
            ("sendbuff", "const void *", "ptr"),
            ("recvbuff", "void *", "ptr"),
            ("count", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            ("root", "int", "int"),
            *_COLL_TAIL,
        ],
    ),
    _n(
        "ncclReduce",
        [
            ("sendbuff", "const void *", "ptr"),
            ("recvbuff", "void *", "ptr"),
            ("count", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            ("op", "ncclRedOp_t", "enum:ncclRedOp_t"),
            ("root", "int", "int"),
            *_COLL_TAIL,
        ],
    ),
    _n(
        "ncclAllGather",
        [
            ("sendbuff", "const void *", "ptr"),
            ("recvbuff", "void *", "ptr"),
            ("sendcount", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            *_COLL_TAIL,
        ],
    ),
    _n(
        "ncclReduceScatter",
        [
            ("sendbuff", "const void *", "ptr"),
            ("recvbuff", "void *", "ptr"),
            ("recvcount", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            ("op", "ncclRedOp_t", "enum:ncclRedOp_t"),
            *_COLL_TAIL,
        ],
    ),
    _n(
        "ncclSend",
        [
            ("sendbuff", "const void *", "ptr"),
            ("count", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            ("peer", "int", "int"),
            *_COLL_TAIL,
        ],
    ),
    _n(
        "ncclRecv",
        [
            ("recvbuff", "void *", "ptr"),
            ("count", "size_t", "count"),
            ("datatype", "ncclDataType_t", "enum:ncclDataType_t"),
            ("peer", "int", "int"),
            *_COLL_TAIL,
        ],
    ),
    _n("ncclGroupStart", []),
    _n(
        "ncclGroupEnd",
        [],
        notes="where grouped operations (and their errors) are actually launched",
    ),
)
