"""The parsed experiment: what load.py makes of a file, as dataclasses.

Nothing here reads a file or runs anything; every value is already
checked (pyctl/experiment/load.py) and has its type. Result rows of a run
are in pyctl/experiment/evidence.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pyctl import templates as T
from pyctl.exceptions import BadInput
from pyctl.experiment.arrival import Arrival
from pyctl.experiment.probes import Probe, Tolerance
from pyctl.experiment.promptset import PromptSet
from pyctl.spec import FaultSpec

WINDOW_S = 1.0  # load windows: the SLO's resolution (hypothesis, breach, recovery)
# Prompt sources of [load] and of traffic steps (pyctl/experiment/corpora.py).
CORPORA = ("prompt", "prompts", "unicode", "over-limit", "at-limit", "hot", "cold")


class ExperimentError(BadInput):
    """One line for the user: which file, which key, what is wrong, what to do."""


@dataclass
class Step:
    """One step of the method: its timing and aim, and its kind's table."""

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
    # Its kind's name in the steps registry (pyctl/experiment/steps/):
    # "fault" (a template or an inline fault), "traffic", "perturb", "pressure".
    kind: str = "fault"
    traffic: Traffic | None = None  # a traffic step: requests, not a fault
    # A perturb step: {"rules": [...], "seed": N, "url": ...}, bit flips the
    # service arms in its own model (pyctl/experiment/steps/perturb.py).
    perturb: dict[str, Any] | None = None
    # A pressure step: {"share", "device", "allocator", "reserve_mib"}, a
    # second process holding VRAM (pyctl/experiment/steps/pressure.py).
    pressure: dict[str, Any] | None = None
    # A fault step for another node: the name of one of the file's
    # [agents.NAME] (pyctl/experiment/agents.py); None: this machine.
    agent: str | None = None
    # agent = {node = "...", labels = {...}}: the one agent whose node says
    # it is that, chosen when the run starts (FleetHost.prepare sets agent).
    agent_select: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return self.template or ("inline" if self.kind == "fault" else self.kind)


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
    # The reference service's --device (None for another target), and what
    # the target needs of the host (`requires`; a cuda device needs "gpu").
    device: str | None = None
    requires: tuple[str, ...] = ()

    @property
    def needs_gpu(self) -> bool:
        return "gpu" in self.requires


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
    # Any OpenAI-style (or other) API: the method, a full endpoint URL
    # instead of the target's URL + path, headers (a value, or one read from
    # the environment when the run starts: never stored), a body template
    # ("$prompt" / "$max_tokens" filled per request; None: the completion
    # request) and whether the answers stream (Server-Sent Events).
    method: str = "POST"
    url: str | None = None
    headers: dict[str, Header] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    stream: bool = False
    # When requests start (pyctl/experiment/arrival.py): None is constant
    # at `rate`; poisson (seeded), bursts, or a closed loop of N clients.
    arrival: Arrival | None = None
    # prompts = "file.jsonl": the user's prompt set, read and checked when
    # the file is (corpus "prompts", like a list; pyctl/experiment/promptset.py).
    prompt_set: PromptSet | None = None
    # The load threads ask to run on time (loadgen.OpenLoopLoad._realtime):
    # True (SCHED_FIFO, else a short slice), "slice" or False.
    realtime: bool | str = True

    def plan(self) -> Arrival:
        return self.arrival or Arrival("constant", rate=self.rate)

    def expected_requests(self, seconds: float) -> int:
        """About how many requests `seconds` of this load sends (a cold
        corpus makes one body per request; a closed loop has no rate, so
        a generous guess, capped: past it the bodies repeat)."""
        rate = self.plan().mean_rate
        if rate is None:
            return min(20_000, int(seconds * 50 * self.plan().clients) + 1)
        return int(rate * seconds) + 1

    def endpoint(self, target_url: str) -> str:
        """The URL the load sends to: its own, or the target's + path (a
        target URL with a path of its own is the endpoint already)."""
        if self.url:
            return self.url
        own = urlsplit(target_url).path
        return target_url if own not in ("", "/") else target_url.rstrip("/") + self.path

    def resolved_headers(self, where: str) -> dict[str, str]:
        """Header values as sent: a variable's value read now (a missing
        one is one ExperimentError line); never kept anywhere else."""
        out: dict[str, str] = {}
        for name, h in self.headers.items():
            if h.env is None:
                out[name] = h.value
                continue
            v = os.environ.get(h.env)
            if v is None:
                raise ExperimentError(
                    f"{where}: load.headers.{name}: the environment variable {h.env} is "
                    f"not set: export {h.env}=... before the run"
                )
            if any(c in v for c in "\r\n\0"):
                raise ExperimentError(
                    f"{where}: load.headers.{name}: {h.env} holds a line break: give one line"
                )
            out[name] = h.prefix + v
        return out


@dataclass(frozen=True)
class Header:
    """A [load] header: a literal `value`, or `prefix` + the value of the
    environment variable `env` when the run starts ({env = "TOKEN",
    prefix = "Bearer "}); the secret is never written to the store."""

    value: str = ""
    env: str | None = None
    prefix: str = ""

    def __str__(self) -> str:
        return f"{self.prefix}${{{self.env}}}" if self.env else self.value


@dataclass
class Traffic(Load):
    """A traffic step: a second open-loop load while the step lasts (the
    adversarial input is the fault). Every answer must have a status in
    ok_status: a refusal (4xx) is fine, a 5xx, a dropped connection or a
    timeout is not; `max_bad` is the share allowed outside."""

    ok_status: tuple[int, int] = (200, 499)
    max_bad: float = 0.0


JUDGE_ALPHA = 0.01  # the default judge's alpha (a file without `judge` gets it)
JUDGE_METHODS = ("blocks", "requests")


@dataclass
class Judge:
    """The judge of the fault window against the baseline (docs/experiments.md,
    "Statistics"). On by default: a file with a [load] and no `judge` gets
    Judge() (explicit False); `judge = false` turns it off (None)."""

    alpha: float = JUDGE_ALPHA
    # "blocks" (pyctl/experiment/blockjudge.py): 1 s blocks of the baseline
    # and the recovered seconds against the fault window's, a permutation
    # test of the block labels; "requests" (stats.judge): every request a
    # draw (Mann-Whitney U and a Fisher tail test), the judge before issue 23.
    method: str = "blocks"
    min_ratio: float = 1.1  # blocks: the window's block statistic >= this x the reference's
    min_effect: float = 0.2  # requests: Cliff's delta of the shift test
    min_tail_effect: float = 0.05  # requests: the tail test's share difference
    # requests: the A/A control, the baseline's halves set a noise floor
    # that is added to the thresholds (stats.judge_with_control).
    control: bool = False
    explicit: bool = True  # written in the file (False: the default judge)
    # The default judge on phases too short for it: why it cannot say
    # worse (load.py; an explicit judge there is refused instead).
    blind: str = ""

    def settings(self) -> dict[str, Any]:
        """What the judge ran with, as a `judge` table (the stored file's)."""
        if self.method == "blocks":
            return {"alpha": self.alpha, "min_ratio": self.min_ratio}
        out: dict[str, Any] = {
            "alpha": self.alpha,
            "method": "requests",
            "min_effect": self.min_effect,
            "min_tail_effect": self.min_tail_effect,
        }
        return out | ({"control": True} if self.control else {})

    def describe(self) -> str:
        if self.method == "blocks":
            return (
                f"1 s blocks, before+after vs the fault window, alpha {self.alpha:g}, "
                f">= {self.min_ratio:g}x"
                + ("" if self.explicit else " (the default judge)")
                + (f"; it cannot say worse here: {self.blind}" if self.blind else "")
            )
        return (
            f"per request (Mann-Whitney U and Fisher tail), alpha {self.alpha:g}, min effect "
            f"{self.min_effect:g} Cliff's delta"
            + (", A/A control: the baseline's halves set the noise floor" if self.control else "")
        )


# The load hypothesis's per-window terms: (name, unit, needs a streamed load).
LOAD_TERMS: tuple[tuple[str, str, bool], ...] = (
    ("p50", "duration", False),
    ("p95", "duration", False),
    ("p99", "duration", False),
    ("error_rate", "share", False),
    ("min_throughput", "number", False),
    ("ttft_p50", "duration", True),
    ("ttft_p95", "duration", True),
    ("ttft_p99", "duration", True),
    ("itl_p50", "duration", True),
    ("itl_p95", "duration", True),
    ("itl_p99", "duration", True),
    ("output_tokens_per_s", "number", True),
    ("goodput", "share", False),
)
# A term's attribute of loadgen.WindowStats (min_throughput bounds `throughput`).
WINDOW_ATTR = {"min_throughput": "throughput"}


@dataclass
class GoodBounds:
    """What one request must meet to count in the goodput (DistServe's and
    vLLM's sense): every bound given here, and no error. ttft: its time to
    first token; itl: its longest gap between tokens; tpot: its time per
    output token after the first; e2e: its latency."""

    ttft: Tolerance | None = None
    itl: Tolerance | None = None
    tpot: Tolerance | None = None
    e2e: Tolerance | None = None

    def __call__(self, s: Any) -> bool:
        for b, v in (
            (self.ttft, s.ttft),
            (self.itl, max(s.itl, default=0.0)),
            (self.tpot, s.tpot),
            (self.e2e, s.latency),
        ):
            if b is not None and (v != v or not b.check(v)):  # v != v: NaN
                return False
        return True

    def __str__(self) -> str:
        return ", ".join(
            f"{k} {b}" for k, b in vars(self).items() if b is not None
        )  # fmt: skip


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
    # Streamed answers (a [load] with stream = true): per-window bounds.
    ttft_p50: Tolerance | None = None
    ttft_p95: Tolerance | None = None
    ttft_p99: Tolerance | None = None
    itl_p50: Tolerance | None = None
    itl_p95: Tolerance | None = None
    itl_p99: Tolerance | None = None
    output_tokens_per_s: Tolerance | None = None
    goodput: Tolerance | None = None  # the share of good requests per window
    good: GoodBounds | None = None  # what a good request is (goodput's table)

    def terms(self) -> list[tuple[str, str, Tolerance]]:
        """(name, WindowStats attribute, bound) of every bound given."""
        out = []
        for name, _unit, _streamed in LOAD_TERMS:
            b = getattr(self, name)
            if b is not None:
                out.append((name, WINDOW_ATTR.get(name, name), b))
        return out

    def any_load_bound(self) -> bool:
        """A bound that needs a [load] (the default judge is not one: a
        file without a load has no judge)."""
        return bool(self.terms()) or (self.judge is not None and self.judge.explicit)

    def window_ok(self, w: Any) -> tuple[bool, str]:
        """Does one load window meet the per-window hypothesis?"""
        if w.count == 0:
            return False, "no request due in this window"
        for _name, attr, b in self.terms():
            if not b.check(getattr(w, attr)):
                return False, f"{attr} {getattr(w, attr):.4g} not {b}"
        return True, ""


@dataclass
class Quality:
    """[quality]: a fixed case set scored against references in every
    phase (pyctl/experiment/quality.py); `bound` is on the drop from the
    baseline's score, in percent."""

    metric: str  # "bleu" (sacrebleu corpus BLEU-4) or "exact"
    bound: Tolerance
    cases: list[tuple[str, str | None]]  # (prompt, reference or None: the first baseline answer)
    # Per case, a chat list sent as the load body's "$messages" (None: the
    # prompt); empty when no case is a chat.
    chats: list[list[dict[str, str]] | None] = field(default_factory=list)
    interval: float = 0.5
    max_tokens: int = 16
    timeout: float = 3.0
    tokenize: str = "13a"

    @property
    def term(self) -> str:
        return f"quality.{self.metric}_drop_pct"


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
    # The verdict this file expects on the target's device (`verdict` in
    # [expect]): a run that ends so exits 0 and says so; anything else is
    # a surprise (docs/experiments.md, "Expected verdicts").
    verdict: str = "pass"
    # The target may die on the way to that verdict (a fault that aborts
    # it is the finding): otherwise a death is a surprise.
    target_may_die: bool = False


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
    quality: Quality | None = None
    # [agents.NAME]: the nodes whose agents arm the steps naming them
    # (pyctl.experiment.agents.AgentRef by name); empty: all steps here.
    agents: dict[str, Any] = field(default_factory=dict)
    # [[slo]]: multi-window burn-rate SLOs (pyctl.experiment.burn.BurnSLO).
    slos: list[Any] = field(default_factory=list)

    @property
    def ident(self) -> str:
        return f"{self.name}@v{self.version}"


__all__ = [
    "ADMIN_TOKEN_ENV",
    "CORPORA",
    "GPUFAULT",
    "LOAD_TERMS",
    "WINDOW_ATTR",
    "GoodBounds",
    "Header",
    "LINKABLE",
    "SERVICE_READY",
    "WINDOW_S",
    "Abort",
    "Expect",
    "Experiment",
    "ExperimentError",
    "JUDGE_ALPHA",
    "JUDGE_METHODS",
    "Judge",
    "Load",
    "Quality",
    "Remediation",
    "Rollback",
    "SteadyState",
    "Step",
    "Target",
    "Traffic",
]
