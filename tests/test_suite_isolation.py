"""The leak checks of tests/conftest.py judge only what their own session
made: a network namespace, a socket in /run/gpufault, a gf* file in /tmp
made during a test by a process outside the session (another session, a
controller, `gpufault serve`) passes; the same things made by the session
itself fail it. Each case is a real pytest run of a small module with the
suite's conftest, in a subprocess."""

from __future__ import annotations

import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="requires root (netns, /run)"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs ip(8)"),
]

# The inner session's conftest is the suite's, loaded under another name
# (the inner directory's own conftest.py is "conftest" too).
SUITE_CONFTEST = str(REPO / "tests" / "conftest.py")
INNER_CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("gf_suite_conftest", {SUITE_CONFTEST!r})
suite = importlib.util.module_from_spec(spec)
import sys
sys.modules["gf_suite_conftest"] = suite
spec.loader.exec_module(suite)
globals().update({{k: v for k, v in vars(suite).items() if not k.startswith("__")}})
"""

# During the test, the outer test (outside the inner session) makes its
# things: the inner test says "go" on one fifo and waits for "done".
FOREIGN_MODULE = """
def test_something_else_runs_beside(fifo_dir):
    open(fifo_dir + "/go", "w").write("go")
    assert open(fifo_dir + "/done").read() == "done"
"""

# The inner session's own: a netns with its tag left behind (the per-test
# check), a file in /tmp with its tag and a process of its own still
# listening in /run/gpufault at its end (the session check).
OWN_MODULE = """
import os, subprocess, sys
import gf_suite_conftest as c

def test_leaves_a_netns(fifo_dir):
    name = c.tag("left")
    open(fifo_dir + "/netns", "w").write(name)
    subprocess.run(["ip", "netns", "add", name], check=True)

def test_leaves_a_file_and_a_server(fifo_dir):
    path = "/tmp/" + c.tag("left")
    open(fifo_dir + "/file", "w").write(path)
    open(path, "w").close()
    code = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]);"
            "s.listen(); print('up', flush=True); time.sleep(600)")
    sock = "/run/gpufault/" + c.tag("serve.sock")
    open(fifo_dir + "/socket", "w").write(sock)
    p = subprocess.Popen([sys.executable, "-c", code, sock], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    open(fifo_dir + "/server", "w").write(str(p.pid))
    assert p.stdout.readline() == b"up\\n"
"""

FIXTURE = """
import os, pytest

@pytest.fixture
def fifo_dir():
    return os.environ["GF_ISOLATION_DIR"]
"""


def _inner(tmp_path: Path, module: str) -> tuple[Path, Path]:
    d = tmp_path / "inner"
    d.mkdir()
    (d / "conftest.py").write_text(INNER_CONFTEST + FIXTURE)
    (d / "test_inner.py").write_text(module)
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    return d, fifos


def _run(d: Path, fifos: Path, tmp_path: Path) -> subprocess.Popen[str]:
    # Only the suite's conftest: no installed plugin (xdist, anyone's).
    env = {**os.environ, "GF_ISOLATION_DIR": str(fifos), "PYTHONPATH": str(REPO)}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["-c", str(d / "conftest.py"), "--rootdir", str(d), "--basetemp", str(tmp_path / "bt")]
    return subprocess.Popen(
        [*cmd, str(d)], cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _read_fifo(path: Path, writer: subprocess.Popen[str], timeout_s: float = 120.0) -> str:
    """What the inner session writes into the fifo at path. Opened without
    blocking and polled, so an inner session that dies before it writes
    (a conftest that fails to load) fails this test with its output
    instead of hanging it on open(2) for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        got = b""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if writer.poll() is not None and not got:
                out = writer.stdout.read() if writer.stdout else ""
                rc = writer.returncode
                pytest.fail(f"the inner session ended (rc {rc}) before writing {path.name}:\n{out}")
            if left <= 0:
                pytest.fail(f"nothing in {path.name} after {timeout_s:.0f} s")
            # Readable once a writer wrote (or closed after writing); the
            # 0.5 s is only how often the writer's life is looked at.
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 4096)
                if chunk:
                    got += chunk
                    continue
                if got:
                    return got.decode()
    finally:
        os.close(fd)


def _netns_dir_mounted() -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == "/run/netns" for line in f)


@contextmanager
def _netns_dir_restored() -> Iterator[None]:
    """`ip netns add` mounts /run/netns and `ip netns delete` leaves it:
    unmounted again if it was not mounted and nothing is left in it."""
    was = _netns_dir_mounted()
    try:
        yield
    finally:
        if not was and _netns_dir_mounted() and not os.listdir("/run/netns"):
            subprocess.run(["umount", "/run/netns"], check=False)


@contextmanager
def _run_dir_made() -> Iterator[Path]:
    """/run/gpufault as a machine with a `gpufault serve` has it; removed
    afterwards if it was not there."""
    d = Path("/run/gpufault")
    made = not d.exists()
    d.mkdir(mode=0o755, exist_ok=True)
    try:
        yield d
    finally:
        if made:
            shutil.rmtree(d, ignore_errors=True)


def test_what_others_make_beside_the_session_does_not_fail_it(tmp_path: Path) -> None:
    d, fifos = _inner(tmp_path, FOREIGN_MODULE)
    os.mkfifo(fifos / "go")
    os.mkfifo(fifos / "done")
    netns = f"gfforeign{secrets.token_hex(3)}"
    other = f"gf-t{secrets.token_hex(4)}-"  # another session's prefix
    files = [Path(f"/tmp/gf-foreign-{secrets.token_hex(3)}"), Path(f"/tmp/{other}left")]
    with _netns_dir_restored(), _run_dir_made() as run_dir:
        sock_path = run_dir / f"serve-{secrets.token_hex(3)}.sock"
        srv = socket.socket(socket.AF_UNIX)
        p = _run(d, fifos, tmp_path)
        try:
            assert _read_fifo(fifos / "go", p) == "go"
            # Now, while the inner test runs: another gpufault's socket, a
            # netns, gf* files in /tmp (one of them another session's).
            subprocess.run(["ip", "netns", "add", netns], check=True)
            srv.bind(str(sock_path))
            srv.listen()
            for f in files:
                f.touch()
            (fifos / "done").write_text("done")
            out = p.communicate(timeout=120)[0]
        finally:
            p.kill()
            p.wait()
            srv.close()
            sock_path.unlink(missing_ok=True)
            for f in files:
                f.unlink(missing_ok=True)
            subprocess.run(["ip", "netns", "delete", netns], check=False)
    assert p.returncode == 0, out
    assert "1 passed" in out and "error" not in out.lower(), out


def test_what_the_session_makes_and_leaves_fails_it(tmp_path: Path) -> None:
    d, fifos = _inner(tmp_path, OWN_MODULE)
    with _netns_dir_restored(), _run_dir_made():
        p = _run(d, fifos, tmp_path)
        try:
            out = p.communicate(timeout=120)[0]
        finally:
            p.kill()
            p.wait()
            netns = (fifos / "netns").read_text() if (fifos / "netns").exists() else ""
            if netns:
                subprocess.run(["ip", "netns", "delete", netns], check=False)
            if (fifos / "file").exists():
                Path((fifos / "file").read_text()).unlink(missing_ok=True)
            if (fifos / "server").exists():
                os.kill(int((fifos / "server").read_text()), signal.SIGKILL)
            if (fifos / "socket").exists():
                Path((fifos / "socket").read_text()).unlink(missing_ok=True)
    assert p.returncode != 0, out
    assert f"test left network namespaces behind: ['{netns}']" in out, out
    # (with /run/netns itself when this netns was the one that mounted it)
    assert re.search(rf"test left mounts behind: \[[^]]*'/run/netns/{netns}'", out), out
    assert "the test session left files outside its temporary dirs" in out, out
    assert (fifos / "file").read_text() in out, out
    assert "the test session's processes still hold gpufault's default places" in out, out
