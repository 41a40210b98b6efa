"""The verdict of an experiment: pass | fail | aborted | error, one reason.

Order matters (the first that applies wins):
1. error: the experiment could not say anything: a step never armed or
   never fired (a fault that did not happen proves nothing, so it is never
   a pass: Chaos Toolkit users were bitten by exactly that), the steady
   state did not hold before the method, or the runner itself failed;
2. aborted: a guard probe stopped the method;
3. fail: a hypothesis (during or after) was breached, the judge found the
   fault window worse than the baseline, or an expectation was not met;
4. pass.
A target that died during the run is said first in any of them (it is
what a user must hear first: a step that never fired, a guard's abort or
a breach usually follows from it); alone, it is a fail.
Exit status of `gpufault experiment run`: 0 pass, 1 fail, 2 error, 3 aborted;
a file that expects its verdict ([expect] verdict) exits 0 when it gets it
(expected_exit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT = {"pass": 0, "fail": 1, "error": 2, "aborted": 3}


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    abort: str | None = None
    failures: list[str] = field(default_factory=list)
    died: str | None = None  # the target's death, if it died during the run


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]


def _reason(died: str | None, items: list[str]) -> str:
    head = items[0] + (f" (+{len(items) - 1} more)" if len(items) > 1 else "") if items else ""
    return "; ".join(x for x in (died, head) if x)


def decide(f: Findings) -> Verdict:
    if f.errors:
        return Verdict("error", _reason(f.died, f.errors))
    if f.abort:
        return Verdict("aborted", _reason(f.died, [f.abort]))
    if f.failures or f.died:
        return Verdict("fail", _reason(f.died, f.failures))
    return Verdict("pass", "steady state held, every expectation met")


def expected_exit(
    verdict: str, expected: str, interrupted: bool = False, died: bool = False
) -> int:
    """The exit status of a run whose file expects `expected`: 0 when the
    verdict is that one; a surprise keeps its own status (a pass where a
    fail was expected is 1: the expected failure did not happen). A run a
    signal interrupted is aborted whatever was expected; a target that
    died is a surprise unless the file says it may ([expect]
    target_may_die): a crash is not the fail a file declares."""
    if interrupted:
        return EXIT["aborted"]
    if verdict == expected and not died:
        return 0
    return EXIT[verdict] or 1


def expectation_words(
    verdict: str, expected: str, interrupted: bool = False, died: bool = False
) -> str:
    """What the verdict line adds for a file that expects another verdict
    than a pass: '(expected)', or the surprise. Nothing for the usual
    file, whose fail reads as it always did."""
    if expected == "pass":
        return ""
    if verdict == expected and not interrupted and not died:
        return " (expected)"
    return f" (expected {expected.upper()}: a surprise)"


__all__ = ["EXIT", "Findings", "Verdict", "decide", "expectation_words", "expected_exit"]
