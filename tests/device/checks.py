"""Device checks: gpufault against the real GPU stack (libcuda, cuBLAS,
NCCL, the driver's Xid tracepoint). Run on the GPU machine through
tests/device/run.sh; every check is its own process with a timeout, and
results.json is rewritten after each one, so a hang costs one check.

    python -m tests.device.checks --out DIR [--only a,b] [--timeout 120]
    python -m tests.device.checks --one NAME --out DIR     (one check, used by the above)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Databases stay on the machine: only a few files may come back from $OUT.
WORK = Path(os.environ.get("GF_WORK", "/tmp/gf-device"))
CHECKS: dict[str, Callable[[Path], dict[str, Any]]] = {}
GROUPS = {
    "single": [
        "env",
        "libs",
        "trace",
        "overhead",
        "oom",
        "leak",
        "corrupt_xid",
        "cublas_torch",
        "cublas_cupy",
        "graph",
        "um",
        "hooks",
        "stream_stall",
        "cufft",
        "cuda_errors",
        "nccl1",
    ],
    "nccl": ["env", "nccl", "trace", "overhead"],
}


def check(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    CHECKS[fn.__name__] = fn
    return fn


# ---- workload processes -------------------------------------------------
class Workload:
    """A tests.device.workloads process: READY, then commands on stdin."""

    def __init__(
        self,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        preexec: Callable[[], None] | None = None,
    ):
        self.name = name
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.device.workloads", name, *args],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=preexec,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self.ready = self.expect("READY", timeout)
        self.pid = self.p.pid

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.err.append(line.rstrip("\n"))
            del self.err[:-40]

    def expect(self, tag: str, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.name}: no {tag} in {timeout:.0f}s; stderr: " + " | ".join(self.err[-5:])
                )
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(
                    f"{self.name}: exited {self.p.wait()} before {tag}; "
                    "stderr: " + " | ".join(self.err[-8:])
                )
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1 :])
            if line.startswith("CRASH "):
                raise RuntimeError(f"{self.name} crashed: {json.loads(line[6:])[-600:]}")

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def finish(self, timeout: float = 60) -> int:
        try:
            if self.p.stdin:
                self.p.stdin.close()
        except OSError:
            pass
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


@contextmanager
def armed(
    specs: list[Any],
    pid: int,
    db: Path,
    kind: str = "device",
    on_fire: Callable[[dict[str, Any]], None] | None = None,
    extra_poll: Callable[[], None] | None = None,
) -> Iterator[Any]:
    """An Engine on pid, owned by one thread (its SQLite connection may only
    be used by the thread that opened it); probes gone on exit."""
    from pyctl.engine import Engine

    for s in specs:
        s.tgid = pid
        # No user stacks: symbolizing torch's libraries (hundreds of MB of
        # ELF) with pyelftools takes tens of seconds per new library.
        s.capture_stack = False
    WORK.mkdir(parents=True, exist_ok=True)
    eng = Engine(specs, db_path=db, pid=pid, argv=["device-check", kind], kind=kind)
    eng.on_fire = on_fire
    started, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def loop() -> None:
        try:
            eng.start()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failed.append(e)
            started.set()
            return
        started.set()
        last_maps = time.monotonic()
        while not stop.is_set():
            try:
                eng.poll(0.05)
                if time.monotonic() - last_maps > 1.0:  # as the runner does
                    last_maps = time.monotonic()
                    eng.refresh_maps()
                if extra_poll:
                    extra_poll()
            except Exception:  # noqa: BLE001 - keep polling, report it
                POLL_ERRORS.append(traceback.format_exc()[-1500:])
                time.sleep(0.05)
        eng.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    started.wait()
    if failed:
        raise failed[0]
    try:
        yield eng
    finally:
        stop.set()
        t.join(120)


POLL_ERRORS: list[str] = []


def tspec(**kw: Any) -> Any:
    from pyctl.templates import build_spec

    return build_spec(kw)


def template_specs(name: str, **sets: Any) -> list[Any]:
    from pyctl import templates

    return templates.get(name).specs({k: str(v) for k, v in sets.items()})


def faults_of(db: Path, run_id: str) -> list[dict[str, Any]]:
    import sqlite3

    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return [
            dict(r)
            for r in con.execute(
                "SELECT fault_id, function, action, retval, call_seq, pid, tid, outcome "
                "FROM faults WHERE run_id=? ORDER BY seq",
                (run_id,),
            )
        ]
    finally:
        con.close()


def sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    return (r.stdout + r.stderr).strip()


# ---- checks ---------------------------------------------------------------
@check
def env(out: Path) -> dict[str, Any]:
    from pyctl import xid

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "kernel": os.uname().release,
        "nvidia_smi": sh(
            "nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id "
            "--format=csv,noheader"
        ),
        "driver": sh("cat /proc/driver/nvidia/version | head -1"),
        "python": sys.version.split()[0],
        "libcuda": sh("ls -l /usr/local/nvidia/lib64/libcuda.so* 2>&1 | head -3"),
        "doctor": sh(f"{sys.executable} -m pyctl doctor"),
        "tracefs": xid.tracefs(),  # run.sh mounts none: the engine needs none
    }
    from pyctl.api import doctor

    info["xid_tracepoint"] = doctor.nvidia_xid_tracepoint()  # kallsyms, no tracefs
    fmt = xid.format_path()
    if fmt is not None:
        text = fmt.read_text()
        (out / "nvidia_dev_xid.format").write_text(text)
        info["xid_layout"] = xid.Layout.from_format(text).rodata()
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpus"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001
        info["torch"] = str(e)
    info["ok"] = bool(info["xid_tracepoint"]) and "H200" in info["nvidia_smi"]
    info["doctor_xids_rc"] = subprocess.run(
        [sys.executable, "-m", "pyctl", "doctor", "--for", "xids"], capture_output=True
    ).returncode
    return info


@check
def libs(out: Path) -> dict[str, Any]:
    """Which catalogued libraries a torch + cupy process really maps."""
    from pyctl.catalog.libraries import lib_for_soname

    w = Workload("libs")
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for line in Path(f"/proc/{w.pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].strip()
        name = lib_for_soname(path)
        if name is None:
            continue
        st = os.stat(path)
        seen.setdefault((st.st_dev, st.st_ino), {"lib": name, "path": path})
    w.send("go")
    w.finish()
    found = sorted({v["lib"] for v in seen.values()})
    return {
        "ok": {"cuda", "cublas", "cublasLt", "cufft", "nccl"} <= set(found),
        "found": found,
        "mapped": sorted(seen.values(), key=lambda v: v["lib"]),
    }


# The default libcuda probe set of the trace and overhead checks.
LIBCUDA_PROBES = [
    "cuLaunchKernel*",
    "cuMemAlloc*",
    "cuMemFree*",
    "cuStreamSynchronize*",
    "cuCtxSynchronize*",
    "cuMemcpy*",
]


def _trace_specs(entry_only: bool = False) -> list[Any]:
    return [
        tspec(lib="libcuda", fn=f, trace=True, entry_only=entry_only, no_stack=True)
        for f in LIBCUDA_PROBES
    ]


def calls_by_symbol(db: Path, run_id: str) -> dict[str, int]:
    import sqlite3

    con = sqlite3.connect(db)
    try:
        return dict(
            con.execute(
                "SELECT f.symbol, count(*) FROM calls c JOIN funcs f ON c.run_id = f.run_id AND "
                "c.func = f.func WHERE c.run_id = ? AND c.kind = 1 GROUP BY f.symbol",
                (run_id,),
            ).fetchall()
        )
    finally:
        con.close()


@check
def trace(out: Path) -> dict[str, Any]:
    """Counts of driver calls seen by gpufault vs what the decode loop did."""
    w = Workload("decode")
    steps = 50
    res: dict[str, Any] = {"workload": w.ready, "steps": steps}
    with armed(_trace_specs(), w.pid, WORK / "trace.db", "trace") as eng:
        w.send(f"STEPS {steps} empty_cache")
        r = w.expect("RESULT", 120)
        cnt = {f: c.calls for f, c in zip(LIBCUDA_PROBES, eng.counters(), strict=True)}
        res["lost"] = eng.lost()
        rid = eng.run_id
    w.finish()
    by_sym = calls_by_symbol(WORK / "trace.db", rid)
    res["result"], res["counts"], res["by_symbol"] = r, cnt, by_sym
    launches = cnt["cuLaunchKernel*"]
    want_k = w.ready["kernels_per_10_steps"] * steps // 10
    res["launches"], res["kernels_expected"] = launches, want_k
    res["checks"] = {
        "launches_match_profiler_kernels": launches == want_k,
        "allocs_match_allocator_segments": by_sym.get("cuMemAlloc_v2", 0)
        == r["segments_allocated"],
        "ctx_syncs_match": cnt["cuCtxSynchronize*"] == steps,
        "stream_syncs_at_least_steps": cnt["cuStreamSynchronize*"] >= steps,
        "nothing_lost": sum(res["lost"].values()) == 0,
    }
    res["ok"] = all(res["checks"].values())
    return res


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@check
def overhead(out: Path) -> dict[str, Any]:
    """Cost on the decode loop of trace and of armed-not-firing faults.

    The loop is one Python thread launching ~75 kernels a step, so its own
    speed drifts by tens of percent over seconds (runs 3 and 4). Hence: the
    workload is pinned to a core of its own and the controller kept off it;
    phases are short (GF_OVERHEAD_STEPS steps); every condition phase sits
    between two baseline phases of the same process, and its cost is the
    ratio of its median step time to the mean of those two neighbours'
    medians. The result is the median of those paired ratios over
    GF_OVERHEAD_ROUNDS rounds, with their interquartile range."""
    cpus = _cpus()
    pin = cpus[-1] if len(cpus) > 2 else None
    if pin is not None:
        os.sched_setaffinity(0, set(cpus) - {pin})
    w = Workload("decode", *(("--cpu", str(pin)) if pin is not None else ()))
    steps = int(os.environ.get("GF_OVERHEAD_STEPS", "200"))
    rounds = int(os.environ.get("GF_OVERHEAD_ROUNDS", "15"))
    kps = w.ready["kernels_per_10_steps"] / 10

    def phase() -> dict[str, Any]:
        w.send(f"STEPS {steps}")
        return w.expect("RESULT", 300)

    never = 2**31 - 1
    conds: dict[str, Callable[[], list[Any]]] = {
        "trace": _trace_specs,
        "armed_launch": lambda: [
            tspec(
                lib="libcuda",
                fn="cuLaunchKernel",
                action="fail",
                ret="CUDA_ERROR_LAUNCH_FAILED",
                nth=never,
            )
        ],
        "armed_alloc": lambda: template_specs("cuda-oom-sticky", after=never),
    }
    for _ in range(3):
        phase()  # settle clocks and caches
    med: dict[str, list[float]] = {k: [] for k in ["base", *conds]}
    ratios: dict[str, list[float]] = {k: [] for k in conds}
    probe_hits: dict[str, int] = {k: 0 for k in conds}
    prev = phase()["step_ms_median"]
    med["base"].append(prev)
    for _ in range(rounds):
        for name, mk in conds.items():
            with armed(mk(), w.pid, WORK / "ovh.db", name) as eng:
                r = phase()
                probe_hits[name] += sum(c.calls for c in eng.counters())
            nxt = phase()["step_ms_median"]
            med[name].append(r["step_ms_median"])
            med["base"].append(nxt)
            ratios[name].append(r["step_ms_median"] / ((prev + nxt) / 2))
            prev = nxt
    w.finish()

    def q(v: list[float], f: float) -> float:
        v = sorted(v)
        return v[min(len(v) - 1, int(f * len(v)))]

    base_ms = statistics.median(med["base"])
    res: dict[str, Any] = {
        "steps_per_phase": steps,
        "rounds": rounds,
        "kernels_per_step": kps,
        "workload_cpu": pin,
        "base_step_ms_median": base_ms,
        "base_step_ms_spread": (max(med["base"]) - min(med["base"])) / base_ms,
        "baseline_launches_per_s": kps * 1000 / base_ms,
        "probe_hits_per_phase": {k: v / rounds for k, v in probe_hits.items()},
        "step_time_ratio": {
            k: {"median": statistics.median(v), "q25": q(v, 0.25), "q75": q(v, 0.75)}
            for k, v in ratios.items()
        },
        "ratios": {k: [round(x, 4) for x in v] for k, v in ratios.items()},
        "phase_medians_ms": {k: [round(x, 4) for x in v] for k, v in med.items()},
    }
    # What can fail: the never-reached fault on cuMemAlloc_v2 (no probe hit
    # at all) must not look slower than baseline beyond the method's noise.
    res["ok"] = res["step_time_ratio"]["armed_alloc"]["median"] < 1.02
    return res


@check
def oom(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    # Sticky from the 4th allocation: torch's retry fails too -> OutOfMemoryError at step 4.
    w = Workload("oom", "--mib", "64", "--steps", "8")
    with armed(template_specs("cuda-oom-sticky", after=3), w.pid, WORK / "oom.db") as eng:
        w.send("go")
        res["sticky"] = w.expect("RESULT", 120)
        rid = eng.run_id
    w.finish()
    res["sticky_faults"] = faults_of(WORK / "oom.db", rid)
    # One failure only: torch frees its cache, retries, and carries on.
    w = Workload("oom", "--mib", "64", "--steps", "8")
    with armed(
        [
            tspec(
                lib="libcuda",
                fn="cuMemAlloc_v2",
                action="fail",
                ret="CUDA_ERROR_OUT_OF_MEMORY",
                nth=4,
            )
        ],
        w.pid,
        WORK / "oom.db",
    ) as eng:
        w.send("go")
        res["single"] = w.expect("RESULT", 120)
        rid = eng.run_id
    w.finish()
    res["single_faults"] = faults_of(WORK / "oom.db", rid)
    s = res["sticky"]
    res["ok"] = (
        s["raised_at_step"] == 4
        and bool(s.get("is_torch_oom"))
        and res["single"]["raised_at_step"] is None
        and len(res["single_faults"]) == 1
    )
    return res


@check
def api(out: Path) -> dict[str, Any]:
    """The library API on the real libcuda (docs/api.md): a sticky
    CUDA_ERROR_OUT_OF_MEMORY from the 4th cuMemAlloc_v2 of a torch process,
    armed with gpufault.arm() in this process and as an isolated child,
    each from a short-lived thread; arm and disarm times; the first fault's
    `show` text from FaultRecord.show()."""
    import gpufault
    from gpufault import Fault

    WORK.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    for isolate in (False, True):
        w = Workload("oom", "--mib", "64", "--steps", "8")
        spec = Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY",
                          sticky=True, after=3)  # fmt: skip
        box: list[Any] = []

        def arm(
            spec: Any = spec, pid: int = w.pid, isolate: bool = isolate, box: list[Any] = box
        ) -> None:
            box.append(gpufault.arm(spec, pid, db=WORK / "api.db", duration=120, isolate=isolate))

        t0 = time.perf_counter()
        th = threading.Thread(target=arm)  # a short-lived thread, as a harness's pool
        th.start()
        th.join()
        armed_ms = (time.perf_counter() - t0) * 1e3
        if not box:
            raise RuntimeError("arm() raised on its thread")
        h = box[0]
        try:
            w.send("go")
            r = w.expect("RESULT", 120)
            fired = h.wait_fires(1, 30)
        finally:
            t1 = time.perf_counter()
            h.disarm()
            disarm_ms = (time.perf_counter() - t1) * 1e3
        w.finish()
        faults = h.faults()
        key = "isolated" if isolate else "in_process"
        res[key] = {
            "armed_ms": round(armed_ms, 1),
            "disarm_ms": round(disarm_ms, 1),
            "mechanism": h.mechanism,
            "status": h.status,
            "counters": vars(h.counters),
            "raised_at_step": r.get("raised_at_step"),
            "is_torch_oom": r.get("is_torch_oom"),
            "fired": fired,
            "faults": len(faults),
            "first_show": faults[0].show()[:3000] if faults else "",
        }
        res[key]["ok"] = (
            fired and r.get("raised_at_step") == 4 and bool(r.get("is_torch_oom"))
            and h.status == "done" and len(faults) >= 1
            and faults[0].function == "cuMemAlloc_v2"
        )  # fmt: skip
    res["ok"] = res["in_process"]["ok"] and res["isolated"]["ok"]
    return res


@check
def leak(out: Path) -> dict[str, Any]:
    w = Workload("leak", "--mib", "1024")
    with armed(
        template_specs("cuda-oom-leak", after=0, max=1, min_bytes="512M"), w.pid, WORK / "leak.db"
    ) as eng:
        w.send("go")
        r = w.expect("RESULT", 120)
        rid = eng.run_id
    w.finish()
    res = {"result": r, "faults": faults_of(WORK / "leak.db", rid)}
    res["ok"] = r["error"] is None and r["leaked"] >= (900 << 20) and len(res["faults"]) == 1
    return res


@check
def corrupt_xid(out: Path) -> dict[str, Any]:
    """corrupt *dptr after cuMemAlloc_v2 -> kernel faults (700) -> Xid linked."""
    from pyctl import xid

    db = WORK / "xid.db"
    mon = xid.XidMonitor(db, window_s=60)
    res: dict[str, Any] = {}
    try:
        mon.start()
        res["xid_monitor"] = "attached"
        res["xid_mode"] = mon.mode  # "raw": no tracefs; "format": the fallback
    except xid.XidError as e:
        res["xid_monitor"] = str(e)
        mon = None  # type: ignore[assignment]
    w = Workload("corrupt")
    spec = tspec(
        lib="libcuda", fn="cuMemAlloc_v2", action="corrupt", corrupt="arg1:set=0x1000", nth=1
    )
    fired: list[dict[str, Any]] = []

    def on_fire(row: dict[str, Any]) -> None:
        fired.append(row)
        if mon is not None:
            mon.note_fault(row)

    with armed([spec], w.pid, db, "corrupt", on_fire=on_fire) as eng:
        w.send("go")
        r = w.expect("RESULT", 120)
        rid = eng.run_id
        time.sleep(0)
    rc = w.finish()
    res.update(result=r, workload_rc=rc, faults=faults_of(db, rid))
    if mon is not None:
        end = time.monotonic() + 15
        while time.monotonic() < end and not mon.seen:
            mon.poll(0.2)
        mon.poll(0.5)
        mon.close()
        import sqlite3

        con = sqlite3.connect(db)
        cols = ("fault_id", "dev", "error_code", "msg", "rule")
        res["xids"] = [
            dict(zip(cols, row, strict=True))
            for row in con.execute("SELECT fault_id, dev, error_code, msg, rule FROM xids")
        ]
        con.close()
    res["dmesg_xid"] = sh("dmesg 2>/dev/null | grep -i xid | tail -5")
    fid = res["faults"][0]["fault_id"] if res["faults"] else None
    # The raw program reads pci_name(pdev) itself: it must look like a BDF.
    res["xid_dev_is_bdf"] = all(
        re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", x["dev"] or "")
        for x in res.get("xids", [])
    )
    res["ok"] = (
        bool(r.get("illegal_address"))
        and bool(res.get("xids"))
        and any(x["fault_id"] == fid for x in res.get("xids", []))
        and res["xid_dev_is_bdf"]
    )
    return res


def _cublas(out: Path, workload: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    w = Workload(workload)
    with armed(template_specs("cublas-create-alloc-failed"), w.pid, WORK / "cublas.db") as eng:
        w.send("go")
        res["create"] = w.expect("RESULT", 120)
        res["create_faults"] = faults_of(WORK / "cublas.db", eng.run_id)
    w.finish()
    w = Workload(workload)
    specs = template_specs("cublas-gemm-exec-failed", every=1, max=1)
    specs += [
        tspec(
            lib="libcublasLt",
            fn="cublasLtMatmul",
            action="fail",
            ret="CUBLAS_STATUS_EXECUTION_FAILED",
            max=1,
        )
    ]
    with armed(specs, w.pid, WORK / "cublas.db") as eng:
        w.send("go")
        res["gemm"] = w.expect("RESULT", 120)
        res["gemm_faults"] = faults_of(WORK / "cublas.db", eng.run_id)
    w.finish()
    res["ok"] = "ALLOC_FAILED" in str(res["create"]["first"]) and "EXECUTION_FAILED" in json.dumps(
        res["gemm"]
    )
    return res


@check
def cublas_torch(out: Path) -> dict[str, Any]:
    return _cublas(out, "cublas_torch")


@check
def cublas_cupy(out: Path) -> dict[str, Any]:
    return _cublas(out, "cublas_cupy")


@check
def graph(out: Path) -> dict[str, Any]:
    w = Workload("graph")
    specs = template_specs("cuda-graph-instantiate-fail", nth=1) + template_specs(
        "cuda-graph-launch-fail", nth=5
    )
    with armed(specs, w.pid, WORK / "graph.db") as eng:
        w.send("go")
        r = w.expect("RESULT", 120)
        f = faults_of(WORK / "graph.db", eng.run_id)
    w.finish()
    res = {"result": r, "faults": f}
    res["ok"] = (
        len(r["builds"]) == 2
        and r["builds"][0] != "ok"
        and r["builds"][1] == "ok"
        and [e[0] for e in r["replay_errors"]] == [5]
        and r["replays_ok"] == 19
    )
    return res


@check
def um(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    w = Workload("um", "--mib", "2048", "--rounds", "4")
    specs = template_specs("cuda-managed-fail", nth=1, prefetch="true", prefetch_every=2)
    with armed(specs, w.pid, WORK / "um.db") as eng:
        w.send("go")
        res["faulted"] = w.expect("RESULT", 300)
        res["faults"] = faults_of(WORK / "um.db", eng.run_id)
    w.finish()
    f = res["faulted"]
    res["ok"] = (
        len(f["alloc_errors"]) == 1 and f["prefetch_rets"] == [0, 1, 0] and bool(f.get("value_ok"))
    )
    return res


@check
def stream_stall(out: Path) -> dict[str, Any]:
    """Template cuda-stream-stall (20 ms on 10% of cuStreamSynchronize) on
    the decode loop: the stalled steps are exactly the fired ones."""
    w = Workload("decode")
    steps = 200
    w.send(f"STEPS {steps} times")
    base = w.expect("RESULT", 120)
    with armed(template_specs("cuda-stream-stall"), w.pid, WORK / "stall.db") as eng:
        w.send(f"STEPS {steps} times")
        r = w.expect("RESULT", 120)
        rid = eng.run_id
        hits = sum(c.calls for c in eng.counters())
    w.finish()
    f = faults_of(WORK / "stall.db", rid)
    slow = [i for i, t in enumerate(r["step_ms"]) if t > base["step_ms_median"] + 15]
    res = {
        "base": {k: v for k, v in base.items() if k != "step_ms"},
        "stalled": {k: v for k, v in r.items() if k != "step_ms"},
        "probe_hits": hits,
        "fires": len(f),
        "slow_steps": len(slow),
        "slow_step_ms": [r["step_ms"][i] for i in slow][:40],
        "faults": f[:5],
    }
    # 10% of ~200 syncs: binomial, 99.99% inside [4, 40]
    res["ok"] = 4 <= len(f) <= 40 and len(slow) == len(f)
    return res


@check
def cufft(out: Path) -> dict[str, Any]:
    """Template cufft-exec-invalid through torch.fft and cupy.fft."""
    res: dict[str, Any] = {}
    for lib in ("torch", "cupy"):
        for plan in (False, True):
            key = f"{lib}_{'plan' if plan else 'exec'}"
            w = Workload("fft", "--lib", lib)
            sets: dict[str, Any] = {"every": 5}
            if plan:
                sets["plan"] = "true"
            with armed(template_specs("cufft-exec-invalid", **sets), w.pid, WORK / "fft.db") as eng:
                w.send("go")
                r = w.expect("RESULT", 120)
                rid = eng.run_id
            w.finish()
            f = faults_of(WORK / "fft.db", rid)
            res[key] = {
                "result": r,
                "faults": [(x["function"], x["retval"], x["call_seq"]) for x in f],
            }

    # Each fire is one error the application saw, and nothing else failed.
    # (Calls per FFT differ: torch makes two cufftXtExec per successful FFT
    # of this shape, so every=5 shows as an error every 3rd FFT.)
    def matched(key: str) -> bool:
        r = res[key]
        execs = [f for f in r["faults"] if "Exec" in f[0]]
        errs = [e[1] for e in r["result"]["errors"]]
        return (
            bool(execs)
            and len(errs) == len(r["faults"])
            and all("INVALID_VALUE" in e or "ALLOC_FAILED" in e or "CuFFTError" in e for e in errs)
        )

    # A failed plan: torch raises at once; cupy (run 6) raised nothing for
    # it: its first error was the first exec fault (it retried the plan).
    tp, cp_ = res["torch_plan"], res["cupy_plan"]
    res["ok"] = (
        all(matched(k) for k in ("torch_exec", "cupy_exec", "torch_plan"))
        and tp["result"]["errors"][0][0] == 1
        and "Plan" in tp["faults"][0][0]
        and "Plan" in cp_["faults"][0][0]
    )
    res["cupy_plan_absorbed"] = len(cp_["faults"]) == len(cp_["result"]["errors"]) + 1
    return res


@check
def cuda_errors(out: Path) -> dict[str, Any]:
    """Class 1 templates on the decode loop: cuda-launch-failed (the 100th
    launch) and cuda-ctx-destroyed (after 10 synchronizations)."""
    res: dict[str, Any] = {}
    for name, sets in (("cuda-launch-failed", {"nth": 100}), ("cuda-ctx-destroyed", {"after": 10})):
        w = Workload("decode")
        kps = w.ready["kernels_per_10_steps"] / 10
        with armed(template_specs(name, **sets), w.pid, WORK / "cuerr.db") as eng:
            w.send("STEPS 40")
            r = w.expect("RESULT", 120)
            rid = eng.run_id
        rc = w.finish()
        res[name] = {
            "result": r,
            "rc": rc,
            "kernels_per_step": kps,
            "faults": [
                (x["function"], x["retval"], x["call_seq"])
                for x in faults_of(WORK / "cuerr.db", rid)
            ][:4],
        }
    la, cd = res["cuda-launch-failed"]["result"], res["cuda-ctx-destroyed"]["result"]
    kps = res["cuda-launch-failed"]["kernels_per_step"]
    res["ok"] = (
        la.get("error") is not None
        and la["error"]["step"] == -(-100 // int(kps))
        and cd.get("error") is not None
        and cd["error"]["step"] == 11
    )
    return res


@check
def nccl1(out: Path) -> dict[str, Any]:
    """ncclSystemError into the 5th ncclAllReduce of a one-rank communicator,
    through cupy (the raw result code) and torch (ProcessGroupNCCL); the
    calls are traced too, so the returned value is on record."""
    res: dict[str, Any] = {}
    for lib in ("cupy", "torch"):
        w = Workload("nccl1", "--lib", lib, env={"NCCL_DEBUG": "WARN"})
        specs = template_specs("nccl-error", nth=5)
        specs += [
            tspec(lib="libnccl", fn=f, trace=True, no_stack=True)
            for f in ("ncclGroupStart", "ncclGroupEnd", "ncclCommGetAsyncError")
        ]
        with armed(specs, w.pid, WORK / "nccl1.db") as eng:
            w.send("go")
            r = w.expect("RESULT", 120)
            rid = eng.run_id
        rc = w.finish()
        res[lib] = {
            "result": r,
            "rc": rc,
            "faults": faults_of(WORK / "nccl1.db", rid)[:3],
            "calls": calls_by_symbol(WORK / "nccl1.db", rid),
            "stderr": w.err[-6:],
        }
    res["ok"] = all(
        res[k]["result"]["errors"] and res[k]["result"]["errors"][0][0] == 5
        for k in ("cupy", "torch")
    )
    return res


@check
def probe_cost(out: Path) -> dict[str, Any]:
    """What one probe hit costs on this host (bench/bench_engine.py: a tight
    loop over an empty function of our own library, no GPU involved), and
    how long attaching the default libcuda probe set to a torch process
    takes. With the decode loop's probe hits per second this bounds the
    trace and armed overheads without the loop's own drift."""

    def bench(script: str) -> dict[str, Any]:
        r = subprocess.run(
            [sys.executable, script],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, "GF_BENCH_CALLS": os.environ.get("GF_BENCH_CALLS", "1000000")},
        )
        try:
            return dict(json.loads(r.stdout[r.stdout.index("{") :]), rc=r.returncode)
        except ValueError:
            return {"rc": r.returncode, "stderr": r.stderr[-2000:]}

    res: dict[str, Any] = {"detach": bench("bench/bench_detach.py")}
    if os.environ.get("GF_PROBE_COST_ENGINE", "1") == "1":
        res["engine"] = bench("bench/bench_engine.py")
    from pyctl.engine import Engine

    w = Workload("decode")
    times = []
    for _ in range(3):
        specs = _trace_specs()
        for s in specs:
            s.tgid, s.capture_stack = w.pid, False
        t0 = time.monotonic()
        eng = Engine(specs, db_path=WORK / "attach.db", pid=w.pid, argv=["attach"], kind="trace")
        eng.start()
        t1 = time.monotonic()
        eng.close()
        times.append(
            {
                "start_s": round(t1 - t0, 3),
                "close_s": round(time.monotonic() - t1, 3),
                "probes": len(eng.atts),
                "uprobe_multi": eng.multi,
            }
        )
    w.finish()
    res["attach_libcuda_trace_set"] = times
    res["ok"] = all(b.get("rc") == 0 for k, b in res.items() if k in ("detach", "engine"))
    return res


@check
def hooks(out: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "pyctl.hooks.gpu_check", "--out", str(out / "hooks.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    try:
        doc = json.loads(Path(out / "hooks.json").read_text())
    except (OSError, ValueError):
        doc = {"stdout": r.stdout[-3000:], "stderr": r.stderr[-3000:]}
    return {"ok": r.returncode == 0, "rc": r.returncode, "hooks": doc}


# ---- NCCL on two GPUs --------------------------------------------------------
NCCL_SAFE = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _ranks(
    n_iters: int,
    extra_env: dict[str, str] | None = None,
    *,
    addr: str = "127.0.0.1",
    preexec: list[Callable[[], None] | None] | None = None,
    timeout_s: int = 30,
) -> list[Workload]:
    port = str(29500 + os.getpid() % 1000)
    ws = []
    for r in (0, 1):
        env = {
            **NCCL_SAFE,
            "MASTER_ADDR": addr,
            "MASTER_PORT": port,
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            **(extra_env or {}),
        }
        ws.append(Workload.__new__(Workload))
        w = ws[-1]
        w.name = f"nccl rank {r}"
        w.p = subprocess.Popen(
            [sys.executable, "-m", "tests.device.nccl_worker", str(n_iters), str(timeout_s)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            preexec_fn=(preexec[r] if preexec else None),
        )
        w.lines, w.err = queue.Queue(), []
        threading.Thread(target=w._read, daemon=True).start()
        threading.Thread(target=w._read_err, daemon=True).start()
        w.pid = w.p.pid
    for w in ws:
        w.ready = w.expect("READY", 180)
    return ws


def _nccl_round(
    out: Path, label: str, specs_rank1: list[Any] | None, n_iters: int, **kw: Any
) -> dict[str, Any]:
    ws = _ranks(n_iters, **kw)
    res: dict[str, Any] = {}
    try:
        ctx = (
            armed(specs_rank1, ws[1].pid, WORK / "nccl.db", label) if specs_rank1 else nullcontext()
        )
        with ctx as eng:
            if eng is not None:
                res["run_id"] = eng.run_id
            for w in ws:
                w.send("go")
            # Each rank on its own: a rank the watchdog aborts has no RESULT.
            res["rank"] = []
            for w in ws:
                try:
                    res["rank"].append(w.expect("RESULT", 150))
                except (RuntimeError, TimeoutError) as e:
                    res["rank"].append({"error": str(e)[:300]})
    except Exception as e:  # noqa: BLE001 - report what happened to each rank
        res["error"] = str(e)
    if "run_id" in res:
        res["faults"] = faults_of(WORK / "nccl.db", res["run_id"])[:4]
        res["calls"] = calls_by_symbol(WORK / "nccl.db", res["run_id"])
    res["rc"] = [w.finish(30) for w in ws]
    res["stderr_tail"] = [w.err[-4:] for w in ws]
    return res


@check
def nccl(out: Path) -> dict[str, Any]:
    import torch

    if torch.cuda.device_count() < 2 and os.environ.get("GF_NCCL_BACKEND") != "gloo":
        return {"ok": False, "skipped": "needs 2 GPUs (kind nvidia-h200-x2)"}
    res: dict[str, Any] = {}
    res["baseline"] = _nccl_round(out, "base", None, 400)
    res["stall"] = _nccl_round(out, "stall", template_specs("nccl-rank-stall"), 400)
    # The error rounds also trace rank 1's NCCL entry points (returns on
    # record) and run NCCL with WARN logging: run 3 saw no exception on the
    # failing rank, and this shows what the library returned and what torch did.
    watch = [
        tspec(lib="libnccl", fn=f, trace=True, no_stack=True)
        for f in ("ncclGroupStart", "ncclGroupEnd", "ncclCommGetAsyncError")
    ]
    dbg = {"NCCL_DEBUG": "WARN"}
    res["system_error"] = _nccl_round(
        out,
        "syserr",
        template_specs("nccl-error", nth=50) + watch,
        200,
        timeout_s=20,
        extra_env=dbg,
    )
    res["remote_error"] = _nccl_round(
        out,
        "remerr",
        template_specs("nccl-error", nth=50, ret="ncclRemoteError") + watch,
        200,
        timeout_s=20,
        extra_env=dbg,
    )
    try:
        res["netem"] = _nccl_netem(out)
    except Exception as e:  # noqa: BLE001
        res["netem"] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-800:]}
    try:
        b0 = res["baseline"]["rank"][0]["p99_ms"]
        s0 = res["stall"]["rank"][0]["p99_ms"]
        res["ok"] = s0 > b0 + 3
    except (KeyError, IndexError, TypeError):
        res["ok"] = False
    return res


def _nccl_netem(out: Path) -> dict[str, Any]:
    from pyctl import netchaos

    res: dict[str, Any] = {"netem_available": netchaos.netem_available()}
    with netchaos.Link() as link:

        def enter(ns: str) -> Callable[[], None]:
            def f() -> None:
                fd = os.open(f"{netchaos.NETNS_DIR}/{ns}", os.O_RDONLY)
                os.setns(fd, os.CLONE_NEWNET)
                os.close(fd)

            return f

        env = {
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1",
            "NCCL_NET": "Socket",
            "NCCL_SOCKET_IFNAME": os.path.commonprefix([link.a.ifname, link.b.ifname]),
        }
        pre = [enter(link.a.ns), enter(link.b.ns)]
        res["ifnames"] = [link.a.ifname, link.b.ifname]
        common = {"addr": link.a.addr, "preexec": pre, "extra_env": env}
        # Each impairment on its own: a kernel without sch_netem refuses delay
        # (netchaos says so) but loss and partitions still work (BPF filter).
        rounds: list[tuple[str, dict[str, Any]]] = [
            ("socket_baseline", {}),
            ("rate_200mbit", {"rate_mbit": 200}),
            ("loss_2pct", {"loss_pct": 2}),
        ]
        if res["netem_available"]:
            rounds.insert(1, ("delay_5ms", {"delay_ms": 5}))
        for label, kw in rounds:
            try:
                if kw:
                    link.set(**kw)
                res[label] = _nccl_round(out, label, None, 100, **common)
                res[label]["drops_a2b"] = link.drop_counters("a2b")
            except Exception as e:  # noqa: BLE001
                res[label] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                link.clear()
        # Partition after a few iterations: the worker sleeps 3 s at iteration 20
        # (GF_PAUSE_AT), and we cut the link then.
        ws = _ranks(200, {**env, "GF_PAUSE_AT": "20"}, addr=link.a.addr, preexec=pre, timeout_s=20)
        for w in ws:
            w.send("go")
        time.sleep(1.5)  # inside the workers' 3 s pause: cut before they resume
        link.partition()
        t0 = time.monotonic()
        part: dict[str, Any] = {}
        try:
            part["rank"] = [w.expect("RESULT", 120) for w in ws]
        except Exception as e:  # noqa: BLE001
            part["error"] = str(e)
        part["seconds_to_results"] = time.monotonic() - t0
        part["rc"] = [w.finish(30) for w in ws]
        part["stderr_tail"] = [w.err[-6:] for w in ws]
        link.heal()
        res["partition"] = part
    return res


# ---- driver ---------------------------------------------------------------
def run_one(name: str, out: Path) -> dict[str, Any]:
    try:
        from pyctl.copilot import block_sigchld

        block_sigchld()  # before any thread: only the copilot takes SIGCHLD
    except ImportError:
        pass
    t0 = time.monotonic()
    try:
        res = CHECKS[name](out)
    except Exception as e:  # noqa: BLE001
        res = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-2000:],
        }
    res["seconds"] = round(time.monotonic() - t0, 1)
    if POLL_ERRORS:
        res["poll_errors"] = POLL_ERRORS[-5:]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--one")
    ap.add_argument("--only", default="single")
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.one:
        print("CHECK " + json.dumps(run_one(a.one, out), default=str), flush=True)
        return 0
    names = GROUPS.get(a.only) or [n for n in re.split(r"[,\s]+", a.only) if n]
    results: dict[str, Any] = {}
    for n in names:
        t0 = time.monotonic()
        print(f"== {n}", flush=True)
        limit = a.timeout * (2.5 if n in ("nccl", "hooks", "overhead") else 1)
        try:
            r = subprocess.run(
                [sys.executable, "-m", "tests.device.checks", "--one", n, "--out", str(out)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=limit,
            )
            line = [x for x in r.stdout.splitlines() if x.startswith("CHECK ")]
            results[n] = (
                json.loads(line[-1][6:])
                if line
                else {
                    "ok": False,
                    "error": f"no result, rc {r.returncode}",
                    "stderr": r.stderr[-2000:],
                }
            )
        except subprocess.TimeoutExpired as e:
            results[n] = {
                "ok": False,
                "error": f"timed out after {limit:.0f}s",
                "stdout": (e.stdout or b"")[-1500:].decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else str(e.stdout)[-1500:],
            }
        results[n].setdefault("seconds", round(time.monotonic() - t0, 1))
        print(
            f"   {n}: ok={results[n].get('ok')} {results[n].get('error', '')} "
            f"({results[n]['seconds']}s)",
            flush=True,
        )
        print("   " + json.dumps(results[n], default=str)[:1200], flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
