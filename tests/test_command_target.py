"""A command gpufault starts (`-- CMD`) and what its signals mean:

- it starts with the signal mask gpufault was started with (the controller
  blocks SIGCHLD for its copilot; a mask survives exec, and a Python
  SIGCHLD handler in the target once never ran);
- a SIGCHLD (or any signal a fault cannot explain) in a faulted process is
  recorded unattributed, never linked to the fault.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root]
REPO = Path(__file__).resolve().parent.parent

# The target: report its blocked mask, then run 20 children with a SIGCHLD
# handler installed, counting how often the handler ran.
CHILD = r"""
import os, signal, subprocess, zlib
blk = [l for l in open('/proc/self/status') if l.startswith('SigBlk')][0].split()[1]
seen = []
signal.signal(signal.SIGCHLD, lambda *a: seen.append(1))
signal.signal(signal.SIGUSR2, lambda *a: None)  # survives an injected SIGUSR2
for i in range(20):
    zlib.crc32(b'x' * i)
    subprocess.run(['true'])
print('SIGBLK', blk, 'HANDLED', len(seen), flush=True)
"""


def _gf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_command_starts_with_gpufaults_own_signal_mask(tmp_path: Path) -> None:
    r = _gf(
        "trace",
        "--lib",
        "libz",
        "--fn",
        "crc32",
        "--db",
        str(tmp_path / "t.db"),
        "--",
        sys.executable,
        "-c",
        CHILD,
    )
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("SIGBLK"))
    _, blk, _, handled = line.split()
    assert int(blk, 16) == 0  # as pytest started gpufault: nothing blocked
    assert int(handled) >= 1  # the target's SIGCHLD handler ran


def test_sigchld_in_a_faulted_process_is_not_linked_to_the_fault(tmp_path: Path) -> None:
    db = tmp_path / "f.db"
    # A fault that leaves the process running (it handles SIGUSR2), then 20
    # children: 20 SIGCHLDs in a faulted process.
    r = _gf(
        "inject",
        "--lib",
        "libz",
        "--fn",
        "crc32",
        "--action",
        "signal",
        "--signal",
        "SIGUSR2",
        "--nth",
        "1",
        "--db",
        str(db),
        "--",
        sys.executable,
        "-c",
        CHILD,
    )
    assert r.returncode == 0, r.stderr
    con = sqlite3.connect(db)
    links = con.execute("SELECT fault_id, kind, rule, detail FROM links").fetchall()
    chld = [
        (f, ru, json.loads(d))
        for f, k, ru, d in links
        if k == "signal" and json.loads(d)["signal"] == 17
    ]
    assert len(chld) >= 1
    assert all(f is None and ru == "unattributed" and "why" in d for f, ru, d in chld)
    usr2 = [
        (f, ru, json.loads(d))
        for f, k, ru, d in links
        if k == "signal" and json.loads(d)["signal"] == 12
    ]
    assert len(usr2) == 1 and usr2[0][0] is not None
    assert usr2[0][1] == "signal-in-faulted-process"
    assert usr2[0][2]["cause"] == "injected signal"
    exits = [f for f, k, _, _ in links if k == "exit"]
    assert len(exits) == 1 and exits[0] is not None  # the exit stays linked
