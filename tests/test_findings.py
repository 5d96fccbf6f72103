"""The findings table from synthetic study results (no training): the verdict rule on every branch, claims that
fail to parse, "not run" and stale results, results read from the runs directory and from the committed copy, and
the shipped study files' claims."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from glm_lightning.sweep import StudyError, load_study
from glm_lightning.sweep.analysis import analyse
from glm_lightning.sweep.claims import Claim, judge
from glm_lightning.sweep.findings import (EXPERIMENTS, STUDIES, main, results_payload, write_results)
from glm_lightning.sweep.runner import DONE_FILE, RunResult, plan_runs

TINY = Path(__file__).parent / "conf" / "sweep_tiny.yaml"  # blocked (control) vs interleaved
INF, NAN = math.inf, math.nan

EFFECT = Claim("interleaved beats blocked", "interleaved", effect=9.7, p=0.002, n="10", ci=(7.6, 11.7))
NULL = Claim("no difference", "interleaved", effect=-0.6, p=0.21, n="10", margin=2.0)


@pytest.mark.parametrize("claim, ours, word, why", [
    (EFFECT, (9.0, 7.0, 11.0, 0.002, 2.0), "reproduced", "same direction"),
    (EFFECT, (4.5, 2.9, 6.1, 0.002, 2.0), "reproduced", "smaller than the tutorial's"),
    (EFFECT, (-3.0, -5.0, -1.0, 0.01, 2.0), "refuted", "opposite direction"),
    (EFFECT, (0.5, -1.0, 2.0, 0.4, 1.5), "refuted", "ruled out"),
    (EFFECT, (3.0, -4.0, 10.0, 0.3, 12.0), "inconclusive", "underpowered: MDE"),
    (EFFECT, (3.0, -INF, INF, 0.5, INF), "inconclusive", "too few seeds"),
    (EFFECT, (3.0, -1.0, 10.0, 0.2, 5.0), "inconclusive", "no effect larger than ±5.0"),
    (NULL, (3.0, 1.0, 5.0, 0.01, 2.0), "refuted", "where the tutorial found none"),
    (NULL, (-1.5, -1.9, -1.1, 0.001, 0.5), "refuted", "small: the whole 95% CI lies inside ±2"),
    (NULL, (3.0, 1.0, 5.0, 0.01, 2.0), "refuted", "opposite in sign to the tutorial's (non-significant) -0.6"),
    (NULL, (0.3, -1.2, 1.5, 0.6, 1.0), "reproduced", "inside ±2"),
    (NULL, (0.3, -2.5, 3.0, 0.7, 1.8), "inconclusive", "no effect larger than ±1.8"),
    (NULL, (0.3, -4.0, 5.0, 0.7, 4.0), "inconclusive", "underpowered"),
])
def test_verdict_rule(claim, ours, word, why):
    verdict = judge(claim, *ours)
    assert verdict.word == word and why in verdict.why


def test_a_missing_result_is_not_judged():
    with pytest.raises(ValueError):
        judge(EFFECT, NAN, NAN, NAN, NAN, NAN)


def _study_with_claims(tmp_path: Path, claims: list, name: str = "sweep_tiny") -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw.update(base=str((TINY.parent / raw["base"]).resolve()), name=name, seeds=10, claims=claims,
               expected_minutes=12)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


CLAIM = {"claim": "interleaved beats blocked", "variant": "interleaved",
         "tutorial": {"effect": 9.7, "ci": [7.6, 11.7], "p": 0.00195, "n": "10 paired seeds"}}


@pytest.mark.parametrize("change, message", [
    ({"variant": "blocked"}, "non-control variants"),
    ({"variant": "nope"}, "non-control variants"),
    ({"tutorial": {"effect": 1.0, "p": 0.3, "n": "3"}}, "needs `margin`"),
    ({"tutorial": {"effect": 1.0, "p": 0.0, "n": "3"}}, "tutorial.p"),
    ({"tutorial": {"effect": "big", "p": 0.01, "n": "3"}}, "must be a number"),
    ({"metric": "val/nothing"}, "not one of the study's metrics"),
    ({"colour": "red"}, "unknown key"),
])
def test_bad_claims_fail_at_load(tmp_path, change, message):
    path = _study_with_claims(tmp_path, [{**CLAIM, **change}])
    with pytest.raises(StudyError, match=message):
        load_study(path)


def _results(study, acc: dict[str, list[float]], out: Path) -> list[RunResult]:
    results = []
    for spec in plan_runs(study, out):
        value = acc[spec.variant][study.seeds.index(spec.seed)]
        results.append(RunResult(spec, "done", {"val/completion_acc": value, "val/loss": 2 - value}, wall_s=60.0))
    return results


ACC = {"blocked": [0.50 + 0.01 * i for i in range(10)],
       "interleaved": [0.55 + 0.01 * i + 0.004 * (-1) ** i for i in range(10)]}


def _row(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("| 1 |"))


def test_table_from_committed_results_matches_the_analysis(tmp_path):
    path = _study_with_claims(tmp_path, [CLAIM])
    study = load_study(path)
    runs, data = tmp_path / "runs", tmp_path / "data"
    results = _results(study, ACC, runs)
    write_results(data / "sweep_tiny.json", results_payload(study, results, "python -m ...", 600.0, 2))
    out = main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")],
               log=lambda _m: None)
    row = _row(out.read_text())
    comp = analyse(study, results)[0].comparisons[0]
    assert comp.n == 10 and comp.p < 0.05
    assert f"{comp.mean_diff * 100:+.1f} [{comp.lo * 100:+.1f}, {comp.hi * 100:+.1f}]" in row
    assert f"MDE ±{comp.mde * 100:.1f}" in row and "n=10 seeds" in row
    assert "**reproduced**" in row and "smaller than the tutorial's" in row
    assert "10 min with 2 workers" in row  # the invocation ran all 20 runs in 600 s
    assert "+9.7 [+7.6, +11.7], p=0.002" in row


def test_no_results_read_not_run_and_stale_results_are_not_used(tmp_path):
    path = _study_with_claims(tmp_path, [CLAIM])
    runs, data = tmp_path / "runs", tmp_path / "data"
    args = ["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")]
    row = _row(main(args, log=lambda _m: None).read_text())
    assert "| not run |" in row and "expected ≈12 min" in row
    other = load_study(path).with_settings({"trainer.max_steps": 50})  # a quick run: other fingerprints
    write_results(data / "sweep_tiny.json", results_payload(other, _results(other, ACC, runs), "", None, None))
    row = _row(main(args, log=lambda _m: None).read_text())
    assert "not run (the 20 saved runs are of other settings)" in row


def test_runs_directory_is_read_and_copied_to_the_committed_data(tmp_path):
    path = _study_with_claims(tmp_path, [CLAIM])
    study = load_study(path)
    runs, data = tmp_path / "runs", tmp_path / "data"
    results = _results(study, ACC, runs)
    for r in results[:12]:  # 6 seeds of each arm finished: a partial study
        r.spec.run_dir.mkdir(parents=True)
        (r.spec.run_dir / DONE_FILE).write_text(json.dumps(
            {"fingerprint": r.spec.fingerprint, "final": r.final, "wall_s": 60.0}))
    out = main(["--studies", str(path), "--runs", str(runs), "--data", str(data), "--out", str(tmp_path / "F.md")],
               log=lambda _m: None)
    row = _row(out.read_text())
    assert "n=6 seeds" in row and "partial: 12/20 runs" in row and "(so far)" in row
    assert "≈6 min with 2 workers" in row  # 12 runs x 60 s / 2 workers
    saved = json.loads((data / "sweep_tiny.json").read_text())
    assert len(saved["runs"]) == 12
    assert {r["fingerprint"] for r in saved["runs"]} == {r.spec.fingerprint for r in results[:12]}


def test_shipped_studies_all_state_their_claims():
    for name in STUDIES:
        study = load_study(EXPERIMENTS / f"{name}.yaml")
        assert study.claims and study.expected_minutes, name
        assert len(study.seeds) >= 3, name
        for claim in study.claims:
            assert claim.variant in {v.name for v in study.variants} - {study.control}
            assert claim.is_null == (claim.margin is not None)
