"""A qemu/TCG guest booted once and shared by several jobs.

vm/vmrun.py's run_in_vm boots a kernel for one command and powers off; a
test session that runs many commands on the same kernel pays a boot (and
the guest's cold page cache: Python's start-up over 9p) for each. A Guest
boots the same machine (vm/init.sh with GF_SERVE=1, vm/serve.sh), then runs
each job the host hands it over the serial console: the job's script in the
job share, "N" on the console, the same start/end/exit markers as a one-job
run (a nonce of its own). Between jobs the guest kills what the job left
running, removes its trace events and the modules it loaded, unmounts its
mounts, and gives the next job fresh /tmp, /run, /dev/shm and bpffs
(VMResult.left says what it had to clean).

Read-write directories are shared at boot (`rw`) and every job sees them
at their host paths: a job's own rw dirs must lie inside one of them (a
test's tmp_path inside the session's base directory). A job that times out
or kills the guest takes it down; the next job boots a new one. What needs
another machine (a bare init, other qemu devices) keeps run_in_vm.

  g = Guest("bookworm", edu=True, rw=[basetemp])
  res = g.run(["python3", "-c", "print(1)"], cwd=repo)
  g.close()
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import initramfs  # noqa: E402
import splats  # noqa: E402
import vmrun  # noqa: E402

# Puts the edu device back after a job removed it (device_del edu0): the
# bridge and slot of vmrun.qemu_argv, so it keeps its address.
EDU_ADD = "device_add edu,id=edu0,bus=bridge0,addr=0x1"
EDU_BACK = "echo 1 > /sys/bus/pci/rescan; grep -l 0x11e8 /sys/bus/pci/devices/*/device"


class _Reader(threading.Thread):
    """Reads the serial console into one growing text; wakes waiters for a
    marker; runs the current job's --qmp-on rules."""

    def __init__(self, proc: subprocess.Popen[bytes], qmp: Path) -> None:
        super().__init__(daemon=True)
        self.proc, self.qmp = proc, qmp
        self.cond = threading.Condition()
        self.buf = ""
        self.eof = False
        self.pending: list[tuple[str, str]] = []
        self.fired: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        partial, cr = "", ""
        while chunk := os.read(fd, 65536):
            text = cr + chunk.decode(errors="replace")
            # A CR at a chunk's end may be the first half of a CRLF.
            text, cr = (text[:-1], "\r") if text.endswith("\r") else (text, "")
            text = text.replace("\r\n", "\n")
            lines = (partial + text).split("\n")
            partial = lines.pop()
            for line in lines:
                self._watch(line)
            with self.cond:
                self.buf += text
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def _watch(self, line: str) -> None:
        with self.cond:
            rules = [r for r in self.pending if r[0] in line]
            for r in rules:
                self.pending.remove(r)
        for marker, command in rules:
            try:
                vmrun.hmp(self.qmp, command)
                self.fired.append(marker)
            except (OSError, vmrun.VMError, ValueError) as e:
                self.errors.append(f"--qmp-on {marker}: {e}")

    def wait_for(self, marker: str, start: int, deadline: float) -> bool:
        """Whether marker appeared in the console after offset start before
        the monotonic deadline (False also when qemu exited first)."""
        with self.cond:
            while marker not in self.buf[start:]:
                left = deadline - time.monotonic()
                if self.eof or left <= 0:
                    return False
                self.cond.wait(left)
            return True


class Guest:
    """One booted guest of `kernel` for jobs one after another (one console
    carries them: not for two threads at once)."""

    def __init__(
        self,
        kernel: str,
        *,
        edu: bool = False,
        rw: Iterable[str | os.PathLike[str]] = (),
        mem: str = "2G",
        cpus: int = 2,
        boot_timeout: float = 180,
    ) -> None:
        vmrun.kernel_dir(kernel)
        self.kernel, self.edu, self.mem, self.cpus = kernel, edu, mem, cpus
        self.shares = vmrun._check_rw(rw)
        self.boot_timeout = boot_timeout
        self.boots = 0  # times booted (a guest that died boots again)
        self.boot_seconds: list[float] = []
        self.jobs = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: _Reader | None = None
        self._dir: Path | None = None
        self._edu_gone = False

    # --- the machine -----------------------------------------------------------

    def _boot_script(self, nonce: str) -> str:
        """/job.sh of the boot: serve mode, each share at /gfshare/I."""
        mounts = "".join(
            f"\tmkdir -p /gfshare/{i} && mount -t 9p -o trans=virtio,version=9p2000.L,"
            f"msize=512000 rw{i} /gfshare/{i} || return 1\n"
            for i in range(len(self.shares))
        )
        return f"GF_NONCE={nonce}\nGF_BARE=0\nGF_SERVE=1\ngf_rw_mounts() {{\n{mounts}\t:\n}}\n"

    def start(self) -> None:
        """Boot, unless a guest is up; raises VMError when it does not come
        up clean (after one more try, as run_in_vm for a crash at boot)."""
        if self.alive():
            return
        self.close()
        why = vmrun.kernel_available(self.kernel)
        if why:
            raise vmrun.VMError(why)
        image = vmrun.boot_image(self.kernel)
        problem = ""
        for _ in (1, 2):
            nonce = secrets.token_hex(6)
            d = self._dir = Path(tempfile.mkdtemp(prefix="gf-vmguest-"))
            (d / "jobs").mkdir()
            job = initramfs.file("job.sh", self._boot_script(nonce).encode(), 0o755)
            (d / "initrd.cpio").write_bytes(
                vmrun.base_initramfs(self.kernel) + initramfs.newc([job])
            )
            argv = vmrun.qemu_argv(
                self.kernel, d, self.shares, self.edu, self.mem, self.cpus, image
            )
            t0 = time.monotonic()
            with open(d / "qemu.err", "wb") as err:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    start_new_session=True,
                )
            self._reader = _Reader(self._proc, d / "qmp.sock")
            self._reader.start()
            self.boots += 1
            ready = self._reader.wait_for(f"===GF-{nonce}-READY===", 0, t0 + self.boot_timeout)
            found = splats.find_splats(vmrun._read(d / "boot.dmesg") or self._reader.buf)
            if ready and not found:
                self.boot_seconds.append(round(time.monotonic() - t0, 1))
                self._edu_gone = False
                return
            problem = f"a splat while booting: {found[0]}" if found else "no READY marker"
            if "INIT-FAILED: " in self._reader.buf:
                problem = self._reader.buf.split("INIT-FAILED: ", 1)[1].split("===")[0]
            self.close()
        raise vmrun.VMError(f"the {self.kernel} guest did not come up: {problem}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Power off (a kill: nothing of the guest is kept) and remove the
        job directory."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            if self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
            self._proc = None
        if self._reader is not None:
            self._reader.join(timeout=10)
            self._reader = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Guest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- jobs ------------------------------------------------------------------

    def _check_inside(self, rw: Iterable[str | os.PathLike[str]]) -> None:
        for d in vmrun._check_rw(rw):
            if not any(d == s or d.startswith(s + "/") for s in self.shares):
                shares = ", ".join(self.shares) or "none"
                raise vmrun.VMError(f"--rw {d}: not inside a share of this guest ({shares})")

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        rw: Iterable[str | os.PathLike[str]] = (),
        qmp_on: Iterable[tuple[str, str]] = (),
        timeout: float = 300,
    ) -> vmrun.VMResult:
        """Run argv in the guest as run_in_vm would (a chroot into the host's
        root, env added to a clean one holding PATH and PYTHONPATH); boots
        first if no guest is up. seconds is the job's, not the boot's."""
        if not argv:
            raise vmrun.VMError("no command given")
        self._check_inside(rw)
        work_dir = vmrun._check_cwd(cwd, self.shares)
        full_env = {**vmrun._default_env(), **(env or {})}
        bad = [k for k in full_env if not k or "=" in k]
        if bad:
            raise vmrun.VMError(f"bad environment variable name {bad[0]!r}; use NAME=VALUE")
        self.start()
        if self.edu and self._edu_gone:
            self._put_edu_back()
        return self._job(argv, work_dir, full_env, list(qmp_on), timeout)

    def _job(
        self,
        argv: Sequence[str],
        work_dir: str,
        env: Mapping[str, str],
        qmp_on: list[tuple[str, str]],
        timeout: float,
    ) -> vmrun.VMResult:
        proc, rd, d = self._proc, self._reader, self._dir
        assert proc is not None and proc.stdin is not None and rd is not None and d is not None
        self.jobs += 1
        n, nonce = self.jobs, secrets.token_hex(6)
        binds = "".join(
            f"\tgf_bind_rw /gfshare/{i} {shlex.quote(s)} || return 1\n"
            for i, s in enumerate(self.shares)
        )
        script = vmrun.job_script(argv, work_dir, env, [], nonce)
        (d / "jobs" / f"{n}.sh").write_text(script + f"gf_rw_mounts() {{\n{binds}\t:\n}}\n")
        with rd.cond:
            start = len(rd.buf)
            rd.pending = list(qmp_on)
            fired0, errors0 = len(rd.fired), len(rd.errors)
        t0 = time.monotonic()
        proc.stdin.write(f"{n}\n".encode())
        proc.stdin.flush()
        mark = f"===GF-{nonce}-"
        done = rd.wait_for(f"{mark}EXIT=", start, t0 + timeout)
        seconds = time.monotonic() - t0
        with rd.cond:
            text = rd.buf[start:]
            rd.pending = []
            fired, errors = rd.fired[fired0:], rd.errors[errors0:]
        dmesg = vmrun._read(d / "jobs" / f"{n}.dmesg")
        rc_text = vmrun._read(d / "jobs" / f"{n}.rc").strip()
        left = [x for x in vmrun._read(d / "jobs" / f"{n}.left").split("\n") if x]
        timed_out = not done and self.alive()
        rc, error = vmrun.RC_NO_EXIT, None
        if timed_out:
            rc, error = vmrun.RC_TIMEOUT, f"timed out after {timeout:g} s"
            self.close()  # the job may still run: this guest is not reusable
        elif done and rc_text.isdigit():
            rc = int(rc_text)
        else:
            error = "the guest stopped during the job"
            self.close()
        if errors:
            error = "; ".join(filter(None, [error, *errors]))
        if any(m in fired and c.startswith("device_del edu0") for m, c in qmp_on):
            self._edu_gone = True
        return vmrun.VMResult(
            rc=rc,
            console=text,
            splats=splats.find_splats(dmesg if dmesg else text),
            seconds=seconds,
            output=vmrun._between(text, f"{mark}START===", f"{mark}END==="),
            dmesg=dmesg,
            timed_out=timed_out,
            error=error,
            fired=fired,
            left=left,
        )

    def _put_edu_back(self) -> None:
        """device_add the edu device a job removed; the guest rescans its
        bus, so the next job finds it where the boot put it."""
        assert self._dir is not None
        vmrun.hmp(self._dir / "qmp.sock", EDU_ADD)
        self._edu_gone = False
        res = self._job(["sh", "-c", EDU_BACK], "/", vmrun._default_env(), [], 60)
        if res.rc != 0:
            self.close()
            raise vmrun.VMError(f"edu0 not back after device_add: {res.output or res.error}")
