"""`gpufault release` reaches controllers through their control sockets
(pyctl/control.py), never by a PID read from a file: a SIGKILLed
controller's leftovers are removed, an unrelated process that now has its
PID is never signalled, and a live controller releases its stalled thread."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import tag
from gftarget import LIB, TARGET, Target

from pyctl import control

REPO = Path(__file__).resolve().parent.parent
GF = [sys.executable, "-m", "pyctl"]


def _release(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUFAULT_RUN_DIR": str(run_dir)}
    return subprocess.run(
        [*GF, "release", *args], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )


def test_a_dead_controllers_socket_is_removed_and_nobody_is_signalled(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # What a SIGKILLed controller leaves: a socket file nobody listens on ...
    code = (
        "import sys, signal; from pathlib import Path; from pyctl.control import "
        "ControlSocket as C; c = C('deadbeef', Path(sys.argv[1])); c.start(); "
        "print(c.path, flush=True); signal.pause()"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert owner.stdout is not None
    sock = Path(owner.stdout.readline().strip())
    owner.kill()
    owner.wait()
    assert sock.exists()
    # ... and the old-style pidfile, naming a PID that now belongs to a sleep.
    bystander = subprocess.Popen(["sleep", "30"])
    (run_dir / f"{bystander.pid}.run").write_text("deadbeef")
    try:
        r = _release(run_dir)
        assert r.returncode == 2
        assert "removed 1 stale control socket" in r.stdout
        assert (
            r.stderr.strip() == "gpufault: no running gpufault controller found: nothing to release"
        )
        assert not sock.exists()
        assert bystander.poll() is None  # never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_release_pid_never_signals_an_arbitrary_process(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        r = _release(tmp_path / "run", "--pid", str(bystander.pid))
        assert r.returncode == 2 and "no gpufault controller with pid" in r.stderr
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_request_from_another_user_is_refused() -> None:
    if os.geteuid() != 0:
        pytest.skip("requires root to act as another user")
    import shutil
    import signal
    import tempfile

    hits: list[int] = []
    # Under /tmp itself: pytest's tmp_path sits below a 0700 directory.
    where = Path(tempfile.mkdtemp(prefix=tag("ctl-")))  # conftest checks it goes
    old = signal.signal(signal.SIGUSR1, lambda *a: hits.append(1))
    ctl = control.ControlSocket("r1", where)
    ctl.start()
    try:
        os.chmod(where, 0o755)
        os.chmod(ctl.path, 0o666)
        code = (
            f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(ctl.path)!r});"
            "s.sendall(b'release\\n'); print(s.recv(64).decode().strip())"
        )
        r = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                code,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.stdout.strip() == "refused", r.stderr
        assert hits == []
    finally:
        ctl.close()
        signal.signal(signal.SIGUSR1, old)
        shutil.rmtree(where)


@pytest.mark.root
def test_release_frees_a_live_controllers_stalled_thread(tmp_path: Path) -> None:
    if not TARGET.exists():
        pytest.skip("build/targets/gf_target missing: run make build")
    run_dir = tmp_path / "run"
    env = {**os.environ, "GPUFAULT_RUN_DIR": str(run_dir)}
    t = Target()
    ctl = subprocess.Popen(
        [
            *GF,
            "inject",
            "--pid",
            str(t.pid),
            "--lib",
            str(LIB),
            "--fn",
            "gf_victim",
            "--action",
            "stall",
            "--nth",
            "1",
            "--db",
            str(tmp_path / "gf.db"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert ctl.stderr is not None
        while "Ctrl-C to end" not in (ln := ctl.stderr.readline()):
            assert ln, "controller exited early"
        result: list = []
        th = threading.Thread(target=lambda: result.append(t.victim(2)))
        th.start()
        deadline = time.monotonic() + 20
        while not _stopped(t.pid):
            assert time.monotonic() < deadline, "no thread was stalled"
        r = _release(run_dir, "--pid", str(ctl.pid))
        assert r.returncode == 0, r.stderr
        assert f"asked controller {ctl.pid}" in r.stdout
        th.join(timeout=20)
        assert not th.is_alive(), "release did not free the stalled thread"
        assert [x[3] for x in result[0]] == [2, 3]
        assert ctl.poll() is None  # the controller carries on
    finally:
        ctl.terminate()
        ctl.wait(timeout=20)
        t.close()
    assert not list(run_dir.glob("*.sock"))  # its socket went with it


def _stopped(pid: int) -> bool:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("t", "T"):
                return True
        except OSError:
            continue
    return False


def test_socket_peer_credentials_are_read() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert control.peer(a) == (os.getpid(), os.geteuid())


# ---- a control socket root must not trust (issue 25 item 4) --------------------------


@pytest.mark.root
@pytest.mark.parametrize(
    "how", ["world-writable dir", "dir of another user", "socket of another user"]
)
def test_release_sends_nothing_to_a_listener_that_is_not_roots(how: str) -> None:
    """`gpufault release` with GPUFAULT_RUN_DIR where another user
    (uid 65534, a forked child) listens on a `*.sock`: not a byte reaches
    it. An unsafe directory is refused in one line before any connect; in
    a directory that passes every check (root's, 0700) only the
    listener's SO_PEERCRED uid tells, and that socket is named in a
    warning. The previous code sent `release` to all three."""
    from test_resident import NOBODY, _fake_server, _report, _world_dir

    with _world_dir() as base:
        run_dir = base / "run"
        run_dir.mkdir(mode=0o700)
        name = "4242-deadbeef.sock"
        if how == "world-writable dir":
            os.chmod(run_dir, 0o777)
            pid, r = _fake_server(run_dir / name)
        elif how == "dir of another user":
            os.chown(run_dir, NOBODY, NOBODY)
            pid, r = _fake_server(run_dir / name)
        else:
            theirs = base / "theirs"
            theirs.mkdir()
            os.chown(theirs, NOBODY, NOBODY)
            pid, r = _fake_server(theirs / name)
            os.rename(theirs / name, run_dir / name)
        res = _release(run_dir)
        if how != "socket of another user":
            os.kill(pid, signal.SIGTERM)  # never connected to: end its accept
        report = _report(pid, r)
        left = sorted(p.name for p in run_dir.iterdir())
    assert report in ("", "none", "0 0"), report  # "8 0" before: b"release\n"
    assert res.returncode == 2, res
    lines = res.stderr.splitlines()
    if how == "socket of another user":
        assert lines == [
            f"gpufault: warning: {name} is served by uid 65534, not root: sent nothing "
            "(stop that process; check who can write the run directory)",
            "gpufault: no running gpufault controller found: nothing to release",
        ], res.stderr
    else:
        assert len(lines) == 1 and lines[0].startswith(f"gpufault: run directory {run_dir} ")
        assert "not asking anything there" in lines[0], lines[0]
    assert left == [name] and res.stdout == ""  # not removed as stale either


def test_release_reads_the_run_dir_when_called() -> None:
    """An empty GPUFAULT_RUN_DIR is the default, not the current directory
    (Path('') is '.'); read at each call, not at import."""
    from pyctl import rundir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUFAULT_RUN_DIR", "")
        assert control.ControlSocket("r1").run_dir == Path(rundir.DEFAULT)
