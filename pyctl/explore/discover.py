"""Discover: the distinct fault points a service's requests pass through.

The service runs under its experiment file's [target] and [load] while
every function of the named libraries carries a sampling probe: action
`signal` with SIGURG, whose default disposition is to be ignored (the
kernel drops it at send time: no handler runs, no system call is
interrupted), so a call is not changed, and each fire records the call's
user stack (the engine's `stacks` rows; observe counts calls but keeps no
stack). The fires are grouped into points: (library, function, caller
site, stack signature), where the site is the return address as `OBJECT+
0xFILE_OFFSET` (what `--caller` filters on) and the signature the frames
from the caller up to `cut` frames (stacks that differ only below the cut
are one point).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (as pyctl/experiment/load.py)
    import tomli as tomllib

from pyctl.api.errors import BadInput, ExperimentFailed
from pyctl.evidence import store
from pyctl.experiment.public import load_experiment, run_experiment
from pyctl.explore import codes as C
from pyctl.explore import tomlout

# Default libraries, and the functions of each that are probed.
DEFAULT_LIBS: dict[str, str] = {
    "libcuda": "cu*",
    "libcudart": "cuda*",
    "libcublas": "cublas*",
    "libnccl": "nccl*",
    # HF tokenizers' encode entry point (pyctl/symbols/tokenizers.py), by
    # demangled name: the Rust crate exports no plain C names to glob.
    "tokenizers": "tok:hf-encode",
}
SAMPLE_SIGNAL = "SIGURG"  # ignored by default: a fire changes nothing
MAX_SAMPLES = 4000  # fires per library: bounds the stacks kept
# Keys of an experiment file that a discovery or a trial keeps from it.
KEEP = (
    "name",
    "version",
    "title",
    "description",
    "slo_id",
    "knobs",
    "target",
    "load",
    "steady_state",
    "probes",
    "phases",
)


@dataclass(frozen=True)
class Point:
    point: str  # 10 hex digits of (library, function, site, signature)
    library: str
    function: str
    site: str  # OBJECT+0xOFFSET of the return address: `--caller`'s value
    signature: str  # the frames from the caller up to the cut, " < " joined
    stack: tuple[str, ...]  # the whole stack of one example fire
    calls: int  # sampled calls through it
    rate: float  # calls per second of the discovery window
    codes: tuple[str, ...]  # what to try: fail:CODE, stall:TIME, hang
    example_fault: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class Discovery:
    experiment_id: str
    window_s: float
    points: list[Point]
    calls: int  # every call the probes counted (sampled or not)
    sampled: int  # fires (calls with a stack)
    libraries: dict[str, str]  # library -> function glob, as probed
    skipped: dict[str, str] = field(default_factory=dict)  # library -> why
    file: str = ""


def read_doc(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except OSError as e:
        raise BadInput(f"{p}: cannot read it ({e.strerror}): check the path") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{p}: not valid TOML ({e}): fix the syntax") from None


def with_target(doc: dict[str, Any], target: dict[str, Any] | None) -> dict[str, Any]:
    """doc with its [target] replaced by target (its `requires` kept)."""
    if not target:
        return doc
    own = doc.get("target") or {}
    needs = {"requires": own["requires"]} if isinstance(own, dict) and "requires" in own else {}
    return {**doc, "target": {**target, **needs}}


def base_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """The file's target, load, hypothesis and knobs; no method, no
    expectations (explore puts its own)."""
    return {k: doc[k] for k in KEEP if k in doc}


def discover_doc(
    doc: dict[str, Any], libs: dict[str, str], window_s: float, samples: int = MAX_SAMPLES
) -> dict[str, Any]:
    d = base_doc(doc)
    d["name"] = "explore-discover"
    d["title"] = f"explore: discover fault points of {doc.get('name', 'the service')}"
    phases = dict(d.get("phases") or {})
    phases.pop("method", None)
    phases["baseline"] = phases.get("baseline", "2s")
    phases["recovery"] = "1s"
    # Trials are short on purpose: keep the 1 s warm-up of before the
    # experiment default became 3 s (issue 23's judge) unless the file says.
    phases.setdefault("warmup", "1s")
    d["phases"] = phases
    d["method"] = [
        {
            "name": f"sample {lib}",
            "fault": {
                "lib": lib,
                "fn": fn,
                "action": "signal",
                "signal": SAMPLE_SIGNAL,
                "max": samples,
            },
            "start": "0s",
            "duration": f"{window_s:g}s",
            **({"parallel": True} if i else {}),
        }
        for i, (lib, fn) in enumerate(libs.items())
    ]
    return d


def _point_id(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:10]


def group(
    conn: sqlite3.Connection,
    run_ids: list[str],
    window_s: float,
    cut: int = 3,
    stall: str = "200ms",
    hang: bool = True,
) -> list[Point]:
    """The fires of run_ids grouped into points, most called first."""
    acc: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    q = ",".join("?" * len(run_ids))
    rows = conn.execute(
        f"SELECT f.fault_id, f.library, f.function, s.depth, s.symbol, s.module, s.offset "
        f"FROM faults f JOIN stacks s ON s.fault_id = f.fault_id WHERE f.run_id IN ({q}) "
        "ORDER BY f.fault_id, s.depth",
        run_ids,
    ).fetchall()
    frames: dict[str, list[tuple[str, str, str, int | None, int | None]]] = {}
    for fid, lib, fn, depth, sym, mod, off in rows:
        frames.setdefault(fid, []).append((lib, fn, sym or "", mod, off))
        del depth
    for fid, fr in frames.items():
        lib, fn = fr[0][0], fr[0][1]
        callers = fr[1:]
        if not callers or callers[0][3] is None or callers[0][4] is None:
            site = "?"
        else:
            site = f"{callers[0][3]}+{int(callers[0][4]):#x}"
        sig = " < ".join(c[2] for c in callers[:cut])
        key = (lib, fn, site, sig)
        a = acc.setdefault(key, {"n": 0, "stack": tuple(c[2] for c in fr), "fid": fid})
        a["n"] += 1
    out = []
    for (lib, fn, site, sig), a in acc.items():
        out.append(
            Point(
                point=_point_id(lib, fn, site, sig),
                library=lib,
                function=fn,
                site=site,
                signature=sig,
                stack=a["stack"],
                calls=a["n"],
                rate=round(a["n"] / window_s, 2) if window_s > 0 else 0.0,
                codes=tuple(C.spelled(c) for c in C.codes_for(fn, stall, hang, library=lib)),
                example_fault=a["fid"],
            )
        )
    out.sort(key=lambda p: (-p.calls, p.function, p.site))
    return out


def _missing_lib(msg: str, libs: dict[str, str]) -> str | None:
    """The library a refusal names as absent from the target, if one."""
    low = msg.lower()
    if (
        "not found" not in low
        and "no such" not in low
        and "not loaded" not in low
        and "cannot find" not in low
        and "no library" not in low
    ):
        return None
    for lib in libs:
        if lib.lower() in low:
            return lib
    return None


def discover(
    file: str | os.PathLike[str],
    *,
    db: str | os.PathLike[str],
    libs: dict[str, str] | None = None,
    window_s: float = 4.0,
    cut: int = 3,
    stall: str = "200ms",
    hang: bool = True,
    workdir: str | os.PathLike[str],
    target: dict[str, Any] | None = None,
    echo: Any = None,
    on_loaded: Any = None,
) -> Discovery:
    """Run the file's target under its load with sampling probes on libs
    (a library the target does not have is dropped, with why) and group
    what was sampled into points. target: a [target] table that replaces
    the file's (`--pid PID --url URL`: a server already running).
    on_loaded: called once the discovery experiment passed the loader's
    checks, before anything starts (a progress line after them: a refusal
    stays one line)."""
    doc = with_target(read_doc(file), target)
    libs = dict(libs or DEFAULT_LIBS)
    skipped: dict[str, str] = {}
    Path(workdir).mkdir(parents=True, exist_ok=True)
    while True:
        if not libs:
            raise BadInput(
                f"{file}: none of the libraries is in the target "
                f"({'; '.join(f'{k}: {v}' for k, v in skipped.items())}): name one with --lib"
            )
        d = discover_doc(doc, libs, window_s)
        path = Path(workdir) / "discover.toml"
        path.write_text(tomlout.dumps(d, f"gpufault explore: discovery of {file}"))
        try:
            try:
                exp = load_experiment(path)
            except BadInput as e:
                # the user's file is what to fix, not the one written from it
                raise BadInput(
                    str(e).replace(str(path), f"{file} (explore's discovery of it)")
                ) from e
            if on_loaded is not None:
                on_loaded()
                on_loaded = None
            v = run_experiment(exp, db=db, echo=echo, raise_on_error=False)
            # A library the target has but did not call in the window is a
            # finding of the discovery (no point there), not its failure.
            if v.verdict not in ("pass", "fail") and "never fired" not in v.reason:
                raise ExperimentFailed(f"discovery {v.experiment_id} {v.verdict}: {v.reason}")
            break
        except BadInput as e:
            lib = _missing_lib(str(e), libs)
            if lib is None:
                raise
            skipped[lib] = str(e)[:240]
            del libs[lib]
    # Opened once the experiment closed its own: one connection at a time.
    ev = store.open_db(db)
    conn = ev.conn
    try:
        steps = conn.execute(
            "SELECT run_id, started_at, ended_at, fires, name FROM experiment_steps "
            "WHERE experiment_id=? ORDER BY idx",
            (v.experiment_id,),
        ).fetchall()
        for r in steps:
            if not r[3]:
                skipped[str(r[4]).removeprefix("sample ")] = "loaded, no call in the window"
        runs = [r[0] for r in steps if r[0]]
        spans = [r[2] - r[1] for r in steps if r[1] and r[2]]
        win = max(spans) if spans else window_s
        pts = group(conn, runs, win, cut, stall, hang)
        calls = sampled = 0
        for (st,) in conn.execute(
            f"SELECT stats FROM runs WHERE run_id IN ({','.join('?' * len(runs))})", runs
        ):
            s = json.loads(st or "{}")
            calls += int(s.get("calls", 0))
            sampled += int(s.get("fires", 0))
    finally:
        ev.close()
    return Discovery(v.experiment_id, win, pts, calls, sampled, libs, skipped, str(path))
