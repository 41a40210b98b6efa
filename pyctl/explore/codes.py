"""Which faults to try at a point: the error codes of the function's
library that fit the function, plus a stall and a hang.

The catalog (pyctl/catalog) lists each library's return codes and each
function's signature, not which codes a function is documented to
return; this table picks them by function family (an allocator can run
out of memory, a launch can fail, a synchronize reports a sticky error)
and keeps only names the catalog knows. A function the catalog does not
know fails with -1.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from pyctl import catalog

# (library, function glob, codes), first match wins; every library's last
# row is its catch-all. Order within a row: the class order of the plan.
_FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("cuda", "cuMem*Alloc*", ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE")),
    ("cuda", "cuMemCreate*", ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE")),
    ("cuda", "cuLaunch*", ("CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_ADDRESS")),
    ("cuda", "cuGraphLaunch*", ("CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_ADDRESS")),
    ("cuda", "*Synchronize*", ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_TIMEOUT")),
    ("cuda", "cuCtx*", ("CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_CONTEXT_IS_DESTROYED")),
    ("cuda", "*", ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_ILLEGAL_ADDRESS")),
    ("cudart", "cuda*Malloc*", ("cudaErrorMemoryAllocation",)),
    ("cudart", "cudaLaunch*", ("cudaErrorLaunchFailure",)),
    ("cudart", "*", ("cudaErrorInvalidValue", "cudaErrorIllegalAddress")),
    ("cublas", "*", ("CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_ALLOC_FAILED")),
    ("nccl", "*", ("ncclUnhandledCudaError", "ncclSystemError", "ncclRemoteError")),
)

# Where the catalog has no entry: a failed C call's most common value.
UNKNOWN_FAIL = "-1"


@dataclass(frozen=True)
class Code:
    """One fault to try: action fail (code: a catalog name or a number),
    stall (code: its time) or hang (code: "hang")."""

    action: str
    code: str

    @property
    def label(self) -> str:
        if self.code == "hang":
            return "hang"
        return self.code if self.action != "stall" else f"stall {self.code}"

    @property
    def klass(self) -> int:
        """Plan order: errors first, then stalls, a hang last (it holds a
        thread for the whole window)."""
        return {"fail": 0, "stall": 1}.get(self.action, 2) if self.code != "hang" else 2


def error_codes(function: str) -> list[str]:
    """The catalog's code names to fail `function` with (UNKNOWN_FAIL when
    the catalog does not know it)."""
    info = catalog.lookup(function)
    if info is None:
        return [UNKNOWN_FAIL]
    for lib, glob, names in _FAMILIES:
        if lib == info.lib and fnmatch.fnmatchcase(info.name, glob):
            known = [n for n in names if _known(lib, n)]
            if known:
                return known
    return [UNKNOWN_FAIL]


def _known(lib: str, name: str) -> bool:
    try:
        catalog.code_value(lib, name)
    except (KeyError, ValueError):
        return False
    return True


# Libraries whose entry points return Rust values (a Result, an Encoding)
# through memory, not a C status in rax: failing one with -1 would be a
# corrupted return, not an error the caller can see. Stall and hang only.
_NO_ERROR_CODES = ("tokenizers", "tiktoken")


def codes_for(
    function: str, stall: str = "200ms", hang: bool = True, library: str = ""
) -> list[Code]:
    """Every fault to try at a point of `function`, in class order."""
    lib = library.rsplit("/", 1)[-1].lower()
    if catalog.lookup(function) is None and any(t in lib for t in _NO_ERROR_CODES):
        out = []
    else:
        out = [Code("fail", c) for c in error_codes(function)]
    if stall:
        out.append(Code("stall", stall))
    if hang:
        out.append(Code("stall", "hang"))
    return out


def parse(text: str) -> Code:
    """`CODE`, `stall:TIME`, `hang` (a pin file's or --code's spelling)."""
    if text == "hang":
        return Code("stall", "hang")
    if text.startswith("stall:"):
        return Code("stall", text.split(":", 1)[1])
    return Code("fail", text.removeprefix("fail:"))


def spelled(c: Code) -> str:
    return "hang" if c.code == "hang" else f"{c.action}:{c.code}"
