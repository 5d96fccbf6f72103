"""Power and minimum detectable effect (MDE) of the paired tests the reports use, so a null result can say what
power says, "an effect of ±X would be detected 80% of the time", or "underpowered", instead of only "not
significant". (Which effects the data exclude comes from the confidence interval, not from the MDE.)

- `sign_flip_power` / `sign_flip_mde`: paired differences of per-seed metrics, tested with the exact two-sided
  sign-flip permutation test (`glm_lightning.stats.sign_flip_permutation_test`), differences ~ Normal(delta, sd).
  * If 2/2^n >= alpha the test can never reject: power 0, MDE = inf ("underpowered").
  * If only the two all-same-sign patterns reach p < alpha (4/2^n >= alpha, e.g. 6 seeds), the test rejects exactly
    when every difference has the same sign: power = Phi(z)^n + Phi(-z)^n with z = delta/sd (exact).
  * Otherwise the paired t-test's power (noncentral t, df = n - 1, noncentrality delta sqrt(n) / sd), which the
    permutation test approaches as n grows; in simulation the permutation test has 0.75-0.80 power at this MDE
    for 7-16 seeds, also at alpha/2 (tests/test_power.py), so the stated MDE is slightly optimistic at 7-10 seeds.
- `tost_power` / `tost_seeds`: the equivalence test at ±margin (two one-sided sign-flip tests, `stats.tost_sign_flip`)
  on n paired differences ~ Normal(effect, sd): 0 while the one-sided test cannot reach p < alpha (1/2^n >= alpha),
  else the paired-t TOST power with a known SD, Phi((m - t se - effect)/se) - Phi((-m + t se - effect)/se), se =
  sd/sqrt(n), t the one-sided t quantile (the SD is estimated from a pilot or an earlier study: approximate). Used
  to plan the seeds an equivalence claim needs before a study runs (`glm_lightning.sweep.plan`).
- `mcnemar_power` / `mcnemar_mde`: paired binary outcomes (pass/fail of two checkpoints on the same n problems),
  exact McNemar test; power summed exactly over the number of discordant problems and their split.

All use two-sided alpha (default 0.05) and target power 0.8. For several Holm-adjusted comparisons pass
alpha / m: Holm's first step, the bar an effect must clear when the other comparisons are null.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import optimize
from scipy import stats as sps

from glm_lightning.stats import min_attainable_p

__all__ = ["sign_flip_power", "sign_flip_mde", "tost_power", "tost_seeds", "mcnemar_power", "mcnemar_mde", "POWER"]

POWER = 0.8


def _check(alpha: float, power: float) -> None:
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must be in (0, 1), got alpha={alpha}, power={power}")


def _same_sign_only(n: int, alpha: float) -> bool:
    """True when only the all-same-sign outcomes (p = 2/2^n) reach p < alpha; the next attainable p is 4/2^n."""
    return min_attainable_p(n) < alpha <= 2 * min_attainable_p(n)


def sign_flip_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided sign-flip test on n paired differences ~ Normal(effect, sd) (see the module doc)."""
    _check(alpha, 0.5)
    if n < 1 or sd <= 0:
        raise ValueError(f"need n >= 1 and sd > 0, got n={n}, sd={sd}")
    if min_attainable_p(n) >= alpha:
        return 0.0
    z = abs(effect) / sd
    if _same_sign_only(n, alpha):
        return float(sps.norm.cdf(z) ** n + sps.norm.cdf(-z) ** n)
    return _t_power(z, n, alpha)


def _t_power(z: float, n: int, alpha: float) -> float:
    """Two-sided paired t-test power at standardised effect z = delta / sd with n pairs. (scipy's noncentral t can
    return NaN far in a tail; a NaN tail probability there is 0.)"""
    df = n - 1
    crit = float(sps.t.ppf(1 - alpha / 2, df))
    nc = z * math.sqrt(n)
    upper, lower = float(sps.nct.sf(crit, df, nc)), float(sps.nct.cdf(-crit, df, nc))
    return min(1.0, (0.0 if math.isnan(upper) else upper) + (0.0 if math.isnan(lower) else lower))


def sign_flip_mde(n: int, sd: float = 1.0, alpha: float = 0.05, power: float = POWER) -> float:
    """Smallest |effect| the sign-flip test detects with probability `power` (in the units of sd; sd=1 gives it in
    SDs of the paired differences). inf when the test can never reject at this n."""
    _check(alpha, power)
    if n < 1 or not sd > 0:
        raise ValueError(f"need n >= 1 and sd > 0, got n={n}, sd={sd}")
    if min_attainable_p(n) >= alpha:
        return math.inf
    if _same_sign_only(n, alpha):
        # exact rejection rule "all n differences share a sign": solve Phi(z)^n + Phi(-z)^n = power
        f = lambda z: float(sps.norm.cdf(z) ** n + sps.norm.cdf(-z) ** n) - power  # noqa: E731
        return sd * float(optimize.brentq(f, 0.0, 10.0, xtol=1e-10))
    df = n - 1
    hi = (float(sps.t.ppf(1 - alpha / 2, df)) + 4.0) / math.sqrt(n)  # power(hi) > 0.99
    z = optimize.brentq(lambda x: _t_power(x, n, alpha) - power, 0.0, hi, xtol=1e-10)
    return sd * float(z)


def tost_power(margin: float, sd: float, n: int, alpha: float = 0.05, effect: float = 0.0) -> float:
    """Probability that the equivalence test at ±margin shows equivalence with n paired seeds (module doc)."""
    _check(alpha, 0.5)
    if not margin > 0 or not sd > 0 or n < 2:
        raise ValueError(f"need margin > 0, sd > 0 and n >= 2, got {margin}, {sd}, {n}")
    if 0.5 ** n >= alpha:  # the one-sided exact test's smallest p is 1/2^n
        return 0.0
    se = sd / math.sqrt(n)
    t = float(sps.t.ppf(1 - alpha, n - 1))
    if margin <= t * se:
        return 0.0
    return float(max(0.0, sps.norm.cdf((margin - t * se - effect) / se) - sps.norm.cdf((-margin + t * se - effect) / se)))


def tost_seeds(margin: float, sd: float, alpha: float = 0.05, power: float = POWER, max_n: int = 1000) -> int | None:
    """Fewest paired seeds with `tost_power` >= power when the true difference is 0 (None: more than max_n)."""
    _check(alpha, power)
    return next((n for n in range(2, max_n + 1) if tost_power(margin, sd, n, alpha) >= power), None)


@functools.lru_cache(maxsize=None)
def _mcnemar_cutoffs(n: int, alpha: float) -> np.ndarray:
    """c[m] for m = 0..n discordant problems: the exact McNemar test rejects at p < alpha iff min(k, m - k) <= c[m]
    (k = gains; its p is min(1, 2 BinomCDF(min(k, m-k); m, 1/2))); -1 when no split rejects."""
    cut = np.full(n + 1, -1, dtype=np.int64)
    for m in range(1, n + 1):
        half = np.arange((m - 1) // 2 + 1)
        ok = np.flatnonzero(2 * sps.binom.cdf(half, m, 0.5) < alpha)
        cut[m] = int(ok[-1]) if ok.size else -1
    return cut


def mcnemar_power(n: int, p_gain: float, p_loss: float, alpha: float = 0.05) -> float:
    """Exact power of the two-sided exact McNemar test on n paired problems where each problem independently is a
    gain (fails before, passes after) with probability p_gain and a loss with probability p_loss:
    sum over m discordant ~ Binom(n, p_gain + p_loss) and k gains ~ Binom(m, p_gain / (p_gain + p_loss))."""
    _check(alpha, 0.5)
    if n < 0 or p_gain < 0 or p_loss < 0 or p_gain + p_loss > 1 + 1e-12:
        raise ValueError(f"need n >= 0 and p_gain, p_loss >= 0 with sum <= 1, got {n}, {p_gain}, {p_loss}")
    psi = min(1.0, p_gain + p_loss)
    if psi == 0 or n == 0:
        return 0.0
    pi = min(1.0, p_gain / psi)
    cut = _mcnemar_cutoffs(n, alpha)
    m = np.flatnonzero(cut >= 0)
    c = cut[m]
    reject = sps.binom.cdf(c, m, pi) + sps.binom.sf(m - c - 1, m, pi)  # k <= c or k >= m - c (disjoint: c < m/2)
    return float(min(1.0, np.sum(sps.binom.pmf(m, n, psi) * reject)))


def mcnemar_mde(n: int, discordant: float, alpha: float = 0.05, power: float = POWER) -> float:
    """Smallest pass-rate change |p_gain - p_loss| the exact McNemar test detects with probability `power`, for n
    problems of which a fraction `discordant` = p_gain + p_loss change outcome (estimate it as (b + c) / n).
    inf when even a one-sided split (all changes in one direction) stays below `power`."""
    _check(alpha, power)
    if not 0 < discordant <= 1 or n < 1:
        return math.inf
    f = lambda delta: mcnemar_power(n, (discordant + delta) / 2, (discordant - delta) / 2, alpha) - power  # noqa: E731
    if f(discordant) < 0:
        return math.inf
    return float(optimize.brentq(f, 0.0, discordant, xtol=1e-6))
