"""Load gfsig.so into a running process and arm or disarm it (issue 26).

A ptrace-driven call sequence in one thread of the target, the way debuggers
and Frida inject a library: seize one thread that sits in a blocking system
call (a safe point: it holds no libc lock), save its registers, call
memfd_create, fill the memfd from the checked helper file and seal it,
call dlopen("/proc/self/fd/N"), close, dlsym the three names, write the
sites, call gfsig_arm(sig), restore the registers (an interrupted system
call restarts as it would after any signal) and detach. Every call returns
to address 0, whose SIGSEGV stop ends it; the SIGSEGV is never delivered.

x86-64 and glibc 2.34+ (dlopen in libc.so.6) only: anything else is a
FastpathError whose message says why, and the engine uses the copilot.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import signal
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyctl.copilot import ptrace
from pyctl.elf import ElfFile
from pyctl.fastpath.sites import Site
from pyctl.paths import GFSIG
from pyctl.symbols import resolve

# Blocking system calls a thread can be taken from: it is waiting for
# input or time, not inside libc's allocator or loader with a lock held.
SAFE_SYSCALLS = {
    0: "read", 7: "poll", 23: "select", 34: "pause", 35: "nanosleep", 43: "accept",
    45: "recvfrom", 47: "recvmsg", 61: "wait4", 128: "rt_sigtimedwait",
    130: "rt_sigsuspend", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
    270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4",
    441: "epoll_pwait2",
}  # fmt: skip
# -ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND, -ERESTART_RESTARTBLOCK
RESTART = {-512, -513, -514, -516}
MFD_CLOEXEC, MFD_ALLOW_SEALING = 1, 2
F_ADD_SEALS = 1033
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 1, 2, 4, 8
RTLD_NOW = 2
CALL_TIMEOUT_S = 5.0
SAFE_POINT_WAIT_S = 1.0
STATE_MAGIC = 0x3130304749534647
# struct gfsig_state / gfsig_site (pyctl/fastpath/gfsig.h; the layout test
# in tests/test_fastpath.py compiles against it)
STATE_FMT = struct.Struct("=QIIQII QQQQ")
SITE_FMT = struct.Struct("=QqqiIQ")
MAX_SITES = 256
OFF_ARMED, OFF_DEADLINE, OFF_NSITES = 8, 16, 24
OFF_HANDLED = 32
COUNTERS = ("handled", "inert", "foreign", "stray")
OFF_SITES = STATE_FMT.size


class FastpathError(Exception):
    """Why the signal fast path cannot serve this target (one line)."""


class SignalTaken(FastpathError):
    """The target owns this signal (a handler, a thread blocking it): another
    signal may still do."""


def _u64(v: int) -> int:
    return v & 0xFFFFFFFFFFFFFFFF


def _s64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def read_helper() -> bytes:
    """The helper's bytes from a checked fd: a regular file owned by root,
    writable by no one else, opened without following a symlink."""
    try:
        fd = os.open(GFSIG, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FastpathError(f"{GFSIG} missing: run `make build`") from None
    except OSError as e:
        raise FastpathError(f"{GFSIG}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise FastpathError(
                f"{GFSIG}: not a root-owned file writable only by root: not loading it"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _status_mask(path: str, field: str) -> int:
    with open(path, "rb") as f:
        for line in f.read().decode().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    return 0


def check_signal_free(pid: int, signo: int) -> None:
    """The target neither handles nor blocks signo (no thread of it)."""
    bit = 1 << (signo - 1)
    name = signal.Signals(signo).name
    try:
        if _status_mask(f"/proc/{pid}/status", "SigCgt") & bit:
            raise SignalTaken(f"pid {pid} has its own {name} handler")
        for t in os.listdir(f"/proc/{pid}/task"):
            if _status_mask(f"/proc/{pid}/task/{t}/status", "SigBlk") & bit:
                raise SignalTaken(f"thread {t} of pid {pid} blocks {name}")
    except FileNotFoundError:
        raise FastpathError(f"pid {pid}: no such process") from None


def check_no_seccomp_filter(pid: int) -> None:
    """The target runs under no seccomp filter (/proc/PID/status Seccomp: 2
    in any thread). The loader makes calls in the target (memfd_create,
    dlopen's mmap and mprotect, the helper's rt_sigaction): a filter may
    answer one of them by killing the process, so such a target is refused
    before anything is traced (the copilot makes no calls there)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise FastpathError(f"pid {pid}: no such process") from None
    for t in [str(pid), *tids]:
        try:
            with open(f"/proc/{pid}/task/{t}/status", "rb") as f:
                text = f.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Seccomp:") and line.split()[1:2] == ["2"]:
                raise FastpathError(
                    f"pid {pid} runs under a seccomp filter (thread {t}: Seccomp 2), "
                    "which could kill it for the loader's calls"
                )


def _safe_threads(pid: int) -> list[int]:
    """Threads blocked in a safe system call now, the leader first."""
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        raise FastpathError(f"pid {pid}: no such process") from None
    for tid in sorted(tids, key=lambda t: t != pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
                first = f.read().split(b" ", 1)[0]
        except OSError:
            continue
        if first.lstrip(b"-").isdigit() and int(first) in SAFE_SYSCALLS:
            out.append(tid)
    return out


def _wait_stop(tid: int, deadline: float) -> int:
    """The next stop of tid (its waitpid status). Bounded: a call that does
    not come back in time (a lock the thread cannot take) is an error."""
    while True:
        got, status = os.waitpid(tid, os.WNOHANG | ptrace.WALL)
        if got == tid:
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                raise FastpathError(f"thread {tid} exited during the helper's load")
            return status
        if time.monotonic() > deadline:
            raise FastpathError(f"thread {tid} did not come back from a helper call in time")
        time.sleep(0.0002)


@dataclass
class _Libc:
    dlopen: int
    dlsym: int
    dlclose: int
    memfd_create: int
    close: int


def find_runtime(pid: int, lib: resolve.Library, file_off: int) -> int:
    """Where file offset file_off of lib is mapped in pid."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            off, inode = int(parts[2], 16), int(parts[4])
            if inode == lib.inode and off <= file_off < off + (hi - lo):
                return lo + file_off - off
    raise FastpathError(f"{lib.display} offset {file_off:#x} is not mapped in pid {pid}")


def find_libc(pid: int) -> _Libc:
    try:
        lib = resolve.find_library("libc.so.6", pid)
        if not lib.mapped:
            raise resolve.ResolveError("not mapped")
        addrs = {}
        for name in ("dlopen", "dlsym", "dlclose", "memfd_create", "close"):
            (sym,) = resolve.symbols(lib, name)
            addrs[name] = find_runtime(pid, lib, sym.offset - (4 if sym.skipped_endbr else 0))
    except (resolve.ResolveError, ValueError) as e:
        raise FastpathError(
            f"pid {pid} maps no glibc 2.34+ libc.so.6 with dlopen (static, musl?): {e}"
        ) from None
    return _Libc(**addrs)


class _Session:
    """One thread of the target held for a sequence of calls."""

    def __init__(self, pid: int):
        self.pid = pid
        self.tid = 0
        self.saved: tuple[int, ...] = ()
        self.mem = -1
        self.pass_sig = 0

    def __enter__(self) -> _Session:
        # No event says "a thread entered a blocking call": look again for a
        # bounded while (a thread between two calls is a moment away).
        end = time.monotonic() + SAFE_POINT_WAIT_S
        while True:
            if self._take():
                return self
            if time.monotonic() > end:
                raise FastpathError(
                    f"no thread of pid {self.pid} is waiting in a blocking system call "
                    "(a safe point to load the helper from)"
                )
            time.sleep(0.001)

    def _take(self) -> bool:
        """Seize and interrupt a thread at a safe point; False if none is."""
        pid = self.pid
        for tid in _safe_threads(pid):
            try:
                ptrace.seize(tid, 0)
            except PermissionError:
                raise FastpathError(
                    f"not permitted to ptrace pid {pid} (traced already, or no CAP_SYS_PTRACE)"
                ) from None
            except ProcessLookupError:
                continue
            self.tid = tid
            try:
                if self._at_safe_point(tid):
                    return True
            except BaseException:
                self._let_go()  # never leave a thread seized behind an error
                raise
            self._let_go()  # it left its system call meanwhile
        return False

    def _at_safe_point(self, tid: int) -> bool:
        """Interrupt the seized tid; True when its stop is inside a safe
        blocking system call (its registers then saved)."""
        ptrace.interrupt(tid)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        status = _wait_stop(tid, deadline)
        while (status >> 16) != ptrace.PTRACE_EVENT_STOP:
            # A signal arrived first: keep it for the detach.
            self.pass_sig = os.WSTOPSIG(status)
            ptrace.cont(tid, 0)
            status = _wait_stop(tid, deadline)
        regs = ptrace.getregs(tid)
        ax, orig = _s64(regs[ptrace.REG["ax"]]), _s64(regs[ptrace.REG["orig_ax"]])
        if orig in SAFE_SYSCALLS and ax in RESTART:
            self.saved = regs
            self.mem = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
            return True
        return False

    def _let_go(self) -> None:
        try:
            ptrace.detach(self.tid, self.pass_sig)
        except OSError:
            pass  # gone, or not stopped: the kernel lets go at our exit
        self.tid, self.pass_sig = 0, 0

    def __exit__(self, *exc: object) -> None:
        if self.mem >= 0:
            os.close(self.mem)
            self.mem = -1
        if self.tid:
            try:
                ptrace.setregs(self.tid, self.saved)
                ptrace.detach(self.tid, self.pass_sig)
            except ProcessLookupError:
                pass
            self.tid = 0

    def write(self, addr: int, data: bytes) -> None:
        os.pwrite(self.mem, data, addr)

    def read(self, addr: int, n: int) -> bytes:
        return os.pread(self.mem, n, addr)

    def call(self, fn: int, *args: int | bytes) -> int:
        """fn(*args) in the held thread, returning rax. A bytes argument is
        written (NUL-terminated) below the saved stack, its address passed."""
        regs = list(self.saved)
        saved_sp = self.saved[ptrace.REG["sp"]]
        sp = (saved_sp - 8192) & ~0xF
        area = sp
        vals = []
        for a in args:
            if isinstance(a, bytes):
                b = a + b"\0"
                self.write(area, b)
                vals.append(area)
                area += (len(b) + 15) & ~15
            else:
                vals.append(a)
        if area > saved_sp - 256:
            raise FastpathError("helper call arguments too long")
        call_sp = sp - 16 - 8  # rsp % 16 == 8 at the callee's entry
        self.write(call_sp, struct.pack("<Q", 0))
        for name, v in zip(("di", "si", "dx", "cx", "r8", "r9"), vals, strict=False):
            regs[ptrace.REG[name]] = _u64(v)
        regs[ptrace.REG["ip"]] = fn
        regs[ptrace.REG["sp"]] = call_sp
        regs[ptrace.REG["ax"]] = 0
        regs[ptrace.REG["orig_ax"]] = _u64(-1)  # no syscall restart around the call
        ptrace.setregs(self.tid, regs)
        ptrace.cont(self.tid, 0)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            status = _wait_stop(self.tid, deadline)
            sig = os.WSTOPSIG(status)
            if (status >> 16) == 0 and sig == signal.SIGSEGV:
                got = ptrace.getregs(self.tid)
                if got[ptrace.REG["ip"]] == 0:
                    return got[ptrace.REG["ax"]]
                raise FastpathError(
                    f"a helper call crashed in pid {self.pid} at {got[ptrace.REG['ip']]:#x}"
                )
            if (status >> 16) == 0 and sig != signal.SIGTRAP:
                self.pass_sig = sig  # delivered after the detach
            ptrace.cont(self.tid, 0)


@dataclass
class Helper:
    """gfsig.so as loaded into pid: where its state and entry points are.
    base: counts as they were when this run armed it (a helper stays in the
    target after a run, inert, and the next run re-arms the same copy)."""

    pid: int
    signo: int
    state: int
    arm_fn: int
    disarm_fn: int
    reused: bool = False
    base: dict[str, int] = field(default_factory=dict)

    def raw_counters(self) -> dict[str, int]:
        try:
            fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return dict.fromkeys(COUNTERS, 0)
        try:
            vals = struct.unpack("<4Q", os.pread(fd, 32, self.state + OFF_HANDLED))
        except OSError:
            return dict.fromkeys(COUNTERS, 0)
        finally:
            os.close(fd)
        return dict(zip(COUNTERS, vals, strict=True))

    def counters(self) -> dict[str, int]:
        """This run's counts (read by /proc/PID/mem; zeros when the target is
        gone): handled (injections done), inert (BPF's signal at a site while
        disarmed or past the deadline: the call ran), foreign (someone else's
        signal, passed on), stray (BPF's signal met the thread at no site:
        the call ran)."""
        raw = self.raw_counters()
        if not any(raw.values()):
            return raw
        return {k: raw[k] - self.base.get(k, 0) for k in COUNTERS}

    def unload(self) -> None:
        """gfsig_disarm: the target's own action for the signal back, the
        handler gone. The object stays mapped, inert: a thread can still be
        inside the handler (delivered just before the disarm, not yet run),
        and unmapping its code would crash it. The next run re-arms it."""
        try:
            with _Session(self.pid) as s:
                rc = _s64(s.call(self.disarm_fn))
        except OSError as e:
            raise FastpathError(f"pid {self.pid}: {e.strerror or e}") from None
        if rc:
            raise FastpathError(f"gfsig_disarm in pid {self.pid}: {os.strerror(-rc)}")


F_GET_SEALS = 1034


def _open_memfd(pid: int, fd: int) -> int:
    """fd N of pid for writing, only if it is what memfd_create just made
    there: the target's other threads run meanwhile and could have put any
    file of theirs at N (one they may only read, a device), which root must
    not write or even open for writing. So: O_PATH first (no open side
    effects), checked to be an empty, unlinked, sealable regular file (a
    memfd), then that very inode reopened."""
    path_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    try:
        st = os.fstat(path_fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != 0 or st.st_nlink != 0:
            raise FastpathError(f"pid {pid}: fd {fd} is not the new memfd: not writing to it")
        wfd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.close(path_fd)
    try:
        st2 = os.fstat(wfd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise FastpathError(f"pid {pid}: fd {fd} changed under us: not writing to it")
        # EINVAL unless a memfd; 0 only for a new one that allows sealing
        if fcntl.fcntl(wfd, F_GET_SEALS) != 0:
            raise OSError("sealed")
    except OSError:
        os.close(wfd)
        raise FastpathError(
            f"pid {pid}: fd {fd} is not a new sealable memfd: not writing it"
        ) from None
    except FastpathError:
        os.close(wfd)
        raise
    return wfd


def _dynsyms(blob: bytes) -> dict[str, int]:
    """Offsets of the helper's three names in the object (its first PT_LOAD
    is at 0, so a loaded copy's base + offset is the address)."""
    want = ("gfsig_state", "gfsig_arm", "gfsig_disarm")
    with ElfFile.from_bytes(blob, "gfsig.so") as elf:
        got = {sym.name: sym.value for sym in elf.symbols(".dynsym") if sym.name in want}
    if set(got) != set(want):
        raise FastpathError(f"{GFSIG} lacks {sorted(set(want) - set(got))}: rebuild it")
    return got


def _loaded_copy(pid: int, blob: bytes) -> int | None:
    """Base of a copy of this very helper that an earlier run left in pid
    (its memfd mapping, first page equal to the file's), or None."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/memfd:gfsig") and int(parts[2], 16) == 0:
            base = int(parts[0].split("-")[0], 16)
            try:
                fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    head = os.pread(fd, 4096, base)
                finally:
                    os.close(fd)
            except OSError:
                continue
            if head == blob[:4096]:
                return base
    return None


def _arm(s: _Session, h: Helper, sites: Sequence[Site], deadline_ns: int) -> None:
    st = h.state
    if struct.unpack("<Q", s.read(st, 8))[0] != STATE_MAGIC:
        raise FastpathError("the helper's state has the wrong magic (another gfsig?)")
    table = b"".join(
        SITE_FMT.pack(x.rip_after, x.sp_delta, x.retval, x.err, x.kind, x.stall_ns) for x in sites
    )
    s.write(st + OFF_NSITES, struct.pack("<I", 0))  # no stale site while rewriting
    s.write(st + OFF_SITES, table)
    s.write(st + OFF_DEADLINE, struct.pack("<Q", deadline_ns))
    s.write(st + OFF_NSITES, struct.pack("<I", len(sites)))
    h.base = h.raw_counters()
    rc = _s64(s.call(h.arm_fn, h.signo))
    if rc == -_errno.EBUSY:
        raise SignalTaken(f"pid {h.pid} has its own {signal.Signals(h.signo).name} handler")
    if rc:
        raise FastpathError(
            f"gfsig_arm({signal.Signals(h.signo).name}) in pid {h.pid}: {os.strerror(-rc)}"
        )


def load(pid: int, signo: int, sites: Sequence[Site], deadline_ns: int = 0) -> Helper:
    """Load (or find the copy an earlier run left) and arm the helper in pid
    for these sites. Raises FastpathError with the reason, leaving no
    handler installed and no thread held (a copy loaded by this call and not
    armed is dlclosed again)."""
    try:
        return _load(pid, signo, sites, deadline_ns)
    except OSError as e:  # the target gone mid-way, /proc refused, ...
        raise FastpathError(f"pid {pid}: {e.strerror or e}") from None


def _load(pid: int, signo: int, sites: Sequence[Site], deadline_ns: int) -> Helper:
    if len(sites) > MAX_SITES:
        raise FastpathError(f"at most {MAX_SITES} probe sites for the signal path")
    check_no_seccomp_filter(pid)  # before any ptrace call
    blob = read_helper()
    offs = _dynsyms(blob)
    base = _loaded_copy(pid, blob)
    if base is not None:
        h = Helper(pid, signo, base + offs["gfsig_state"], base + offs["gfsig_arm"],
                   base + offs["gfsig_disarm"], reused=True)  # fmt: skip
        with _Session(pid) as s:
            if struct.unpack("<I", s.read(h.state + OFF_ARMED, 4))[0]:
                # Armed still: a run whose controller died. Its probes went
                # with it; its handler goes now, the target's action back.
                s.call(h.disarm_fn)
            check_signal_free(pid, signo)
            _arm(s, h, sites, deadline_ns)
        return h
    check_signal_free(pid, signo)
    libc = find_libc(pid)
    with _Session(pid) as s:
        mfd = _s64(s.call(libc.memfd_create, b"gfsig", MFD_CLOEXEC | MFD_ALLOW_SEALING))
        if mfd < 0:
            raise FastpathError(f"memfd_create in pid {pid}: {os.strerror(-mfd)}")
        try:
            wfd = _open_memfd(pid, mfd)
            try:
                os.write(wfd, blob)
                fcntl.fcntl(wfd, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW
                            | F_SEAL_WRITE)  # fmt: skip
            finally:
                os.close(wfd)
            handle = s.call(libc.dlopen, f"/proc/self/fd/{mfd}".encode(), RTLD_NOW)
        finally:
            s.call(libc.close, mfd)
        if not handle:
            raise FastpathError(f"dlopen of the helper failed in pid {pid}")
        state = s.call(libc.dlsym, handle, b"gfsig_state")
        if not state:
            s.call(libc.dlclose, handle)
            raise FastpathError(f"the helper in pid {pid} has no gfsig_state")
        lbase = state - offs["gfsig_state"]
        h = Helper(pid, signo, state, lbase + offs["gfsig_arm"], lbase + offs["gfsig_disarm"])
        try:
            _arm(s, h, sites, deadline_ns)
        except FastpathError:
            s.call(libc.dlclose, handle)  # never armed: no handler can be running it
            raise
        return h
