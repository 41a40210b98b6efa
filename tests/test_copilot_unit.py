"""Copilot pieces that need no tracee: register rewrites, input checks,
/proc parsing, and the ptrace layer's struct layout."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from pyctl.copilot import (
    GF_ACT_FAIL,
    GF_F_AFTER,
    Copilot,
    CopilotError,
    Injection,
    procfs,
    ptrace,
    rewrite,
)

R = ptrace.REG
M64 = (1 << 64) - 1


def inj(sp: int = 0x7FFF0000, retval: int = -2, flags: int = 0) -> Injection:
    regs = [0x100 + i for i in range(21)]
    regs[R["sp"]] = sp
    return Injection(7, tuple(regs), retval, 0, 0, GF_ACT_FAIL, flags)


def cur(sp: int = 0x7FFEFFF8) -> list[int]:
    regs = [0x900 + i for i in range(27)]
    regs[R["sp"]] = sp
    return regs


PT_REGS_ORDER = "r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di orig_ax ip cs flags sp ss"


def test_first_21_registers_are_pt_regs_order() -> None:
    assert " ".join(ptrace.REG_NAMES[: ptrace.NPTREGS]) == PT_REGS_ORDER


def test_user_regs_layout_matches_sys_user_h(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("requires gcc to compile the layout probe")
    fields = [
        "r" + n
        if n in ("bp", "bx", "ax", "cx", "dx", "si", "di", "ip", "sp")
        else {"orig_ax": "orig_rax", "flags": "eflags"}.get(n, n)
        for n in ptrace.REG_NAMES
    ]
    prints = "".join(f'printf("%zu\\n", offsetof(struct user_regs_struct, {f}));' for f in fields)
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n#include <sys/user.h>\n"
        f'int main(void) {{ printf("%zu\\n", sizeof(struct user_regs_struct)); {prints} }}\n'
    )
    subprocess.run(["gcc", "-o", str(tmp_path / "layout"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True)
    size, *offsets = (int(x) for x in out.stdout.split())
    assert size == ctypes.sizeof(ptrace.UserRegs)
    assert offsets == [getattr(ptrace.UserRegs, n).offset for n in ptrace.REG_NAMES]


def test_skip_restores_entry_registers_and_returns() -> None:
    i, c = inj(), cur()
    new = rewrite.skip(c, i, ret_addr=0x401234)
    assert new[R["ip"]] == 0x401234
    assert new[R["sp"]] == 0x7FFF0008
    assert new[R["ax"]] == (-2) & M64
    assert new[R["orig_ax"]] == M64
    for name in ("r15", "r14", "r13", "r12", "bp", "bx", "flags", "cs", "ss", "di"):
        assert new[R[name]] == i.regs[R[name]], name
    assert new[21:] == c[21:]  # fs_base, gs_base, segments: kept


def test_after_changes_only_ax_and_orig_ax() -> None:
    c = cur()
    new = rewrite.after(c, inj(retval=719, flags=GF_F_AFTER))
    changed = {k for k in range(27) if new[k] != c[k]}
    assert changed == {R["ax"], R["orig_ax"]} and new[R["ax"]] == 719


def test_check_skip() -> None:
    assert rewrite.check_skip(cur(), inj()) is None
    assert "sp moved" in (rewrite.check_skip(cur(sp=0x10000), inj()) or "")
    short = Injection(1, (0,) * 20, 0, 0, 0, GF_ACT_FAIL, 0)
    assert "expected 21" in (rewrite.check_skip(cur(), short) or "")


@pytest.mark.parametrize(
    ("pid", "signo", "message"),
    [
        (0, signal.SIGURG, "invalid pid 0"),
        (-5, signal.SIGURG, "invalid pid -5"),
        (None, signal.SIGURG, "cannot trace its own process"),  # this process
        (1, signal.SIGKILL, "signal 9 cannot be used"),
        (1, 0, "signal 0 cannot be used"),
    ],
)
def test_bad_input_is_a_one_line_error(pid: int | None, signo: int, message: str) -> None:
    # None, not os.getpid() in the parameters: each xdist worker collects
    # the same test ids, which a pid would make differ.
    cp = Copilot(os.getpid() if pid is None else pid, signo, lambda tid: None)
    with pytest.raises(CopilotError, match=message) as err:
        cp.start()
    assert "\n" not in str(err.value)
    assert not cp.running  # nothing started, nothing left behind


def test_absent_pid_is_refused() -> None:
    pid = int(open("/proc/sys/kernel/pid_max").read())  # never a live pid
    with pytest.raises(CopilotError, match=f"pid {pid}: no such process"):
        Copilot(pid, signal.SIGURG, lambda tid: None).start()


def test_procfs_reads_own_process() -> None:
    me = os.getpid()
    assert me in procfs.tids(me)
    assert procfs.thread_state(me, me) == "R"
    assert procfs.tracer_pid(me) >= 0
    assert procfs.tids(int(open("/proc/sys/kernel/pid_max").read())) == []


def test_not_started_copilot_is_inert() -> None:
    cp = Copilot(1, signal.SIGURG, lambda tid: None)
    assert cp.release() == 0 and cp.stalled() == [] and not cp.running
    cp.stop()  # nothing to do, no error
    assert cp.wait_stalled(1, timeout=0) == []
