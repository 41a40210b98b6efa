"""What this kernel allows BPF to do, tried for real (never read from the
version): the trial loads of bpf/regs_probe.bpf.c (pt_regs writes,
bpf_probe_write_user, uprobe_multi links) and of the engine's programs.

The engine asks these to choose its mechanism (pyctl/capabilities.py
re-exports them), `gpufault doctor` reports them (pyctl/api/doctor.py).
Light on purpose: libbpf is loaded by a trial, not by the import, since
the `trace` entry imports this module before anything else.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import lru_cache

from pyctl import paths
from pyctl.bpf.names import Main, RegsProbe

MAIN_OBJ = paths.bpf_object(Main.OBJECT.removesuffix(".bpf.o"))
REGS_PROBE_OBJ = paths.bpf_object(RegsProbe.OBJECT.removesuffix(".bpf.o"))

# The engine's uprobe programs in bpf/gpufault.bpf.c: one entry and one
# return variant is loaded per run, picked by what the kernel allows.
UPROBE_PROGRAMS = Main.UPROBE_PROGRAMS


def engine_programs(regs: bool, user_writes: bool) -> tuple[str, str]:
    """(entry, return) program names for a kernel that allows pt_regs writes
    (regs) and/or bpf_probe_write_user (user_writes) in uprobe programs."""
    if regs:
        return Main.ENTRY_REGS, Main.RETURN_REGS_WU if user_writes else Main.RETURN_REGS
    return Main.ENTRY, Main.RETURN_WU if user_writes else Main.RETURN


def select_programs(obj: object, regs: bool, user_writes: bool) -> tuple[str, str]:
    """Autoload only the chosen pair in obj (a libbpf.Object); return it."""
    pair = engine_programs(regs, user_writes)
    for p in UPROBE_PROGRAMS:
        obj.set_autoload(p, p in pair)  # type: ignore[attr-defined]
    return pair


def boot_cached(name: str, trial: Callable[[], bool]) -> bool:
    """trial(), remembered for this boot of this kernel (pyctl/diskcache.py):
    each trial loads a BPF object (and uprobe_multi attaches and detaches a
    link), tens of ms that every `trace --pid` paid before its probes were
    live. Keyed also by the trial object's identity: a rebuilt object is
    tried again. Only root's results are kept (a refusal as another user
    says nothing about the kernel)."""
    # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help`
    from pyctl import diskcache

    try:
        st = REGS_PROBE_OBJ.stat()
        key = f"{name}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return trial()
    hit = diskcache.load_caps().get(key)
    if isinstance(hit, bool):
        return hit
    ok = trial()
    if os.geteuid() == 0:
        diskcache.store_cap(key, ok)
    return ok


def _trial_load(prog: str) -> bool:
    # lazy: pyctl.bpf.libbpf (ctypes, +7 modules) only when this runs
    from pyctl.bpf.libbpf import BpfError, Object

    try:
        obj = Object(REGS_PROBE_OBJ)
    except BpfError:
        return False
    try:
        for p in RegsProbe.PROGRAMS:
            obj.set_autoload(p, p == prog)
        obj.load()
        return True
    except BpfError:
        return False
    finally:
        obj.close()


@lru_cache(maxsize=1)
def regs_writable() -> bool:
    """True when the verifier accepts a uprobe program that writes pt_regs."""
    return boot_cached("regs_writable", lambda: _trial_load(RegsProbe.REGS))


@lru_cache(maxsize=1)
def user_writable() -> bool:
    """True when BPF may write user memory (bpf_probe_write_user); kernel
    lockdown (integrity) forbids it, and corrupt then uses the copilot."""
    return boot_cached("user_writable", lambda: _trial_load(RegsProbe.WRITE))


@lru_cache(maxsize=1)
def uprobe_multi() -> bool:
    """True when the kernel has uprobe_multi links (6.6+) whose pid filter
    takes every thread of the process: tried, never read from the version.
    One link then carries every probe site of a file, and detaching it waits
    for the kernel's RCU grace periods once instead of once per site (~200 ms
    each on 6.18). GPUFAULT_NO_UPROBE_MULTI=1 turns it off (the per-site
    path, as on older kernels)."""
    if os.environ.get("GPUFAULT_NO_UPROBE_MULTI"):
        return False
    return boot_cached("uprobe_multi", _uprobe_multi_trial)


def getpid_site() -> tuple[str, int] | None:
    """(file, file offset) of libc's getpid as this process maps it: the
    trial's probe site. Read from the loader's own address and
    /proc/self/maps, so that this layer needs no ELF reader (pyctl/symbols
    is above it); None when the mapping cannot be found."""
    # lazy: ctypes (+3 modules) only when this runs
    import ctypes

    addr = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    if not addr:
        return None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return parts[5], addr - lo + int(parts[2], 16)
    except OSError:
        return None
    return None


def _uprobe_multi_trial() -> bool:
    # lazy: ctypes (+3 modules) only when this runs
    import ctypes

    # lazy: pyctl.bpf.libbpf (ctypes, +7 modules) only when this runs
    from pyctl.bpf.libbpf import BPF_TRACE_UPROBE_MULTI, BpfError, Object, map_lookup

    site = getpid_site()
    if site is None:
        return False
    path, offset = site
    try:
        obj = Object(REGS_PROBE_OBJ)
    except BpfError:
        return False
    try:
        for p in RegsProbe.PROGRAMS:
            obj.set_autoload(p, p == RegsProbe.MULTI)
        obj.set_expected_attach_type(RegsProbe.MULTI, BPF_TRACE_UPROBE_MULTI)
        obj.load()
        obj.attach_uprobe_multi(RegsProbe.MULTI, os.getpid(), path, [offset], [0], False)
        # A call from a thread other than the main one must be seen.
        t = threading.Thread(target=ctypes.CDLL(None).getpid)
        t.start()
        t.join()
        hits = ctypes.c_uint64(0)
        if not map_lookup(obj.map_fd(RegsProbe.MULTI_HITS), ctypes.c_uint32(0), hits):
            return False
        return hits.value >= 1
    except BpfError:
        return False
    finally:
        obj.close()


def engine_load() -> tuple[str | None, str | None]:
    """Load the engine's programs (no register writes) and attach its
    process tracepoints, then close: (why the load failed, why the
    tracepoints did not attach), None for what worked. Raises nothing the
    kernel refuses; the caller checks root and the object's presence."""
    # lazy: pyctl.bpf.libbpf (ctypes, +7 modules) only when this runs
    from pyctl.bpf.libbpf import BpfError, Object

    obj = None
    try:
        obj = Object(MAIN_OBJ)
        select_programs(obj, regs=False, user_writes=False)
        obj.load()
    except BpfError as e:
        if obj is not None:
            obj.close()
        return str(e), None
    try:
        for p in (Main.SIGNAL_DELIVER, Main.PROCESS_EXIT):
            obj.attach(p)
        return None, None
    except BpfError as e:
        return None, str(e)
    finally:
        obj.detach_all()
        obj.close()


def libbpf_version() -> tuple[int, int]:
    """The loaded libbpf's (major, minor); raises what loading it raised."""
    # lazy: pyctl.bpf.libbpf (ctypes, +7 modules) only when this runs
    from pyctl.bpf import libbpf

    return libbpf.version()


def libbpf_origin() -> str:
    """'system' or 'bundled' and the path of the libbpf in use, where the
    loader says; '' if it cannot tell."""
    # lazy: pyctl.bpf.libbpf (ctypes, +7 modules) only when this runs
    from pyctl.bpf import libbpf

    fn = getattr(libbpf, "origin", None)
    if fn is None:
        return ""
    try:
        kind, path = fn()
    except Exception:  # noqa: BLE001 - doctor reports, never crashes
        return ""
    return f"{kind}: {path}"


__all__ = [
    "MAIN_OBJ",
    "REGS_PROBE_OBJ",
    "UPROBE_PROGRAMS",
    "boot_cached",
    "engine_load",
    "engine_programs",
    "getpid_site",
    "libbpf_origin",
    "libbpf_version",
    "regs_writable",
    "select_programs",
    "uprobe_multi",
    "user_writable",
]
