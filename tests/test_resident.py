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
    after client.ANSWER_S with one line and runs the command itself."""
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
    finally:
        hung.close()
        t.close()


@pytest.mark.root
def test_a_caller_that_is_not_root_is_refused() -> None:
    # Not under tmp_path: its parents are root's only. conftest ignores
    # gf-test-run-* (a test session's own run directories).
    run_dir = Path(tempfile.mkdtemp(prefix="gf-test-run-serve-"))
    with _removed(run_dir), server(run_dir) as srv:
        sock = run_dir / wire.SOCKET_NAME
        os.chmod(run_dir, 0o755)  # let nobody reach it: SO_PEERCRED must still refuse
        os.chmod(sock, 0o666)
        code = (
            "import array, socket; s = socket.socket(socket.AF_UNIX);"
            f"s.connect({str(sock)!r});"
            "s.sendmsg([b'\\0\\0\\0\\0'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,"
            " array.array('i', (0, 1, 2)))]); print(s.recv(16)[:1].decode())"
        )
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "/usr/bin/python3", "-c", code], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
        assert r.stdout.strip() == "N", r.stderr
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
    assert "GPUFAULT_RUN_DIR" in found  # the scan sees the known ones


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
