"""Aggregating a study: per-variant mean and t-interval across seeds, and paired comparisons against the control.

For every metric and every non-control variant, the comparison uses only the seeds where both arms finished:
per-seed differences d = variant - control, their mean, the exact sign-flip permutation p (all 2^n patterns for
n <= 20), the interval that inverts that test (so the interval excludes 0 exactly when p < alpha; none with <= 5
seeds), Holm's adjustment across the study's comparisons of that metric (the primary metric's family is the
confirmatory one), and the minimum detectable effect at 80% power for that n and the observed SD of d
(`glm_lightning.power`). Verdicts are plain sentences (`glm_lightning.stats`). Bounded metrics (declared `bounds`, e.g. accuracies, pass rates:
every value in [0, 1]) have their per-variant intervals and curve bands clipped to [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glm_lightning.power import POWER, sign_flip_mde
from glm_lightning.stats import holm, mean_ci, min_attainable_p, sign_flip_ci, sign_flip_permutation_test, verdict_text
from glm_lightning.sweep.events import read_scalars
from glm_lightning.sweep.runner import RunResult
from glm_lightning.sweep.score_at import point
from glm_lightning.sweep.study import Metric, Study, StudyError


@dataclass
class VariantSummary:
    name: str
    values: dict[int, float]
    mean: float
    lo: float
    hi: float

    @property
    def n(self) -> int:
        return len(self.values)


@dataclass
class Comparison:
    variant: str
    control: str
    seeds: list[int]
    diffs: list[float]
    mean_diff: float
    lo: float
    hi: float
    p: float
    p_holm: float
    wins: int
    losses: int
    verdict: str
    sd_diff: float = math.nan  # SD of the per-seed differences (ddof=1)
    mde: float = math.nan  # minimum detectable |mean difference| at 80% power (inf: the test can never reject)
    alpha_mde: float = 0.05  # the alpha the MDE is for: alpha / (number of Holm-adjusted comparisons)

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def median_diff(self) -> float:
        """Median of the per-seed paired differences (variant - control), not a difference of medians."""
        return float(np.median(self.diffs)) if self.diffs else math.nan


@dataclass
class MetricAnalysis:
    metric: Metric
    summaries: dict[str, VariantSummary]
    comparisons: list[Comparison]


def scored_value(study: Study, res: RunResult, tag: str) -> float | None:
    """The value of `tag` a study scores for one run: its last logged value, or with `score_at` its evaluation k
    (from the curves it carries, else its folder's events; None when it has fewer evaluations)."""
    if study.score_at is None:
        return res.final.get(tag)
    curve = res.curves.get(tag) if res.curves else None
    if curve is None and res.spec.run_dir.is_dir():
        curve = read_scalars(res.spec.run_dir).get(tag)
    return point(curve, study.score_at.evaluation)


def per_seed_values(study: Study, results: Sequence[RunResult], tag: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {v.name: {} for v in study.variants}
    for res in results:
        value = scored_value(study, res, tag) if res.ok else None
        if value is not None and math.isfinite(value):
            out[res.spec.variant][res.spec.seed] = value
    return out


def metric_bounds(metric: Metric, observed: Sequence[float] = ()) -> tuple[float, float] | None:
    """The metric's declared range (`bounds` in the study file, e.g. [0, 1] for rates), so its intervals can be
    clipped to what the metric can take; None when undeclared, or when an observed value lies outside it."""
    if metric.bounds is None or any(not metric.bounds[0] <= v <= metric.bounds[1] for v in observed):
        return None
    return metric.bounds


def clip(value: float, bounds: tuple[float, float] | None) -> float:
    """value limited to bounds (NaN and None bounds pass through)."""
    if bounds is None or math.isnan(value):
        return value
    return min(max(value, bounds[0]), bounds[1])


def _summary(name: str, values: dict[int, float], confidence: float,
             bounds: tuple[float, float] | None = None) -> VariantSummary:
    if not values:
        return VariantSummary(name, {}, math.nan, math.nan, math.nan)
    m, lo, hi = mean_ci(list(values.values()), confidence)
    return VariantSummary(name, dict(sorted(values.items())), m, clip(lo, bounds), clip(hi, bounds))


def _mde(d: np.ndarray, alpha: float) -> tuple[float, float]:
    """(SD of d, MDE at 80% power in the metric's units): inf when n is too small for the exact test to ever give
    p < alpha, NaN when the SD is undefined (1 seed) or 0."""
    sd = float(d.std(ddof=1)) if d.size >= 2 else math.nan
    if min_attainable_p(d.size) >= alpha:
        return sd, math.inf
    return sd, (sign_flip_mde(d.size, sd, alpha, POWER) if sd > 0 else math.nan)


def analyse_metric(study: Study, metric: Metric, results: Sequence[RunResult], n_boot: int = 10000,
                   n_perm: int = 100000, confidence: float = 0.95, alpha: float = 0.05) -> MetricAnalysis:
    """Per-variant summaries and paired comparisons for one metric. `n_boot` is accepted for callers that still pass
    it; the comparison interval is now the exact sign-flip inversion, which needs no resampling."""
    del n_boot
    values = per_seed_values(study, results, metric.tag)
    bounds = metric_bounds(metric, [v for vals in values.values() for v in vals.values()])
    summaries = {name: _summary(name, vals, confidence, bounds) for name, vals in values.items()}
    control = values[study.control]
    raw: list[tuple[str, list[int], np.ndarray, float, float, float, float]] = []
    for variant in study.variants:
        if variant.name == study.control:
            continue
        seeds = sorted(set(control) & set(values[variant.name]))
        d = np.array([values[variant.name][s] - control[s] for s in seeds])
        if len(seeds) == 0:
            raw.append((variant.name, seeds, d, math.nan, math.nan, math.nan, math.nan))
            continue
        lo, hi = sign_flip_ci(d, confidence)
        p = sign_flip_permutation_test(d, n_perm=n_perm)
        raw.append((variant.name, seeds, d, float(d.mean()), lo, hi, p))
    adjusted = holm([r[6] for r in raw]) if raw else []
    n_tests = sum(1 for r in raw if not math.isnan(r[6]))
    alpha_mde = alpha / max(1, n_tests)
    comparisons = []
    for (name, seeds, d, mean_d, lo, hi, p), p_adj in zip(raw, adjusted):
        sign = 1 if metric.higher_is_better else -1
        wins = int(np.sum(sign * d > 0))
        losses = int(np.sum(sign * d < 0))
        sd, mde = _mde(d, alpha_mde) if len(seeds) else (math.nan, math.nan)
        if bounds is not None and mde >= bounds[1] - bounds[0]:
            mde = math.inf  # more than the metric's whole range: no possible effect reaches 80% power
        verdict = verdict_text(mean_d, lo, hi, p, n=len(seeds), p_adjusted=p_adj if len(raw) > 1 else None,
                               variant=name, control=study.control, higher_is_better=metric.higher_is_better,
                               alpha=alpha, confidence=confidence, scale=metric.scale, unit=metric.unit,
                               digits=1 if metric.scale >= 10 else 3, mde=mde, n_tests=max(1, n_tests))
        comparisons.append(Comparison(name, study.control, seeds, d.tolist(), mean_d, lo, hi, p, p_adj, wins,
                                      losses, verdict, sd, mde, alpha_mde))
    return MetricAnalysis(metric, summaries, comparisons)


def run_cpu(res: RunResult) -> str | None:
    """The CPU key a run recorded in its fingerprint parts (None for runs made before runs recorded it)."""
    env = (res.spec.parts or {}).get("environment") or {}
    return env.get("cpu") or None


def check_one_cpu(study: Study, results: Sequence[RunResult]) -> None:
    """Refuse to pair runs made on different CPUs (issue 47): a seed fixes a result only on one CPU kind, and the
    equal-time verdicts flipped between two CPUs. Runs that did not record their CPU are not checked."""
    by_seed: dict[int, dict[str, str]] = {}
    for res in results:
        cpu = run_cpu(res) if res.ok else None
        if cpu:
            by_seed.setdefault(res.spec.seed, {})[res.spec.variant] = cpu
    for seed, cpus in sorted(by_seed.items()):
        if len(set(cpus.values())) > 1:
            where = "; ".join(f"{v}: {c}" for v, c in sorted(cpus.items()))
            raise StudyError(f"{study.name}: seed {seed}'s runs were made on different CPUs ({where}); a study pairs "
                             "runs of one CPU only: rerun them on one machine kind")


def study_cpus(results: Sequence[RunResult]) -> list[str]:
    """The CPU keys the study's finished runs recorded (empty when none did)."""
    return sorted({c for c in (run_cpu(r) for r in results if r.ok) if c})


def analyse(study: Study, results: Sequence[RunResult], **kwargs: float) -> list[MetricAnalysis]:
    """One MetricAnalysis per study metric (the first is the primary one), after `check_one_cpu`."""
    check_one_cpu(study, results)
    return [analyse_metric(study, m, results, **kwargs) for m in study.metrics]


Curves = dict[str, dict[str, dict[int, list[tuple[int, float]]]]]  # variant -> tag -> seed -> [(step, value)]


def load_curves(study: Study, results: Sequence[RunResult], tags: Sequence[str]) -> Curves:
    """Learning curves of `tags` for every finished run, read from its TensorBoard events."""
    curves: Curves = {v.name: {t: {} for t in tags} for v in study.variants}
    for res in results:
        if not res.ok:
            continue
        scalars = read_scalars(res.spec.run_dir)
        for tag in tags:
            if scalars.get(tag):
                curves[res.spec.variant][tag][res.spec.seed] = scalars[tag]
    return curves


def curve_band(per_seed: dict[int, list[tuple[int, float]]], confidence: float = 0.95,
               bounds: tuple[float, float] | None = None) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps logged by every seed, with the mean and t-interval across seeds at each step (no band for 1 seed),
    the band clipped to `bounds` (e.g. (0, 1) for an accuracy: a t-interval near 100% can pass it)."""
    if not per_seed:
        return [], [], [], []
    common = set.intersection(*(set(s for s, _ in pts) for pts in per_seed.values()))
    steps = sorted(common)
    lookup = [dict(pts) for pts in per_seed.values()]
    means, los, his = [], [], []
    for step in steps:
        m, lo, hi = mean_ci([d[step] for d in lookup], confidence)
        means.append(m)
        los.append(m if math.isnan(lo) else clip(lo, bounds))
        his.append(m if math.isnan(hi) else clip(hi, bounds))
    return steps, means, los, his
