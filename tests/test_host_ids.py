"""Run and fault ids with a host part (pyctl/evidence/hostid.py, issue 28):
two "nodes" are two private mount namespaces whose /etc/machine-id differ
(bind mounts over the real file, undone with the namespace). Their runs'
ids differ in the host part even when the random halves are the same, so
their stores merge; a short id that both share is refused in one line and
the full ids work; the kernel module's u32 records map back to the run."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, requires_root

from pyctl.anchors import decode
from pyctl.anchors.synth import make_record
from pyctl.evidence import hostid, store
from pyctl.evidence.anchors import by_fault, store_records

GF = [sys.executable, "-I", "-m", "pyctl"]
HALF = "1a2b3c4d"
# The child: one run made by the store (fill: a fault, a stack, a link),
# its random half forced to HALF, so that only the host part tells the two
# nodes' runs apart.
CHILD = f"""
import json, os, sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from pathlib import Path
from pyctl.evidence import hostid
real = os.urandom
os.urandom = lambda n: bytes.fromhex({HALF!r}) if n == 4 else real(n)
from evidence_rows import fill
got = fill(Path(sys.argv[1]))
print(json.dumps({{"run": got["run"], "faults": got["faults"], "id": hostid.host_identity()}}))
"""


def _expected(ident: str) -> str:
    return hashlib.sha256(b"gpufault host\0" + ident.encode()).hexdigest()[:8]


def _on_node(tmp: Path, name: str, machine_id: str | None, owner: int = 0) -> dict:
    """CHILD in a mount namespace whose machine-id files hold machine_id
    (None: "uninitialized", as an image before its first boot)."""
    idf = tmp / f"{name}.machine-id"
    idf.write_text((machine_id or "uninitialized") + "\n")
    os.chown(idf, owner, owner)
    binds = " ".join(
        f"mount --bind {idf} {p};" for p, _ in hostid.SOURCES[:2] if os.path.exists(p)
    )
    db = tmp / f"{name}.db"
    script = f'{binds} exec "$0" -I -c "$1" "$2"'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        sys.executable, CHILD, str(db)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return {"db": db, **json.loads(r.stdout)}


@requires_root
def test_two_nodes_same_random_half_merge_and_short_ids_say_which(tmp_path: Path) -> None:
    a = _on_node(tmp_path, "a", "0123456789abcdef0123456789abcdef")
    b = _on_node(tmp_path, "b", "fedcba9876543210fedcba9876543210")
    assert a["id"] == [_expected("0123456789abcdef0123456789abcdef"), "machine-id"]
    assert b["id"] == [_expected("fedcba9876543210fedcba9876543210"), "machine-id"]
    assert a["run"] == a["id"][0] + HALF and b["run"] == b["id"][0] + HALF
    merged = tmp_path / "fleet.db"
    r = subprocess.run([*GF, "evidence", "merge", str(a["db"]), str(b["db"]), "--into",
                        str(merged)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # the short id both nodes print is refused in one line naming both runs
    r = subprocess.run([*GF, "show", f"{HALF}-1", "--db", str(merged)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert a["run"] in r.stderr and b["run"] in r.stderr and "full id" in r.stderr
    r = subprocess.run([*GF, "timeline", HALF, "--db", str(merged)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "full id" in r.stderr, r.stderr
    for node in (a, b):
        r = subprocess.run([*GF, "show", node["faults"][0], "--db", str(merged), "--json"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["fault"]["run_id"] == node["run"]
        # in its own store the short id is the node's one run
        r = subprocess.run([*GF, "show", f"{HALF}-1", "--db", str(node["db"]), "--json"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and json.loads(r.stdout)["fault"]["run_id"] == node["run"]


@requires_root
def test_no_machine_id_falls_back_to_the_boot_id(tmp_path: Path) -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    got = _on_node(tmp_path, "image", None)
    assert got["id"] == [_expected(boot), "boot-id"]


@requires_root
def test_a_machine_id_another_user_owns_is_not_roots_host(tmp_path: Path) -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    got = _on_node(tmp_path, "planted", "0123456789abcdef0123456789abcdef", owner=65534)
    assert got["id"] == [_expected(boot), "boot-id"]


def test_new_runs_random_halves_are_unique_in_a_store(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    db = store.open_db(tmp_path / "gf.db")
    draws = iter([bytes.fromhex(HALF), bytes.fromhex(HALF), bytes(4), bytes.fromhex("0badcafe")])
    monkeypatch.setattr(store.os, "urandom", lambda n: next(draws))
    first = store.new_run(db, ["gpufault"], "inject")
    second = store.new_run(db, ["gpufault"], "inject")
    assert first[8:] == HALF and second[8:] == "0badcafe"  # a taken half and zero redrawn
    assert first[:8] == second[:8] == hostid.host_part()


def test_module_records_get_their_runs_full_id(tmp_path: Path) -> None:
    db = store.open_db(tmp_path / "gf.db")
    run = store.new_run(db, ["gpufault"], "inject")
    low = int(run[8:], 16)
    recs = decode(bytes(make_record(run_id=low, fault_seq=3))
                  + bytes(make_record(run_id=0x0BADCAFE, fault_seq=1, rec_seq=2)))  # fmt: skip
    assert store_records(db, recs) == 2
    assert [r["kind"] for r in by_fault(db, f"{run}-3")] == ["reset_end"]
    assert len(by_fault(db, "0badcafe-1")) == 1  # no such run here: the module's id kept
