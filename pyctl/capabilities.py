"""What this kernel and host allow, probed for real (never from versions).

Used by `gpufault doctor` and by the engine to choose the fail mechanism.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
MAIN_OBJ = DATA / "gpufault.bpf.o"
REGS_PROBE_OBJ = DATA / "regs_probe.bpf.o"

# The engine's uprobe programs in bpf/gpufault.bpf.c: one entry and one
# return variant is loaded per run, picked by what the kernel allows.
UPROBE_PROGRAMS = (
    "gf_entry",
    "gf_entry_regs",
    "gf_return",
    "gf_return_wu",
    "gf_return_regs",
    "gf_return_regs_wu",
)


def engine_programs(regs: bool, user_writes: bool) -> tuple[str, str]:
    """(entry, return) program names for a kernel that allows pt_regs writes
    (regs) and/or bpf_probe_write_user (user_writes) in uprobe programs."""
    entry = "gf_entry_regs" if regs else "gf_entry"
    ret = ("gf_return_regs" if regs else "gf_return") + ("_wu" if user_writes else "")
    return entry, ret


def select_programs(obj: object, regs: bool, user_writes: bool) -> tuple[str, str]:
    """Autoload only the chosen pair in obj (a libbpf.Object); return it."""
    pair = engine_programs(regs, user_writes)
    for p in UPROBE_PROGRAMS:
        obj.set_autoload(p, p in pair)  # type: ignore[attr-defined]
    return pair


# What a user may ask doctor about (`gpufault doctor --for FEATURE`), and
# what each needs. A check lists the features it is required for; a failing
# check fails doctor only when one of the requested features needs it.
FEATURES = {
    "trace": "trace calls with uprobes (gpufault trace)",
    "inject": "inject faults (gpufault inject, template run)",
    "xids": "record NVIDIA Xids (nvidia:nvidia_dev_xid)",
    "tokenizer-count": "count tokenizer calls with tracefs uprobes (tokenizer probes --target)",
}
DEFAULT_FEATURES = ("trace", "inject")
BPF_FEATURES = ["trace", "inject", "xids"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required_for: list[str] = field(default_factory=list)


def _boot_cached(name: str, trial: Callable[[], bool]) -> bool:
    """trial(), remembered for this boot of this kernel (pyctl/diskcache.py):
    each trial loads a BPF object (and uprobe_multi attaches and detaches a
    link), tens of ms that every `trace --pid` paid before its probes were
    live. Keyed also by the trial object's identity: a rebuilt object is
    tried again. Only root's results are kept (a refusal as another user
    says nothing about the kernel)."""
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
    from pyctl.bpf.libbpf import BpfError, Object

    try:
        obj = Object(REGS_PROBE_OBJ)
    except BpfError:
        return False
    try:
        for p in ("gf_regs_probe", "gf_write_probe", "gf_multi_probe"):
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
    return _boot_cached("regs_writable", lambda: _trial_load("gf_regs_probe"))


@lru_cache(maxsize=1)
def user_writable() -> bool:
    """True when BPF may write user memory (bpf_probe_write_user); kernel
    lockdown (integrity) forbids it, and corrupt then uses the copilot."""
    return _boot_cached("user_writable", lambda: _trial_load("gf_write_probe"))


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
    return _boot_cached("uprobe_multi", _uprobe_multi_trial)


def _uprobe_multi_trial() -> bool:
    import ctypes
    import threading

    from pyctl.bpf.libbpf import BPF_TRACE_UPROBE_MULTI, BpfError, Object, map_lookup
    from pyctl.symbols import resolve

    try:
        libc = resolve.find_library("libc", os.getpid())
        (sym,) = resolve.symbols(libc, "getpid")[:1]
        obj = Object(REGS_PROBE_OBJ)
    except (BpfError, resolve.ResolveError, ValueError):
        return False
    try:
        for p in ("gf_regs_probe", "gf_write_probe", "gf_multi_probe"):
            obj.set_autoload(p, p == "gf_multi_probe")
        obj.set_expected_attach_type("gf_multi_probe", BPF_TRACE_UPROBE_MULTI)
        obj.load()
        obj.attach_uprobe_multi("gf_multi_probe", os.getpid(), libc.path, [sym.offset], [0],
                                False)
        # A call from a thread other than the main one must be seen.
        t = threading.Thread(target=ctypes.CDLL(None).getpid)
        t.start()
        t.join()
        hits = ctypes.c_uint64(0)
        if not map_lookup(obj.map_fd("multi_hits"), ctypes.c_uint32(0), hits):
            return False
        return hits.value >= 1
    except BpfError:
        return False
    finally:
        obj.close()


def _tracefs() -> str | None:
    from pyctl import tracefs

    return tracefs.find()


@lru_cache(maxsize=1)
def nvidia_xid_tracepoint() -> bool:
    """Whether the NVIDIA driver's Xid tracepoint can be attached: a trial
    attach of the raw tracepoint program by name (no tracefs), as the Xid
    monitor does; without root, whether tracefs or kallsyms show it.
    (kallsyms alone is not enough: the H200 host's does not list it.)"""
    if os.geteuid() == 0:
        from pyctl import xid

        try:
            return xid.raw_tracepoint_attaches()
        except Exception:  # noqa: BLE001 - doctor reports, never crashes
            return False
    tf = _tracefs()
    if tf and os.path.isdir(os.path.join(tf, "events/nvidia/nvidia_dev_xid")):
        return True
    try:
        with open("/proc/kallsyms", "rb") as f:
            return any(b" __tracepoint_nvidia_dev_xid" in line for line in f)
    except OSError:
        return False


def _process_tracepoints(obj: object) -> str | None:
    """Attach the engine's signal and exit programs (BTF-typed tracepoints,
    no tracefs) to a loaded object, then detach: None, or why not."""
    from pyctl.bpf.libbpf import BpfError

    try:
        for p in ("gf_signal_deliver", "gf_process_exit"):
            obj.attach(p)  # type: ignore[attr-defined]
        return None
    except BpfError as e:
        return str(e)
    finally:
        obj.detach_all()  # type: ignore[attr-defined]


def ptrace_scope() -> int:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return 0


def checks() -> list[Check]:
    """Every check, each with the features that need it (FEATURES)."""
    out: list[Check] = []
    root = os.geteuid() == 0
    allf = BPF_FEATURES + ["tokenizer-count"]
    out.append(Check("root", root, "euid 0" if root else f"euid {os.geteuid()}",
                     "run as root (sudo gpufault ...)", allf))
    try:
        from pyctl.bpf import libbpf

        major, minor = libbpf.version()
        ok = major >= 1
        where = libbpf_origin()
        out.append(Check("libbpf", ok, f"libbpf {major}.{minor}" + (f" ({where})" if where else ""),
                         "install libbpf1 (>= 1.0), or use the wheel's bundled copy",
                         BPF_FEATURES))
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        out.append(Check("libbpf", False, str(e),
                         "install libbpf1 (>= 1.0) or set GPUFAULT_LIBBPF", BPF_FEATURES))
        return out
    btf = os.path.exists("/sys/kernel/btf/vmlinux")
    out.append(Check("btf", btf, "/sys/kernel/btf/vmlinux" if btf else "missing",
                     "kernel built without CONFIG_DEBUG_INFO_BTF: CO-RE relocations fail",
                     BPF_FEATURES))
    objs = MAIN_OBJ.exists()
    out.append(Check("bpf objects", objs, str(MAIN_OBJ) if objs else "not built",
                     "run make build (or install the wheel, which carries them)",
                     BPF_FEATURES))
    if root and objs:
        from pyctl.bpf.libbpf import BpfError, Object

        obj = None
        try:
            obj = Object(MAIN_OBJ)
            select_programs(obj, regs=False, user_writes=False)
            obj.load()
            out.append(Check("bpf + uprobes", True, "engine programs load",
                             required_for=["trace", "inject"]))
            why = _process_tracepoints(obj)
            out.append(Check(
                "process tracepoints", why is None,
                "signal_deliver, sched_process_exit as BTF-typed tracepoints (no tracefs)"
                if why is None else why,
                "needs CONFIG_DEBUG_INFO_BTF and tp_btf support (5.5+)", ["inject"]))
        except BpfError as e:
            out.append(Check("bpf + uprobes", False, str(e),
                             "need CONFIG_BPF_SYSCALL, CONFIG_UPROBE_EVENTS, CAP_BPF+CAP_PERFMON",
                             ["trace", "inject"]))
        finally:
            if obj is not None:
                obj.close()
        rw = regs_writable()
        out.append(Check(
            "register writes", True,
            "uprobe programs may write pt_regs: fail uses the regs mechanism (no stop)"
            if rw else "verifier refuses pt_regs writes in uprobes: fail uses the ptrace copilot"))
        um = uprobe_multi()
        out.append(Check(
            "uprobe_multi links", True,
            "one link per library: detaching ~100 probes takes ~0.1 s"
            if um else "per-site links (kernel < 6.6?): detaching waits ~0.2 s per probe"))
        wu = user_writable()
        out.append(Check(
            "user memory writes", True,
            "bpf_probe_write_user allowed: corrupt is done in BPF"
            if wu else "bpf_probe_write_user refused (kernel lockdown?): "
            "corrupt uses the ptrace copilot"))
    tf = _tracefs()
    has_tracing = os.path.isdir("/sys/kernel/tracing")
    out.append(Check(
        "tracefs", tf is not None or (root and has_tracing),
        f"{tf} (the engine does not need it)" if tf else
        "not mounted: the engine does not need it; the tokenizer uprobe counter "
        "mounts it at /sys/kernel/tracing when used" if has_tracing else "kernel without tracefs",
        "mount -t tracefs nodev /sys/kernel/tracing", ["tokenizer-count"]))
    xid = nvidia_xid_tracepoint()
    out.append(Check(
        "nvidia xid tracepoint", xid,
        "nvidia:nvidia_dev_xid attaches (raw tracepoint, no tracefs)" if xid else "absent",
        "needs the NVIDIA open kernel module >= 575 loaded; without it Xids are not recorded",
        ["xids"]))
    out.append(_ptrace_check(root))
    out.append(_serve_check())
    return out


def _serve_check() -> Check:
    """`gpufault serve` (docs/resident.md): optional, so only a server of
    other code is a warning (it refuses every request: a lost speed-up)."""
    from pyctl.resident import client, wire

    state = client.ping()
    if state is None:
        return Check("gpufault serve", True,
                     "not running (optional: it cuts trace/inject --pid start-up by about a third)")
    pid, same = state
    if same:
        return Check("gpufault serve", True, f"pid {pid} on {wire.socket_path()}, this code")
    return Check("gpufault serve", False,
                 f"pid {pid} runs other code than this gpufault: it serves nothing",
                 f"kill {pid} and start gpufault serve again")


def _ptrace_check(root: bool) -> Check:
    """The copilot needs ptrace; Yama can forbid it. Only mention Yama where
    the kernel has it."""
    yama = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")
    scope = ptrace_scope()
    if not root:
        return Check("ptrace", False, "not root: the copilot cannot seize threads",
                     "run as root", ["inject"])
    if not yama:
        return Check("ptrace", True, "no Yama LSM: ptrace as root allowed",
                     required_for=["inject"])
    return Check("ptrace", scope < 3, f"yama ptrace_scope={scope}",
                 "ptrace_scope 3 forbids the copilot (reboot needed): fail/stall then "
                 "need register writes", ["inject"])


def libbpf_origin() -> str:
    """'system' or 'bundled' and the path of the libbpf in use, where the
    loader says; '' if it cannot tell."""
    from pyctl.bpf import libbpf

    fn = getattr(libbpf, "origin", None)
    if fn is None:
        return ""
    try:
        kind, path = fn()
    except Exception:  # noqa: BLE001 - doctor reports, never crashes
        return ""
    return f"{kind}: {path}"


def failed_for(res: list[Check], features: tuple[str, ...] | list[str]) -> list[Check]:
    """The failing checks that the requested features need."""
    want = set(features)
    return [c for c in res if not c.ok and want & set(c.required_for)]
