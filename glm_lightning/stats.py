"""Statistics for comparing runs across seeds (and checkpoints across problems), with honest small-sample behaviour.

- `mean_ci`: mean and Student-t interval across seeds.
- `wilson_interval`: interval for a single pass rate (k of n problems).
- `mcnemar_exact`: two checkpoints, paired pass/fail on the same problems (exact binomial on discordant pairs).
- `bootstrap_ci` / `paired_bootstrap_ci`: percentile bootstrap of a statistic / of paired differences (b - a).
- `sign_flip_permutation_test`: paired test on per-seed differences; exact over all 2^n sign patterns for n <= 20
  (the smallest attainable two-sided p is 2 / 2^n, e.g. 0.00195 for 10 seeds, 0.0625 for 5).
- `sign_flip_ci`: the interval of shifts that test does not reject (Hartigan's subset means), so the interval
  excludes 0 exactly when the test gives p < alpha; unbounded with 5 or fewer pairs.
- `holm`: Holm step-down adjustment across several comparisons.
- `verdict_text`: one plain-language sentence from a difference, its CI and p.

Every function takes plain sequences of numbers and returns Python floats. Formulas follow the project's
statistics reference (rl-and-verifier reference, section 5); scipy is used wherever it has the distribution or test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy import stats as sps

__all__ = [
    "mean_ci", "wilson_interval", "mcnemar_exact", "holm", "bootstrap_ci", "paired_bootstrap_ci",
    "sign_flip_permutation_test", "sign_flip_ci", "min_attainable_p", "format_p", "underpowered_text",
    "verdict_text",
]

EXACT_SIGN_FLIP_MAX_N = 20


def _as_1d(values: Sequence[float] | np.ndarray, name: str = "values") -> np.ndarray:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or inf: {x.tolist()}")
    return x


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t confidence interval: `mean ± t_{(1+c)/2, n-1} · sd / sqrt(n)`.

    With a single value the interval is undefined and returned as (nan, nan); with zero spread it collapses to the
    mean.
    """
    _check_confidence(confidence)
    x = _as_1d(values)
    m = float(x.mean())
    if x.size == 1:
        return m, math.nan, math.nan
    se = float(x.std(ddof=1)) / math.sqrt(x.size)
    half = float(sps.t.ppf((1 + confidence) / 2, x.size - 1)) * se
    return m, m - half, m + half


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion `successes / n` (same as scipy's
    `binomtest(k, n).proportion_ci(method="wilson")`). With n = 0 nothing is known: (0, 1)."""
    _check_confidence(confidence)
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    z = float(sps.norm.ppf((1 + confidence) / 2))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact McNemar test: two-sided binomial p of the discordant counts (b = A passes & B fails, c = A fails &
    B passes) under H0 p = 1/2, i.e. `min(1, 2 · BinomCDF(min(b, c); b + c, 1/2))`. 1.0 when b + c = 0."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return float(min(1.0, sps.binomtest(int(min(b, c)), int(b + c), 0.5).pvalue))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values in the original order: sorted ascending, `p~_(i) = max_{j<=i} min(1, (m-j+1) p_(j))`.

    Reject H_i at level alpha iff `p~_i <= alpha`. NaN entries (comparisons that could not be computed) stay NaN and
    do not count towards m.
    """
    p = np.asarray(list(pvalues), dtype=np.float64)
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must lie in [0, 1], got {p.tolist()}")
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if m == 0:
        return out.tolist()
    order = ok[np.argsort(p[ok], kind="stable")]
    running = 0.0
    for rank, idx in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[idx]))
        out[idx] = running
    return [float(v) for v in out]


def _bootstrap_stats(x: np.ndarray, stat: Callable[..., float], n_boot: int, seed: int) -> np.ndarray:
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    samples = x[idx]
    try:  # vectorised statistics (np.mean, np.median, ...) accept axis=
        out = np.asarray(stat(samples, axis=1), dtype=np.float64)
        if out.shape == (n_boot,):
            return out
    except TypeError:
        pass
    return np.array([float(stat(row)) for row in samples])


def bootstrap_ci(values: Sequence[float], stat: Callable[..., float] = np.mean, n_boot: int = 10000,
                 confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat(values)`: resample with replacement `n_boot` times (seeded)."""
    _check_confidence(confidence)
    x = _as_1d(values)
    boots = _bootstrap_stats(x, stat, n_boot, seed)
    alpha = 1 - confidence
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], stat: Callable[..., float] = np.mean,
                        n_boot: int = 10000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat(b - a)` over matched pairs (a = control, b = variant): the pairs are
    resampled together, so the seed-to-seed variation shared by both arms cancels."""
    xa, xb = _as_1d(a, "a"), _as_1d(b, "b")
    if xa.shape != xb.shape:
        raise ValueError(f"paired samples need equal lengths, got {xa.size} and {xb.size}")
    return bootstrap_ci(xb - xa, stat=stat, n_boot=n_boot, confidence=confidence, seed=seed)


def _subset_sums(d: np.ndarray) -> np.ndarray:
    """All 2^n subset sums of d (built by doubling; 8 MiB for n = 20)."""
    sums = np.zeros(1)
    for v in d:
        sums = np.concatenate([sums, sums + v])
    return sums


def sign_flip_permutation_test(diffs: Sequence[float], n_perm: int = 100000, seed: int = 0) -> float:
    """Two-sided paired permutation test of mean(diffs) = 0 by random sign flips.

    p = fraction of sign patterns s with `|mean(s·d)| >= |mean(d)|`. For n <= 20 all 2^n patterns are enumerated
    (exact; flipping a subset S gives sum = total - 2·sum_S). Otherwise `n_perm` random patterns are drawn (seeded)
    and p = (1 + hits) / (1 + n_perm), which is a valid (slightly conservative) Monte-Carlo p. All-zero diffs give
    p = 1.
    """
    d = _as_1d(diffs, "diffs")
    total = float(d.sum())
    scale = float(np.abs(d).sum())
    if scale == 0.0:
        return 1.0
    tol = 1e-9 * scale  # floating-point ties (e.g. patterns equal to the observed one) count as hits
    if d.size <= EXACT_SIGN_FLIP_MAX_N:
        sums = total - 2.0 * _subset_sums(d)
        return float(np.mean(np.abs(sums) >= abs(total) - tol))
    if n_perm < 1:
        raise ValueError(f"n_perm must be >= 1, got {n_perm}")
    rng = np.random.default_rng(seed)
    hits = 0
    chunk = max(1, min(n_perm, 2_000_000 // d.size))
    done = 0
    while done < n_perm:
        k = min(chunk, n_perm - done)
        signs = rng.integers(0, 2, size=(k, d.size)) * 2 - 1
        hits += int(np.sum(np.abs(signs @ d) >= abs(total) - tol))
        done += k
    return (1 + hits) / (1 + n_perm)


def _subset_sizes(n: int) -> np.ndarray:
    """Size of every subset, in the same order as `_subset_sums`."""
    sizes = np.zeros(1, dtype=np.int64)
    for _ in range(n):
        sizes = np.concatenate([sizes, sizes + 1])
    return sizes


def sign_flip_ci(diffs: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Confidence interval for the mean shift that is the inversion of `sign_flip_permutation_test`.

    Why: a bootstrap interval can exclude 0 while the exact test says p = 0.5 (2 seeds); this one cannot. The test of
    H0 "shift = t" flips the signs of d - t; its one-sided p is `(1 + #{non-empty S: mean(d_S) <= t}) / 2^n`, so the
    accepted shifts lie between the k-th smallest and k-th largest of the 2^n - 1 subset means (Hartigan 1969),
    with k = ceil(alpha 2^(n-1)) - 1, alpha = 1 - confidence. The interval excludes 0 exactly when the two-sided
    test gives p < alpha; its coverage is 1 - 2k/2^n >= confidence when the differences are symmetric about the
    shift. k = 0 (n <= 5 at 95%) gives (-inf, inf): no finite interval, only the exact test. For n > 20 (where the
    test is Monte Carlo) the Student-t interval is returned instead.
    """
    _check_confidence(confidence)
    d = _as_1d(diffs, "diffs")
    n = d.size
    if n > EXACT_SIGN_FLIP_MAX_N:
        _, lo, hi = mean_ci(d, confidence)
        return lo, hi
    k = max(0, math.ceil((1 - confidence) * 2 ** (n - 1)) - 1)
    if k == 0:
        return -math.inf, math.inf
    sums, sizes = _subset_sums(d)[1:], _subset_sizes(n)[1:]
    sums[np.abs(sums) <= 1e-9 * float(np.abs(d).sum())] = 0.0  # exact zeros, as the test's tie tolerance
    means = np.sort(sums / sizes)
    return float(means[k - 1]), float(means[-k])


def min_attainable_p(n: int) -> float:
    """Smallest two-sided p the exact sign-flip test can give with n pairs: 2 / 2^n (1.0 for n = 0)."""
    return 1.0 if n <= 0 else min(1.0, 2.0 / 2 ** n)


# --- equivalence: two one-sided tests (TOST) -------------------------------------------------------------------------
# Why: "p >= 0.05" never shows that two arms are alike, and "p < 0.05" does not show that they differ by an amount that
# matters. TOST tests H0 |shift| >= margin against |shift| < margin with the same exact sign-flip test as the
# difference test, shifted to each edge of the margin; equivalence holds when both one-sided tests reject.
def sign_flip_one_sided(diffs: Sequence[float], shift: float = 0.0, alternative: str = "greater",
                        n_perm: int = 100000, seed: int = 0) -> float:
    """One-sided sign-flip p of H0 "the differences are symmetric about `shift`" against a mean above it
    (`alternative="greater"`) or below it ("less"): the fraction of sign patterns s of e = d - shift with
    sum(s·e) >= sum(e) (or <=). Exact over all 2^n patterns for n <= 20 (smallest p 1/2^n), else `n_perm` seeded
    random patterns with p = (1 + hits) / (1 + n_perm)."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    e = _as_1d(diffs, "diffs") - float(shift)
    if alternative == "less":
        e = -e
    total = float(e.sum())
    tol = 1e-9 * max(float(np.abs(e).sum()), 1e-300)  # floating-point ties count as hits, as in the two-sided test
    if e.size <= EXACT_SIGN_FLIP_MAX_N:
        sums = total - 2.0 * _subset_sums(e)
        return float(np.mean(sums >= total - tol))
    if n_perm < 1:
        raise ValueError(f"n_perm must be >= 1, got {n_perm}")
    rng = np.random.default_rng(seed)
    hits, done = 0, 0
    chunk = max(1, min(n_perm, 2_000_000 // e.size))
    while done < n_perm:
        k = min(chunk, n_perm - done)
        signs = rng.integers(0, 2, size=(k, e.size)) * 2 - 1
        hits += int(np.sum(signs @ e >= total - tol))
        done += k
    return (1 + hits) / (1 + n_perm)


def tost_sign_flip(diffs: Sequence[float], margin: float, n_perm: int = 100000, seed: int = 0) -> float:
    """p of the equivalence test (two one-sided sign-flip tests) of H0 |mean shift| >= margin: the larger of the
    p's of "shift > -margin" and "shift < +margin". p < alpha shows the shift lies inside ±margin (about the same
    as the (1 - 2 alpha) interval lying inside it); the 95% interval inside the margin is the stricter rule."""
    if not margin > 0:
        raise ValueError(f"the equivalence margin must be > 0, got {margin}")
    lower = sign_flip_one_sided(diffs, -margin, "greater", n_perm, seed)
    upper = sign_flip_one_sided(diffs, margin, "less", n_perm, seed)
    return max(lower, upper)


def format_p(p: float) -> str:
    """`0.43`, `0.002`, `3.1e-05`: two significant-ish digits, never `0.000`."""
    if p is None or math.isnan(p):
        return "n/a"
    if p >= 0.1:
        return f"{p:.2f}"
    if p >= 0.001:
        return f"{p:.3f}"
    return f"{p:.1e}"


def _fmt(x: float, digits: int, sign: bool = False) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def underpowered_text(n: int, alpha: float = 0.05, n_tests: int = 1, n_label: str = "seeds") -> str | None:
    """Why no difference can ever be significant with n pairs (and Holm across n_tests comparisons), else None.

    The exact sign-flip test's smallest p is 2 / 2^n, and Holm multiplies the smallest p by n_tests.
    """
    floor = min_attainable_p(n) * max(1, n_tests)
    if floor < alpha:
        return None
    need = next(k for k in range(1, 64) if min_attainable_p(k) * max(1, n_tests) < alpha)
    held = f" ({n_tests} Holm-adjusted comparisons)" if n_tests > 1 else ""
    return (f"underpowered: with {n} {n_label}{held} the smallest attainable p is {format_p(min(1.0, floor))}, so no "
            f"difference can reach p < {alpha:g}; at least {need} {n_label} are needed")


def verdict_text(diff: float, lo: float, hi: float, p: float, n: int, *, p_adjusted: float | None = None,
                 variant: str = "variant", control: str = "control", higher_is_better: bool = True,
                 alpha: float = 0.05, confidence: float = 0.95, scale: float = 1.0, unit: str = "",
                 digits: int = 1, n_label: str = "seeds", adjustment: str = "Holm", mde: float | None = None,
                 n_tests: int = 1) -> str:
    """A plain-language verdict for `variant − control` = `diff` with interval [lo, hi] and p-value p over n pairs.

    The decision uses `p_adjusted` when given (e.g. Holm across the study's `n_tests` comparisons), else p. Values
    are shown multiplied by `scale` (e.g. 100 to show accuracies as points) with `unit` appended. A null result
    states what power says: "an effect of ±mde would be detected 80% of the time" (`mde` = minimum detectable effect
    at 80% power, `glm_lightning.power`) or "underpowered" when n is too small for the exact test to ever reach alpha.
    Examples:

    - `no significant difference at n=10 seeds (p=0.43, Holm-adjusted); an effect of ±2.1 points would be detected
      80% of the time (MDE)` (which effects the data exclude comes from the interval, not from the MDE)
    - `variant beats control by +3.1 points [95% CI 1.2, 5.0], p=0.002`
    - `variant is worse than control by -2.0 points [95% CI -3.1, -0.9], p=0.004 (Holm-adjusted)`
    - `no significant difference at n=2 seeds (p=0.50); underpowered: with 2 seeds the smallest attainable p is
      0.50, ...`
    """
    p_used = p if p_adjusted is None else p_adjusted
    adj = "" if p_adjusted is None else f", {adjustment}-adjusted"
    unit_s = f" {unit}" if unit else ""
    if n < 1 or p_used is None or math.isnan(p_used):
        return f"not testable: {n} paired {n_label}"
    if p_used >= alpha:
        text = f"no significant difference at n={n} {n_label} (p={format_p(p_used)}{adj})"
        weak = underpowered_text(n, alpha, n_tests, n_label)
        if weak is not None:
            return f"{text}; {weak}"
        if mde is not None and math.isfinite(mde) and mde > 0:
            text += f"; an effect of ±{_fmt(mde * scale, digits)}{unit_s} would be detected 80% of the time (MDE)"
        elif mde is not None and math.isinf(mde):
            text += "; underpowered: no effect size reaches 80% power at this n"
        return text
    better = (diff > 0) == higher_is_better
    amount = f"{_fmt(diff * scale, digits, sign=True)}{unit_s}"
    ci = f"[{confidence:.0%} CI {_fmt(lo * scale, digits)}, {_fmt(hi * scale, digits)}]"
    verb = "beats" if better else "is worse than"
    ptxt = f"p={format_p(p_used)}" + (f" ({adjustment}-adjusted)" if p_adjusted is not None else "")
    text = f"{variant} {verb} {control} by {amount} {ci}, {ptxt}"
    if not math.isnan(lo) and not math.isnan(hi) and lo <= 0 <= hi:
        text += " (borderline: the interval includes 0)"
    return text


# --- per-family regression tests (RegressionCallback, the RL table) --------------------------------------------------

Measurement = dict[str, dict[str, list[float]]]
"""family -> {"task_ids": [...], "greedy": [0/1 per task], "sampled": [pass fraction per task] (optional)}"""


def compare_families(baseline: Measurement, current: Measurement, *, alpha: float = 0.05, min_effect: float = 0.0,
                     confidence: float = 0.95, n_boot: int = 10000, seed: int = 0,
                     roles: dict[str, str] | None = None) -> dict[str, Any]:
    """Per-family change from `baseline` to `current` (same tasks, same order) with intervals and Holm-corrected
    exact McNemar tests; returns a JSON-ready report (see the module docstring for the decision rule)."""
    families = [f for f in baseline if f in current]
    rows: dict[str, dict[str, Any]] = {}
    pvals: list[float] = []
    for fam in families:
        before = [int(v) for v in baseline[fam]["greedy"]]
        after = [int(v) for v in current[fam]["greedy"]]
        if len(before) != len(after):
            raise ValueError(f"family {fam}: baseline has {len(before)} tasks, current {len(after)}")
        n = len(before)
        losses = sum(1 for a, b in zip(before, after) if a and not b)
        gains = sum(1 for a, b in zip(before, after) if b and not a)
        p = mcnemar_exact(losses, gains)
        pvals.append(p)
        row: dict[str, Any] = {
            "role": (roles or {}).get(fam, "evaluated"),
            "n_tasks": n,
            "baseline_greedy": sum(before) / n if n else math.nan,
            "baseline_greedy_ci": list(wilson_interval(sum(before), n, confidence)),
            "current_greedy": sum(after) / n if n else math.nan,
            "current_greedy_ci": list(wilson_interval(sum(after), n, confidence)),
            "losses": losses,
            "gains": gains,
            "p_mcnemar": p,
        }
        row["delta"] = row["current_greedy"] - row["baseline_greedy"]
        row["delta_ci"] = _paired_ci(before, after, confidence, n_boot, seed)
        sb, sa = baseline[fam].get("sampled"), current[fam].get("sampled")
        if sb and sa and len(sb) == len(sa):
            row["baseline_sampled"] = float(np.mean(sb))
            row["current_sampled"] = float(np.mean(sa))
            row["delta_sampled"] = row["current_sampled"] - row["baseline_sampled"]
            row["delta_sampled_ci"] = _paired_ci(sb, sa, confidence, n_boot, seed)
        rows[fam] = row
    adjusted = holm(pvals) if pvals else []
    flagged, improved = [], []
    for fam, p_adj in zip(families, adjusted):
        row = rows[fam]
        row["p_holm"] = p_adj
        significant = p_adj <= alpha
        row["regression"] = bool(significant and row["losses"] > row["gains"] and -row["delta"] >= min_effect)
        row["improvement"] = bool(significant and row["gains"] > row["losses"])
        row["verdict"] = ("REGRESSION" if row["regression"] else "improved" if row["improvement"]
                          else "no significant change")
        if row["regression"]:
            flagged.append(fam)
        if row["improvement"]:
            improved.append(fam)
    return {"alpha": alpha, "min_effect": min_effect, "confidence": confidence, "test": "exact McNemar on greedy "
            "task outcomes, Holm-adjusted across families", "families": rows, "flagged": flagged,
            "improved": improved}


def _paired_ci(before: Sequence[float], after: Sequence[float], confidence: float, n_boot: int,
               seed: int) -> list[float]:
    if len(before) == 0:
        return [math.nan, math.nan]
    if len(before) == 1:
        d = float(after[0]) - float(before[0])
        return [d, d]
    lo, hi = paired_bootstrap_ci(before, after, n_boot=n_boot, confidence=confidence, seed=seed)
    return [lo, hi]
