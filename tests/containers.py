"""Real containers for tests: a root filesystem built from this host's
files, run by crun (the OCI runtime, a Debian package) or by plain
`unshare --pid --mount --fork` + chroot. No image registry is needed.

The root filesystem holds the test targets (build/targets/gf_target and
its libgftarget.so, the libcuda TEST DOUBLE and its gf-infer workload
from pyctl/data/doubles) and the libraries they need per `ldd`, **copied**
(other inodes than the host's files) to /gf/lib, a directory the host does
not have: a library the container maps is reachable from the host only
through /proc/PID/root, as in a real image. The dynamic loader sits where
the binaries name it (/lib64/ld-linux-x86-64.so.2).

crun 1.8 refuses this host's hybrid cgroup layout (v1 controllers plus a
v2 tree at /sys/fs/cgroup/unified): it runs in a private mount namespace
of its own in which /sys/fs/cgroup/unified is unmounted, and the
container's cgroup is /gf-<hex> in the v1 hierarchies. Its state is
crun's own, in the host's /run/crun/NAME (a private mount namespace
shares the host's directories).

Each container is removed at the end, even when its test failed: its
processes killed, `crun delete -f`, its cgroup directories gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from gftarget import Target

REPO = Path(__file__).resolve().parent.parent
TARGETS = REPO / "build" / "targets"
DOUBLES = REPO / "pyctl" / "data" / "doubles"
CRUN = shutil.which("crun") or "/usr/bin/crun"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
BUSYBOX = shutil.which("busybox") or "/usr/bin/busybox"  # static (busybox-static)
SH = shutil.which("sh") or "/bin/sh"
MOUNT = shutil.which("mount") or "/usr/bin/mount"
CGROUP_ROOT = "/sys/fs/cgroup"
# Inside the root filesystem: where the programs and their libraries are.
BIN = "/gf/bin"
LIBDIR = "/gf/lib"
ENV = {"PATH": BIN, "LD_LIBRARY_PATH": LIBDIR}
_LDD = re.compile(r"^\s*(?:(\S+) => )?(/\S+) \(0x[0-9a-f]+\)$")


def programs() -> list[Path]:
    """The binaries a root filesystem carries; what is missing says to build."""
    progs = [TARGETS / "gf_target", DOUBLES / "gf-infer"]
    missing = [str(p) for p in progs if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} missing: run make build")
    return progs


def needed(program: Path) -> list[tuple[str, str]]:
    """(name as the program asks for it, host file) for each library ldd
    lists, the dynamic loader included (its name is its absolute path)."""
    out = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=True,
                         timeout=30).stdout  # fmt: skip
    libs = []
    for line in out.splitlines():
        m = _LDD.match(line)
        if m:
            name, path = m.group(1) or m.group(2), m.group(2)
            libs.append((name, os.path.realpath(path)))
    return libs


def build_rootfs(dest: Path, extra: dict[str, Path] | None = None) -> Path:
    """dest/rootfs: the programs in /gf/bin, their libraries copied into
    /gf/lib, the loader at its own path, empty /proc /dev /tmp; extra:
    more host files copied in (path inside -> host file)."""
    root = dest / "rootfs"
    for d in (BIN, LIBDIR, "/proc", "/dev", "/tmp", "/lib64"):
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    # A static shell for the tests' own work inside (a mount in its namespace).
    shutil.copy2(BUSYBOX, root / BIN.lstrip("/") / "busybox")
    for prog in programs():
        shutil.copy2(prog, root / BIN.lstrip("/") / prog.name)
        for name, host in needed(prog):
            at = name if name.startswith("/") else f"{LIBDIR}/{name}"
            to = root / at.lstrip("/")
            to.parent.mkdir(parents=True, exist_ok=True)
            if not to.exists():
                shutil.copy2(host, to)  # a copy: another inode than the host's
    for at, host_file in (extra or {}).items():
        shutil.copy2(host_file, root / at.lstrip("/"))
    os.chmod(root, 0o755)
    return root


def _cgroup_dirs(name: str) -> list[str]:
    """The cgroup directories a container named `name` has (or left)."""
    try:
        hier = os.listdir(CGROUP_ROOT)
    except OSError:
        return []
    return [d for h in hier if os.path.isdir(d := f"{CGROUP_ROOT}/{h}/{name}")]


# The private mount namespace crun runs in: the v2 tree of the hybrid
# layout out of sight, so crun sees a v1 host.
_CRUN_NS = (
    f"if mountpoint -q {CGROUP_ROOT}/unified; then umount {CGROUP_ROOT}/unified || exit 3; fi; "
    'exec "$@"'
)


def crun(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """One crun command in its own private mount namespace."""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           _CRUN_NS, "crun-ns", CRUN, *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def crun_state(name: str) -> dict:
    r = crun("state", name)
    if r.returncode != 0:
        raise RuntimeError(f"crun state {name}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def oci_config(args: list[str], name: str, env: dict[str, str] | None = None,
               binds: dict[str, str] | None = None) -> dict:  # fmt: skip
    """A minimal OCI bundle config: own PID, mount, UTS and IPC namespaces,
    its own read-only root, /proc, no capabilities, cgroup /NAME; binds:
    host directories mounted read-only inside (path inside -> host dir)."""
    mounts = [{"destination": "/proc", "type": "proc", "source": "proc"}]
    mounts += [{"destination": at, "type": "bind", "source": host, "options": ["rbind", "ro"]}
               for at, host in (binds or {}).items()]  # fmt: skip
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": [f"{k}={v}" for k, v in {**ENV, **(env or {})}.items()],
            "cwd": "/",
            "capabilities": {
                k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
            },  # fmt: skip
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": name,
        "mounts": mounts,
        "linux": {
            "cgroupsPath": f"/{name}",
            "namespaces": [{"type": t} for t in ("pid", "mount", "uts", "ipc")],
            "maskedPaths": [],
            "readonlyPaths": [],
        },
    }


class Contained(Target):
    """A program running in a container, driven like tests/gftarget.py's
    Target (commands on its stdin, lines on its stdout, through the
    runtime's stdio). pid: its host pid; name: the container's name (crun)
    or '' (unshare); rootfs: its root on the host; kind: crun or unshare."""

    def __init__(self, kind: str, rootfs: Path, args: list[str], name: str = "",
                 ready: str = "ready", env: dict[str, str] | None = None,
                 binds: dict[str, str] | None = None) -> None:  # fmt: skip
        self.kind, self.rootfs, self.name = kind, rootfs, name
        if kind == "crun":
            bundle = rootfs.parent
            cfg = oci_config(args, name, env, binds)
            (bundle / "config.json").write_text(json.dumps(cfg))
            argv = [UNSHARE, "--mount", "--propagation", "private", "sh", "-c", _CRUN_NS,
                    "crun-ns", CRUN, "run", "--bundle", str(bundle), name]  # fmt: skip
            env = None
        else:
            # The binds in its own mount namespace, then the chroot.
            mounts = "".join(f'{MOUNT} --bind -o ro "{host}" "{rootfs}{at}" && '
                             for at, host in (binds or {}).items())  # fmt: skip
            argv = [UNSHARE, "--pid", "--mount", "--fork", SH, "-c",
                    f'{mounts}exec "$@"', "gf-chroot", CHROOT, str(rootfs), *args]  # fmt: skip
            env = {**ENV, **(env or {})}
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1, env=env)  # fmt: skip
        assert self.p.stdout is not None
        self.first = self.p.stdout.readline()
        if not self.first.startswith(ready):
            self.p.kill()
            raise RuntimeError(f"{kind} container did not start: {self.first!r} "
                               f"(exit {self.p.wait(10)})")  # fmt: skip
        if kind == "crun":
            self.pid = int(crun_state(name)["pid"])
        else:
            # lazy: tests import pyctl from the worktree after conftest set the path up
            from pyctl.targets.procfs import descendants

            self.pid = next(q for q in descendants(self.p.pid) if q)

    def exec(self, args: list[str]) -> Target:
        """Another process in this container (crun exec; nsenter into the
        PID namespace and root of the unshare kind), driven the same way:
        not the namespace's init."""
        if self.kind == "crun":
            argv = [UNSHARE, "--mount", "--propagation", "private", "sh", "-c", _CRUN_NS,
                    "crun-ns", CRUN, "exec", "--env", f"LD_LIBRARY_PATH={LIBDIR}", self.name,
                    *args]  # fmt: skip
            env = None
        else:
            argv = [NSENTER, "--target", str(self.pid), "--pid", "--root", "--", *args]
            env = dict(ENV)
        return Joined(argv, env)

    def inside(self, *args: str) -> subprocess.CompletedProcess[str]:
        """busybox ARGS as root in the container's mount namespace and root
        (paths as it sees them): what its own root user could do."""
        return subprocess.run([NSENTER, "--target", str(self.pid), "--mount", "--root", "--",
                               f"{BIN}/busybox", *args], capture_output=True, text=True,
                              timeout=30)  # fmt: skip

    def alive(self) -> bool:
        return self.p.poll() is None and Path(f"/proc/{self.pid}").exists()

    def kill(self) -> None:
        """SIGKILL its init: the namespace's other processes go with it."""
        with suppress(ProcessLookupError):
            os.kill(self.pid, 9)

    def close(self) -> int:
        if self.p.poll() is None:
            try:
                assert self.p.stdin is not None
                self.p.stdin.write("quit\n")
                self.p.stdin.flush()
                self.p.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                return self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.p.wait(timeout=30)


class Joined(Target):
    """A process started into a running container; pid: its host pid (the
    one whose pid in the container is what its ready line says)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1, env=env)  # fmt: skip
        assert self.p.stdout is not None
        first = self.p.stdout.readline()
        m = re.match(r"ready pid=(\d+)", first)
        if m is None:
            self.p.kill()
            raise RuntimeError(f"{argv}: did not start: {first!r} (exit {self.p.wait(10)})")
        # lazy: tests import pyctl from the worktree after conftest set the path up
        from pyctl.targets.procfs import descendants, ns_pids

        inner = int(m.group(1))
        self.pid = next(q for q in descendants(self.p.pid) if ns_pids(q)[-1:] == [inner])


@contextmanager
def container(kind: str, tmp: Path, args: list[str] | None = None, ready: str = "ready",
              env: dict[str, str] | None = None, extra: dict[str, Path] | None = None,
              binds: dict[str, str] | None = None) -> Iterator[Contained]:  # fmt: skip
    """A running container of `kind` (crun or unshare) whose process is
    args (gf_target by default), removed after: processes, crun's state,
    cgroups; no mount is left (crun's and unshare's are in namespaces
    that end with their processes). env: more environment for it; extra:
    more host files in its root (build_rootfs); binds: host directories
    mounted read-only inside it (path inside -> host dir)."""
    rootfs = build_rootfs(tmp, extra)
    for at in binds or {}:
        (rootfs / at.lstrip("/")).mkdir(parents=True, exist_ok=True)
    name = f"gf-{secrets.token_hex(4)}" if kind == "crun" else ""
    c = None
    try:
        c = Contained(kind, rootfs, args or [f"{BIN}/gf_target"], name, ready, env, binds)
        yield c
    finally:
        if c is not None:
            c.close()
        if kind == "crun":
            if os.path.exists(f"/run/crun/{name}"):
                crun("delete", "--force", name)
            for d in _cgroup_dirs(name):
                with suppress(OSError):
                    os.rmdir(d)
            left = leftovers(name)
            assert not left, f"container {name} left {left}"


def leftovers(name: str) -> list[str]:
    """What a removed container could have left on the host."""
    return _cgroup_dirs(name) + ([f"/run/crun/{name}"] if os.path.exists(f"/run/crun/{name}")
                                 else [])  # fmt: skip
