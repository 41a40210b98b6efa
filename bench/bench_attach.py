"""Attach time, gpufault against bpftrace, in one run on this machine.

A Python target calls zlib's crc32 through ctypes every ~0.2 ms. Each
tool is started as a user starts it (a fresh process) and the clock runs
from just before it is spawned to the first call its probe sees:

- gpufault: `gpufault trace --pid P --lib libz --fn crc32`; the end point
  is the first stored call's entry time (calls.ts_ns, bpf_ktime_get_ns);
  also when it printed its start-up line ("... Ctrl-C to end") and how
  long it took to exit after SIGINT (detach, drain, close).
- bpftrace: `uprobe:LIBZ:crc32 /pid == P/ { printf nsecs; exit() }`; the
  end point is that nsecs (the same clock); also its BEGIN.

gpufault runs cold (an empty GPUFAULT_CACHE_DIR: symbol tables parsed, the
kernel's capabilities tried) and warm (the same dir again: the tables and
trial results come from it). Medians of REPS runs, ratios to bpftrace.
`--baseline DIR` also runs another checkout (another revision, built,
e.g. a `git worktree`) warm in the same interleaved rounds: a change's
effect measured under the same load.
`--target torch` (the GPU host) probes the real libcuda's cuLaunchKernel
in a torch process instead; `--installed` runs the gpufault on sys.path
(the wheel) rather than this checkout; `--no-bpftrace` where it is not
installed (the GPU image has none).
`--fns 1,100`: the same rounds for each count of probed functions (N > 1:
a library of N functions built with cc, probed by one glob in both tools,
the target calling the first); the JSON's top level is the first count's,
`by_functions` has each. Columns besides cold and warm: the early attach
off (GPUFAULT_NO_EARLY_ATTACH=1, pyctl/early.py), both early steps off,
`python -S -m pyctl` (no `site`), through `gpufault serve` (with and
without -S in the client), the clean venv's.
Prints JSON; `--md` appends a table to docs/benchmarks.md. Needs root.
"""

from __future__ import annotations

import compileall
import json
import os
import platform
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("GF_BENCH_ATTACH_REPS", "5"))
DEADLINE_S = 20.0

TARGET = """
import ctypes, sys, time
z = ctypes.CDLL("libz.so.1")
z.crc32.restype = ctypes.c_ulong
z.crc32.argtypes = [ctypes.c_ulong, ctypes.c_char_p, ctypes.c_uint]
buf = b"x" * 64
print("ready", flush=True)
while True:
    z.crc32(0, buf, 64)
    time.sleep(0.0002)
"""

# `--target torch` (the GPU host): torch launches one tiny kernel every
# ~0.2 ms, so the probe is on the real libcuda's cuLaunchKernel (a 96 MB
# library with thousands of symbols, the case the attach goal names).
TORCH_TARGET = """
import time, torch
x = torch.zeros(16, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    x.add_(1)
    time.sleep(0.0002)
"""
TARGETS = {  # --target: (program, library as mapped, function)
    "libz": (TARGET, "/libz.so", "crc32"),
    "torch": (TORCH_TARGET, "/libcuda.so", "cuLaunchKernel"),
}


# `--fns N` (N > 1): a library of N functions, all probed by one glob in
# both tools; the target calls the first. Distinct bodies, so that no two
# are folded into one address (-fipa-icf at -O2).
MANY_PREFIX = "gfb_fn"
MANY_TARGET = """
import ctypes, sys, time
f = ctypes.CDLL(sys.argv[1]).gfb_fn000
f.restype = ctypes.c_long
f.argtypes = [ctypes.c_long]
print("ready", flush=True)
while True:
    f(64)
    time.sleep(0.0002)
"""


def many_functions(where: Path, n: int) -> Path:
    """libgfbN.so with gfb_fn000 .. gfb_fn{n-1}, built with cc."""
    src = where / f"gfb{n}.c"
    src.write_text(
        "".join(
            f"__attribute__((noinline)) long {MANY_PREFIX}{i:03d}(long x) "
            f"{{ return x * {i + 3} + (x >> {i % 7 + 1}); }}\n"
            for i in range(n)
        )
    )
    lib = where / f"libgfb{n}.so"
    subprocess.run(["cc", "-O1", "-fno-ipa-icf", "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True)  # fmt: skip
    return lib


def mono_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def start_target(
    kind: str = "libz", many: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """The target and the library path as it maps it; many: the library
    of --fns N (MANY_TARGET calls its first function)."""
    prog, mapped, _fn = TARGETS[kind]
    args = [sys.executable, "-c", prog]
    if many is not None:
        args, mapped = [sys.executable, "-c", MANY_TARGET, str(many)], many.name
    p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    maps = Path(f"/proc/{p.pid}/maps").read_text().splitlines()
    lib = next(ln.split()[-1] for ln in maps if mapped in ln)
    return p, lib


def gpufault_once(
    pid: int,
    cache: Path,
    db: Path,
    tree: Path | None = REPO,
    lib: str = "libz",
    fn: str = "crc32",
    *,
    python: str = sys.executable,
    env_extra: dict[str, str] | None = None,
    flags: tuple[str, ...] = (),
) -> dict[str, float]:
    """tree None: the gpufault `python` imports (the wheel on the GPU host,
    the clean venv's). flags: the interpreter's (-S: no `site`)."""
    env = {**os.environ, "GPUFAULT_CACHE_DIR": str(cache), **(env_extra or {})}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    argv = [python, *flags, "-m", "pyctl", "trace", "--pid", str(pid), "--lib", lib,
            "--fn", fn, "--no-stack", "--db", str(db)]  # fmt: skip
    t0 = mono_ns()
    p = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tree or cache.parent,
    )
    assert p.stderr is not None
    banner = None
    while banner is None:
        line = p.stderr.readline()
        if not line:
            raise RuntimeError(f"gpufault ended before its probes were live: {p.wait()}")
        if "Ctrl-C to end" in line:
            banner = mono_ns()
    # The first call is in the ring now; let the consumer store a batch.
    time.sleep(0.3)
    t_int = mono_ns()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=DEADLINE_S)
    t_exit = mono_ns()
    with sqlite3.connect(db) as c:
        # The database is reused, as the default one is: this run's calls.
        (first,) = c.execute(
            "SELECT min(ts_ns) FROM calls WHERE run_id = "
            "(SELECT run_id FROM runs ORDER BY started DESC LIMIT 1)"
        ).fetchone()
    if first is None:
        raise RuntimeError("gpufault stored no call")
    return {
        "first_call_ms": (first - t0) / 1e6,
        "banner_ms": (banner - t0) / 1e6,
        "exit_after_sigint_ms": (t_exit - t_int) / 1e6,
    }


def imports_once(
    tree: Path | None = REPO, python: str = sys.executable, flags: tuple[str, ...] = ()
) -> dict[str, float]:
    """The floor under gpufault's number: the interpreter's start and the
    imports of `trace` (its --help), without resolving or loading."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    t0 = mono_ns()
    subprocess.run([python, *flags, "-c", "pass"], check=True)
    t1 = mono_ns()
    subprocess.run([python, *flags, "-m", "pyctl", "trace", "--help"], check=True, env=env,
                   stdout=subprocess.DEVNULL, cwd=tree or "/")  # fmt: skip
    t2 = mono_ns()
    return {"python_start_ms": (t1 - t0) / 1e6, "trace_help_ms": (t2 - t1) / 1e6}


def bpftrace_once(pid: int, libz: str, fn: str = "crc32") -> dict[str, float]:
    prog = (
        'BEGIN { printf("begin %llu\\n", nsecs); } '
        f'uprobe:{libz}:{fn} /pid == {pid}/ {{ printf("first %llu\\n", nsecs); exit(); }}'
    )
    t0 = mono_ns()
    r = subprocess.run(["bpftrace", "-e", prog], capture_output=True, text=True,
                       timeout=DEADLINE_S)  # fmt: skip
    t_exit = mono_ns()
    vals = dict(ln.split() for ln in r.stdout.splitlines() if ln.startswith(("begin", "first")))
    if "first" not in vals:
        raise RuntimeError(f"bpftrace saw no call: {r.stderr.strip()[-300:]}")
    first = int(vals["first"])
    return {
        "first_call_ms": (first - t0) / 1e6,
        "begin_ms": (int(vals["begin"]) - t0) / 1e6,
        # exit() at the first call: detaching its one probe and ending.
        "exit_after_first_ms": (t_exit - first) / 1e6,
    }


# pyproject's dependencies a trace run imports (click, rust-demangler), by
# their import names (pyelftools left them: pyctl/elf.py reads ELF).
RUN_DEPS = ("click", "rust_demangler")


def clean_venv(where: Path, tree: Path) -> str:
    """A venv that imports gpufault as an installed wheel does: the package
    and click as plain directories in its own site-packages, no .pth file
    and no editable-install finder (this machine's site-packages has both,
    plus a sandbox's certifi hook: 50-65 ms of `site` before any of our
    code). The package is a link to this checkout, so the bytes are the
    same; returns its python."""
    import importlib

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = next((where / "lib").glob("python3*/site-packages"))
    (site / "pyctl").symlink_to(tree / "pyctl")
    for dep in RUN_DEPS:  # pure Python: copied as pip would unpack them
        shutil.copytree(Path(importlib.import_module(dep).__file__ or "").parent, site / dep)
    return str(where / "bin" / "python")


class Server:
    """`gpufault serve` for one interpreter and tree, listening in run_dir;
    started() returns once it listens (its "listening" line). Its later
    lines are read into `lines` (one per request it served), so its pipe
    never fills."""

    def __init__(self, python: str, tree: Path | None, run_dir: Path) -> None:
        env = {**os.environ, "GPUFAULT_RUN_DIR": str(run_dir)}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        self.proc = subprocess.Popen([python, "-m", "pyctl", "serve"], stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=tree or run_dir.parent)  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        self.lines.extend(self.proc.stderr)

    def started(self) -> Server:
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        if "listening" not in line:
            self.proc.kill()
            raise RuntimeError(f"gpufault serve did not start: {line.strip()}")
        self._reader.start()
        return self

    def stop(self) -> None:
        self.proc.terminate()

    def served(self) -> int:
        """Requests the stopped server forked a controller for."""
        self.proc.wait()
        self._reader.join(timeout=30)  # to the pipe's EOF
        return sum(1 for ln in self.lines if ": controller " in ln)


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}


def _opt(name: str, default: str | None = None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


class Column:
    """One round's gpufault runs against one target, into r[name]."""

    def __init__(self, r: dict[str, list[dict[str, float]]], pid: int, lib: str, fn: str,
                 cache: Path, db: Path, tree: Path | None) -> None:  # fmt: skip
        self.r, self.pid, self.lib, self.fn = r, pid, lib, fn
        self.cache, self.db, self.tree = cache, db, tree

    def __call__(self, name: str, cache: Path | None = None, d: Path | None = None,
                 tree: Path | None | str = "", **kw: Any) -> None:  # fmt: skip
        t = self.tree if tree == "" else tree
        run = gpufault_once(self.pid, cache or self.cache, d or self.db, t,  # type: ignore[arg-type]
                            self.lib, self.fn, **kw)  # fmt: skip
        self.r.setdefault(name, []).append(run)


def ratio(xs: list[dict[str, float]], ys: list[dict[str, float]]) -> float:
    """Per round, first call of xs over ys: the median."""
    return round(
        statistics.median(
            x["first_call_ms"] / y["first_call_ms"] for x, y in zip(xs, ys, strict=True)
        ),
        3,
    )


def main() -> int:
    if os.geteuid() != 0:
        print("bench_attach: needs root (BPF)", file=sys.stderr)
        return 2
    kind = _opt("--target", "libz") or "libz"
    if kind not in TARGETS:
        print(f"bench_attach: --target {kind}: use one of {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    # --fns 1,100: the same rounds for each count of probed functions (1:
    # the target's crc32; N > 1: a library of N, one glob in both tools).
    try:
        counts = [int(x) for x in (_opt("--fns", "1") or "1").split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts) or (kind != "libz" and counts != [1]):
        print("bench_attach: --fns: counts such as 1,100 (libz target only)", file=sys.stderr)
        return 2
    # --installed: the gpufault on sys.path (the wheel on the GPU host), not
    # this checkout, which has sources only there.
    tree: Path | None = None if "--installed" in sys.argv else REPO
    have_bpftrace = shutil.which("bpftrace") is not None
    if not have_bpftrace and "--no-bpftrace" not in sys.argv:
        print(
            "bench_attach: bpftrace missing: apt-get install bpftrace (or --no-bpftrace)",
            file=sys.stderr,
        )
        return 2
    # Byte-code first, as an installed wheel has it (pip compiles at
    # install): with PYTHONDONTWRITEBYTECODE set, as on this machine, every
    # run would otherwise compile each edited module again (~160 ms seen).
    baseline = None
    if "--baseline" in sys.argv:
        baseline = Path(sys.argv[sys.argv.index("--baseline") + 1]).resolve()
        if not (baseline / "pyctl" / "data" / "gpufault.bpf.o").exists():
            print(f"bench_attach: {baseline} is not a built checkout", file=sys.stderr)
            return 2
    import pyctl

    for t in (Path(pyctl.__file__).parent.parent if tree is None else tree, baseline):
        if t is not None:
            compileall.compile_dir(t / "pyctl", quiet=1)
    load_before = round(os.getloadavg()[0], 2)
    tmp = Path(tempfile.mkdtemp(prefix="gf-bench-attach-"))
    servers: list[Server] = []
    targets: list[subprocess.Popen[str]] = []
    runs: dict[int, dict[str, list[dict[str, float]]]] = {}
    where: dict[int, tuple[int, str, str]] = {}  # count -> (pid, library, --fn)
    sizes: dict[int, int] = {}
    try:
        for n in counts:
            many = many_functions(tmp, n) if n > 1 else None
            target, lib = start_target(kind, many)
            targets.append(target)
            where[n] = (target.pid, lib, f"{MANY_PREFIX}*" if many else TARGETS[kind][2])
            sizes[n] = os.path.getsize(lib)
        warm_cache = tmp / "warm-cache"
        db = tmp / "gf.db"
        # The warm column's own store, as the baseline has its own: the
        # others write gf.db from other cache dirs (cold ones, a server's),
        # where a run's "known whole" note (pyctl/evidence/store.py) is not
        # found, so each warm start re-read a store six columns had grown.
        warm_db = tmp / "warm.db"
        for pid, lib, fn in where.values():  # fill the cache, the dbs
            gpufault_once(pid, warm_cache, warm_db, tree, lib, fn)
            gpufault_once(pid, warm_cache, db, tree, lib, fn)
            if baseline is not None:  # its own cache and db: its formats may differ
                gpufault_once(pid, tmp / "base-cache", tmp / "base.db", baseline, lib, fn)
        vpy = clean_venv(tmp / "venv", tree) if tree is not None else None
        run_dir, venv_run_dir = tmp / "run", tmp / "venv-run"
        servers.append(Server(sys.executable, tree, run_dir).started())
        via_server = {"GPUFAULT_RUN_DIR": str(run_dir)}
        via_venv_server = {"GPUFAULT_RUN_DIR": str(venv_run_dir)}
        if vpy is not None:
            servers.append(Server(vpy, None, venv_run_dir).started())
        serial = {"GPUFAULT_NO_EARLY_LOAD": "1", "GPUFAULT_NO_EARLY_ATTACH": "1"}
        no_site = ("-S",) if tree is not None else ()  # -m pyctl under -S: PYTHONPATH finds it
        for i in range(REPS):
            # Interleaved, so load on the machine falls on every column alike.
            for n, (pid, lib, fn) in where.items():
                r = runs.setdefault(n, {})
                col = Column(r, pid, lib, fn, warm_cache, db, tree)

                if n == 1:
                    col("gpufault_cold", tmp / f"cold-cache-{i}")
                col("gpufault_warm", d=warm_db)
                col("gpufault_warm_early_attach_off", env_extra={"GPUFAULT_NO_EARLY_ATTACH": "1"})
                if n == 1:  # neither early step: the start before both
                    col("gpufault_warm_early_load_off", env_extra=serial)
                if no_site:
                    col("gpufault_warm_no_site", flags=no_site)
                col("gpufault_served", env_extra=via_server)
                if no_site:
                    col("gpufault_served_no_site", env_extra=via_server, flags=no_site)
                if vpy is not None:
                    col("gpufault_warm_clean_venv", tree=None, python=vpy)
                    col("gpufault_served_clean_venv", tree=None, python=vpy,
                        env_extra=via_venv_server)  # fmt: skip
                if have_bpftrace:
                    r.setdefault("bpftrace", []).append(bpftrace_once(pid, lib, fn))
                if n == counts[0]:
                    r.setdefault("floor", []).append(imports_once(tree))
                    if no_site:
                        r.setdefault("floor_no_site", []).append(imports_once(tree, flags=no_site))
                    if vpy is not None:
                        r.setdefault("floor_clean_venv", []).append(imports_once(None, vpy))
                if baseline is not None:
                    col("baseline_warm", tmp / "base-cache", tmp / "base.db", tree=baseline)
    finally:
        for srv in servers:
            srv.stop()
        served_by = [srv.served() for srv in servers]
        for t in targets:
            t.kill()
            t.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    # A run the server refused (other code: a file edited meanwhile) would
    # have run in-process and measured nothing of the server.
    per_server = (("gpufault_served", "gpufault_served_no_site"), ("gpufault_served_clean_venv",))
    want = [sum(len(r.get(c, [])) for r in runs.values() for c in cols) for cols in per_server]
    want = want[: len(servers)]
    if served_by != want:
        print(f"bench_attach: the servers served {served_by} of {want} runs: "
              "was pyctl edited during the bench?", file=sys.stderr)  # fmt: skip
        return 1
    machine = {"kernel": platform.release(), "cpus": os.cpu_count(),
               "python": platform.python_version()}  # fmt: skip
    by_count = {n: summarize(r) for n, r in runs.items()}
    for n, res in by_count.items():
        pid, lib, fn = where[n]
        res["function"] = f"{lib}:{fn}"
        res["functions"] = n
        res["library_bytes"] = sizes[n]
    first = by_count[counts[0]]
    out = {"machine": machine, "reps": REPS, "load_avg_1m_before": load_before,
           "load_avg_1m": round(os.getloadavg()[0], 2), **first}  # fmt: skip
    if baseline is not None:
        out["baseline"] = {"tree": str(baseline), "warm": first.get("baseline_warm")}
    if len(counts) > 1:
        out["by_functions"] = {str(n): res for n, res in by_count.items()}
    print(json.dumps(out, indent=2))
    if "--md" in sys.argv and "bpftrace" in first:
        md(out)
    return 0


def summarize(r: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per column, per-round ratios, the raw runs."""
    res: dict[str, Any] = {k: median(v) for k, v in r.items()}
    warm = r["gpufault_warm"]
    res["ratio_served_to_warm"] = ratio(r["gpufault_served"], warm)
    res["ratio_early_attach_on_to_off"] = ratio(warm, r["gpufault_warm_early_attach_off"])
    if "gpufault_warm_early_load_off" in r:
        res["ratio_early_load_on_to_off"] = ratio(
            r["gpufault_warm_early_attach_off"], r["gpufault_warm_early_load_off"]
        )
    if "baseline_warm" in r:
        # Per round, this tree against the baseline measured seconds apart.
        res["ratio_to_baseline_warm"] = ratio(warm, r["baseline_warm"])
    if "bpftrace" in r:
        b = r["bpftrace"]
        # Per round (the same seconds), and of the medians.
        res["ratio_to_bpftrace"] = {
            k.removeprefix("gpufault_"): ratio(v, b)
            for k, v in r.items()
            if k.startswith("gpufault_")
        }
        bm = res["bpftrace"]["first_call_ms"]
        res["ratio_of_medians_to_bpftrace"] = {
            k.removeprefix("gpufault_"): round(res[k]["first_call_ms"] / bm, 2)
            for k in r
            if k.startswith("gpufault_")
        }
    res["raw"] = r
    return res


def md(res: dict) -> None:
    c, w, b = res["gpufault_cold"], res["gpufault_warm"], res["bpftrace"]
    lines = [
        "",
        f"`bench/bench_attach.py` ({res['machine']['kernel']}, {res['machine']['cpus']} CPUs, "
        f"median of {res['reps']}): spawn to first call seen, ms",
        "",
        "| tool | first call | start-up line / BEGIN | ratio to bpftrace |",
        "|---|---|---|---|",
        f"| gpufault cold cache | {c['first_call_ms']} | {c['banner_ms']} | "
        f"{res['ratio_to_bpftrace']['cold']}x |",
        f"| gpufault warm cache | {w['first_call_ms']} | {w['banner_ms']} | "
        f"{res['ratio_to_bpftrace']['warm']}x |",
        f"| bpftrace | {b['first_call_ms']} | {b['begin_ms']} | 1.00x |",
        "",
        f"Floor: `python -c pass` {res['floor']['python_start_ms']} ms, `gpufault trace --help` "
        f"{res['floor']['trace_help_ms']} ms; load average {res['load_avg_1m']}.",
        "",
    ]
    with open(REPO / "docs" / "benchmarks.md", "a") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
