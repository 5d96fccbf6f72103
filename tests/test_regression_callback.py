"""Regression callback: the per-family comparison on hand-made outcomes (McNemar + Holm + intervals), the report
files, and stop-on-regression driven through the hooks with controlled measurements."""

import json
from types import SimpleNamespace

import pytest

from callbacks.regression import RegressionCallback, compare_families, markdown_report
from glm_lightning.stats import holm, mcnemar_exact


def outcomes(greedy, sampled=None):
    return {"task_ids": [f"dev/x/{i}" for i in range(len(greedy))], "greedy": [float(g) for g in greedy],
            "sampled": list(sampled or [])}


BASE = {
    "square": outcomes([1] * 8, [0.75] * 8),
    "list_sum": outcomes([1, 1, 1, 1, 0, 0, 0, 0]),
    "reverse": outcomes([0] * 8),
    "increment": outcomes([0] * 8),
}
NOW = {
    "square": outcomes([0] * 8, [0.25] * 8),       # lost every task: 8 losses, 0 gains
    "list_sum": outcomes([1, 1, 1, 0, 0, 0, 0, 1]),  # one loss, one gain
    "reverse": outcomes([0] * 8),                  # unchanged
    "increment": outcomes([1] * 8),                # gained every task
}


def test_compare_families_flags_only_significant_regressions():
    report = compare_families(BASE, NOW, alpha=0.05, n_boot=500, roles={"increment": "rewarded"})
    fams = report["families"]
    assert report["flagged"] == ["square"] and report["improved"] == ["increment"]
    sq = fams["square"]
    assert (sq["losses"], sq["gains"]) == (8, 0)
    assert sq["p_mcnemar"] == pytest.approx(2 * 0.5 ** 8)
    raw = [mcnemar_exact(8, 0), mcnemar_exact(1, 1), mcnemar_exact(0, 0), mcnemar_exact(0, 8)]
    assert [fams[f]["p_holm"] for f in ("square", "list_sum", "reverse", "increment")] == pytest.approx(holm(raw))
    assert sq["delta"] == -1.0 and sq["delta_ci"] == [-1.0, -1.0]
    lo, hi = sq["baseline_greedy_ci"]
    assert lo < 1.0 and hi == pytest.approx(1.0)  # Wilson interval of 8/8
    assert sq["delta_sampled"] == pytest.approx(-0.5)
    assert fams["list_sum"]["verdict"] == "no significant change" and fams["list_sum"]["delta"] == 0.0
    lo, hi = fams["list_sum"]["delta_ci"]
    assert lo < 0 < hi
    assert fams["increment"]["role"] == "rewarded" and fams["square"]["role"] == "evaluated"
    # a predeclared minimum effect larger than the drop suppresses the flag
    assert compare_families(BASE, NOW, min_effect=1.01, n_boot=100)["flagged"] == []
    md = markdown_report(report)
    assert "| square |" in md and "**REGRESSION**" in md and "Significant regressions: square." in md
    with pytest.raises(ValueError, match="baseline has 8 tasks"):
        compare_families(BASE, {"square": outcomes([1] * 7)})


def test_small_families_cannot_reach_significance():
    base = {"a": outcomes([1, 1, 1]), "b": outcomes([1, 1, 1])}
    now = {"a": outcomes([0, 0, 0]), "b": outcomes([1, 1, 1])}
    report = compare_families(base, now, n_boot=100)
    assert report["families"]["a"]["p_mcnemar"] == pytest.approx(0.25) and report["flagged"] == []


class FakeLogger:
    experiment = None


def _hooks_run(tmp_path, stop):
    cb = RegressionCallback(n_boot=100, stop_on_regression=stop, output_dir=str(tmp_path))
    measurements = iter([BASE, NOW, NOW])
    cb.measure = lambda trainer, pl_module: next(measurements)
    dm = SimpleNamespace(train_families=("increment",), monitor_families=("square", "list_sum", "reverse"))
    trainer = SimpleNamespace(global_step=0, sanity_checking=False, should_stop=False, logger=None,
                              is_global_zero=True, default_root_dir=str(tmp_path), datamodule=dm)
    logged = {}
    module = SimpleNamespace(log=lambda name, value, **kw: logged.__setitem__(name, value))
    cb.on_train_start(trainer, module)
    trainer.sanity_checking = True
    cb.on_validation_epoch_end(trainer, module)  # ignored: sanity check
    assert not logged
    trainer.sanity_checking, trainer.global_step = False, 10
    with pytest.warns(UserWarning, match="significant regression at step 10: square"):
        cb.on_validation_epoch_end(trainer, module)
    trainer.global_step = 12
    cb.on_train_end(trainer, module)  # stale last comparison: measured once more, then reports written
    return cb, trainer, logged


def test_hooks_log_flag_stop_and_write_reports(tmp_path):
    cb, trainer, logged = _hooks_run(tmp_path, stop=True)
    assert trainer.should_stop and cb.stopped_at == 10
    assert logged["regression/flagged"] == 1.0 and logged["regression/square/delta"] == -1.0
    assert logged["regression/square/p_holm"] == pytest.approx(cb.history[0]["families"]["square"]["p_holm"])
    data = json.loads((tmp_path / "regression_report.json").read_text())
    assert data["baseline_step"] == 0 and data["stopped_at"] == 10
    assert [h["step"] for h in data["history"]] == [10, 12]
    assert data["final"]["flagged"] == ["square"] and data["final"]["families"]["increment"]["role"] == "rewarded"
    md = (tmp_path / "regression_report.md").read_text()
    assert md.startswith("# Regression report") and "stopped early at: 10" in md


def test_no_stop_unless_asked(tmp_path):
    _, trainer, _ = _hooks_run(tmp_path, stop=False)
    assert not trainer.should_stop


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        RegressionCallback(alpha=1.5)
    with pytest.raises(ValueError, match="min_effect"):
        RegressionCallback(min_effect=-0.1)
    with pytest.raises(ValueError, match="unknown split"):
        RegressionCallback(split="holdout")
