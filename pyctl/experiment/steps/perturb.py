"""A perturb step: Tensor Core bit flips armed in the service (class 4).

    [[method]]
    perturb = { rules = ["blocks.*@exp:4@1e-3@fp16"], seed = 7 }
    duration = "5s"

The step POSTs the rules to the service's /admin/perturb (`gpufault
service --perturb-control`, pyctl/service/perturb.py) with the step's
duration and the service's admin token (a fresh one the runner gave the
service it started, else GPUFAULT_ADMIN_TOKEN): the service itself ends
the flips at that deadline, so they stop on time even if this runner
hangs or is killed. At the step's end (or an
abort) it DELETEs them and reads what was flipped, per layer.

Evidence, like the hooks' (pyctl/hooks/record.py): a run (kind
`experiment:perturb`, mechanism `torch-hook`), its spec, and one fault row
(action `perturb`, function the rules, outcome the service's counts: bits
and elements flipped per layer, batches). The step fired when at least one
bit flipped; a perturbation that flipped nothing proves nothing and the
verdict says so (a step that never fired).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from pyctl.experiment.facts import render_facts
from pyctl.experiment.steps.base import EndsOnItsOwn, FaultHostError, StepKind, register

if TYPE_CHECKING:
    from pyctl.experiment.model import Step
    from pyctl.experiment.reader import Reader
    from pyctl.experiment.steps.base import Run, StepRun


def _call(
    url: str, method: str, body: Any = None, timeout: float = 5.0, token: str | None = None
) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:  # the service's admin token (pyctl/service/perturb.py)
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = e.reason
        raise FaultHostError(f"{method} {url}: {e.code} {msg}") from None
    except (OSError, ValueError) as e:
        raise FaultHostError(f"{method} {url}: {e}") from None


class PerturbRun(EndsOnItsOwn):
    """A perturb step behind the RunningFault interface."""

    def __init__(
        self,
        url: str,
        rules: list[str],
        seed: int,
        duration: float,
        db_path: str,
        who: tuple[int | None, int | None] = (None, None),
        token: str | None = None,
    ) -> None:
        # lazy: pyctl.evidence.store (+6 modules) only when this runs
        from pyctl.evidence import layers, store

        self.url, self.db_path = url, db_path
        self.pid, self.tid = who  # the service and its worker: where the flips happen
        self.ts_ns = time.monotonic_ns()
        self.rules, self.seed, self.duration = rules, seed, duration
        spec = {"rules": rules, "seed": seed, "duration_s": duration}
        self.token = token
        self.report = _call(url, "POST", spec, token=token)  # FaultHostError: failed to arm
        self.started_at = float(self.report.get("started") or time.time())
        self._ended_at: float | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        db = store.open_db(db_path)
        try:
            self.run_id = store.new_run(
                db, ["POST", url, json.dumps(spec)], "experiment:perturb", mechanism="torch-hook"
            )
            layers.add_spec(db, self.run_id, 0, f"perturb {' '.join(rules)} seed={seed}", spec)
        finally:
            db.close()
        self.fault_id = f"{self.run_id}-1"
        self._write(final=False)
        self._waiter = threading.Thread(target=self._run, name="gf-exp-perturb", daemon=True)
        self._waiter.start()

    def _run(self) -> None:
        self._stop.wait(self.duration)  # the step's end, or stop() early
        try:
            self.report = _call(self.url, "DELETE", token=self.token)
        except FaultHostError as e:
            # The service's own deadline ended the flips; only the counts are lost.
            self.report = {**self.report, "error": str(e)}
        self._ended_at = time.time()
        self._write(final=True)
        self._done.set()

    def _write(self, *, final: bool) -> None:
        # lazy: pyctl.evidence.store (+6 modules) only when this runs
        from pyctl.evidence import layers, store

        rep = self.report
        row = layers.fault_row(
            self.run_id,
            1,
            action="perturb",
            function=" ".join(self.rules),
            library="service /admin/perturb",
            mechanism="torch-hook",
            outcome={k: rep.get(k) for k in ("id", "bits_flipped", "elements", "batches",
                                               "layers", "end_reason", "error") if k in rep},
            wall=self.started_at,
            latency_ns=int(((self._ended_at or time.time()) - self.started_at) * 1e9)
            if final
            else None,
            ts_ns=self.ts_ns,
            pid=self.pid,
            tid=self.tid or self.pid,
            comm="gf-worker" if self.tid else "gf-service",
            call_seq=1,
            ret=rep.get("bits_flipped"),
        )  # fmt: skip
        db = store.open_db(self.db_path)
        try:
            layers.insert_faults(db, [row])
            if final:
                ok = rep.get("bits_flipped", 0) > 0
                stats = {"bits_flipped": rep.get("bits_flipped"), "batches": rep.get("batches")}
                store.end_run(db, self.run_id, "done" if ok else "no-fires", 0, stats)
        finally:
            db.close()

    def stop(self) -> None:
        self._stop.set()

    def fires(self) -> list[tuple[str, float]]:
        n = self.report.get("bits_flipped") or 0
        return [(self.fault_id, self.started_at)] if n > 0 else []

    @property
    def what(self) -> str:
        return f"perturbing ({', '.join(self.rules)}, seed {self.seed}, id {self.report.get('id')}"


def parse_perturb(r: Reader, key: str, v: Any) -> dict[str, Any]:
    """A perturb step's table: rules checked here with the hooks' own
    parser, so a bad bit name is refused before anything starts."""
    # lazy: keeps pyctl.hooks.bitflip (argparse, asyncio, +964 modules, ~9 s) off `--help`
    from pyctl.hooks.bitflip import BitSpecError

    # lazy: keeps pyctl.hooks.tc_perturb (+965 modules, ~10 s) off `--help`
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


class PerturbKind(StepKind):
    name = "perturb"
    words = ("perturb",)
    refused = ("thread", "pid", "tid", "set", "arm_timeout")
    why = "a perturb step is armed by the service: remove it"

    def parse(self, r: Reader, key: str, m: dict[str, Any], step: Step) -> Step:
        table = parse_perturb(r, f"{key}.perturb", m["perturb"])
        step.name = r.str_(m, key, "name", "perturb " + " ".join(table["rules"]))
        step.thread, step.perturb = None, table
        return step

    def arm(self, run: Run, sr: StepRun, pending: Any, facts: dict[str, Any]) -> Any:
        s = sr.step
        assert s.perturb is not None
        return PerturbRun(
            str(render_facts(s.perturb["url"], facts)),
            s.perturb["rules"],
            s.perturb["seed"],
            s.duration,
            run.db_path,
            (facts.get("pid"), facts.get("worker_tid")),
            token=run.admin_token,
        )

    def spec(self, step: Step) -> dict[str, Any]:
        return {"perturb": step.perturb}


register(PerturbKind())

__all__ = ["PerturbKind", "PerturbRun", "parse_perturb"]
