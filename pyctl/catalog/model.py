"""Data types of the catalogs: one FuncInfo per exported symbol, one Arg per
C parameter, and the register each argument arrives in (SysV x86-64)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Integer argument registers in SysV x86-64 order; the BPF side captures
# exactly these six (GF_NARGS in bpf/gpufault.h).
ARG_REGS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")

# Argument kinds. 'enum:<type>' names a table in the library's ENUMS.
KINDS = (
    "int",  # C int / enum-free signed 32-bit value
    "uint",  # unsigned int
    "i64",  # long long / int64_t
    "u64",  # unsigned long long / cuuint64_t
    "flags",  # bit flags, shown in hex
    "size",  # size_t byte count: decimal plus MiB
    "count",  # size_t element count: decimal
    "ptr",  # a pointer the function reads through (or a device address)
    "out_ptr",  # a pointer the function writes a result through
    "handle",  # an opaque handle (pointer-sized)
    "handle32",  # an opaque handle that is a C int (cufftHandle)
    "str",  # const char *
    "device",  # CUdevice ordinal (int)
    "memloc",  # CUmemLocation by value: {type, id} packed into one register
    "stack",  # passed in memory (struct larger than 16 bytes): not in a register
)


@dataclass(frozen=True)
class Arg:
    """One C parameter: its name and type as in the vendor header, and how to
    decode it."""

    name: str
    ctype: str
    kind: str

    @property
    def in_register(self) -> bool:
        # Structs larger than 16 bytes go on the stack and take no register.
        return self.kind != "stack"


@dataclass(frozen=True)
class FuncInfo:
    """One exported function. `name` is the symbol the library exports;
    `aliases` are other exported symbols with the very same signature (the
    per-thread-stream `_ptsz`/`_ptds` entry points, NCCL's `p` profiling
    names, legacy unversioned symbols)."""

    name: str
    lib: str
    args: tuple[Arg, ...]
    ret_kind: str
    hot: bool = False
    notes: str = ""
    aliases: tuple[str, ...] = field(default=())

    @property
    def base(self) -> str:
        return base_name(self.name)

    @property
    def prototype(self) -> str:
        inner = ", ".join(_param(a) for a in self.args) or "void"
        ret = self.ret_kind.split(":", 1)[-1]
        return f"{ret} {self.name}({inner})"

    def registers(self) -> list[tuple[Arg, int]]:
        """(arg, register index) for the arguments that arrive in the six
        integer argument registers, in order."""
        out: list[tuple[Arg, int]] = []
        reg = 0
        for a in self.args:
            if not a.in_register:
                continue
            if reg >= len(ARG_REGS):
                break
            out.append((a, reg))
            reg += 1
        return out

    def arg_index(self, name: str) -> int | None:
        """1-based register argument number of `name` (for argN predicates)."""
        for a, reg in self.registers():
            if a.name == name:
                return reg + 1
        return None


def _param(a: Arg) -> str:
    sep = "" if a.ctype.endswith("*") else " "
    return f"{a.ctype}{sep}{a.name}"


SUFFIXES = ("_ptsz", "_ptds")


def base_name(symbol: str) -> str:
    """cuMemcpyHtoD_v2_ptds -> cuMemcpyHtoD; cublasSgemm_v2_64 -> cublasSgemm."""
    name = symbol
    for s in SUFFIXES:
        if name.endswith(s):
            name = name[: -len(s)]
    if name.endswith("_64"):
        name = name[:-3]
    head, sep, tail = name.rpartition("_v")
    if sep and head and tail.isdigit():
        name = head
    return name


def fn(
    name: str,
    lib: str,
    args: list[tuple[str, str, str]] | tuple[tuple[str, str, str], ...],
    ret: str,
    *,
    hot: bool = False,
    notes: str = "",
    aliases: tuple[str, ...] = (),
) -> FuncInfo:
    """Compact constructor used by the per-library tables."""
    return FuncInfo(
        name=name,
        lib=lib,
        args=tuple(Arg(n, t, k) for n, t, k in args),
        ret_kind=ret,
        hot=hot,
        notes=notes,
        aliases=aliases,
    )
