"""Target selectors (pyctl/targets, gpufault.Target.comm/cgroup/
ranks_of/container/pod, the CLI's --comm/--cgroup/--ranks-of/--container/
--pod/--thread): real processes, real cgroups, real PID and mount
namespaces; the container runtime's and the kubelet's state files are
planted in a private mount namespace (a double of a runtime that cannot
run here, named as one) where no runtime is involved."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import requires_root
from gftarget import LIB, TARGET, Target

import gpufault
from gpufault import BadInput, Fault

REPO = Path(__file__).resolve().parent.parent
VICTIM = (str(LIB), "gf_victim")
GF = [sys.executable, "-m", "pyctl"]


def _rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture
def named(tmp_path: Path) -> str:
    """A link to gf_target with a name no other process has: the comm of
    what it starts (an xdist worker's or another session's gf_target is
    never selected)."""
    name = "gfsel" + secrets.token_hex(4)
    (tmp_path / name).symlink_to(TARGET)
    return str(tmp_path / name)


def _cgroup2_root() -> str | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if post.startswith("cgroup2 "):
            return pre.split()[4]
    return None


@pytest.fixture
def cgroup() -> Iterator[tuple[str, str]]:
    """A cgroup v2 directory of this test's own (its path as /proc/PID/cgroup
    writes it, and its directory); removed at the end."""
    root = _cgroup2_root()
    if root is None or not os.access(root, os.W_OK):
        pytest.skip("needs a writable cgroup v2 hierarchy")
    rel = f"/gftest-{secrets.token_hex(4)}"
    d = root + rel
    os.mkdir(d)
    try:
        yield rel, d
    finally:
        # Its processes ended with their tests (quit), so it is empty.
        os.rmdir(d)


@requires_root
def test_comm_arms_in_every_process_of_that_name_and_tags_each_run(
    named: str, tmp_path: Path
) -> None:
    a, b = Target(named), Target(named)
    try:
        db = tmp_path / "gf.db"
        sel = gpufault.Target.comm(Path(named).name)
        # arm() is one process: it says so, and arms nothing.
        with pytest.raises(BadInput, match=r"is 2 processes .*: arm them with gpufault.arm_all"):
            gpufault.arm(Fault.fail(*VICTIM, ret=-5, nth=2), sel, db=db)
        assert not db.exists()
        with gpufault.arm_all(Fault.fail(*VICTIM, ret=-5, nth=2), sel, db=db, duration=30) as g:
            assert isinstance(g, gpufault.SessionGroup) and len(g.sessions) == 2
            assert sorted(t.pid for t in g.members) == sorted([a.pid, b.pid])
            assert [r[3] for r in a.victim(3)] == [2, -5, 4]
            assert [r[3] for r in b.victim(3)] == [2, -5, 4]
            assert g.wait_fires(2, 10)
        assert g.counters.fires == 2 and g.counters.calls == 6
        faults = g.faults()
        assert sorted(f.pid for f in faults) == sorted([a.pid, b.pid])
        rows = _rows(db, "SELECT host_pid, ns_pid, ns_depth, selector, comm FROM targets")
        assert sorted(rows) == sorted(
            (p, p, 0, f"comm={Path(named).name}", Path(named).name[:15]) for p in (a.pid, b.pid)
        )
    finally:
        a.close()
        b.close()


@requires_root
def test_cgroup_selects_its_processes_and_not_the_others(
    named: str, cgroup: tuple[str, str], tmp_path: Path
) -> None:
    rel, d = cgroup
    inside, outside = Target(named), Target(named)
    try:
        Path(d, "cgroup.procs").write_text(str(inside.pid))
        db = tmp_path / "gf.db"
        # The directory and the /proc/PID/cgroup spelling name the same cgroup.
        for name in (d, rel):
            with gpufault.arm(Fault.fail(*VICTIM, ret=-9, sticky=True), gpufault.Target.cgroup(
                    name), db=db, duration=30) as s:  # fmt: skip
                assert isinstance(s, gpufault.IsolatedSession | gpufault.Session)
                assert s.target.pid == inside.pid
                assert [r[3] for r in inside.victim(2)] == [-9, -9]
                assert [r[3] for r in outside.victim(2)] == [2, 3]
        rows = _rows(db, "SELECT host_pid, cgroup, selector FROM targets")
        assert rows == [(inside.pid, rel, f"cgroup={d}"), (inside.pid, rel, f"cgroup={rel}")]
    finally:
        inside.close()
        outside.close()


_LAUNCHER = """
import os, subprocess, sys
exe, fifos = sys.argv[1], sys.argv[2:]
kids = []
for rank, (i, o) in enumerate(zip(fifos[0::2], fifos[1::2])):
    env = dict(os.environ, RANK=str(1 - rank))  # rank 1 is started first
    kids.append(subprocess.Popen([exe], stdin=open(i, "rb"), stdout=open(o, "wb"), env=env))
print("started", " ".join(str(k.pid) for k in kids), flush=True)
sys.stdin.read()  # until the test closes it
for k in kids:
    k.wait()
"""


class _FifoTarget(Target):
    """A gf_target started by the launcher, driven through two FIFOs."""

    def __init__(self, pid: int, fin: Path, fout: Path) -> None:  # noqa: D107
        self.pid = pid
        self.p = subprocess.Popen(["true"])  # close() waits on something harmless
        self._in = open(fin, "w", buffering=1)  # noqa: SIM115
        self._out = open(fout)  # noqa: SIM115
        assert self._out.readline().startswith("ready")

    def cmd(self, line: str) -> list[str]:
        self._in.write(line + "\n")
        out = []
        while (ln := self._out.readline().strip()) != "done":
            if not ln:
                raise EOFError(line)
            out.append(ln)
        return out

    def close(self) -> int:
        self._in.write("quit\n")
        self._in.close()
        self._out.close()
        return self.p.wait()


@requires_root
def test_ranks_of_a_launcher_are_its_descendants_ranked_by_their_environment(
    named: str, tmp_path: Path
) -> None:
    fifos = []
    for k in range(2):
        for d in ("in", "out"):
            f = tmp_path / f"r{k}.{d}"
            os.mkfifo(f)
            fifos.append(f)
    launcher = subprocess.Popen(
        [sys.executable, "-I", "-c", _LAUNCHER, named, *map(str, fifos)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    ranks = []
    try:
        ranks = [_FifoTarget(0, fifos[0], fifos[1]), _FifoTarget(0, fifos[2], fifos[3])]
        assert launcher.stdout is not None
        pids = [int(x) for x in launcher.stdout.readline().split()[1:]]
        ranks[0].pid, ranks[1].pid = pids
        db = tmp_path / "gf.db"
        # ranks_of keeps the processes that map the library: the launcher
        # (a Python interpreter) is not one.
        with gpufault.arm_all(Fault.fail(*VICTIM, ret=-3, nth=1), gpufault.Target.ranks_of(
                launcher.pid), db=db, duration=30) as g:  # fmt: skip
            assert [t.pid for t in g.members] == [pids[1], pids[0]]  # rank 0 first
            assert [dict(t.labels)["rank"] for t in g.members] == [0, 1]
            assert [r[3] for r in ranks[0].victim(2)] == [-3, 3]
            assert [r[3] for r in ranks[1].victim(2)] == [-3, 3]
            assert g.wait_fires(2, 10)
        shown = subprocess.run([*GF, "show", g.run_ids[1], "--db", str(db)],
                               capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        assert f"  target    rank 1, chosen by ranks-of={launcher.pid}\n" in shown, shown
        rows = _rows(db, "SELECT rank, host_pid, selector FROM targets ORDER BY rank")
        assert rows == [(0, pids[1], f"ranks-of={launcher.pid}"),
                        (1, pids[0], f"ranks-of={launcher.pid}")]  # fmt: skip
    finally:
        for r in ranks:
            r.close()
        assert launcher.stdin is not None
        launcher.stdin.close()
        launcher.wait(10)


@requires_root
def test_a_process_in_its_own_pid_namespace_is_recorded_in_both_views(
    named: str, tmp_path: Path
) -> None:
    t = Target(named, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    try:
        db = tmp_path / "gf.db"
        with gpufault.arm(Fault.fail(*VICTIM, ret=-4, nth=1), t.pid, db=db, duration=30) as s:
            assert [r[3] for r in t.victim(2)] == [-4, 3]
            assert s.wait_fires(1, 10)
        (row,) = _rows(db, "SELECT host_pid, ns_pid, ns_depth, pid_ns, selector FROM targets")
        assert row[0] == t.pid and row[1] == 1 and row[2] == 1, row
        own = os.stat(f"/proc/{t.pid}/ns/pid").st_ino
        assert row[3] == own != os.stat("/proc/self/ns/pid").st_ino
        assert row[4] is None
    finally:
        t.close()


# ---- a container runtime's state, planted (a double of containerd/kubelet) ----

# Drawn per process: the pod is found by its uid across the whole cgroup
# tree, so two xdist workers planting the same uid at once each found the
# other's process in "their" pod (2 processes where 1 was planted).
_CID = "c0ffee" + secrets.token_hex(29)
_POD_UID = str(uuid.UUID(bytes=secrets.token_bytes(16), version=4))

# In a private mount namespace: a tmpfs where containerd's shim keeps its
# state and one where the kubelet keeps the pods' logs, then gpufault.
_PLANT = r"""
set -e
# Fresh tmpfs over /run and /var/log (not mkdir on the host's: a private
# mount namespace shares the host's directories, only mounts are its own).
mount -t tmpfs -o mode=755 gf /run
mount -t tmpfs -o mode=755 gf /var/log
d=/run/containerd/io.containerd.runtime.v2.task/k8s.io/$CID
mkdir -p $d /var/log/pods/$NS\_$POD\_$UID/$NAME
echo $PID > $d/init.pid
printf '%s' "$CONFIG" > $d/config.json
[ -z "$HOSTILE" ] || chown -R nobody $d
exec "$@"
"""


def _plant_env(pid: int, *, hostile: bool = False) -> dict[str, str]:
    """What _PLANT reads: containerd's task of pod serving/llm-0, container
    server, whose init is pid."""
    cfg = {"annotations": {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.container-name": "server",
        "io.kubernetes.cri.sandbox-name": "llm-0",
        "io.kubernetes.cri.sandbox-namespace": "serving",
        "io.kubernetes.cri.sandbox-uid": _POD_UID,
    }}  # fmt: skip
    return {"CID": _CID, "PID": str(pid), "CONFIG": json.dumps(cfg), "NS": "serving",
            "POD": "llm-0", "UID": _POD_UID, "NAME": "server",
            "HOSTILE": "1" if hostile else ""}  # fmt: skip


def _planted(pid: int, args: list[str], *, hostile: bool = False,
             ready: int | None = None) -> subprocess.Popen:  # fmt: skip
    env = dict(os.environ, **_plant_env(pid, hostile=hostile))
    return subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", _PLANT, "plant", *args],
        env=env, stderr=subprocess.PIPE, text=True,
        pass_fds=() if ready is None else (ready,),
    )  # fmt: skip


def _inject_ready(pid: int, sel: list[str], db: Path, *, hostile: bool = False
                  ) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """gpufault inject SEL in the planted namespace; returns once armed
    (its --ready-fd line) or exited."""
    r, w = os.pipe()
    p = _planted(pid, [*GF, "inject", *sel, "--lib", str(LIB), "--fn", "gf_victim",
                       "--action", "fail", "--ret", "-6", "--nth", "1", "--db", str(db),
                       "--duration", "60s", "-q", "--ready-fd", str(w)],
                 hostile=hostile, ready=w)  # fmt: skip
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    return p, line


def _end(p: subprocess.Popen) -> str:
    if p.poll() is None:
        p.send_signal(2)
    _, err = p.communicate(timeout=60)
    return err


@requires_root
def test_container_by_name_from_the_runtimes_state(named: str, tmp_path: Path) -> None:
    t = Target(named, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    try:
        db = tmp_path / "gf.db"
        p, line = _inject_ready(t.pid, ["--container", "server"], db)
        assert line.startswith("ready"), _end(p)
        assert [r[3] for r in t.victim(2)] == [-6, 3]
        err = _end(p)
        assert p.returncode == 0, err
        (row,) = _rows(db, "SELECT host_pid, ns_pid, container_id, container_name, runtime, "
                           "pod_namespace, pod_name, pod_uid, selector FROM targets")  # fmt: skip
        assert row == (t.pid, 1, _CID, "server", "containerd", "serving", "llm-0", _POD_UID,
                       "container=server"), row  # fmt: skip
        shown = subprocess.run([*GF, "show", "latest", "--db", str(db)], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
        want = (f"  target    container server (containerd, id {_CID[:12]}), pod serving/llm-0, "
                "its pid 1 in its PID namespace, chosen by container=server")  # fmt: skip
        assert want in shown, shown
        # An id prefix names it too; a name that is not there is one line.
        p, line = _inject_ready(t.pid, ["--container", _CID[:10]], db)
        assert line.startswith("ready"), _end(p)
        assert _end(p) == "" or p.returncode == 0
        p, line = _inject_ready(t.pid, ["--container", "nosuch"], db)
        err = _end(p)
        assert line == "" and p.returncode == 2, err
        # One line naming what runs: "server", and whatever else this host
        # runs meanwhile (another xdist worker's planted pod cgroup shows as
        # a container by id).
        (one,) = err.strip().splitlines()
        head = "gpufault: --container nosuch: no such container on this host (running: "
        assert one.startswith(head) and one.endswith(
            "); give its name or id as the runtime lists it"
        ), one
        assert "server" in one[len(head) :].split(")")[0].split(", "), one
    finally:
        t.close()


@requires_root
def test_state_another_user_could_write_is_not_state(named: str, tmp_path: Path) -> None:
    t = Target(named, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    try:
        p, line = _inject_ready(t.pid, ["--container", "server"], tmp_path / "gf.db", hostile=True)
        err = _end(p)
        assert line == "" and p.returncode == 2, err
        assert "--container server: no such container" in err
        # Nothing armed: the call returns its own value.
        assert [r[3] for r in t.victim(1)] == [2]
        assert not (tmp_path / "gf.db").exists()
    finally:
        t.close()


def _pod_cgroup(d: str) -> tuple[str, list[str]]:
    """The kubelet's systemd-driver layout of the planted pod under d: its
    leaf path (relative to d) and the directories made, outermost first."""
    u = _POD_UID.replace("-", "_")
    leaf = (f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/"
            f"cri-containerd-{_CID}.scope")  # fmt: skip
    dirs, path = [], d
    for part in leaf.split("/"):
        path = f"{path}/{part}"
        os.mkdir(path)
        dirs.append(path)
    return leaf, dirs


@requires_root
def test_a_pod_session_through_the_node_agent(
    named: str, cgroup: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/fleet.md's pod session: the agent runs where the kubelet's and
    containerd's state is (the planted mount namespace), a controller
    reaches it over TLS with a token and names the pod; the agent resolves
    it on its node, arms, streams the fire; the controller pulls the
    evidence, whose target is the pod."""
    from agentproc import AgentProc, make_certs

    rel, d = cgroup
    leaf, dirs = _pod_cgroup(d)
    t = Target(named)
    (tmp_path / "certs").mkdir()
    certs = make_certs(tmp_path / "certs")
    tok = tmp_path / "token"
    tok.write_text("pod-session-token-0123456789")
    tok.chmod(0o600)
    for k, v in _plant_env(t.pid).items():
        monkeypatch.setenv(k, v)
    agent = None
    try:
        Path(dirs[-1], "cgroup.procs").write_text(str(t.pid))
        agent = AgentProc(
            ["--listen", "tls://127.0.0.1:0", "--cert", certs["server.pem"], "--key",
             certs["server.key"], "--token-file", str(tok), "--db", str(tmp_path / "node.db"),
             "--node-name", "gpu-node-7", "--label", "pool=gpu"],
            prefix=("unshare", "-m", "--propagation", "private", "sh", "-c", _PLANT, "plant"),
        )  # fmt: skip
        (url,) = agent.urls
        auth = {"token_file": str(tok), "ca": certs["ca.pem"], "server_hostname": "localhost"}
        with gpufault.AgentClient.connect(url, **auth) as c:
            assert (c.hello["node"], c.hello["labels"]) == ("gpu-node-7", {"pool": "gpu"})
            h = c.arm(Fault.fail(*VICTIM, ret=-6, nth=1), gpufault.Target.pod("serving/llm-0"),
                      duration=30, lease_s=5)  # fmt: skip
            assert [r[3] for r in t.victim(2)] == [-6, 3]
            assert h.wait_fires(1, 10)
            h.disarm()
            assert h.ended_by == "disarmed"
            (fault,) = h.fired()
            # A pod the node does not have: the agent's one line, nothing armed.
            with pytest.raises(gpufault.GpufaultError,
                               match="no such pod on this node .pods here: serving/llm-0."):
                c.arm(Fault.fail(*VICTIM, ret=-6), gpufault.Target.pod("serving/other"),
                      duration=30)  # fmt: skip
            assert c.sessions() == []
        # The same through the CLI: held until its deadline, the fire printed.
        cli = subprocess.Popen([*GF, "agent", "arm", "--agent", url, "--ca", certs["ca.pem"],
                                "--token-file", str(tok), "--server-name", "localhost", "--pod",
                                "serving/llm-0", "--lib", str(LIB), "--fn", "gf_victim", "--ret",
                                "-7", "--duration", "3s"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert cli.stderr is not None
        armed = cli.stderr.readline()
        assert " in pod serving/llm-0 on gpu-node-7 " in armed, armed
        assert [r[3] for r in t.victim(1)] == [-7]
        out, err = cli.communicate(timeout=30)
        assert cli.returncode == 0, err
        assert out.startswith("fire ") and " gf_victim " in out
        assert "ended: deadline (1 fires)" in err
        print(armed + out + err)
        fleet = tmp_path / "fleet.db"
        gpufault.pull_evidence([url], fleet, **auth)
        rows = _rows(fleet, "SELECT host_pid, container_name, pod_namespace, pod_name, "
                            "pod_uid, cgroup, selector FROM targets")  # fmt: skip
        # the API's run and the CLI's, both the pod's process
        assert rows == [(t.pid, "server", "serving", "llm-0", _POD_UID, f"{rel}/{leaf}",
                         "pod=serving/llm-0")] * 2, rows  # fmt: skip
        r = subprocess.run([*GF, "show", fault.fault_id, "--db", str(fleet)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and "pod serving/llm-0" in r.stdout, (r.stdout, r.stderr)
        print(r.stdout)
    finally:
        if agent is not None:
            assert agent.stop() == 0, agent.lines
        t.close()
        for x in reversed(dirs):
            os.rmdir(x)


@requires_root
def test_pod_selects_the_processes_in_its_cgroup(
    named: str, cgroup: tuple[str, str], tmp_path: Path
) -> None:
    rel, d = cgroup
    # The kubelet's systemd-driver layout under this test's cgroup.
    u = _POD_UID.replace("-", "_")
    leaf = (f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/"
            f"cri-containerd-{_CID}.scope")  # fmt: skip
    dirs = []
    path = d
    for part in leaf.split("/"):
        path = f"{path}/{part}"
        os.mkdir(path)
        dirs.append(path)
    t, other = Target(named), Target(named)
    try:
        Path(path, "cgroup.procs").write_text(str(t.pid))
        db = tmp_path / "gf.db"
        p, line = _inject_ready(t.pid, ["--pod", "serving/llm-0"], db)
        assert line.startswith("ready"), _end(p)
        assert [r[3] for r in t.victim(2)] == [-6, 3]
        assert [r[3] for r in other.victim(1)] == [2]
        err = _end(p)
        assert p.returncode == 0, err
        (row,) = _rows(db, "SELECT host_pid, container_id, container_name, pod_namespace, "
                           "pod_name, pod_uid, cgroup, selector FROM targets")  # fmt: skip
        assert row == (t.pid, _CID, "server", "serving", "llm-0", _POD_UID, f"{rel}/{leaf}",
                       "pod=serving/llm-0"), row  # fmt: skip
        p, line = _inject_ready(t.pid, ["--pod", "serving/other"], db)
        err = _end(p)
        assert p.returncode == 2 and "no such pod on this node (pods here: serving/llm-0)" in err
    finally:
        t.close()
        other.close()
        for x in reversed(dirs):
            os.rmdir(x)


# ---- bad input -----------------------------------------------------------------


def test_target_constructors_refuse_bad_values() -> None:
    for bad in ("", " ", "a\nb"):
        with pytest.raises(BadInput):
            gpufault.Target.container(bad)
    with pytest.raises(BadInput):
        gpufault.Target.ranks_of(0)
    with pytest.raises(BadInput):
        gpufault.Target.run(["x"]).threads("w")
    t = gpufault.Target.pod("ns/name").threads("worker")
    assert gpufault.Target.from_json(json.loads(json.dumps(t.to_json()))) == t


@requires_root
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pid", "1", "--container", "x"], "use either --pid or --container, not both"),
        (["--comm", "a", "--cgroup", "/b"], "give one of --cgroup, --comm, not several"),
        (["--thread", "w"], "--thread NAME: say whose threads: add --pid PID or a selector"),
        (["--tid", "1", "--comm", "a"], "--tid names one thread already"),
        (["--cgroup", "rel/path"], "--cgroup rel/path: give an absolute path"),
        (["--comm", "gf-no-such-process"], "--comm gf-no-such-process: no process has that name"),
        (["--pod", "justname"], "--pod justname: give NAMESPACE/NAME"),
    ],
)
def test_bad_selectors_are_one_line_and_leave_nothing(
    args: list[str], message: str, tmp_path: Path
) -> None:
    r = subprocess.run([*GF, "inject", *args, "--lib", str(LIB), "--fn", "gf_victim",
                        "--action", "fail", "--ret", "-1", "--db", str(tmp_path / "gf.db")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "gf.db").exists()


@requires_root
def test_thread_name_narrows_a_process_to_those_threads(named: str, tmp_path: Path) -> None:
    t = Target(named)
    try:
        # gf_target's main thread has the program's name; no thread is "nope".
        r = subprocess.run([*GF, "inject", "--pid", str(t.pid), "--thread", "nope", "--lib",
                            str(LIB), "--fn", "gf_victim", "--action", "fail", "--ret", "-1",
                            "--db", str(tmp_path / "gf.db")],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and f"no thread of that name in pid {t.pid}" in r.stderr, r
        name = Path(named).name[:15]
        with gpufault.arm(Fault.fail(*VICTIM, ret=-8, sticky=True),
                          gpufault.Target.process(t.pid).threads(name),
                          db=tmp_path / "gf.db", duration=30) as s:  # fmt: skip
            assert s.target.tid == t.pid
            # victim runs its calls on a new thread (named like main): a
            # thread that was not there when the selector resolved.
            assert [r[3] for r in t.victim(1)] == [2]
            (line,) = t.cmd("both 1")  # on the main thread, the selected one
            assert line.endswith("victim=-8"), line
    finally:
        t.close()
