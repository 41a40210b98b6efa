"""Bad input to trace / inject / probes: one line `gpufault: what: what to do`
on stderr, exit 2, nothing left behind (no probe, no run row, no database).
And the inputs that used to be misread: `-p`, several `--fn`, `libc` (a
linker script beside libc.so.6), Python packages as `--lib`, numbers that
wrapped, `SIG_IGN`, durations."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from gftarget import LIB, Target, bpf_progs, no_new_progs
from procio import start_controller

from pyctl.cli import cli, start_notes
from pyctl.spec import FaultSpec, SpecError, parse_duration, parse_signal
from pyctl.symbols import resolve

GF = [sys.executable, "-m", "pyctl"]
LIBC_SCRIPT = Path("/usr/lib/x86_64-linux-gnu/libc.so")


def gf(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GF, *args], capture_output=True, text=True, timeout=60, **kw)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gpufault: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture(autouse=True)
def _keeps_the_signal_mask():
    """A command run in-process (CliRunner) that got as far as the engine
    would block SIGCHLD in pytest itself, and every later child (gpufault
    and its commands) would inherit it: assert it did not, and undo it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    after = signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert after == before, f"the test left signals blocked: {sorted(after - before)}"


# ---- 1. libc is a linker script; non-ELF --lib ------------------------------


def test_libc_name_skips_the_linker_script_on_disk() -> None:
    if not LIBC_SCRIPT.exists() or resolve.elf_kind(str(LIBC_SCRIPT)):
        pytest.skip(f"{LIBC_SCRIPT} is not a linker script here")
    res = CliRunner().invoke(cli, ["probes", "libc", "--fn", "mall*"])
    assert res.exit_code == 0, res.output
    assert "Magic number" not in res.output
    first = res.stdout.splitlines()[0]
    assert "libc.so.6 (on disk)" in first and " malloc " in res.stdout


def test_libc_name_prefers_what_the_target_maps() -> None:
    lib = resolve.find_library("libc", os.getpid())
    assert lib.mapped and lib.display.endswith("libc.so.6")
    res = CliRunner().invoke(cli, ["probes", "libc", "-p", str(os.getpid()), "--fn", "malloc"])
    assert res.exit_code == 0 and "(mapped)" in res.stdout, res.output


@pytest.mark.parametrize("path", ["/etc/passwd", str(LIBC_SCRIPT)])
def test_non_elf_lib_path_is_one_line(path: str) -> None:
    if not Path(path).exists():
        pytest.skip(f"{path} missing")
    res = CliRunner().invoke(cli, ["probes", path, "--fn", "*"])
    assert res.exit_code == 2, res.output
    line = one_line(res.stderr)
    assert f"{path} is not an ELF file" in line and "give the path of a shared library" in line


# ---- 5. Python packages by name ---------------------------------------------


@pytest.mark.parametrize(
    "pkg, stem", [("tiktoken", "_tiktoken.cpython-"), ("tokenizers", "tokenizers.abi3.so")]
)
def test_python_package_extension_by_name(pkg: str, stem: str) -> None:
    pytest.importorskip(pkg)
    lib = resolve.find_library(pkg)
    assert f"/{pkg}/" in lib.display and os.path.basename(lib.display).startswith(stem)
    assert not lib.mapped
    res = CliRunner().invoke(cli, ["probes", pkg, "--fn", "PyInit_*"])
    assert res.exit_code == 0, res.output
    assert "PyInit_" in res.stdout


def test_python_package_in_the_targets_maps() -> None:
    pytest.importorskip("tiktoken")
    pytest.importorskip("tokenizers")
    p = subprocess.Popen(
        [sys.executable, "-c", "import tiktoken, sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        lib = resolve.find_library("tiktoken", p.pid)
        assert lib.mapped and "/tiktoken/_tiktoken." in lib.display
        # Not loaded by the target: found in the target's own site-packages.
        tok = resolve.find_library("tokenizers", p.pid)
        assert not tok.mapped and tok.display.endswith("/tokenizers/tokenizers.abi3.so")
    finally:
        p.kill()
        p.wait()


# ---- 3. several --fn ----------------------------------------------------------


def test_several_fn_all_resolve_and_an_unknown_one_is_named() -> None:
    res = CliRunner().invoke(cli, ["probes", str(LIB), "--fn", "gf_victim", "--fn", "gf_alloc"])
    assert res.exit_code == 0, res.output
    assert "gf_victim" in res.stdout and "gf_alloc" in res.stdout and "2 functions" in res.stdout
    res = CliRunner().invoke(cli, ["probes", str(LIB), "--fn", "gf_victim", "--fn", "gf_nope*"])
    assert res.exit_code == 2
    assert "symbol 'gf_nope*' not found" in one_line(res.stderr)
    syms = resolve.symbols(resolve.find_library(str(LIB)), ["gf_victim", "gf_*", "gf_alloc"])
    assert sorted(s.name for s in syms) == ["gf_alloc", "gf_empty", "gf_victim"]


# ---- 6. numbers, signals, durations -------------------------------------------


@pytest.mark.parametrize(
    "text, secs",
    [("30s", 30), ("500ms", 0.5), ("2h", 7200), ("1m30s", 90), ("1h2m3.5s", 3723.5),
     ("1.5", 1.5), ("250us", 250e-6), ("2m", 120)],
)  # fmt: skip
def test_durations(text: str, secs: float) -> None:
    assert parse_duration(text) == pytest.approx(secs)


@pytest.mark.parametrize("text", ["0", "0s", "0ms", "1m30", "1s1s", "abc", "-1s", "3651d", "inf"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(SpecError):
        parse_duration(text)


def test_signals_are_real_signals() -> None:
    assert parse_signal("SIGSEGV") == signal.SIGSEGV
    assert parse_signal("bus") == signal.SIGBUS
    assert parse_signal("9") == 9 and parse_signal("64") == 64
    assert parse_signal("SIGRTMIN+1") == signal.SIGRTMIN + 1
    for bad in ("SIG_IGN", "SIG_DFL", "0", "65", "SIGNOPE"):
        with pytest.raises(SpecError):
            parse_signal(bad)


def test_counters_out_of_the_u64_range_are_refused() -> None:
    for kw in ({"nth": 2**64 + 1}, {"every": 2**64}, {"after": 2**70}, {"max_fires": 2**64}):
        with pytest.raises(SpecError, match="out of range"):
            FaultSpec(lib="x", fn="y", **kw).validate()
    with pytest.raises(SpecError, match="--ret"):
        FaultSpec(lib="x", fn="y", action="fail", ret=2**64).validate()
    s = FaultSpec(lib="x", fn="y", action="fail", ret=2**64 - 1).validate()
    assert s.to_bpf().retval == -1


# ---- 4 and 6: what a run says at start ----------------------------------------


class _Att:
    def __init__(self, spec: int, name: str) -> None:
        self.spec = spec
        self.sym = type("S", (), {"name": name})()


def test_observe_without_trace_says_what_it_records() -> None:
    notes = start_notes([FaultSpec(lib="l", fn="f", nth=5)], [_Att(0, "f")])
    assert len(notes) == 1 and "add --trace" in notes[0]
    assert start_notes([FaultSpec(lib="l", fn="f", trace=True)], [_Att(0, "f")]) == []


def test_fail_on_a_void_function_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyctl import catalog
    from pyctl.catalog.model import FuncInfo

    real = catalog.lookup
    # No catalogued function returns void today; one that did must warn.
    monkeypatch.setattr(
        catalog,
        "lookup",
        lambda n: FuncInfo(n, "cuda", (), "void") if n == "cuVoidThing" else real(n),
    )
    fail = FaultSpec(lib="libcuda", fn="cu*", action="fail", ret=2)
    notes = start_notes([fail], [_Att(0, "cuVoidThing"), _Att(0, "cuMemAlloc_v2")])
    assert len(notes) == 1 and notes[0].strip().startswith("warning: cuVoidThing returns void")
    assert start_notes([fail], [_Att(0, "cuMemAlloc_v2")]) == []


# ---- the command line as a user runs it ----------------------------------------


def test_missing_target_and_stray_words_need_no_root(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    base = ["--lib", str(LIB), "--fn", "gf_victim", "--db", str(db)]
    for args, needle in [
        (["trace", *base], "give a target"),
        (["trace", "-x", *base], "unknown option -x"),
        (["trace", *base, "./app"], "unexpected argument './app'"),
        (["trace", *base, "./app", "-v"], "unknown option -v"),
        (["inject", "--ret", "1", "--pid", "abc", *base], "'abc' is not a valid integer"),
        (["inject", "--ret", "1e23", "-p", "12", *base], "--ret: '1e23' is not an integer"),
        (["trace", "--duration", "0", "-p", "12", *base], "--duration: '0' must be longer"),
    ]:
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        assert needle in one_line(res.stderr), (args, res.stderr)
    assert not db.exists()


def _kthread() -> int:
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                flags = int((p / "stat").read_text().rsplit(")", 1)[1].split()[6])
            except (OSError, IndexError):
                continue
            if flags & 0x00200000:
                return int(p.name)
    pytest.skip("no kernel thread visible")


BAD = [
    (["-x"], "unknown option -x"),
    (["./gf_target"], "unexpected argument './gf_target'"),
    (["--duration", "0"], "--duration: '0' must be longer than 0"),
    (["--nth", "18446744073709551617"], "--nth: 18446744073709551617 is out of range"),
    (["--ret", "1e23"], "--ret: '1e23' is not an integer"),
    (["--ret", str(2**64)], "--ret: 18446744073709551616 is out of range"),
    (["--action", "signal", "--signal", "SIG_IGN"], "--signal: unknown signal 'SIG_IGN'"),
    (["--fn", "gf_nope"], "symbol 'gf_nope' not found"),
    (["--lib", "/etc/passwd"], "/etc/passwd is not an ELF file"),
    (["--when", "arg1==18446744073709551617"], "--when value"),
    (["--stall", "0", "--action", "stall"], "--stall: '0' must be longer than 0"),
]


@pytest.mark.root
@pytest.mark.parametrize("extra, needle", BAD, ids=[b[1].split(":")[0][:24] for b in BAD])
def test_bad_input_one_line_exit_2_nothing_left(
    target: Target, tmp_path: Path, extra: list[str], needle: str
) -> None:
    db = tmp_path / "gf.db"
    before = bpf_progs()
    args = ["inject", "-p", str(target.pid), "--lib", str(LIB), "--fn", "gf_victim"]
    if "--ret" not in extra and "--action" not in extra:
        args += ["--ret", "1"]
    if "--lib" in extra:
        args = args[:3] + args[5:]
    res = gf(*args, *extra, "--db", str(db))
    assert res.returncode == 2, res
    assert needle in one_line(res.stderr), res.stderr
    assert not db.exists()
    assert no_new_progs(before)
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]


@pytest.mark.root
def test_unusable_targets_are_refused(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    base = ["--lib", "libc", "--fn", "getpid", "--db", str(db)]
    for args, needle in [
        (["trace", "-p", "1", *base], "pid 1 "),
        (["trace", "-p", str(_kthread()), *base], "is a kernel thread"),
        (["trace", "--pid", "0", *base], "--pid: 0 is not a process id"),
        (["trace", *base], "give a target"),
        (["trace", *base, "--", "/no/such/prog"], "cannot run /no/such/prog: no such file"),
        (["trace", *base, "--", "gf-no-such-command"], "command not found on PATH"),
        (["trace", *base, "--", "/etc/passwd"], "not an executable file"),
        (["trace", "--tid", "1", *base], "pid 1 "),
    ]:
        res = gf(*args)
        assert res.returncode == 2, (args, res)
        assert needle in one_line(res.stderr), (args, res.stderr)
        assert "exec:" not in res.stderr
    assert not db.exists()


def test_template_run_takes_dash_p_and_refuses_unknown_options(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    for args, needle in [
        (["-x", "1"], "-x"),
        (["-p", "1"], "pid 1 "),
    ]:
        res = gf("template", "run", "cuda-oom-sticky", "--db", str(db), *args)
        assert res.returncode == 2, res
        assert needle in one_line(res.stderr), res.stderr
        assert "exec:" not in res.stderr
    assert not db.exists()


@pytest.mark.root
def test_gpufault_in_a_nested_pid_namespace_is_refused(tmp_path: Path) -> None:
    """From a container's PID namespace our pids are not the ones BPF
    compares: refuse rather than arm faults that can never fire."""
    db = tmp_path / "gf.db"
    res = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", *GF, "trace", "--lib", "libc",
         "--fn", "getpid", "--db", str(db), "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if res.returncode != 2 and "unshare:" in res.stderr:
        pytest.skip(f"cannot make a PID namespace here: {res.stderr.strip()}")
    assert res.returncode == 2, res
    assert "PID namespace other than the host's" in one_line(res.stderr)
    assert not db.exists()


def _controller(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    return start_controller([*GF, *args])


@pytest.mark.root
def test_dash_p_and_several_fn_trace_both(target: Target, tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "gf.db"
    ctl, _ = _controller(
        "trace", "-p", str(target.pid), "--lib", str(LIB), "--fn", "gf_victim", "--fn",
        "gf_alloc", "--db", str(db),
    )  # fmt: skip
    assert ctl.stderr is not None
    probes = ctl.stderr.readline()
    assert "gf_alloc, gf_victim" in probes, probes
    target.victim(2)
    target.alloc(1)
    ctl.send_signal(signal.SIGINT)
    err = ctl.stderr.read()
    assert ctl.wait(timeout=30) == 0, err
    con = sqlite3.connect(db)
    fns = con.execute(
        "SELECT f.symbol, count(*) FROM calls c JOIN funcs f USING (run_id, func) GROUP BY 1"
    ).fetchall()
    assert dict(fns) == {"gf_victim": 2, "gf_alloc": 1}
    (text,) = con.execute("SELECT text FROM specs").fetchone()
    assert ":gf_victim,gf_alloc observe" in text


@pytest.mark.root
def test_inject_lib_libc_and_observe_note(target: Target, tmp_path: Path) -> None:
    ctl, _ = _controller(
        "inject", "-p", str(target.pid), "--lib", "libc", "--fn", "mall*", "--action",
        "observe", "--nth", "5", "--db", str(tmp_path / "gf.db"),
    )  # fmt: skip
    ctl.send_signal(signal.SIGINT)
    assert ctl.stderr is not None
    err = ctl.stderr.read()  # not communicate(): it skips what readline() buffered
    assert ctl.wait(timeout=30) == 0, err
    assert "Magic number" not in err
    assert "note: mall*: --action observe without --trace records no calls" in err


@pytest.mark.root
def test_compound_duration_ends_the_run(target: Target, tmp_path: Path) -> None:
    t0 = time.monotonic()
    res = gf(
        "trace", "-p", str(target.pid), "--lib", str(LIB), "--fn", "gf_victim",
        "--duration", "0m1s500ms", "--db", str(tmp_path / "gf.db"), "-q",
    )  # fmt: skip
    assert res.returncode == 0, res
    assert 1.5 <= time.monotonic() - t0 < 30


@pytest.mark.root
def test_command_after_double_dash_keeps_its_options(tmp_path: Path) -> None:
    res = gf(
        "trace", "--lib", str(LIB), "--fn", "gf_victim", "--db", str(tmp_path / "gf.db"),
        "-q", "--", "/bin/sh", "-c", "exit 7", "-p", "--fn",
    )  # fmt: skip
    assert res.returncode == 7, res
