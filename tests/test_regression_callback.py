"""Regression callback: the per-family comparison on hand-made outcomes (McNemar + Holm + intervals), the report
files, and stop-on-regression driven through the hooks with controlled measurements."""

import json
from types import SimpleNamespace

import pytest

from callbacks.regression import RegressionCallback, markdown_report
from glm_lightning.stats import compare_families, holm, mcnemar_exact


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


def test_summary_counts_and_rates_per_role():
    from callbacks.regression import summary_counts, summary_rates

    meas = {"increment": outcomes([1, 0, 0, 0], [1.0, 0.125, 0.0, 0.0]),   # 8 + 1 exact samples, 2 tasks any-pass
            "square": outcomes([1, 1], [0.5, 0.0]),                          # 4 exact samples, 1 task any-pass
            "other": outcomes([0], [0.25])}                                  # no role: counted in "all" only
    counts = summary_counts(meas, {"increment": "rewarded", "square": "monitor"}, n_samples=8)
    assert counts["rewarded"] == {"tasks": 4, "greedy_pass": 1, "samples": 32, "sampled_exact": 9, "pass@8": 2}
    assert counts["monitor"] == {"tasks": 2, "greedy_pass": 2, "samples": 16, "sampled_exact": 4, "pass@8": 1}
    assert counts["all"] == {"tasks": 7, "greedy_pass": 3, "samples": 56, "sampled_exact": 15, "pass@8": 4}
    rates = summary_rates(counts, "regression/after")
    assert rates["regression/after/rewarded/sampled_exact"] == pytest.approx(9 / 32)
    assert rates["regression/after/all/pass@8"] == pytest.approx(4 / 7)
    assert rates["regression/after/monitor/greedy_pass"] == 1.0
    # greedy only: no sampled measures
    assert set(summary_counts({"a": outcomes([1, 0])}, {}, 0)["all"]) == {"tasks", "greedy_pass"}


class ListLogger:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))


def test_compare_only_at_the_end_logs_before_and_after(tmp_path):
    """every_n_evals = 0: no measurement at validations, one at the end; the summary rates are logged before and
    after and the final per-task measurement lands in regression_report.json."""
    cb = RegressionCallback(n_boot=100, every_n_evals=0, output_dir=str(tmp_path))
    calls = []

    def measure(trainer, pl_module):
        calls.append(trainer.global_step)
        return BASE if len(calls) == 1 else NOW
    cb.measure = measure
    dm = SimpleNamespace(train_families=("increment",), monitor_families=("square", "list_sum", "reverse"))
    logger = ListLogger()
    trainer = SimpleNamespace(global_step=0, sanity_checking=False, should_stop=False, logger=logger,
                              is_global_zero=True, default_root_dir=str(tmp_path), datamodule=dm)
    module = SimpleNamespace(log=lambda *a, **kw: None)
    cb.on_train_start(trainer, module)
    trainer.global_step = 5
    cb.on_validation_epoch_end(trainer, module)
    trainer.global_step = 9
    cb.on_validation_epoch_end(trainer, module)
    assert calls == [0]  # validations measure nothing
    cb.on_train_end(trainer, module)
    assert calls == [0, 9]
    logged = {k: v for _, m in logger.calls for k, v in m.items()}
    assert logged["regression/before/rewarded/greedy_pass"] == 0.0
    assert logged["regression/after/rewarded/greedy_pass"] == 1.0
    assert logged["regression/before/monitor/greedy_pass"] == pytest.approx(12 / 24)
    assert logged["regression/after/monitor/greedy_pass"] == pytest.approx(4 / 24)
    data = json.loads((tmp_path / "regression_report.json").read_text())
    assert data["final_measurement"] == NOW and data["n_samples"] == 0 and data["final"]["step"] == 9
    with pytest.raises(ValueError, match="evaluate_at_end"):
        RegressionCallback(every_n_evals=0, evaluate_at_end=False)


def _cache_run(tmp_path, module, families=("increment", "square"), datamodule=None):
    """on_train_start with a counted fake measurement and the baseline cache in tmp_path/cache."""
    cb = RegressionCallback(n_boot=100, families=list(families), split="confirm", per_family=2,
                            baseline_cache=str(tmp_path / "cache"), output_dir=str(tmp_path))
    calls = []

    def measure(trainer, pl_module):
        calls.append(1)
        return {f: outcomes([len(calls) % 2] * 2) for f in families}
    cb.measure = measure
    strategy = SimpleNamespace(broadcast=lambda obj, src=0: obj)
    trainer = SimpleNamespace(global_step=0, logger=None, is_global_zero=True, default_root_dir=str(tmp_path),
                              datamodule=datamodule, strategy=strategy)
    cb.on_train_start(trainer, module)
    return cb, calls


def test_baseline_cache_measures_shared_starting_weights_once(tmp_path):
    """Seeds of a sweep start from one checkpoint: the second run reuses the first one's baseline; different weights,
    settings or tasks measure again."""
    import torch

    torch.manual_seed(0)
    module = SimpleNamespace(model=torch.nn.Linear(4, 3), log=lambda *a, **kw: None)
    first, calls1 = _cache_run(tmp_path, module)
    second, calls2 = _cache_run(tmp_path, module)
    assert calls1 == [1] and calls2 == [] and second.baseline == first.baseline
    assert second.baseline_cached_at and first.baseline_cached_at is None
    with torch.no_grad():
        module.model.weight[0, 0] += 1e-3          # other weights: measured again
    _, calls3 = _cache_run(tmp_path, module)
    assert calls3 == [1]
    _, calls4 = _cache_run(tmp_path, module, families=("increment", "even"))  # other tasks: measured again
    assert calls4 == [1]
    from glm_lightning.tasks.task import make_tasks  # the same task ids drawn with another data seed: other tasks
    other_seed = SimpleNamespace(eval_tasks=lambda split, n, fams: make_tasks(split, n, fams, seed=1))
    _, calls5 = _cache_run(tmp_path, module, datamodule=other_seed)
    assert calls5 == [1]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 4


def test_a_corrupt_cache_entry_is_measured_again(tmp_path):
    import torch

    module = SimpleNamespace(model=torch.nn.Linear(4, 3), log=lambda *a, **kw: None)
    _cache_run(tmp_path, module)
    (entry,) = (tmp_path / "cache").glob("*.json")
    entry.write_text("{not json")
    _, calls = _cache_run(tmp_path, module)
    assert calls == [1] and json.loads(entry.read_text())["payload"]
