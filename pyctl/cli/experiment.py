"""`gpufault experiment list|show|validate|run|results`: chaos experiments
with SLO verdicts (docs/experiments.md).

Exit status of `run`: 0 pass, 1 fail, 2 error or bad input (one line, nothing
armed), 3 aborted (a guard probe, Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Any

import click

from pyctl.api.errors import BadInput
from pyctl.api.reading import open_readonly
from pyctl.api.values import DEFAULT_DB
from pyctl.cli.base import UserError
from pyctl.cli.options import Duration, db_option, metrics_addr_option, set_option
from pyctl.cli.report import report
from pyctl.experiment import corpora
from pyctl.experiment import load as F
from pyctl.experiment import model as M
from pyctl.experiment.verdict import expectation_words


def _user_error(msg: str) -> click.ClickException:
    return UserError(msg)


def _load(name: str, sets: dict[str, str], target: dict[str, Any] | None = None) -> M.Experiment:
    try:
        return F.load(name, sets, target)
    except M.ExperimentError as e:
        raise _user_error(str(e)) from None


def _target_table(
    url: str | None, pid: int | None, command: str | None, ready: str | None
) -> dict[str, Any] | None:
    """--url/--pid/--command/--ready as the [target] table they replace
    (None: the file's own)."""
    if pid is None and command is None:
        if url or ready:
            raise _user_error("--url and --ready go with --pid PID or --command CMD: add one")
        return None
    if pid is not None and command is not None:
        raise _user_error("--pid and --command both name the process: keep one")
    t: dict[str, Any] = {}
    if url:
        t["url"] = url
    if pid is not None:
        t["pid"] = pid
    if command is not None:
        try:
            t["command"] = shlex.split(command)
        except ValueError as e:
            raise _user_error(f"--command: {e}: quote it as a shell would") from None
    if ready is not None:
        t["ready"] = ready
    return t


def target_options(fn: Any) -> Any:
    """Point a file at another server: its url, and its pid or the command
    that starts it (the file's [target] is replaced)."""
    for opt in reversed((
        click.option("--url", metavar="URL",
                     help="the server's base URL (with --pid or --command)"),
        click.option("--pid", type=int, metavar="PID",
                     help="inject into this running server instead of the file's target"),
        click.option("--command", metavar="CMD",
                     help="start this server instead of the file's target (one shell-quoted "
                     "string; {ready_file} is a private path)"),
        click.option("--ready", metavar="REGEX",
                     help="with --command: the stderr line that says it is up (a (?P<url>...) "
                     "group gives the url)"),
    )):  # fmt: skip
        fn = opt(fn)
    return fn


@click.group("experiment")
def experiment() -> None:
    """Chaos experiments: faults against a live service, with an SLO verdict.

    \b
    Examples:
      gpufault experiment list
      gpufault experiment show tokenizer-stall --set stall=80ms
      gpufault experiment run control --db /tmp/exp.db
      gpufault experiment results x1a2b3c4d --db /tmp/exp.db
    """


@experiment.command("list")
def list_() -> None:
    """List experiments: name, version, title (GPUFAULT_EXPERIMENTS dirs first).

    \b
    Example:
      gpufault experiment list
    """
    for name, path in sorted(F.all_names().items()):
        try:
            e = F.load_file(path)
            also = [a for a, n in F.ALIASES.items() if n == name]
            alias = f"  (also: {', '.join(also)})" if also else ""
            click.echo(f"{name:24} v{e.version:<3} {len(e.steps)} step(s)  {e.title}{alias}")
        except M.ExperimentError as err:
            click.echo(f"{name:24} INVALID  {err}")


def describe(e: M.Experiment) -> list[str]:
    """The file's meaning in words."""
    out = [f"{e.ident}  {e.path}", e.title]
    if e.description:
        out += ["", e.description]
    if e.slo_id:
        out.append(f"\nSLO: {e.slo_id}")
    if e.knobs:
        out.append("\nknobs (--set KNOB=VALUE):")
        for k in e.knobs.values():
            mark = "" if e.values[k.name] == k.default else f"  (default {k.default!r})"
            out.append(f"  {k.name:16} {e.values[k.name]!r:16} {k.help}{mark}")
    t = e.target
    if t.command[:4] == [M.GPUFAULT, "service", "--port", "0"] and t.ready == M.SERVICE_READY:
        # The service shortcut's command (target.service = {device, args}).
        who = f"starts `gpufault service {' '.join(t.command[4:])}`"
    elif t.command:
        who = f"starts `{' '.join(t.command)}` (ready: /{t.ready}/)"
    else:
        who = f"pid {t.pid}"
    out.append(f"\ntarget: {who}" + (f", url {t.url}" if t.url else ""))
    if e.load is not None:
        L = e.load
        where = L.url or L.path
        extra = "".join(
            [
                ", streamed" if L.stream else "",
                ", body template" if L.body is not None else "",
                f", headers {', '.join(f'{k}: {_shown(k, v)}' for k, v in L.headers.items())}"
                if L.headers
                else "",
            ]
        )
        out.append(
            f"load: {L.plan().describe()}, {L.method} {where} {corpora.describe(L)} "
            f"max_tokens {L.max_tokens}, timeout {L.timeout:g}s{extra}"
        )
    st = e.steady
    hyp = [f"{attr} {b}" for _n, attr, b in st.terms()]
    if st.good is not None:
        hyp.append(f"(a good request: {st.good})")
    out.append(
        f"\nphases: warmup {e.warmup:g}s, baseline {e.baseline:g}s, method "
        f"{e.method_window:g}s, recovery {e.recovery:g}s"
    )
    out.append("steady state (before, during, after):")
    if hyp:
        out.append(
            f"  load: {', '.join(hyp)} in at least {st.quorum:.0%} of each phase's 1 s windows"
        )
    if st.judge is not None:
        out.append(f"  latency of the fault window not worse: {st.judge.describe()}")
    elif e.load is not None:
        out.append("  no judge (judge = false)")
    if e.quality is not None:
        q = e.quality
        what = "BLEU-4 (sacrebleu)" if q.metric == "bleu" else "exact match"
        out.append(
            f"  quality: {len(q.cases)} cases every {q.interval:g}s scored with {what}, "
            f"{q.metric}_drop_pct {q.bound} from the baseline's score"
        )
    for n in st.probes:
        out.append(f"  probe {n}: {_probe_words(e.probes[n].table)}")
    others = [n for n in e.probes if n not in st.probes]
    for n in others:
        out.append(f"probe {n}: {_probe_words(e.probes[n].table)}")
    out.append("\nmethod:" if e.steps else "\nmethod: no fault (a control experiment)")
    for s in e.steps:
        who = f" thread {s.thread}" if s.thread else ""
        who += f" pid {s.pid}" if s.pid else ""
        who += f" tid {s.tid}" if s.tid else ""
        src = (
            f"template {s.template}" + (f" --set {s.sets}" if s.sets else "")
            if s.template
            else "traffic"
            if s.traffic is not None
            else "in-process bit flips, armed by the service"
            if s.perturb is not None
            else "a second process holding GPU memory"
            if s.pressure is not None
            else "inline fault"
        )
        out.append(f"  {s.idx + 1}. at +{s.start:g}s for {s.duration:g}s{who}: {s.name} ({src})")
        if s.traffic is not None:
            tr = s.traffic
            lo, hi = tr.ok_status
            out.append(
                f"       {tr.plan().describe()}, {corpora.describe(tr)} "
                f"(max_tokens {tr.max_tokens}); "
                f"every answer's status in [{lo}, {hi}]"
                + (f" but {tr.max_bad:.0%}" if tr.max_bad else "")
                + " (a 5xx, a dropped connection or a timeout fails the experiment)"
            )
        if s.perturb is not None:
            pt = s.perturb
            out.append(
                f"       POST {pt['url']}: rules {', '.join(pt['rules'])}, seed {pt['seed']} "
                "(the service ends them at the step's end itself)"
            )
        if s.pressure is not None:
            pr = s.pressure
            out.append(
                f"       pyctl/hooks/vram_pressure.py holds {pr['share']:.1%} of GPU "
                f"{pr['device']}'s free memory ({pr['allocator']}"
                + (", fill: refused chunks split, freed memory taken" if pr.get("fill") else "")
                + "); it releases at its own deadline"
            )
        if s.arm_timeout is not None:
            out.append(f"       armed within {s.arm_timeout:g}s")
        for sp in s.specs:
            out.append(f"       {sp.describe()}")
    for a in e.aborts:
        out.append(
            f"abort: when probe {a.probe} fails {a.after_failures} time(s) in a row, "
            "stop every fault at once"
        )
    ex = e.expect
    if ex.alert_probe:
        out.append(
            f"expect alert_fired: probe {ex.alert_probe} ok within "
            f"{ex.alert_within:g}s of the first fire"
        )
    if ex.degradation_probe:
        out.append(
            f"expect degradation_worked: probe {ex.degradation_probe} ok while a fault is active"
        )
    if ex.recovered_within is not None:
        by = f"probe {ex.recovery_probe}" if ex.recovery_probe else "the load hypothesis"
        out.append(
            f"expect recovered_within {ex.recovered_within:g}s: {by} holds for "
            f"{ex.recovery_hold:g}s from then on"
        )
    for what in ex.linked:
        table = M.LINKABLE[what]
        out.append(f"expect linked {what}: a row of {table} names a fault ID of this experiment")
    for rb in e.rollbacks:
        out.append(f"rollback (always): {' '.join(rb.command)}")
    if e.remediation is not None:
        out.append(f"remediation on breach: {' '.join(e.remediation.command)}")
    return out


def _probe_words(t: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in t.items())


@experiment.command()
@click.argument("name")
@set_option("show with these knob values")
def show(name: str, sets: dict[str, str]) -> None:
    """Show what an experiment does, in words, with knob values after --set.

    \b
    Example:
      gpufault experiment show cuda-oom-degrade --set duration=10s
    """
    click.echo("\n".join(describe(_load(name, sets))))


@experiment.command()
@click.argument("name")
@set_option("validate with these knob values")
@click.option(
    "--target",
    "target_pid",
    type=int,
    metavar="PID",
    help="also resolve each fault step's libraries and functions in this process",
)
def validate(name: str, sets: dict[str, str], target_pid: int | None) -> None:
    """Check an experiment file (keys, types, templates, faults, probes).

    With --target PID, every fault step's libraries and functions are
    resolved in that running process, as arming would, and the first one
    it lacks is refused: before a run's baseline, not after it.

    \b
    Examples:
      gpufault experiment validate ./my-experiment.toml
      gpufault experiment validate cuda-oom-degrade --target 4242
    """
    e = _load(name, sets)
    lines = []
    if target_pid is not None:
        # lazy: the fault steps' check (the engine's planner) only with --target
        from pyctl.experiment.steps.fault import check_step

        for s in e.steps:
            if not s.specs:
                continue
            if s.pid or s.tid:
                lines.append(f"  step {s.idx + 1} ({s.name}): in {s.pid or s.tid}, not checked "
                             "(that process is known once the target runs)")  # fmt: skip
                continue
            try:
                lines += [f"  step {s.idx + 1} ({s.name}): {x}" for x in check_step(s, target_pid)]
            except M.ExperimentError as err:
                raise _user_error(f"{e.path}: {err}") from None
    where = f", resolved in pid {target_pid}" if target_pid is not None else ""
    click.echo(f"{e.path}: ok ({e.ident}, {len(e.steps)} step(s), {len(e.probes)} probe(s)"
               f"{where})")  # fmt: skip
    for ln in lines:
        click.echo(ln)


GRAFANA_TOKEN_ENV = "GPUFAULT_GRAFANA_TOKEN"  # never stored, never printed


def export_options(fn: Any) -> Any:
    """Where an experiment's record goes besides the store: OTLP spans and
    Grafana annotations (pyctl/observe/export.py)."""
    for opt in reversed((
        click.option("--otlp-file", type=click.Path(dir_okay=False), default=None,
                     help="write the experiment's spans to this file as OTLP JSON"),
        click.option("--otlp-endpoint", metavar="URL", default=None,
                     help="send the spans to a collector's OTLP/HTTP endpoint "
                          "(http://HOST:4318; /v1/traces is added)"),
        click.option("--grafana-url", metavar="URL", default=None,
                     help="post each step as a Grafana annotation (the token: "
                          "--grafana-token-file or $GPUFAULT_GRAFANA_TOKEN)"),
        click.option("--grafana-token-file", type=click.Path(dir_okay=False), default=None,
                     help="a Grafana service account token (a root-owned 0600 file)"),
        click.option("--annotations-file", type=click.Path(dir_okay=False), default=None,
                     help="write the Grafana annotations to this JSON file"),
    )):  # fmt: skip
        fn = opt(fn)
    return fn


def _export(db_file: str, xid: str, otlp_file: str | None, otlp_endpoint: str | None,
            grafana_url: str | None, grafana_token_file: str | None,
            annotations_file: str | None) -> list[str]:  # fmt: skip
    if not (otlp_file or otlp_endpoint or grafana_url or annotations_file):
        return []
    # lazy: pyctl.observe.export (the OTLP encoder, urllib) only when asked for
    from pyctl.observe import ObserveError
    from pyctl.observe.export import export

    token = os.environ.get(GRAFANA_TOKEN_ENV) or None
    if grafana_token_file:
        # lazy: the agent's token reader (root's, 0600, checked on the fd) only with a token file
        from pyctl.agent.auth import read_token

        try:
            token = read_token(grafana_token_file)
        except BadInput as err:
            raise _user_error(str(err)) from None
    try:
        db = open_readonly(db_file)
    except BadInput as err:
        raise _user_error(str(err)) from None
    try:
        return export(db, xid, otlp_file=otlp_file, otlp_endpoint=otlp_endpoint,
                      grafana_url=grafana_url, grafana_token=token,
                      annotations_file=annotations_file)  # fmt: skip
    except ObserveError as err:
        raise _user_error(str(err)) from None
    finally:
        db.close()


@experiment.command("export")
@click.argument("experiment_id")
@db_option()
@export_options
def export_cmd(experiment_id: str, db_path: str | None, otlp_file: str | None,
               otlp_endpoint: str | None, grafana_url: str | None,
               grafana_token_file: str | None, annotations_file: str | None) -> None:  # fmt: skip
    """Send a recorded experiment to OpenTelemetry and Grafana.

    Its spans (the experiment, each step, each fault) as OTLP JSON to a
    file or over OTLP/HTTP to a collector; its steps as Grafana
    annotations to the API and/or a file. The store is read, not changed.

    \b
    Examples:
      gpufault experiment export x1a2b3c4d --db /tmp/exp.db --otlp-file spans.json
      gpufault experiment export x1a2b3c4d --otlp-endpoint http://otel:4318 \\
          --grafana-url http://grafana:3000 --grafana-token-file /etc/gpufault/grafana.token
    """
    lines = _export(str(db_path or DEFAULT_DB), experiment_id, otlp_file, otlp_endpoint,
                    grafana_url, grafana_token_file, annotations_file)  # fmt: skip
    if not lines:
        raise _user_error("say where it goes: --otlp-file, --otlp-endpoint, --grafana-url "
                          "or --annotations-file")  # fmt: skip
    for ln in lines:
        click.echo(ln)


@experiment.command()
@click.argument("name", required=False)
@click.option(
    "--all",
    "run_all",
    is_flag=True,
    help="run every experiment `list` shows, one after the other; exit 0 unless one "
    "ends other than its file expects",
)
@click.option("--match", metavar="GLOB", help="with --all: only the names matching GLOB")
@set_option("override a knob")
@db_option()
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON at the end")
@metrics_addr_option
@target_options
@export_options
@click.option(
    "--metrics-linger",
    type=Duration(allow_zero=True),
    default="5s",
    show_default=True,
    help="with --metrics-addr: at the end, wait at most this long for one more scrape",
)
def run(
    name: str | None,
    run_all: bool,
    match: str | None,
    sets: dict[str, str],
    db_path: str,
    as_json: bool,
    metrics_addr: str | None,
    metrics_linger: float,
    url: str | None,
    pid: int | None,
    command: str | None,
    ready: str | None,
    otlp_file: str | None,
    otlp_endpoint: str | None,
    grafana_url: str | None,
    grafana_token_file: str | None,
    annotations_file: str | None,
) -> None:
    """Run an experiment: baseline, method, recovery, verdict.

    --pid PID (or --command CMD) with --url URL runs the file against
    another server: every fault step's libraries and functions are
    resolved in it before the baseline starts.

    Exit status: 0 pass, 1 fail, 2 error or bad input, 3 aborted. A file
    that expects another verdict ([expect] verdict = "fail") exits 0 when
    it gets that one. One that needs a GPU the host lacks is refused (exit
    2) before anything starts; with --all it is skipped.

    \b
    Examples:
      gpufault experiment run control --db /tmp/exp.db
      gpufault experiment run tokenizer-stall --set stall=80ms
      gpufault experiment run --all --db /tmp/all.db
      gpufault experiment run cuda-oom-degrade --url http://127.0.0.1:8000 --pid 4242
    """
    # lazy: keeps pyctl.experiment.run (hmac, secrets, +9 modules) off `--help`
    from pyctl.experiment import run as runner

    # lazy: pyctl.experiment.target (socket, subprocess) only when one runs
    from pyctl.experiment.target import missing_on_host

    target = _target_table(url, pid, command, ready)
    if run_all or match:
        if target is not None:
            raise _user_error("--all runs the shipped files against their own targets: "
                              "give one NAME with --url/--pid/--command")  # fmt: skip
        if name or not run_all or metrics_addr or as_json:
            raise _user_error(
                "--all runs every experiment (--match narrows it): give no NAME, "
                "--metrics-addr or --json with it"
            )
        _run_all(match, sets, str(db_path))
        return
    if not name:
        raise _user_error("give an experiment NAME (see `gpufault experiment list`) or --all")
    if grafana_url and not (grafana_token_file or os.environ.get(GRAFANA_TOKEN_ENV)):
        raise _user_error(f"--grafana-url needs --grafana-token-file or ${GRAFANA_TOKEN_ENV} "
                          "(a service account token with annotations:write)")  # fmt: skip
    if grafana_token_file:
        # lazy: the agent's token reader only with a token file; checked before anything runs
        from pyctl.agent.auth import read_token

        try:
            read_token(grafana_token_file)
        except BadInput as err:
            raise _user_error(str(err)) from None
    e = _load(name, sets, target)
    if (why := missing_on_host(e.target)) is not None:
        raise _user_error(f"{e.ident} {why}: run it on a GPU host")
    db = str(db_path)
    echo = (lambda s: click.echo(s, err=True)) if as_json else click.echo
    linger = metrics_linger
    metrics = None
    if metrics_addr:
        # Before anything starts: a port in use is exit 2 with nothing run.
        # lazy: pyctl.observe.metrics (prometheus_client, +32 modules) only for --metrics-addr
        from pyctl.observe import ObserveError
        from pyctl.observe.metrics import Metrics

        try:
            metrics = Metrics.start(metrics_addr, experiment=e.name, slo_id=e.slo_id)
        except ObserveError as err:
            raise _user_error(str(err)) from None
        echo(f"metrics: {metrics.url}")
    try:
        out = runner.run(e, db, echo=echo, metrics=metrics)
    except (M.ExperimentError, BadInput) as err:  # a store that is not gpufault's: BadInput
        raise _user_error(str(err)) from None
    finally:
        if metrics is not None:
            metrics.close(final_scrape_s=linger)  # Prometheus reads the verdict first
    try:
        for ln in _export(db, out.experiment_id, otlp_file, otlp_endpoint, grafana_url,
                          grafana_token_file, annotations_file):  # fmt: skip
            echo(ln)
    except click.ClickException as err:
        # The run is recorded and judged: its export failing changes no verdict.
        echo(f"gpufault: export: {err.message}; retry with gpufault experiment export "
             f"{out.experiment_id} --db {db}")  # fmt: skip
    v = out.verdict
    words = expectation_words(v.verdict, out.expected, out.interrupted is not None, out.died)
    line = (
        f"verdict {v.verdict.upper()}{words}: {v.reason}  [experiment {out.experiment_id}, "
        f"{out.ended_at - out.started_at:.1f}s; evidence in {db}: gpufault experiment "
        f"results {out.experiment_id} --db {db}]"
    )
    if as_json:
        click.echo(line, err=True)
        click.echo(
            json.dumps(
                {
                    "experiment_id": out.experiment_id,
                    "verdict": v.verdict,
                    "expected": out.expected,
                    "as_expected": out.as_expected,
                    "reason": v.reason,
                    "exit_code": out.expected_exit,
                    "db": db,
                    "started_at": out.started_at,
                    "ended_at": out.ended_at,
                    "abort_at": out.abort_at,
                    "steps": [
                        {
                            "idx": s.step.idx,
                            "name": s.step.name,
                            "status": s.status,
                            "run_id": s.fault.run_id if s.fault else None,
                            "fires": len(s.fires),
                        }
                        for s in out.steps
                    ],
                    # The SLO terms as judged: load.p99, load.itl_p99, load.goodput,
                    # quality.bleu_drop_pct ... per phase (NaN: null).
                    "slo": [
                        {
                            "term": term,
                            "phase": phase,
                            "value": value if value == value else None,
                            "ok": ok,
                        }
                        for term, phase, value, ok in out.slo
                    ],
                }
            )
        )
    else:
        click.echo(line)
    sys.exit(out.expected_exit)


def _run_all(match: str | None, sets: dict[str, str], db: str) -> None:
    """`run --all`: every experiment in turn, in one store; a table at the
    end; exit 0 unless one ended other than its file expects (1), or a
    signal stopped the set (3). A --set goes to the files that have that
    knob (--set device=cuda on a GPU host); one that no file has is bad
    input, said before anything runs."""
    # lazy: fnmatch (re) only for --match
    from fnmatch import fnmatchcase

    # lazy: keeps pyctl.experiment.run (hmac, secrets, +9 modules) off `--help`
    from pyctl.experiment import run as runner

    # lazy: pyctl.experiment.target (socket, subprocess) only when one runs
    from pyctl.experiment.target import missing_on_host

    names = [n for n in F.all_names() if match is None or fnmatchcase(n, match)]
    if not names:
        raise _user_error(f"--match {match}: no experiment of that name: see `experiment list`")
    loaded: list[tuple[str, M.Experiment | None, str]] = []
    used: set[str] = set()
    for n in names:
        try:
            knobs = F.load(n).knobs
            mine = {k: v for k, v in sets.items() if k in knobs}
            used |= set(mine)
            loaded.append((n, F.load(n, mine), ""))
        except M.ExperimentError as bad:
            loaded.append((n, None, str(bad)))
    if unused := sorted(set(sets) - used):
        raise _user_error(f"--set {unused[0]}: no experiment here has that knob: drop it")
    rows: list[tuple[str, str, str, str]] = []  # name, verdict, expected, what
    stopped = False
    for n, e, load_error in loaded:
        if e is None:
            click.echo(f"== {n}: does not load: {load_error}")
            rows.append((n, "error", "pass", "SURPRISE: does not load"))
            continue
        if (why := missing_on_host(e.target)) is not None:
            click.echo(f"== {n}: skipped: {why}")
            rows.append((n, "-", e.expect.verdict, "skipped"))
            continue
        click.echo(f"== {n} (expects {e.expect.verdict.upper()})")
        try:
            out = runner.run(e, db, echo=click.echo)
        except (M.ExperimentError, BadInput) as refused:
            click.echo(f"   {refused}")
            rows.append((n, "error", e.expect.verdict, "SURPRISE: " + str(refused)[:60]))
            continue
        v = out.verdict
        click.echo(
            f"verdict {v.verdict.upper()}"
            f"{expectation_words(v.verdict, out.expected, out.interrupted is not None, out.died)}: "
            f"{v.reason}  [experiment {out.experiment_id}, {out.ended_at - out.started_at:.1f}s]"
        )
        rows.append((n, v.verdict, out.expected, "as expected" if out.as_expected else "SURPRISE"))
        if out.interrupted is not None:
            stopped = True
            break
    width = max(len(r[0]) for r in rows)
    click.echo(f"\n{'experiment':{width}}  verdict  expected  outcome")
    for n, got, want, what in rows:
        click.echo(f"{n:{width}}  {got.upper():7}  {want.upper():8}  {what}")
    surprises = sum(1 for r in rows if r[3].startswith("SURPRISE"))
    skipped = sum(1 for r in rows if r[3] == "skipped")
    ran = len(rows) - skipped
    click.echo(
        f"{ran} run, {ran - surprises} as expected, {surprises} surprise(s), {skipped} skipped"
        f"{', stopped by a signal' if stopped else ''}; evidence in {db}"
    )
    sys.exit(3 if stopped else 1 if surprises else 0)


@experiment.command()
@click.argument("experiment_id", required=False)
@db_option()
@click.option("--json", "as_json", is_flag=True, help="the evidence as JSON")
def results(experiment_id: str | None, db_path: str | None, as_json: bool) -> None:
    """An experiment's evidence: steps with their fault ids, hypotheses,
    judgements, expectations, verdict. Without ID: the experiments, newest first.

    \b
    Examples:
      gpufault experiment results --db /tmp/exp.db
      gpufault experiment results x1a2b3c4d --db /tmp/exp.db
    """
    # lazy: keeps pyctl.experiment.evidence (+3 modules, ~500 ms) off `--help`
    from pyctl.experiment import evidence as E

    db_file = db_path or str(DEFAULT_DB)
    try:
        db = open_readonly(db_file)
    except BadInput as err:
        raise _user_error(str(err)) from None
    if experiment_id is None:
        rows = E.experiments(db)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        for r in [] if as_json else rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"] or 0))
            click.echo(
                f"{r['id']}  {when}  {r['name']}@v{r['version']}  "
                f"{(r['verdict'] or '').upper():8} {r['reason']}"
            )
        return
    doc = E.results(db, experiment_id)
    if doc is None:
        raise _user_error(
            f"no experiment {experiment_id} in {db_file}: list them with "
            "`gpufault experiment results`"
        )
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
        return
    click.echo("\n".join(render_results(doc)))


def _short(name: str | None, width: int = 48) -> str:
    """A (Rust-mangled) function name cut to a width; `gpufault show` has it whole."""
    name = name or "-"
    return name if len(name) <= width else name[: width - 3] + "..."


def render_results(doc: dict[str, Any]) -> list[str]:
    e = doc["experiment"]
    t0 = e["started_at"] or 0.0

    def rel(t: float | None) -> str:
        return "-" if t is None else f"+{t - t0:.2f}s"

    out = [
        f"experiment {e['id']}  {e['name']}@v{e['version']}  {e['file']}",
        f"  verdict   {(e['verdict'] or '').upper()}: {e['reason']}",
        f"  ran       {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))} for "
        f"{(e['ended_at'] or t0) - t0:.1f}s on {e['host']}"
        + (f", SLO {e['slo_id']}" if e["slo_id"] else ""),
    ]
    out.append("  steps" if doc["steps"] else "  steps     none (control)")
    for s in doc["steps"]:
        spec = s.get("spec") if isinstance(s.get("spec"), dict) else {}
        traffic = "traffic" in spec
        kind = s["template"] or (
            "traffic"
            if traffic
            else next((k for k in ("perturb", "pressure") if k in spec), "inline")
        )
        out.append(
            f"    {s['idx'] + 1}. {s['name']} [{kind}] "
            f"{s['status']}: run {s['run_id'] or '-'}, planned {rel(s['planned_start'])} "
            f"for {s['planned_duration']:g}s, armed {rel(s['started_at'])}, ended "
            f"{rel(s['ended_at'])}, {s['fires']} "
            + ("request(s)" if traffic else "fire(s)")
            + (f" into pid {spec['pid']}" if spec.get("pid") else "")
        )
        if traffic and spec.get("check"):
            out.append(f"         answers: {spec['check']}")
        for f in s["faults"][:10]:
            out.append(
                f"         fault {f['fault_id']}  {_short(f['function'])} {f['action']} "
                f"tid {f['tid']} ({f['comm']}) {rel(f['wall'])}  "
                f"-> gpufault show {f['fault_id']}"
            )
        if len(s["faults"]) > 10:
            out.append(
                f"         ... {len(s['faults']) - 10} more: gpufault faults --run {s['run_id']}"
            )
    if doc["hypothesis_results"]:
        out.append("  hypothesis")
        for h in doc["hypothesis_results"]:
            out.append(
                f"    {h['phase']:7} {h['probe']:18} {'ok ' if h['ok'] else 'NO '} "
                f"{h['value']} (want {h['tolerance'] or '-'})  {h['detail']}"
            )
    for j in doc["judgements"]:
        out.append(
            f"  judge     {j['metric']}: {'WORSE' if j['worse'] else 'not worse'} "
            f"(p={j['p_value']:.3g}, effect {j['effect']:.2f}, n {j['baseline_n']} vs "
            f"{j['window_n']}) {j['reason']}"
        )
    for x in doc["expectations"]:
        out.append(f"  expect    {x['name']:20} {'ok' if x['ok'] else 'NOT MET'}  {x['detail']}")
    for r in doc["remediations"]:
        took = f"{r['ended_at'] - r['started_at']:.2f}s" if r["ended_at"] else "timed out"
        out.append(
            f"  remedy    {r['command']}: at {rel(r['started_at'])}, took {took}, rc {r['rc']}"
        )
    for w in doc["load_windows"]:
        p99 = f"{w['worst_p99'] * 1000:.1f}ms" if w["worst_p99"] is not None else "-"
        out.append(
            f"  load      {w['phase']:8} {w['windows']} windows, {w['requests']} "
            f"requests, worst 1 s p99 {p99}"
        )
    return out


__all__ = ["experiment", "describe", "render_results"]


def _add_report() -> None:
    """`gpufault experiment report ID...`: the HTML/Markdown report
    (pyctl/report), a command of this group owned by that package."""
    experiment.add_command(report)


_add_report()


def _shown(name: str, h: M.Header) -> str:
    """A [load] header as `show` prints it: a variable's name, never a
    secret-looking literal."""
    # lazy: pyctl.experiment.reader only for a file with headers
    from pyctl.experiment.reader import SECRET_HEADERS

    return "<redacted>" if h.env is None and SECRET_HEADERS.search(name) else str(h)
