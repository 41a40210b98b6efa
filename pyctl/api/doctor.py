"""`gpufault doctor` as data: what this host and kernel allow, each check
with its fix and the work that needs it.

    from pyctl.api import doctor
    rep = doctor.report(["trace", "xids"])
    if not rep.ok:
        print(rep.failure_line())

The kernel's own trial loads are pyctl/bpf/features.py; this module adds
the host's side (root, tracefs, Yama, the Xid tracepoint, a running
`gpufault serve`) and decides, per requested feature, FAIL or WARN.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from pyctl.exceptions import BadInput

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
    """One line of the report: ok or not, what was seen, how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required_for: list[str] = field(default_factory=list)


@dataclass
class DoctorReport:
    """Every check, read for the requested features."""

    features: list[str]
    checks: list[Check]

    def required(self, c: Check) -> bool:
        """Whether a requested feature needs c (a failing one is FAIL, not WARN)."""
        return bool(set(self.features) & set(c.required_for))

    @property
    def failed(self) -> list[Check]:
        """The failing checks that the requested features need."""
        return failed_for(self.checks, self.features)

    @property
    def ok(self) -> bool:
        return not self.failed

    def failure_line(self) -> str:
        """The one line (without `gpufault: `) that says what cannot run."""
        return (
            f"{', '.join(c.name for c in self.failed)} failed: "
            f"{' / '.join(self.features)} cannot run here until fixed"
        )

    def to_json(self) -> dict[str, Any]:
        """`gpufault doctor --json`."""
        return {
            "features": {f: FEATURES[f] for f in self.features},
            "ok": self.ok,
            "checks": [dict(c.__dict__, required=self.required(c)) for c in self.checks],
        }


def report(features: Sequence[str] | None = None) -> DoctorReport:
    """Run every check for `features` (FEATURES' keys, "all"; default
    trace and inject). Raises BadInput for an unknown feature."""
    want = list(features or DEFAULT_FEATURES)
    if "all" in want:
        want = list(FEATURES)
    if unknown := [f for f in want if f not in FEATURES]:
        raise BadInput(f"doctor: unknown feature {unknown[0]!r}: give one of {', '.join(FEATURES)}")
    return DoctorReport(want, checks())


def failed_for(res: list[Check], features: Sequence[str]) -> list[Check]:
    """The failing checks that the requested features need."""
    want = set(features)
    return [c for c in res if not c.ok and want & set(c.required_for)]


def _tracefs() -> str | None:
    # lazy: pyctl.tracefs (ctypes, +4 modules) only when this runs
    from pyctl import tracefs

    return tracefs.find()


@lru_cache(maxsize=1)
def nvidia_xid_tracepoint() -> bool:
    """Whether the NVIDIA driver's Xid tracepoint can be attached: a trial
    attach of the raw tracepoint program by name (no tracefs), as the Xid
    monitor does; without root, whether tracefs or kallsyms show it.
    (kallsyms alone is not enough: the H200 host's does not list it.)"""
    if os.geteuid() == 0:
        # lazy: pyctl.xid (ctypes, datetime, +21 modules) only when this runs
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


def ptrace_scope() -> int:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return 0


def checks() -> list[Check]:
    """Every check, each with the features that need it (FEATURES)."""
    # lazy: the trials (pyctl.paths, the BPF names) off `import gpufault`
    from pyctl.bpf import features as kf

    out: list[Check] = []
    root = os.geteuid() == 0
    allf = BPF_FEATURES + ["tokenizer-count"]
    out.append(
        Check(
            "root",
            root,
            "euid 0" if root else f"euid {os.geteuid()}",
            "run as root (sudo gpufault ...)",
            allf,
        )
    )
    try:
        major, minor = kf.libbpf_version()
        ok = major >= 1
        where = kf.libbpf_origin()
        out.append(
            Check(
                "libbpf",
                ok,
                f"libbpf {major}.{minor}" + (f" ({where})" if where else ""),
                "install libbpf1 (>= 1.0), or use the wheel's bundled copy",
                BPF_FEATURES,
            )
        )
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        out.append(
            Check(
                "libbpf",
                False,
                str(e),
                "install libbpf1 (>= 1.0) or set GPUFAULT_LIBBPF",
                BPF_FEATURES,
            )
        )
        return out
    btf = os.path.exists("/sys/kernel/btf/vmlinux")
    out.append(
        Check(
            "btf",
            btf,
            "/sys/kernel/btf/vmlinux" if btf else "missing",
            "kernel built without CONFIG_DEBUG_INFO_BTF: CO-RE relocations fail",
            BPF_FEATURES,
        )
    )
    objs = kf.MAIN_OBJ.exists()
    out.append(
        Check(
            "bpf objects",
            objs,
            str(kf.MAIN_OBJ) if objs else "not built",
            "run make build (or install the wheel, which carries them)",
            BPF_FEATURES,
        )
    )
    if root and objs:
        out += _kernel_checks()
    tf = _tracefs()
    has_tracing = os.path.isdir("/sys/kernel/tracing")
    out.append(
        Check(
            "tracefs",
            tf is not None or (root and has_tracing),
            f"{tf} (the engine does not need it)"
            if tf
            else "not mounted: the engine does not need it; the tokenizer uprobe counter "
            "mounts it at /sys/kernel/tracing when used"
            if has_tracing
            else "kernel without tracefs",
            "mount -t tracefs nodev /sys/kernel/tracing",
            ["tokenizer-count"],
        )
    )
    xid = nvidia_xid_tracepoint()
    out.append(
        Check(
            "nvidia xid tracepoint",
            xid,
            "nvidia:nvidia_dev_xid attaches (raw tracepoint, no tracefs)" if xid else "absent",
            "needs the NVIDIA open kernel module >= 575 loaded; without it Xids are not recorded",
            ["xids"],
        )
    )
    out.append(_ptrace_check(root))
    out.append(_pid_namespace_check())
    out.append(_serve_check())
    return out


def _kernel_checks() -> list[Check]:
    """The trial loads (as root, with the objects built)."""
    # lazy: the trials (pyctl.paths, the BPF names) off `import gpufault`
    from pyctl.bpf import features as kf

    out: list[Check] = []
    load_err, tp_err = kf.engine_load()
    if load_err is not None:
        out.append(
            Check(
                "bpf + uprobes",
                False,
                load_err,
                "need CONFIG_BPF_SYSCALL, CONFIG_UPROBE_EVENTS, CAP_BPF+CAP_PERFMON",
                ["trace", "inject"],
            )
        )
    else:
        out.append(
            Check("bpf + uprobes", True, "engine programs load", required_for=["trace", "inject"])
        )
        out.append(
            Check(
                "process tracepoints",
                tp_err is None,
                "signal_deliver, sched_process_exit as BTF-typed tracepoints (no tracefs)"
                if tp_err is None
                else tp_err,
                "needs CONFIG_DEBUG_INFO_BTF and tp_btf support (5.5+)",
                ["inject"],
            )
        )
    rw = kf.regs_writable()
    out.append(
        Check(
            "register writes",
            True,
            "uprobe programs may write pt_regs: fail uses the regs mechanism (no stop)"
            if rw
            else "verifier refuses pt_regs writes in uprobes: fail and stall go through "
            "the signal fast path or the ptrace copilot (see `default mechanism`)",
        )
    )
    out.append(_mechanism_check(rw))
    um = kf.uprobe_multi()
    out.append(
        Check(
            "uprobe_multi links",
            True,
            "one link per library: detaching ~100 probes takes ~0.1 s"
            if um
            else "per-site links (kernel < 6.6?): detaching waits ~0.2 s per probe",
        )
    )
    wu = kf.user_writable()
    out.append(
        Check(
            "user memory writes",
            True,
            "bpf_probe_write_user allowed: corrupt is done in BPF"
            if wu
            else "bpf_probe_write_user refused (kernel lockdown?): corrupt uses the ptrace copilot",
        )
    )
    return out


def _mechanism_check(regs: bool) -> Check:
    """Which mechanism this kernel gives a run's fails and stalls by default,
    and why (docs/copilot.md, "Which mechanism a run gets"): informational.
    The signal path's trial is per target (its libc, seccomp, its handlers,
    a thread at a safe point), so this says what the host offers and where
    each run's answer is kept."""
    import platform  # lazy: only doctor's mechanism line names the machine

    name = "default mechanism"
    if regs:
        return Check(
            name, True, "regs: the verifier takes uprobe register writes, so a fail is "
            "BPF's own write (no helper, no stop); a stall uses the ptrace copilot",
        )  # fmt: skip
    if os.environ.get("GPUFAULT_SIGNAL") == "0":
        return Check(
            name, True, "copilot: GPUFAULT_SIGNAL=0 in this environment turns the signal "
            "fast path off (--mechanism signal still asks for it)",
        )  # fmt: skip
    if ptrace_scope() >= 3:
        return Check(
            name, True, "none for fail and stall: ptrace_scope 3 forbids both the signal "
            "helper's loader and the ptrace copilot (see `ptrace`)",
        )  # fmt: skip
    if platform.machine() != "x86_64":
        return Check(name, True, f"copilot: the signal fast path is x86-64 only, not "
                     f"{platform.machine()}")  # fmt: skip
    # lazy: the fast path's loader (ptrace, ELF) only where doctor asks about it
    from pyctl.fastpath.inject import FastpathError, read_helper

    try:
        read_helper()
    except FastpathError as e:
        return Check(name, True, f"copilot: signal fast path not available ({e})")
    return Check(
        name,
        True,
        "signal, by trial: no BPF register writes here, and gfsig.so is ready; a run of "
        "fail-skips and timed stalls on a --pid target loads it once (~1.5 us per fail "
        "on the dev VM, no ptrace stop); a target it cannot serve (static or musl, a "
        "seccomp filter, both SIGURG and SIGWINCH its own, no thread in a blocking call) "
        "and the specs it does not do (a hang, fail after, corrupt) and `-- CMD` get the "
        "copilot, the reason in the run row (capabilities.signal_refusal); "
        "--mechanism copilot forces the copilot",
    )


def _serve_check() -> Check:
    """`gpufault serve` (docs/resident.md): optional, so only a server of
    other code is a warning (it refuses every request: a lost speed-up)."""
    # lazy: pyctl.resident.wire (+5 modules) only when this runs
    from pyctl.resident import client, wire

    state = client.ping()
    if state is None:
        return Check(
            "gpufault serve",
            True,
            "not running (optional: it cuts trace/inject --pid start-up by about a third)",
        )
    pid, same = state
    if same:
        return Check("gpufault serve", True, f"pid {pid} on {wire.socket_path()}, this code")
    return Check(
        "gpufault serve",
        False,
        f"pid {pid} runs other code than this gpufault: it serves nothing",
        f"kill {pid} and start gpufault serve again",
    )


# The init PID namespace's inode number is fixed (PROC_PID_INIT_INO).
HOST_PID_NS_INO = 0xEFFFFFFC


def _pid_namespace_check() -> Check:
    """BPF filters and reports host pids (bpf_get_current_pid_tgid), the
    copilot and /proc take this namespace's: a gpufault in a PID namespace
    of its own (a container without hostPID) would probe by a pid that
    means another process, or none. It does not translate pids: it says
    how to run it."""
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError as e:
        return Check("pid-namespace", False, f"cannot read /proc/self/ns/pid: {e.strerror}",
                     "mount /proc and run as root", ["trace", "inject"])  # fmt: skip
    if ino == HOST_PID_NS_INO:
        return Check("pid-namespace", True, "the host's: pids here are the ones BPF sees",
                     required_for=["trace", "inject"])  # fmt: skip
    return Check(
        "pid-namespace",
        False,
        f"gpufault runs in a PID namespace of its own (inode {ino}, not the host's): BPF sees "
        "host pids, this /proc another numbering, so --pid and every selector would name the "
        "wrong process",
        "run it in the host's PID namespace: hostPID: true in its pod spec "
        "(deploy/kubernetes/gpufault-agent.yaml), podman/docker run --pid=host",
        ["trace", "inject"],
    )


def _ptrace_check(root: bool) -> Check:
    """The copilot needs ptrace; Yama can forbid it. Only mention Yama where
    the kernel has it."""
    yama = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")
    scope = ptrace_scope()
    if not root:
        return Check(
            "ptrace", False, "not root: the copilot cannot seize threads", "run as root", ["inject"]
        )
    if not yama:
        return Check("ptrace", True, "no Yama LSM: ptrace as root allowed", required_for=["inject"])
    return Check(
        "ptrace",
        scope < 3,
        f"yama ptrace_scope={scope}",
        "ptrace_scope 3 forbids the copilot (reboot needed): fail/stall then need register writes",
        ["inject"],
    )


__all__ = [
    "BPF_FEATURES",
    "DEFAULT_FEATURES",
    "FEATURES",
    "Check",
    "DoctorReport",
    "checks",
    "failed_for",
    "nvidia_xid_tracepoint",
    "ptrace_scope",
    "report",
]
