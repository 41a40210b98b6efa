"""Which container a process is in, and which processes a container has,
from the cgroup paths in /proc and the runtimes' own state files: no
runtime client library, no socket to a daemon.

Two facts name a container, and either is enough:
- a runtime's state (crun, runc, containerd's shims, Docker, CRI-O and
  Podman's container storage): its id, its name, its init pid, and for a
  Kubernetes container the pod it belongs to;
- the id in a process's cgroup path (`docker-ID.scope`, `libpod-ID.scope`,
  `crio-ID.scope`, `cri-containerd-ID.scope`, or a 64-hex path component
  under cgroupfs), which is all a node without readable state offers.

A container's processes are the ones in its init's PID namespace (when
that is not the host's), and the ones whose cgroup path carries its id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pyctl.targets import procfs, statefile

_ID64 = r"[0-9a-f]{64}"
# The scope names systemd-managed runtimes give a container's cgroup; the
# conmon scopes are the monitor's, not the container's.
_SCOPE = re.compile(rf"^(?:docker|libpod|crio|cri-containerd|containerd)-({_ID64})\.scope$")
_BARE = re.compile(rf"^({_ID64})$")
_POD = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$"
)


@dataclass(frozen=True)
class Container:
    id: str
    name: str = ""
    runtime: str = ""  # crun, runc, containerd, docker, cri-o, podman, cgroup
    init_pid: int | None = None
    pod_namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    sandbox: bool = False  # a Kubernetes pod's pause container
    names: tuple[str, ...] = field(default=())  # other names it answers to
    # Its root filesystem as the host reaches it (the runtime's own record:
    # crun's/runc's rootfs, containerd's bundle rootfs), "" when unknown.
    root: str = ""

    def describe(self) -> str:
        who = self.name or self.id[:12]
        return (
            f"{who} ({self.runtime}, id {self.id[:12]})" if self.name else f"{who} ({self.runtime})"
        )


def ids_in_cgroup_path(path: str) -> list[str]:
    """Container ids named by the components of one cgroup path."""
    out = []
    for part in path.split("/"):
        m = _SCOPE.match(part) or _BARE.match(part)
        if m:
            out.append(m.group(1))
    return out


def pod_uid_in_cgroup_path(path: str) -> str:
    for part in path.split("/"):
        m = _POD.search(part)
        if m and (part.startswith("pod") or "-pod" in part):
            return m.group(1).replace("_", "-")
    return ""


def process_container_ids(pid: int) -> list[str]:
    ids: list[str] = []
    for _, path in procfs.cgroups(pid):
        for i in ids_in_cgroup_path(path):
            if i not in ids:
                ids.append(i)
    return ids


# ---- the runtimes' state ----------------------------------------------------


def _json(path: str) -> Any:
    b = statefile.read(path)
    if b is None:
        return None
    try:
        return json.loads(b)
    except ValueError:
        return None


def _pidfile(path: str) -> int | None:
    b = statefile.read(path, 64)
    if b is None:
        return None
    s = b.strip()
    return int(s) if s.isdigit() else None


def _annotations(cfg: Any) -> dict[str, str]:
    a = cfg.get("annotations") if isinstance(cfg, dict) else None
    return {str(k): str(v) for k, v in a.items()} if isinstance(a, dict) else {}


def _kube(c: dict[str, Any], ann: dict[str, str]) -> dict[str, Any]:
    """Pod identity from the OCI annotations CRI-O and containerd's CRI
    plugin write."""
    get = ann.get
    ns = get("io.kubernetes.pod.namespace") or get("io.kubernetes.cri.sandbox-namespace") or ""
    pod = get("io.kubernetes.pod.name") or get("io.kubernetes.cri.sandbox-name") or ""
    uid = get("io.kubernetes.pod.uid") or get("io.kubernetes.cri.sandbox-uid") or ""
    name = get("io.kubernetes.container.name") or get("io.kubernetes.cri.container-name") or ""
    kind = get("io.kubernetes.cri.container-type") or get("io.kubernetes.cri-o.ContainerType")
    out = dict(c)
    if ns or pod:
        out.update(pod_namespace=ns, pod_name=pod, pod_uid=uid)
    if name:
        out["name"] = name
    if kind == "sandbox":
        out["sandbox"] = True
    return out


def _oci_state_dirs(root: str, runtime: str, pid_key: str) -> Iterable[dict[str, Any]]:
    """crun (/run/crun/ID/status) and runc (/run/runc/ID/state.json) keep
    one directory per container; their id is the name it was created with."""
    file = "status" if runtime == "crun" else "state.json"
    for cid in statefile.list_dir(root):
        st = _json(f"{root}/{cid}/{file}")
        if not isinstance(st, dict):
            continue
        pid = st.get(pid_key)
        cfg = st.get("config")
        rootfs = st.get("rootfs") or (cfg.get("rootfs") if isinstance(cfg, dict) else None)
        bundle = st.get("bundle")
        if isinstance(rootfs, str) and rootfs and not rootfs.startswith("/"):
            # crun records config.json's root.path as written: the bundle's.
            rootfs = f"{bundle}/{rootfs}" if isinstance(bundle, str) and bundle[:1] == "/" else ""
        if not (isinstance(rootfs, str) and rootfs.startswith("/")):
            rootfs = ""
        yield {"id": cid, "name": cid, "runtime": runtime, "root": rootfs,
               "init_pid": pid if isinstance(pid, int) and pid > 0 else None}  # fmt: skip


def _containerd() -> Iterable[dict[str, Any]]:
    base = "/run/containerd/io.containerd.runtime.v2.task"
    for ns in statefile.list_dir(base):
        for cid in statefile.list_dir(f"{base}/{ns}"):
            d = f"{base}/{ns}/{cid}"
            c = {
                "id": cid,
                "name": cid,
                "runtime": "containerd",
                "init_pid": _pidfile(f"{d}/init.pid"),
                "root": f"{d}/rootfs",
            }
            yield _kube(c, _annotations(_json(f"{d}/config.json")))


def _docker() -> Iterable[dict[str, Any]]:
    base = "/var/lib/docker/containers"
    for cid in statefile.list_dir(base):
        cfg = _json(f"{base}/{cid}/config.v2.json")
        if not isinstance(cfg, dict):
            continue
        raw = cfg.get("State")
        st: dict[str, Any] = raw if isinstance(raw, dict) else {}
        pid = st.get("Pid") if st.get("Running") else None
        yield {"id": cid, "name": str(cfg.get("Name") or "").lstrip("/"), "runtime": "docker",
               "init_pid": pid if isinstance(pid, int) and pid > 0 else None}  # fmt: skip


def _container_storage() -> Iterable[dict[str, Any]]:
    """CRI-O and Podman share containers/storage: its registry names every
    container, userdata/ has the OCI config and the pidfile."""
    names: dict[str, list[str]] = {}
    reg = _json("/var/lib/containers/storage/overlay-containers/containers.json")
    for c in reg if isinstance(reg, list) else []:
        if isinstance(c, dict) and isinstance(c.get("id"), str):
            names[c["id"]] = [str(n) for n in c.get("names") or []]
    base = "/run/containers/storage/overlay-containers"
    for cid in statefile.list_dir(base):
        d = f"{base}/{cid}/userdata"
        cfg = _json(f"{d}/config.json")
        ann = _annotations(cfg)
        runtime = "cri-o" if any(k.startswith("io.kubernetes.cri-o.") for k in ann) else "podman"
        ns = names.get(cid, [])
        c = {"id": cid, "name": ns[0] if ns else cid, "runtime": runtime,
             "init_pid": _pidfile(f"{d}/pidfile"), "names": tuple(ns[1:])}  # fmt: skip
        yield _kube(c, ann)


def from_state() -> list[Container]:
    """Every container a runtime on this host keeps readable state for."""
    found: dict[str, Container] = {}
    sources: list[Iterable[dict[str, Any]]] = [
        _container_storage(),  # first: it knows Podman's and CRI-O's names
        _containerd(),
        _docker(),
        _oci_state_dirs("/run/crun", "crun", "pid"),
        _oci_state_dirs("/run/runc", "runc", "init_process_pid"),
    ]
    for src in sources:
        for c in src:
            if c["id"] not in found:
                found[c["id"]] = Container(**c)
    return list(found.values())


def from_cgroups() -> list[Container]:
    """Containers seen only as ids in processes' cgroup paths."""
    seen: dict[str, Container] = {}
    for pid in procfs.pids():
        for cid in process_container_ids(pid):
            if cid not in seen:
                uid = next(
                    (u for _, p in procfs.cgroups(pid) if (u := pod_uid_in_cgroup_path(p))), ""
                )
                seen[cid] = Container(id=cid, runtime="cgroup", pod_uid=uid)
    return list(seen.values())


def running() -> list[Container]:
    """State first (names, init pids), then ids only cgroups show."""
    out = {c.id: c for c in from_state()}
    for c in from_cgroups():
        out.setdefault(c.id, c)
    return list(out.values())


def matches(c: Container, query: str) -> bool:
    if query in (c.id, c.name) or query in c.names:
        return True
    # A unique prefix of the id, as the runtimes' CLIs accept (4 at least:
    # "a" would name whatever container happens to start with it).
    return (
        len(query) >= 4 and all(ch in "0123456789abcdef" for ch in query) and c.id.startswith(query)
    )


def members(c: Container, *, exclude: Iterable[int] = ()) -> list[int]:
    """The host pids of c's processes, sorted."""
    skip = set(exclude)
    out: set[int] = set()
    host = procfs.HOST_PID_NS_INO
    pidns = procfs.ns_inode(c.init_pid, "pid") if c.init_pid else None
    for pid in procfs.pids():
        if pid in skip or procfs.is_kernel_thread(pid):
            continue
        if pidns is not None and pidns != host and procfs.ns_inode(pid, "pid") == pidns:
            out.add(pid)
        elif c.id in process_container_ids(pid):
            out.add(pid)
    if c.init_pid and not out and procfs.comm(c.init_pid) is not None:
        # Sharing the host's PID namespace with no id in its cgroups (crun
        # with cgroups disabled): its init and what it started.
        out = {c.init_pid, *procfs.descendants(c.init_pid)}
    return sorted(out)


def of_process(pid: int, known: list[Container] | None = None) -> Container | None:
    """The container pid runs in, None for a process of the host (decided
    from its own cgroup and PID namespace first: the host's processes,
    the common case, cost no runtime state read)."""
    ids = process_container_ids(pid)
    pidns = procfs.ns_inode(pid, "pid")
    own_ns = pidns is not None and pidns != procfs.HOST_PID_NS_INO
    if not ids and not own_ns:
        return None
    cs = known if known is not None else from_state()
    for c in cs:
        if c.id in ids:
            return c
    if own_ns:
        for c in cs:
            if c.init_pid and procfs.ns_inode(c.init_pid, "pid") == pidns:
                return c
    if ids:
        return Container(id=ids[-1], runtime="cgroup")
    return None
