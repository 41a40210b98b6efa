"""Network chaos between two network namespaces (fault class 3, network level).

A `Link` creates two namespaces joined by a veth pair, gives each end an
address that exists only inside its namespace, and impairs traffic per
direction at run time:

- delay (+ jitter) and loss with tc netem (sch_netem) on the sender's veth;
- a bandwidth limit: netem's own rate where netem is in use, otherwise a
  tbf (token bucket) root qdisc on the sender's veth (sch_tbf, which
  kernels without sch_netem usually still have);
- loss where the kernel lacks sch_netem, and partitions everywhere, with a
  small tc BPF drop filter (bpf/netchaos.bpf.c: clsact egress, direct
  action) whose drop probability and deadline live in a BPF array map, so
  changing it is one map write.

Nothing outside the namespaces we create is touched. Cleanup always runs:
`Link` is a context manager, registers an atexit hook, and `cleanup()`
removes namespaces left behind by dead owners (the owner pid is in the name).

A window on another process's link (`Link.attach`, the CLI's partition,
delay, loss and rate) cannot outlive its controller: its drop filter
passes everything from the window's deadline on (in the kernel), a
watchdog process removes the window's qdiscs and filter when the
controller dies, and the next window removes one whose controller is dead
or whose deadline has passed (the filter's name says whose and until
when: `Marker`).

Example::

    with Link() as link:
        link.set(delay_ms=20, jitter_ms=2)           # both directions
        link.set(loss_pct=10, direction="a2b")
        link.set(rate_mbit=40, direction="a2b")      # 40 Mbit/s a -> b
        link.partition()
        link.heal()
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import errno
import json
import math
import os
import re
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pyctl import paths
from pyctl.bpf import libbpf, raw
from pyctl.bpf.names import NetChaos
from pyctl.exceptions import GpufaultError

NETNS_DIR = "/run/netns"
# gf + owner pid (hex) + "n" + random hex + side: recognisable, and cleanup()
# can tell whether the owner still runs. Under a test session (tests/
# conftest.py sets GPUFAULT_TEST_ID) "gf" becomes "gf-t<id>-": the suite's
# leak check then looks at its own namespaces only, not at the machine's
# links or another session's.
_NAME_RE = re.compile(r"^(?:gf|gf-t[0-9a-z]{1,16}-)([0-9a-f]+)n([0-9a-f]{6})([ab])$")
_TEST_ID_RE = re.compile(r"^[0-9a-z]{1,16}$")


def _ns_prefix() -> str:
    """gf, or gf-t<id>- under a test session (anything else in the variable is ignored)."""
    tid = os.environ.get("GPUFAULT_TEST_ID", "")
    return f"gf-t{tid}-" if _TEST_ID_RE.match(tid) else "gf"


_CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")
# tc carries a rate as a u32 of bytes per second (tc_ratespec; netem's
# rate too): 2**32 - 1 B/s is 34359.7 Mbit/s. Below 1 kbit/s the token
# bucket's buffer (one burst's transmit time in 64 ns ticks) overflows.
MAX_RATE_MBIT = (2**32 - 1) * 8 / 1e6
MIN_RATE_MBIT = 0.001


class NetChaosError(RuntimeError, GpufaultError):
    """A one-line, actionable error."""


@dataclass
class Impairment:
    """What one direction of the link suffers. Zero everywhere = clean."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    partitioned: bool = False
    rate_mbit: float = 0.0  # bandwidth limit in Mbit/s (10**6 bit/s); 0: none

    def validate(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise NetChaosError("delay and jitter must be >= 0 ms")
        if self.jitter_ms > 0 and self.delay_ms == 0:
            raise NetChaosError("jitter needs a delay: pass delay_ms > 0 too")
        if not 0 <= self.loss_pct <= 100:
            raise NetChaosError("loss must be a percentage between 0 and 100")
        if not math.isfinite(self.rate_mbit) or self.rate_mbit < 0:
            raise NetChaosError("rate must be a finite number of Mbit/s >= 0 (0: no limit)")
        if self.rate_mbit and not MIN_RATE_MBIT <= self.rate_mbit <= MAX_RATE_MBIT:
            raise NetChaosError(
                f"rate must be between {MIN_RATE_MBIT} and {int(MAX_RATE_MBIT)} Mbit/s"
                " (tc's 32-bit byte rate), or 0 for no limit"
            )


# ---------------------------------------------------------------- BPF drop
# bpf/netchaos.bpf.c, built by `make build` into pyctl/data/netchaos.bpf.o:
#   ARP passes (neighbour resolution keeps working); every other packet is
#   counted (seen), passes once deadline_ns (CLOCK_MONOTONIC) is reached,
#   else is dropped when prandom_u32() < threshold. threshold is in
#   [0, 2**32]; 2**32 drops every non-ARP packet (a partition).

_BPF_MAP_LOOKUP, _BPF_MAP_UPDATE = 1, 2
_STATE = struct.Struct("<QQQQ")  # struct netchaos_state: threshold, drops, seen, deadline_ns


def _bpf(cmd: int, attr: bytes) -> int:
    return raw.bpf(cmd, ctypes.create_string_buffer(attr, 128))


class DropFilter:
    """The tc program and its map for one veth end; owns both until close()
    (once attached, the kernel's filter holds them too: a controller that
    dies leaves them in place, and their deadline still applies)."""

    def __init__(self, deadline_ns: int = 0) -> None:
        path = paths.DATA / NetChaos.OBJECT
        if not path.exists():
            raise NetChaosError(f"the tc drop filter {path} is missing: run `make build`")
        try:
            self._obj = libbpf.Object(path)
        except OSError as e:
            raise NetChaosError(f"cannot load the tc drop filter: {e}") from None
        try:
            self._obj.load()
            self.prog_fd = int(libbpf.lib().bpf_program__fd(self._obj.program(NetChaos.DROP)))
            self.map_fd = self._obj.map_fd(NetChaos.STATE)
            # The deadline is in the map before the filter is attached: there
            # is no moment at which it drops without one.
            self._write(0, 0, 0, deadline_ns)
        except OSError as e:
            self._obj.close()
            raise NetChaosError(f"cannot load the tc drop filter: {e}") from None

    def set_threshold(self, fraction: float) -> None:
        threshold = min(1 << 32, max(0, round(fraction * (1 << 32))))
        _, drops, seen, deadline = self._read()
        # Counters may move between the read and the write; they are
        # statistics, a lost increment there is acceptable.
        self._write(threshold, drops, seen, deadline)

    def counters(self) -> tuple[int, int, int]:
        """(threshold, drops, seen) as the kernel sees them now."""
        thr, drops, seen, _ = self._read()
        return thr, drops, seen

    def deadline_ns(self) -> int:
        return self._read()[3]

    def _read(self) -> tuple[int, int, int, int]:
        key = ctypes.c_uint32(0)
        val = ctypes.create_string_buffer(_STATE.size)
        attr = struct.pack(
            "<IIQQQ", self.map_fd, 0, ctypes.addressof(key), ctypes.addressof(val), 0
        )
        _bpf(_BPF_MAP_LOOKUP, attr)
        return _STATE.unpack(val.raw)  # type: ignore[return-value]

    def _write(self, threshold: int, drops: int, seen: int, deadline_ns: int) -> None:
        key = ctypes.c_uint32(0)
        val = ctypes.create_string_buffer(_STATE.pack(threshold, drops, seen, deadline_ns))
        attr = struct.pack(
            "<IIQQQ", self.map_fd, 0, ctypes.addressof(key), ctypes.addressof(val), 0
        )
        _bpf(_BPF_MAP_UPDATE, attr)

    def close(self) -> None:
        self._obj.close()


# ---------------------------------------------------------------- owners
# A window on an attached link (`gpufault netchaos partition|delay|loss|rate`)
# names its drop filter after itself: gf_drop:PID:START:DEADLINE:HANDLE, the
# controller's pid and start time (clock ticks since boot, /proc/PID/stat:
# a later process with the same pid is not it), the filter's deadline (ns of
# CLOCK_MONOTONIC, 0: none) and the major number of its root qdisc (0: none).
# Every window installs the filter (threshold 0 when it drops nothing), so
# the kernel itself says whose an impairment is and until when: its
# watchdog and the next window can remove a dead or expired one, and
# nothing else.

_MARK_RE = re.compile(r"^gf_drop:(\d+):(\d+):(\d+):([0-9a-f]+)$")


@dataclass(frozen=True)
class Marker:
    pid: int
    start: int
    deadline_ns: int
    handle: int  # root qdisc major (handle = major << 16); 0: none

    @property
    def name(self) -> str:
        return f"gf_drop:{self.pid}:{self.start}:{self.deadline_ns}:{self.handle:x}"

    @classmethod
    def parse(cls, name: str | None) -> Marker | None:
        m = _MARK_RE.match(name or "")
        if not m:
            return None
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4), 16))

    def owner_alive(self) -> bool:
        return _start_time(self.pid) == self.start

    def expired(self, now_ns: int | None = None) -> bool:
        now = time.monotonic_ns() if now_ns is None else now_ns
        return self.deadline_ns != 0 and now >= self.deadline_ns


def _start_time(pid: int) -> int | None:
    """Start time of a live pid in clock ticks since boot; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()  # comm may hold spaces and parens
    if rest[0] in ("Z", "X"):
        return None  # exited, not yet reaped: it undoes nothing any more
    return int(rest[19])


_CLSACT_EGRESS = 0xFFFFFFF3


def _markers(ipr: Any, index: int) -> list[Marker]:
    """The window markers among the clsact egress filters of link `index`."""
    # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1 s) only when this runs
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        filters = ipr.get_filters(index=index, parent=_CLSACT_EGRESS)
    except NetlinkError:
        return []  # no clsact
    out = []
    for f in filters:
        opts = f.get_attr("TCA_OPTIONS")
        name = opts.get_attr("TCA_BPF_NAME") if hasattr(opts, "get_attr") else None
        mk = Marker.parse(name)
        if mk is not None and mk not in out:
            out.append(mk)
    return out


def remove_window(ipr: Any, index: int, mk: Marker) -> bool:
    """Remove what the window `mk` installed on link `index` (its root qdisc,
    by its own handle, then its clsact), if its marker is still there.
    True if it was."""
    # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1 s) only when this runs
    from pyroute2.netlink.exceptions import NetlinkError

    if mk not in _markers(ipr, index):
        return False  # its controller undid it, or someone cleaned it already
    if mk.handle:
        # The kernel deletes a root qdisc only if the handle matches: a
        # later window's qdisc (another handle) is never removed.
        with contextlib.suppress(NetlinkError):
            ipr.tc("del", index=index, handle=f"{mk.handle:x}:", root=True)
    with contextlib.suppress(NetlinkError):
        ipr.tc("del", "clsact", index)
    return True


def watchdog_main() -> None:
    """A window's watchdog process (Link.start_watchdog): waits for its
    controller to say "done" on the pipe it inherited. End of file instead (the
    controller died: SIGKILL, a crash) or the deadline plus a grace passing
    (a controller hung past its window) removes the window's impairment,
    if its marker is still there."""
    # Imported before the wait: the undo after a SIGKILL is then netlink
    # calls only (pyroute2's import alone is ~0.5 s on a small machine).
    # lazy: pyroute2 (+246 modules) only in the watchdog child, and before the wait
    from pyroute2 import IPRoute

    spec = json.loads(sys.argv[1])
    mk = Marker(**spec["marker"])
    fd = int(spec["fd"])
    timeout = None
    if mk.deadline_ns:
        timeout = max(0.0, (mk.deadline_ns - time.monotonic_ns()) / 1e9 + spec["grace_s"])
    got = b""
    if select.select([fd], [], [], timeout)[0]:
        got = os.read(fd, 16)
    if got == b"done":
        return
    for ns, index in spec["ends"]:
        try:
            with IPRoute(netns=ns) as ipr:
                remove_window(ipr, index, mk)
        except OSError:
            pass  # the link's namespaces are gone: nothing left to undo


# ---------------------------------------------------------------- netns

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _netns_dir_mounted() -> bool:
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == NETNS_DIR for line in f)
    except OSError:
        return False


# Creating the first named namespace makes /run/netns a mount point (a
# bind mount of itself, as `ip netns add` does) that stays after the last
# namespace is gone. A new machine has none: when this process made it and
# its last namespace goes, it is unmounted again (nothing left behind).
_MADE_NETNS_MOUNT = False


def _create_netns(name: str) -> None:
    global _MADE_NETNS_MOUNT
    # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1000 ms) only when this runs
    from pyroute2 import netns

    before = _netns_dir_mounted()
    netns.create(name)
    if not before and _netns_dir_mounted():
        _MADE_NETNS_MOUNT = True


def _remove_netns(name: str, *, ours_made_the_mount: bool = False) -> None:
    """Remove a namespace; unmount /run/netns once empty if this process
    mounted it, or (cleanup of a dead owner's namespaces) the caller knows
    a gpufault namespace was the reason it exists."""
    global _MADE_NETNS_MOUNT
    # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1000 ms) only when this runs
    from pyroute2 import netns

    netns.remove(name)
    if (
        (_MADE_NETNS_MOUNT or ours_made_the_mount)
        and _netns_dir_mounted()
        and not os.listdir(NETNS_DIR)
    ):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.umount2(NETNS_DIR.encode(), 2) == 0:  # MNT_DETACH
            _MADE_NETNS_MOUNT = False


def run_in_netns(ns: str, fn: Callable[[], _T]) -> _T:
    """Run fn in a short-lived thread that has entered netns `ns`.

    setns(CLONE_NEWNET) changes only the calling thread, and sockets keep
    the namespace they were created in: a socket made here can be used
    from any thread afterwards.
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    t = threading.Thread(target=body, name=f"netns-{ns}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def socket_in(ns: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A new IPv4 socket that lives in netns `ns`."""
    return run_in_netns(ns, lambda: socket.socket(socket.AF_INET, kind))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(all_owners: bool = False) -> list[str]:
    """Remove namespaces made by Link whose owner process is gone.

    all_owners=True also removes those of live owners (a manual reset).
    Deleting a namespace destroys the veth end inside it, and the veth
    peer with it. Returns the names removed.
    """
    # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1000 ms) only when this runs
    from pyroute2 import netns

    removed = []
    for name in sorted(netns.listnetns()):
        m = _NAME_RE.match(name)
        if not m:
            continue
        if not all_owners and _pid_alive(int(m.group(1), 16)):
            continue
        with contextlib.suppress(FileNotFoundError):
            # A dead owner cannot unmount /run/netns after its last one.
            _remove_netns(name, ours_made_the_mount=True)
            removed.append(name)
    return removed


# (kind, options) of a root qdisc, as pyroute2's ipr.tc() takes them.
_Root = tuple[str, dict[str, float]]
_FRAME = 1514  # a full frame on our veth: MTU 1500 + 14-byte Ethernet header


def _root_qdisc(new: Impairment, use_netem: bool) -> _Root | None:
    """The root qdisc that carries new's delay, netem loss and rate, if any."""
    rate = round(new.rate_mbit * 1e6 / 8)  # tc wants bytes per second
    if use_netem:
        opts: dict[str, float] = {
            "delay": int(new.delay_ms * 1000),
            "jitter": int(new.jitter_ms * 1000),
            "loss": new.loss_pct,
            # netem shapes to the rate itself, after the delay. Always sent,
            # 0 too: netem keeps its old rate when the attribute is absent.
            "rate": rate,
        }
        return "netem", opts
    if not rate:
        return None
    # Token bucket sizes:
    # - burst: what may leave back to back at veth speed. The kernel drops
    #   any non-GSO packet larger than the bucket, so at least two full
    #   frames; and at least 1 ms of the rate, so tokens that arrive while
    #   the qdisc watchdog (an hrtimer) wakes up late are not lost and the
    #   link still reaches its rate. Larger bursts only blur the limit at
    #   short time scales (4 MiB at 40 Mbit: 5 kB of burst, 0.1 %).
    # - limit: the queue in bytes, one burst plus 50 ms of the rate, and
    #   never under 16 frames. Measured here (one TCP flow, BBR): with a
    #   20 ms queue a bulk transfer at 1-40 Mbit sometimes reached only
    #   0.8-0.85 of the rate; with this one it got 0.95-0.96 (the payload
    #   share of a frame) every time from 1 to 5000 Mbit. Deeper would only
    #   let a saturated link delay other packets longer. (netem's own rate
    #   queues up to 1000 packets instead.)
    burst = max(2 * _FRAME, rate // 1000)
    limit = burst + max(rate * 50 // 1000, 16 * _FRAME)
    return "tbf", {"rate": rate, "burst": burst, "limit": limit}


def _replace_root(ipr: Any, index: int, root: _Root, major: int = 1) -> None:
    """Create or change (tc `replace`) the root qdisc major: of link `index`."""
    kind, opts = root
    if kind != "netem":
        ipr.tc("replace", kind, index, handle=f"{major:x}:", **opts)
        return
    # pyroute2's tc() also copies netem's `rate` into TCA_RATE (the rate
    # estimator attribute) and then fails to encode it: build the message
    # from its netem plugin ourselves.
    # lazy: pyroute2 (+246 modules, ~1 s) only when this runs
    from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST
    from pyroute2.netlink.rtnl import RTM_NEWQDISC, TC_H_ROOT

    # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1000 ms) only when this runs
    from pyroute2.netlink.rtnl.tcmsg import plugins, tcmsg

    msg = tcmsg()
    msg["header"]["type"] = RTM_NEWQDISC
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE
    msg["index"] = index
    msg["handle"] = major << 16
    msg["parent"] = TC_H_ROOT
    msg["attrs"] = [
        ["TCA_KIND", "netem"],
        ["TCA_OPTIONS", plugins["netem"].get_parameters(dict(opts))],
    ]
    # (nlm_request() of pyroute2 0.9's sync IPRoute fails on a status key;
    # the batch call sends the message as it is and raises the kernel's error.)
    ipr.nlm_request_batch([msg])


@dataclass
class _End:
    ns: str
    ifname: str
    addr: str
    index: int = 0
    root: _Root | None = None  # the root qdisc we installed on this veth end
    major: int = 1  # its handle's major number (a window's own on an attached link)
    drop: DropFilter | None = None
    state: Impairment = field(default_factory=Impairment)


class Link:
    """Two namespaces `a` and `b` joined by a veth pair, impairable per direction."""

    def __init__(self, subnet: str | None = None) -> None:
        tag = secrets.token_hex(3)
        owner = f"{os.getpid():x}"
        # Random /30 in 10.200-254.x.y unless given: no clash between runs.
        if subnet is None:
            rnd = secrets.randbelow(55 * 256 * 64)
            base = f"10.{200 + rnd // (256 * 64)}.{(rnd // 64) % 256}.{(rnd % 64) * 4}"
        else:
            base = subnet
        o = [int(x) for x in base.split(".")]
        if len(o) != 4 or o[0] not in (10, 192) or (o[0] == 192 and o[1] != 168):
            raise NetChaosError("subnet must be a private 10.x or 192.168.x /30 base address")
        a_ip = ".".join(map(str, o[:3] + [o[3] + 1]))
        b_ip = ".".join(map(str, o[:3] + [o[3] + 2]))
        ns = f"{_ns_prefix()}{owner}n{tag}"
        self.a = _End(f"{ns}a", f"gf{tag}a", a_ip)
        self.b = _End(f"{ns}b", f"gf{tag}b", b_ip)
        self._lock = threading.Lock()
        self._closed = False
        self._opened = False
        self._owner = True  # False: attach()ed to another process's link
        self._for_ns = 0  # attached: the window's length (0: until close())
        self._marker: Marker | None = None  # attached: this window's, once installed
        self._watchdog: Any = None  # attached: (Popen, pipe write end)

    @property
    def name(self) -> str:
        """The link's name, as `gpufault netchaos link` prints it."""
        return self.a.ifname[:-1]

    @classmethod
    def attach(cls, name: str | None = None, for_s: float | None = None) -> Link:
        """The live link `name` (gf<6 hex>, from `gpufault netchaos link`) of
        another process, to impair until close(): close() then removes what
        this object installed (its qdisc, its drop filter), never the
        namespaces. name None: the only link there is.

        for_s: the window's length. Its drop filter (installed with the
        first impairment, threshold 0 if it drops nothing) then passes
        everything from that deadline on, in the kernel, whether or not
        this process is still there to lift it. An impairment left by a
        window whose controller is dead or whose deadline has passed is
        removed here, before anything else is refused."""
        if os.geteuid() != 0:
            raise NetChaosError("netchaos needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN): run as root")
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1000 ms) only when this runs
        from pyroute2 import IPRoute, netns

        links: dict[str, dict[str, str]] = {}
        for ns in netns.listnetns():
            m = _NAME_RE.match(ns)
            if m and _pid_alive(int(m.group(1), 16)):
                links.setdefault(f"gf{m.group(2)}", {})[m.group(3)] = ns
        links = {k: v for k, v in links.items() if set(v) == {"a", "b"}}
        if name is None:
            if len(links) != 1:
                if not links:
                    raise NetChaosError("no netchaos link: start one with `gpufault netchaos link`")
                raise NetChaosError(f"{len(links)} links ({', '.join(sorted(links))}): pass --link")
            name = next(iter(links))
        name = name if name.startswith("gf") else f"gf{name}"
        if name not in links:
            raise NetChaosError(
                f"no netchaos link {name} (live: {', '.join(sorted(links)) or 'none'}):"
                " start one with `gpufault netchaos link`"
            )
        self = cls.__new__(cls)
        self._lock, self._closed, self._opened, self._owner = threading.Lock(), False, True, False
        self._for_ns = round(for_s * 1e9) if for_s else 0
        self._marker, self._watchdog = None, None
        ends = []
        for side in ("a", "b"):
            end = _End(links[name][side], f"{name}{side}", "")
            with IPRoute(netns=end.ns) as ipr:
                found = ipr.link_lookup(ifname=end.ifname)
                if not found:
                    raise NetChaosError(f"link {name} has no {end.ifname}: it is being torn down")
                end.index = found[0]
                for a in ipr.get_addr(index=end.index, family=socket.AF_INET):
                    end.addr = a.get_attr("IFA_ADDRESS")
                for mk in _markers(ipr, end.index):
                    # A window that cannot lift its impairment any more (its
                    # controller and watchdog were killed) or need not (past
                    # its deadline, the filter passes everything already).
                    if not mk.owner_alive() or mk.expired():
                        remove_window(ipr, end.index, mk)
                # One impairment at a time per direction: a second would
                # replace the first's qdisc and undo it at its own end.
                for q in ipr.get_qdiscs(index=end.index):
                    kind = q.get_attr("TCA_KIND")
                    if kind in ("netem", "tbf", "clsact"):
                        raise NetChaosError(
                            f"link {name} already has an impairment ({kind} on {end.ifname}):"
                            " wait for it to end, or stop it"
                        )
            ends.append(end)
        self.a, self.b = ends
        # The window's own root qdisc handle (major:), the same on both ends:
        # its watchdog and a later window delete only that one.
        major = 0x100 + secrets.randbelow(0xFF00 - 0x100)
        for end in ends:
            end.major = major
        atexit.register(self.close)
        return self

    def start_watchdog(self, grace_s: float = 2.0) -> None:
        """An attached window's watchdog: a process of its own session that
        removes this window's impairment if this process dies without
        close() (SIGKILL), or if it is still there `grace_s` after the
        window's deadline. close() tells it to go. The drop filter's own
        deadline needs no process; qdiscs (delay, rate, netem loss) have
        none in the kernel, so this one lifts them."""
        assert not self._owner and self._watchdog is None
        pid = os.getpid()
        start = _start_time(pid) or 0
        deadline = time.monotonic_ns() + self._for_ns if self._for_ns else 0
        self._marker = Marker(pid, start, deadline, self.a.major)
        r, w = os.pipe()
        spec = {
            "fd": r,
            "marker": self._marker.__dict__,
            "grace_s": grace_s,
            "ends": [[e.ns, e.index] for e in (self.a, self.b)],
        }
        try:
            # -I and an explicit path: as root, never import a pyctl from
            # the caller's directory or PYTHONPATH.
            pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            code = (
                f"import sys; sys.path.insert(0, {pkg_parent!r}); "
                "from pyctl.netchaos import watchdog_main; watchdog_main()"
            )
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", code, json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                cwd="/",
                pass_fds=(r,),
                start_new_session=True,  # Ctrl-C or a kill of our group is not its end
            )
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._watchdog = (proc, w)

    def _stop_watchdog(self) -> None:
        if self._watchdog is None:
            return
        proc, w = self._watchdog
        self._watchdog = None
        with contextlib.suppress(OSError):
            os.write(w, b"done")
        os.close(w)
        try:
            proc.wait(10)
        except Exception:  # noqa: BLE001 - a stuck watchdog must not keep us
            proc.kill()
            proc.wait(5)

    # -- lifecycle
    def __enter__(self) -> Link:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if os.geteuid() != 0:
            raise NetChaosError("netchaos needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN): run as root")
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~900 ms) only when this runs
        from pyroute2 import IPRoute

        atexit.register(self.close)
        self._opened = True
        try:
            for end in (self.a, self.b):
                _create_netns(end.ns)
            with IPRoute() as ipr:
                ipr.link("add", ifname=self.a.ifname, kind="veth", peer=self.b.ifname)
                for end in (self.a, self.b):
                    idx = ipr.link_lookup(ifname=end.ifname)[0]
                    ipr.link("set", index=idx, net_ns_fd=end.ns)
            for end in (self.a, self.b):
                with IPRoute(netns=end.ns) as ipr:
                    end.index = ipr.link_lookup(ifname=end.ifname)[0]
                    ipr.addr("add", index=end.index, address=end.addr, prefixlen=30)
                    ipr.link("set", index=end.index, state="up")
                    lo = ipr.link_lookup(ifname="lo")[0]
                    ipr.link("set", index=lo, state="up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._lock:
            if self._closed or not self._opened:
                return
            self._closed = True
        if not self._owner:
            self._undo()
            self._stop_watchdog()  # after the undo: until then, it is our net
            atexit.unregister(self.close)
            return

        for end in (self.a, self.b):
            if end.drop is not None:
                end.drop.close()
                end.drop = None
            with contextlib.suppress(FileNotFoundError, OSError):
                _remove_netns(end.ns)
        atexit.unregister(self.close)

    def _undo(self) -> None:
        """Remove what this object installed on an attached link (the owner
        may have torn the namespaces down already: nothing left to undo)."""
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~900 ms) only when this runs
        from pyroute2 import IPRoute

        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1 s) only when this runs
        from pyroute2.netlink.exceptions import NetlinkError

        for end in (self.a, self.b):
            try:
                with IPRoute(netns=end.ns) as ipr:
                    if self._marker is not None:
                        # Only while our marker is there: past our deadline the
                        # next window may have removed ours and put its own.
                        remove_window(ipr, end.index, self._marker)
                    elif end.root is not None:
                        with contextlib.suppress(NetlinkError):
                            ipr.tc("del", index=end.index, handle=f"{end.major:x}:", root=True)
            except (OSError, NetlinkError):
                pass
            if end.drop is not None:
                end.drop.close()
                end.drop = None
            end.root = None

    # -- impairments
    def _ends(self, direction: str) -> list[_End]:
        # An impairment of a->b traffic lives on a's egress, and vice versa.
        table = {"a2b": [self.a], "b2a": [self.b], "both": [self.a, self.b]}
        if direction not in table:
            raise NetChaosError("direction must be one of a2b, b2a, both")
        return table[direction]

    def set(
        self,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss_pct: float = 0.0,
        direction: str = "both",
        rate_mbit: float = 0.0,
    ) -> None:
        """Replace the delay/jitter/loss/rate of a direction (partitions stay).

        rate_mbit > 0 limits the direction's bandwidth to that many Mbit/s
        (10**6 bit/s, counting Ethernet frames); 0 removes the limit.
        """
        for end in self._ends(direction):
            new = Impairment(
                delay_ms=delay_ms,
                jitter_ms=jitter_ms,
                loss_pct=loss_pct,
                partitioned=end.state.partitioned,
                rate_mbit=rate_mbit,
            )
            new.validate()
            self._apply(end, new)

    def partition(self, direction: str = "both") -> None:
        for end in self._ends(direction):
            self._apply(end, Impairment(**{**end.state.__dict__, "partitioned": True}))

    def heal(self, direction: str = "both") -> None:
        for end in self._ends(direction):
            self._apply(end, Impairment(**{**end.state.__dict__, "partitioned": False}))

    def clear(self, direction: str = "both") -> None:
        for end in self._ends(direction):
            self._apply(end, Impairment())

    def state(self, direction: str) -> Impairment:
        (end,) = self._ends(direction)
        return Impairment(**end.state.__dict__)

    def drop_counters(self, direction: str) -> tuple[int, int]:
        """(dropped, seen) packets of the BPF drop filter; (0, 0) if none."""
        (end,) = self._ends(direction)
        if end.drop is None:
            return 0, 0
        _, drops, seen = end.drop.counters()
        return drops, seen

    def _apply(self, end: _End, new: Impairment) -> None:
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~900 ms) only when this runs
        from pyroute2 import IPRoute

        use_netem = new.delay_ms > 0 or (new.loss_pct > 0 and netem_available())
        bpf_loss = 0.0 if use_netem else new.loss_pct
        if new.delay_ms > 0 and not netem_available():
            raise NetChaosError(
                "delay needs sch_netem, which this kernel lacks: load it with"
                " `modprobe sch_netem` (CONFIG_NET_SCH_NETEM)"
            )
        root = _root_qdisc(new, use_netem)
        with IPRoute(netns=end.ns) as ipr:
            # The drop filter sits on clsact egress, before the root qdisc:
            # it composes with any of them, and what it drops never queues.
            # An attached window always has one, first: it is the window's
            # marker (whose, until when) and carries the kernel deadline.
            want_drop = new.partitioned or bpf_loss > 0 or not self._owner
            if want_drop and end.drop is None:
                self._attach_drop(ipr, end)
            if end.drop is not None:
                end.drop.set_threshold(1.0 if new.partitioned else bpf_loss / 100.0)
            if root != end.root:
                self._set_root(ipr, end, root)
        end.state = new

    @staticmethod
    def _set_root(ipr: Any, end: _End, root: _Root | None) -> None:
        """Make `root` the root qdisc of end's veth (None: the default)."""
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1 s) only when this runs
        from pyroute2.netlink.exceptions import NetlinkError

        old = end.root
        # `replace` changes a qdisc of the same kind in place (its queue
        # stays); a qdisc of another kind under the same handle is refused,
        # so that one goes first.
        if old is not None and (root is None or root[0] != old[0]):
            ipr.tc("del", index=end.index, handle=f"{end.major:x}:", root=True)
            end.root = None
        if root is None:
            return
        try:
            _replace_root(ipr, end.index, root, end.major)
        except NetlinkError as e:
            if end.root is None and old is not None:  # put the old one back
                with contextlib.suppress(NetlinkError):
                    _replace_root(ipr, end.index, old, end.major)
                    end.root = old
            if root[0] == "tbf" and e.code in (errno.ENOENT, errno.EOPNOTSUPP):
                raise NetChaosError(
                    "a bandwidth limit needs sch_tbf, which this kernel lacks: load it"
                    " with `modprobe sch_tbf` (CONFIG_NET_SCH_TBF)"
                ) from None
            raise
        end.root = root

    def _attach_drop(self, ipr: Any, end: _End) -> None:
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1 s) only when this runs
        from pyroute2.netlink.exceptions import NetlinkError

        if not self._owner and self._marker is None:
            self.start_watchdog()  # the marker and the deadline come with it
        mk = self._marker
        drop = DropFilter(mk.deadline_ns if mk is not None else 0)
        try:
            ipr.tc("add", "clsact", end.index)
            ipr.tc(
                "add-filter",
                "bpf",
                end.index,
                ":1",
                fd=drop.prog_fd,
                name=mk.name if mk is not None else "gf_drop",
                parent="ffff:fff3",  # clsact egress
                classid=1,
                direct_action=True,
            )
        except NetlinkError as e:
            drop.close()
            if e.code == errno.ENOENT:
                raise NetChaosError(
                    "partition/loss needs tc clsact and cls_bpf, which this kernel lacks:"
                    " `modprobe sch_ingress cls_bpf`"
                ) from None
            raise
        end.drop = drop


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has sch_netem (probed once in a throwaway netns)."""
    global _NETEM
    if _NETEM is None:
        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~900 ms) only when this runs
        from pyroute2 import IPRoute

        # lazy: pyroute2 (argparse, asyncio, +246 modules, ~1 s) only when this runs
        from pyroute2.netlink.exceptions import NetlinkError

        name = f"{_ns_prefix()}{os.getpid():x}n{secrets.token_hex(3)}a"
        _create_netns(name)
        try:
            with IPRoute(netns=name) as ipr:
                lo = ipr.link_lookup(ifname="lo")[0]
                try:
                    ipr.tc("add", "netem", lo, handle="1:", delay=1000)
                    _NETEM = True
                except NetlinkError as e:
                    if e.code not in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    _NETEM = False
        finally:
            _remove_netns(name)
    return _NETEM


@contextlib.contextmanager
def link(**kwargs: Any) -> Iterator[Link]:
    """`with link() as l:` convenience wrapper around Link."""
    with Link(**kwargs) as lk:
        yield lk
