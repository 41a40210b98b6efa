"""Cold parse time of big libraries: the one ELF reader (pyctl/elf.py,
struct) against what was there before it (pyelftools for the file, with
struct fast paths for the symbol tables) and against pyelftools alone.

What a cold start pays for one library, each in a fresh interpreter (the
import is part of the cost: pyelftools' alone is ~70 ms): import the
symbol modules, then build both tables a probed library needs, symtab's
function table (`.symtab`, `.dynsym`, MiniDebugInfo, the debug file by
build-id) and resolve's probe-site table. The disk cache is off
(GPUFAULT_CACHE_DIR=""), so every run parses.

- `new`: this tree.
- `before`: the tree given with --base DIR (e.g. `git archive` of the
  commit before the reader), which read ELF with pyelftools.
- `pyelftools`: pyelftools alone, no struct fast path: ELFFile, its
  segments, notes and `iter_symbols()` over both tables (what a reader on
  pyelftools would cost without the hand-written loops beside it).

`tables_ms`: the function tables alone, read as symtab and resolve read
them (no ranking of names after): the reader's own share, new against
before.

Also the warm path's per-call cost: the build-id read before every cache
lookup (the reader's `build_id` against the struct reader that was in
pyctl/diskcache.py), median of 200 calls in one process.

    python3 bench/bench_elf.py --base /tmp/h5-base [--elftools DIR] [--reps 5] \
        [--out bench/results/elf-host.json] [FILE...]

--elftools DIR puts DIR first on the children's sys.path (a machine whose
Python lacks pyelftools: the GPU image). Default files: libc, libstdc++,
the tokenizers and tiktoken extensions, and where present libcuda and
torch's libtorch_cpu.so.
"""

from __future__ import annotations

import compileall
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_NEW = """
import sys, time
t0 = time.perf_counter()
from pyctl.elf import ElfFile
from pyctl.symbols import resolve, symtab
t1 = time.perf_counter()
p = sys.argv[1]
with ElfFile.open(p) as f:
    t = symtab._parse(p, "", p, f)
r = resolve._read_elf(p)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, len(t.names), len(r[0]))
"""

_BEFORE = """
import sys, time
t0 = time.perf_counter()
from pyctl.symbols import resolve, symtab
import elftools.elf.elffile
t1 = time.perf_counter()
p = sys.argv[1]
t = symtab._parse(p, "", p)
r = resolve._read_elf(p)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, len(t.names), len(r[0]))
"""

_PYELFTOOLS = """
import sys, time
t0 = time.perf_counter()
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import NoteSection, SymbolTableSection
t1 = time.perf_counter()
funcs = {}
with open(sys.argv[1], "rb") as f:
    elf = ELFFile(f)
    loads = [s["p_vaddr"] for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
    bid = [n["n_desc"] for s in elf.iter_sections() if isinstance(s, NoteSection)
           for n in s.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID"]
    for name in (".symtab", ".dynsym"):
        sec = elf.get_section_by_name(name)
        if isinstance(sec, SymbolTableSection):
            for sym in sec.iter_symbols():
                if sym["st_info"]["type"] == "STT_FUNC" and sym["st_value"]:
                    funcs.setdefault(sym.name, sym["st_value"])
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, len(funcs), len(funcs))
"""

# The function tables alone (what the reader does, without the ranking of
# names that symtab and resolve do after it): both tables as symtab reads
# them, and both as resolve reads them.
_TABLES_NEW = """
import sys, time
from pyctl.elf import STT_FUNC, ElfFile
from pyctl.symbols import symtab
p = sys.argv[1]
t0 = time.perf_counter()
with ElfFile.open(p) as f:
    a = symtab._funcs(f)
    b = [f.functions(n, (STT_FUNC,)) for n in (".dynsym", ".symtab")]
print(time.perf_counter() - t0, 0, len(a), sum(map(len, b)))
"""

_TABLES_BEFORE = """
import sys, time
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from pyctl.symbols import resolve, symtab
p = sys.argv[1]
t0 = time.perf_counter()
with open(p, "rb") as f:
    e = ELFFile(f)
    a = symtab._funcs(e)
    b = []
    for n in (".dynsym", ".symtab"):
        sec = e.get_section_by_name(n)
        if isinstance(sec, SymbolTableSection):
            b.append(resolve._func_syms(f, e, sec))
print(time.perf_counter() - t0, 0, len(a), sum(map(len, b)))
"""

_WARM = """
import sys, time, statistics
from pyctl import elf
p = sys.argv[1]
ts = []
for _ in range(200):
    t = time.perf_counter(); elf.build_id(p); ts.append(time.perf_counter() - t)
print(statistics.median(ts))
"""

# diskcache.build_id_of as it was before the reader (commit 4f2bba1).
_WARM_BEFORE = """
import sys, time, statistics
from pyctl import diskcache
p = sys.argv[1]
ts = []
for _ in range(200):
    t = time.perf_counter(); diskcache.build_id_of(p); ts.append(time.perf_counter() - t)
print(statistics.median(ts))
"""


def default_files() -> list[str]:
    out = ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"]
    for mod in ("tokenizers", "tiktoken"):
        for d in sys.path:
            hits = sorted(glob.glob(f"{d}/{mod}/*{mod}*.so"))
            if hits:
                out.append(hits[0])
                break
    out += sorted(glob.glob("/usr/local/nvidia/lib64/libcuda.so.*.*"))[:1]
    out += sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so.*.*"))[:1]
    for d in sys.path:
        hits = glob.glob(f"{d}/torch/lib/libtorch_cpu.so")
        if hits:
            out.append(hits[0])
            break
    return [p for p in out if os.path.isfile(p)]


def child(
    code: str, tree: Path, path: str, extra: str | None, timeout: float
) -> list[float] | None:
    env = dict(os.environ, GPUFAULT_CACHE_DIR="", PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([p for p in (extra, str(tree)) if p])
    try:
        r = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True,
                           text=True, timeout=timeout, cwd="/")  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    if r.returncode:
        raise SystemExit(f"bench_elf: child failed on {path}:\n{r.stderr[-2000:]}")
    return [float(x) for x in r.stdout.split()]


def main() -> None:
    args = sys.argv[1:]

    def opt(name: str) -> str | None:
        if name in args:
            i = args.index(name)
            v = args[i + 1]
            del args[i : i + 2]
            return v
        return None

    base = opt("--base")
    extra = opt("--elftools")
    # Absolute: the children run in / (no module of the cwd on their path).
    base = os.path.abspath(base) if base else None
    extra = os.path.abspath(extra) if extra else None
    reps = int(opt("--reps") or 5)
    out = opt("--out")
    timeout = float(opt("--timeout") or 120)
    files = args or default_files()
    # Byte-code compiled first, as an installed wheel has it: otherwise each
    # child compiles every module it imports (PYTHONDONTWRITEBYTECODE here).
    for tree in [REPO] + ([Path(base)] if base else []):
        compileall.compile_dir(str(tree / "pyctl"), quiet=1)
    modes = {"new": (_NEW, REPO)}
    if base:
        modes["before"] = (_BEFORE, Path(base))
    modes["pyelftools"] = (_PYELFTOOLS, REPO)
    res: dict = {
        "host": platform.node(),
        "python": platform.python_version(),
        "load_before": os.getloadavg()[0],
        "reps": reps,
        "files": {},
    }
    for path in files:
        raw: dict[str, list] = {m: [] for m in modes}
        for _ in range(reps):  # interleaved: the same load for each mode
            for m, (code, tree) in modes.items():
                if raw[m] and raw[m][-1] is None:
                    continue  # timed out once: not again
                raw[m].append(child(code, tree, path, extra, timeout))
        row: dict = {"bytes": os.path.getsize(path)}
        for m, runs in raw.items():
            ok = [r for r in runs if r is not None]
            if not ok:
                row[m] = {"timeout_s": timeout}
                continue
            imp = statistics.median(r[0] for r in ok) * 1e3
            parse = statistics.median(r[1] for r in ok) * 1e3
            total = statistics.median(r[0] + r[1] for r in ok) * 1e3
            row[m] = {"import_ms": round(imp, 1), "parse_ms": round(parse, 1),
                      "total_ms": round(total, 1), "names": int(ok[0][2]),
                      "sites": int(ok[0][3])}  # fmt: skip
        tables: dict[str, list[float]] = {"new": [], "before": []}
        for _ in range(reps):
            tables["new"].append(child(_TABLES_NEW, REPO, path, extra, timeout)[0])  # type: ignore[index]
            if base:
                tb = child(_TABLES_BEFORE, Path(base), path, extra, timeout)
                tables["before"].append(tb[0])  # type: ignore[index]
        row["tables_ms"] = {k: round(statistics.median(v) * 1e3, 1) for k, v in tables.items() if v}
        warm = child(_WARM, REPO, path, extra, timeout)
        row["build_id_us"] = {"new": round(warm[0] * 1e6, 1) if warm else None}
        if base:
            wb = child(_WARM_BEFORE, Path(base), path, extra, timeout)
            row["build_id_us"]["before"] = round(wb[0] * 1e6, 1) if wb else None
        res["files"][path] = row
        print(json.dumps({path: row}), flush=True)
    res["load_after"] = os.getloadavg()[0]
    res["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = json.dumps(res, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
