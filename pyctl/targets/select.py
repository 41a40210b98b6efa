"""Target selectors: a container, a cgroup, a pod, a process name, the
ranks of a job, a thread name, resolved to the host pids (and tids) a
session arms in, each with the labels its evidence keeps.

Every selector resolves now, once: processes that appear later are not
added (a fault armed in a job's ranks is armed in the ranks running when
it started). No match is an error that says what is running instead.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.exceptions import BadInput
from pyctl.targets import containers, pods, procfs

KINDS = ("container", "cgroup", "pod", "comm", "ranks_of", "thread")
_LIST_MAX = 8  # candidates named in an error line


class SelectError(BadInput):
    """One line: what matched nothing (or too much), what to give instead."""


@dataclass(frozen=True)
class Member:
    pid: int
    tid: int | None = None
    labels: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def describe(self) -> str:
        bits = [f"pid {self.pid}"] + ([f"tid {self.tid}"] if self.tid else [])
        for k in ("rank", "container_name", "pod_name"):
            if self.labels.get(k) not in (None, ""):
                bits.append(f"{k.split('_')[0]} {self.labels[k]}")
        return ", ".join(bits)


def _names(items: Iterable[str]) -> str:
    items = sorted(set(items))
    more = len(items) - _LIST_MAX
    return ", ".join(items[:_LIST_MAX]) + (f" and {more} more" if more > 0 else "")


def _self() -> tuple[int, ...]:
    """gpufault's own processes are never a target of a selector."""
    me = os.getpid()
    return (me, os.getppid()) if procfs.comm(os.getppid()) == procfs.comm(me) else (me,)


def _container(query: str) -> list[Member]:
    cs = containers.running()
    hits = [c for c in cs if containers.matches(c, query)]
    if not hits:
        names = [c.name or c.id[:12] for c in cs if not c.sandbox]
        raise SelectError(
            f"--container {query}: no such container on this host"
            + (
                f" (running: {_names(names)})"
                if names
                else " (no runtime state or container cgroup found)"
            )
            + "; give its name or id as the runtime lists it"
        )
    if len({c.id for c in hits}) > 1:
        raise SelectError(f"--container {query}: names {len(hits)} containers "
                          f"({_names(c.id[:12] for c in hits)}): give more of the id")  # fmt: skip
    c = hits[0]
    pids = containers.members(c, exclude=_self())
    if not pids:
        raise SelectError(f"--container {query}: {c.describe()} has no running process")
    labels = {"selector": f"container={query}", "container_id": c.id,
              "container_name": c.name or None, "runtime": c.runtime}  # fmt: skip
    return [Member(p, None, dict(labels)) for p in pids]


def _cgroup_rel(path: str) -> str:
    """A cgroup as /proc/PID/cgroup writes it: '/a/b' given as that or as
    a directory under a cgroup mount (/sys/fs/cgroup/a/b)."""
    if not path.startswith("/"):
        raise SelectError(f"--cgroup {path}: give an absolute path (/system.slice/x.service, "
                          "or its directory under /sys/fs/cgroup)")  # fmt: skip
    real = os.path.normpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    best = ("", "")
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields = pre.split()
        if len(fields) < 5 or post.split()[:1] not in (["cgroup"], ["cgroup2"]):
            continue
        root, mnt = fields[3], fields[4]
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
            best = (mnt, root)
    if best[0]:
        rest = real[len(best[0]) :]
        return (best[1].rstrip("/") + rest) or "/"
    return real


def _cgroup(path: str) -> list[Member]:
    rel = _cgroup_rel(path)
    if rel == "/":
        raise SelectError(
            "--cgroup /: that is every process; name the container's or service's cgroup"
        )
    skip = set(_self())
    pids = [
        p for p in procfs.pids()
        if p not in skip and not procfs.is_kernel_thread(p)
        and any(cg == rel or cg.startswith(rel + "/") for _, cg in procfs.cgroups(p))
    ]  # fmt: skip
    if not pids:
        raise SelectError(f"--cgroup {path}: no process is in {rel} or below it "
                          "(see /proc/PID/cgroup of the one you mean)")  # fmt: skip
    return [Member(p, None, {"selector": f"cgroup={path}"}) for p in sorted(pids)]


def _pod(query: str) -> list[Member]:
    parts = query.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise SelectError(f"--pod {query}: give NAMESPACE/NAME (or NAMESPACE/NAME/CONTAINER)")
    ns, name, ctr = parts[0], parts[1], (parts[2] if len(parts) == 3 else "")
    all_pods = pods.pods()
    hit = next((p for p in all_pods if (p.namespace, p.name) == (ns, name)), None)
    if hit is None:
        raise SelectError(
            f"--pod {ns}/{name}: no such pod on this node"
            + (f" (pods here: {_names(p.describe() for p in all_pods)})" if all_pods
               else f" (no kubelet pod directories in {pods.LOG_DIR})")
        )  # fmt: skip
    pids = pods.members(hit, ctr, exclude=_self())
    if not pids:
        what = f"container {ctr} of pod" if ctr else "pod"
        names = pods.container_names(hit)
        raise SelectError(f"--pod {query}: {what} {ns}/{name} has no running process"
                          + (f" (its containers: {_names(names)})" if names else ""))  # fmt: skip
    labels = {"selector": f"pod={query}", "pod_namespace": ns, "pod_name": name, "pod_uid": hit.uid}
    return [Member(p, None, dict(labels)) for p in pids]


def _comm_matches(pattern: str, name: str | None) -> bool:
    if name is None:
        return False
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern


def _comm(pattern: str) -> list[Member]:
    if not pattern or len(pattern) > 64:
        raise SelectError(
            f"--comm {pattern!r}: give a process name as ps -o comm shows it (15 characters)"
        )
    skip = set(_self())
    pids = [p for p in procfs.pids() if p not in skip and not procfs.is_kernel_thread(p)
            and _comm_matches(pattern, procfs.comm(p))]  # fmt: skip
    if not pids:
        raise SelectError(f"--comm {pattern}: no process has that name (names are cut at 15 "
                          "characters; a glob like 'python*' matches several)")  # fmt: skip
    return [Member(p, None, {"selector": f"comm={pattern}"}) for p in sorted(pids)]


# (pid, absolute --lib) -> whether pid maps a copy of that file: the layer
# above, which reads ELF files, says it (a build-id match in another root).
SameBuild = Callable[[int, str], bool]


def _maps_any(pid: int, libs: Sequence[str], same: SameBuild | None = None) -> bool:
    if not libs:
        return True
    files = procfs.mapped_files(pid)
    inodes: dict[tuple[int, int], tuple[str, str]] | None = None
    for want in libs:
        for path in files:
            base = os.path.basename(path)
            if want.startswith("/"):
                if path == want:
                    return True
            elif base == want or base.startswith((want + ".", want + "-", want + "_")):
                return True
        if want.startswith("/"):
            # The same file by another path: the container's own path of a
            # library it maps (through its root), or a host path bind-mounted
            # into it; matched by the mapped inode, not by its name.
            inodes = procfs.mapped_inodes(pid) if inodes is None else inodes
            root = procfs.root_prefix(pid)
            for cand in ([root + want] if root else []) + [want]:
                try:
                    st = os.stat(cand)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in inodes:
                    return True
            if same is not None and same(pid, want):
                return True
    return False


def _ranks_of(pid: int, libs: Sequence[str], same: SameBuild | None = None) -> list[Member]:
    if procfs.comm(pid) is None:
        raise SelectError(f"--ranks-of {pid}: no process {pid}: give the job's launcher "
                          "(torchrun, mpirun) or its first rank")  # fmt: skip
    tree = [pid, *procfs.descendants(pid)]
    pids = [p for p in tree if _maps_any(p, libs, same)]
    if not pids:
        lib = " or ".join(libs)
        raise SelectError(f"--ranks-of {pid}: none of its {len(tree)} processes maps {lib} yet: "
                          "arm after the ranks have loaded it")  # fmt: skip
    ranks = {p: procfs.rank(p) for p in pids}
    # Ranks by RANK (torchrun, MPI, Slurm) where every process says one;
    # by pid order otherwise, said as such in the evidence.
    if all(r is not None for r in ranks.values()) and len(set(ranks.values())) == len(pids):
        ordered = sorted(pids, key=lambda p: ranks[p])  # type: ignore[arg-type,return-value]
        src = "env"
    else:
        ordered, src = sorted(pids), "pid-order"
        ranks = {p: i for i, p in enumerate(ordered)}
    return [
        Member(p, None, {"selector": f"ranks-of={pid}", "rank": ranks[p], "rank_source": src})
        for p in ordered
    ]


def _threads(name: str, within: Sequence[Member]) -> list[Member]:
    out = []
    for m in within:
        for tid, tname in sorted(procfs.thread_comms(m.pid).items()):
            if _comm_matches(name, tname):
                out.append(Member(m.pid, tid, {**m.labels, "thread": tname}))
    if not out:
        where = ", ".join(str(m.pid) for m in within[:_LIST_MAX])
        names = sorted({t for m in within[:_LIST_MAX] for t in procfs.thread_comms(m.pid).values()})
        raise SelectError(f"--thread {name}: no thread of that name in pid {where}"
                          + (f" (threads: {_names(names)})" if names else ""))  # fmt: skip
    return out


def resolve(
    kind: str, value: str | int, *, libs: Sequence[str] = (), thread: str = "",
    pid: int | None = None, same: SameBuild | None = None,
) -> list[Member]:  # fmt: skip
    """The members kind=value selects (thread narrows them to the threads
    of that name). libs: the libraries the faults probe, for ranks_of;
    same: whether a process maps a copy of an absolute lib (build-id)."""
    if kind == "pid":
        if pid is None:
            pid = int(value)
        within = [Member(pid, None, {})]
    elif kind == "container":
        within = _container(str(value))
    elif kind == "cgroup":
        within = _cgroup(str(value))
    elif kind == "pod":
        within = _pod(str(value))
    elif kind == "comm":
        within = _comm(str(value))
    elif kind == "ranks_of":
        try:
            p = int(value)
        except ValueError:
            raise SelectError(f"--ranks-of {value}: give the launcher's pid") from None
        within = _ranks_of(p, libs, same)
    else:
        raise SelectError(f"unknown target selector {kind!r}: one of {', '.join(KINDS)}")
    if kind in ("container", "cgroup", "pod", "comm") and libs:
        # A container's shell, a pod's sidecar: only the processes that map
        # a probed library are targets (ranks_of filtered already).
        mapping = [m for m in within if _maps_any(m.pid, libs, same)]
        if not mapping:
            raise SelectError(
                f"--{kind} {value}: none of its {len(within)} processes "
                f"({_names(str(m.pid) for m in within)}) maps {' or '.join(libs)} yet: "
                "arm after the workload has loaded it, or give --pid of the one that will"
            )
        within = mapping
    return _threads(thread, within) if thread else within
