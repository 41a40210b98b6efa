"""A Kubernetes pod's processes on this node, from what the kubelet and
the runtime leave on disk: the kubelet names each pod's log directory
/var/log/pods/NAMESPACE_NAME_UID, and every container of the pod runs in
a cgroup whose path carries `pod<UID>` (`-` or `_` in it, by cgroup
driver). No API server, no CRI socket needed."""

from __future__ import annotations

from dataclasses import dataclass

from pyctl.targets import containers, procfs, statefile

LOG_DIR = "/var/log/pods"


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    uid: str

    def describe(self) -> str:
        return f"{self.namespace}/{self.name}"


def pods() -> list[Pod]:
    out = []
    for entry in statefile.list_dir(LOG_DIR):
        # Namespaces and names are DNS labels (no "_"); the uid is last.
        parts = entry.split("_")
        if len(parts) == 3 and all(parts):
            out.append(Pod(*parts))
    return out


def container_names(pod: Pod) -> list[str]:
    """The pod's containers, as the kubelet names their log directories."""
    return statefile.list_dir(f"{LOG_DIR}/{pod.namespace}_{pod.name}_{pod.uid}")


def members(pod: Pod, container: str = "", *, exclude: tuple[int, ...] = ()) -> list[int]:
    """Host pids of pod's processes (of one container of it when given),
    the pause container's left out: it holds the namespaces, it is not
    the workload."""
    known = {c.id: c for c in containers.from_state()}
    out = []
    for pid in procfs.pids():
        if pid in exclude:
            continue
        paths = [p for _, p in procfs.cgroups(pid)]
        if not any(containers.pod_uid_in_cgroup_path(p) == pod.uid for p in paths):
            continue
        cids = containers.process_container_ids(pid)
        c = next((known[i] for i in cids if i in known), None)
        if c is not None and c.sandbox:
            continue
        if c is None and procfs.comm(pid) == "pause":
            continue
        if container and (c is None or c.name != container):
            continue
        out.append(pid)
    return sorted(out)
