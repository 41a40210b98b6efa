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
Exit status of `gpufault experiment run`: 0 pass, 1 fail, 2 error, 3 aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT = {"pass": 0, "fail": 1, "error": 2, "aborted": 3}


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    abort: str | None = None
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]


def decide(f: Findings) -> Verdict:
    if f.errors:
        more = f" (+{len(f.errors) - 1} more)" if len(f.errors) > 1 else ""
        return Verdict("error", f.errors[0] + more)
    if f.abort:
        return Verdict("aborted", f.abort)
    if f.failures:
        more = f" (+{len(f.failures) - 1} more)" if len(f.failures) > 1 else ""
        return Verdict("fail", f.failures[0] + more)
    return Verdict("pass", "steady state held, every expectation met")


__all__ = ["EXIT", "Findings", "Verdict", "decide"]
