"""Who a target process is, in every view the evidence keeps: the host's
pid and tid, the container's (its own PID namespace's), the namespaces,
the cgroup, the container and the pod. Written once per run (the
`targets` table) and shown by `show`."""

from __future__ import annotations

import os
from typing import Any

from pyctl.targets import containers, procfs


def _cgroup(pid: int) -> str:
    cg = procfs.cgroups(pid)
    # The unified (v2) path when there is one; else the first v1 one with a
    # container or pod in it; else the first.
    for ctl, path in cg:
        if ctl == "":
            if path != "/" or len(cg) == 1:
                return path
    for _, path in cg:
        if containers.ids_in_cgroup_path(path) or containers.pod_uid_in_cgroup_path(path):
            return path
    return cg[0][1] if cg else ""


def _root(pid: int, c: containers.Container | None) -> str | None:
    """Where the host finds the files the target's paths name: its
    container's root filesystem as the runtime recorded it, or, for a
    process chrooted in the host's mount namespace, its root's host path
    (/proc/PID/root reads as that path then). None for a process whose
    root is the host's."""
    if c is not None and c.root:
        return c.root
    if procfs.ns_inode(pid, "mnt") != procfs.ns_inode(os.getpid(), "mnt"):
        return None  # another mount namespace: its root's path means nothing here
    try:
        r = os.readlink(f"/proc/{pid}/root")
    except OSError:
        return None
    return r if r != "/" and r.startswith("/") else None


def of(pid: int, tid: int | None = None, labels: dict[str, Any] | None = None) -> dict[str, Any]:
    """The targets row for pid (and tid), labels (selector, rank) added."""
    nsp = procfs.ns_pids(pid)
    c = containers.of_process(pid)
    cg = _cgroup(pid)
    row: dict[str, Any] = {
        "host_pid": pid,
        "host_tid": tid,
        "ns_pid": nsp[-1] if nsp else None,
        "ns_tid": procfs.ns_tid(pid, tid) if tid else None,
        "ns_depth": max(0, len(nsp) - 1) if nsp else None,
        "pid_ns": procfs.ns_inode(pid, "pid"),
        "mnt_ns": procfs.ns_inode(pid, "mnt"),
        "comm": procfs.comm(pid),
        "cgroup": cg,
        "container_id": c.id if c else None,
        "container_name": (c.name or None) if c else None,
        "runtime": c.runtime if c else None,
        "pod_namespace": (c.pod_namespace or None) if c else None,
        "pod_name": (c.pod_name or None) if c else None,
        "pod_uid": ((c.pod_uid or containers.pod_uid_in_cgroup_path(cg)) or None) if c else None,
        "rank": None,
        "selector": None,
        "root": _root(pid, c),
    }
    for k, v in (labels or {}).items():
        if k in row and v not in (None, ""):
            row[k] = v
    return row
