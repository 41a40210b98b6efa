"""pyctl.experiment.stats: the Mann-Whitney U judge and recovery_time.

p-values are checked against scipy.stats.mannwhitneyu where scipy is
importable (it is a dev tool here, not a dependency), and always against
textbook values computed by hand."""

from __future__ import annotations

import math
import random

import pytest

from pyctl.experiment.stats import fisher_greater, judge, mann_whitney_u, recovery_time, tail_test

try:
    from scipy.stats import mannwhitneyu
except ImportError:  # pragma: no cover - scipy is optional
    mannwhitneyu = None

needs_scipy = pytest.mark.skipif(mannwhitneyu is None, reason="scipy is not importable")


# ---- textbook values -----------------------------------------------------------


def test_exact_textbook_complete_separation():
    # n1 = n2 = 3, every window value above every baseline value: U = 9,
    # P(U >= 9) = 1 / C(6, 3) = 1/20.
    u, p, method = mann_whitney_u([4, 5, 6], [1, 2, 3], greater=True)
    assert (u, method) == (9, "exact")
    assert p == pytest.approx(1 / 20)
    # the other direction: P(U <= 9) = 1
    assert mann_whitney_u([4, 5, 6], [1, 2, 3], greater=False)[1] == pytest.approx(1.0)


def test_exact_textbook_counts():
    # n1 = 2, n2 = 3: the 10 orderings give U = 0,1,2,2,3,3,4,4,5,6;
    # window [2, 5] vs [1, 3, 4]: ranks 2 and 5, U = 7 - 3 = 4, P(U >= 4) = 4/10.
    u, p, _ = mann_whitney_u([2, 5], [1, 3, 4], greater=True)
    assert u == 4 and p == pytest.approx(0.4)
    assert mann_whitney_u([2, 5], [1, 3, 4], greater=False)[1] == pytest.approx(0.8)


def test_normal_with_ties_by_hand():
    # 25 + 25 values, two tie groups (0 x 25, 1 x 25), window all ones:
    # U = 625, mu = 312.5, var = 625/12 * (51 - 2*(25^3-25)/(50*49)) = 2678.57...
    w, b = [1.0] * 25, [0.0] * 25
    u, p, method = mann_whitney_u(w, b, greater=True)
    var = 625 / 12 * (51 - 2 * (25**3 - 25) / (50 * 49))
    z = (625 - 312.5 - 0.5) / math.sqrt(var)
    assert method == "normal" and u == 625
    assert p == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=1e-12)


def test_all_equal_is_no_evidence():
    j = judge([0.02] * 50, [0.02] * 50)
    assert not j.worse and j.p_value == 1.0 and j.effect == 0.0


# ---- against scipy -------------------------------------------------------------


@needs_scipy
@pytest.mark.parametrize(
    "n1,n2,ties",
    [
        (3, 4, False),
        (8, 8, False),
        (12, 20, False),
        (20, 20, False),
        (21, 30, False),
        (60, 200, False),
        (10, 10, True),
        (40, 50, True),
        (300, 300, True),
    ],
)
def test_p_values_match_scipy(n1: int, n2: int, ties: bool):
    rnd = random.Random(n1 * 1000 + n2)
    for shift in (0.0, 0.4, -0.4):
        w = [rnd.gauss(shift, 1) for _ in range(n1)]
        b = [rnd.gauss(0, 1) for _ in range(n2)]
        if ties:
            w, b = [round(x * 2) for x in w], [round(x * 2) for x in b]
        for greater in (True, False):
            u, p, method = mann_whitney_u(w, b, greater=greater)
            ref = mannwhitneyu(
                w,
                b,
                alternative="greater" if greater else "less",
                method="exact" if method == "exact" else "asymptotic",
                use_continuity=True,
            )
            assert u == ref.statistic
            assert p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-15)
            # exact only without ties and for small samples
            assert (method == "exact") == (not ties and min(n1, n2) <= 20)


@needs_scipy
def test_exact_and_normal_agree_near_the_boundary():
    rnd = random.Random(7)
    w = [rnd.gauss(0.5, 1) for _ in range(20)]
    b = [rnd.gauss(0, 1) for _ in range(20)]
    _, p_exact, m = mann_whitney_u(w, b)
    ref = mannwhitneyu(w, b, alternative="greater", method="asymptotic")
    assert m == "exact" and abs(p_exact - ref.pvalue) < 5e-3


# ---- the judge -----------------------------------------------------------------


def test_judge_worse_latency():
    rnd = random.Random(1)
    base = [0.020 + rnd.expovariate(1000) for _ in range(400)]
    fault = [
        0.020 + rnd.expovariate(1000) + (0.05 if rnd.random() < 0.3 else 0) for _ in range(400)
    ]
    j = judge(base, fault)
    assert j.worse and j.p_value < 1e-6 and j.effect > 0.2
    assert (j.baseline_n, j.window_n) == (400, 400)
    assert j.reason.startswith("worse: window higher than baseline")
    assert "Cliff's delta" in j.reason


def test_judge_only_the_bad_direction_counts():
    base = [float(x) for x in range(100)]
    better = [x - 50 for x in base]
    j = judge(base, better)  # lower latency: not worse
    assert not j.worse and j.p_value > 0.99 and j.effect < 0
    # throughput: lower is worse
    j2 = judge(base, better, higher_is_worse=False)
    assert j2.worse and j2.effect > 0.2
    assert "lower than baseline" in j2.reason


def test_judge_significant_but_small_is_not_worse():
    rnd = random.Random(3)
    base = [rnd.gauss(0, 1) for _ in range(20000)]
    win = [rnd.gauss(0.1, 1) for _ in range(20000)]  # delta ~ 0.056
    j = judge(base, win)
    assert j.p_value < 1e-6 and 0 < j.effect < 0.2 and not j.worse
    assert "significant but small" in j.reason


def test_judge_same_distribution_not_worse():
    rnd = random.Random(4)
    j = judge([rnd.gauss(0, 1) for _ in range(300)], [rnd.gauss(0, 1) for _ in range(300)])
    assert not j.worse and j.p_value > 0.01


def test_judge_empty_and_nan():
    j = judge([], [1.0, 2.0])
    assert not j.worse and j.baseline_n == 0 and "no samples in the baseline" in j.reason
    j = judge([1.0], [])
    assert not j.worse and "no samples in the window" in j.reason
    j = judge([1.0, 2.0, 3.0, math.nan], [7.0, 8.0, 9.0, math.nan])
    assert (j.baseline_n, j.window_n) == (3, 3) and "2 NaN values dropped" in j.reason


def test_effect_is_cliffs_delta():
    # window [3, 4] vs baseline [1, 3]: pairs (3>1, 3=3, 4>1, 4>3): (3 - 0)/4 with the tie 0
    j = judge([1.0, 3.0], [3.0, 4.0])
    assert j.effect == pytest.approx((3 - 0) / 4)


def test_a_tail_only_stall_is_worse_though_the_ranks_cancel():
    # tokenizer-stall's CI run: 1 request in 5 stalled 50 ms while the rest
    # ran ~8 % faster: U found nothing (p = 0.95), the tail test must.
    rnd = random.Random(5)
    base = [0.0061 + rnd.gauss(0, 0.0008) for _ in range(240)]
    win = [0.0056 + rnd.gauss(0, 0.0008) + (0.05 if rnd.random() < 0.2 else 0) for _ in range(240)]
    shift_only = judge(base, win, alpha=0.05, min_effect=0.1, min_tail_effect=2.0)
    assert not shift_only.worse  # what the rank test alone said
    j = judge(base, win, alpha=0.05, min_effect=0.1)
    assert j.worse and j.tail_p < 1e-6 and j.tail_effect > 0.1, j.reason
    assert j.reason.startswith("worse: the window's upper tail is heavier"), j.reason


def test_the_tail_of_lower_is_worse_is_the_low_one():
    rnd = random.Random(6)
    base = [100 + rnd.gauss(0, 5) for _ in range(300)]
    win = [(10.0 if rnd.random() < 0.2 else 100 + rnd.gauss(0, 5)) for _ in range(300)]
    assert judge(base, win, higher_is_worse=False).worse
    assert not judge(base, win, higher_is_worse=True).worse


def test_two_tests_keep_the_false_alarm_rate_at_alpha():
    # Same distribution, 400 trials: each test runs at alpha/2, so the
    # judge says worse in about alpha of them, not 2 alpha.
    rnd = random.Random(7)
    alarms = sum(
        judge([rnd.expovariate(1) for _ in range(120)], [rnd.expovariate(1) for _ in range(120)],
              alpha=0.05, min_effect=0.0, min_tail_effect=0.0).worse
        for _ in range(400)
    )  # fmt: skip
    assert alarms <= 30, alarms  # 5 % of 400 is 20; 2 alpha would be ~40


@pytest.mark.parametrize(
    "a, n1, c, n2",
    [(12, 240, 12, 240), (48, 240, 12, 240), (0, 5, 3, 7), (5, 5, 0, 7), (3, 10, 1, 30),
     # a long window (40,000 requests): in exact integers this took minutes
     (3200, 40000, 2000, 40000)],
)  # fmt: skip
def test_fisher_exact_by_hand_and_against_scipy(a: int, n1: int, c: int, n2: int) -> None:
    got = fisher_greater(a, n1, c, n2)
    if n1 + n2 <= 1000:  # by the definition, in fractions (minutes for the long window)
        from fractions import Fraction

        k, n = a + c, n1 + n2
        want = sum(
            Fraction(math.comb(k, x) * math.comb(n - k, n1 - x), math.comb(n, n1))
            for x in range(a, min(k, n1) + 1)
        )
        assert got == pytest.approx(float(want), rel=1e-9)
    try:
        from scipy.stats import fisher_exact
    except ImportError:  # pragma: no cover - scipy is optional
        return
    _, p = fisher_exact([[a, n1 - a], [c, n2 - c]], alternative="greater")
    assert got == pytest.approx(p, rel=1e-9)


def test_tail_cut_is_the_baselines_p95():
    base = [float(x) for x in range(1, 101)]  # p95 (nearest rank) = 95
    p, effect, cut, nw, nb = tail_test(base, [96.0] * 10 + [1.0] * 90)
    assert (cut, nb, nw) == (95.0, 5, 10) and effect == pytest.approx(0.05)


# ---- recovery_time -------------------------------------------------------------


def _wins(oks: str, start: float = 0.0, width: float = 1.0) -> list[tuple[float, float, bool]]:
    return [(start + i * width, start + (i + 1) * width, c == "1") for i, c in enumerate(oks)]


def test_recovery_immediate():
    assert recovery_time(_wins("0000111111"), fault_end=4.0, hold=3.0) == 0.0


def test_recovery_after_bad_windows():
    # fault ends at 4; windows 4..6 bad; ok from 7 on
    assert recovery_time(_wins("00000001111"), fault_end=4.0, hold=3.0) == 3.0


def test_recovery_must_hold_for_the_whole_hold():
    # ok 5-6, bad 7, ok 8-12: the first run is too short
    assert recovery_time(_wins("0000011011111"), fault_end=4.0, hold=3.0) == 4.0


def test_recovery_never():
    assert recovery_time(_wins("0000111"), fault_end=4.0, hold=5.0) is None
    assert recovery_time(_wins("00000000"), fault_end=4.0, hold=1.0) is None
    assert recovery_time([], fault_end=4.0, hold=1.0) is None


def test_recovery_window_straddling_fault_end():
    # windows of 1 s from 0.5; fault ends at 4.0 inside window [3.5, 4.5), which is ok
    w = _wins("000111111", start=0.5)
    assert recovery_time(w, fault_end=4.0, hold=2.0) == 0.0
    # not ok: recovery starts at the next window, 4.5
    w = _wins("000011111", start=0.5)
    assert recovery_time(w, fault_end=4.0, hold=2.0) == pytest.approx(0.5)


def test_recovery_gap_breaks_the_run_and_order_does_not_matter():
    w = [(5.0, 6.0, True), (8.0, 9.0, True), (9.0, 10.0, True), (10.0, 11.0, True)]
    assert recovery_time(list(reversed(w)), fault_end=4.0, hold=2.5) == 4.0
    # irregular probe samples (start, end) pairs work the same
    w = [(4.0, 4.7, False), (4.7, 5.9, True), (5.9, 7.0, True)]
    assert recovery_time(w, fault_end=4.0, hold=2.0) == pytest.approx(0.7)
