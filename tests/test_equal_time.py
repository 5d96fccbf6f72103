"""Equal time from the runs' own minutes (issue 47): each arm's value at the shorter run's minutes, read off its own
evaluation curve, and the ±10% step-time band; a verdict that changes inside the band is reported as such."""

import pytest

from glm_lightning.sweep.equal_time import BAND, EqualTime, paired_at_equal_time, render, value_at


def test_value_at_interpolates_between_evaluations_and_not_beyond():
    curve = [[49, 0.2], [99, 0.4], [149, 0.8]]
    assert value_at(curve, 74) == pytest.approx(0.3)
    assert value_at(curve, 149) == pytest.approx(0.8)
    assert value_at(curve, 20) is None and value_at(curve, 200) is None


def test_the_faster_arm_is_compared_with_the_control_at_the_arms_minutes():
    control = {"curves": {"t": [[49, 0.2], [99, 0.4], [149, 0.8]]}, "wall_s": 150.0}  # 1 s per step
    arm = {"curves": {"t": [[49, 0.3], [99, 0.5], [149, 0.6]]}, "wall_s": 100.0}  # 2/3 s per step: done at 100 s
    c, a, minutes = paired_at_equal_time(control, arm, "t")
    assert minutes == pytest.approx(100 / 60)
    assert a == pytest.approx(0.6) and c == pytest.approx(value_at(control["curves"]["t"], 99))
    c_slow, _, _ = paired_at_equal_time(control, arm, "t", factor=1.1)  # the arm 10% slower: the control gets longer
    assert c_slow > c


def test_a_verdict_changing_inside_the_band_is_named():
    row = [EqualTime("arm", f, 10, m, m - 1, m + 1, p, p) for f, m, p in zip(BAND, (5.0, 2.0, -0.5), (0.01, 0.2, 0.8))]
    assert "verdict flips inside the band" in render("s", [row])[-2]
    steady = [EqualTime("arm", f, 10, -9.0, -12.0, -6.0, 0.01, 0.01) for f in BAND]
    assert render("s", [steady])[-2].endswith("| stable |")


def test_too_few_overlapping_seeds_is_not_a_verdict_and_not_a_flip():
    row = [EqualTime("arm", 0.9, 10, -9.0, -12.0, -6.0, 0.01, 0.01), EqualTime("arm", 1.0, 10, -8.0, -11.0, -5.0,
                                                                               0.01, 0.01),
           EqualTime("arm", 1.1, 1, 3.0, float("nan"), float("nan"), 1.0, 1.0)]
    assert row[2].word.startswith("too few seeds overlap")
    assert render("s", [row])[-2].endswith("| stable |")


def test_a_findings_row_of_an_equal_time_twin_carries_the_band():
    from glm_lightning.sweep.equal_time import MIN_SEEDS, study_equal_time
    from glm_lightning.sweep.findings import equal_time_note

    rows = {row[0].arm: row for row in study_equal_time("ablation_mixer")}
    twin = rows["dense_attention_equal_time"]
    flips = len({r.word for r in twin if r.n >= MIN_SEEDS}) > 1
    note = equal_time_note("ablation_mixer", "dense_attention_equal_time")
    assert ("flips inside the band" in note) == flips and "equal_time.md" in note
    assert equal_time_note("ablation_mixer", "dense_attention") == ""  # equal-steps rows carry no time note
