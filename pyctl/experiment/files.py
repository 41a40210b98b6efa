"""Experiment files: named, versioned TOML that say what to break, what to
watch, and what "the service coped" means (docs/experiments.md).

A file is checked whole before anything runs: every key is known, every
value has its type, every template exists, every fault builds through the
templates' own builder (pyctl.templates.build_spec, the one spec parser),
every duration parses. A problem is one ExperimentError line naming the
file, the key and what to do.

The words are Chaos Toolkit's and Litmus's: steady_state (hypothesis),
method (fault steps), abort (guards), rollback, probes with a mode
(sot/eot/edge/continuous/onchaos) and a tolerance.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.exceptions import BadInput
from pyctl.experiment.facts import (
    PID_FACTS,
    PLACEHOLDER,
    TARGET_FACTS,
    is_fact,
    placeholders,
    render,
)
from pyctl.experiment.probes import Probe, ProbeError, Tolerance, probe_from_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from pyctl import templates as T
from pyctl.spec import FaultSpec, SpecError, parse_duration

SHIPPED = Path(__file__).resolve().parent.parent / "experiments"
ENV_DIRS = "GPUFAULT_EXPERIMENTS"
# Prompt sources of [load] and of traffic steps (pyctl/experiment/corpora.py).
CORPORA = ("prompt", "prompts", "unicode", "over-limit", "at-limit", "hot", "cold")


_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")

TOP_KEYS = {
    "name",
    "version",
    "title",
    "description",
    "slo_id",
    "knobs",
    "target",
    "load",
    "phases",
    "steady_state",
    "probes",
    "method",
    "abort",
    "expect",
    "rollback",
    "remediation",
}


class ExperimentError(BadInput):
    """One line for the user: which file, which key, what is wrong, what to do."""


# ---- small typed readers: every message names file and key -------------------------------


class _Reader:
    def __init__(self, where: str) -> None:
        self.where = where
        self.modes: dict[str, str] = {}  # probe name -> its mode (sot, continuous, ...)

    def err(self, key: str, what: str) -> ExperimentError:
        return ExperimentError(f"{self.where}: {key}: {what}")

    def table(
        self, doc: dict[str, Any], key: str, allowed: set[str], *, required: bool = False
    ) -> dict[str, Any]:
        v = doc.get(key.rsplit(".", 1)[-1])
        if v is None:
            if required:
                raise self.err(key, f"missing: add a [{key}] table")
            return {}
        if not isinstance(v, dict):
            raise self.err(key, f"expected a table, got {_kind(v)}: write [{key}] or {{...}}")
        self.keys(v, key, allowed)
        return v

    def keys(self, d: dict[str, Any], key: str, allowed: set[str]) -> None:
        for k in d:
            if k not in allowed:
                raise self.err(
                    f"{key}.{k}" if key else k,
                    f"unknown key: remove it or use one of {', '.join(sorted(allowed))}",
                )

    def str_(self, d: dict[str, Any], key: str, name: str, default: str | None = None) -> str:
        v = d.get(name, default)
        if v is None:
            raise self.err(_join(key, name), "missing: give a string")
        if not isinstance(v, str):
            raise self.err(_join(key, name), f"expected a string, got {_kind(v)} {v!r}")
        return v

    def int_(
        self, d: dict[str, Any], key: str, name: str, default: int | None = None, lo: int = 0
    ) -> int:
        v = d.get(name, default)
        if v is None:
            raise self.err(_join(key, name), "missing: give an integer")
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.err(_join(key, name), f"expected an integer, got {_kind(v)} {v!r}")
        if v < lo:
            raise self.err(_join(key, name), f"{v} is below {lo}: give at least {lo}")
        return v

    def num(
        self,
        d: dict[str, Any],
        key: str,
        name: str,
        default: float | None = None,
        what: str = "a number",
    ) -> float:
        v = d.get(name, default)
        if v is None:
            raise self.err(_join(key, name), f"missing: give {what}")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self.err(_join(key, name), f"expected {what}, got {_kind(v)} {v!r}")
        return float(v)

    def bool_(self, d: dict[str, Any], key: str, name: str, default: bool) -> bool:
        v = d.get(name, default)
        if not isinstance(v, bool):
            raise self.err(_join(key, name), f"expected true or false, got {_kind(v)} {v!r}")
        return v

    def duration(
        self,
        d: dict[str, Any],
        key: str,
        name: str,
        default: Any = None,
        *,
        allow_zero: bool = False,
    ) -> float:
        v = d.get(name, default)
        k = _join(key, name)
        if v is None:
            raise self.err(k, 'missing: give a duration such as "5s" or "500ms"')
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise self.err(k, f'expected a duration such as "5s", got {_kind(v)} {v!r}')
        try:
            return parse_duration(str(v), k, allow_zero=allow_zero)
        except SpecError as e:
            raise self.err(k, str(e).split(": ", 1)[-1]) from None

    def env(self, d: dict[str, Any], key: str, name: str) -> dict[str, str]:
        v = d.get(name, {})
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            raise self.err(
                _join(key, name), 'expected a table of strings, e.g. {GF_DOUBLE_MEM_MIB = "24"}'
            )
        return dict(v)

    def command(self, d: dict[str, Any], key: str, name: str) -> list[str]:
        """A command as a list of words, or one string split like a shell
        would (no shell runs it: no expansion, no pipes)."""
        v = d.get(name)
        k = _join(key, name)
        if isinstance(v, str):
            try:
                words = shlex.split(v)
            except ValueError as e:
                raise self.err(k, f"cannot split {v!r} ({e}): fix the quoting") from None
        elif isinstance(v, list) and all(isinstance(w, str) for w in v):
            words = list(v)
        else:
            raise self.err(k, f"expected a command (a string or a list of strings), got {_kind(v)}")
        if not words:
            raise self.err(k, "empty command: give the program and its arguments")
        return words


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _kind(v: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(v), type(v).__name__)


# ---- bounds for the load generator's numbers (latency, error share, rate) ----------------


def parse_bound(text: Any, r: _Reader, key: str, unit: str) -> Tolerance:
    """A load bound (`<= 200ms`, `< 1%`): the probes' one tolerance type."""
    try:
        return Tolerance.bound(text, unit)
    except ProbeError as e:
        raise r.err(key, str(e)) from None


# ---- the parsed experiment ---------------------------------------------------------------


@dataclass
class Step:
    """One fault step of the method."""

    idx: int
    name: str
    template: str | None  # "name@vN" for a template step, None for an inline fault
    sets: dict[str, str]  # --set values of a template step
    fault: dict[str, Any] | None  # an inline [[fault]] table (knobs rendered)
    start: float  # offset from the method's start, seconds
    duration: float
    thread: str | None  # only this thread of the target (its comm), e.g. gf-worker
    specs: list[FaultSpec] = field(default_factory=list)
    # Another process or thread of the target than the served one: a number
    # or one fact ("{rank1_pid}"), filled in once the target runs.
    pid: str | None = None
    tid: str | None = None
    arm_timeout: float | None = None  # None: the FaultHost's own (60 s)
    traffic: Traffic | None = None  # a traffic step: requests, not a fault
    # A perturb step: {"rules": [...], "seed": N, "url": ...}, bit flips the
    # service arms in its own model (pyctl/experiment/perturb_step.py).
    perturb: dict[str, Any] | None = None
    # A pressure step: {"share", "device", "allocator", "reserve_mib"}, a
    # second process holding VRAM (pyctl/experiment/pressure_step.py).
    pressure: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        if self.pressure is not None:
            return "pressure"
        if self.perturb is not None:
            return "perturb"
        return self.template or ("traffic" if self.traffic is not None else "inline")


# The first word of a target command that means "this gpufault": started
# isolated (`python -I -m pyctl ...`, pyctl.paths), never one found on PATH.
GPUFAULT = "gpufault"
# gpufault's admin token variable (the reference service reads it, and so
# may any server): what a perturb step sends when the file names none.
ADMIN_TOKEN_ENV = "GPUFAULT_ADMIN_TOKEN"
# The default ready line: the reference service's "serving on http://..."
# (any server may print the same; target.ready gives another regex).
SERVICE_READY = r"serving on (?P<url>https?://\S+)"


@dataclass
class Target:
    url: str | None
    pid: int | None
    command: list[str]  # gpufault starts it ({ready_file} is a private path)
    ready: str  # a regex over its stderr lines; a (?P<url>) group gives the url
    start_timeout: float
    env: dict[str, str] = field(default_factory=dict)  # added to the command's environment
    # A fresh secret gpufault puts into this variable of the command it
    # starts; its perturb steps send it (the service's --perturb-control).
    admin_token_env: str | None = None


@dataclass
class Load:
    rate: float
    prompt: str
    max_tokens: int
    timeout: float
    path: str
    concurrency: int
    # The prompt mix (corpora.bodies): "prompt" (the one above), "prompts"
    # (the list, in turn), or a generated corpus.
    corpus: str = "prompt"
    prompts: list[str] = field(default_factory=list)
    context: int = 256  # the service's --max-context (over-limit, at-limit)
    vocab_size: int = 1000  # the service's --vocab-size (its tokenizer, rebuilt here)
    max_len: int = 20000  # cap of the unicode corpus's long cases (characters)


@dataclass
class Traffic(Load):
    """A traffic step: a second open-loop load while the step lasts (the
    adversarial input is the fault). Every answer must have a status in
    ok_status: a refusal (4xx) is fine, a 5xx, a dropped connection or a
    timeout is not; `max_bad` is the share allowed outside."""

    ok_status: tuple[int, int] = (200, 499)
    max_bad: float = 0.0


@dataclass
class Judge:
    alpha: float
    min_effect: float  # Cliff's delta of the shift test
    min_tail_effect: float = 0.05  # the tail test's share difference (pyctl/experiment/stats.py)


@dataclass
class SteadyState:
    p50: Tolerance | None
    p95: Tolerance | None
    p99: Tolerance | None
    error_rate: Tolerance | None
    min_throughput: Tolerance | None
    judge: Judge | None
    probes: list[str]  # names of the hypothesis probes (tables in Experiment.probes)
    quorum: float = 0.8  # share of a phase's 1 s windows that must meet the bounds

    def window_ok(self, w: Any) -> tuple[bool, str]:
        """Does one load window meet the per-window hypothesis?"""
        if w.count == 0:
            return False, "no request due in this window"
        for name, b in (
            ("p50", self.p50),
            ("p95", self.p95),
            ("p99", self.p99),
            ("error_rate", self.error_rate),
            ("throughput", self.min_throughput),
        ):
            if b is not None and not b.check(getattr(w, name)):
                return False, f"{name} {getattr(w, name):.4g} not {b}"
        return True, ""


@dataclass
class Abort:
    probe: str
    after_failures: int


@dataclass
class Expect:
    alert_probe: str | None = None
    alert_within: float = 0.0
    degradation_probe: str | None = None
    recovered_within: float | None = None
    recovery_probe: str | None = None
    recovery_hold: float = 3.0
    # Evidence rows that must name one of the experiment's fault IDs: "xid"
    # (the NVIDIA driver's Xid tracepoint), "anchor" (gpufa.ko's anchors).
    linked: tuple[str, ...] = ()


LINKABLE = {"xid": "xids", "anchor": "anchors"}  # expectation word -> evidence table


@dataclass
class Rollback:
    name: str
    command: list[str]
    timeout: float


@dataclass
class Remediation:
    command: list[str]
    on: str
    timeout: float


@dataclass
class Experiment:
    name: str
    version: int
    title: str
    description: str
    slo_id: str
    path: Path
    knobs: dict[str, T.Knob]
    values: dict[str, Any]
    warmup: float  # load runs, nothing is counted (a fresh service's first requests)
    baseline: float
    method_window: float  # the method phase's length (steps' end, or [phases] method)
    recovery: float
    target: Target
    load: Load | None
    steady: SteadyState
    probes: dict[str, Probe]  # name -> probe, parsed once (target facts: with_facts)
    probe_where: dict[str, str]  # name -> "steady_state.probes.X" / "probes.X"
    steps: list[Step]
    aborts: list[Abort]
    expect: Expect
    rollbacks: list[Rollback]
    remediation: Remediation | None
    expanded: dict[str, Any]  # the file's content with the knobs filled in

    @property
    def ident(self) -> str:
        return f"{self.name}@v{self.version}"


# ---- loading -----------------------------------------------------------------------------


def search_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(ENV_DIRS, "").split(os.pathsep) if p]
    return [*extra, SHIPPED]


def find(name_or_file: str) -> Path:
    """A path (has a slash or ends in .toml and exists), else a name
    (NAME or NAME@vN) in GPUFAULT_EXPERIMENTS dirs, then the shipped ones."""
    p = Path(name_or_file)
    if "/" in name_or_file or name_or_file.endswith(".toml"):
        if not p.is_file():
            raise ExperimentError(f"{name_or_file}: no such experiment file: check the path")
        return p
    base = name_or_file.split("@v", 1)[0]
    for name in (base, ALIASES.get(base)):
        for d in search_dirs() if name else ():
            if (d / f"{name}.toml").is_file():
                return d / f"{name}.toml"
    names = ", ".join(sorted(all_names())) or "none"
    raise ExperimentError(
        f"no experiment {name_or_file!r}: see `gpufault experiment list` ({names})"
    )


# Other names users know a shipped experiment by (a file of that name in a
# search dir comes first): the observability issue's walk-through runs
# `gpufault experiment run cuda-oom-under-load`.
ALIASES = {"cuda-oom-under-load": "cuda-oom-degrade"}


def all_names() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for d in search_dirs():
        for p in sorted(d.glob("*.toml")) if d.is_dir() else ():
            out.setdefault(p.stem, p)
    return out


def load(name_or_file: str, sets: dict[str, str] | None = None) -> Experiment:
    path = find(name_or_file)
    exp = load_file(path, sets)
    if "@v" in name_or_file and "/" not in name_or_file:
        want = name_or_file.split("@v", 1)[1]
        if str(exp.version) != want:
            raise ExperimentError(
                f"{path}: version: is {exp.version}, not {want}: "
                f"drop @v{want} or use the file of that version"
            )
    return exp


def load_file(path: Path, sets: dict[str, str] | None = None) -> Experiment:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise ExperimentError(f"{path}: cannot read it ({e.strerror}): check the path") from None
    except tomllib.TOMLDecodeError as e:
        raise ExperimentError(f"{path}: not valid TOML ({e}): fix the syntax") from None
    r = _Reader(str(path))
    r.keys(doc, "", TOP_KEYS)
    name = r.str_(doc, "", "name")
    if not _NAME.fullmatch(name):
        raise r.err("name", f"{name!r}: use lower-case letters, digits and dashes")
    if path.parent.resolve() in {d.resolve() for d in search_dirs()} and name != path.stem:
        raise r.err("name", f"{name!r} must equal the file name ({path.stem}): rename one")
    version = r.int_(doc, "", "version", lo=1)
    title = r.str_(doc, "", "title")
    description = r.str_(doc, "", "description", "").strip()
    slo_id = r.str_(doc, "", "slo_id", "")

    knobs: dict[str, T.Knob] = {}
    for k, spec in r.table(doc, "knobs", set(doc.get("knobs") or {})).items():
        kk = f"knobs.{k}"
        if not isinstance(spec, dict):
            raise r.err(kk, "expected a table with default and help")
        r.keys(spec, kk, {"default", "help"})
        if "default" not in spec or not isinstance(spec.get("help"), str) or not spec["help"]:
            raise r.err(kk, "needs a default and a help line")
        if isinstance(spec["default"], (dict, list)):
            raise r.err(f"{kk}.default", "expected a string, number or boolean")
        knobs[k] = T.Knob(k, spec["default"], spec["help"])
    values = {k: kn.default for k, kn in knobs.items()}
    for k, text in (sets or {}).items():
        if k not in knobs:
            raise ExperimentError(
                f"{path}: --set {k}: no such knob (knobs: "
                f"{', '.join(knobs) or 'none'}): use one of them"
            )
        try:
            values[k] = knobs[k].coerce(text)
        except T.TemplateError as e:
            raise ExperimentError(f"{path}: {e}") from None

    # Every {name} must be a knob or a target fact, wherever it is.
    for k in doc:
        if k == "knobs":
            continue
        for ph in placeholders(doc[k]):
            if ph not in knobs and not is_fact(ph):
                raise r.err(
                    k,
                    f"{{{ph}}} is neither a knob nor a target fact "
                    f"({', '.join(TARGET_FACTS)}, rankN_pid, rankN_tid): add [knobs.{ph}]",
                )
    rendered = {k: render(v, values) for k, v in doc.items() if k != "knobs"}

    target = _target(r, rendered)
    load_ = _load(r, rendered)
    probes, probe_where = _probes(r, rendered)
    steady = _steady(r, rendered, probes, probe_where)
    if (
        load_ is None
        and any(
            b is not None
            for b in (steady.p50, steady.p95, steady.p99, steady.error_rate, steady.min_throughput)
        )
        or load_ is None
        and steady.judge is not None
    ):
        raise r.err("steady_state", "latency or error hypotheses need a [load] table: add one")
    steps = _method(r, rendered, values)
    phases = r.table(rendered, "phases", {"warmup", "baseline", "method", "recovery"})
    warmup = r.duration(phases, "phases", "warmup", "1s", allow_zero=True)
    baseline = r.duration(phases, "phases", "baseline", "5s")
    steps_end = max((s.start + s.duration for s in steps), default=0.0)
    method_window = r.duration(phases, "phases", "method", steps_end or "5s")
    if method_window < steps_end:
        raise r.err(
            "phases.method",
            f"{method_window:g}s is shorter than the steps "
            f"({steps_end:g}s): lengthen it or drop it",
        )
    aborts = _aborts(r, rendered, probes)
    expect = _expect(r, rendered, probes, load_ is not None)
    need = (expect.recovered_within or 0) + (
        expect.recovery_hold if expect.recovered_within is not None else 0
    )
    recovery = r.duration(phases, "phases", "recovery", max(need, 1.0), allow_zero=True)
    if recovery < need:
        raise r.err(
            "phases.recovery",
            f"{recovery:g}s cannot show recovered_within + hold ({need:g}s): lengthen it",
        )
    rollbacks = _rollbacks(r, rendered)
    remediation = _remediation(r, rendered)

    expanded = dict(rendered)
    expanded["knobs"] = values
    return Experiment(
        name=name,
        version=version,
        title=title,
        description=description,
        slo_id=slo_id,
        path=path,
        knobs=knobs,
        values=values,
        warmup=warmup,
        baseline=baseline,
        method_window=method_window,
        recovery=recovery,
        target=target,
        load=load_,
        steady=steady,
        probes=probes,
        probe_where=probe_where,
        steps=steps,
        aborts=aborts,
        expect=expect,
        rollbacks=rollbacks,
        remediation=remediation,
        expanded=expanded,
    )


def _target(r: _Reader, doc: dict[str, Any]) -> Target:
    t = r.table(
        doc,
        "target",
        {"url", "pid", "command", "ready", "service", "start_timeout", "env", "admin_token_env"},
        required=True,
    )
    url = r.str_(t, "target", "url", "") or None
    if url is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        raise r.err("target.url", f"{url!r} is not an http URL: write e.g. http://127.0.0.1:8000")
    pid = None
    if "pid" in t:
        pid = r.int_(t, "target", "pid", lo=1)
    command: list[str] = []
    if "command" in t:
        command = r.command(t, "target", "command")
    env = r.env(t, "target", "env")
    admin_token_env = r.str_(t, "target", "admin_token_env", "") or None
    if "service" in t:
        # The reference service is a command like any other: this shortcut
        # only spells its command line, ready line and admin token variable;
        # `gpufault service` itself checks its options when it starts.
        s = r.table(t, "target.service", {"device", "args", "env"})
        dev = r.str_(s, "target.service", "device", "cpu")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", dev):
            raise r.err("target.service.device", f"{dev!r}: give a device such as cpu or cuda")
        args = s.get("args", [])
        if isinstance(args, list):
            # "{knob}" alone keeps the knob's type: a number is an option value too.
            args = [
                str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
                for a in args
            ]
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise r.err(
                "target.service.args",
                "expected a list of strings (the options of `gpufault service`)",
            )
        env.update(r.env(s, "target.service", "env"))
        command = [GPUFAULT, "service", "--port", "0", "--device", dev, *args]
        if admin_token_env is None and "--perturb-control" in args:
            admin_token_env = ADMIN_TOKEN_ENV
    if admin_token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", admin_token_env):
        raise r.err("target.admin_token_env", f"{admin_token_env!r} is not a variable name")
    given = [k for k in ("pid", "command", "service") if k in t]
    if len(given) > 1:
        raise r.err("target", f"{' and '.join(given)} both name the process: keep one")
    if not given:
        raise r.err("target", "no process to inject into: add pid, command or service")
    if (pid is not None) and url is None:
        raise r.err("target.url", "missing: a pid target needs the service's url")
    if pid is not None and (env or admin_token_env):
        raise r.err("target", "env and admin_token_env are for a command gpufault starts")
    ready = r.str_(t, "target", "ready", SERVICE_READY)
    try:
        re.compile(ready)
    except re.error as e:
        raise r.err("target.ready", f"not a regular expression ({e})") from None
    return Target(
        url=url,
        pid=pid,
        command=command,
        ready=ready,
        start_timeout=r.duration(t, "target", "start_timeout", "90s"),
        env=env,
        admin_token_env=admin_token_env,
    )


LOAD_KEYS = {
    "rate",
    "prompt",
    "max_tokens",
    "timeout",
    "path",
    "concurrency",
    "corpus",
    "prompts",
    "context",
    "vocab_size",
    "max_len",
}


def _load(r: _Reader, doc: dict[str, Any]) -> Load | None:
    if "load" not in doc:
        return None
    t = r.table(doc, "load", LOAD_KEYS)
    return Load(**_load_fields(r, t, "load"))


def _load_fields(r: _Reader, t: dict[str, Any], key: str) -> dict[str, Any]:
    """The keys [load] and a traffic step share."""
    rate = r.num(t, key, "rate", 10, "a number of requests per second")
    if not 0 < rate <= 10000:
        raise r.err(f"{key}.rate", f"{rate:g}: give 0 < rate <= 10000 requests per second")
    path = r.str_(t, key, "path", "/v1/completions")
    if not path.startswith("/"):
        raise r.err(f"{key}.path", f"{path!r}: give a path starting with /")
    prompts = t.get("prompts", [])
    if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts):
        raise r.err(f"{key}.prompts", "expected a list of strings (sent in turn)")
    corpus = r.str_(t, key, "corpus", "prompts" if prompts else "prompt")
    if corpus not in CORPORA:
        raise r.err(f"{key}.corpus", f"{corpus!r}: use one of {', '.join(CORPORA)}")
    if corpus == "prompts" and not prompts:
        raise r.err(f"{key}.prompts", 'corpus "prompts" needs prompts = ["...", ...]')
    if prompts and corpus != "prompts":
        raise r.err(f"{key}.prompts", f'prompts are for corpus = "prompts", not {corpus!r}')
    return {
        "rate": rate,
        "prompt": r.str_(t, key, "prompt", "hello world"),
        "max_tokens": r.int_(t, key, "max_tokens", 4, lo=1),
        "timeout": r.duration(t, key, "timeout", "5s"),
        "path": path,
        "concurrency": r.int_(t, key, "concurrency", 64, lo=1),
        "corpus": corpus,
        "prompts": list(prompts),
        "context": r.int_(t, key, "context", 256, lo=8),
        "vocab_size": r.int_(t, key, "vocab_size", 1000, lo=256),
        "max_len": r.int_(t, key, "max_len", 20000, lo=1),
    }


def _traffic(r: _Reader, key: str, v: Any) -> Traffic:
    if not isinstance(v, dict):
        raise r.err(key, 'expected a table {corpus = "unicode", rate = 10, ...}')
    r.keys(v, key, LOAD_KEYS | {"ok_status", "max_bad"})
    fields = _load_fields(r, v, key)
    ok = v.get("ok_status", [200, 499])
    if (
        not isinstance(ok, list)
        or len(ok) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in ok)
        or not 100 <= ok[0] <= ok[1] <= 599
    ):
        raise r.err(f"{key}.ok_status", f"{ok!r}: give a status range such as [200, 499]")
    bad = v.get("max_bad", 0)
    if isinstance(bad, str) and bad.strip().endswith("%"):
        try:
            bad = float(bad.strip()[:-1]) / 100
        except ValueError:
            pass
    if isinstance(bad, bool) or not isinstance(bad, (int, float)) or not 0 <= bad < 1:
        raise r.err(f"{key}.max_bad", f'{v.get("max_bad")!r}: give a share such as "1%" or 0')
    return Traffic(**fields, ok_status=(ok[0], ok[1]), max_bad=float(bad))


def _probe(r: _Reader, key: str, v: Any) -> Probe:
    """The probe, parsed once, here: the probe package owns its keys and
    checks them with stand-ins for the target's facts."""
    if not isinstance(v, dict):
        raise r.err(key, 'expected a table (kind = "http" | "prometheus" | ...)')
    try:
        return probe_from_toml(key.rsplit(".", 1)[-1], v, f"{r.where}: {key}")
    except ProbeError as e:
        msg = str(e)
        raise ExperimentError(msg if r.where in msg else f"{r.where}: {key}: {msg}") from None


def _probes(r: _Reader, doc: dict[str, Any]) -> tuple[dict[str, Probe], dict[str, str]]:
    probes: dict[str, Probe] = {}
    where: dict[str, str] = {}
    modes = r.modes
    ss_doc = doc.get("steady_state")
    ss: dict[str, Any] = ss_doc if isinstance(ss_doc, dict) else {}
    for section, tables in (
        ("steady_state.probes", ss.get("probes") or {}),
        ("probes", doc.get("probes") or {}),
    ):
        if not isinstance(tables, dict):
            raise r.err(section, "expected tables [" + section + ".NAME]")
        for name, v in tables.items():
            key = f"{section}.{name}"
            if name in probes:
                raise r.err(key, f"a probe {name!r} exists already ({where[name]}): rename one")
            probes[name] = _probe(r, key, v)
            modes[name] = str(probes[name].mode)
            where[name] = key
    return probes, where


def _steady(
    r: _Reader, doc: dict[str, Any], probes: dict[str, Any], where: dict[str, str]
) -> SteadyState:
    t = r.table(
        doc,
        "steady_state",
        {"p50", "p95", "p99", "error_rate", "min_throughput", "judge", "probes", "quorum"},
    )
    b: dict[str, Tolerance | None] = {}
    for k, unit in (
        ("p50", "duration"),
        ("p95", "duration"),
        ("p99", "duration"),
        ("error_rate", "share"),
        ("min_throughput", "number"),
    ):
        b[k] = parse_bound(t[k], r, f"steady_state.{k}", unit) if k in t else None
    judge = None
    if "judge" in t:
        j = t["judge"]
        if j is True:
            j = {}
        if not isinstance(j, dict):
            want = "expected true or a table {alpha, min_effect, min_tail_effect}"
            raise r.err("steady_state.judge", want)
        r.keys(j, "steady_state.judge", {"alpha", "min_effect", "min_tail_effect"})
        alpha = r.num(j, "steady_state.judge", "alpha", 0.01)
        if not 0 < alpha < 1:
            raise r.err("steady_state.judge.alpha", f"{alpha:g}: give 0 < alpha < 1")
        judge = Judge(
            alpha=alpha,
            min_effect=r.num(j, "steady_state.judge", "min_effect", 0.2),
            min_tail_effect=r.num(j, "steady_state.judge", "min_tail_effect", 0.05),
        )
    hyp = [n for n, w in where.items() if w.startswith("steady_state.")]
    quorum = 0.8
    if "quorum" in t:
        q = t["quorum"]
        if isinstance(q, str) and q.strip().endswith("%"):
            try:
                q = float(q.strip()[:-1]) / 100
            except ValueError:
                pass
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
            raise r.err(
                "steady_state.quorum",
                f'{t["quorum"]!r}: give a share such as "80%" or 0.8 (0 < quorum <= 1)',
            )
        quorum = float(q)
    return SteadyState(
        p50=b["p50"],
        p95=b["p95"],
        p99=b["p99"],
        error_rate=b["error_rate"],
        min_throughput=b["min_throughput"],
        judge=judge,
        probes=hyp,
        quorum=quorum,
    )


def _pressure(r: _Reader, key: str, v: Any) -> dict[str, Any]:
    """A pressure step's table: what pyctl/hooks/vram_pressure.py takes."""
    if not isinstance(v, dict):
        raise r.err(key, 'expected {share = 0.9, device = 0, allocator = "auto"}')
    r.keys(v, key, {"share", "device", "allocator", "reserve_mib", "fill"})
    share = r.num(v, key, "share", what="the share of free memory (0.9)")
    if not 0 < share <= 1:
        raise r.err(f"{key}.share", f"{share:g}: the share of FREE memory, 0 < share <= 1")
    allocator = r.str_(v, key, "allocator", "auto")
    if allocator not in ("auto", "cupy", "torch", "host-double"):
        raise r.err(f"{key}.allocator", f"{allocator!r}: use auto, cupy or torch")
    return {
        "share": share,
        "device": r.int_(v, key, "device", 0),
        "allocator": allocator,
        "reserve_mib": r.int_(v, key, "reserve_mib", 0),
        "fill": r.bool_(v, key, "fill", False),
    }


def _perturb(r: _Reader, key: str, v: Any) -> dict[str, Any]:
    """A perturb step's table: rules checked here with the hooks' own
    parser, so a bad bit name is refused before anything starts."""
    from pyctl.hooks.bitflip import BitSpecError
    from pyctl.hooks.tc_perturb import parse_rule

    if not isinstance(v, dict):
        raise r.err(key, 'expected {rules = ["PATTERN@BITS@RATE[@DTYPE]", ...], seed = 0}')
    r.keys(v, key, {"rules", "seed", "url"})
    rules = v.get("rules")
    if not isinstance(rules, list) or not rules or not all(isinstance(x, str) for x in rules):
        raise r.err(
            f"{key}.rules", 'a list of PATTERN@BITS@RATE[@DTYPE], e.g. ["blocks.*@sign@1e-3"]'
        )
    for x in rules:
        try:
            parse_rule(x)
        except BitSpecError as e:
            raise r.err(f"{key}.rules", str(e)) from None
    seed = r.int_(v, key, "seed", 0)
    url = r.str_(v, key, "url", "{url}/admin/perturb")
    return {"rules": list(rules), "seed": seed, "url": url}


def _method(r: _Reader, doc: dict[str, Any], values: dict[str, Any]) -> list[Step]:
    raw = doc.get("method", [])
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise r.err("method", "expected [[method]] tables (one per fault step)")
    steps: list[Step] = []
    prev_start, prev_end = 0.0, 0.0
    for i, m in enumerate(raw):
        key = f"method[{i + 1}]"
        r.keys(
            m,
            key,
            {
                "name",
                "template",
                "set",
                "fault",
                "traffic",
                "perturb",
                "pressure",
                "start",
                "duration",
                "parallel",
                "thread",
                "pid",
                "tid",
                "arm_timeout",
            },
        )
        if sum(k in m for k in ("template", "fault", "traffic", "perturb", "pressure")) != 1:
            raise r.err(
                key,
                'give exactly one of template = "NAME", fault = {lib=..., ...}, '
                'traffic = {corpus = "...", rate = ...}, perturb = {rules = [...]} '
                "or pressure = {share = 0.9}",
            )
        duration = r.duration(m, key, "duration")
        parallel = r.bool_(m, key, "parallel", False)
        if "start" in m:
            start = r.duration(m, key, "start", allow_zero=True)
        else:
            start = prev_start if parallel else prev_end
        thread = r.str_(m, key, "thread", "") or None
        pid, tid = _who(r, m, key, "pid"), _who(r, m, key, "tid")
        if tid is not None and thread is not None:
            raise r.err(f"{key}.tid", "tid and thread both name the thread: keep one")
        arm_timeout = r.duration(m, key, "arm_timeout") if "arm_timeout" in m else None
        sets: dict[str, str] = {}
        fault = None
        template = None
        if "traffic" in m:
            for k in ("thread", "pid", "tid", "arm_timeout"):
                if k in m:
                    raise r.err(f"{key}.{k}", "a traffic step sends requests: remove it")
            traffic = _traffic(r, f"{key}.traffic", m["traffic"])
            steps.append(
                Step(
                    idx=i,
                    name=r.str_(m, key, "name", f"traffic {traffic.corpus}"),
                    template=None,
                    sets={},
                    fault=None,
                    start=start,
                    duration=duration,
                    thread=None,
                    traffic=traffic,
                )
            )
            prev_start, prev_end = start, start + duration
            continue
        # Steps that are not BPF faults: no thread or process to aim at.
        side = next((k for k in ("pressure", "perturb") if k in m), None)
        if side is not None:
            why = {
                "pressure": "a pressure step is a process of its own: remove it",
                "perturb": "a perturb step is armed by the service: remove it",
            }[side]
            # A pressure step waits for its child to hold: it may have arm_timeout.
            banned = ("thread", "pid", "tid", "set") + (
                ("arm_timeout",) if side == "perturb" else ()
            )
            for k in banned:
                if k in m:
                    raise r.err(f"{key}.{k}", why)
            table = (_pressure if side == "pressure" else _perturb)(r, f"{key}.{side}", m[side])
            default_name = (
                f"vram pressure {table['share']:g}"
                if side == "pressure"
                else "perturb " + " ".join(table["rules"])
            )
            steps.append(
                Step(
                    idx=i,
                    name=r.str_(m, key, "name", default_name),
                    template=None,
                    sets={},
                    fault=None,
                    start=start,
                    duration=duration,
                    thread=None,
                    arm_timeout=arm_timeout,
                    pressure=table if side == "pressure" else None,
                    perturb=table if side == "perturb" else None,
                )
            )
            prev_start, prev_end = start, start + duration
            continue
        if "template" in m:
            tname = r.str_(m, key, "template")
            s = m.get("set", {})
            if not isinstance(s, dict):
                raise r.err(f"{key}.set", "expected a table {knob = value, ...}")
            sets = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in s.items()}
            try:
                tpl = T.get(tname)
                specs = tpl.specs(sets)
            except T.TemplateError as e:
                raise r.err(f"{key}.template", f"{e}") from None
            template = tpl.ident
        else:
            if "set" in m:
                raise r.err(f"{key}.set", "set is for template steps: put the values in fault")
            f = m["fault"]
            if not isinstance(f, dict):
                raise r.err(f"{key}.fault", "expected a table {lib=..., fn=..., action=...}")
            for k in f:
                if k not in T.FAULT_FIELDS:
                    fields = ", ".join(sorted(T.FAULT_FIELDS))
                    raise r.err(
                        f"{key}.fault.{k}",
                        f"unknown field: use the [[fault]] fields of a template ({fields})",
                    )
            if f.get("entry_only"):
                raise r.err(f"{key}.fault.entry_only", "not for an injected fault: remove it")
            try:
                specs = [T.build_spec(dict(f))]
            except (SpecError, ValueError, KeyError) as e:
                raise r.err(f"{key}.fault", f"{e}") from None
            fault = dict(f)
        name = r.str_(
            m,
            key,
            "name",
            template.split("@")[0] if template else f"{specs[0].action} {specs[0].fn_text}",
        )
        steps.append(
            Step(
                idx=i,
                name=name,
                template=template,
                sets=sets,
                fault=fault,
                start=start,
                duration=duration,
                thread=thread,
                specs=specs,
                pid=pid,
                tid=tid,
                arm_timeout=arm_timeout,
            )
        )
        prev_start, prev_end = start, start + duration
    return steps


def _who(r: _Reader, m: dict[str, Any], key: str, name: str) -> str | None:
    """A step's pid or tid: a number, or one fact naming a process or thread
    ("{rank1_pid}", "{worker_tid}"), filled in when the target runs."""
    if name not in m:
        return None
    v = m[name]
    k = f"{key}.{name}"
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise r.err(k, f"{v} is not a process id: give one >= 1")
        return str(v)
    if isinstance(v, str):
        ph = PLACEHOLDER.fullmatch(v.strip())
        if ph and PID_FACTS.fullmatch(ph.group(1)):
            return v.strip()
        if v.strip().isdigit() and int(v) >= 1:
            return v.strip()
    raise r.err(
        k,
        f'{v!r}: give a number or one fact such as "{{rank1_pid}}" '
        '("{pid}", "{worker_tid}", "{rankN_pid}", "{rankN_tid}")',
    )


def _known_probe(
    r: _Reader, key: str, name: Any, probes: dict[str, Any], sampled: bool = True
) -> str:
    """A probe name that exists; sampled: it must be sampled while faults
    run (continuous or onchaos), else the check could never see anything."""
    if not isinstance(name, str):
        raise r.err(key, f"expected a probe name, got {_kind(name)}")
    if name not in probes:
        raise r.err(
            key,
            f"no probe {name!r}: define [probes.{name}] (probes: {', '.join(probes) or 'none'})",
        )
    mode = r.modes.get(name, "continuous")
    if sampled and mode not in ("continuous", "onchaos"):
        raise r.err(
            key,
            f"probe {name!r} has mode {mode!r}, so it is not sampled while the "
            'faults run: give it mode = "continuous" (or "onchaos")',
        )
    return name


def _aborts(r: _Reader, doc: dict[str, Any], probes: dict[str, Any]) -> list[Abort]:
    raw = doc.get("abort", [])
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise r.err("abort", "expected [[abort]] tables {probe, after_failures}")
    out = []
    for i, a in enumerate(raw):
        key = f"abort[{i + 1}]"
        r.keys(a, key, {"probe", "after_failures"})
        out.append(
            Abort(
                probe=_known_probe(r, f"{key}.probe", a.get("probe"), probes),
                after_failures=r.int_(a, key, "after_failures", 1, lo=1),
            )
        )
    return out


def _expect(r: _Reader, doc: dict[str, Any], probes: dict[str, Any], has_load: bool) -> Expect:
    t = r.table(doc, "expect", {"alert_fired", "degradation_worked", "recovered_within", "linked"})
    e = Expect()
    if "linked" in t:
        lk = t["linked"]
        if (
            not isinstance(lk, list)
            or not lk
            or not all(isinstance(x, str) and x in LINKABLE for x in lk)
        ):
            raise r.err(
                "expect.linked",
                f"expected a list of {' / '.join(repr(k) for k in LINKABLE)} "
                '(e.g. linked = ["xid"]: an Xid row must name a fault of this experiment)',
            )
        e.linked = tuple(dict.fromkeys(lk))
    if "alert_fired" in t:
        a = t["alert_fired"]
        if not isinstance(a, dict):
            raise r.err("expect.alert_fired", 'expected {probe = "NAME", within = "5s"}')
        r.keys(a, "expect.alert_fired", {"probe", "within"})
        e.alert_probe = _known_probe(r, "expect.alert_fired.probe", a.get("probe"), probes)
        e.alert_within = r.duration(a, "expect.alert_fired", "within")
    if "degradation_worked" in t:
        d = t["degradation_worked"]
        if isinstance(d, dict):
            r.keys(d, "expect.degradation_worked", {"probe"})
            d = d.get("probe")
        e.degradation_probe = _known_probe(r, "expect.degradation_worked", d, probes)
    if "recovered_within" in t:
        rw = t["recovered_within"]
        if isinstance(rw, dict):
            r.keys(rw, "expect.recovered_within", {"within", "probe", "hold"})
            e.recovered_within = r.duration(
                rw, "expect.recovered_within", "within", allow_zero=True
            )
            if "probe" in rw:
                e.recovery_probe = _known_probe(
                    r, "expect.recovered_within.probe", rw["probe"], probes
                )
            e.recovery_hold = r.duration(rw, "expect.recovered_within", "hold", "3s")
        else:
            e.recovered_within = r.duration(t, "expect", "recovered_within", allow_zero=True)
        if e.recovery_probe is None and not has_load:
            raise r.err(
                "expect.recovered_within",
                'needs [load] or a probe: add {within = "10s", probe = "NAME"}',
            )
    return e


def _rollbacks(r: _Reader, doc: dict[str, Any]) -> list[Rollback]:
    raw = doc.get("rollback", [])
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise r.err("rollback", "expected [[rollback]] tables {command, timeout}")
    out = []
    for i, rb in enumerate(raw):
        key = f"rollback[{i + 1}]"
        r.keys(rb, key, {"name", "command", "timeout"})
        cmd = r.command(rb, key, "command")
        out.append(
            Rollback(
                name=r.str_(rb, key, "name", cmd[0]),
                command=cmd,
                timeout=r.duration(rb, key, "timeout", "30s"),
            )
        )
    return out


def _remediation(r: _Reader, doc: dict[str, Any]) -> Remediation | None:
    if "remediation" not in doc:
        return None
    t = r.table(doc, "remediation", {"command", "on", "timeout"})
    on = r.str_(t, "remediation", "on", "breach")
    if on != "breach":
        raise r.err("remediation.on", f'{on!r}: the only trigger is "breach"')
    return Remediation(
        command=r.command(t, "remediation", "command"),
        on=on,
        timeout=r.duration(t, "remediation", "timeout", "30s"),
    )


__all__ = [
    "Experiment",
    "ExperimentError",
    "Step",
    "Load",
    "Traffic",
    "load",
    "load_file",
    "find",
    "all_names",
    "search_dirs",
    "TARGET_FACTS",
]
