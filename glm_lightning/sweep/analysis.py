"""Aggregating a study: per-variant mean and t-interval across seeds, and paired comparisons against the control.

For every metric and every non-control variant, the comparison uses only the seeds where both arms finished:
per-seed differences d = variant - control, their mean, a paired percentile bootstrap interval, the exact sign-flip
permutation p (all 2^n patterns for n <= 20), and Holm's adjustment across the study's comparisons of that metric
(the primary metric's family is the confirmatory one). Verdicts are plain sentences (`glm_lightning.stats`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glm_lightning.stats import holm, mean_ci, paired_bootstrap_ci, sign_flip_permutation_test, verdict_text
from glm_lightning.sweep.events import read_scalars
from glm_lightning.sweep.runner import RunResult
from glm_lightning.sweep.study import Metric, Study


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

    @property
    def n(self) -> int:
        return len(self.seeds)


@dataclass
class MetricAnalysis:
    metric: Metric
    summaries: dict[str, VariantSummary]
    comparisons: list[Comparison]


def per_seed_values(study: Study, results: Sequence[RunResult], tag: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {v.name: {} for v in study.variants}
    for res in results:
        if res.ok and tag in res.final and math.isfinite(res.final[tag]):
            out[res.spec.variant][res.spec.seed] = res.final[tag]
    return out


def _summary(name: str, values: dict[int, float], confidence: float) -> VariantSummary:
    if not values:
        return VariantSummary(name, {}, math.nan, math.nan, math.nan)
    m, lo, hi = mean_ci(list(values.values()), confidence)
    return VariantSummary(name, dict(sorted(values.items())), m, lo, hi)


def analyse_metric(study: Study, metric: Metric, results: Sequence[RunResult], n_boot: int = 10000,
                   n_perm: int = 100000, confidence: float = 0.95, alpha: float = 0.05) -> MetricAnalysis:
    values = per_seed_values(study, results, metric.tag)
    summaries = {name: _summary(name, vals, confidence) for name, vals in values.items()}
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
        if len(seeds) >= 2:
            lo, hi = paired_bootstrap_ci([control[s] for s in seeds], [values[variant.name][s] for s in seeds],
                                         n_boot=n_boot, confidence=confidence)
        else:
            lo = hi = math.nan
        p = sign_flip_permutation_test(d, n_perm=n_perm)
        raw.append((variant.name, seeds, d, float(d.mean()), lo, hi, p))
    adjusted = holm([r[6] for r in raw]) if raw else []
    comparisons = []
    for (name, seeds, d, mean_d, lo, hi, p), p_adj in zip(raw, adjusted):
        sign = 1 if metric.higher_is_better else -1
        wins = int(np.sum(sign * d > 0))
        losses = int(np.sum(sign * d < 0))
        verdict = verdict_text(mean_d, lo, hi, p, n=len(seeds), p_adjusted=p_adj if len(raw) > 1 else None,
                               variant=name, control=study.control, higher_is_better=metric.higher_is_better,
                               alpha=alpha, confidence=confidence, scale=metric.scale, unit=metric.unit,
                               digits=1 if metric.scale >= 10 else 3)
        comparisons.append(Comparison(name, study.control, seeds, d.tolist(), mean_d, lo, hi, p, p_adj, wins,
                                      losses, verdict))
    return MetricAnalysis(metric, summaries, comparisons)


def analyse(study: Study, results: Sequence[RunResult], **kwargs: float) -> list[MetricAnalysis]:
    """One MetricAnalysis per study metric (the first is the primary one)."""
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


def curve_band(per_seed: dict[int, list[tuple[int, float]]], confidence: float = 0.95
               ) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps logged by every seed, with the mean and t-interval across seeds at each step (no band for 1 seed)."""
    if not per_seed:
        return [], [], [], []
    common = set.intersection(*(set(s for s, _ in pts) for pts in per_seed.values()))
    steps = sorted(common)
    lookup = [dict(pts) for pts in per_seed.values()]
    means, los, his = [], [], []
    for step in steps:
        m, lo, hi = mean_ci([d[step] for d in lookup], confidence)
        means.append(m)
        los.append(m if math.isnan(lo) else lo)
        his.append(m if math.isnan(hi) else hi)
    return steps, means, los, his
