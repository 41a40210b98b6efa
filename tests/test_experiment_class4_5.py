"""Pieces of classes 4 and 5 that need no service and no root: the
`differs_from` tolerance, `[expect] linked` and `perturb` steps in
experiment files, cuBLAS statuses as device errors, the Xid monitor's
per-process GPU cache, and the runner's `_died` and `Run._linked`."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pyctl import xid as X
from pyctl.evidence import schema
from pyctl.experiment import load as F
from pyctl.experiment import model as M
from pyctl.experiment import run as R
from pyctl.experiment import target as T
from pyctl.experiment.probes import ProbeError, Tolerance

# ---- Tolerance {differs_from = "first"} --------------------------------------------


def test_differs_from_first_is_ok_once_a_value_differs() -> None:
    t = Tolerance.from_toml({"differs_from": "first"}, "probes.out.tolerance")
    assert not t.check("abc")  # the reference itself: nothing differs yet
    assert not t.check("abc")  # equal to the reference
    assert t.check("abd")
    # The reference stays the first value, not the last one seen.
    assert not t.check("abc") and t.check("xyz") and t.check("abd")
    assert not t.check(None)  # no value measured is never "differs"
    assert str(t) == "differs from the first sample"


def test_differs_from_keeps_its_reference_past_a_missing_sample() -> None:
    # A probe that failed first (None) must not make None the reference.
    t = Tolerance.from_toml({"differs_from": "first"}, "x")
    assert not t.check(None)
    assert not t.check(7) and not t.check(7) and t.check(8)


def test_differs_from_and_same_as_are_opposites_on_one_series() -> None:
    series = ["a", "a", "b", "a", "c"]
    same = Tolerance.from_toml({"same_as": "first"}, "x")
    diff = Tolerance.from_toml({"differs_from": "first"}, "x")
    s = [same.check(v) for v in series]
    d = [diff.check(v) for v in series]
    assert d == [False, False, True, False, True]
    assert s[1:] == [not x for x in d[1:]]


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"differs_from": "last"}, 'x.differs_from: the only reference is "first"'),
        ({"differs_from": 1}, 'x.differs_from: the only reference is "first"'),
        # Another key beside it is not a differs_from table: the regex form's message.
        ({"differs_from": "first", "regex": "a"}, "a table tolerance is {regex"),
    ],
)
def test_bad_differs_from_is_a_probe_error(value: Any, needle: str) -> None:
    with pytest.raises(ProbeError) as ei:
        Tolerance.from_toml(value, "x")
    assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


# ---- experiment files: [expect] linked and perturb steps ------------------------------

BASE = """
name = "c45"
version = 1
title = "t"
[target]
url = "http://127.0.0.1:9"
pid = 4242
[[method]]
STEP
duration = "2s"
EXTRA
"""
PERTURB = 'perturb = { rules = ["blocks.*@exp:4@1e-2@fp16"], seed = 3 }'
FAULT = 'fault = { lib = "libcuda", fn = "cuMemAlloc_v2", action = "fail", ret = 2 }'


def load(tmp_path: Path, step: str = FAULT, extra: str = "") -> M.Experiment:
    p = tmp_path / "c45.toml"
    p.write_text(BASE.replace("STEP", step).replace("EXTRA", extra))
    return F.load(str(p))


def refused(tmp_path: Path, step: str, extra: str, key: str, what: str) -> str:
    with pytest.raises(M.ExperimentError) as ei:
        load(tmp_path, step, extra)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "c45.toml") + ": "), msg
    assert key in msg and what in msg, msg
    return msg


def test_linked_is_read_deduplicated_and_empty_by_default(tmp_path: Path) -> None:
    assert load(tmp_path).expect.linked == ()
    e = load(tmp_path, extra='[expect]\nlinked = ["xid", "anchor", "xid"]')
    assert e.expect.linked == ("xid", "anchor")
    assert set(M.LINKABLE) == {"xid", "anchor"}
    assert M.LINKABLE["xid"] == "xids"
    # Every word names a real evidence table: _linked queries it by that name.
    tables = {t.name for t in schema.TABLES}
    assert set(M.LINKABLE.values()) <= tables


@pytest.mark.parametrize("value", ['["nope"]', "[]", '"xid"', '["xid", 1]', "true", '["XID"]'])
def test_bad_linked_is_one_line_naming_the_key(tmp_path: Path, value: str) -> None:
    msg = refused(tmp_path, FAULT, f"[expect]\nlinked = {value}", "expect.linked", "'xid'")
    assert "'anchor'" in msg


def test_a_perturb_step(tmp_path: Path) -> None:
    e = load(tmp_path, PERTURB)
    (s,) = e.steps
    assert s.perturb == {
        "rules": ["blocks.*@exp:4@1e-2@fp16"],
        "seed": 3,
        "url": "{url}/admin/perturb",  # the target's url, filled in when it runs
    }
    assert s.label == "perturb" and not s.specs and s.traffic is None
    assert s.name == "perturb blocks.*@exp:4@1e-2@fp16"
    assert (s.start, s.duration, s.thread) == (0.0, 2.0, None)
    two = load(tmp_path, 'perturb = { rules = ["head@sign@0.5", "matmul@mant:3@1e-3"] }')
    p2 = two.steps[0].perturb
    assert p2 is not None and p2["seed"] == 0 and len(p2["rules"]) == 2


def test_a_perturb_step_after_a_fault_step_is_sequenced(tmp_path: Path) -> None:
    e = load(tmp_path, FAULT, f'[[method]]\n{PERTURB}\nduration = "3s"')
    a, b = e.steps
    assert a.perturb is None and a.specs and b.perturb is not None
    assert (b.start, b.duration) == (2.0, 3.0) and e.method_window == 5.0


@pytest.mark.parametrize(
    ("step", "extra", "key", "what"),
    [
        (
            'perturb = { rules = ["blocks.*@exp:9@1e-2@fp16"] }',
            "",
            "method[1].perturb.rules",
            "exp:9",
        ),
        (
            'perturb = { rules = ["blocks.*@sign"] }',
            "",
            "method[1].perturb.rules",
            "PATTERN@BITS@RATE",
        ),
        (
            'perturb = { rules = ["blocks.*@sign@often"] }',
            "",
            "method[1].perturb.rules",
            "not a number",
        ),
        (
            'perturb = { rules = ["blocks.*@sign@1e-3@fp8"] }',
            "",
            "method[1].perturb.rules",
            "as_dtype",
        ),
        ("perturb = { rules = [] }", "", "method[1].perturb.rules", "a list of PATTERN"),
        ('perturb = { rules = "head@sign@0.1" }', "", "method[1].perturb.rules", "a list"),
        ("perturb = { seed = 1 }", "", "method[1].perturb.rules", "a list"),
        (
            'perturb = { rules = ["head@sign@0.1"], seed = "x" }',
            "",
            "method[1].perturb.seed",
            "expected an integer",
        ),
        (
            'perturb = { rules = ["head@sign@0.1"], colour = 1 }',
            "",
            "method[1].perturb.colour",
            "unknown key",
        ),
        ('perturb = "head@sign@0.1"', "", "method[1].perturb", "expected {rules"),
        (PERTURB, 'thread = "gf-worker"', "method[1].thread", "armed by the service"),
        (PERTURB, "pid = 1234", "method[1].pid", "armed by the service"),
        (PERTURB, 'tid = "{worker_tid}"', "method[1].tid", "armed by the service"),
        (PERTURB, 'arm_timeout = "5s"', "method[1].arm_timeout", "armed by the service"),
        (PERTURB, "set = { after = 1 }", "method[1].set", "armed by the service"),
        (PERTURB + "\n" + FAULT, "", "method[1]", "exactly one of"),
    ],
)
def test_bad_perturb_steps_are_one_line_naming_the_key(
    tmp_path: Path, step: str, extra: str, key: str, what: str
) -> None:
    # `extra` goes right after duration, i.e. into the same [[method]] table.
    refused(tmp_path, step, extra, key, what)


def test_a_bad_bit_name_without_a_dtype_is_refused(tmp_path: Path) -> None:
    refused(
        tmp_path,
        'perturb = { rules = ["blocks.*@nonsense@1e-2"] }',
        "",
        "method[1].perturb.rules",
        "nonsense",
    )


# ---- classify_torch_cuda: cuBLAS statuses --------------------------------------------


def _classify(text: str) -> Any:
    pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")
    from pyctl.service.device import classify_torch_cuda

    return classify_torch_cuda(RuntimeError(text))


TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the"
    " stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


def test_a_cublas_status_is_the_code_and_the_call_is_named() -> None:
    text = (
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, "
        "opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
    )
    e = _classify(text + TAIL)
    assert e is not None
    assert (e.code, e.call) == ("CUBLAS_STATUS_EXECUTION_FAILED", "cublasSgemm")
    assert str(e) == text  # the first line only: the hint lines are torch's, not the error


@pytest.mark.parametrize(
    ("text", "code", "call"),
    [
        (
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
            "CUBLAS_STATUS_ALLOC_FAILED",
            "cublasCreate",
        ),
        (
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasLtMatmul("
            "ltHandle, computeDesc.descriptor(), ...)`",
            "CUBLAS_STATUS_EXECUTION_FAILED",
            "cublasLtMatmul",
        ),
        ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED", "CUBLAS_STATUS_NOT_SUPPORTED", ""),
        ("CUDA error: an illegal memory access was encountered", "CUDA_ERROR_ILLEGAL_ADDRESS", ""),
        ("CUDA error: an illegal memory access was encountered.", "CUDA_ERROR_ILLEGAL_ADDRESS", ""),
        ("CUDA error: unspecified launch failure", "CUDA_ERROR_LAUNCH_FAILED", ""),
        ("CUDA error: something new", "CUDA_ERROR_OTHER", ""),
    ],
)
def test_cuda_texts_map_to_codes(text: str, code: str, call: str) -> None:
    e = _classify(text + TAIL)
    assert e is not None and (e.code, e.call) == (code, call), (e.code, e.call)


def test_an_illegal_address_stays_a_curesult_with_no_call() -> None:
    e = _classify("CUDA error: an illegal memory access was encountered" + TAIL)
    assert e is not None and e.code == "CUDA_ERROR_ILLEGAL_ADDRESS" and e.call == ""


def test_a_non_cuda_error_is_not_a_device_error() -> None:
    assert _classify("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)") is None
    from pyctl.service.device import classify_torch_cuda

    assert classify_torch_cuda(ValueError("CUDA error: out of memory")) is None


def test_torch_oom_is_out_of_memory() -> None:
    torch = pytest.importorskip("torch")
    from pyctl.service.device import classify_torch_cuda

    e = classify_torch_cuda(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert e is not None and e.code == "CUDA_ERROR_OUT_OF_MEMORY"


# ---- XidMonitor: the per-process GPU cache -------------------------------------------


class Minors:
    """A stand-in for /proc/PID/fd: what nvidia_minors_of sees for each pid now."""

    def __init__(self) -> None:
        self.now: dict[int, set[int]] = {}
        self.asked: list[int] = []

    def __call__(self, pid: int) -> set[int]:
        self.asked.append(pid)
        return set(self.now.get(pid, set()))


@pytest.fixture
def minors(monkeypatch: pytest.MonkeyPatch) -> Minors:
    m = Minors()
    monkeypatch.setattr(X, "nvidia_minors_of", m)
    return m


def monitor(tmp_path: Path) -> X.XidMonitor:
    # No start(): the constructor loads nothing and opens no database.
    return X.XidMonitor(tmp_path / "x.db", run_id="r1", minor_of=lambda dev: 1)


def test_note_pid_caches_the_minors_of_a_live_process(tmp_path: Path, minors: Minors) -> None:
    mon = monitor(tmp_path)
    minors.now[100] = {0, 1}
    mon.note_pid(100)
    assert mon._pid_minors[100] == {0, 1}
    assert not (tmp_path / "x.db").exists()


def test_a_gone_process_does_not_overwrite_its_cached_minors(
    tmp_path: Path, minors: Minors
) -> None:
    mon = monitor(tmp_path)
    minors.now[100] = {1}
    mon.note_pid(100)  # at attach, while it runs
    minors.now[100] = set()  # the fault killed it: /proc/100/fd is gone
    mon.note_fault({"pid": 100, "fault_id": "f-1"})
    assert mon._pid_minors[100] == {1}
    mon.note_pid(100)  # a later look at the dead process keeps it too
    assert mon._pid_minors[100] == {1}


def test_note_fault_asks_again_only_while_nothing_is_known(tmp_path: Path, minors: Minors) -> None:
    mon = monitor(tmp_path)
    mon.note_pid(200)  # not on a GPU yet (before its CUDA context)
    assert mon._pid_minors[200] == set()
    minors.now[200] = {3}
    mon.note_fault({"pid": "200"})  # the row's pid may be text
    assert mon._pid_minors[200] == {3}
    asked = len(minors.asked)
    mon.note_fault({"pid": 200})  # known and non-empty: /proc is not read again
    assert len(minors.asked) == asked and mon._pid_minors[200] == {3}


def test_the_cached_minors_link_an_xid_of_a_dead_process(tmp_path: Path, minors: Minors) -> None:
    mon = monitor(tmp_path)
    minors.now[300] = {1}
    mon.note_pid(300)
    minors.now[300] = set()
    mon.note_fault({"pid": 300})
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE faults (fault_id TEXT, pid INTEGER, ts_ns INTEGER, run_id TEXT)")
        conn.execute("INSERT INTO faults VALUES ('f-9', 300, 1000, 'r1')")
        mon.db = SimpleNamespace(conn=conn)
        x = X.Xid(ts_ns=2000, error_code=79, pid=0, tid=0, dev="0000:01:00.0", msg="fell off")
        assert mon._link(x) == ("f-9", "xid-on-device-of-faulted-process")
        # ...and not one on another GPU (the minor comes from minor_of).
        mon.minor_of = lambda dev: 2
        assert mon._link(x) == (None, "unattributed")
    finally:
        conn.close()


# ---- runner: _died and Run._linked ---------------------------------------------------


def died_of(code: str) -> str:
    """_died on a real child that ran `code`, its stderr read as TargetProcess reads it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for ln in proc.stderr:
            lines.append(ln.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(60)
    # Not joined here: _died itself must wait for the last lines.
    out = T.died(SimpleNamespace(proc=proc, _reader=reader, lines=lines))  # type: ignore[arg-type]
    reader.join(10)
    assert proc.stderr is not None
    proc.stderr.close()
    return out


def test_died_names_the_signal_and_the_last_words() -> None:
    out = died_of('import os, sys; print("boom", file=sys.stderr, flush=True); os.abort()')
    assert out.startswith("the target died during the experiment (killed by SIGABRT)"), out
    assert out.endswith("; its last words: boom"), out
    assert signal.SIGABRT.name in out


def test_died_with_a_status_keeps_only_the_last_three_lines() -> None:
    code = "import sys\nfor i in range(5): print(f'line {i}', file=sys.stderr)\nsys.exit(3)"
    out = died_of(code)
    assert out == (
        "the target died during the experiment (exit status 3); "
        "its last words: line 2 | line 3 | line 4"
    ), out


def test_died_silently_says_no_last_lines() -> None:
    assert died_of("import os; os.kill(os.getpid(), 9)") == (
        "the target died during the experiment (killed by SIGKILL)"
    )


def test_died_caps_the_tail() -> None:
    out = died_of("import sys; print('x' * 5000, file=sys.stderr); sys.exit(1)")
    tail = out.split("; its last words: ", 1)[1]
    assert tail == "x" * 400


XIDS = next(t for t in schema.TABLES if t.name == "xids")
ANCHORS = next(t for t in schema.TABLES if t.name == "anchors")


def fake_run(db: Path, fires: list[tuple[str, float]], run_id: str | None = "run-a") -> Any:
    """What Run._linked reads of a Run: its steps' fires and faults, the
    baseline's start, the evidence database."""
    step = SimpleNamespace(fires=fires, fault=SimpleNamespace(run_id=run_id))
    # A traffic-like step: no fault handle, request "fires" of no fault.
    other = SimpleNamespace(fires=[], fault=None)
    return SimpleNamespace(
        steps=[step, other], phase_at={"baseline": time.time() - 60}, db_path=str(db)
    )


def evidence_db(
    tmp_path: Path,
    xids: list[tuple[Any, ...]],
    anchors: list[tuple[Any, ...]],
    name: str = "ev.db",
) -> Path:
    p = tmp_path / name
    c = sqlite3.connect(p)
    try:
        c.execute(XIDS.create_sql())
        c.execute(ANCHORS.create_sql())
        c.executemany(
            "INSERT INTO xids (fault_id, run_id, dev, error_code, msg, ts_ns) VALUES (?,?,?,?,?,?)",
            xids,
        )
        c.executemany(
            "INSERT INTO anchors (fault_id, kind, wall_ns) VALUES (?,?,?)",
            anchors,
        )
        c.commit()
    finally:
        c.close()
    return p


def linked(run: Any, what: str) -> tuple[bool, float, str]:
    return R.Run._linked(run, what)


def test_linked_xid_names_a_fault_of_the_experiment(tmp_path: Path) -> None:
    now = time.time()
    db = evidence_db(
        tmp_path,
        [("f-1", "run-a", "0000:01:00.0", 79, "fell off the bus", 1)],
        [],
    )
    run = fake_run(db, [("f-1", now), ("f-2", now)])
    assert linked(run, "xid") == (
        True,
        1.0,
        "1 xids row(s) name a fault of this experiment (2 fault IDs)",
    )


def test_unlinked_xids_of_our_run_are_said_and_others_are_not(tmp_path: Path) -> None:
    now = time.time()
    db = evidence_db(
        tmp_path,
        [
            (None, "run-a", "0000:01:00.0", 79, "ours, unattributed", 1),
            ("f-x", "run-b", "0000:01:00.0", 79, "another run's", 2),
        ],
        [],
    )
    assert linked(fake_run(db, [("f-1", now)]), "xid") == (
        False,
        0.0,
        "no xids row names one of its 1 fault IDs (1 unlinked row(s) in the window)",
    )
    empty = evidence_db(tmp_path, [], [], name="empty.db")
    assert linked(fake_run(empty, [("f-1", now)]), "xid")[2] == (
        "no xids row names one of its 1 fault IDs (none recorded)"
    )


def test_linked_with_no_fires_links_nothing(tmp_path: Path) -> None:
    db = evidence_db(tmp_path, [("f-1", "run-a", "d", 79, "m", 1)], [])
    # A fire with no fault ID (a request of a traffic step) is no fault either.
    assert linked(fake_run(db, [("", time.time())]), "xid") == (
        False,
        0.0,
        "no fault fired, so nothing can be linked",
    )


def test_linked_anchor_counts_the_window_by_wall_clock(tmp_path: Path) -> None:
    now_ns = time.time_ns()
    db = evidence_db(
        tmp_path,
        [],
        [
            ("kmod-1", "aer", now_ns - 1_000_000_000),  # in the window, not ours
            ("kmod-2", "aer", now_ns - 3600 * 10**9),  # before the baseline: not said
        ],
    )
    run = fake_run(db, [("f-1", time.time())])
    assert linked(run, "anchor") == (
        False,
        0.0,
        "no anchors row names one of its 1 fault IDs (1 unlinked row(s) in the window)",
    )
    with closing(sqlite3.connect(db)) as c, c:
        c.execute(
            "INSERT INTO anchors (fault_id, kind, wall_ns) VALUES ('f-1', 'aer', ?)", (now_ns,)
        )
    assert linked(run, "anchor")[:2] == (True, 1.0)


def test_linked_without_the_table_says_it_could_not_be_read(tmp_path: Path) -> None:
    db = tmp_path / "bare.db"
    sqlite3.connect(db).close()
    ok, n, d = linked(fake_run(db, [("f-1", time.time())]), "xid")
    assert (ok, n) == (False, 0.0) and d.startswith("the xids table could not be read ("), d


def test_cuda_oom_under_load_is_another_name_for_cuda_oom_degrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = F.load("cuda-oom-under-load")
    assert e.name == "cuda-oom-degrade" and e.version == 1
    assert F.load("cuda-oom-under-load@v1").name == "cuda-oom-degrade"
    with pytest.raises(M.ExperimentError, match="version: is 1, not 2"):
        F.load("cuda-oom-under-load@v2")
    # A user's file of that name comes first: an alias never hides one.
    src = (
        F.find("cuda-oom-degrade")
        .read_text()
        .replace('name = "cuda-oom-degrade"', 'name = "cuda-oom-under-load"')
    )
    (tmp_path / "cuda-oom-under-load.toml").write_text(src)
    monkeypatch.setenv(F.ENV_DIRS, str(tmp_path))
    assert F.find("cuda-oom-under-load") == tmp_path / "cuda-oom-under-load.toml"
