"""`score_at` (issue 47): a study scores each run's k-th evaluation instead of its last value, refuses a variant whose
k-th evaluation falls at another number of training completions, and the RL screen's committed rows are scored at
the evaluation after 128 completions (recomputed here from its curves, not copied)."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from glm_lightning.stats import sign_flip_permutation_test
from glm_lightning.sweep.analysis import analyse
from glm_lightning.sweep.findings import EXPERIMENTS, from_saved
from glm_lightning.sweep.runner import RunResult, plan_runs
from glm_lightning.sweep.score_at import completions_at
from glm_lightning.sweep.study import StudyError, load_study

REPO = Path(__file__).resolve().parents[1]
SCREEN = EXPERIMENTS / "rl_screen_tutorial.yaml"
BASE = EXPERIMENTS / "rl_screen_tutorial_base.yaml"


def test_completions_at_counts_batches_times_prompts_times_g():
    assert completions_at(BASE, {}, 1) == 16 * 1 * 8
    assert completions_at(BASE, {"model.init_args.sampling.group_size": 4, "trainer.val_check_interval": 32}, 1) == 128
    assert completions_at(BASE, {}, 2) == 256
    # a completion budget ends the run with its final evaluation at the batch that spends it
    assert completions_at(BASE, {"trainer.val_check_interval": 100, "model.init_args.budget.completions": 128}, 1) == 128


def _screen_copy(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load(SCREEN.read_text())
    raw["base"] = str(BASE)
    raw["blocks"] = {k: {**v, "overrides": {}} for k, v in raw["blocks"].items()}
    raw.update(changes)
    path = tmp_path / "screen.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_variant_evaluated_at_other_completions_is_refused(tmp_path):
    raw = yaml.safe_load(SCREEN.read_text())
    variants = {**raw["variants"], "G4": {"model.init_args.sampling.group_size": 4}}  # evaluation 1 at 64
    with pytest.raises(StudyError, match="'G4' reaches evaluation 1 after 64 training completions, not 128"):
        load_study(_screen_copy(tmp_path, variants=variants))
    with pytest.raises(StudyError, match="score_at.evaluation"):
        load_study(_screen_copy(tmp_path, score_at={"evaluation": 0}))


def test_the_scored_value_is_the_kth_evaluation_not_the_last(tmp_path):
    study = load_study(_screen_copy(tmp_path))
    results = []
    for spec in plan_runs(study, tmp_path / "runs"):
        at_128 = 0.2 + (0.01 if spec.variant == "G4" else 0.0) + 0.001 * spec.seed
        last = at_128 + (0.05 if spec.variant == "G4" else 0.0)  # G4 went on longer and gained more
        curves = {"screen/greedy_pass": [(0, 0.15), (16, at_128), (32, last)],
                  "screen/pass@1": [(0, 0.1), (16, at_128), (32, last)]}
        results.append(RunResult(spec, "skipped", {"screen/greedy_pass": last, "screen/pass@1": last}, {}, 1.0,
                                 curves=curves))
    g4 = next(c for c in analyse(study, results)[0].comparisons if c.variant == "G4")
    assert g4.mean_diff == pytest.approx(0.01)  # not 0.06, the difference of the last evaluations


def test_the_screen_rows_are_scored_after_128_completions():
    study = load_study(SCREEN)
    data = REPO / "docs" / "results" / "data" / "rl_screen_tutorial.json"
    found = from_saved(study, data, REPO / "runs" / "sweeps")
    assert found.finished == 144
    runs = json.loads(data.read_text())["runs"]
    point1 = {(r["variant"], r["seed"]): r["curves"]["screen/greedy_pass"][1][1] for r in runs}
    analysis = analyse(study, found.results)[0]
    for comp in analysis.comparisons:
        d = np.array([point1[(comp.variant, s)] - point1[("baseline", s)] for s in comp.seeds])
        assert comp.mean_diff == pytest.approx(float(d.mean()))
        assert comp.p == pytest.approx(sign_flip_permutation_test(d))
    later = sum(len(r["curves"]["screen/greedy_pass"]) > 2 for r in runs)
    assert later > 0  # some runs evaluated again after 128 completions: their last value is not what is scored
