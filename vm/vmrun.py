#!/usr/bin/env python3
"""Run a command inside a qemu/TCG VM that sees the host's root read-only.

The kernel is one that vm/fetch_kernels.py put under build/vm/ (bookworm:
Debian 12's 6.1; sid: Debian sid's 7.x). A busybox init mounts the host
root over 9p with proc, sys, devtmpfs, tmpfs /tmp and /run, tracefs,
debugfs, bpffs and cgroup2, mounts each --rw directory read-write at its own
path, runs the command in a chroot, and powers off. The exit status is the
command's; a kernel splat in the guest's log fails the run unless
--allow-splats.

Examples:
  python3 vm/vmrun.py --kernel sid -- python3 -c 'import os; print(os.uname())'
  python3 vm/vmrun.py --kernel bookworm --rw "$PWD/build" --cwd "$PWD" -- make -C kmod check
  python3 vm/vmrun.py --edu --qmp-on 'UNPLUG-NOW=device_del edu0' -- sh -c '...'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import initramfs  # noqa: E402
import splats  # noqa: E402

HERE = Path(__file__).resolve().parent
VMDIR = HERE.parent / "build" / "vm"
KERNELS = ("bookworm", "sid")
BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")
QEMU = "qemu-system-x86_64"
# Exit statuses of the runner itself (the command's own status otherwise).
RC_TIMEOUT = 124
RC_NO_EXIT = 125  # the guest stopped without reporting the command's status


class VMError(Exception):
    """Bad input or a missing prerequisite; the message says what to do."""


@dataclass
class VMResult:
    rc: int  # the command's exit status, or RC_TIMEOUT / RC_NO_EXIT
    console: str  # everything the guest printed on its serial console
    splats: list[str]  # kernel log lines that start a splat report
    seconds: float  # wall time from qemu start to its exit
    output: str = ""  # what the command printed (stdout and stderr)
    dmesg: str = ""  # the guest's kernel log when the command ended
    timed_out: bool = False
    error: str | None = None  # why there is no command status, if there is none
    fired: list[str] = field(default_factory=list)  # --qmp-on markers acted on
    left: list[str] = field(default_factory=list)  # what a shared guest cleaned up after it


# --- kernels ----------------------------------------------------------------


def kernel_dir(kernel: str) -> Path:
    if kernel not in KERNELS:
        raise VMError(f"unknown kernel {kernel!r}; use one of {', '.join(KERNELS)}")
    return VMDIR / kernel


def kernel_available(kernel: str) -> str | None:
    """None when the kernel is fetched and qemu is installed, else why not
    (for pytest skip reasons)."""
    try:
        kdir = kernel_dir(kernel)
    except VMError as e:
        return str(e)
    for name in ("release", "vmlinuz", "modules/order"):
        if not (kdir / name).exists():
            return f"VM kernel {kernel} not fetched (run `make vm-kernels`)"
    if shutil.which(QEMU) is None:
        return f"{QEMU} not installed (apt-get install qemu-system-x86)"
    if not any(Path(b).is_file() for b in BUSYBOX):
        return "busybox not installed (apt-get install busybox-static)"
    return None


def kernel_release(kernel: str) -> str:
    """The fetched kernel's `uname -r` string."""
    why = kernel_available(kernel)
    if why:
        raise VMError(why)
    return (kernel_dir(kernel) / "release").read_text().strip()


# --- initramfs --------------------------------------------------------------


def _busybox() -> bytes:
    for b in BUSYBOX:
        if Path(b).is_file():
            return Path(b).read_bytes()
    raise VMError("busybox not installed (apt-get install busybox-static)")


def base_initramfs(kernel: str) -> bytes:
    """The per-kernel archive: busybox, init, modules. Built afresh for each
    run (a few milliseconds), so an edited init.sh always takes effect."""
    kdir = kernel_dir(kernel)
    mods = (kdir / "modules" / "order").read_text().split()
    ents = [initramfs.directory(d) for d in ("bin", "dev", "modules", "proc", "sys", "mnt")]
    ents += [
        initramfs.chardev("dev/console", 5, 1),
        initramfs.file("bin/busybox", _busybox(), 0o755),
        initramfs.file("init", (HERE / "init.sh").read_bytes(), 0o755),
        initramfs.file("serve.sh", (HERE / "serve.sh").read_bytes(), 0o644),
        initramfs.file("modules/order", (kdir / "modules" / "order").read_bytes()),
    ]
    ents += [initramfs.file(f"modules/{m}", (kdir / "modules" / m).read_bytes()) for m in mods]
    return initramfs.newc(ents)


def job_script(
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    rw: Sequence[str],
    nonce: str,
    bare: bool = False,
) -> str:
    """The /job.sh that init sources: rw mounts and the command line; bare:
    init mounts no tracefs, debugfs, bpffs or cgroup2 (a new machine)."""
    q = shlex.quote
    mounts = "".join(f"\tgf_mount_rw rw{i} {q(d)}\n" for i, d in enumerate(rw)) or "\t:\n"
    envs = " ".join(q(f"{k}={v}") for k, v in env.items())
    inner = 'cd "$1" && shift && exec "$@"'
    run = f"exec chroot /mnt/root /usr/bin/env -i {envs} /bin/sh -c {q(inner)} sh {q(cwd)} "
    run += " ".join(q(a) for a in argv)
    head = f"GF_NONCE={nonce}\nGF_BARE={int(bare)}\n"
    return head + f"gf_rw_mounts() {{\n{mounts}}}\ngf_run() {{\n\t{run}\n}}\n"


# --- qemu -------------------------------------------------------------------


def boot_image(kernel: str, image: str = "auto") -> Path:
    """auto: the uncompressed vmlinux (PVH entry) when fetch_kernels.py could
    make one, which saves the kernel's self-decompression (seconds under
    TCG), else the bzImage; vmlinux or vmlinuz: that file."""
    kdir = kernel_dir(kernel)
    if image == "auto":
        image = "vmlinux" if (kdir / "vmlinux").is_file() else "vmlinuz"
    if image not in ("vmlinux", "vmlinuz") or not (kdir / image).is_file():
        raise VMError(f"no boot image {image!r} for {kernel}; use auto, vmlinux or vmlinuz")
    return kdir / image


def qemu_argv(
    kernel: str, job: Path, rw: Sequence[str], edu: bool, mem: str, cpus: int, image: Path
) -> list[str]:
    """job: the run's private directory, holding initrd.cpio and qmp.sock,
    shared with the guest (tag gfjob) for the kernel log and exit status."""
    append = "console=ttyS0 panic=-1 quiet mitigations=off random.trust_cpu=on"
    argv = [
        QEMU, "-accel", "tcg", "-cpu", "max", "-smp", str(cpus), "-m", mem,
        "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio",
        # SeaBIOS's serial console would clear the terminal and cost time.
        "-fw_cfg", "name=etc/sercon-port,string=0",
        "-kernel", str(image), "-initrd", str(job / "initrd.cpio"), "-append", append,
        "-qmp", f"unix:{job / 'qmp.sock'},server=on,wait=off",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                   "multidevs=remap",
        "-virtfs", f"local,path={job},mount_tag=gfjob,security_model=none",
    ]  # fmt: skip
    for i, d in enumerate(rw):
        argv += ["-virtfs", f"local,path={d},mount_tag=rw{i},security_model=none,multidevs=remap"]
    if edu:
        # Behind a bridge so that the kmod tests see a realistic topology
        # and so that device_del has a hotplug-capable slot to leave.
        argv += ["-device", "pci-bridge,id=bridge0,chassis_nr=1",
                 "-device", "edu,id=edu0,bus=bridge0,addr=0x1"]  # fmt: skip
    return argv


def hmp(qmp_path: Path, command: str, timeout: float = 10.0) -> str:
    """Run one human-monitor command through the QMP socket; its output."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(qmp_path))
        f = s.makefile("rwb")

        def call(cmd: dict[str, object]) -> object:
            f.write(json.dumps(cmd).encode() + b"\n")
            f.flush()
            while True:  # skip asynchronous events until the reply
                msg = json.loads(f.readline())
                if "error" in msg:
                    raise VMError(f"QMP {cmd['execute']}: {msg['error'].get('desc')}")
                if "return" in msg:
                    return msg["return"]

        json.loads(f.readline())  # greeting
        call({"execute": "qmp_capabilities"})
        out = call({"execute": "human-monitor-command", "arguments": {"command-line": command}})
        return str(out)


class _Console(threading.Thread):
    """Reads the serial console; sends a monitor command when a --qmp-on
    marker shows up in a line."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        qmp: Path,
        qmp_on: Sequence[tuple[str, str]],
        echo: bool,
    ) -> None:
        super().__init__(daemon=True)
        self.proc, self.qmp, self.echo = proc, qmp, echo
        self.pending = list(qmp_on)
        self.chunks: list[bytes] = []
        self.fired: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        partial = b""
        while chunk := os.read(fd, 65536):
            self.chunks.append(chunk)
            if self.echo:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            if not self.pending:
                continue
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                self._watch(line.decode(errors="replace"))

    def _watch(self, line: str) -> None:
        for rule in list(self.pending):
            marker, command = rule
            if marker in line:
                self.pending.remove(rule)
                try:
                    hmp(self.qmp, command)
                    self.fired.append(marker)
                except (OSError, VMError, ValueError) as e:
                    self.errors.append(f"--qmp-on {marker}: {e}")

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _between(text: str, start: str, end: str) -> str:
    i = text.find(start)
    j = text.find(end, i + 1) if i >= 0 else -1
    if i < 0 or j < 0:
        return ""
    return text[i + len(start) : j].strip("\n") + "\n"


def _default_env() -> dict[str, str]:
    env = {"HOME": "/root", "TERM": "dumb", "LANG": "C.UTF-8"}
    for k in ("PATH", "PYTHONPATH"):
        if k in os.environ:
            env[k] = os.environ[k]
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    # Guest scripts import pyctl from this checkout, whether or not (and
    # wherever) the host has it installed.
    repo = str(HERE.parent)
    env["PYTHONPATH"] = repo + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _check_rw(rw: Iterable[str | os.PathLike[str]]) -> list[str]:
    dirs = []
    for d in rw:
        p = Path(d).resolve()
        if not p.is_dir():
            raise VMError(f"--rw {d}: not a directory; create it first")
        if p == Path("/"):
            raise VMError("--rw /: share a directory, not the whole root")
        dirs.append(str(p))
    # Parents first, so a nested share is mounted on top of its parent.
    return sorted(dirs, key=lambda s: s.count("/"))


def _share_hidden_checkout(cwd: str | os.PathLike[str] | None, rw_dirs: list[str]) -> list[str]:
    """A working directory below /tmp or /run (a CI clone, say) is invisible
    in the guest, whose /tmp and /run are fresh: share it read-write. /tmp
    or /run themselves stay refused by _check_cwd."""
    p = Path(cwd).resolve() if cwd is not None else Path.cwd()
    tops = (Path("/tmp"), Path("/run"))
    if p in tops or not any(t in p.parents for t in tops) or not p.is_dir():
        return rw_dirs
    if any(p == Path(d) or Path(d) in p.parents for d in rw_dirs):
        return rw_dirs
    return _check_rw([*rw_dirs, p])


def _check_cwd(cwd: str | os.PathLike[str] | None, rw_dirs: Sequence[str]) -> str:
    p = Path(cwd).resolve() if cwd is not None else Path.cwd()
    if not p.is_dir():
        raise VMError(f"--cwd {cwd}: not a directory")
    # The guest mounts fresh tmpfs on /tmp and /run: host files there are
    # invisible unless shared.
    hidden = any(p == Path(t) or Path(t) in p.parents for t in ("/tmp", "/run"))
    if hidden and not any(p == Path(d) or Path(d) in p.parents for d in rw_dirs):
        raise VMError(f"--cwd {p}: /tmp and /run are fresh in the guest; share it with --rw")
    return str(p)


def crashed_before_job(console: str, mark: str, splats: Sequence[str], timed_out: bool) -> bool:
    """The guest kernel crashed (a splat on the console) before init said
    the job starts: a boot failure, not the job's result."""
    return not timed_out and bool(splats) and f"{mark}START===" not in console


def run_in_vm(
    kernel: str,
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    rw: Iterable[str | os.PathLike[str]] = (),
    edu: bool = False,
    qmp_on: Iterable[tuple[str, str]] = (),
    timeout: float = 300,
    mem: str = "1G",
    cpus: int = 2,
    echo: bool = False,
    image: str = "auto",
    bare: bool = False,
) -> VMResult:
    """Boot `kernel`, run argv in a chroot into the host's root, return what
    happened. env is added to a clean environment holding the host's PATH
    and PYTHONPATH; qmp_on holds (marker, HMP command) pairs; echo copies
    the console to stderr as it arrives; image picks the kernel file
    (boot_image())."""
    # Inputs first, so that bad ones fail fast even without fetched kernels.
    if not argv:
        raise VMError("no command given; put it after --")
    kernel_dir(kernel)
    if not re.fullmatch(r"[1-9][0-9]*[MG]?", mem):
        raise VMError(f"--mem {mem}: expected a size such as 512M or 2G")
    if cpus < 1:
        raise VMError("--cpus must be at least 1")
    rw_dirs = _check_rw(rw)
    rw_dirs = _share_hidden_checkout(cwd, rw_dirs)
    work_dir = _check_cwd(cwd, rw_dirs)
    full_env = {**_default_env(), **(env or {})}
    bad = [k for k in full_env if not k or "=" in k]
    if bad:
        raise VMError(f"bad environment variable name {bad[0]!r}; use NAME=VALUE")
    why = kernel_available(kernel)
    if why:
        raise VMError(why)
    boot = boot_image(kernel, image)
    nonce = secrets.token_hex(6)
    job = job_script(argv, work_dir, full_env, rw_dirs, nonce, bare)

    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="gf-vm-") as tmp:
            jobdir = Path(tmp)
            # The per-run job script rides in a second cpio appended to the base.
            extra = initramfs.newc([initramfs.file("job.sh", job.encode(), 0o755)])
            (jobdir / "initrd.cpio").write_bytes(base_initramfs(kernel) + extra)
            cmd = qemu_argv(kernel, jobdir, rw_dirs, edu, mem, cpus, boot)
            t0 = time.monotonic()
            # qemu's own messages go to a file: the console stays the guest's.
            with open(jobdir / "qemu.err", "wb") as err:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    start_new_session=True,
                )
            console = _Console(proc, jobdir / "qmp.sock", list(qmp_on), echo)
            console.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            console.join(timeout=10)
            seconds = time.monotonic() - t0
            dmesg = _read(jobdir / "dmesg")
            rc_text = _read(jobdir / "rc").strip()
            qemu_err = _read(jobdir / "qemu.err").strip().splitlines()

        text = console.text()
        mark = f"===GF-{nonce}-"
        output = _between(text, f"{mark}START===", f"{mark}END===")
        # Without the kernel log (a panic, a hang) scan what reached the console.
        found = splats.find_splats(dmesg if dmesg else text)
        rc, error = RC_NO_EXIT, None
        if timed_out:
            rc, error = RC_TIMEOUT, f"timed out after {timeout:g} s"
        elif rc_text.isdigit():
            rc = int(rc_text)
        elif m := re.search(re.escape(mark) + r"EXIT=(\d+)===", text):
            rc = int(m.group(1))  # the share lost the file; the console has it
        elif f"{mark}INIT-FAILED" in text:
            error = "init failed: " + text.split(f"{mark}INIT-FAILED: ", 1)[1].split("===")[0]
        else:
            error = f"guest stopped without an exit status (qemu rc {proc.returncode})"
            if proc.returncode and qemu_err:
                error += ": " + qemu_err[0]
        if console.errors:
            error = "; ".join(filter(None, [error, *console.errors]))
        # A guest kernel that crashes while it boots, before the job began
        # (an early int3 oops under TCG's text patching, seen once in the
        # sid guest), says nothing about the job: boot it once more, and
        # say so. A crash after START is the job's and is returned.
        if attempt == 1 and crashed_before_job(text, mark, found, timed_out):
            print(
                f"vmrun: {kernel}: the guest kernel crashed while booting, before the job "
                f"started ({found[0]}); "
                "booting once more",
                file=sys.stderr,
            )
            continue
        return VMResult(
            dmesg=dmesg,
            rc=rc,
            console=text,
            splats=found,
            seconds=seconds,
            output=output,
            timed_out=timed_out,
            error=error,
            fired=console.fired,
        )
    raise AssertionError("unreachable: the second boot always returns")


# --- CLI --------------------------------------------------------------------


def _kv(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"{s!r}: expected NAME=VALUE")
    return k, v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vmrun",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("Examples:")[1].join(["examples:", ""]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--kernel", default="sid", help="bookworm or sid (default: sid)")
    ap.add_argument("--mem", default="1G", help="guest memory (default: 1G)")
    ap.add_argument("--cpus", type=int, default=2, help="guest CPUs (default: 2)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds (default: 300)")
    ap.add_argument(
        "--rw",
        action="append",
        default=[],
        metavar="DIR",
        help="share DIR read-write at the same path (repeatable)",
    )
    ap.add_argument("--cwd", default=None, help="working directory (default: the current one)")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        type=_kv,
        metavar="K=V",
        help="environment variable for the command (repeatable)",
    )
    ap.add_argument(
        "--edu", action="store_true", help="add QEMU's edu PCI device (id edu0) behind a pci-bridge"
    )
    ap.add_argument(
        "--qmp-on",
        action="append",
        default=[],
        type=_kv,
        metavar="MARKER=HMPCMD",
        help="when the guest prints MARKER, run the monitor command (repeatable)",
    )
    ap.add_argument("--allow-splats", action="store_true", help="do not fail on kernel splats")
    ap.add_argument(
        "--bare",
        action="store_true",
        help="mount nothing but proc, sys, dev (and /tmp, /run): a new machine",
    )
    ap.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only the command's output, not the whole console",
    )
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        res = run_in_vm(
            args.kernel,
            command,
            cwd=args.cwd,
            env=dict(args.env),
            rw=args.rw,
            edu=args.edu,
            qmp_on=args.qmp_on,
            timeout=args.timeout,
            mem=args.mem,
            cpus=args.cpus,
            echo=not args.quiet,
            bare=args.bare,
        )
    except VMError as e:
        print(f"vmrun: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        sys.stdout.write(res.output)
    if res.error:
        print(f"vmrun: {res.error}", file=sys.stderr)
    if res.splats and res.rc == RC_NO_EXIT and res.error:
        # The guest died: show the report itself, not only its first line.
        print(splats.report_excerpt(res.dmesg or res.console), file=sys.stderr)
    if res.splats and not args.allow_splats:
        print(
            f"vmrun: kernel splat in the guest ({len(res.splats)} lines), first: "
            f"{res.splats[0]!r}; --allow-splats to ignore",
            file=sys.stderr,
        )
        return res.rc or 1
    print(f"vmrun: {args.kernel} exit {res.rc} in {res.seconds:.1f} s", file=sys.stderr)
    return res.rc


if __name__ == "__main__":
    sys.exit(main())
