"""A kernel-enforced watchdog for stalls: a POSIX timer that kills this
(the controller's) process at an absolute CLOCK_MONOTONIC time.

While the copilot holds a thread in a stall, only the copilot resumes it.
If the controller hangs (deadlock, a C call holding the GIL, SIGSTOP), the
thread would stay stopped forever. The tracer thread therefore keeps this
timer armed at the latest planned stall end plus a grace. When a hung
controller misses that time, the kernel kills the controller, detaches
every tracee (the copilot never sets PTRACE_O_EXITKILL), and the stalled
threads resume. A live controller ends its stalls on time and re-arms or
disarms the timer first, so the timer never fires for it.

Why these choices:
- timer_create(CLOCK_MONOTONIC): the clock of the stall ends and of the
  BPF deadline (bpf_ktime_get_ns). It does not advance while the machine is
  suspended, so a suspend does not kill a live controller. The timer
  belongs to this process only: setitimer/alarm (SIGALRM) and other POSIX
  timers are separate, and fork does not inherit it (exec deletes it).
- SIGKILL as sigev_signo. Linux 6.18 (this VM) accepts it in timer_create
  and delivers it on expiry, also to a SIGSTOPped process, which no other
  signal kills (a stopped process keeps a fatal signal pending until
  SIGCONT). Verified by tests/test_copilot_watchdog.py.
- The fallback, used only if a kernel refuses SIGKILL there (EINVAL):
  FALLBACK_SIGNAL, a real-time signal (default action: terminate; Python
  installs no handler for it; pytest-timeout and alarm() use SIGALRM, not
  this one), sent to the creating thread (SIGEV_THREAD_ID), which unblocks
  it. It kills a controller that is hung while running, but not a
  SIGSTOPped one until SIGCONT.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal
import threading

CLOCK_MONOTONIC = 1
TIMER_ABSTIME = 1
SIGEV_SIGNAL = 0
SIGEV_THREAD_ID = 4
FALLBACK_SIGNAL = signal.SIGRTMAX


class _Sigevent(ctypes.Structure):
    """struct sigevent (x86-64, 64 bytes): value, signo, notify, then a union
    whose first int is the thread id for SIGEV_THREAD_ID."""

    _fields_ = [
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("sigev_tid", ctypes.c_int),
        ("_pad", ctypes.c_int * 11),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if not hasattr(libc, "timer_create"):  # glibc < 2.34 keeps timers in librt
        libc = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
    libc.timer_create.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    libc.timer_settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    libc.timer_gettime.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libc.timer_delete.argtypes = [ctypes.c_void_p]
    return libc


_libc = _load()


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class Watchdog:
    """One POSIX timer whose expiry kills this process.

    Create it on the thread that arms it (the copilot's tracer thread: the
    fallback signal is directed at that thread). arm(), disarm() and
    remaining_ns() are one syscall each; close() deletes the timer.
    """

    def __init__(self, signo: int | None = None) -> None:
        """signo None: SIGKILL, or FALLBACK_SIGNAL if the kernel refuses it."""
        self._timer = ctypes.c_void_p()
        self._lock = threading.Lock()  # close() against arm() from another thread
        self.closed = False
        self.expiry_ns: int | None = None  # armed for (CLOCK_MONOTONIC), None: disarmed
        if signo is None:
            try:
                self._create(signal.SIGKILL)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._create(FALLBACK_SIGNAL)
        else:
            self._create(signo)

    def _create(self, signo: int) -> None:
        sev = _Sigevent()
        sev.sigev_signo = signo
        if signo == signal.SIGKILL:
            sev.sigev_notify = SIGEV_SIGNAL  # kills the whole process whoever gets it
        else:
            # Default action (terminate) only: a Python handler would run in
            # the main thread, which is the one that may be hung.
            if signal.getsignal(signo) != signal.SIG_DFL:
                raise OSError(
                    errno.EBUSY, f"watchdog signal {signo} has a handler: it would not terminate"
                )
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signo})
            sev.sigev_notify = SIGEV_THREAD_ID
            sev.sigev_tid = threading.get_native_id()
        _check(
            _libc.timer_create(CLOCK_MONOTONIC, ctypes.byref(sev), ctypes.byref(self._timer)),
            f"timer_create(CLOCK_MONOTONIC, signal {signo})",
        )
        self.signo = int(signo)

    @property
    def timer_id(self) -> int:
        """The kernel's timer id (the ID line of /proc/PID/timers)."""
        return self._timer.value or 0

    def arm(self, at_ns: int) -> None:
        """Fire at CLOCK_MONOTONIC at_ns (absolute); replaces any earlier expiry."""
        self._settime(max(1, at_ns))
        self.expiry_ns = at_ns

    def disarm(self) -> None:
        self._settime(0)
        self.expiry_ns = None

    def _settime(self, at_ns: int) -> None:
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(at_ns, 1_000_000_000)
        with self._lock:
            if self.closed:
                return
            _check(
                _libc.timer_settime(self._timer, TIMER_ABSTIME, ctypes.byref(spec), None),
                "timer_settime",
            )

    def remaining_ns(self) -> int:
        """What the kernel says is left until expiry; 0 when disarmed or closed."""
        spec = _Itimerspec()
        with self._lock:
            if self.closed:
                return 0
            _check(_libc.timer_gettime(self._timer, ctypes.byref(spec)), "timer_gettime")
        return spec.it_value.tv_sec * 1_000_000_000 + spec.it_value.tv_nsec

    def close(self) -> None:
        """Delete the timer (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.expiry_ns = None
            _check(_libc.timer_delete(self._timer), "timer_delete")
