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


def mono_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def start_target(kind: str = "libz") -> tuple[subprocess.Popen[str], str]:
    prog, mapped, _fn = TARGETS[kind]
    p = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True)
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
) -> dict[str, float]:
    """tree None: the gpufault `python` imports (the wheel on the GPU host,
    the clean venv's)."""
    env = {**os.environ, "GPUFAULT_CACHE_DIR": str(cache), **(env_extra or {})}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    argv = [python, "-m", "pyctl", "trace", "--pid", str(pid), "--lib", lib,
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


def imports_once(tree: Path | None = REPO, python: str = sys.executable) -> dict[str, float]:
    """The floor under gpufault's number: the interpreter's start and the
    imports of `trace` (its --help), without resolving or loading."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    t0 = mono_ns()
    subprocess.run([python, "-c", "pass"], check=True)
    t1 = mono_ns()
    subprocess.run([python, "-m", "pyctl", "trace", "--help"], check=True, env=env,
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


def main() -> int:
    if os.geteuid() != 0:
        print("bench_attach: needs root (BPF)", file=sys.stderr)
        return 2
    kind = _opt("--target", "libz") or "libz"
    if kind not in TARGETS:
        print(f"bench_attach: --target {kind}: use one of {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    fn = TARGETS[kind][2]
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
    target, lib = start_target(kind)
    tmp = Path(tempfile.mkdtemp(prefix="gf-bench-attach-"))
    try:
        # Interleaved, so load on the machine falls on every column alike.
        cold, warm, bpft, floor, base = [], [], [], [], []
        serial, venv, venv_floor = [], [], []  # early load off; the clean venv
        served, venv_served = [], []  # through `gpufault serve` (docs/resident.md)
        servers: list[Server] = []
        warm_cache = tmp / "warm-cache"
        db = tmp / "gf.db"
        # The warm column's own store, as the baseline has its own: the
        # others write gf.db from other cache dirs (cold ones, a server's),
        # where a run's "known whole" note (pyctl/evidence/store.py) is not
        # found, so each warm start re-read a store six columns had grown.
        warm_db = tmp / "warm.db"
        gpufault_once(target.pid, warm_cache, warm_db, tree, lib, fn)  # fills the cache, the db
        gpufault_once(target.pid, warm_cache, db, tree, lib, fn)
        if baseline is not None:  # its own cache and db: its formats may differ
            gpufault_once(target.pid, tmp / "base-cache", tmp / "base.db", baseline, lib, fn)
        vpy = clean_venv(tmp / "venv", tree) if tree is not None else None
        no_early = {"GPUFAULT_NO_EARLY_LOAD": "1"}
        run_dir, venv_run_dir = tmp / "run", tmp / "venv-run"
        servers.append(Server(sys.executable, tree, run_dir).started())
        via_server = {"GPUFAULT_RUN_DIR": str(run_dir)}
        via_venv_server = {"GPUFAULT_RUN_DIR": str(venv_run_dir)}
        if vpy is not None:
            servers.append(Server(vpy, None, venv_run_dir).started())
        for i in range(REPS):
            cold.append(gpufault_once(target.pid, tmp / f"cold-cache-{i}", db, tree, lib, fn))
            warm.append(gpufault_once(target.pid, warm_cache, warm_db, tree, lib, fn))
            serial.append(
                gpufault_once(target.pid, warm_cache, db, tree, lib, fn, env_extra=no_early)
            )
            served.append(
                gpufault_once(target.pid, warm_cache, db, tree, lib, fn, env_extra=via_server)
            )
            if vpy is not None:
                venv.append(gpufault_once(target.pid, warm_cache, db, None, lib, fn, python=vpy))
                venv_floor.append(imports_once(None, vpy))
                venv_served.append(
                    gpufault_once(
                        target.pid, warm_cache, db, None, lib, fn, python=vpy,
                        env_extra=via_venv_server,
                    )
                )  # fmt: skip
            if have_bpftrace:
                bpft.append(bpftrace_once(target.pid, lib, fn))
            floor.append(imports_once(tree))
            if baseline is not None:
                base_db = tmp / "base.db"
                base.append(
                    gpufault_once(target.pid, tmp / "base-cache", base_db, baseline, lib, fn)
                )
    finally:
        for srv in servers:
            srv.stop()
        served_by = [srv.served() for srv in servers]
        target.kill()
        target.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    # A run the server refused (other code: a file edited meanwhile) would
    # have run in-process and measured nothing of the server.
    if served_by != [len(served), len(venv_served)][: len(servers)]:
        print(f"bench_attach: the servers served {served_by} of {len(served)} runs each: "
              "was pyctl edited during the bench?", file=sys.stderr)  # fmt: skip
        return 1
    res = {
        "machine": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },  # fmt: skip
        "function": f"{lib}:{fn}",
        "library_bytes": os.path.getsize(lib),
        "reps": REPS,
        "gpufault_cold": median(cold),
        "gpufault_warm": median(warm),
        # The same warm run with the BPF object loaded after the imports,
        # not beside them (GPUFAULT_NO_EARLY_LOAD=1): what the early load buys.
        "gpufault_warm_early_load_off": median(serial),
        "gpufault_warm_clean_venv": median(venv) if venv else None,
        # Handed to a running `gpufault serve` of the same interpreter.
        "gpufault_served": median(served),
        "ratio_served_to_warm": round(
            statistics.median(
                v["first_call_ms"] / w["first_call_ms"] for v, w in zip(served, warm, strict=True)
            ),
            3,
        ),
        "gpufault_served_clean_venv": median(venv_served) if venv_served else None,
        "bpftrace": median(bpft) if bpft else None,
        "floor": median(floor),
        "floor_clean_venv": median(venv_floor) if venv_floor else None,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "raw": {"gpufault_cold": cold, "gpufault_warm": warm, "bpftrace": bpft, "floor": floor,
                "gpufault_warm_early_load_off": serial, "gpufault_warm_clean_venv": venv,
                "gpufault_served": served, "gpufault_served_clean_venv": venv_served},
    }  # fmt: skip
    res["ratio_early_load_on_to_off"] = round(
        statistics.median(
            w["first_call_ms"] / s["first_call_ms"] for w, s in zip(warm, serial, strict=True)
        ),
        3,
    )
    if baseline is not None:
        res["baseline"] = {"tree": str(baseline), "warm": median(base)}
        res["raw"]["baseline_warm"] = base
        # Per round, this tree against the baseline measured seconds apart.
        res["ratio_to_baseline_warm"] = round(
            statistics.median(
                w["first_call_ms"] / b["first_call_ms"] for w, b in zip(warm, base, strict=True)
            ),
            3,
        )
    if bpft:
        b = res["bpftrace"]["first_call_ms"]
        res["ratio_to_bpftrace"] = {
            "cold": round(res["gpufault_cold"]["first_call_ms"] / b, 2),
            "warm": round(res["gpufault_warm"]["first_call_ms"] / b, 2),
        }
        res["ratio_to_bpftrace"]["served"] = round(res["gpufault_served"]["first_call_ms"] / b, 2)
        if venv:
            res["ratio_to_bpftrace"]["warm_clean_venv"] = round(
                res["gpufault_warm_clean_venv"]["first_call_ms"] / b, 2
            )
            res["ratio_to_bpftrace"]["served_clean_venv"] = round(
                res["gpufault_served_clean_venv"]["first_call_ms"] / b, 2
            )
    print(json.dumps(res, indent=2))
    if "--md" in sys.argv and bpft:
        md(res)
    return 0


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
