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
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from pyctl import templates as T
from pyctl.experiment.agents import parse_agents
from pyctl.experiment.burn import parse_slos
from pyctl.experiment.facts import TARGET_FACTS, is_fact, placeholders, render
from pyctl.experiment.method import parse_method
from pyctl.experiment.model import (
    JUDGE_ALPHA,
    JUDGE_METHODS,
    LINKABLE,
    LOAD_TERMS,
    Abort,
    Expect,
    Experiment,
    ExperimentError,
    GoodBounds,
    Judge,
    Load,
    Remediation,
    Rollback,
    SteadyState,
)
from pyctl.experiment.probes import Probe, ProbeError, Tolerance, probe_from_toml
from pyctl.experiment.quality import parse_quality
from pyctl.experiment.reader import (
    LOAD_KEYS,
    Reader,
    kind_name,
    load_fields,
    parse_bound,
    redact_headers,
)
from pyctl.experiment.target import parse_target

AA_MIN_BASELINE = 8.0  # judge.control: 8 windows, 70 ways to split them in halves
SHIPPED = Path(__file__).resolve().parent.parent / "experiments"
ENV_DIRS = "GPUFAULT_EXPERIMENTS"

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
    "agents",
    "quality",
    "slo",
}


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


def load(
    name_or_file: str, sets: dict[str, str] | None = None, target: dict[str, Any] | None = None
) -> Experiment:
    """target: a [target] table that replaces the file's (`experiment run
    --url/--pid/--command`); the file's `requires` stays."""
    path = find(name_or_file)
    exp = load_file(path, sets, target)
    if "@v" in name_or_file and "/" not in name_or_file:
        want = name_or_file.split("@v", 1)[1]
        if str(exp.version) != want:
            raise ExperimentError(
                f"{path}: version: is {exp.version}, not {want}: "
                f"drop @v{want} or use the file of that version"
            )
    return exp


def load_file(
    path: Path, sets: dict[str, str] | None = None, target: dict[str, Any] | None = None
) -> Experiment:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise ExperimentError(f"{path}: cannot read it ({e.strerror}): check the path") from None
    except tomllib.TOMLDecodeError as e:
        raise ExperimentError(f"{path}: not valid TOML ({e}): fix the syntax") from None
    r = Reader(str(path), base=path.parent)
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
    if target is not None:
        raw = rendered.get("target")
        own: dict[str, Any] = raw if isinstance(raw, dict) else {}
        needs = list(own.get("requires") or [])
        svc = own.get("service")
        if isinstance(svc, dict) and str(svc.get("device", "cpu")).startswith("cuda"):
            needs.append("gpu")  # the file's service ran on a GPU: its faults need one
        rendered["target"] = {**target, **({"requires": needs} if needs else {})}
    tr = Reader(f"{path} (its target from --url/--pid/--command)") if target is not None else r
    parsed_target = parse_target(tr, rendered)
    load_ = _load(r, rendered)
    probes, probe_where = _probes(r, rendered)
    steady = _steady(r, rendered, probes, probe_where)
    if load_ is None and steady.any_load_bound():
        raise r.err("steady_state", "latency or error hypotheses need a [load] table: add one")
    streamed = {n for n, _u, st in LOAD_TERMS if st}
    needs_stream = [n for n, _a, _b in steady.terms() if n in streamed]
    if steady.good is not None and (steady.good.ttft or steady.good.itl or steady.good.tpot):
        needs_stream.append("goodput")
    if load_ is not None and not load_.stream and needs_stream:
        raise r.err(
            f"steady_state.{needs_stream[0]}",
            "token timings need a streamed load: add stream = true to [load]",
        )
    slos = parse_slos(r, rendered)
    if slos and load_ is None:
        raise r.err("slo", "burn-rate SLOs count the load's requests: add a [load] table")
    if load_ is not None and not load_.stream:
        for i, so in enumerate(slos):
            if so.streamed():
                raise r.err(
                    f"slo[{i}].good",
                    "token timings need a streamed load: add stream = true to [load]",
                )
    steps = parse_method(r, rendered)
    agents = parse_agents(r, rendered, path.parent)
    _check_agent_steps(r, steps, agents)
    phases = r.table(rendered, "phases", {"warmup", "baseline", "method", "recovery"})
    # 3 s, not 1: after a 1 s warm-up the reference service's 1 s p50s were
    # still 4.1, 7.5, 4.3, 4.2 ms in the baseline against 3.2-3.4 ms in the
    # method (control; over-limit-prompts 24, 34, 15, 12 against 8 ms), a
    # drift the judge's tail statistic took for a fault (bench_judge_aa.py).
    warmup = r.duration(phases, "phases", "warmup", "3s", allow_zero=True)
    baseline = r.duration(phases, "phases", "baseline", "5s")
    if load_ is None and steady.judge is not None and not steady.judge.explicit:
        steady.judge = None  # the default judge judges a load: none here
    if steady.judge is not None and steady.judge.control and baseline < AA_MIN_BASELINE:
        raise r.err(
            "steady_state.judge.control",
            f"the A/A control splits the baseline's 1 s windows: give a baseline of at "
            f"least {AA_MIN_BASELINE:g}s (it is {baseline:g}s), so that its halves are "
            "4 windows or more",
        )
    steps_end = max((s.start + s.duration for s in steps), default=0.0)
    method_window = r.duration(phases, "phases", "method", steps_end or "5s")
    if method_window < steps_end:
        raise r.err(
            "phases.method",
            f"{method_window:g}s is shorter than the steps "
            f"({steps_end:g}s): lengthen it or drop it",
        )
    aborts = _aborts(r, rendered, probes)
    expect = _expect(r, rendered, probes, load_ is not None, parsed_target.device)
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
    quality = parse_quality(r, rendered, load_)

    if steady.judge is not None and steady.judge.method == "blocks":
        _check_judge(r, steady.judge, baseline, method_window, recovery, expect.recovery_hold)
    expanded = redact_headers(rendered)  # a literal token is not stored
    expanded["knobs"] = values
    # The judge as it runs, its alpha included, in the stored file (issue
    # 23: "on by default, with its alpha in the file"); false when off.
    judged = steady.judge.settings() if steady.judge is not None else False
    expanded["steady_state"] = {**(expanded.get("steady_state") or {}), "judge": judged}
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
        target=parsed_target,
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
        agents=agents,
        quality=quality,
        slos=slos,
    )


def _check_agent_steps(r: Reader, steps: list[Any], agents: dict[str, Any]) -> None:
    for s in steps:
        if s.agent is None and s.agent_select is None:
            continue
        key = f"method[{s.idx + 1}].agent"
        if s.agent_select is not None and not agents:
            raise r.err(key, "a selector chooses among the file's [agents.NAME]: add them")
        if s.agent is not None and s.agent not in agents:
            have = ", ".join(sorted(agents)) or "none"
            raise r.err(key, f"{s.agent!r} is not one of the file's [agents.NAME] ({have}): "
                             "add the table or fix the name")  # fmt: skip
        if s.kind != "fault":
            raise r.err(key, f"a {s.kind} step runs here: agent is for fault steps")
        if s.pid is None and s.tid is None:
            raise r.err(key, 'an agent step names its process on that node: pid = N or '
                             'pid = "{rank1_pid}" (or tid)')  # fmt: skip
        if s.thread is not None:
            raise r.err(key, "thread is resolved on this machine: give the thread's tid instead")


def _load(r: Reader, doc: dict[str, Any]) -> Load | None:
    if "load" not in doc:
        return None
    t = r.table(doc, "load", LOAD_KEYS)
    return Load(**load_fields(r, t, "load"))


def _probe(r: Reader, key: str, v: Any) -> Probe:
    """The probe, parsed once, here: the probe package owns its keys and
    checks them with stand-ins for the target's facts."""
    if not isinstance(v, dict):
        raise r.err(key, 'expected a table (kind = "http" | "prometheus" | ...)')
    try:
        return probe_from_toml(key.rsplit(".", 1)[-1], v, f"{r.where}: {key}")
    except ProbeError as e:
        msg = str(e)
        raise ExperimentError(msg if r.where in msg else f"{r.where}: {key}: {msg}") from None


def _probes(r: Reader, doc: dict[str, Any]) -> tuple[dict[str, Probe], dict[str, str]]:
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
    r: Reader, doc: dict[str, Any], probes: dict[str, Any], where: dict[str, str]
) -> SteadyState:
    t = r.table(
        doc,
        "steady_state",
        {n for n, _u, _s in LOAD_TERMS} | {"judge", "probes", "quorum"},
    )
    b: dict[str, Tolerance | None] = {}
    good = None
    for k, unit, _streamed in LOAD_TERMS:
        v = t.get(k)
        if k == "goodput" and isinstance(v, dict):
            v, good = _goodput(r, v)
        elif k == "goodput" and v is not None:
            raise r.err(
                "steady_state.goodput",
                'expected a table { share = ">= 90%", ttft = "<= 200ms", itl = "<= 50ms", '
                'tpot = "<= 20ms", e2e = "<= 1s" } (the share of requests meeting every bound)',
            )
        b[k] = parse_bound(v, r, f"steady_state.{k}", unit) if v is not None else None
    judge = _judge(r, t)
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
        judge=judge,
        probes=hyp,
        quorum=quorum,
        good=good,
        **b,  # type: ignore[arg-type]
    )


JUDGE_KEYS = {"alpha", "method", "min_ratio", "min_effect", "min_tail_effect", "control"}
REQUEST_KEYS = ("min_effect", "min_tail_effect", "control")  # method = "requests" only


def _judge(r: Reader, t: dict[str, Any]) -> Judge | None:
    """steady_state.judge: absent or true, the default judge (alpha 0.01,
    1 s blocks); false, none; a table, its settings (docs/experiments.md,
    "Statistics")."""
    key = "steady_state.judge"
    if "judge" not in t:
        return Judge(explicit=False)
    j = t["judge"]
    if j is False:
        return None
    if j is True:
        j = {}
    if not isinstance(j, dict):
        raise r.err(
            key,
            f"{j!r}: give false (no judge), true (the default) or a table "
            "{ alpha = 0.01, min_ratio = 1.1 }",
        )
    r.keys(j, key, JUDGE_KEYS)
    alpha = r.num(j, key, "alpha", JUDGE_ALPHA)
    if not 0 < alpha < 1:
        raise r.err(f"{key}.alpha", f"{alpha:g}: give 0 < alpha < 1")
    method = r.str_(j, key, "method", "blocks")
    if method not in JUDGE_METHODS:
        raise r.err(
            f"{key}.method",
            f'{method!r}: give "blocks" (the default: 1 s blocks) or "requests" '
            "(every request a draw)",
        )
    if method == "blocks":
        for k in REQUEST_KEYS:
            if k in j:
                raise r.err(
                    f"{key}.{k}",
                    "the default judge compares 1 s blocks, not requests (issue 23), and "
                    "its minimum effect is min_ratio (default 1.1: the fault window's blocks "
                    '10% worse): drop it, or give method = "requests" for the per-request '
                    "judge",
                )
    elif "min_ratio" in j:
        raise r.err(
            f"{key}.min_ratio",
            'the per-request judge (method = "requests") has min_effect and '
            "min_tail_effect instead: drop it",
        )
    min_ratio = r.num(j, key, "min_ratio", 1.1)
    if not min_ratio >= 1:
        raise r.err(f"{key}.min_ratio", f"{min_ratio:g}: give a ratio >= 1 (1.1: 10% worse)")
    return Judge(
        alpha=alpha,
        method=method,
        min_ratio=min_ratio,
        min_effect=r.num(j, key, "min_effect", 0.2),
        min_tail_effect=r.num(j, key, "min_tail_effect", 0.05),
        control=r.bool_(j, key, "control", False),
    )


def _check_judge(
    r: Reader, judge: Judge, baseline: float, window: float, recovery: float, hold: float
) -> None:
    """A block judge that can never say worse (its smallest p, 1 / C(n,
    k) of the blocks it will have, is not under alpha / 2): refused when
    the file asks for it; the default judge says so in `blind` (show,
    validate and its judgement row), since a file too short for it may
    still be judged by its per-window hypotheses."""
    # lazy: pyctl.experiment.blockjudge (+1 module) only for a file with a load
    from pyctl.experiment import blockjudge as BJ

    ref = baseline + (hold if BJ.after_counts(recovery, hold) else 0.0)
    nr, nw = int(ref / BJ.WIDTH + 1e-9), int(window / BJ.WIDTH + 1e-9)
    if BJ.enough_blocks(nr, nw, judge.alpha):
        return
    extra = nr - int(baseline)
    need = next(
        (b for b in range(int(baseline) + 1, 3600) if BJ.enough_blocks(extra + b, nw, judge.alpha)),
        None,
    )
    what = (
        f"{nr} reference and {nw} fault-window blocks of 1 s: the block judge's p cannot go "
        f"below {BJ.smallest_p(nr, nw):.2g}, never under alpha/2 = {judge.alpha / 2:g}"
    )
    fix = f"give a baseline of at least {need}s" if need else "lengthen the method"
    if judge.explicit:
        raise r.err("steady_state.judge", f"{what}: {fix}, or judge = false")
    judge.blind = f"{what} ({fix} for a judge that can)"


GOOD_KEYS = {"share", "ttft", "itl", "tpot", "e2e"}


def _goodput(r: Reader, t: dict[str, Any]) -> tuple[Any, GoodBounds]:
    """steady_state.goodput: the share bound and what a good request is."""
    k = "steady_state.goodput"
    r.keys(t, k, GOOD_KEYS)
    if "share" not in t:
        raise r.err(f"{k}.share", 'missing: give the share of good requests, e.g. ">= 90%"')
    per = {
        n: parse_bound(t[n], r, f"{k}.{n}", "duration") if n in t else None
        for n in ("ttft", "itl", "tpot", "e2e")
    }
    if not any(per.values()):
        raise r.err(k, "give at least one per-request bound: ttft, itl, tpot or e2e")
    return t["share"], GoodBounds(**per)


def _known_probe(
    r: Reader, key: str, name: Any, probes: dict[str, Any], sampled: bool = True
) -> str:
    """A probe name that exists; sampled: it must be sampled while faults
    run (continuous or onchaos), else the check could never see anything."""
    if not isinstance(name, str):
        raise r.err(key, f"expected a probe name, got {kind_name(name)}")
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


def _aborts(r: Reader, doc: dict[str, Any], probes: dict[str, Any]) -> list[Abort]:
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


VERDICT_WORDS = ("pass", "fail", "error", "aborted")


def _expected_verdict(r: Reader, t: dict[str, Any], device: str | None) -> str:
    """[expect] verdict: a word, or a table by the service's device with
    an optional "default" (a leak that fails on the CPU double passes on
    141 GB: verdict = { cpu-double = "fail", default = "pass" })."""
    v = t.get("verdict", "pass")
    how = (
        f"expected one of {' / '.join(repr(w) for w in VERDICT_WORDS)}, or a table by "
        'device (verdict = { cpu-double = "fail", default = "pass" })'
    )
    if isinstance(v, dict):
        if not v or not all(isinstance(k, str) and x in VERDICT_WORDS for k, x in v.items()):
            raise r.err("expect.verdict", how)
        v = v.get(device or "", v.get("default", "pass"))
    if v not in VERDICT_WORDS:
        raise r.err("expect.verdict", how)
    return str(v)


def _expect(
    r: Reader,
    doc: dict[str, Any],
    probes: dict[str, Any],
    has_load: bool,
    device: str | None = None,
) -> Expect:
    t = r.table(
        doc,
        "expect",
        {
            "alert_fired", "degradation_worked", "recovered_within", "linked", "verdict",
            "target_may_die",
        },
    )  # fmt: skip
    e = Expect()
    e.verdict = _expected_verdict(r, t, device)
    e.target_may_die = r.bool_(t, "expect", "target_may_die", False)
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


def _rollbacks(r: Reader, doc: dict[str, Any]) -> list[Rollback]:
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


def _remediation(r: Reader, doc: dict[str, Any]) -> Remediation | None:
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
    "ALIASES",
    "ENV_DIRS",
    "SHIPPED",
    "all_names",
    "find",
    "load",
    "load_file",
    "search_dirs",
]
