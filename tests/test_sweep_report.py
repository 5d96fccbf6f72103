"""REPORT.md statistics from synthetic finished runs (no training): the MDE or "underpowered" in every report, no
interval without a test behind it at small n, rate intervals clipped to [0, 100], and every median named."""

import math
from pathlib import Path

import numpy as np
import pytest

from glm_lightning.sweep import load_study
from glm_lightning.sweep.analysis import analyse, clip, curve_band, metric_bounds
from glm_lightning.sweep.report import plot_curves, plot_paired, write_report
from glm_lightning.sweep.runner import RunResult, plan_runs
from glm_lightning.sweep.study import Metric

STUDY = Path(__file__).parent / "conf" / "sweep_tiny.yaml"  # blocked (control) vs interleaved; acc and loss


def _report(tmp_path: Path, seeds: int, acc: dict[str, list[float]]) -> tuple[str, list]:
    study = load_study(STUDY, seeds=seeds)
    results = []
    for spec in plan_runs(study, tmp_path):
        value = acc[spec.variant][study.seeds.index(spec.seed)]
        results.append(RunResult(spec, "done", {"val/completion_acc": value, "val/loss": 2.0 - value},
                                 wall_s=10.0 + 3 * spec.seed))
    analyses = analyse(study, results)
    path = write_report(study, analyses, results, [], tmp_path, "python -m glm_lightning sweep ...", 10000)
    return path.read_text(), analyses


def _row(report: str, start: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(start))


def test_two_seeds_that_agree_get_no_interval_and_are_called_underpowered(tmp_path):
    report, analyses = _report(tmp_path, 2, {"blocked": [0.50, 0.52], "interleaved": [0.60, 0.63]})
    comp = analyses[0].comparisons[0]
    assert comp.p == 0.5 and math.isinf(comp.lo) and math.isinf(comp.hi) and math.isinf(comp.mde)
    row = _row(report, "| interleaved | 2 |")
    assert "none (exact test only)" in row and "none: underpowered" in row
    assert "underpowered: with 2 seeds the smallest attainable p is 0.50" in row
    assert "- interleaved vs blocked: underpowered: with 2 seeds" in report  # the power lines at the top
    assert "[95% CI" not in report  # no interval anywhere claims what the test cannot


def test_null_result_states_the_mde(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.uniform(0.4, 0.6, size=10)
    noise = np.array([0.01, -0.02, 0.015, -0.01, 0.005, -0.015, 0.02, -0.005, 0.0, 0.01])
    report, analyses = _report(tmp_path, 10, {"blocked": list(base), "interleaved": list(base + noise)})
    comp = analyses[0].comparisons[0]
    assert comp.p > 0.05 and comp.lo < 0 < comp.hi
    assert comp.mde == pytest.approx(0.996 * np.std(noise, ddof=1), rel=1e-3)  # 10 seeds: 0.996 SD
    mde_points = f"{comp.mde * 100:.1f}"
    row = _row(report, "| interleaved | 10 |")
    assert f"an effect of ±{mde_points} points would be detected 80% of the time (MDE)" in row and f"| ±{mde_points} |" in row
    assert f"minimum detectable effect at 80% power is ±{mde_points} points" in report


def test_significant_result_interval_matches_the_test_and_rate_bands_are_clipped(tmp_path):
    blocked = [0.90, 0.95, 0.99, 0.93, 0.97, 0.91, 0.96, 0.94, 0.98, 0.92]
    interleaved = [1.0, 1.0, 1.0, 0.97, 1.0, 0.99, 1.0, 0.99, 1.0, 1.0]
    report, analyses = _report(tmp_path, 10, {"blocked": blocked, "interleaved": interleaved})
    acc = analyses[0]
    comp = acc.comparisons[0]
    assert comp.p == pytest.approx(2 / 1024) and 0 < comp.lo <= comp.mean_diff <= comp.hi
    assert acc.summaries["interleaved"].hi == 1.0  # the raw t-interval passes 100%
    row = _row(report, "| interleaved | 10 |")
    assert "100.0]" in row and "interleaved beats blocked by" in row
    assert "95% CI (t, clipped to [0, 100])" in report
    loss = analyses[1]
    assert metric_bounds(loss.metric) is None and "## Secondary metric: `val/loss`" in report


def test_every_median_is_named(tmp_path):
    report, _ = _report(tmp_path, 2, {"blocked": [0.5, 0.4], "interleaved": [0.55, 0.45]})
    medians = [line for line in report.replace(str(tmp_path), "OUT").splitlines() if "median" in line]
    assert medians
    for line in medians:
        assert "median across the" in line or "median of these paired differences" in line, line
    # the median of the 4 wall times (10, 10, 13, 13) is 11.5, not the upper middle element 13
    assert "wall time per run: median across the 4 finished runs 12 s" in report


def test_metric_bounds_and_clip():
    acc = Metric("val/completion_acc", scale=100, unit="points", bounds=(0.0, 1.0))
    assert metric_bounds(acc, [0.2, 0.9]) == (0.0, 1.0)
    assert metric_bounds(acc, [0.2, 1.5]) is None  # a value outside the declared range: do not clip
    assert metric_bounds(Metric("val/pass@1/rewarded"), [0.5]) is None  # undeclared: no guessing from the name
    assert metric_bounds(Metric("val/loss", higher_is_better=False), [0.5]) is None
    assert clip(1.07, (0.0, 1.0)) == 1.0 and clip(-0.1, (0.0, 1.0)) == 0.0 and clip(0.3, None) == 0.3
    assert math.isnan(clip(math.nan, (0.0, 1.0)))


def test_curve_band_is_clipped():
    per_seed = {0: [(1, 0.98), (2, 1.0)], 1: [(1, 0.90), (2, 0.96)], 2: [(1, 1.0), (2, 1.0)]}
    steps, mean, lo, hi = curve_band(per_seed)
    assert steps == [1, 2] and max(hi) > 1.0  # the t band alone passes 100%
    _, _, lo_c, hi_c = curve_band(per_seed, bounds=(0.0, 1.0))
    assert max(hi_c) == 1.0 and lo_c == [max(v, 0.0) for v in lo]


def test_charts_render_from_synthetic_results(tmp_path):
    study = load_study(STUDY, seeds=3)
    report_results = []
    for spec in plan_runs(study, tmp_path):
        report_results.append(RunResult(spec, "done", {"val/completion_acc": 0.9 + 0.03 * spec.seed, "val/loss": 1.0}))
    analyses = analyse(study, report_results)
    curves = {v.name: {"val/completion_acc": {s: [(1, 0.95), (2, 0.99 + 0.005 * s)] for s in study.seeds}}
              for v in study.variants}
    png = plot_curves(study, curves, ["val/completion_acc"], tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_paired(study, analyses[0], tmp_path / "paired.png").stat().st_size > 1000


def test_mde_beyond_the_metric_range_reads_underpowered(tmp_path):
    # 6 seeds with wildly different differences: the MDE (1.79 SD) exceeds 100 points
    report, analyses = _report(tmp_path, 6, {"blocked": [0.0, 1.0, 0.0, 1.0, 0.5, 0.0],
                                             "interleaved": [1.0, 0.0, 1.0, 0.0, 0.5, 0.2]})
    comp = analyses[0].comparisons[0]
    assert math.isinf(comp.mde) and comp.p > 0.05
    row = _row(report, "| interleaved | 6 |")
    assert "none: underpowered" in row and "no effect size reaches 80% power" in row
    assert "no effect within the metric's range reaches 80% power" in report


def test_a_quick_sweeps_report_says_its_runs_are_not_the_study_as_shipped():
    from glm_lightning.sweep.report import quick_mode_note

    assert quick_mode_note("python -m glm_lightning sweep --config configs/experiments/rl_reward.yaml --seeds 2") == []
    note = " ".join(quick_mode_note("python -m glm_lightning sweep --config c.yaml --seeds 2 --set "
                                    "trainer.limit_train_batches=1 --set 'data.init_args.eval_per_family=2'"))
    assert "Not the study as shipped" in note
    assert "`trainer.limit_train_batches=1`" in note and "`data.init_args.eval_per_family=2`" in note
