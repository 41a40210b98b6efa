"""When the load generator starts each request: the arrival process.

Four kinds, the ones serving benchmarks use (vLLM's benchmark_serving:
`--request-rate` with Poisson or constant gaps and `--max-concurrency`;
LLMPerf: `--num-concurrent-requests`):

- constant: request i is due at i / rate (wrk2, vegeta);
- poisson: exponential gaps of mean 1 / rate, drawn from a seeded
  generator, so the same seed plans the same send times (the seed goes into
  the evidence; a run is reproducible);
- burst: `size` requests due at once every `every` seconds (mean rate
  size / every): what a batch job or a retry storm sends;
- closed: `clients` workers, each sending its next request when the last
  one is answered. No schedule, so no coordinated-omission guard: it
  measures what N concurrent users see, not what a fixed offered load does.

The first three are open loop: `offsets()` is the plan, absolute times
from the load's start, which the scheduler follows without letting a late
wake-up shift what comes after.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("constant", "poisson", "burst", "closed")


@dataclass(frozen=True)
class Arrival:
    kind: str = "constant"
    rate: float = 10.0  # requests/s of constant and poisson (burst: size / every)
    seed: int | None = None  # poisson's; None only where no poisson runs
    size: int = 1  # burst: requests due together
    every: float = 0.0  # burst: seconds between bursts
    clients: int = 0  # closed: concurrent workers
    # poisson: the file gave no seed, this one was drawn when it was read
    # (each reading draws anew; the run's is in its evidence)
    drawn: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        # Checked here too (not only by the file's parser) so that a wrong
        # Arrival built in code fails where it is built, not in a thread.
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.kind in ("constant", "poisson") and not self.rate > 0:
            raise ValueError(f"arrival rate {self.rate!r} must be positive")
        if self.kind == "poisson" and self.seed is None:
            raise ValueError("a poisson arrival needs its seed (the plan must be reproducible)")
        if self.kind == "burst" and not (self.size >= 1 and self.every > 0):
            raise ValueError("a burst needs size >= 1 and every > 0")
        if self.kind == "closed" and self.clients < 1:
            raise ValueError("a closed loop needs clients >= 1")

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"

    @property
    def mean_rate(self) -> float | None:
        """Requests/s on average; None for a closed loop (the server sets it)."""
        if self.kind == "burst":
            return self.size / self.every
        return None if self.kind == "closed" else self.rate

    def offsets(self) -> Iterator[float]:
        """Planned due times, seconds after the start, non-decreasing,
        endless. Each is computed from its index (constant, burst) or
        summed from seeded gaps (poisson): the plan, not the clock."""
        if self.kind == "constant":
            return (i / self.rate for i in itertools.count())
        if self.kind == "burst":
            return ((i // self.size) * self.every for i in itertools.count())
        if self.kind == "poisson":
            return _poisson(self.rate, self.seed or 0)
        raise ValueError("a closed loop has no planned times")

    def describe(self) -> str:
        """One line: `poisson 200/s (seed 7)`, `burst 20 every 100ms`."""
        if self.kind == "constant":
            return f"constant {self.rate:g}/s open loop"
        if self.kind == "poisson":
            how = ", drawn" if self.drawn else ""
            return f"poisson {self.rate:g}/s open loop (seed {self.seed}{how})"
        if self.kind == "burst":
            ms = self.every * 1e3
            return f"bursts of {self.size} every {ms:g}ms open loop ({self.mean_rate:g}/s)"
        return f"closed loop, {self.clients} clients"


def _poisson(rate: float, seed: int) -> Iterator[float]:
    # random.Random, not the module's shared generator: the plan depends on
    # the seed alone, whatever else in the process draws numbers.
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def new_seed() -> int:
    """A fresh seed for a poisson arrival given none (then written into the
    stored file, so the run can be repeated)."""
    return random.SystemRandom().randrange(1, 2**31)


__all__ = ["KINDS", "Arrival", "new_seed"]
