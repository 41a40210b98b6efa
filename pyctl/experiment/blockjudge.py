"""The default judge: is the fault window worse than the reference (the
baseline before the fault and the recovered seconds after it), counted in
1 s blocks of time (issue 23: "a judge that holds up").

Why blocks. stats.judge() treats every request as an independent draw,
and on a shared machine they are not: another process's burst slows every
request of a second or two, so a do-nothing window that holds a burst has
hundreds of "independent" slow requests and a tiny p (issue 23: 1 of 7
do-nothing runs worse at alpha 0.01, two more at p < 0.025). Here the
unit of evidence is a block of WIDTH = 1 s (the load windows' width, and
the time scale of this machine's bursts): each block is summarized, and
the fault window's blocks are compared with the reference's by a
permutation test of the block labels. A burst that moves a whole second
moves one block, one unit of evidence among the 10-20 of a run. Half-
second blocks were tried: two halves of one slow second are two
"independent" blocks again (in the first version, synthetic A/A draws
with per-second levels were worse 2.5-5 % of the time at alpha 0.01 with
0.5 s blocks, 1-1.5 % with 1 s).

Why before and after. The fault window always comes after the baseline,
so a machine that gets busier during a run (drift) looks like a fault.
The reference is the baseline's blocks and the last `hold` seconds of the
recovery phase (the seconds the after hypothesis calls recovered), so the
fault window sits between its two parts and a linear drift is in both.

The test, per statistic: the rank sum of the window's block summaries
among all blocks (Wilcoxon-Mann-Whitney over blocks: a permutation test
whose exact distribution over all C(n, k) relabellings is Mann-Whitney's,
counted in integers; with ties the relabellings are enumerated, or a
seeded sample of them). Two statistics, each at alpha / 2 (Bonferroni):
- centre: each block's median latency (a shift of the whole distribution);
- tail: each block's mean over its median (its "tail weight"). A stall
  on a share of requests moves a block's mean and not its median (10x on
  5 % of requests: the mean +45 %, the median ~0; 50 ms on 20 % of 10 ms
  requests: the mean x2), and the ratio takes out the block's level, so a
  burst that slows every request of a second does not move it. The block
  mean itself was tried: it follows the level, and found the 10x stall on
  5 % in 23 of 40 synthetic draws where the tail weight found 29.
Ranks keep one burst second or one timed-out request from counting more
than one block.
Worse only when p < alpha / 2 AND the median over the window's blocks is
at least `min_ratio` (default 1.1) times the reference's: with enough
blocks a drift of a few percent is significant; under a tenth it is not
called worse.

The per-request tests of stats.judge() run on the same requests and are
printed in the reason for comparison; they do not decide.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence

from pyctl.experiment.stats import Judgement, _ranks, judge, mann_whitney_u

WIDTH = 1.0  # block width, seconds (see the docstring: half-second blocks fail A/A)
MIN_RATIO = 1.1  # the window's block statistic >= this x the reference's
MIN_PER_BLOCK = 3  # a block with fewer requests is left out (too few to summarize)
EXACT_MAX = 5000  # with ties: every relabelling when there are at most this many
SAMPLES = 5000  # else this many seeded random ones
SEED = 23  # the sample's seed (with n and k: the same blocks, the same p)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def _weight(xs: Sequence[float]) -> float:
    """A block's tail weight: its mean over its median (1.0 for a block
    of zeros: nothing to weigh)."""
    m = _median(xs)
    return math.fsum(xs) / len(xs) / m if m > 0 else 1.0


def relabellings(n: int, k: int) -> int:
    return math.comb(n, k)


def smallest_p(ref_blocks: int, win_blocks: int) -> float:
    """The smallest p the test can give: 1 / C(n, k)."""
    if ref_blocks < 1 or win_blocks < 1:
        return 1.0
    return 1 / relabellings(ref_blocks + win_blocks, win_blocks)


def enough_blocks(ref_blocks: int, win_blocks: int, alpha: float) -> bool:
    """Can the test say p < alpha / 2 at all? (Whether it has power is
    another matter: at 5 + 5 blocks only "every window block above every
    reference block" gets there; docs/experiments.md has the measured power.)"""
    return smallest_p(ref_blocks, win_blocks) < alpha / 2


def after_counts(recovery: float, hold: float) -> bool:
    """Does the reference take the last `hold` seconds of the recovery
    phase (the seconds the after hypothesis calls recovered)? Only when
    the phase is that long: a shorter one is the fault's aftermath. One
    rule for validate (load.py) and the run (evaluate.py)."""
    return recovery >= hold


def cut(
    samples: Iterable[tuple[float, float]], start: float, end: float, width: float = WIDTH
) -> list[list[float]]:
    """Values of (t, value) samples in consecutive full blocks [start + i
    width, start + (i + 1) width) that end by `end` (a last partial block
    is left out: a fraction of a block is not a block); NaN values dropped."""
    n = max(0, int((end - start) / width + 1e-9))
    out: list[list[float]] = [[] for _ in range(n)]
    for t, v in samples:
        i = math.floor((t - start) / width)
        if 0 <= i < n and not math.isnan(v):
            out[i].append(float(v))
    return out


def _combos(n: int, k: int) -> tuple[Iterable[Sequence[int]], int, str]:
    total = relabellings(n, k)
    if total <= EXACT_MAX:
        return itertools.combinations(range(n), k), total, f"exact over all {total} relabellings"
    rng = random.Random(SEED * 1_000_003 + n * 1009 + k)
    idx = list(range(n))
    picks = [rng.sample(idx, k) for _ in range(SAMPLES)]
    return picks, SAMPLES, f"{SAMPLES} of {total} relabellings sampled, seed {SEED}"


def rank_sum_test(
    ref: Sequence[float], win: Sequence[float], *, higher_is_worse: bool = True
) -> tuple[float, str]:
    """(p, method): one-sided, are the window's values ranked higher (lower
    when lower is worse) among the pooled values than chance? The rank sum
    of the window is the permutation statistic: with no ties its exact
    distribution over all C(n, k) relabellings is Mann-Whitney's
    (stats.mann_whitney_u, counted in integers); with ties the midrank
    sums of every relabelling are counted (at most EXACT_MAX of them, else
    a seeded sample of SAMPLES)."""
    n, k = len(ref) + len(win), len(win)
    ranks, ties = _ranks(list(win) + list(ref))
    if not ties or n <= 1:
        _u, p, how = mann_whitney_u(win, ref, greater=higher_is_worse)
        if how == "exact":
            return p, f"exact over all {relabellings(n, k)} relabellings"
        return p, "normal approximation of the rank sum (many blocks)"
    sign = 1.0 if higher_is_worse else -1.0
    obs = sign * sum(ranks[:k])
    combos, total, method = _combos(n, k)
    hits = sum(1 for c in combos if sign * sum(ranks[i] for i in c) >= obs - 1e-9)
    exact = relabellings(n, k) <= EXACT_MAX
    return (hits / total if exact else (1 + hits) / (1 + total)), method + ", ties"


def judge_blocks(
    ref_blocks: Sequence[Sequence[float]],
    win_blocks: Sequence[Sequence[float]],
    *,
    higher_is_worse: bool = True,
    alpha: float = 0.01,
    min_ratio: float = MIN_RATIO,
    ref_what: str = "reference",
) -> Judgement:
    """Is the window worse than the reference, block by block (the
    module's docstring)? Judgement.p_value is the smaller of the two block
    tests' p and .effect its ratio (window / reference); tail_p and
    tail_effect are the tail test's. The per-request judge (stats.judge,
    over the same requests) is in `reason`, for comparison."""
    flat_r = [x for b in ref_blocks for x in b]
    flat_w = [x for b in win_blocks for x in b]
    per_request = judge(flat_r, flat_w, higher_is_worse=higher_is_worse, alpha=alpha)
    shown = f"per-request, for comparison (not deciding): {per_request.reason}"
    rb = [list(b) for b in ref_blocks if len(b) >= MIN_PER_BLOCK]
    wb = [list(b) for b in win_blocks if len(b) >= MIN_PER_BLOCK]
    thin = len(ref_blocks) + len(win_blocks) - len(rb) - len(wb)
    note = f"; {thin} block(s) of fewer than {MIN_PER_BLOCK} requests left out" if thin else ""
    each = alpha / 2
    if len(rb) < 1 or len(wb) < 1:
        why = f"not worse: not judged, {len(wb)} window and {len(rb)} {ref_what} blocks{note}"
        return Judgement(False, 1.0, 1.0, len(flat_r), len(flat_w), f"{why}; {shown}")
    floor = smallest_p(len(rb), len(wb))
    found = []
    for name, summary in (("centre", _median), ("tail", _weight)):
        r = [summary(x) for x in rb]
        w = [summary(x) for x in wb]
        p, method = rank_sum_test(r, w, higher_is_worse=higher_is_worse)
        mr, mw = _median(r), _median(w)
        ratio = mw / mr if mr > 0 else (math.inf if mw > 0 else 1.0)
        bad_ratio = ratio if higher_is_worse else (1 / ratio if ratio else math.inf)
        found.append((name, p, ratio, mr, mw, p < each and bad_ratio >= min_ratio, method))
    (_c, cp, cr, cmr, cmw, cbad, method), (_t, tp, tr, tmr, tmw, tbad, _m) = found
    direction = "higher" if higher_is_worse else "lower"
    if cbad and tbad:
        why = f"worse: the window's blocks {direction} than the {ref_what}'s, centre and tail"
    elif cbad:
        why = f"worse: the window's blocks {direction} than the {ref_what}'s (centre)"
    elif tbad:
        why = f"worse: the window's blocks {direction} than the {ref_what}'s (tail)"
    elif floor >= each:
        why = f"not worse: too few blocks, p cannot go below {floor:.2g} (alpha/2 = {each:g})"
    elif cp >= each and tp >= each:
        why = f"not worse: no block test below alpha/2 = {each:g}"
    else:
        why = f"not worse: significant but under {min_ratio:g}x"
    facts = (
        f"{len(wb)} window vs {len(rb)} {ref_what} blocks of {WIDTH:g}s, block rank-sum "
        f"test ({method}; smallest possible p {floor:.2g}): centre (block medians) "
        f"{cmw:.4g} vs {cmr:.4g} ({cr:.2f}x, p={cp:.3g}); tail (block mean/median) {tmw:.3g} vs "
        f"{tmr:.3g} ({tr:.2f}x, p={tp:.3g}); each at alpha/2 = {each:g} and >= {min_ratio:g}x"
        f"{note}"
    )
    lead_p, lead_r = (cp, cr) if cp <= tp else (tp, tr)
    return Judgement(
        cbad or tbad, lead_p, lead_r, len(flat_r), len(flat_w), f"{why}: {facts}; {shown}", tp, tr
    )


def judge_timed(
    samples: Sequence[tuple[float, float]],
    reference: Sequence[tuple[float, float]],
    window: tuple[float, float],
    *,
    alpha: float = 0.01,
    min_ratio: float = MIN_RATIO,
    higher_is_worse: bool = True,
) -> Judgement:
    """judge_blocks over (t, value) samples: the reference's ranges
    (the baseline, the recovered seconds after the fault) and the fault
    window, each cut into 1 s blocks from its start."""
    ref = [b for a, z in reference for b in cut(samples, a, z)]
    what = "baseline" if len(reference) == 1 else "before+after"
    return judge_blocks(
        ref,
        cut(samples, *window),
        higher_is_worse=higher_is_worse,
        alpha=alpha,
        min_ratio=min_ratio,
        ref_what=what,
    )


__all__ = [
    "MIN_RATIO",
    "WIDTH",
    "after_counts",
    "cut",
    "enough_blocks",
    "judge_blocks",
    "judge_timed",
    "rank_sum_test",
    "smallest_p",
]
