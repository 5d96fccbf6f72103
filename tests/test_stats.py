"""Statistics helpers against scipy and hand-computed cases, plus a known-significant and a known-null study."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from glm_lightning.stats import (
    bootstrap_ci, format_p, holm, mcnemar_exact, mean_ci, min_attainable_p, paired_bootstrap_ci,
    sign_flip_ci, sign_flip_one_sided, sign_flip_permutation_test, tost_sign_flip, underpowered_text, verdict_text,
    wilson_interval,
)


def test_mean_ci_matches_scipy_t_interval():
    x = [0.61, 0.58, 0.64, 0.60, 0.55, 0.63, 0.59]
    m, lo, hi = mean_ci(x)
    elo, ehi = sps.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=sps.sem(x))
    assert m == pytest.approx(np.mean(x)) and lo == pytest.approx(elo) and hi == pytest.approx(ehi)
    _, lo90, hi90 = mean_ci(x, confidence=0.90)
    assert lo < lo90 < m < hi90 < hi
    assert mean_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    m1, lo1, hi1 = mean_ci([3.0])
    assert m1 == 3.0 and math.isnan(lo1) and math.isnan(hi1)
    with pytest.raises(ValueError, match="empty"):
        mean_ci([])


@pytest.mark.parametrize("k, n", [(0, 20), (3, 10), (10, 10), (57, 164), (1, 1)])
def test_wilson_matches_scipy(k, n):
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)


def test_wilson_edge_cases():
    # 0 failures in m problems: the 95% upper bound on the failure rate is about 3/m
    _, hi = wilson_interval(0, 100)
    assert 0.02 < hi < 0.045
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 3)


def test_mcnemar_exact():
    assert mcnemar_exact(16, 0) == pytest.approx(2 * 0.5 ** 16)  # 3.05e-5 (reference example)
    assert mcnemar_exact(0, 16) == pytest.approx(2 * 0.5 ** 16)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    # hand computed: b=1, c=7 -> 2 * (C(8,0) + C(8,1)) / 2^8 = 18/256
    assert mcnemar_exact(1, 7) == pytest.approx(18 / 256)
    assert mcnemar_exact(12, 30) == pytest.approx(sps.binomtest(12, 42, 0.5).pvalue)


def test_holm_hand_computed():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert holm([0.02]) == [0.02]
    out = holm([0.01, float("nan"), 0.04])  # NaN passes through, m = 2
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)
    assert holm([]) == []
    with pytest.raises(ValueError):
        holm([1.5])


def test_bootstrap_ci_close_to_scipy_percentile():
    rng = np.random.default_rng(1)
    x = rng.normal(0.6, 0.05, size=40)
    lo, hi = bootstrap_ci(x, n_boot=20000)
    ref = sps.bootstrap((x,), np.mean, n_resamples=20000, method="percentile", random_state=2).confidence_interval
    assert lo == pytest.approx(ref.low, abs=0.004) and hi == pytest.approx(ref.high, abs=0.004)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)  # seeded
    # a statistic without axis= falls back to a loop
    lo_m, hi_m = bootstrap_ci(x, stat=lambda v: float(np.median(v)), n_boot=500)
    assert lo_m < np.median(x) < hi_m


def test_paired_bootstrap_is_on_differences():
    a = np.array([0.50, 0.60, 0.55, 0.70, 0.52, 0.58])
    b = a + np.array([0.03, 0.02, 0.04, 0.03, 0.02, 0.05])
    assert paired_bootstrap_ci(a, b) == bootstrap_ci(b - a)
    lo, hi = paired_bootstrap_ci(a, b)
    assert 0.02 <= lo < hi <= 0.05
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap_ci([1, 2], [1, 2, 3])


def test_sign_flip_exact_values():
    assert sign_flip_permutation_test([0.01] * 10) == pytest.approx(2 / 1024)  # 0.00195, all seeds agree
    assert min_attainable_p(10) == pytest.approx(2 / 1024) and min_attainable_p(5) == 0.0625
    assert sign_flip_permutation_test([1, -1, 2, -2]) == 1.0
    assert sign_flip_permutation_test([0, 0, 0]) == 1.0
    # hand computed: d = (1, 2, 3): sums over the 8 patterns are +-6, +-4, +-2, +-0 -> |sum| >= 6 in 2 of 8
    assert sign_flip_permutation_test([1, 2, 3]) == pytest.approx(0.25)


def test_sign_flip_matches_scipy_exact_permutation_test():
    rng = np.random.default_rng(7)
    d = rng.normal(0.4, 1.0, size=9)
    ref = sps.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=np.inf,
                               alternative="two-sided").pvalue
    assert sign_flip_permutation_test(d) == pytest.approx(ref)


def test_sign_flip_monte_carlo_close_to_exact():
    rng = np.random.default_rng(3)
    d = rng.normal(0.3, 1.0, size=21)  # n > 20: Monte Carlo; exact value by enumerating 2^21 subset sums
    from glm_lightning.stats import _subset_sums

    exact = float(np.mean(np.abs(d.sum() - 2 * _subset_sums(d)) >= abs(d.sum()) - 1e-12))
    mc = sign_flip_permutation_test(d, n_perm=40000, seed=0)
    assert mc == pytest.approx(exact, abs=0.01)
    assert sign_flip_permutation_test(d, n_perm=2000, seed=1) == sign_flip_permutation_test(d, n_perm=2000, seed=1)


def _study(effect: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """10 seeds; the seed effect (shared by both arms) is much larger than the treatment effect."""
    rng = np.random.default_rng(seed)
    seed_effect = rng.normal(0.55, 0.05, size=10)
    control = seed_effect + rng.normal(0, 0.004, size=10)
    return control, seed_effect + effect + rng.normal(0, 0.004, size=10)


def test_known_significant_synthetic_study():
    control, variant = _study(effect=0.03, seed=0)
    d = variant - control
    p = sign_flip_permutation_test(d)
    lo, hi = paired_bootstrap_ci(control, variant)
    assert p == pytest.approx(2 / 1024)
    assert 0 < lo < 0.03 < hi
    # unpaired intervals overlap heavily: pairing is what makes the effect visible
    _, clo, chi = mean_ci(control)
    _, vlo, vhi = mean_ci(variant)
    assert vlo < chi
    text = verdict_text(float(d.mean()), lo, hi, p, n=10, variant="diverse", control="repeated", scale=100,
                        unit="points")
    assert text.startswith("diverse beats repeated by +3.") and "points [95% CI" in text and "p=0.002" in text


def test_known_null_synthetic_study():
    control, variant = _study(effect=0.0, seed=1)
    d = variant - control
    p = sign_flip_permutation_test(d)
    lo, hi = paired_bootstrap_ci(control, variant)
    assert p > 0.05 and lo < 0 < hi
    p_adj = holm([p, 0.001])[0]
    assert p_adj >= p
    text = verdict_text(float(d.mean()), lo, hi, p, n=10, p_adjusted=p_adj)
    assert text == f"no significant difference at n=10 seeds (p={format_p(p_adj)}, Holm-adjusted)"


def test_verdict_formats():
    assert verdict_text(0.031, 0.012, 0.050, 0.002, n=10, scale=100, unit="points") == \
        "variant beats control by +3.1 points [95% CI 1.2, 5.0], p=0.002"
    assert verdict_text(0.01, -0.01, 0.03, 0.43, n=10, p_adjusted=0.43) == \
        "no significant difference at n=10 seeds (p=0.43, Holm-adjusted)"
    worse = verdict_text(-0.02, -0.031, -0.009, 0.004, n=10, scale=100, unit="points", p_adjusted=0.008)
    assert worse == "variant is worse than control by -2.0 points [95% CI -3.1, -0.9], p=0.008 (Holm-adjusted)"
    # lower-is-better metric: a negative difference is a win
    assert verdict_text(-0.05, -0.08, -0.02, 0.002, n=10, higher_is_better=False, digits=2).startswith(
        "variant beats control by -0.05")
    assert "smallest attainable p is 0.062" in verdict_text(0.1, 0.05, 0.15, 0.0625, n=5)
    assert "borderline" in verdict_text(0.01, -0.001, 0.02, 0.01, n=10)
    assert format_p(3.052e-5) == "3.1e-05" and format_p(0.00195) == "0.002" and format_p(0.2148) == "0.21"


# --- the interval that inverts the sign-flip test ---------------------------------------------------------------
def test_sign_flip_ci_agrees_with_the_test_on_random_studies():
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(2, 13))
        d = np.round(rng.normal(rng.normal(0, 1), 1, size=n), int(rng.integers(0, 3)))  # rounding makes ties
        lo, hi = sign_flip_ci(d)
        p = sign_flip_permutation_test(d)
        assert (p < 0.05) == (not lo <= 0 <= hi), (d.tolist(), lo, hi, p)
        assert lo <= d.mean() <= hi


def test_sign_flip_ci_endpoints_are_where_the_test_starts_rejecting():
    d = np.array([4.1, -0.7, 2.3, 5.0, 1.2, 3.3, -1.5, 2.8, 0.4, 3.9])
    lo, hi = sign_flip_ci(d)
    eps = 1e-6
    # brute force: the shifted test accepts just inside both ends and rejects just outside
    assert sign_flip_permutation_test(d - (lo + eps)) >= 0.05 > sign_flip_permutation_test(d - (lo - eps))
    assert sign_flip_permutation_test(d - (hi - eps)) >= 0.05 > sign_flip_permutation_test(d - (hi + eps))


def test_sign_flip_ci_small_n():
    # 2 seeds that agree: a bootstrap interval would be [min, max] and exclude 0, but p = 0.5 -> no finite interval
    assert sign_flip_permutation_test([0.03, 0.05]) == 0.5
    assert sign_flip_ci([0.03, 0.05]) == (-math.inf, math.inf)
    assert sign_flip_ci([1.0, 2.0, 3.0, 4.0, 5.0]) == (-math.inf, math.inf)  # 5 seeds: p >= 0.0625 always
    # 6 seeds: the test rejects only when all signs agree, so the interval is [min, max]
    d = [0.5, 1.5, -0.2, 2.0, 0.9, 1.1]
    assert sign_flip_ci(d) == (min(d), max(d))


def test_sign_flip_ci_coverage_by_simulation():
    # 8 seeds: k = ceil(0.05 * 128) - 1 = 6, exact coverage 1 - 12/256 = 0.953 for symmetric differences; 2000
    # draws give SE 0.0047, so 4 SE = 0.019
    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(2000):
        lo, hi = sign_flip_ci(rng.standard_t(3, size=8) + 0.7)
        hits += lo <= 0.7 <= hi
    assert hits / 2000 == pytest.approx(1 - 12 / 256, abs=0.019)


def test_sign_flip_ci_large_n_uses_t_interval():
    d = np.random.default_rng(2).normal(0.5, 1.0, size=25)
    assert sign_flip_ci(d) == pytest.approx(mean_ci(d)[1:])


# --- verdicts that say what a null result can mean ---------------------------------------------------------------
def test_null_verdict_states_the_mde():
    text = verdict_text(0.004, -0.01, 0.02, 0.43, n=10, p_adjusted=0.6, scale=100, unit="points", mde=0.021,
                        n_tests=2)
    assert text == ("no significant difference at n=10 seeds (p=0.60, Holm-adjusted); an effect of ±2.1 points "
                    "would be detected 80% of the time (MDE)")
    assert "underpowered" in verdict_text(0.0, 0, 0, 0.5, n=10, mde=math.inf)


@pytest.mark.parametrize("n, n_tests, floor", [(2, 1, "0.50"), (5, 1, "0.062"), (6, 2, "0.062")])
def test_underpowered_verdicts(n, n_tests, floor):
    text = verdict_text(0.05, -math.inf, math.inf, 1.0, n=n, n_tests=n_tests, mde=math.inf)
    assert f"underpowered: with {n} seeds" in text and f"smallest attainable p is {floor}" in text
    assert "would be detected" not in text
    needed = 7 if n_tests == 2 else 6
    assert text.endswith(f"at least {needed} seeds are needed")
    assert underpowered_text(10, 0.05, 1) is None and underpowered_text(6, 0.05, 1) is None


# --- equivalence (TOST) ----------------------------------------------------------------------------------------------
def _one_sided_by_hand(d, shift, greater):
    """Every sign pattern written out (itertools), independent of the subset-sum enumeration."""
    import itertools

    e = [x - shift for x in d]
    if not greater:
        e = [-x for x in e]
    total = sum(e)
    pats = list(itertools.product((1, -1), repeat=len(e)))
    return sum(sum(s * x for s, x in zip(pat, e)) >= total - 1e-12 for pat in pats) / len(pats)


@pytest.mark.parametrize("d", [[0.3, -0.2, 0.5, 0.1, -0.4, 0.25, 0.05],
                               [-1.2, -0.8, -1.5, -0.9, -1.1, -1.3]])
def test_one_sided_sign_flip_and_tost_by_hand(d):
    for shift in (-2.0, -0.5, 0.0, 0.7):
        assert sign_flip_one_sided(d, shift, "greater") == pytest.approx(_one_sided_by_hand(d, shift, True))
        assert sign_flip_one_sided(d, shift, "less") == pytest.approx(_one_sided_by_hand(d, shift, False))
    for margin in (0.5, 1.0, 2.0, 5.0):
        expected = max(_one_sided_by_hand(d, -margin, True), _one_sided_by_hand(d, margin, False))
        assert tost_sign_flip(d, margin) == pytest.approx(expected)


def test_tost_equivalence_behaves():
    d = [-3.0 + x for x in np.linspace(-2.56, 2.56, 20)]  # a significant -3.0 [-3.8, -2.2]
    assert sign_flip_permutation_test(d) < 0.05
    assert tost_sign_flip(d, 5.0) < 0.05  # ... yet inside ±5: equivalent
    assert tost_sign_flip(d, 3.0) > 0.4  # the mean sits at the margin: not equivalent
    assert tost_sign_flip(d, 2.0) > 0.99  # the whole interval lies beyond the margin
    assert tost_sign_flip([0.0] * 6, 1.0) == pytest.approx(1 / 64)  # the smallest one-sided p of 6 pairs
    with pytest.raises(ValueError, match="margin"):
        tost_sign_flip(d, 0.0)
    with pytest.raises(ValueError, match="alternative"):
        sign_flip_one_sided(d, 0.0, "both")


def test_tost_monte_carlo_for_many_pairs_agrees_with_the_t_version():
    d = np.random.default_rng(5).normal(0.4, 1.0, size=40)
    p = tost_sign_flip(d, 1.0, n_perm=20000)
    se = np.std(d, ddof=1) / np.sqrt(d.size)
    t_p = max(sps.t.sf((d.mean() + 1.0) / se, d.size - 1), sps.t.cdf((d.mean() - 1.0) / se, d.size - 1))
    assert p == pytest.approx(t_p, abs=0.02)
