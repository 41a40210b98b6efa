"""An agent process for tests (`gpufault agent serve` as a `python -I`
child, as root runs it), certificates made with the openssl CLI, and the
probe check (the first bytes of a function in a process against the file:
a uprobe is an int3 in the process's copy of the page)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from pyctl.paths import module_argv


class AgentProc:
    def __init__(
        self, args: list[str], *, timeout: float = 30.0, prefix: tuple[str, ...] = ()
    ) -> None:
        # prefix: e.g. nsenter --net=/run/netns/NS (a network namespace only:
        # `ip netns exec` would remount /sys, and with it bpffs and tracefs)
        self.p = subprocess.Popen([*prefix, *module_argv("pyctl", ["agent", "serve", *args])],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, cwd="/")  # fmt: skip
        self.lines: list[str] = []
        self.urls: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            assert self.p.stderr is not None
            for ln in self.p.stderr:
                self.lines.append(ln.rstrip("\n"))
                if "agent: listening on " in ln:
                    self.urls = ln.split("listening on ")[1].split(" (pid")[0].split()
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        ready.wait(timeout)
        assert self.urls, f"agent did not start: {self.lines}"
        self.pid = self.p.pid

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.terminate()
        return self.p.wait(30)


def make_certs(d: Path) -> dict[str, str]:
    """ca (signs the agent and client), other-ca (signs a client no agent
    trusts): PEM files in d."""

    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)

    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "other-ca"):
        run(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-days",
            "2",
            "-subj",
            f"/CN=gf-test-{ca}",
        )
    for name, ca, ext in (("server", "ca", True), ("client", "ca", False),
                          ("rogue", "other-ca", False)):  # fmt: skip
        run(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=gf-test-{name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            *(["-extfile", "san.cnf"] if ext else []),
        )
    for f in d.iterdir():
        os.chmod(f, 0o600)
    return {n: str(d / n) for n in (f.name for f in d.iterdir())}


def code_at(pid: int, lib: str, fn: str) -> tuple[str, str]:
    """The first 8 bytes of fn in the process, and in the file."""
    from pyctl.symbols import resolve

    sym = resolve.symbols(resolve.find_library(lib, pid), fn)[0]
    real = os.path.realpath(lib)
    addr = None
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            p = ln.split()
            if len(p) >= 6 and os.path.realpath(p[-1]) == real and "x" in p[1]:
                addr = int(p[0].split("-")[0], 16) + sym.offset - int(p[2], 16)
    assert addr is not None, f"{lib} is not mapped executable in pid {pid}"
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(addr)
        mem = f.read(8)
    with open(lib, "rb") as f:
        f.seek(sym.offset)
        disk = f.read(8)
    return mem.hex(), disk.hex()


def probed(pid: int, lib: str, fn: str) -> bool:
    mem, disk = code_at(pid, lib, fn)
    return mem != disk
