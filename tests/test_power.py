"""Power and minimum detectable effect against brute-force simulation of the tests the reports actually run.

Tolerances: a simulated rejection rate over N seeded draws has binomial SE sqrt(p(1-p)/N); at p = 0.8 and N = 4000
that is 0.0063, so `SIM_TOL` = 0.025 is 4 SE (a correct formula fails by chance about once in 16,000 runs, and the
draws are seeded anyway). Where the formula is an approximation (paired-t power for the permutation test at 7+
seeds) the test states the measured gap and bounds it instead.
"""

import math

import numpy as np
import pytest
from scipy import stats as sps

from glm_lightning.power import (
    _mcnemar_cutoffs, mcnemar_mde, mcnemar_power, sign_flip_mde, sign_flip_power,
)
from glm_lightning.stats import mcnemar_exact, sign_flip_permutation_test

DRAWS = 4000
SIM_TOL = 4 * math.sqrt(0.8 * 0.2 / DRAWS)  # 0.025


def _sign_flip_rejection_rate(effect: float, n: int, alpha: float = 0.05, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    draws = rng.normal(effect, 1.0, size=(DRAWS, n))
    return float(np.mean([sign_flip_permutation_test(d) < alpha for d in draws]))


def test_six_seeds_mde_is_exact_for_the_sign_flip_test():
    # with 6 seeds only the all-same-sign outcome (p = 2/64) is below 0.05: the power formula is exact
    mde = sign_flip_mde(6)
    assert sign_flip_power(mde, 1.0, 6) == pytest.approx(0.8, abs=1e-9)
    assert 1.7 < mde < 1.9  # Phi(z)^6 = 0.8 -> z = 1.79
    assert _sign_flip_rejection_rate(mde, 6) == pytest.approx(0.8, abs=SIM_TOL)
    # and a smaller effect has proportionally less power, also matched by simulation
    assert _sign_flip_rejection_rate(1.0, 6, seed=1) == pytest.approx(sign_flip_power(1.0, 1.0, 6), abs=SIM_TOL)


@pytest.mark.parametrize("n", [8, 10, 16])
def test_t_power_matches_simulated_paired_t_test(n):
    mde = sign_flip_mde(n)
    rng = np.random.default_rng(n)
    x = rng.normal(mde, 1.0, size=(DRAWS, n))
    rate = float(np.mean(sps.ttest_1samp(x, 0.0, axis=1).pvalue < 0.05))
    assert rate == pytest.approx(0.8, abs=SIM_TOL)
    half = sign_flip_mde(n) / 2
    rate_half = float(np.mean(sps.ttest_1samp(rng.normal(half, 1.0, size=(DRAWS, n)), 0.0, axis=1).pvalue < 0.05))
    assert rate_half == pytest.approx(sign_flip_power(half, 1.0, n), abs=SIM_TOL)


@pytest.mark.parametrize("n, alpha", [(7, 0.05), (8, 0.05), (10, 0.05), (16, 0.05), (8, 0.025), (10, 0.025)])
def test_sign_flip_test_power_at_the_mde_is_close_to_80_percent(n, alpha):
    # the permutation test is slightly less powerful than the t-test at small n (measured 0.77 at 7 seeds, 0.78 at
    # 10, 0.80 at 16; 0.75 at 8 seeds with alpha/2 for two Holm comparisons): the stated MDE may be optimistic by a
    # few percent, never by more than this bound
    rate = _sign_flip_rejection_rate(sign_flip_mde(n, alpha=alpha), n, alpha=alpha, seed=2)
    assert 0.8 - 0.05 - SIM_TOL < rate < 0.8 + SIM_TOL


def test_mde_has_exactly_the_target_power_over_a_grid():
    # includes the far-tail cases where scipy's noncentral t returns NaN (8 seeds at alpha 0.025 once broke the root)
    for alpha in (0.05, 0.025, 0.05 / 3, 0.0125, 0.01):
        for n in range(1, 41):
            mde = sign_flip_mde(n, alpha=alpha)
            if math.isfinite(mde):
                assert sign_flip_power(mde, 1.0, n, alpha) == pytest.approx(0.8, abs=1e-6), (n, alpha)


def test_mde_scales_with_sd_and_shrinks_with_n():
    assert sign_flip_mde(10, sd=2.5) == pytest.approx(2.5 * sign_flip_mde(10))
    mdes = [sign_flip_mde(n) for n in (6, 7, 8, 10, 16, 20)]
    assert all(a > b for a, b in zip(mdes, mdes[1:]))
    assert sign_flip_mde(40) == pytest.approx(2.8 / math.sqrt(40), rel=0.05)  # large n: (z_.975 + z_.8) / sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_too_few_seeds_is_underpowered(n):
    # 2/2^n >= 0.05: even when every seed agrees the exact p is 2/2^n, never below 0.05
    assert math.isinf(sign_flip_mde(n)) and sign_flip_power(100.0, 1.0, n) == 0.0
    assert sign_flip_permutation_test([1.0] * n) >= 0.05


def test_holm_alpha_makes_six_seeds_underpowered():
    # two comparisons: the MDE is for alpha/2 = 0.025, and 2/64 = 0.031 cannot reach it
    assert math.isinf(sign_flip_mde(6, alpha=0.025)) and math.isfinite(sign_flip_mde(7, alpha=0.025))


def test_power_arguments_are_checked():
    with pytest.raises(ValueError):
        sign_flip_mde(10, sd=0.0)
    with pytest.raises(ValueError):
        sign_flip_mde(10, power=1.0)
    with pytest.raises(ValueError):
        mcnemar_power(10, 0.7, 0.5)


def test_mcnemar_cutoffs_match_the_exact_test():
    cut = _mcnemar_cutoffs(40, 0.05)
    for m in range(41):
        for k in range(m + 1):
            assert (min(k, m - k) <= cut[m]) == (mcnemar_exact(m - k, k) < 0.05), (m, k)
    assert list(cut[:7]) == [-1, -1, -1, -1, -1, -1, 0]  # 6 discordant problems, all one way: p = 2/64


@pytest.mark.parametrize("n, gain, loss", [(40, 0.2, 0.05), (96, 0.10, 0.04), (24, 0.3, 0.0)])
def test_mcnemar_power_matches_simulation(n, gain, loss):
    rng = np.random.default_rng(n)
    counts = rng.multinomial(n, [gain, loss, 1 - gain - loss], size=DRAWS)
    p_of = {bc: mcnemar_exact(*bc) for bc in {(int(c[1]), int(c[0])) for c in counts}}  # loss/gain counts
    rate = float(np.mean([p_of[int(c[1]), int(c[0])] < 0.05 for c in counts]))
    expected = mcnemar_power(n, gain, loss)
    se = math.sqrt(max(expected * (1 - expected), 0.01) / DRAWS)
    assert rate == pytest.approx(expected, abs=4 * se)


def test_mcnemar_mde():
    mde = mcnemar_mde(96, 0.2)
    assert 0 < mde < 0.2
    assert mcnemar_power(96, (0.2 + mde) / 2, (0.2 - mde) / 2) == pytest.approx(0.8, abs=1e-4)
    assert mcnemar_mde(256, 0.2) < mde  # more problems, smaller MDE
    # 5 problems: at most 5 discordant, p >= 2/32 -> never significant
    assert math.isinf(mcnemar_mde(5, 1.0)) and math.isinf(mcnemar_mde(50, 0.0))


def _tost_rate(margin: float, n: int, alpha: float, seed: int = 0) -> float:
    from glm_lightning.stats import tost_sign_flip

    rng = np.random.default_rng(seed)
    draws = rng.normal(0.0, 1.0, size=(400, n))
    return float(np.mean([tost_sign_flip(d, margin, n_perm=2000) < alpha for d in draws]))


def test_tost_power_against_simulation_of_the_sign_flip_equivalence_test():
    """The planned power of the equivalence test is close to the simulated rejection rate of the test the reports
    run (400 draws: SE 0.02 near 0.8; the formula uses a known SD, so it may be a little optimistic)."""
    from glm_lightning.power import tost_power, tost_seeds

    n = tost_seeds(1.0, 1.0)
    assert n is not None and tost_power(1.0, 1.0, n) >= 0.8 > tost_power(1.0, 1.0, n - 1)
    simulated = _tost_rate(1.0, n, 0.05)
    assert 0.65 <= simulated <= 0.95, (n, simulated)
    assert tost_power(1.0, 1.0, 4) == 0.0  # 1/2^4 > 0.05: the one-sided exact test can never reject
    assert tost_seeds(0.5, 1.0) > tost_seeds(1.0, 1.0)  # a tighter margin needs more seeds
