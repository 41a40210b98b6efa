"""`gpufault serve` (pyctl/resident): a `trace --pid` handed to a running
server behaves as the same command run in-process (output, evidence,
status, Ctrl-C), ends when its client is killed, and anything the server
must not answer (other code, another import-time environment, a caller
that is not root) runs in-process or is refused."""

from __future__ import annotations

import ast
import os
import re
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import tag
from gftarget import TARGET, Target, bpf_progs, no_new_progs, on_victim
from procio import finish, start_controller

from pyctl.resident import wire

REPO = Path(__file__).resolve().parent.parent
GF = [sys.executable, "-m", "pyctl"]
LOGGED = re.compile(r"serve: pid (\d+): controller (\d+): gpufault (.*)")

# `gpufault serve` as a server started before an upgrade would be: its
# fingerprint is not this code's.
OLDER_SERVER = (
    "import sys; from pyctl.resident import wire; wire.fingerprint = lambda: 'older';"
    "sys.argv = ['gpufault', 'serve']; from pyctl.entry import main; main()"
)
needs_target = pytest.mark.skipif(not TARGET.exists(), reason="run make build")


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "GPUFAULT_RUN_DIR": str(run_dir), **extra}
    env.pop("GPUFAULT_NO_SERVER", None)
    return env


@contextmanager
def server(run_dir: Path, code: str | None = None) -> Iterator[subprocess.Popen[str]]:
    """`gpufault serve` listening in run_dir (code: a `python -c` that runs
    it instead, to change something first); stopped with SIGTERM after,
    which must remove its socket."""
    argv = [*GF, "serve"] if code is None else [sys.executable, "-c", code]
    p, _ = start_controller(argv, marker="listening on", env=_env(run_dir), cwd=REPO)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=30) == 0
            assert not (run_dir / wire.SOCKET_NAME).exists()


def served_line(srv: subprocess.Popen[str]) -> tuple[int, int, str]:
    """The server's log line for the request it just took: client pid,
    controller pid, command."""
    assert srv.stderr is not None
    line = srv.stderr.readline()
    m = LOGGED.match(line)
    assert m, f"not a request line: {line!r}"
    return int(m.group(1)), int(m.group(2)), m.group(3)


def calls_stored(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT count(*) FROM calls").fetchone()[0]


def await_exit(pid: int, timeout: float) -> bool:
    """Whether the process ended within timeout (its pidfd turns readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@pytest.mark.root
@needs_target
def test_a_served_trace_is_the_same_run(tmp_path: Path) -> None:
    run_dir, db = tmp_path / "run", tmp_path / "gf.db"
    t = Target()
    try:
        with server(run_dir) as srv:
            argv = [*GF, *on_victim("trace", t.pid), "--db", str(db)]
            ctl, lines = start_controller(argv, env=_env(run_dir), stdout=subprocess.PIPE,
                                          cwd=REPO)  # fmt: skip
            client, controller, cmd = served_line(srv)
            assert client == ctl.pid and controller != ctl.pid
            assert cmd.startswith(f"trace --pid {t.pid} ")
            # The controller's own start-up line, on the client's stderr.
            assert f"in pid {t.pid}" in lines[-1]
            assert len(t.victim(40)) == 40
            ctl.send_signal(signal.SIGINT)  # forwarded: the run ends cleanly
            out, err = finish(ctl, timeout=60)
            assert ctl.returncode == 0, err
            assert "gf_victim" in out and "calls 40" in out  # the summary, on its stdout
            assert calls_stored(db) == 40
            assert await_exit(controller, 10)
    finally:
        t.close()


@pytest.mark.root
@needs_target
def test_a_served_inject_fails_the_nth_call(tmp_path: Path) -> None:
    """The fault path through a forked controller: on kernels that refuse
    register writes that is the copilot, whose ptrace the controller does."""
    run_dir, db = tmp_path / "run", tmp_path / "gf.db"
    t = Target()
    try:
        with server(run_dir) as srv:
            argv = [*GF, *on_victim("inject", t.pid), "--action", "fail", "--ret", "-5",
                    "--nth", "2", "--db", str(db)]  # fmt: skip
            ctl, _ = start_controller(argv, env=_env(run_dir), stdout=subprocess.PIPE, cwd=REPO)
            assert served_line(srv)[0] == ctl.pid
            rets = [r[3] for r in t.victim(3)]
            assert rets[1] == -5 and -5 not in (rets[0], rets[2]), rets
            ctl.send_signal(signal.SIGINT)
            _, err = finish(ctl, timeout=60)
            assert ctl.returncode == 0, err
            with sqlite3.connect(db) as c:
                assert c.execute("SELECT count(*) FROM faults").fetchone()[0] == 1
    finally:
        t.close()


@pytest.mark.root
def test_bad_input_served_is_one_line_and_status_2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    dead = subprocess.Popen(["true"])
    dead.wait()
    with server(run_dir) as srv:
        r = subprocess.run([*GF, "trace", "--pid", str(dead.pid), "--lib", "libc", "--fn",
                            "getpid"], capture_output=True, text=True, env=_env(run_dir),
                           cwd=REPO, timeout=60)  # fmt: skip
        assert served_line(srv)[0] > 0  # it was served, not run in-process
        assert r.returncode == 2
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("gpufault: "), r.stderr


@pytest.mark.root
@needs_target
def test_killing_the_client_ends_the_controller_and_detaches(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    t = Target()
    try:
        with server(run_dir) as srv:
            before = bpf_progs()  # with the server's loaded object
            argv = [*GF, *on_victim("trace", t.pid), "--db", str(tmp_path / "gf.db")]
            ctl, _ = start_controller(argv, env=_env(run_dir), stdout=subprocess.DEVNULL,
                                      cwd=REPO)  # fmt: skip
            _, controller, _ = served_line(srv)
            assert bpf_progs() > before
            ctl.kill()
            ctl.wait()
            assert await_exit(controller, 10), "the controller outlived its client"
            assert no_new_progs(before)
            assert len(t.victim(5)) == 5  # the target runs on, unprobed
    finally:
        t.close()


@pytest.mark.root
@needs_target
@pytest.mark.parametrize("why", ["GPUFAULT_NO_SERVER", "GPUFAULT_DEBUG"])
def test_what_is_not_served_runs_in_process(tmp_path: Path, why: str) -> None:
    """GPUFAULT_NO_SERVER asks for it; GPUFAULT_DEBUG is read at import, so a
    controller forked from a server without it would not have it."""
    run_dir = tmp_path / "run"
    t = Target()
    try:
        with server(run_dir) as srv:
            argv = [*GF, *on_victim("trace", t.pid), "--db", str(tmp_path / "gf.db")]
            env = {**_env(run_dir), why: "1"}
            ctl, _ = start_controller(argv, env=env, stdout=subprocess.DEVNULL, cwd=REPO)
            ctl.send_signal(signal.SIGINT)
            _, err = finish(ctl, timeout=60)
            assert ctl.returncode == 0, err
            srv.send_signal(signal.SIGTERM)
            rest = finish(srv, timeout=30)[1]
            assert "controller" not in rest, rest
    finally:
        t.close()


@pytest.mark.root
@needs_target
def test_a_server_of_other_code_says_so_and_the_run_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    t = Target()
    try:
        with server(run_dir, OLDER_SERVER):
            argv = [*GF, *on_victim("trace", t.pid), "--db", str(tmp_path / "gf.db")]
            ctl, lines = start_controller(argv, env=_env(run_dir), stdout=subprocess.DEVNULL,
                                          cwd=REPO)  # fmt: skip
            assert "runs other code than this gpufault" in lines[0]
            assert "restart it; running in-process" in lines[0]
            ctl.send_signal(signal.SIGINT)
            assert finish(ctl, timeout=60) and ctl.returncode == 0
    finally:
        t.close()


def _doctor_serve_check(run_dir: Path) -> dict:
    r = subprocess.run([*GF, "doctor", "--json"], capture_output=True, text=True,
                       env=_env(run_dir), cwd=REPO, timeout=60)  # fmt: skip
    import json

    return next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "gpufault serve")


@pytest.mark.root
def test_doctor_names_the_server_and_a_stale_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _doctor_serve_check(run_dir)["detail"].startswith("not running")
    with server(run_dir) as srv:
        c = _doctor_serve_check(run_dir)
        assert (
            c["ok"] and c["detail"] == f"pid {srv.pid} on {run_dir / wire.SOCKET_NAME}, this code"
        )
    with server(run_dir, OLDER_SERVER) as srv:
        c = _doctor_serve_check(run_dir)
        assert not c["ok"] and not c["required"]  # a WARN: doctor still exits 0
        assert c["fix"] == f"kill {srv.pid} and start gpufault serve again"


@pytest.mark.root
def test_one_server_per_socket_and_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with server(run_dir):
        r = subprocess.run([*GF, "serve"], capture_output=True, text=True, env=_env(run_dir),
                           cwd=REPO, timeout=60)  # fmt: skip
        assert r.returncode == 2
        assert r.stderr.strip().startswith("gpufault: a gpufault serve already listens on")
    # A SIGKILLed server leaves its socket; the next one takes its place.
    p, _ = start_controller([*GF, "serve"], marker="listening on", env=_env(run_dir), cwd=REPO)
    p.kill()
    p.wait()
    assert (run_dir / wire.SOCKET_NAME).exists()
    with server(run_dir):
        pass
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"


@pytest.mark.root
@needs_target
def test_a_server_that_does_not_answer_is_skipped(tmp_path: Path) -> None:
    """A listener that never accepts (a hung server): the client gives up
    after client.ANSWER_S with one line and runs the command itself, and
    it handed nothing over: the connection left in the hung listener's
    queue holds no request and none of the caller's descriptors (they
    were sent before the server had accepted: a late accept could run the
    command twice, and the queued stderr kept the caller's reader from
    ever seeing its end, which hung this test when the controller died)."""
    import socket

    from pyctl.resident import client

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(run_dir / wire.SOCKET_NAME))
    hung.listen(1)  # connect() succeeds into the backlog; nobody reads
    t = Target()
    try:
        argv = [*GF, *on_victim("trace", t.pid), "--db", str(tmp_path / "gf.db")]
        ctl, lines = start_controller(argv, env=_env(run_dir), stdout=subprocess.DEVNULL,
                                      cwd=REPO)  # fmt: skip
        assert lines[0].strip() == (
            f"gpufault: gpufault serve did not answer within {client.ANSWER_S:.0f} s; "
            "running in-process"
        )
        assert len(t.victim(3)) == 3
        ctl.send_signal(signal.SIGINT)
        assert finish(ctl, timeout=60) and ctl.returncode == 0
        conn, _ = hung.accept()  # the connection the client made and gave up on
        with conn:
            conn.settimeout(5)
            data, anc, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
        assert (data, anc) == (b"", []), (data[:80], anc)
    finally:
        hung.close()
        t.close()


@pytest.mark.root
def test_a_caller_that_is_not_root_is_refused() -> None:
    # Not under tmp_path: its parents are root's only. It carries the
    # session's id, so conftest checks that it goes.
    run_dir = Path(tempfile.mkdtemp(prefix=tag("run-serve-")))
    with _removed(run_dir), server(run_dir) as srv:
        sock = run_dir / wire.SOCKET_NAME
        os.chmod(run_dir, 0o755)  # let nobody reach it: SO_PEERCRED must still refuse
        os.chmod(sock, 0o666)
        code = (
            "import array, socket; s = socket.socket(socket.AF_UNIX);"
            f"s.connect({str(sock)!r});"
            "s.sendmsg([b'\\0\\0\\0\\0'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,"
            " array.array('i', (0, 1, 2)))]); g = s.recv(1);"
            "print(g.decode() + s.recv(16)[:1].decode())"
        )
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "/usr/bin/python3", "-c", code], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
        assert r.stdout.strip() == "HN", r.stderr  # the greeting, then "not served"
        os.chmod(run_dir, 0o700)
        assert srv.poll() is None


@contextmanager
def _removed(d: Path) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _module_level_environ_reads(tree: ast.Module) -> set[str]:
    """Names read from os.environ by statements outside any function."""
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if (
                    isinstance(owner, ast.Attribute)
                    and owner.attr == "environ"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    names.add(str(node.args[0].value))
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                if node.value.attr == "environ" and isinstance(node.slice, ast.Constant):
                    names.add(str(node.slice.value))
    return names


def test_every_import_time_environment_read_is_compared() -> None:
    """A module that reads a variable when imported keeps the server's
    value in a forked controller: the server must refuse a request whose
    value differs, so each such name must be in wire.IMPORT_TIME_ENV."""
    found: dict[str, str] = {}
    for path in (REPO / "pyctl").rglob("*.py"):
        for name in _module_level_environ_reads(ast.parse(path.read_text())):
            found[name] = str(path.relative_to(REPO))
    missing = {n: p for n, p in found.items() if n not in wire.IMPORT_TIME_ENV}
    assert not missing, f"read at import, not in wire.IMPORT_TIME_ENV: {missing}"
    assert "GPUFAULT_FIRES_RING_BYTES" in found  # the scan sees the known ones


def test_a_request_round_trips() -> None:
    req = wire.encode_request(["trace", "--pid", "1", "--fn", "a=b"], "/tmp", 0o22,
                              {"A": "1=2", "B": ""}, "fp")  # fmt: skip
    (n,) = wire.LEN.unpack(req[:4])
    assert n == len(req) - 4
    assert wire.decode_request(req[4:]) == (
        "fp",
        "/tmp",
        0o22,
        ["trace", "--pid", "1", "--fn", "a=b"],
        {"A": "1=2", "B": ""},
    )
    with pytest.raises(wire.BadRequest):
        wire.decode_request(b"gf0\0x")
    with pytest.raises(wire.BadRequest):
        wire.decode_request(b"gf1\0fp\0/\0022\0009\0trace")


def test_only_attaches_to_running_processes_are_servable() -> None:
    from pyctl.entry import servable

    assert servable(["trace", "--pid", "1", "--fn", "x"])
    assert servable(["--db", "x.db", "inject", "--pid", "1"])
    assert not servable(["trace", "--fn", "x", "--", "sleep", "1"])
    assert not servable(["trace", "--help"])
    assert not servable(["show", "latest"])


# ---- a server the client must not trust (issue 25, items 4 and 12) -------------------

NOBODY = 65534


def _fake_server(sock_path: Path) -> tuple[int, int]:
    """Fork a process that becomes uid 65534 (another local user), listens
    on sock_path, and reports on a pipe what one connection sent it: b"R"
    once listening, then "BYTES FDS" (or "none" if nobody connected
    within 30 s). Returns (pid, read end)."""
    import array
    import socket

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(sock_path))
            os.chmod(sock_path, 0o666)
            s.listen(4)
            os.write(w, b"R")
            s.settimeout(30)
            try:
                conn, _ = s.accept()
            except TimeoutError:
                os.write(w, b"none")
                os._exit(0)
            conn.settimeout(30)
            try:
                conn.sendall(b"H")  # the greeting a real server sends: no help to it
            except OSError:
                pass
            got, fds = 0, 0
            while True:
                data, anc, _f, _a = conn.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
                for _lvl, _kind, payload in anc:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                    fds += len(a)
                if not data:
                    break
                got += len(data)
            os.write(w, f"{got} {fds}".encode())
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"R"  # listening: the client may come
    return pid, r


def _report(pid: int, r: int) -> str:
    out = b""
    while chunk := os.read(r, 64):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out.decode()


@contextmanager
def _world_dir() -> Iterator[Path]:
    """A directory uid 65534 can reach (tmp_path's parents are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="gf-test-run-iso-"))
    os.chmod(base, 0o755)  # made here, by this test
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.root
@pytest.mark.parametrize(
    "how", ["world-writable dir", "dir of another user", "socket of another user"]
)
def test_a_server_that_is_not_roots_gets_nothing(how: str) -> None:
    """Root's `trace --pid` with GPUFAULT_RUN_DIR where another user's fake
    server listens: the client sends it no byte and no descriptor (not its
    stdio, not its environment), says so in one line and runs in-process.
    The third case passes every directory check (root's, 0755): only the
    listener's SO_PEERCRED uid tells."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    with _world_dir() as base:
        run_dir = base / "run"
        run_dir.mkdir()
        if how == "world-writable dir":
            os.chmod(run_dir, 0o777)
            pid, r = _fake_server(run_dir / wire.SOCKET_NAME)
        elif how == "dir of another user":
            os.chown(run_dir, NOBODY, NOBODY)
            pid, r = _fake_server(run_dir / wire.SOCKET_NAME)
        else:
            theirs = base / "theirs"
            theirs.mkdir()
            os.chown(theirs, NOBODY, NOBODY)
            pid, r = _fake_server(theirs / wire.SOCKET_NAME)
            os.rename(theirs / wire.SOCKET_NAME, run_dir / wire.SOCKET_NAME)
        env = _env(run_dir, GF_SECRET="hunter2")
        argv = [*GF, "trace", "--pid", str(dead.pid), "--lib", "libc", "--fn", "getpid"]
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
        if how != "socket of another user":
            os.kill(pid, signal.SIGTERM)  # never connected to: end its accept
        report = _report(pid, r)
    assert report in ("", "none", "0 0"), report  # not a byte, not a descriptor
    lines = res.stderr.splitlines()
    assert len(lines) == 2, res.stderr
    assert lines[0].startswith("gpufault: ") and lines[0].endswith("; running in-process")
    want = "is served by uid 65534, not root" if how == "socket of another user" else str(run_dir)
    assert want in lines[0], lines[0]
    # ...and it ran in-process: the in-process controller's own one line.
    assert res.returncode == 2 and lines[1].startswith("gpufault: "), res.stderr


@pytest.mark.root
def test_an_unsafe_run_dir_is_refused_and_never_chmod_ed(tmp_path: Path) -> None:
    """A shared 1777 directory stays 1777, a link's target keeps its mode:
    `gpufault serve` refuses both with one line and status 2."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    link = tmp_path / "link"
    link.symlink_to(target)
    for d, why in ((shared, "is writable by others (mode 1777)"), (link, "is a symbolic link")):
        r = subprocess.run([*GF, "serve"], capture_output=True, text=True, env=_env(d),
                           cwd=REPO, timeout=60)  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert r.stderr.splitlines() == [
            f"gpufault: run directory {d} {why}: use a directory only root can write "
            "(unset GPUFAULT_RUN_DIR for /run/gpufault)"
        ]
    assert shared.stat().st_mode & 0o7777 == 0o1777
    assert target.stat().st_mode & 0o7777 == 0o755
    assert not (target / wire.SOCKET_NAME).exists() and not list(shared.iterdir())


def test_a_controllers_release_socket_refuses_an_unsafe_run_dir(tmp_path: Path) -> None:
    from pyctl import control, rundir

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(rundir.UnsafeRunDir, match="writable by others"):
        control.ControlSocket("feedbeef", shared).start()
    assert shared.stat().st_mode & 0o7777 == 0o1777 and not list(shared.iterdir())
    fresh = tmp_path / "fresh"  # one it makes itself is 0700
    c = control.ControlSocket("feedbeef", fresh)
    c.start()
    c.close()
    assert fresh.stat().st_mode & 0o7777 == 0o700


@pytest.mark.root
def test_a_full_backlog_falls_back_after_answer_s(tmp_path: Path) -> None:
    """A listener whose backlog is full (listen(0), never accepts): connect()
    is bounded by client.ANSWER_S, then one line and the run goes on
    in-process (before: the client hung in connect for good)."""
    import socket
    import time

    from pyctl.resident import client

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    full = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    full.bind(str(run_dir / wire.SOCKET_NAME))
    full.listen(0)
    fillers = []
    try:
        while True:  # fill its backlog until the kernel says it is full
            f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            f.setblocking(False)
            fillers.append(f)
            try:
                f.connect(str(run_dir / wire.SOCKET_NAME))
            except BlockingIOError:
                break
        dead = subprocess.Popen(["true"])
        dead.wait()
        argv = [*GF, "trace", "--pid", str(dead.pid), "--lib", "libc", "--fn", "getpid"]
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, env=_env(run_dir), cwd=REPO,
                           timeout=60)  # fmt: skip
        took = time.monotonic() - t0
    finally:
        for f in fillers:
            f.close()
        full.close()
    lines = r.stderr.splitlines()
    assert lines[0] == (
        f"gpufault: gpufault serve ({run_dir / wire.SOCKET_NAME}) did not accept within "
        f"{client.ANSWER_S:.0f} s; running in-process"
    ), r.stderr
    assert r.returncode == 2 and len(lines) == 2  # the in-process run's own line
    assert client.ANSWER_S <= took < client.ANSWER_S + 20, took
